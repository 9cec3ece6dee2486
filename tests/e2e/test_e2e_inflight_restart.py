"""A persistent session's QoS 1/2 exchanges in flight survive a restart of `lmqtt serve` (real
process, SIGTERM or kill -9 after the client left): on reconnect the server sends PUBLISH again
with DUP and the same packet ids, PUBREL for the message the client already received (QoS 2), and
nothing it had acknowledged; an inbound QoS 2 message whose PUBREL had not arrived is not stored a
second time when the client sends it again (MQTT §4.3.3, §4.4)."""
from __future__ import annotations

import pytest

from lmqtt.gateway.mqtt import packets as P
from tests.support import RawMQTT


def _recv_publish(c: RawMQTT) -> P.Publish:
    pkt = c.recv(timeout=10.0)
    assert isinstance(pkt, P.Publish), pkt
    return pkt


@pytest.mark.parametrize("how", ["sigterm", "kill9", "sigterm-while-connected"])
def test_exchanges_in_flight_resume_with_their_packet_ids_after_a_restart(lmqtt_server, how):
    """`sigterm` / `kill9`: the client left, then the server stopped; `sigterm-while-connected`:
    the server's shutdown closes the connection itself."""
    sub = RawMQTT(lmqtt_server)
    assert sub.connect("dev", clean=False).session_present is False
    sub.send(P.Subscribe(1, [P.SubscriptionRequest("t2/#", qos=2), P.SubscriptionRequest("t1/#", qos=1)]))
    assert isinstance(sub.recv(), P.SubAck)

    pub = RawMQTT(lmqtt_server)
    assert isinstance(pub.connect("pub", clean=False), P.ConnAck)
    for i, (topic, qos) in enumerate([("t2/a", 2), ("t2/a", 2), ("t2/a", 2), ("t1/a", 1), ("t1/a", 1)]):
        pub.send(P.Publish(topic, b"m%d" % i, qos=qos, packet_id=10 + i))
        ack = pub.recv(timeout=10.0)
        if qos == 2:
            assert isinstance(ack, P.PubRec)
            pub.send(P.PubRel(10 + i))
            assert isinstance(pub.recv(timeout=10.0), P.PubComp)
        else:
            assert isinstance(ack, P.PubAck)
    # an inbound QoS 2 message stored, its PUBREL not sent before the restart
    pub.send(P.Publish("t2/b", b"once", qos=2, packet_id=77))
    assert isinstance(pub.recv(timeout=10.0), P.PubRec)
    pub.send(P.Disconnect())
    assert pub.closed_by_server()                         # gone offline: its record says so
    pub.close()

    got = {}
    for _ in range(6):                                    # m0..m4 and the inbound QoS 2 one
        p = _recv_publish(sub)
        got[p.payload] = p
    received, waiting, done, once = got[b"m0"], got[b"m1"], got[b"m2"], got[b"once"]
    sub.send(P.PubRec(received.packet_id))               # m0: received, PUBCOMP will be left out
    assert isinstance(sub.recv(timeout=10.0), P.PubRel)
    sub.send(P.PubRec(done.packet_id))                    # m2: the whole exchange
    assert isinstance(sub.recv(timeout=10.0), P.PubRel)
    sub.send(P.PubComp(done.packet_id))
    sub.send(P.PubAck(got[b"m3"].packet_id))              # m3 acknowledged; m1, m4, "once" not answered
    sub.send(P.PingReq())                                 # the server has read the acks above
    assert isinstance(sub.recv(timeout=10.0), P.PingResp)
    if how == "sigterm-while-connected":
        lmqtt_server.restart()
        assert sub.closed_by_server()
    else:
        sub.send(P.Disconnect())
        assert sub.closed_by_server()
        lmqtt_server.restart(kill=how == "kill9")
    sub.close()

    again = RawMQTT(lmqtt_server)
    assert again.connect("dev", clean=False).session_present is True
    resent = [again.recv(timeout=10.0) for _ in range(4)]
    rels = [p for p in resent if isinstance(p, P.PubRel)]
    pubs = [p for p in resent if isinstance(p, P.Publish)]
    assert [r.packet_id for r in rels] == [received.packet_id]
    assert sorted((p.payload, p.packet_id, p.dup) for p in pubs) == sorted(
        [(b"m1", waiting.packet_id, True), (b"m4", got[b"m4"].packet_id, True),
         (b"once", once.packet_id, True)])

    # the publisher sends its unreleased QoS 2 message again (DUP): not stored a second time
    pub = RawMQTT(lmqtt_server)
    assert pub.connect("pub", clean=False).session_present is True
    pub.send(P.Publish("t2/b", b"once", qos=2, dup=True, packet_id=77))
    assert isinstance(pub.recv(timeout=10.0), P.PubRec)
    pub.send(P.PubRel(77))
    assert isinstance(pub.recv(timeout=10.0), P.PubComp)
    pub.send(P.Publish("t2/c", b"after", qos=1, packet_id=78))
    assert isinstance(pub.recv(timeout=10.0), P.PubAck)
    nxt = _recv_publish(again)                            # the next message is the new one
    assert (nxt.payload, nxt.dup) == (b"after", False)
    for c in (again, pub):
        c.close()


