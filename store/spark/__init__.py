"""PySpark data source `lmqtt` over the lmqtt store, read and written through the SDK (docs/spark.md).

    from lmqtt.store.spark import LmqttDataSource
    spark.dataSource.register(LmqttDataSource)
    df = spark.read.format("lmqtt").option("store", "127.0.0.1:10911").option("filter", "sensors/#").load()

This package imports pyspark; the rest of `lmqtt.store` never imports it.
"""
from .source import SCHEMA, LmqttDataSource, write_rows
from .views import delivery_audit, state_as_of

__all__ = ["LmqttDataSource", "SCHEMA", "state_as_of", "delivery_audit", "write_rows"]
