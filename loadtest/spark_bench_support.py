"""What `lmqtt bench spark`'s cases share (spark_bench.py: the hot cases and the command line;
spark_bench_cold.py: the cold-tier cases): a local Spark session with the `lmqtt` source, loading
messages into the store through the SDK, the timed all-columns job, and the CPU seconds of Spark's
JVM, its Python workers and the store."""
from __future__ import annotations

import os
import sys
import time

from lmqtt.store.client import connect
from lmqtt.store.spark import LmqttDataSource

TOPIC = "sparkbench"


def _jvm(psutil):
    """Spark's JVM: the `java` child of this (the driver) process, whose children are Spark's
    Python workers."""
    for c in psutil.Process().children(recursive=True):
        try:
            if c.name() == "java":
                return c
        except psutil.Error:
            pass
    raise RuntimeError("no Spark JVM among this process's children")


def session(master: str, parallelism: int):
    from pyspark.sql import SparkSession  # optional: a Spark job only (the spark extra)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    s = (SparkSession.builder.master(master).appName("lmqtt-bench-spark")
         .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", str(parallelism))
         .config("spark.default.parallelism", str(parallelism))
         .config("spark.sql.session.timeZone", "UTC")
         .config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.host", "127.0.0.1")
         .config("spark.driver.memory", "4g")
         .getOrCreate())
    s.sparkContext.setLogLevel("ERROR")
    s.dataSource.register(LmqttDataSource)
    return s

def load(address: str, rows: int, size: int) -> float:
    """Write `rows` messages of `size` bytes to TOPIC through the SDK; returns seconds taken."""
    body = os.urandom(size)
    t0 = time.perf_counter()
    with connect(address) as c:
        p = c.producer()
        batch = [(f"{TOPIC}/d{i % 100}", body) for i in range(1000)]
        left = rows
        while left > 0:
            n = min(1000, left)
            p.send_batch(batch[:n])
            left -= n
    return time.perf_counter() - t0

def touch_all(df):
    """An action that reads every column of every row (no column pruning can skip one)."""
    from pyspark.sql import functions as F  # optional: a Spark job only (the spark extra)
    cols = [c for c in df.columns if c != "user_properties"]
    return df.select(F.count(F.lit(1)).alias("n"), F.sum(F.hash(*cols)).alias("h"),
                     F.sum(F.size("user_properties")).alias("p")).collect()[0]

def timed(df, rows: int, repeat: int, what: str):
    """Run the all-columns job `repeat` times: (best seconds, every run's seconds). The first run
    of a session also pays for starting Spark's Python workers and compiling the plan, so every
    case is measured warm, best of `repeat`, the same way."""
    times = []
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        r = touch_all(df)
        times.append(time.perf_counter() - t0)
        if r["n"] != rows:
            raise RuntimeError(f"{what} read returned {r['n']} rows, {rows} were written")
    return min(times), [round(t, 3) for t in times]

def spark_cpu(spark) -> tuple[float, float]:
    """(CPU seconds of Spark's JVM, of its Python workers) so far: with the store's CPU, where the
    time of a read went; on a loaded VM these move far less than the wall-clock figures."""
    try:
        import psutil  # optional: the bench extra
        jvm = _jvm(psutil)
        t = jvm.cpu_times()
        py = 0.0
        for c in jvm.children(recursive=True):
            try:
                ct = c.cpu_times()
                py += ct.user + ct.system
            except psutil.Error:
                pass
        return t.user + t.system, py
    except Exception:  # noqa: BLE001  (no psutil, no local JVM: the figures are left out)
        return 0.0, 0.0

def load_mixed(address: str, rows: int, size: int, every: int) -> float:
    """`rows` messages under `fhist`: one in `every` to fhist/dK/temp, the others to fhist/dK/hum."""
    body = os.urandom(size)
    batch = [(f"fhist/d{i % 100}/{'temp' if i % every == 0 else 'hum'}", body) for i in range(1000 * every)]
    t0 = time.perf_counter()
    with connect(address) as c:
        p = c.producer()
        done = 0
        while done < rows:
            n = min(1000, rows - done)
            k = done % len(batch)
            p.send_batch(batch[k:k + n])
            done += n
    return time.perf_counter() - t0

def proc_cpu(proc) -> float:
    try:
        import psutil  # optional: the bench extra
        t = psutil.Process(proc.pid).cpu_times()
        return t.user + t.system
    except Exception:  # noqa: BLE001
        return 0.0
