"""End-to-end: delayed delivery asked for over MQTT, against the embedded `lmqtt serve`
and `lmqtt store` + `lmqtt gateway`: `$delayed/{seconds}/{topic}` at QoS 0/1/2 with paho, the MQTT
5 user property `deliver-at`, refusals of bad forms with their reason code (and the cause in the
log), the ACL checked against the real topic, and a `kill -9` with pending timers (none lost,
none fired twice: counted in the store itself).

Timing: the store's timer wheel runs with its default 1 s precision. "Not before the due time" is
asserted strictly (from a time taken before the PUBLISH was sent); "within" gets a generous
bound (precision + 3 s) because the machine is shared: no tight timing assertion here."""
from __future__ import annotations

import time

import pytest

from lmqtt.gateway.mqtt import ReasonCode as RC, packets as P
from tests.support import LmqttServer, Paho, RawMQTT, both_kinds_fixtures

pytestmark = pytest.mark.timeout(90)

PRECISION_S = 1.0        # StoreConfig.timer_precision_ms default
MARGIN_S = 3.0           # scheduling on a shared 2-core machine


shared_server, lmqtt_server = both_kinds_fixtures()


def _timed(sub: Paho, n: int, timeout: float) -> list[tuple[float, object]]:
    """The next `n` messages with the wall-clock time each arrived (the test client's own thread
    stamps nothing, so stamp as they are taken: a message sits in the queue a moment at most)."""
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        try:
            m = sub.msgs.get(timeout=0.02)
        except Exception:  # noqa: BLE001 - queue.Empty
            continue
        out.append((time.time(), m))
    return out


def _raw_publish(srv, version: int, topic: str, qos: int, pid: int = 1, props=None):
    """PUBLISH with the gateway's own codec; returns (the ack packet or None, the client)."""
    c = RawMQTT(srv, version=version)
    ack = c.connect(f"raw-{pid}-{qos}")
    assert isinstance(ack, P.ConnAck) and ack.reason_code == 0
    c.send(P.Publish(topic, b"x", qos, False, False, pid if qos else None, props or P.Properties()))
    return c


def test_delayed_topic_delivers_on_the_real_topic_after_the_delay_in_time_order(lmqtt_server):
    """At QoS 0, 1 and 2 at once (one wait for all three: each QoS has its own topics and its
    own publisher, and the subscriber's QoS 2 lets each message keep the QoS it was sent with)."""
    sub = Paho(lmqtt_server, "dsub", version=4)
    sub.subscribe("dl/#", 2)
    pubs = {qos: Paho(lmqtt_server, f"dpub-{qos}", version=4) for qos in (0, 1, 2)}
    t0 = time.time()
    for qos, pub in pubs.items():
        pub.publish(f"$delayed/3/dl/{qos}/late", b"late", qos=qos)     # published first, due last
    t1 = time.time()
    for qos, pub in pubs.items():
        pub.publish(f"$delayed/1/dl/{qos}/early", b"early", qos=qos)
        pub.publish(f"dl/{qos}/now", b"now", qos=qos)                   # an ordinary publish is not held back
    got = _timed(sub, 9, timeout=3 + PRECISION_S + MARGIN_S + 2)
    assert len(got) == 9, [m.topic for _t, m in got]
    for qos in (0, 1, 2):
        mine = [(t, m) for t, m in got if m.topic.startswith(f"dl/{qos}/")]
        assert [m.payload for _t, m in mine] == [b"now", b"early", b"late"], f"QoS {qos}: not in due-time order"
        at = {m.payload: t for t, m in mine}
        topics = {m.payload: m.topic for _t, m in mine}
        assert topics == {b"now": f"dl/{qos}/now", b"early": f"dl/{qos}/early", b"late": f"dl/{qos}/late"}
        assert at[b"early"] >= t1 + 1.0, f"QoS {qos}: delivered {at[b'early'] - t1:.3f} s after a 1 s delay"
        assert at[b"late"] >= t0 + 3.0, f"QoS {qos}: delivered {at[b'late'] - t0:.3f} s after a 3 s delay"
        assert at[b"late"] <= t0 + 3.0 + PRECISION_S + MARGIN_S
        assert {m.qos for _t, m in mine} == {qos}
    assert sub.drain(1.5) == []                                     # fired once
    for pub in pubs.values():
        pub.disconnect()
    sub.disconnect()


