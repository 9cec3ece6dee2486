"""Consumers whose offsets a cut CommitLog left past the queues' ends, end to end: a persistent MQTT session (and SDK consumer groups) consumed 10 messages,
the server stopped, the newest CommitLog segment was cut inside the record of message 6 (or
truncated to 0 bytes), the server restarted. The queues now end before the consumers' offsets;
the messages published next reuse those offsets. Before the fix the session stayed at offset 10
and received only `new-6` (of six), the 0-byte cut was not even reported. Now every consumer is
brought back to its queue's end (a WARNING each), the cut is reported loudly, and every new
message arrives.

Real parts: `lmqtt serve` subprocesses on one data dir, paho-mqtt, the SDK (lmqtt.store.client)
over the server's store port, the segment file cut between the two runs."""
from __future__ import annotations

import glob
import logging
import os
import time

import pytest

from lmqtt.store.client import connect
from tests.support import LmqttServer, Paho, poll_n, record_position

pytestmark = pytest.mark.timeout(120)


def _session_offset(conn, cid: str, flt: str):
    """(committed offset, queue end) of client `cid`'s subscription to `flt` (`lmqtt admin --session`)."""
    s = conn.cmd("session", client_id=cid)["session"]
    sub = next(x for x in s["subscriptions"] if x["filter"] == flt)
    return sub["committed_offset"], sub["max_offset"]


