"""IoT analytics job: MQTT JSON telemetry in the store -> per-device window stats (Parquet) and
alerts published back to MQTT (`alerts/{device}`) through the `lmqtt` sink.

    lmqtt serve &                                                  # MQTT 1883, store 10911
    python3 -m lmqtt.examples.simulator --seconds 120 &         # telemetry/{device}
    python3 -m lmqtt.examples.iot_analytics --out /tmp/iot --seconds 120
    mosquitto_sub -t 'alerts/#' -v                                 # or any MQTT client

Two streaming queries over `readStream.format("lmqtt").option("filter", "telemetry/+")`:
  1. stats: event time from the payload's `ts`, watermark `--watermark`, tumbling windows of
     `--window` per device: count, avg/min/max/stddev temp, avg humidity, min battery -> Parquet
     under OUT/stats (append mode: a window is written once the watermark passes it).
  2. alerts (foreachBatch): a reading outside [--min-temp, --max-temp] or more than --z standard
     deviations from its device's mean within the micro-batch -> `alerts/{device}` {"kind":
     "anomaly"}; a device whose last reading (state as of now) is older than --silence ->
     {"kind": "silent"}, once (checked every max(trigger, silence/2) seconds, not on every
     micro-batch, so anomaly alerts never wait for it; read from the first-level ConsumeQueue,
     which also has telemetry from before the job started).
     Alerts are written with queryId/batchId = the job's checkpoint/batch: a re-run batch is not
     published twice (docs/spark.md, exactly-once).
Checkpoints live under OUT/_checkpoints: stop the job any time and re-run the same command.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
import time

from lmqtt.store.client import ConnectionLost, StoreClientError, connect
from lmqtt.store.spark import LmqttDataSource, write_rows
from lmqtt.store.spark.views import state_as_of


def _seconds(trigger: str) -> float:
    """"500 milliseconds" / "10 seconds" / "1 minute" -> seconds."""
    n, _, unit = trigger.strip().partition(" ")
    unit = unit.strip().lower().rstrip("s")
    return float(n) * {"millisecond": 0.001, "second": 1.0, "minute": 60.0, "hour": 3600.0}.get(unit or "second", 1.0)


def build(spark, a):
    from pyspark.sql import functions as F  # optional: a Spark job only (the spark extra)

    src = (spark.readStream.format("lmqtt").option("store", a.store).option("filter", a.filter)
           .option("startingOffsets", a.starting))
    if a.token:
        src = src.option("token", a.token)
    raw = src.load()
    schema = "device string, ts long, temp double, humidity double, battery double, seq long"
    tele = (raw.select("topic", "store_ts", F.from_json(F.col("payload").cast("string"), schema).alias("j"))
            .select(F.coalesce("j.device", F.element_at(F.split("topic", "/"), -1)).alias("device"),
                    F.coalesce((F.col("j.ts") / 1000).cast("timestamp"), F.col("store_ts")).alias("event_time"),
                    "j.temp", "j.humidity", "j.battery")
            .where("temp is not null"))

    stats = (tele.withWatermark("event_time", a.watermark)
             .groupBy(F.window("event_time", a.window).alias("w"), "device")
             .agg(F.count("*").alias("n"), F.avg("temp").alias("avg_temp"), F.min("temp").alias("min_temp"),
                  F.max("temp").alias("max_temp"), F.stddev("temp").alias("std_temp"),
                  F.avg("humidity").alias("avg_humidity"), F.min("battery").alias("min_battery"))
             .select(F.col("w.start").alias("window_start"), F.col("w.end").alias("window_end"), "*")
             .drop("w"))
    _forget_unstarted(f"{a.out}/_checkpoints/stats")
    q_stats = (stats.writeStream.outputMode("append").format("parquet").option("path", f"{a.out}/stats")
               .option("checkpointLocation", f"{a.out}/_checkpoints/stats").trigger(processingTime=a.stats_trigger)
               .start())

    trigger_s = _seconds(a.trigger)
    # The silence check reads the device states (a batch read of the first-level topic), so it
    # runs at most every `check_s` seconds, not on every micro-batch: anomaly alerts, the part
    # that must be fast, do not wait for it. Each check covers the devices whose last reading
    # fell in [previous cut, this cut); the first check of a run looks back an hour (devices may
    # have gone quiet while the job was down).
    check_s = max(trigger_s, a.silence / 2)
    last_cut = [None]

    def alerts(batch, batch_id):
        batch = batch.persist()          # read from the store once, used twice (stats + join)
        try:
            _alerts(batch, batch_id)
        finally:
            batch.unpersist()

    def _alerts(batch, batch_id):
        dev = batch.groupBy("device").agg(F.avg("temp").alias("mu"), F.stddev("temp").alias("sd"))
        anomalies = (batch.join(dev, "device")
                     .where((F.col("temp") < a.min_temp) | (F.col("temp") > a.max_temp)
                            | ((F.col("sd") > 0) & (F.abs(F.col("temp") - F.col("mu")) > a.z * F.col("sd"))))
                     .select(F.concat(F.lit("alerts/"), "device").alias("topic"),
                             F.to_json(F.struct(F.lit("anomaly").alias("kind"), "device", "temp",
                                                F.col("event_time").cast("string").alias("at"))).alias("payload")))
        now = int(time.time() * 1000)
        cut = now - int(a.silence * 1000)
        silent = None
        if last_cut[0] is None or cut - last_cut[0] >= check_s * 1000:
            lower = cut - 3_600_000 if last_cut[0] is None else last_cut[0]
            last_cut[0] = cut
            # the first-level ConsumeQueue: it has history from before the job registered its filter
            last = state_as_of(spark, now, topic=a.filter.split("/")[0], store=a.store, token=a.token,
                               since=lower)
            silent = (last.where((F.col("store_ts") < F.timestamp_millis(F.lit(cut)))
                                 & (F.col("store_ts") >= F.timestamp_millis(F.lit(lower))))
                      .select(F.concat(F.lit("alerts/"), F.element_at(F.split("topic", "/"), -1)).alias("topic"),
                              F.to_json(F.struct(F.lit("silent").alias("kind"),
                                                 F.element_at(F.split("topic", "/"), -1).alias("device"),
                                                 F.col("store_ts").cast("string").alias("last_seen"))).alias("payload")))
        out = anomalies if silent is None else anomalies.unionByName(silent)
        out = out.withColumn("payload", F.col("payload").cast("binary")).withColumn("qos", F.lit(1))
        # alerts are few: collected and written from the driver (no Spark write job, no task per
        # partition), with the sink's exactly-once rule (query id + batch id)
        write_rows(out.collect(), query_id=a.job_id, batch_id=batch_id, store=a.store, token=a.token)

    _forget_unstarted(f"{a.out}/_checkpoints/alerts")
    q_alerts = (tele.writeStream.foreachBatch(alerts)
                .option("checkpointLocation", f"{a.out}/_checkpoints/alerts").trigger(processingTime=a.trigger)
                .start())
    return q_stats, q_alerts


def _forget_unstarted(checkpoint: str) -> None:
    """Start a query's checkpoint anew when it recorded no batch. A stop that comes while the
    query writes its first batch's offsets can leave the offset log with the write's temporary
    files but no batch, and Spark 4 then refuses to start over it (STATE_STORE_CHECKPOINT_LOCATION_
    NOT_EMPTY: a new query's checkpoint must be empty), so "stop and re-run any time" would end
    at the next run. With no batch in the offset log nothing was read, written or committed (Spark
    writes a batch's offsets before it runs it): what is there holds nothing to continue from.
    A checkpoint that is not a local folder is left to Spark."""
    offsets = os.path.join(checkpoint, "offsets")
    if not os.path.isdir(checkpoint):
        return
    try:
        names = os.listdir(offsets)
    except (FileNotFoundError, NotADirectoryError):
        names = []
    if any(n.isdigit() for n in names):       # batch files are named by their batch id
        return
    if not os.listdir(checkpoint):
        return
    print(f"lmqtt spark-iot: {checkpoint} recorded no batch (a stop came during its first): "
          "starting it anew", file=sys.stderr, flush=True)
    shutil.rmtree(checkpoint)


def parse_args(argv=None) -> argparse.Namespace:
    """The job's options (also what tests and notebooks pass to `build`)."""
    ap = argparse.ArgumentParser(prog="lmqtt spark-iot", description="lmqtt IoT analytics job (docs/spark.md)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--store", default="127.0.0.1:10911", help="HOST:PORT of the store's native protocol")
    ap.add_argument("--token", default=None, help="the store's auth token")
    ap.add_argument("--filter", default="telemetry/+", help="MQTT topic filter of the telemetry")
    ap.add_argument("--starting", default="earliest", help="startingOffsets of a new checkpoint")
    ap.add_argument("--out", default="./iot-analytics", help="folder of the Parquet stats and the checkpoints")
    ap.add_argument("--window", default="1 minute", help="tumbling window of the per-device stats")
    ap.add_argument("--watermark", default="2 minutes", help="how late a reading may arrive (event time)")
    ap.add_argument("--trigger", default="1 second", help="micro-batch interval of the alerts query")
    ap.add_argument("--stats-trigger", default="10 seconds",
                    help="micro-batch interval of the window statistics (a window is written once "
                         "the watermark passes it, so a short interval only costs CPU the alerts need)")
    ap.add_argument("--min-temp", type=float, default=-10.0, help="a reading below this is an anomaly")
    ap.add_argument("--max-temp", type=float, default=45.0, help="a reading above this is an anomaly")
    ap.add_argument("--z", type=float, default=4.0,
                    help="a reading this many standard deviations from its device's mean is an anomaly")
    ap.add_argument("--silence", type=float, default=30.0, help="seconds without telemetry = silent")
    ap.add_argument("--job-id", default="iot-analytics-alerts", help="producer identity of the alerts")
    ap.add_argument("--seconds", type=float, default=0, help="stop after this long (0 = run until Ctrl-C)")
    ap.add_argument("--master", default="local[2]", help="Spark master URL")
    return ap.parse_args(argv)


def _check_store(a) -> str | None:
    """One line saying why the store cannot be used, or None: checked before Spark starts, so a
    store that is not running is one message, not a streaming query's stack trace."""
    try:
        connect(a.store, token=a.token).close()
    except ConnectionLost as e:
        return f"{e} (is `lmqtt serve` or `lmqtt store` running? --store HOST:PORT)"
    except StoreClientError as e:
        return f"the store at {a.store} refused the connection: {e}"
    except ValueError:                          # a malformed HOST:PORT
        return f"--store {a.store!r} is not HOST:PORT"
    return None


def _failure(e) -> str:
    """A failed streaming query in one line: the lmqtt/Python error at the bottom of the
    traceback Spark wraps it in, else the first line of Spark's message."""
    text = str(getattr(e, "desc", None) or e)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if ":" in ln and " " not in head and (head.endswith(("Error", "Exception", "Lost", "Full"))):
            return ln
    return lines[0] if lines else repr(e)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        return _main(a)
    except KeyboardInterrupt:                   # Ctrl-C while Spark was still starting
        print("lmqtt spark-iot: interrupted", file=sys.stderr)
        return 130


def _main(a) -> int:
    try:
        from pyspark.sql import SparkSession  # optional: a Spark job only (the spark extra)
    except ImportError:
        print("lmqtt spark-iot: needs pyspark: python3 -m pip install -e '.[spark]' (and Java 17)", file=sys.stderr)
        return 2
    problem = _check_store(a)
    if problem:
        print(f"lmqtt spark-iot: {problem}", file=sys.stderr)
        return 3

    spark = (SparkSession.builder.master(a.master).appName("lmqtt-iot-analytics")
             .config("spark.sql.shuffle.partitions", "4").config("spark.sql.session.timeZone", "UTC")
             .getOrCreate())
    # PySpark's own SIGINT handler cancels the jobs over py4j from inside whatever py4j call the
    # main thread is blocked in (a reentrant call: pages of tracebacks on Ctrl-C). Here Ctrl-C and
    # SIGTERM only set a flag; the loop below then stops the queries, which is the documented way
    # to end the job (the checkpoints make a re-run continue where it stopped).
    stop = threading.Event()
    _quiet_accumulator_hangup(spark)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    spark.dataSource.register(LmqttDataSource)
    failed = []
    try:
        qs = build(spark, a)
        print(f"lmqtt spark-iot: running over {a.filter!r} at {a.store}: window stats -> {a.out}/stats, "
              f"alerts -> alerts/{{device}}; " + (f"stops after {a.seconds:g} s" if a.seconds else "Ctrl-C stops"),
              file=sys.stderr, flush=True)
        deadline = time.monotonic() + a.seconds if a.seconds else None
        while not stop.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                break
            if not all(q.isActive for q in qs):
                break
            stop.wait(0.5)
        failed = [e for e in (q.exception() for q in qs) if e is not None]
        _stop_once_started(qs)
    finally:
        spark.stop()
    for e in failed:
        print(f"lmqtt spark-iot: a streaming query failed: {_failure(e)}", file=sys.stderr)
    if not failed:              # Ctrl-C / SIGTERM, or --seconds ran out: the same closing line
        print("lmqtt spark-iot: stopped (run the same command again to continue from the checkpoints)",
              file=sys.stderr)
    return 1 if failed else 0



# how long a stop waits for a query still starting (a re-run over its checkpoints on a loaded machine
# takes a few seconds to plan its first batch)
START_WAIT_S = 60.0


def _stop_once_started(qs) -> None:
    """Stop the queries, each once it has started. A query is stopped mid-start when Ctrl-C or
    `--seconds` comes while it still plans its first batch: Spark then cancels the Python worker
    of the lmqtt source while it connects back, and both Spark's Python runner and its JVM print
    a traceback of that (EOFError, "Python worker failed to connect back") on a stop that
    otherwise ends cleanly. So a stop waits, up to START_WAIT_S, for its "Initializing ..." status
    (StreamExecution, then sources) to be over; the checkpoints make either way safe to re-run."""
    end = time.monotonic() + START_WAIT_S
    while time.monotonic() < end and any(_starting(q) for q in qs):
        time.sleep(0.1)
    for q in qs:
        q.stop()


def _starting(q) -> bool:
    try:
        return bool(q.isActive) and str(q.status.get("message", "")).startswith("Initializing")
    except Exception:  # noqa: BLE001 - a query that ended meanwhile: nothing to wait for
        return False


def _quiet_accumulator_hangup(spark) -> None:
    """PySpark's accumulator server reads updates from the JVM until it is told to stop, but a
    query's stop (its jobs cancelled) and `spark.stop()` close the JVM's end first: the read sees
    the hang-up and socketserver prints an EOFError traceback after the job ended normally. That
    one error is the JVM's side going away, not a failure (this job keeps no results in
    accumulators): it is not printed. (Any other is.) Set up at the start: a query may be stopped
    at any time."""
    srv = getattr(spark.sparkContext, "_accumulatorServer", None)
    if srv is None:
        return
    report = srv.handle_error

    def handle_error(request, client_address):
        if not isinstance(sys.exc_info()[1], EOFError):
            report(request, client_address)
    srv.handle_error = handle_error

if __name__ == "__main__":
    raise SystemExit(main())