def test_deliver_at_user_property_epoch_ms_and_rfc3339(lmqtt_server):
    from datetime import datetime, timezone

    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
    sub = Paho(lmqtt_server, "da-sub", version=5)
    sub.subscribe("da/#", 1)
    pub = Paho(lmqtt_server, "da-pub", version=5)
    now = time.time()
    due_ms = int((now + 2.0) * 1000)
    p1 = Properties(PacketTypes.PUBLISH)
    p1.UserProperty = [("deliver-at", str(due_ms)), ("unit", "C")]
    due2 = datetime.fromtimestamp(int(now) + 1, tz=timezone.utc)     # whole seconds, RFC 3339
    p2 = Properties(PacketTypes.PUBLISH)
    p2.UserProperty = [("deliver-at", due2.isoformat().replace("+00:00", "Z"))]
    pub.publish("da/epoch", b"epoch", qos=1, properties=p1)
    pub.publish("da/rfc", b"rfc", qos=1, properties=p2)
    got = _timed(sub, 2, timeout=2 + PRECISION_S + MARGIN_S + 2)
    assert [m.payload for _t, m in got] == [b"rfc", b"epoch"]
    at = {m.payload: t for t, m in got}
    assert at[b"epoch"] * 1000 >= due_ms
    assert at[b"rfc"] >= due2.timestamp()
    assert at[b"epoch"] <= now + 2.0 + PRECISION_S + MARGIN_S
    props = dict(got[1][1].properties.UserProperty)
    assert props["unit"] == "C"                                     # other properties travel as usual
    pub.disconnect()
    sub.disconnect()


BAD_FORMS = [
    ("$delayed/abc/bad/t", None, RC.TOPIC_NAME_INVALID),            # delay not a number
    ("$delayed/5", None, RC.TOPIC_NAME_INVALID),                   # no topic
    ("$delayed/5/", None, RC.TOPIC_NAME_INVALID),                  # empty topic
    ("$delayed/99999999/bad/t", None, RC.TOPIC_NAME_INVALID),      # beyond the 40-day maximum
    ("$delayed/5/$SYS/x", None, RC.TOPIC_NAME_INVALID),            # a $-topic
    ("bad/deliver-at", [("deliver-at", "next tuesday")], RC.PAYLOAD_FORMAT_INVALID),
    ("bad/deliver-at", [("deliver-at", "far")], RC.PAYLOAD_FORMAT_INVALID),          # 50 days ahead, below
]


def test_bad_forms_are_refused_with_a_reason_code_and_logged(lmqtt_server):
    """Each bad form at QoS 1 and 2 over MQTT 5: PUBACK/PUBREC with its reason code and a reason
    string, the connection goes on (an ordinary publish right after is delivered), nothing of the
    refused message is stored, and the log names the cause."""
    sub = Paho(lmqtt_server, "bad-sub", version=4)
    sub.subscribe("#", 1)
    pid = 0
    for qos in (1, 2):
        for topic, props, rc in BAD_FORMS:
            pid += 2
            pp = P.Properties()
            if props:
                far = str(int(time.time() * 1000) + 50 * 86400_000)
                pp.user_property = [(k, far if v == "far" else v) for k, v in props]
            c = _raw_publish(lmqtt_server, 5, topic, qos, pid=pid, props=pp)
            ack = c.recv()
            assert isinstance(ack, P.PubAck if qos == 1 else P.PubRec) and ack.packet_id == pid
            assert ack.reason_code == rc, f"reason code {ack.reason_code:#x} for {topic!r} {props} QoS {qos}"
            assert ack.properties.reason_string                         # the cause, for the client
            c.send(P.Publish("ok/after", b"fine", 1, False, False, pid + 1, P.Properties()))
            ok = c.recv()
            assert isinstance(ok, P.PubAck) and ok.packet_id == pid + 1 and ok.reason_code == 0
            got = sub.get_n(1, timeout=5)
            assert [m.topic for m in got] == ["ok/after"], f"after {topic!r}: {[m.topic for m in got]}"
            c.close()
    assert sub.drain(1.2) == []                                         # nothing of the refused ones stored
    sub.disconnect()
    log = lmqtt_server.log_tail(200000)
    for rc in (RC.TOPIC_NAME_INVALID, RC.PAYLOAD_FORMAT_INVALID):
        assert "event=delayed_publish_refused" in log and f"reason_code=0x{rc:02X}" in log
    assert "the delay must be whole seconds" in log and "neither epoch milliseconds nor an RFC 3339" in log


def test_mqtt311_bad_delayed_form_closes_the_connection_and_stores_nothing(lmqtt_server):
    sub = Paho(lmqtt_server, "b3-sub", version=4)
    sub.subscribe("#", 1)
    c = _raw_publish(lmqtt_server, 4, "$delayed/soon/x/y", 1, pid=3)
    assert c.closed_by_server(5), "3.1.1 has no negative PUBACK: the connection must close"
    assert sub.drain(1.5) == []
    sub.disconnect()


def test_wildcard_in_a_delayed_topic_is_refused_as_an_invalid_topic_name(lmqtt_server):
    """PUBLISH topic names may not hold wildcards at all: the codec refuses the packet before the
    broker sees it, so MQTT 5 gets DISCONNECT 0x90 (not a PUBACK) and the message is not stored."""
    sub = Paho(lmqtt_server, "wc-sub", version=4)
    sub.subscribe("#", 1)
    c = _raw_publish(lmqtt_server, 5, "$delayed/1/a/+", 1, pid=4)
    pkt = c.recv()
    assert isinstance(pkt, P.Disconnect) and pkt.reason_code == RC.TOPIC_NAME_INVALID
    assert sub.drain(2.0) == []
    sub.disconnect()


