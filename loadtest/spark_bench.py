"""`lmqtt bench spark`: Spark (local mode) over the store, one JSON object per result on stdout.

Cases:
* lmqtt           `spark.read.format("lmqtt")` of `--rows` 100-byte messages (one first-level
                  topic, read through the SDK from an embedded `lmqtt serve`): rows_per_s of a job
                  that touches every column of every row
* parquet, json   the same rows (same schema, same values) read by Spark from Parquet / JSON files
                  written beforehand, with the same job: the yardsticks for the lmqtt row
* python-source   the ceiling of any Python data source here: a source with the lmqtt schema whose
                  reader does no I/O at all (it yields, over and over, an Arrow batch the lmqtt
                  reader produced, read once from a local Arrow file), same partitions, same job.
                  What Spark's Python data source path itself costs, so the lmqtt row can be read
                  as "store + SDK" against "Spark's own share"
* filter-history  a filter's history: `--rows` messages under one first-level topic, one
                  in `--filter-every` to `fhist/dK/temp` and the rest to `fhist/dK/hum`, nobody
                  subscribed; `spark.read.format("lmqtt").option("filter", "fhist/+/temp")` reads the
                  matching ones (the store scans the topic's whole ConsumeQueue and keeps the matching
                  records, lightqueue/history.py) with the same all-columns job: rows_per_s of matching
                  rows and scanned_per_s of ConsumeQueue entries looked at; without_spark_rows_per_s:
                  the source's partition reader alone (store scan + SDK + Arrow batches, no Spark);
                  the CPU seconds of the store, Spark's JVM and its Python workers, run by run
                  (cpu_s_runs) and their medians over the warm runs (*_cpu_s_per_run)
* cold-parquet    Spark over the cold tier: `--rows` messages written to an `lmqtt store
                  --tier file://... --tier-parquet on --local-retention 0` (segments of
                  `--cold-segment-mb`); once every sealed segment is in the tier and the
                  tier's compaction merged each partition's small files (one per segment) into
                  row-group-sized ones (--tier-parquet-file-mb, after --tier-parquet-merge-after-s
                  without a new segment: 60 s by default), the same
                  all-columns job over (a) `spark.read.parquet(<tier>/parquet)` (the offloaded rows,
                  Spark's native reader), (b) the same rows as plain Parquet written by Spark (the
                  yardstick; (a) and (b) timed alternately, round by round, the order swapped
                  every round, after a warm-up job; vs_plain_parquet = the median of the rounds'
                  ratios, cpu_vs_plain_parquet = the same of the JVM's CPU seconds; both copies'
                  files, row groups and codecs are reported), (c) `spark.read.format("lmqtt")` of the whole topic through the store
                  (today's Python source; the offloaded part read back from the tier) and (d)
                  `read_history` (cold Parquet + the hot tail through the source, each row once)
* filter-history-cold  the filter-history load written to an `lmqtt store --tier file://...
                  --tier-parquet on --local-retention 0` (like cold-parquet); once offloaded,
                  `read_history(filter="fhist/+/temp")` (the tier's Parquet, sorted by topic, with
                  `topic IN (the matching topics named in the files' footers)` pushed down to
                  Spark's Parquet reader, UNION the hot tail through the source) with the same
                  all-columns job, timed from the call to the job's end, rows checked exact; and
                  the same with the cold side filtered row by row by the filter's regex
                  (:regex-no-pushdown)
* stream-latency  the shipped IoT job (`lmqtt spark-iot`, trigger `--trigger`) with every reading an
                  anomaly: a device publishes readings over MQTT at `--rate` per second, the job
                  publishes one alert per reading back over MQTT; latency = alert received minus
                  reading published (p50/p99/max ms)

    lmqtt bench spark --rows 1000000
    lmqtt bench spark --rows 10000000 --cases lmqtt,parquet
    lmqtt bench spark --rows 10000000 --cases filter-history        # 1M matching rows among 10M
    lmqtt bench spark --rows 10000000 --cases cold-parquet
    lmqtt bench spark --rows 10000000 --cases filter-history-cold   # 1M among 10M, from the tier

Each batch case runs its job `--repeat` times (default 3) and reports the best run and all runs:
the first action of a session also starts Spark's Python workers, so every case is compared warm.
The lmqtt row adds the store's CPU seconds per run, so a reader can tell whether the store or
Spark bounds the figure.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

from lmqtt.examples.iot_analytics import build, parse_args
from lmqtt.loadtest.sdk_bench import LmqttProc
from lmqtt.store.spark import LmqttDataSource
from lmqtt.store.spark.source import SourceQueues

from .spark_bench_cold import bench_cold, bench_filter_history_cold
from .spark_bench_support import TOPIC, load, load_mixed, session, spark_cpu, timed


def _ceiling_source():
    """The `python-source` case's data source (defined lazily: pyspark is imported only by the
    Spark bench). Options: `path` (an Arrow IPC file with one batch), `rows`, `partitions`."""
    from pyspark.sql.datasource import (  # optional: a Spark job only (the spark extra)
        DataSource,
        DataSourceReader,
        InputPartition,
    )

    class CeilingReader(DataSourceReader):
        def __init__(self, options) -> None:
            self.options = options

        def partitions(self):
            n, rows = int(self.options["partitions"]), int(self.options["rows"])
            return [InputPartition(rows // n + (1 if i < rows % n else 0)) for i in range(n)]

        def read(self, partition):
            import pyarrow as pa  # optional: the spark extra
            with pa.memory_map(self.options["path"]) as f:
                batch = pa.ipc.open_file(f).get_batch(0)
            left = partition.value
            while left > 0:
                b = batch if left >= batch.num_rows else batch.slice(0, left)
                left -= b.num_rows
                yield b

    class CeilingSource(DataSource):
        @classmethod
        def name(cls) -> str:
            return "lmqtt-python-ceiling"

        def schema(self):
            return LmqttDataSource({}).schema()

        def reader(self, schema):
            return CeilingReader(self.options)

    return CeilingSource


def _ceiling_batch(srv, path: str, per_partition: int) -> int:
    """One Arrow batch as the lmqtt reader yields it, written to `path`; returns its rows."""
    import pyarrow as pa  # optional: the spark extra

    opts = {"store": srv.address, "topic": TOPIC, "recordsPerPartition": str(per_partition)}
    ds = LmqttDataSource(opts)
    reader = ds.reader(ds.schema())
    part = reader.partitions()[0]
    gen = reader.read(part)
    try:
        batch = next(gen)
    finally:
        gen.close()
    with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, batch.schema) as w:
        w.write_batch(batch)
    return batch.num_rows


def bench_read(spark, srv, rows: int, size: int, base: str, cases: list[str], per_partition: int,
               repeat: int = 3):
    out = []
    reader = (spark.read.format("lmqtt").option("store", srv.address).option("topic", TOPIC)
              .option("recordsPerPartition", str(per_partition)))
    df = reader.load()
    if "lmqtt" in cases:
        s0 = srv.cpu()
        el, runs = timed(df, rows, repeat, "lmqtt")
        out.append({"case": "lmqtt", "rows": rows, "size": size, "seconds": round(el, 3), "runs_s": runs,
                    "rows_per_s": round(rows / el),
                    "store_cpu_s_per_run": round((srv.cpu() - s0) / max(1, repeat), 2),
                    "partitions": df.rdd.getNumPartitions()})
    if "python-source" in cases:
        path = os.path.join(base, "ceiling.arrow")
        batch_rows = _ceiling_batch(srv, path, per_partition)
        spark.dataSource.register(_ceiling_source())
        cdf = (spark.read.format("lmqtt-python-ceiling").option("path", path).option("rows", str(rows))
               .option("partitions", str(df.rdd.getNumPartitions())).load())
        el, runs = timed(cdf, rows, repeat, "python-source")
        out.append({"case": "python-source", "rows": rows, "size": size, "seconds": round(el, 3), "runs_s": runs,
                    "rows_per_s": round(rows / el), "batch_rows": batch_rows,
                    "partitions": cdf.rdd.getNumPartitions()})
    # the same rows as files: written once from the lmqtt read, then read back the same way
    for fmt in ("parquet", "json"):
        if fmt not in cases:
            continue
        path = os.path.join(base, fmt)
        getattr(df.write.mode("overwrite"), fmt)(path)
        fdf = spark.read.schema(df.schema).format(fmt).load(path)
        el, runs = timed(fdf, rows, repeat, fmt)
        out.append({"case": fmt, "rows": rows, "size": size, "seconds": round(el, 3), "runs_s": runs,
                    "rows_per_s": round(rows / el),
                    "bytes_on_disk": sum(os.path.getsize(os.path.join(dp, f))
                                         for dp, _, fs in os.walk(path) for f in fs)})
    return out


def bench_filter_history(spark, srv, rows: int, size: int, every: int, per_partition: int, repeat: int) -> dict:
    print(f"[spark] loading {rows:,} messages of {size} B, 1 in {every} matching ...", file=sys.stderr, flush=True)
    load_s = load_mixed(srv.address, rows, size, every)
    print(f"[spark] loaded in {load_s:.1f} s", file=sys.stderr, flush=True)
    want = len(range(0, rows, every))
    df = (spark.read.format("lmqtt").option("store", srv.address).option("filter", "fhist/+/temp")
          .option("recordsPerPartition", str(per_partition)).load())
    # run by run, with the CPU seconds each run cost the store, Spark's JVM and its Python workers
    # (the first run also starts the workers and compiles the plan)
    runs, cpu_runs = [], {"store": [], "jvm": [], "py_workers": []}
    for _ in range(max(1, repeat)):
        s0, (j0, w0) = srv.cpu(), spark_cpu(spark)
        runs.append(timed(df, want, 1, "filter-history")[0])
        j1, w1 = spark_cpu(spark)
        for k, v in (("store", srv.cpu() - s0), ("jvm", j1 - j0), ("py_workers", w1 - w0)):
            cpu_runs[k].append(round(v, 2))
    el = min(runs)
    runs = [round(t, 3) for t in runs]
    warm = {k: v[1:] or v for k, v in cpu_runs.items()}
    # the same read without Spark: the source's own partition reader (store scan + SDK + Arrow
    # batches) in this process, one partition after the other, best of `repeat`
    q = SourceQueues({"store": srv.address, "filter": "fhist/+/temp"})
    direct = []
    try:
        for _ in range(max(1, repeat)):
            t0 = time.perf_counter()
            n = sum(b.num_rows for key in q.keys() for b in q.iter_batches(key, *q.bounds(key)))
            direct.append(time.perf_counter() - t0)
            if n != want:
                raise RuntimeError(f"filter-history direct read returned {n} rows, {want} were written")
    finally:
        q.conn.close()
    return {"case": "filter-history", "rows": want, "among": rows, "size": size, "seconds": round(el, 3),
            "runs_s": runs, "rows_per_s": round(want / el), "scanned_per_s": round(rows / el),
            "store_cpu_s_per_run": statistics.median(warm["store"]), "jvm_cpu_s_per_run": statistics.median(warm["jvm"]),
            "py_workers_cpu_s_per_run": statistics.median(warm["py_workers"]), "cpu_s_runs": cpu_runs,
            "partitions": df.rdd.getNumPartitions(),
            "without_spark_rows_per_s": round(want / min(direct)), "without_spark_runs_s": [round(t, 3) for t in direct],
            "load_s": round(load_s, 1)}


def bench_stream_latency(spark, srv, seconds: float, rate: int, trigger: str, base: str,
                         warmup: float = 5.0) -> dict:
    import paho.mqtt.client as mqtt  # optional: the bench and spark extras

    args = parse_args(["--store", srv.address, "--filter", "latbench/+", "--out", os.path.join(base, "iot"),
                       "--trigger", trigger, "--max-temp", "-1000", "--silence", "86400",
                       "--window", "10 seconds", "--watermark", "10 seconds", "--job-id", "bench-latency"])
    lat: list[float] = []
    lock = threading.Lock()
    measure_from = [float("inf")]       # readings sent before this (the warm-up) are not counted
    received = [0]

    def on_message(_c, _u, m):
        now = time.time()
        try:
            sent = int(json.loads(m.payload)["device"][2:]) / 1e6     # "d-<send time in µs>"
            with lock:
                received[0] += 1
                if sent >= measure_from[0]:
                    lat.append((now - sent) * 1000)
        except (ValueError, KeyError):
            pass

    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-alerts")
    sub.on_message = on_message
    sub.connect("127.0.0.1", srv.mqtt_port, 30)
    sub.subscribe("alerts/#", 1)
    sub.loop_start()
    qs = build(spark, args)
    try:
        deadline = time.monotonic() + 120
        while not all(q.lastProgress for q in qs):
            if time.monotonic() > deadline:
                raise RuntimeError("the IoT job's queries did not start within 120 s")
            time.sleep(0.2)
        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-devices")
        pub.connect("127.0.0.1", srv.mqtt_port, 30)
        pub.loop_start()
        n = 0
        t0 = time.monotonic()
        measure_from[0] = time.time() + warmup
        while time.monotonic() - t0 < warmup + seconds:
            # one device per reading, named after its send time: the alert carries the device
            now = time.time()
            msg = {"device": f"d-{int(now * 1e6)}", "ts": int(now * 1000), "temp": 20.0, "humidity": 50.0,
                   "battery": 4.0}
            pub.publish(f"latbench/d{n % 50}", json.dumps(msg), qos=1)
            n += 1
            time.sleep(max(0.0, t0 + n / rate - time.monotonic()))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with lock:
                if received[0] >= n:
                    break
            time.sleep(0.2)
        pub.loop_stop()
        pub.disconnect()
    finally:
        for q in qs:
            q.stop()
        sub.loop_stop()
        sub.disconnect()
    with lock:
        v = sorted(lat)
    pick = lambda p: round(v[min(len(v) - 1, int(p / 100 * (len(v) - 1)))], 1) if v else None  # noqa: E731
    return {"case": "stream-latency", "rows": n, "alerts": received[0], "measured": len(v), "warmup_s": warmup,
            "trigger": trigger, "rate": rate,
            "p50_ms": pick(50), "p99_ms": pick(99), "max_ms": round(v[-1], 1) if v else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmqtt bench spark", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="messages to read in the batch cases")
    ap.add_argument("--size", type=int, default=100, help="payload bytes (default 100)")
    ap.add_argument("--cases", default="lmqtt,python-source,parquet,json,stream-latency")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--records-per-partition", type=int, default=250_000)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each batch case; the best is reported")
    ap.add_argument("--filter-every", type=int, default=10,
                    help="filter-history: one message in N matches the filter (default 10: 1M among 10M)")
    ap.add_argument("--stream-seconds", type=float, default=20.0)
    ap.add_argument("--rate", type=int, default=200, help="readings per second in stream-latency")
    ap.add_argument("--trigger", default="500 milliseconds")
    ap.add_argument("--cold-segment-mb", type=int, default=64, help="cold-parquet: the store's segment size")
    ap.add_argument("--warmup", type=float, default=5.0,
                    help="seconds of readings published first and not counted (query warm-up)")
    a = ap.parse_args(argv)
    if not 0 < a.rows <= 50_000_000:
        ap.error("--rows must be in 1..50,000,000")
    cases = [c for c in a.cases.split(",") if c]
    unknown = set(cases) - {"lmqtt", "python-source", "parquet", "json", "stream-latency", "filter-history",
                          "cold-parquet", "filter-history-cold"}
    if unknown:
        ap.error(f"unknown case(s): {', '.join(sorted(unknown))}")
    base = tempfile.mkdtemp(prefix="lmqtt-bench-spark-")
    srv = LmqttProc("serve")
    spark = None
    try:
        parallelism = int(a.master[6:-1]) if a.master.startswith("local[") and a.master[6:-1].isdigit() else 2
        spark = session(a.master, parallelism)
        if {"lmqtt", "python-source", "parquet", "json"} & set(cases):
            print(f"[spark] loading {a.rows:,} messages of {a.size} B ...", file=sys.stderr, flush=True)
            el = load(srv.address, a.rows, a.size)
            print(f"[spark] loaded in {el:.1f} s", file=sys.stderr, flush=True)
            for row in bench_read(spark, srv, a.rows, a.size, base, cases, a.records_per_partition, a.repeat):
                print(json.dumps(row), flush=True)
        if "filter-history" in cases:
            print(json.dumps(bench_filter_history(spark, srv, a.rows, a.size, max(1, a.filter_every),
                                                  a.records_per_partition, a.repeat)), flush=True)
        if "cold-parquet" in cases:
            for row in bench_cold(spark, a.rows, a.size, base, a.records_per_partition, a.repeat,
                                  a.cold_segment_mb):
                print(json.dumps(row), flush=True)
        if "filter-history-cold" in cases:
            for row in bench_filter_history_cold(spark, a.rows, a.size, max(1, a.filter_every), base,
                                                 a.records_per_partition, a.repeat, a.cold_segment_mb):
                print(json.dumps(row), flush=True)
        if "stream-latency" in cases:
            print(json.dumps(bench_stream_latency(spark, srv, a.stream_seconds, a.rate, a.trigger, base, a.warmup)),
                  flush=True)
    finally:
        if spark is not None:
            spark.stop()
        srv.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
