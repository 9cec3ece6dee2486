"""An inbound QoS 2 PUBLISH of a persistent session cut by a crash between its append and the
write of its packet id as stored: its id is written to the session record as pending
BEFORE the append, with a unique key the message carries (gateway/broker/broker.py `_qos2_ahead`),
and when the record is read back the store settles it against its log's key index
(lightqueue/records.py `resolve_pending_qos2`): stored -> "stored, awaiting PUBREL" (the client's
PUBLISH sent again is answered, not stored twice), not stored -> still pending (stored when sent
again, with the same key: at most once, store/unique_keys.py).
Before, the id was written only after the append: a message appended just before the crash was
stored a second time when the publisher sent it again (DUP)."""
from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from lmqtt.gateway.mqtt import packets as P
from tests.e2e.test_e2e_qos2_crash import _stored
from tests.support import LmqttFleet, RawMQTT


@pytest.fixture
def fleet(tmp_path):
    f = LmqttFleet(str(tmp_path / "store-data"), log_dir=str(tmp_path)).start()
    try:
        yield f
    finally:
        if f.store.proc is not None and f.store.proc.poll() is None:
            os.kill(f.store.proc.pid, signal.SIGCONT)
        f.stop()


def test_qos2_publish_in_flight_at_a_gateway_kill_is_stored_once(fleet):
    """The store is stopped (SIGSTOP) while a QoS 2 PUBLISH reaches the gateway, which is then
    killed (-9) with the publish on its way to the store; the store resumes and reads what the
    dead gateway had sent. The publisher sends the PUBLISH again (DUP) to the restarted gateway:
    the message is stored once (before: the dead gateway's append reached the log without any
    trace in the session record, and the DUP was stored a second time)."""
    pub = RawMQTT(fleet)
    assert isinstance(pub.connect("pub", clean=False), P.ConnAck)
    pub.send(P.Publish("t/a", b"m0", qos=2, packet_id=10))
    assert isinstance(pub.recv(timeout=10.0), P.PubRec)
    pub.send(P.PubRel(10))
    assert isinstance(pub.recv(timeout=10.0), P.PubComp)

    store_pid = fleet.store.proc.pid
    os.kill(store_pid, signal.SIGSTOP)
    try:
        pub.send(P.Publish("t/a", b"in", qos=2, packet_id=50))
        time.sleep(1.0)                      # the gateway reads it and writes to the store's socket
        fleet.gateway.stop(signal.SIGKILL)
    finally:
        os.kill(store_pid, signal.SIGCONT)
    assert pub.closed_by_server(timeout=10.0)
    pub.close()
    fleet.gateway.start()

    pub = RawMQTT(fleet)
    assert pub.connect("pub", clean=False).session_present is True
    pub.send(P.Publish("t/a", b"in", qos=2, dup=True, packet_id=50))
    assert isinstance(pub.recv(timeout=10.0), P.PubRec)
    pub.send(P.PubRel(50))
    assert isinstance(pub.recv(timeout=10.0), P.PubComp)
    pub.close()
    assert dict(_stored(fleet, "t/#")) == {b"m0": 1, b"in": 1}, fleet.log_tail()


