"""Spark's batch source (`spark.read.format("lmqtt")`) over a store whose history is in the tier:
rows of offloaded segments come back byte-identical, by filter and by first-level topic."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("pyspark")

from tests.support import LmqttStore  # noqa: E402
from tests.tier.test_tier_node import SEG_MB, _offloaded, _produce  # noqa: E402


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    from lmqtt.store.spark import LmqttDataSource
    os.environ.setdefault("PYSPARK_PYTHON", __import__("sys").executable)
    s = (SparkSession.builder.master("local[2]").appName("lmqtt-tier-tests")
         .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
         .config("spark.default.parallelism", "2").config("spark.sql.session.timeZone", "UTC")
         .config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.host", "127.0.0.1")
         .getOrCreate())
    s.sparkContext.setLogLevel("ERROR")
    s.dataSource.register(LmqttDataSource)
    yield s
    s.stop()


def test_spark_reads_offloaded_history_byte_identical(spark, tmp_path):
    (tmp_path / "data").mkdir()
    store = LmqttStore(str(tmp_path / "data"), ("--segment-mb", str(SEG_MB), "--tier", f"file://{tmp_path / 'tier'}",
                                                "--local-retention", "0"))
    store.start()
    try:
        sent = _produce(store, 2000)
        s = _offloaded(store, 3)
        for opts in ({"filter": "dev/+/t"}, {"topic": "dev"}):
            r = spark.read.format("lmqtt").option("store", store.address)
            for k, v in opts.items():
                r = r.option(k, v)
            rows = sorted(r.load().select("topic", "payload", "offset").collect(), key=lambda x: x.offset)
            assert [(x.topic, bytes(x.payload)) for x in rows] == sent, opts
            assert rows[0].offset < s["local_min_offset"]
    finally:
        store.stop()
