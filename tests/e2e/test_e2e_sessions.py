"""End-to-end: persistent sessions (incl. restart of `lmqtt serve` by SIGTERM and kill -9), session
expiry, takeover, keepalive timeout, will messages."""
from __future__ import annotations

import socket
import time

import pytest

from tests.support import Paho, RawMQTT, both_kinds_fixtures, mixed_publish_props
from lmqtt.gateway.mqtt import packets as P


shared_server, lmqtt_server = both_kinds_fixtures()


pytestmark = pytest.mark.timeout(90)


def _persistent(server, cid, version):
    if version == 5:
        return Paho(server, cid, version=5, clean=False, expiry=3600)
    return Paho(server, cid, version=4, clean=False)


@pytest.mark.parametrize("version", [4, 5])
def test_persistent_session_gets_messages_published_while_offline(lmqtt_server, version):
    s = _persistent(lmqtt_server, f"offline-{version}", version)
    s.subscribe("off/#", 1)
    s.disconnect()
    pub = Paho(lmqtt_server, f"offline-pub-{version}")
    for i in range(30):
        pub.publish(f"off/{i % 2}", f"{i}".encode(), qos=1)
    s = _persistent(lmqtt_server, f"offline-{version}", version)
    assert s.session_present
    got = s.get_n(30)
    assert [m.payload for m in got] == [f"{i}".encode() for i in range(30)]
    assert s.before_sentinel(pub, "off/0") == []          # nothing more, nothing twice


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "kill9"])
@pytest.mark.parametrize("version", [4, 5])
def test_persistent_qos1_survives_server_restart(lmqtt_server, kill, version):
    """Subscribe, go offline, QoS 1 messages acknowledged by the server, restart the server
    (clean stop or kill -9), reconnect: every acknowledged message arrives, in publish order."""
    cid = f"restart-{version}-{int(kill)}"
    s = _persistent(lmqtt_server, cid, version)
    s.subscribe("rs/+/data", 1)
    s.disconnect()
    pubs = [Paho(lmqtt_server, f"rs-pub{k}") for k in range(2)]
    n = 50
    for i in range(n):
        for k, p in enumerate(pubs):
            p.publish(f"rs/{k}/data", f"{k}:{i}".encode(), qos=1)   # returns after PUBACK
    for p in pubs:
        p.disconnect()
    lmqtt_server.restart(kill=kill)
    s = _persistent(lmqtt_server, cid, version)
    assert s.session_present
    got = s.get_n(2 * n, timeout=20)
    got += s.before_sentinel(Paho(lmqtt_server, f"{cid}-sentinel"), "rs/0/data")   # and nothing twice
    by_pub: dict[str, list[int]] = {"0": [], "1": []}
    for m in got:
        k, i = m.payload.decode().split(":")
        by_pub[k].append(int(i))
    assert by_pub["0"] == list(range(n))     # none lost, order kept per publisher
    assert by_pub["1"] == list(range(n))


def test_unacked_inflight_redelivered_after_kill9_of_server(lmqtt_server):
    """Messages sent but never PUBACKed by the subscriber (raw client that does not ack) come
    back after a kill -9 of the server: the offset only moves on PUBACK."""
    raw = RawMQTT(lmqtt_server, version=4)
    assert raw.connect("noack", clean=False).reason_code == 0
    raw.send(P.Subscribe(1, [P.SubscriptionRequest("na/t", 1)]))
    assert isinstance(raw.recv(), P.SubAck)
    pub = Paho(lmqtt_server, "noack-pub")
    for i in range(5):
        pub.publish("na/t", f"{i}".encode(), qos=1)
    first = [raw.recv() for _ in range(5)]
    assert [p.payload for p in first] == [f"{i}".encode() for i in range(5)]
    raw.send(P.PubAck(first[0].packet_id))      # ack only the first
    time.sleep(0.5)                             # offsets are flushed every 100 ms
    raw.close()
    pub.disconnect()
    lmqtt_server.restart(kill=True)
    s = Paho(lmqtt_server, "noack", clean=False)
    got = [m.payload for m in s.get_n(4) + s.before_sentinel(Paho(lmqtt_server, "noack-sentinel"), "na/t")]
    assert got == [b"1", b"2", b"3", b"4"]


