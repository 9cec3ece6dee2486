"""End-to-end QoS mechanics seen on the wire (raw codec client): QoS 2 handshakes, duplicate
suppression, the Receive Maximum window, the `sync` flush mode, wills stored across a crash."""
from __future__ import annotations

import pytest

from tests.support import LmqttServer, Paho, RawMQTT, both_kinds_fixtures
from lmqtt.gateway.mqtt import packets as P


shared_server, lmqtt_server = both_kinds_fixtures()


pytestmark = pytest.mark.timeout(60)


def _sub(server, cid, flt, qos, version=4, props=None, clean=True):
    r = RawMQTT(server, version=version)
    assert r.connect(cid, clean=clean, props=props).reason_code == 0
    r.send(P.Subscribe(1, [P.SubscriptionRequest(flt, qos)]))
    assert isinstance(r.recv(), P.SubAck)
    return r


def test_inbound_qos2_duplicate_before_pubrel_is_delivered_once(lmqtt_server):
    watcher = Paho(lmqtt_server, "q2-watch")
    watcher.subscribe("q2/t", 2)
    pub = RawMQTT(lmqtt_server, version=4)
    pub.connect("q2-pub")
    pub.send(P.Publish("q2/t", b"once", 2, packet_id=42))
    rec = pub.recv()
    assert isinstance(rec, P.PubRec) and rec.packet_id == 42
    pub.send(P.Publish("q2/t", b"once", 2, dup=True, packet_id=42))   # retransmission
    rec2 = pub.recv()
    assert isinstance(rec2, P.PubRec) and rec2.packet_id == 42
    pub.send(P.PubRel(42))
    comp = pub.recv()
    assert isinstance(comp, P.PubComp) and comp.packet_id == 42
    got = watcher.get_n(1) + watcher.before_sentinel(watcher, "q2/t")
    assert [(m.payload, m.qos) for m in got] == [(b"once", 2)]


def test_outbound_qos2_handshake(lmqtt_server):
    sub = _sub(lmqtt_server, "q2-raw-sub", "q2o/t", 2)
    Paho(lmqtt_server, "q2o-pub").publish("q2o/t", b"exactly", qos=2)
    p = sub.recv()
    assert isinstance(p, P.Publish) and (p.qos, p.payload) == (2, b"exactly")
    sub.send(P.PubRec(p.packet_id))
    rel = sub.recv()
    assert isinstance(rel, P.PubRel) and rel.packet_id == p.packet_id
    sub.send(P.PubComp(p.packet_id))
    sub.send(P.PingReq())
    assert isinstance(sub.recv(), P.PingResp)     # nothing else pending


def test_receive_maximum_limits_unacked_messages(lmqtt_server):
    sub = _sub(lmqtt_server, "rm-sub", "rm/t", 1, version=5, props=P.Properties(receive_maximum=3))
    pub = Paho(lmqtt_server, "rm-pub")
    for i in range(10):
        pub.publish("rm/t", f"{i}".encode(), qos=1)
    first = [sub.recv() for _ in range(3)]
    assert [p.payload for p in first] == [b"0", b"1", b"2"]
    sub.send(P.PingReq())
    assert isinstance(sub.recv(), P.PingResp)        # window full: nothing more was sent
    got = [p.payload for p in first]
    pending = list(first)
    while len(got) < 10:
        sub.send(P.PubAck(pending.pop(0).packet_id))
        p = sub.recv()
        assert isinstance(p, P.Publish)
        pending.append(p)
        got.append(p.payload)
    assert got == [f"{i}".encode() for i in range(10)]


def test_retained_qos1_respect_window(lmqtt_server):
    pub = Paho(lmqtt_server, "rw-pub")
    for i in range(6):
        pub.publish(f"rw/{i}", f"{i}".encode(), qos=1, retain=True)
    sub = _sub(lmqtt_server, "rw-sub", "rw/+", 1, version=5, props=P.Properties(receive_maximum=2))
    seen = []
    outstanding = [sub.recv(), sub.recv()]
    sub.send(P.PingReq())
    assert isinstance(sub.recv(), P.PingResp)
    while outstanding:
        p = outstanding.pop(0)
        assert p.retain
        seen.append(p.payload)
        sub.send(P.PubAck(p.packet_id))
        if len(seen) + len(outstanding) < 6:
            outstanding.append(sub.recv())
    assert sorted(seen) == [f"{i}".encode() for i in range(6)]


def test_sync_flush_mode_round_trip_and_restart(tmp_path):
    srv = LmqttServer(str(tmp_path / "d"), ("--flush-mode", "sync"), str(tmp_path / "log")).start()
    try:
        s = Paho(srv, "sync-sub", clean=False)
        s.subscribe("sy/t", 1)
        s.disconnect()
        p = Paho(srv, "sync-pub")
        for i in range(20):
            p.publish("sy/t", f"{i}".encode(), qos=1)
        p.disconnect()
        srv.restart(kill=True)
        s = Paho(srv, "sync-sub", clean=False)
        assert [m.payload for m in s.get_n(20)] == [f"{i}".encode() for i in range(20)]
    finally:
        srv.stop()


def test_will_of_client_connected_at_crash_is_published_after_restart(lmqtt_server):
    watcher = Paho(lmqtt_server, "crash-watch", clean=False)
    watcher.subscribe("will/crash", 1)
    watcher.disconnect()
    victim = RawMQTT(lmqtt_server, version=4)
    assert victim.connect("crash-victim", will=P.Will("will/crash", b"server died", 1, False)).reason_code == 0
    lmqtt_server.restart(kill=True)
    victim.close()
    watcher = Paho(lmqtt_server, "crash-watch", clean=False)
    assert watcher.get().payload == b"server died"


def test_publish_too_large_for_the_store_fails_alone(lmqtt_server):
    """A PUBLISH within the MQTT packet limit but above the store's record limit (4 MiB), sent in
    the same write as a good one: only it is refused (PUBACK 0x83), the other is stored and
    delivered."""
    watcher = Paho(lmqtt_server, "big-watch")
    watcher.subscribe("big/#", qos=1)
    pub = RawMQTT(lmqtt_server, version=5)
    assert pub.connect("big-pub").reason_code == 0
    from lmqtt.gateway.mqtt import encode
    big = encode(P.Publish("big/huge", b"x" * ((4 << 20) - 20), qos=1, packet_id=1), 5)
    small = encode(P.Publish("big/small", b"fine", qos=1, packet_id=2), 5)
    pub.send_raw(big + small)
    acks = {}
    for _ in range(2):
        pkt = pub.recv(10)
        assert isinstance(pkt, P.PubAck), pkt
        acks[pkt.packet_id] = pkt.reason_code
    assert acks == {1: 0x83, 2: 0}
    m = watcher.get(5)
    assert (m.topic, m.payload) == ("big/small", b"fine")
    assert watcher.before_sentinel(watcher, "big/sentinel") == []
    pub.close()
    watcher.disconnect()
