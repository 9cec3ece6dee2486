"""`lmqtt bench spark`'s batch cases on the test session's SparkSession, with a few thousand rows:
the lmqtt and python-source cases read back exactly the rows written (the bench raises otherwise)
and report the fields BENCHMARKS.md quotes; python-source reads through its own no-I/O data source
with the lmqtt reader's schema and partitions. (Parquet and JSON are Spark's own readers.)"""
from lmqtt.loadtest import spark_bench, spark_bench_cold, spark_bench_support
from lmqtt.loadtest.sdk_bench import LmqttProc


def test_batch_cases_read_every_row_and_report_their_fields(spark, tmp_path):
    srv = LmqttProc("serve")
    try:
        spark_bench_support.load(srv.address, 3000, 100)
        rows = spark_bench.bench_read(spark, srv, 3000, 100, str(tmp_path),
                                      ["lmqtt", "python-source"], per_partition=1500, repeat=1)
    finally:
        srv.stop()
    by = {r["case"]: r for r in rows}
    assert set(by) == {"lmqtt", "python-source"}
    for r in rows:
        assert r["rows"] == 3000 and r["rows_per_s"] > 0 and r["seconds"] > 0, r
    assert by["lmqtt"]["partitions"] == 2 and by["python-source"]["partitions"] == 2
    assert by["python-source"]["batch_rows"] == 1500       # the lmqtt reader's first batch, repeated
    assert by["lmqtt"]["store_cpu_s_per_run"] >= 0


def test_filter_history_case_reads_the_matching_rows_and_splits_the_cpu(spark):
    """The filter-history case: 1 in 10 of the messages under `fhist` match `fhist/+/temp`; Spark and
    the source's reader alone both return exactly those (the bench raises otherwise), and the row
    says where the CPU went (store, Spark's JVM, its Python workers)."""
    srv = LmqttProc("serve")
    try:
        r = spark_bench.bench_filter_history(spark, srv, 3000, 100, 10, per_partition=150, repeat=1)
    finally:
        srv.stop()
    assert r["rows"] == 300 and r["among"] == 3000 and r["rows_per_s"] > 0 and r["without_spark_rows_per_s"] > 0
    assert r["partitions"] == 2                      # 3,000 entries at 150 rows of 1 in 10: 2 of 1,500
    assert r["store_cpu_s_per_run"] >= 0 and r["jvm_cpu_s_per_run"] > 0 and r["py_workers_cpu_s_per_run"] >= 0


def test_filter_history_cold_case_reads_exactly_the_matching_rows_from_the_tier_and_the_tail(spark, tmp_path):
    """The filter-history-cold case: the same load written to a store with a file:// tier (Parquet
    on, no local retention); read_history by filter returns exactly the matching rows (the bench
    raises otherwise), most of them from the tier's Parquet, the rest from the hot tail, with and
    without the topic pushdown."""
    rows = spark_bench_cold.bench_filter_history_cold(spark, 100000, 100, 10, str(tmp_path), per_partition=20000,
                                                      repeat=1, segment_mb=5,
                                                      store_args=("--tier-parquet-merge-after-s", "0"))
    by = {r["case"]: r for r in rows}
    assert set(by) == {"filter-history-cold", "filter-history-cold:regex-no-pushdown"}
    r = by["filter-history-cold"]
    assert r["rows"] == 10000 and r["among"] == 100000 and r["rows_per_s"] > 0
    assert 0 < r["hot_rows"] < r["cold_rows"] and r["cold_rows"] + r["hot_rows"] == 10000
    assert r["parquet_files"] >= 1 and r["segments"] >= 3