def test_inflight_resent_with_dup_on_reconnect(lmqtt_server):
    raw = RawMQTT(lmqtt_server, version=4)
    raw.connect("dupper", clean=False)
    raw.send(P.Subscribe(1, [P.SubscriptionRequest("dup/t", 1)]))
    raw.recv()
    pub = Paho(lmqtt_server, "dup-pub")
    pub.publish("dup/t", b"x", qos=1)
    first = raw.recv()
    assert first.dup is False
    raw.close()                                  # no PUBACK
    raw = RawMQTT(lmqtt_server, version=4)
    ack = raw.connect("dupper", clean=False)
    assert ack.session_present
    again = raw.recv()
    assert isinstance(again, P.Publish)
    assert (again.payload, again.dup, again.packet_id) == (b"x", True, first.packet_id)
    raw.send(P.PubAck(again.packet_id))
    raw.close()


def _publish_mixed_backlog(pub: Paho, topic: str, n: int) -> list[tuple]:
    """n messages to `topic`: mostly QoS 1 without properties (what a reader's backlog sends as
    encoded runs), broken by QoS 0, user properties and message expiry (sent message by message).
    Returns what each should arrive as: (payload, qos published, user property, expiry)."""
    sent = []
    for i in range(n):
        qos = 0 if i % 13 == 4 else 1
        props, up, exp = mixed_publish_props(i, (19, 7), (31, 11))
        pub.publish(topic, f"m{i}".encode(), qos=qos, properties=props)
        sent.append((f"m{i}", qos, up, exp))
    return sent


@pytest.mark.parametrize("version", [4, 5])
def test_mixed_backlog_arrives_complete_and_in_order_after_reconnect(lmqtt_server, version):
    """An offline session's backlog mixing plain QoS 1 (encoded as runs) with QoS 0, MQTT 5 user
    properties and message expiry (per message) arrives complete, in queue order, each message
    with its own QoS and properties, through a small in-flight window (runs broken by a full
    window as well as by the per-message ones)."""
    cid = f"mixbl-{version}"
    topic = f"mixbl{version}/t"
    s = _persistent(lmqtt_server, cid, version)
    s.subscribe(topic, 1)
    s.disconnect()
    pub = Paho(lmqtt_server, f"{cid}-pub", version=5)
    sent = _publish_mixed_backlog(pub, topic, 700)
    if version == 5:
        s = Paho(lmqtt_server, cid, version=5, clean=False, expiry=3600, receive_maximum=37)
    else:
        s = _persistent(lmqtt_server, cid, version)
    assert s.session_present
    got = s.get_n(len(sent), timeout=30)
    assert [m.payload.decode() for m in got] == [x[0] for x in sent]
    assert [m.qos for m in got] == [x[1] for x in sent]
    assert not any(m.dup for m in got)
    if version == 5:
        for m, (_, _, up, exp) in zip(got, sent):
            assert (getattr(m.properties, "UserProperty", None) or []) == ([up] if up else [])
            left = getattr(m.properties, "MessageExpiryInterval", None)
            assert (left is None) == (exp is None) and (left is None or 3590 <= left <= 3600)
    assert s.before_sentinel(pub, topic) == []          # nothing more, nothing twice


def _collect(raw: RawMQTT, wait: float = 0.5) -> list:
    """PUBLISHes arriving until none came for `wait` seconds (bounded by the server's window)."""
    out = []
    while True:
        try:
            pkt = raw.recv(timeout=wait)
        except socket.timeout:
            return out
        assert pkt is not None, "closed by the server"
        if isinstance(pkt, P.Publish):
            out.append(pkt)