def test_acl_is_checked_against_the_real_topic(tmp_path):
    acl = tmp_path / "acl"
    acl.write_text("topic readwrite allowed/#\n")          # nothing about $delayed/
    srv = LmqttServer(str(tmp_path / "data"), ("--acl-file", str(acl)),
                      log_path=str(tmp_path / "serve.log")).start()
    try:
        sub = Paho(srv, "acl-sub", version=4)
        sub.subscribe("allowed/#", 1)
        c = _raw_publish(srv, 5, "$delayed/1/denied/x", 1, pid=5)     # the real topic decides
        ack = c.recv()
        assert isinstance(ack, P.PubAck) and ack.reason_code == RC.NOT_AUTHORIZED
        c.send(P.Publish("$delayed/1/allowed/x", b"yes", 1, False, False, 6, P.Properties()))
        ack = c.recv()
        assert isinstance(ack, P.PubAck) and ack.reason_code == 0
        got = sub.get_n(1, timeout=1 + PRECISION_S + MARGIN_S)
        assert [(m.topic, m.payload) for m in got] == [("allowed/x", b"yes")]
        c.close()
        sub.disconnect()
    finally:
        srv.stop()


@pytest.mark.slow
def test_kill_9_with_pending_timers_loses_none_and_fires_none_twice(lmqtt_server):
    """40 QoS 1 `$delayed/` publishes due over 1..5 s; the server (both processes in the fleet) is
    killed with SIGKILL after ~2.5 s, when some fired and most are pending, and restarted. Every
    message reaches the persistent subscriber, and the store holds each exactly once under its
    real topic (the timer's exactly-once firing, counted in the topic's ConsumeQueue)."""
    from lmqtt.store.client import connect
    n = 40
    sub = Paho(lmqtt_server, "kd-sub", version=4, clean=False)
    sub.subscribe("kd/#", 1)
    pub = Paho(lmqtt_server, "kd-pub", version=4)
    t0 = time.time()
    for i in range(n):
        pub.publish(f"$delayed/{1 + i % 5}/kd/{i % 4}", b"%d" % i, qos=1)   # each PUBACK: the timer is durable
    pub.disconnect()
    before = {int(m.payload) for m in sub.drain(max(0.0, t0 + 2.5 - time.time()))}
    sub.c.loop_stop()
    while not sub.msgs.empty():       # arrived (and acknowledged by paho) after the drain
        before.add(int(sub.msgs.get_nowait().payload))
    assert 0 < len(before) < n, f"the kill must land with timers both fired and pending ({len(before)} of {n})"
    lmqtt_server.restart(kill=True)
    sub = Paho(lmqtt_server, "kd-sub", version=4, clean=False)
    got = set(before)
    deadline = time.monotonic() + max(0.0, t0 + 8 + PRECISION_S - time.time()) + MARGIN_S + 5
    while len(got) < n and time.monotonic() < deadline:
        try:
            got.add(int(sub.get(timeout=0.5).payload))
        except Exception:  # noqa: BLE001 - queue.Empty
            pass
    sub.disconnect()
    bodies = []
    with connect(lmqtt_server.store_address) as c:
        off = 0
        while True:
            r = c.pull("kd", 0, off, 1000)
            if not r.records:
                break
            bodies += [int(x.body) for x in r.records]
            off = r.next_offset
    assert sorted(bodies) == list(range(n)), "a timer fired twice (or never) in the store"
    assert got == set(range(n)), f"lost across the kill: {sorted(set(range(n)) - got)}"


def test_zero_delay_qos0_refusal_and_retain_flag(lmqtt_server):
    """`$delayed/0/t` is an ordinary publish on t; a bad form at QoS 0 (no ack exists) is dropped
    and logged, the connection goes on; a delayed publish with RETAIN does not replace t's
    retained message."""
    sub = Paho(lmqtt_server, "z-sub", version=4)
    sub.subscribe("dz/#", 1)
    pub = Paho(lmqtt_server, "z-pub", version=5)
    pub.publish("dz/kept", b"retained-before", qos=1, retain=True)
    assert [m.payload for m in sub.get_n(1, timeout=5)] == [b"retained-before"]
    t0 = time.time()
    pub.publish("$delayed/0/dz/now", b"zero", qos=1)
    got = sub.get_n(1, timeout=5)
    assert [(m.topic, m.payload) for m in got] == [("dz/now", b"zero")]
    assert time.time() - t0 < PRECISION_S                  # not parked for a tick
    pub.publish("$delayed/x/dz/bad", b"dropped", qos=0)
    pub.publish("$delayed/1/dz/kept", b"delayed-retain", qos=1, retain=True)
    got = sub.get_n(1, timeout=1 + PRECISION_S + MARGIN_S)
    assert [(m.topic, m.payload) for m in got] == [("dz/kept", b"delayed-retain")]
    assert sub.drain(0.5) == []                             # the QoS 0 bad form was not stored
    late = Paho(lmqtt_server, "z-late", version=4)
    late.subscribe("dz/kept", 1)
    assert [m.payload for m in late.get_n(1, timeout=5)] == [b"retained-before"]
    assert "event=delayed_publish_refused" in lmqtt_server.log_tail(20000)
    for c in (late, pub, sub):
        c.disconnect()