def test_pending_qos2_ids_are_settled_against_the_log(tmp_path, caplog):
    """The store side of it, on a real store and metadata DB: a session record read back with
    pending inbound ids knows the one whose message (by its key) is in the log as stored, awaiting
    PUBREL, and keeps the one whose message is not pending with its key (a stalled gateway may
    still append it); a record without pending ids is untouched."""
    from lmqtt.lightqueue import LightQueueStore
    from lmqtt.lightqueue.records import INFLIGHT, QOS2_KEY_PREFIX, SessionRecord
    from lmqtt.store import Message, MessageStore, StoreConfig

    store = MessageStore(StoreConfig(data_dir=str(tmp_path / "store"), segment_size=1 << 24, preallocate=False))
    lq = LightQueueStore(store, str(tmp_path / "lq"))
    store.start()
    try:
        now = int(time.time() * 1000)
        stored_key, lost_key = QOS2_KEY_PREFIX + "a1", QOS2_KEY_PREFIX + "b2"
        r = store.append(Message("t/a", b"in", keys=(stored_key,), born_ts=now,
                                 dispatch_queues=lq.queues_for_topic("t/a")))
        assert store.wait_dispatched(r.phys_offset + r.size, 10)
        state = {"out": [], "next": {}, "in2": [7], "pid": 3,
                 "in2p": [[50, "t/a", stored_key, now], [51, "t/a", lost_key, now]]}
        lq.metadata.put_session("pub", SessionRecord("pub", expiry_interval=60, extra={INFLIGHT: state}))
        lq.metadata.put_session("old", SessionRecord("old", expiry_interval=60, extra={INFLIGHT: {"in2": [9]}}))
        caplog.set_level(logging.INFO, logger="lmqtt.lightqueue.metadata")
        got = lq.metadata.get_session("pub").extra[INFLIGHT]
        assert got["in2"] == [7, 50] and got["in2p"] == [[51, "t/a", lost_key, now]]
        # each lookup is logged: it decides whether the PUBLISH sent again is stored or a duplicate
        assert [r.getMessage() for r in caplog.records if "qos2_pending_settled" in r.getMessage()] == [
            f"event=qos2_pending_settled client_id=pub key={stored_key} stored=True",
            f"event=qos2_pending_settled client_id=pub key={lost_key} stored=False"]
        listed = {rec.client_id: rec.extra[INFLIGHT] for rec in lq.metadata.list_sessions()}
        assert listed["pub"]["in2"] == [7, 50] and listed["pub"]["in2p"] == [[51, "t/a", lost_key, now]]
        assert listed["old"] == {"in2": [9]}
    finally:
        lq.close()
        store.shutdown()


@pytest.mark.parametrize("late", ["after the resend", "before the resend"])
def test_a_stalled_gateways_late_append_and_the_resent_publish_store_the_message_once(fleet, late):
    """A gateway wrote a QoS 2 id ahead (pending, with the key its message carries) and stalled
    before its PRODUCE left (SIGSTOP, a VM pause); the client reconnected to another gateway,
    which found no message with that key in the log. The stalled gateway's PRODUCE then reaches
    the store late - after the client's PUBLISH sent again was stored, or between the reconnect
    and the resend. Either way the message is stored once: the pending id keeps its key, the
    resend carries it, and the store keeps one record per key (store/unique_keys.py). Before,
    the reconnect forgot the id and the resend got a new key: stored twice (`lmqtt bench chaos`,
    a fleet gateway stopped). The test plays the stalled gateway: it writes the session record
    as that gateway left it, and sends its PRODUCE."""
    from lmqtt.lightqueue.records import INFLIGHT, QOS2_KEY_PREFIX, SessionRecord
    from lmqtt.store import protocol as W
    from lmqtt.store.client.connection import check_reply, connect
    from lmqtt.store.client.producer import make_props

    now = int(time.time() * 1000)
    key = QOS2_KEY_PREFIX + "5ta11ed0"
    state = {"out": [], "next": {}, "in2": [], "pid": 1, "in2p": [[50, "t/a", key, now]]}
    rec = SessionRecord("pub", protocol_version=4, expiry_interval=0xFFFFFFFF, last_disconnect_ms=now,
                        extra={INFLIGHT: state, "gateway": "gw-stalled"})
    with connect(fleet.store.address) as c:
        c.cmd("gw_put_session", client_id="pub", rec=rec.to_bytes().decode())

        def stalled_append():
            body = W.encode_produce("", 0, 1, W.encode_messages_for_produce(
                [("t/a", b"in", (key,), make_props(qos=2), 0, now)]))
            check_reply(c.request(W.OP_PRODUCE, body, W.F_UNIQUE_KEYS).result(10))

        pub = RawMQTT(fleet)
        assert pub.connect("pub", clean=False).session_present is True
        if late == "before the resend":
            stalled_append()
        pub.send(P.Publish("t/a", b"in", qos=2, dup=True, packet_id=50))
        rec_ = pub.recv(timeout=10.0)
        assert isinstance(rec_, P.PubRec) and rec_.reason_code == 0, rec_
        if late == "after the resend":
            stalled_append()
        pub.send(P.PubRel(50))
        assert isinstance(pub.recv(timeout=10.0), P.PubComp)
        pub.close()
    assert dict(_stored(fleet, "t/#")) == {b"in": 1}, fleet.log_tail()