def _wait(cond, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("damage", ["cut-in-record-6", "truncated-to-0"])
def test_consumers_get_every_message_published_after_a_cut_log(tmp_path, damage):
    data = tmp_path / "data"
    data.mkdir()
    srv = LmqttServer(str(data)).start()
    try:
        sess = Paho(srv, "sess", clean=False)
        sess.subscribe("t/#", qos=1)
        conn = connect(srv.store_address)
        pc = conn.consumer("t", "cg")                       # a ConsumeQueue consumer group
        fc = conn.filter_consumer("t/#", group="fg")        # a light-queue consumer group
        pub = Paho(srv, "pub")
        for i in range(1, 11):
            pub.publish("t/a", f"m-{i}".encode(), qos=1)
        assert [m.payload for m in sess.get_n(10)] == [f"m-{i}".encode() for i in range(1, 11)]
        assert len(poll_n(pc, 10)) == 10 and len(poll_n(fc, 10)) == 10
        pc.commit()
        fc.commit()
        sess.disconnect()
        pub.disconnect()
        assert _wait(lambda: _session_offset(conn, "sess", "t/#") == (10, 10), "the session's commit")
        conn.close()
        assert srv.stop() == 0

        segment = sorted(glob.glob(str(data / "store" / "commitlog" / "0*")))[-1]
        if damage == "cut-in-record-6":
            at = record_position(segment, "t/a", b"m-6")
            os.truncate(segment, at + 9)
            end, n_new = 5, 6
        else:
            os.truncate(segment, 0)
            end, n_new = 0, 7

        srv.start()
        log = srv.log_tail(100_000)
        assert "store recovery: the checkpoints recorded" in log and "acknowledged are lost" in log, log
        for who, queue in (("sess", "t/#"), ("group cg", "t:0"), ("group fg", "t/#")):
            assert (f"consumer {who}: offset 10 of queue {queue} beyond its end {end} after recovery: "
                    f"reset to {end} ({10 - end} entries lost from the log)") in log, (who, log)
        conn = connect(srv.store_address)
        assert _session_offset(conn, "sess", "t/#") == (end, end)      # `lmqtt admin --session sess`
        assert conn.cmd("stats")["consumer_offsets_reset"] == 3        # sess, cg, fg

        sess = Paho(srv, "sess", clean=False)
        assert sess.session_present
        pub = Paho(srv, "pub")
        new = [f"new-{i}".encode() for i in range(1, n_new + 1)]
        for body in new:
            pub.publish("t/a", body, qos=1)
        assert [m.payload for m in sess.get_n(n_new)] == new
        assert sess.before_sentinel(pub, "t/a") == []                  # nothing more, nothing twice
        pc = conn.consumer("t", "cg")
        fc = conn.filter_consumer("t/#", group="fg")
        assert [r.body for r in poll_n(pc, n_new + 1)][:n_new] == new
        assert [r.body for r in poll_n(fc, n_new + 1)][:n_new] == new
        conn.close()
        sess.disconnect()
        pub.disconnect()
    finally:
        srv.stop()


def _read(reader, start: dict, end: dict) -> list[bytes]:
    """The payloads of the batch Spark would plan from `start` to `end`, read as its tasks do."""
    out = []
    for p in reader.partitions(start, end):
        for b in reader.read(p):
            out += b.column(b.schema.get_field_index("payload")).to_pylist()
    return out


def test_spark_stream_offsets_beyond_the_end_are_read_from_the_end(tmp_path, caplog):
    """A Spark streaming query's checkpoint holds offset 10 (its own, the store keeps nothing of
    it); after the store's log was cut back to 5 entries the restarted query's source clamps it
    when Spark hands it back (commit at restart, then the first batch's start), with a WARNING, and
    the batch reads every new message. The source is driven as Spark's micro-batch engine calls it
    (initialOffset / latestOffset / partitions / read / commit), without a SparkSession."""
    pytest.importorskip("pyarrow")
    source = pytest.importorskip("lmqtt.store.spark.source")
    data = tmp_path / "data"
    data.mkdir()
    srv = LmqttServer(str(data)).start()
    try:
        opts = {"store": srv.store_address, "startingoffsets": "earliest"}
        # a filter read's queues are its first-level topic's ConsumeQueues too: key t:0
        kinds = {"filter": {"filter": "t/#"}, "topic": {"topic": "t"}}
        key = "t:0"
        readers = {kind: source.LmqttStreamReader({**opts, **o}) for kind, o in kinds.items()}
        for r in readers.values():
            r.initialOffset()
        pub = Paho(srv, "pub")
        for i in range(1, 11):
            pub.publish("t/a", f"m-{i}".encode(), qos=1)
        for r in readers.values():
            latest = r.latestOffset()
            assert latest == {key: 10}
            assert _read(r, {key: 0}, latest) == [f"m-{i}".encode() for i in range(1, 11)]
            r.commit(latest)
            r.stop()
        pub.disconnect()
        assert srv.stop() == 0

        segment = sorted(glob.glob(str(data / "store" / "commitlog" / "0*")))[-1]
        os.truncate(segment, record_position(segment, "t/a", b"m-6") + 9)
        srv.start()
        caplog.set_level(logging.WARNING, logger="lmqtt.spark")
        pub = Paho(srv, "pub")
        new = [f"new-{i}".encode() for i in range(1, 7)]
        for kind in readers:
            caplog.clear()
            r = readers[kind] = source.LmqttStreamReader({**opts, **kinds[kind]})
            r.commit({key: 10})                     # Spark, restarting from its checkpoint
            assert (f"offset 10 of queue {key} in the query's checkpoint is beyond the queue's end 5"
                    in caplog.text), kind
        for body in new:
            pub.publish("t/a", body, qos=1)
        for kind, r in readers.items():
            latest = _wait(lambda: (lambda v: v if v == {key: 11} else None)(r.latestOffset()), "the new messages")
            assert _read(r, {key: 10}, latest) == new, kind   # Spark's next batch starts at its 10
            r.commit(latest)
            assert _read(r, latest, latest) == []
            r.stop()
        pub.disconnect()
    finally:
        srv.stop()


def test_store_node_reports_the_cut_on_its_metrics_and_resets_sdk_groups(tmp_path):
    """`lmqtt store` (the store node): an SDK producer and a consumer group, the segment truncated
    to 0 bytes; the restart's /metrics counts the lost bytes and the reset offset, and the group
    reads every message produced afterwards."""
    from tests.support import LmqttStore, free_port
    data = tmp_path / "data"
    data.mkdir()
    mport = free_port()
    node = LmqttStore(str(data), extra_args=("--metrics-port", str(mport))).start()
    try:
        conn = connect(node.address)
        prod = conn.producer()
        for i in range(1, 11):
            prod.send("t/a", f"m-{i}".encode())
        pc = conn.consumer("t", "cg")
        assert len(poll_n(pc, 10)) == 10
        pc.commit()
        conn.close()
        assert node.stop() == 0
        segment = sorted(glob.glob(str(data / "store" / "commitlog" / "0*")))[-1]
        recorded = os.path.getsize(segment)
        os.truncate(segment, 0)
        node.start()
        metrics = _wait(lambda: _get(f"http://127.0.0.1:{mport}/metrics"), "/metrics")
        assert "lmqtt_store_recoveries_total 1\n" in metrics
        assert "lmqtt_store_consumer_offsets_reset_total 1\n" in metrics
        lost = int(metrics.split("\nlmqtt_store_recovery_lost_bytes ")[1].split()[0])
        assert 0 < lost <= recorded
        assert ("consumer group cg: offset 10 of queue t:0 beyond its end 0 after recovery: reset to 0 "
                "(10 entries lost from the log)") in node.log_tail(100_000)
        conn = connect(node.address)
        prod = conn.producer()
        new = [f"new-{i}".encode() for i in range(1, 8)]
        for body in new:
            prod.send("t/a", body)
        assert [r.body for r in poll_n(conn.consumer("t", "cg"), 7)] == new
        conn.close()
    finally:
        node.stop()


def _get(url: str) -> str | None:
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.read().decode()
    except OSError:
        return None
