"""One local SparkSession for the whole test session, one real `lmqtt serve` per module."""
import os

import pytest

pyspark = pytest.importorskip("pyspark")


@pytest.fixture(scope="session")
def spark():
    from pyspark.sql import SparkSession

    from lmqtt.store.spark import LmqttDataSource
    os.environ.setdefault("PYSPARK_PYTHON", __import__("sys").executable)
    s = (SparkSession.builder.master("local[2]").appName("lmqtt-tests")
         .config("spark.ui.enabled", "false")
         .config("spark.sql.shuffle.partitions", "2")
         .config("spark.default.parallelism", "2")
         .config("spark.sql.session.timeZone", "UTC")
         .config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.driver.host", "127.0.0.1")
         .getOrCreate())
    s.sparkContext.setLogLevel("ERROR")
    s.dataSource.register(LmqttDataSource)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.support import LmqttServer
    srv = LmqttServer(str(tmp_path_factory.mktemp("lmqtt-spark"))).start()
    yield srv
    srv.stop()