@pytest.mark.parametrize("version", [4, 5])
def test_reconnect_mid_backlog_redelivers_unacked_with_dup_none_lost(lmqtt_server, version):
    """Reconnect to a backlog, take part of it and acknowledge only some, drop the connection;
    reconnect again: every QoS 1 message left unacknowledged comes again first, with DUP and its
    packet id, in order, then the rest of the backlog - nothing lost, nothing else twice."""
    cid = f"midbl-{version}"
    topic = f"midbl{version}/t"
    props = P.Properties()
    props.session_expiry_interval = 3600
    props.receive_maximum = 40
    raw = RawMQTT(lmqtt_server, version=version)
    assert raw.connect(cid, clean=False, props=props if version == 5 else None).reason_code == 0
    raw.send(P.Subscribe(1, [P.SubscriptionRequest(topic, 1)]))
    assert isinstance(raw.recv(), P.SubAck)
    raw.close()
    pub = Paho(lmqtt_server, f"{cid}-pub", version=5)
    # v5: a window of 40 stops the first reconnect mid-backlog; 3.1.1 has no Receive Maximum
    # (the server's max_inflight, 1,000): a backlog longer than that
    n = 300 if version == 5 else 1300
    sent = _publish_mixed_backlog(pub, topic, n)
    raw = RawMQTT(lmqtt_server, version=version)
    assert raw.connect(cid, clean=False, props=props if version == 5 else None).session_present
    first = _collect(raw)
    assert 0 < len(first) < n and not any(p.dup for p in first)
    qos1 = [p for p in first if p.qos == 1]
    for p in qos1[:10]:
        raw.send(P.PubAck(p.packet_id))
    first += _collect(raw)        # the acks opened the window: more of the backlog
    raw.close()
    acked = {p.packet_id for p in qos1[:10]}
    unacked = [p for p in first if p.qos == 1 and p.packet_id not in acked]
    assert unacked and len(first) < n
    assert [p.payload.decode() for p in first] == [x[0] for x in sent[:len(first)]]

    raw = RawMQTT(lmqtt_server, version=version)
    assert raw.connect(cid, clean=False, props=props if version == 5 else None).session_present
    again: list = []
    for _ in range(len(unacked)):
        pkt = raw.recv()
        assert isinstance(pkt, P.Publish)
        again.append(pkt)
    assert [(p.payload, p.packet_id, p.qos, p.dup) for p in again] == \
        [(p.payload, p.packet_id, 1, True) for p in unacked]
    rest: list = []
    for p in again:
        raw.send(P.PubAck(p.packet_id))
    for _ in range(4 * n):         # bounded: each round takes what the window lets through
        if len(first) + len(rest) >= n:
            break
        more = _collect(raw, 1.0)
        assert more, f"stalled after {len(first) + len(rest)} of {n}"
        for p in more:
            if p.qos:
                raw.send(P.PubAck(p.packet_id))
        rest += more
    assert not any(p.dup for p in rest)
    assert [p.payload.decode() for p in first + rest] == [x[0] for x in sent]    # none lost, none twice
    assert [p.qos for p in first + rest] == [x[1] for x in sent]
    assert _collect(raw, 0.3) == []
    raw.close()


def test_kill9_mid_backlog_resumes_at_the_first_unacked(lmqtt_server):
    """Part of a backlog sent as runs and partly acknowledged, then kill -9 of the server while
    the client is connected: after the restart delivery resumes at the first unacknowledged QoS 1
    message (what the cursor committed), so none is lost; the acknowledged ones before it do not
    come again. (A session that went offline before the crash keeps its exchanges instead, and
    its QoS 0 messages already sent do not come again: test_e2e_inflight_restart.py.)"""
    cid = "k9bl"
    topic = "k9bl/t"
    props = P.Properties()
    props.session_expiry_interval = 3600
    props.receive_maximum = 40
    raw = RawMQTT(lmqtt_server, version=5)
    assert raw.connect(cid, clean=False, props=props).reason_code == 0
    raw.send(P.Subscribe(1, [P.SubscriptionRequest(topic, 1)]))
    assert isinstance(raw.recv(), P.SubAck)
    raw.close()
    pub = Paho(lmqtt_server, f"{cid}-pub", version=5)
    sent = _publish_mixed_backlog(pub, topic, 200)
    pub.disconnect()
    raw = RawMQTT(lmqtt_server, version=5)
    assert raw.connect(cid, clean=False, props=props).session_present
    first = _collect(raw)
    qos1 = [i for i, p in enumerate(first) if p.qos == 1]
    assert len(qos1) == 40 and [p.payload.decode() for p in first] == [x[0] for x in sent[:len(first)]]
    for i in qos1[:10]:
        raw.send(P.PubAck(first[i].packet_id))
    time.sleep(0.5)                             # offsets are flushed every 100 ms
    lmqtt_server.restart(kill=True)             # while the client is still connected: a session
    raw.close()                                 # seen going offline first keeps its exchanges instead
    s = Paho(lmqtt_server, cid, version=5, clean=False, expiry=3600)
    assert s.session_present
    k = qos1[10]                                # the first message never acknowledged
    got = s.get_n(len(sent) - k, timeout=20)
    assert [m.payload.decode() for m in got] == [x[0] for x in sent[k:]]
    assert s.before_sentinel(Paho(lmqtt_server, f"{cid}-sentinel", version=5), topic) == []


