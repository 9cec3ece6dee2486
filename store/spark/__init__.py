"""PySpark data source `lmqtt` over the lmqtt store, read and written through the SDK (docs/spark.md).

    from lmqtt.store.spark import LmqttDataSource
    spark.dataSource.register(LmqttDataSource)
    df = spark.read.format("lmqtt").option("store", "127.0.0.1:10911").option("filter", "sensors/#").load()

    from lmqtt.store.spark import read_history      # cold Parquet in the tier + the hot tail, once each
    df = read_history(spark, store="127.0.0.1:10911", tier="file:///mnt/cold/n1", filter="sensors/#")

The names are imported on first use, so that `lmqtt.store.spark.columns` (the `lmqtt` schema's
Arrow columns, which the tier's Parquet writer in the store node uses too) loads pyarrow, not
pyspark; the rest of `lmqtt.store` never imports pyspark.
"""
from __future__ import annotations

import importlib

_WHERE = {"LmqttDataSource": ".source", "SCHEMA": ".source", "write_rows": ".sink",
          "state_as_of": ".views", "delivery_audit": ".views", "read_history": ".cold"}

__all__ = ["LmqttDataSource", "SCHEMA", "state_as_of", "delivery_audit", "write_rows", "read_history"]


def __getattr__(name: str):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value