def test_a_fleet_session_resumes_its_exchanges_on_another_gateway(tmp_path):
    """A rolling restart of a gateway fleet: gateway A stops (SIGTERM) under a connected client
    with a QoS 2 message past PUBREC and a QoS 1 message unacknowledged; the client connects to
    gateway B, which reads the session and those messages from the store with the CONNECT, and
    gets PUBREL and the PUBLISH again with DUP and the same packet ids, nothing as new."""
    from tests.support import LmqttGateway, LmqttStore

    store = LmqttStore(str(tmp_path / "store"), log_path=str(tmp_path / "store.log")).start()
    a = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    b = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    try:
        sub = RawMQTT(a)
        assert sub.connect("dev", clean=False).session_present is False
        sub.send(P.Subscribe(1, [P.SubscriptionRequest("t/#", qos=2)]))
        assert isinstance(sub.recv(timeout=10.0), P.SubAck)
        pub = RawMQTT(b)
        assert isinstance(pub.connect("pub"), P.ConnAck)
        pub.send(P.Publish("t/2", b"two", qos=2, packet_id=1))
        assert isinstance(pub.recv(timeout=10.0), P.PubRec)
        pub.send(P.PubRel(1))
        assert isinstance(pub.recv(timeout=10.0), P.PubComp)
        pub.send(P.Publish("t/1", b"one", qos=1, packet_id=2))
        assert isinstance(pub.recv(timeout=10.0), P.PubAck)
        two, one = _recv_publish(sub), _recv_publish(sub)
        assert (two.payload, one.payload) == (b"two", b"one")
        sub.send(P.PubRec(two.packet_id))
        assert isinstance(sub.recv(timeout=10.0), P.PubRel)
        sub.send(P.PingReq())
        assert isinstance(sub.recv(timeout=10.0), P.PingResp)
        a.stop()                                      # SIGTERM: A takes its clients offline
        assert sub.closed_by_server()
        sub.close()

        moved = RawMQTT(b)
        assert moved.connect("dev", clean=False).session_present is True
        first, second = moved.recv(timeout=10.0), moved.recv(timeout=10.0)
        assert isinstance(first, P.PubRel) and first.packet_id == two.packet_id
        assert isinstance(second, P.Publish)
        assert (second.payload, second.packet_id, second.dup, second.qos) == (b"one", one.packet_id, True, 1)
        moved.send(P.PubComp(two.packet_id))
        moved.send(P.PubAck(one.packet_id))
        pub.send(P.Publish("t/3", b"three", qos=1, packet_id=3))
        assert isinstance(pub.recv(timeout=10.0), P.PubAck)
        nxt = _recv_publish(moved)
        assert (nxt.payload, nxt.dup) == (b"three", False)
        for c in (moved, pub):
            c.close()
    finally:
        b.stop()
        a.stop()
        store.stop()