def test_clean_session_discards_state(lmqtt_server):
    s = Paho(lmqtt_server, "cleaner", clean=False)
    s.subscribe("cl/t", 1)
    s.disconnect()
    s = Paho(lmqtt_server, "cleaner", clean=True)
    assert not s.session_present
    pub = Paho(lmqtt_server, "cleaner-pub")
    pub.publish("cl/t", b"x", qos=1)
    assert s.drain(0.5) == []


def test_mqtt5_session_expiry(lmqtt_server):
    s = Paho(lmqtt_server, "expiring", version=5, clean=False, expiry=1)
    s.subscribe("exp/t", 1)
    s.disconnect()
    time.sleep(2.0)
    s = Paho(lmqtt_server, "expiring", version=5, clean=False, expiry=60)
    assert not s.session_present


def test_mqtt5_zero_expiry_session_ends_at_disconnect(lmqtt_server):
    s = Paho(lmqtt_server, "zero-exp", version=5, clean=False, expiry=0)
    s.subscribe("ze/t", 1)
    s.disconnect()
    s = Paho(lmqtt_server, "zero-exp", version=5, clean=False, expiry=0)
    assert not s.session_present


def test_takeover_closes_first_connection_mqtt5_reason(lmqtt_server):
    first = RawMQTT(lmqtt_server, version=5)
    assert first.connect("twin").reason_code == 0
    second = Paho(lmqtt_server, "twin", version=5)
    d = first.recv()
    assert isinstance(d, P.Disconnect) and d.reason_code == 0x8E
    assert first.recv() is None                 # then the socket is closed
    second.subscribe("tw/t", 0)
    second.publish("tw/t", b"alive", qos=1)
    assert second.get().payload == b"alive"


def test_takeover_mqtt311_keeps_persistent_subscriptions(lmqtt_server):
    a = Paho(lmqtt_server, "twin4", clean=False)
    a.subscribe("tw4/t", 1)
    b = Paho(lmqtt_server, "twin4", clean=False)
    assert b.session_present
    a.c.loop_stop()
    pub = Paho(lmqtt_server, "twin4-pub")
    pub.publish("tw4/t", b"to-b", qos=1)
    assert b.get().payload == b"to-b"


def test_empty_client_id_rules_mqtt311(lmqtt_server):
    raw = RawMQTT(lmqtt_server, version=4)
    ack = raw.connect("", clean=False)
    assert ack.reason_code == 0x02              # identifier rejected
    assert raw.recv() is None
    raw = RawMQTT(lmqtt_server, version=4)
    assert raw.connect("", clean=True).reason_code == 0


def test_keepalive_timeout_closes_and_sends_will(lmqtt_server):
    watcher = Paho(lmqtt_server, "ka-watch")
    watcher.subscribe("will/ka", 1)
    raw = RawMQTT(lmqtt_server, version=5)
    ack = raw.connect("ka-client", keepalive=1, will=P.Will("will/ka", b"gone", 1, False))
    assert ack.reason_code == 0
    d = raw.recv(timeout=6)                      # silent client: closed after 1.5 x keepalive
    assert isinstance(d, P.Disconnect) and d.reason_code == 0x8D
    assert watcher.get().payload == b"gone"


