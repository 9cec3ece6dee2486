"""Sink and streaming source against a real `lmqtt serve` (own module: own server)."""

from tests.support import Paho


def test_sink_delivers_to_mqtt_and_a_rerun_of_the_batch_is_not_delivered_twice(spark, server):
    sub = Paho(server, client_id="alerts-sub", version=5)
    sub.subscribe("alerts/#", qos=1)
    rows = [(f"alerts/dev{i}", f"hot {i}".encode(), 1, False, {"sev": "high"}) for i in range(5)]
    df = spark.createDataFrame(rows, "topic string, payload binary, qos int, retain boolean, "
                                     "user_properties map<string,string>").repartition(2)

    def save():
        (df.write.format("lmqtt").option("store", server.store_address)
         .option("queryId", "alerts-job").option("batchId", "7").mode("append").save())
    save()
    got = sub.get_n(5)
    assert sorted(m.topic for m in got) == [f"alerts/dev{i}" for i in range(5)]
    assert sorted(m.payload for m in got) == [f"hot {i}".encode() for i in range(5)]
    assert all(m.qos == 1 and dict(m.properties.UserProperty) == {"sev": "high"} for m in got)

    save()                                           # the same query + batch id again: a retry
    (df.write.format("lmqtt").option("store", server.store_address)       # the next batch: new
     .option("queryId", "alerts-job").option("batchId", "8").mode("append").save())
    again = sub.get_n(5)
    assert len(again) == 5                           # batch 8 only
    # and nothing of batch 7 a second time: the retry was answered before batch 8 was written, so a
    # second copy would sit in alerts/# before the sentinel
    assert sub.before_sentinel(sub, "alerts/sentinel") == []
    sub.disconnect()


def _run(spark, server, ckpt, sink, limit=None, once=False, flt="tele/+", group=None):
    r = (spark.readStream.format("lmqtt").option("store", server.store_address)
         .option("filter", flt).option("startingOffsets", "earliest"))
    if limit:
        r = r.option("maxRecordsPerTrigger", str(limit))
    if group:
        r = r.option("group", group)
    w = (r.load().selectExpr("cast(payload as string) as v", "offset").writeStream
         .foreachBatch(sink).option("checkpointLocation", ckpt))
    return (w.trigger(once=True) if once else w).start()


def test_stream_stopped_and_restarted_sees_every_message_once(spark, server, tmp_path):
    """Run 1 reads what is there and stops; run 2 dies in the middle of its first batch (after
    the batch's offsets are in the checkpoint, before it is committed); run 3 restarts from the
    checkpoint: it re-reads exactly that range, then goes on in batches of at most 14."""

    from lmqtt.store.client import connect
    c = connect(server.store_address)
    c.cmd("subscribe", filter="tele/+")
    prod = c.producer()
    send = lambda a, b: prod.send_batch([(f"tele/d{i % 3}", str(i).encode()) for i in range(a, b)])  # noqa: E731
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    crash = tmp_path / "crash"
    sizes = {}

    def sink(df, batch_id):      # idempotent per batch id (overwrite), like a transactional sink
        df.write.mode("overwrite").parquet(f"{out}/b{batch_id}")
        sizes[batch_id] = df.count()
        if crash.exists():
            crash.unlink()
            raise RuntimeError("crash in the middle of the batch")

    send(0, 40)
    q = _run(spark, server, ckpt, sink, limit=14, once=True)
    q.awaitTermination(120)
    assert q.exception() is None

    send(40, 60)
    crash.touch()
    q = _run(spark, server, ckpt, sink, limit=14)
    try:
        q.awaitTermination(120)
    except Exception:  # noqa: BLE001 - the injected crash
        pass
    assert q.exception() is not None and not crash.exists()

    send(60, 80)
    q = _run(spark, server, ckpt, sink, limit=14)
    q.processAllAvailable()
    q.stop()
    vals = [r.v for r in spark.read.parquet(*[f"{out}/b{b}" for b in sorted(sizes)]).collect()]
    assert sorted(vals, key=int) == [str(i) for i in range(80)]     # each once, no gap
    later = [sizes[b] for b in sorted(sizes) if b >= 2]
    assert later and max(later) <= 14                               # the per-trigger limit
    c.close()


def test_stream_keeps_the_per_trigger_limit_on_the_first_batch_after_a_restart(spark, server, tmp_path):
    """A restarted query learns where it stands from Spark's commit of the restored offsets, so the
    first batch after a restart obeys maxRecordsPerTrigger too (it would otherwise take all 40
    new messages at once)."""
    from lmqtt.store.client import connect
    c = connect(server.store_address)
    c.cmd("subscribe", filter="lim/+")
    prod = c.producer()
    send = lambda a, b: prod.send_batch([(f"lim/d{i % 3}", str(i).encode()) for i in range(a, b)])  # noqa: E731
    ckpt = str(tmp_path / "ckpt")
    seen, sizes = [], {}

    def sink(df, batch_id):
        rows = [r.v for r in df.collect()]
        sizes[batch_id] = len(rows)
        seen.extend(rows)

    send(0, 12)
    q = _run(spark, server, ckpt, sink, limit=5, flt="lim/+")
    q.processAllAvailable()
    q.stop()
    first_run = set(sizes)
    send(12, 52)
    q = _run(spark, server, ckpt, sink, limit=5, flt="lim/+")
    q.processAllAvailable()
    q.stop()
    after = [sizes[b] for b in sorted(sizes) if b not in first_run]
    assert after and max(after) <= 5, sizes                       # the first batch included
    assert sorted(seen, key=int) == [str(i) for i in range(52)]   # each once, no gap
    c.close()


def test_stream_sink_rerun_of_a_batch_after_a_lost_commit_is_not_delivered_twice(spark, server, tmp_path):
    """writeStream.format("lmqtt"): batch 0 delivered; its commit-log entry removed (the query
    died after writing, before committing) -> the restart re-runs batch 0 with the same query id
    and batch id, and the store's producer dedup drops it."""
    import os

    from lmqtt.store.client import connect
    c = connect(server.store_address)
    c.cmd("subscribe", filter="src/+")
    c.producer().send_batch([(f"src/d{i % 3}", str(i).encode()) for i in range(10)])
    c.close()
    sub = Paho(server, client_id="sink-sub", version=5)
    sub.subscribe("fwd/#", qos=1)
    ckpt = str(tmp_path / "ckpt")

    def run():
        q = (spark.readStream.format("lmqtt").option("store", server.store_address).option("filter", "src/+")
             .option("startingOffsets", "earliest").load()
             .selectExpr("concat('fwd/', topic) as topic", "payload")
             .writeStream.format("lmqtt").option("store", server.store_address)
             .option("checkpointLocation", ckpt).trigger(once=True).start())
        q.awaitTermination(120)
        assert q.exception() is None
        return q.lastProgress
    run()
    got = sub.get_n(10)
    assert sorted(m.payload for m in got) == sorted(str(i).encode() for i in range(10))
    for f in ("0", ".0.crc"):
        p = os.path.join(ckpt, "commits", f)
        if os.path.exists(p):
            os.remove(p)
    again = run()
    assert again["batchId"] == 0 and again["numInputRows"] == 10    # batch 0 really ran again
    assert sub.before_sentinel(sub, "fwd/sentinel") == []          # the re-run was written (and dropped) by now
    sub.disconnect()