def test_keepalive_respected_while_client_pings(lmqtt_server):
    raw = RawMQTT(lmqtt_server, version=4)
    raw.connect("pinger", keepalive=1)
    for _ in range(4):
        time.sleep(0.6)
        raw.send(P.PingReq())
        assert isinstance(raw.recv(), P.PingResp)


@pytest.mark.parametrize("version", [4, 5])
def test_will_on_abnormal_close_not_on_disconnect(lmqtt_server, version):
    watcher = Paho(lmqtt_server, f"will-watch-{version}")
    watcher.subscribe("will/#", 1)
    # abnormal: the client's socket is killed without DISCONNECT
    raw = RawMQTT(lmqtt_server, version=version)
    raw.connect(f"dies-{version}", will=P.Will(f"will/dies{version}", b"died", 1, False))
    raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    raw.close()                                  # RST
    m = watcher.get()
    assert (m.topic, m.payload) == (f"will/dies{version}", b"died")
    # clean: DISCONNECT (0x00) discards the will
    raw = RawMQTT(lmqtt_server, version=version)
    raw.connect(f"polite-{version}", will=P.Will(f"will/polite{version}", b"never", 1, False))
    raw.send(P.Disconnect(0))
    assert raw.recv() is None
    assert watcher.drain(0.7) == []


def test_mqtt5_disconnect_with_will_message_sends_will(lmqtt_server):
    watcher = Paho(lmqtt_server, "w04-watch")
    watcher.subscribe("will/w04", 1)
    raw = RawMQTT(lmqtt_server, version=5)
    raw.connect("w04", will=P.Will("will/w04", b"asked", 1, False))
    raw.send(P.Disconnect(0x04))
    assert watcher.get().payload == b"asked"


def test_mqtt5_will_delay_cancelled_by_reconnect(lmqtt_server):
    watcher = Paho(lmqtt_server, "wd-watch")
    watcher.subscribe("will/delay", 1)
    props = P.Properties(session_expiry_interval=60)
    wprops = P.Properties(will_delay_interval=1)
    raw = RawMQTT(lmqtt_server, version=5)
    raw.connect("wd", clean=False, will=P.Will("will/delay", b"late", 1, False, wprops), props=props)
    raw.close()
    raw = RawMQTT(lmqtt_server, version=5)       # back within the delay: no will
    assert raw.connect("wd", clean=False, props=props).session_present
    assert watcher.drain(1.6) == []
    raw.close()                                  # gone for good (no will this time: not set)
    # and a delayed will that is not cancelled arrives after the delay
    raw = RawMQTT(lmqtt_server, version=5)
    raw.connect("wd2", clean=False, will=P.Will("will/delay", b"late2", 1, False, wprops), props=props)
    raw.close()
    assert watcher.drain(0.5) == []
    assert watcher.get(timeout=3).payload == b"late2"


def test_will_published_by_takeover(lmqtt_server):
    watcher = Paho(lmqtt_server, "tw-watch")
    watcher.subscribe("will/takeover", 1)
    raw = RawMQTT(lmqtt_server, version=4)
    raw.connect("tk", will=P.Will("will/takeover", b"replaced", 1, False))
    Paho(lmqtt_server, "tk")
    assert watcher.get().payload == b"replaced"


def test_session_expiry_counts_while_server_is_down(lmqtt_server):
    s = Paho(lmqtt_server, "exp-restart", version=5, clean=False, expiry=2)
    s.subscribe("expr/t", 1)
    keep = Paho(lmqtt_server, "exp-keep", version=5, clean=False, expiry=3600)
    keep.subscribe("expr/t", 1)
    s.disconnect()
    keep.disconnect()
    lmqtt_server.stop()
    time.sleep(2.5)
    lmqtt_server.start()
    s = Paho(lmqtt_server, "exp-restart", version=5, clean=False, expiry=60)
    assert not s.session_present            # expired while the server was down
    keep = Paho(lmqtt_server, "exp-keep", version=5, clean=False, expiry=3600)
    assert keep.session_present
