"""QoS 2 exactly once across a crash (kill -9) of `lmqtt serve` while the clients are connected:
a persistent session's QoS 2 exchanges are written ahead of the packets that depend
on them (gateway/clients/session_persistence.py `write_ahead` / `journal`), so after the restart the
server sends PUBLISH again with DUP and the same packet id, or PUBREL - never a message as new -
and knows the inbound QoS 2 ids it stored (the publisher's PUBLISH sent again is not stored twice).

The subscriber below is a raw client acting as MQTT §4.3.3 allows a receiver to (it delivers a
message at its first PUBLISH and keeps its packet id until PUBREL: a PUBLISH with an id it keeps is
not delivered again), withholding PUBREC/PUBCOMP to pin each exchange's state at the crash."""
from __future__ import annotations

import socket
import time
from collections import Counter

from lmqtt.gateway.mqtt import packets as P
from tests.support import Paho, RawMQTT


class Receiver:
    """A QoS 2 receiver (raw socket): counts deliveries per payload as an application would see
    them; `answer=False` holds back the PUBREC/PUBCOMP it owes."""

    def __init__(self, server, client_id: str) -> None:
        self.server = server
        self.client_id = client_id
        self.held: set[int] = set()          # ids received, PUBREL not yet (survives reconnects)
        self.delivered: Counter = Counter()
        self.c: RawMQTT | None = None

    def connect(self) -> bool:
        self.c = RawMQTT(self.server)
        ack = self.c.connect(self.client_id, clean=False)
        assert isinstance(ack, P.ConnAck), ack
        return ack.session_present

    def handle(self, pkt, answer: bool = True):
        if isinstance(pkt, P.Publish):
            assert pkt.qos == 2, pkt
            if pkt.packet_id not in self.held:
                self.held.add(pkt.packet_id)
                self.delivered[pkt.payload] += 1
            if answer:
                self.c.send(P.PubRec(pkt.packet_id))
        elif isinstance(pkt, P.PubRel):
            self.held.discard(pkt.packet_id)
            if answer:
                self.c.send(P.PubComp(pkt.packet_id))
        return pkt

    def recv(self, timeout: float = 10.0, answer: bool = True):
        pkt = self.c.recv(timeout=timeout)
        assert pkt is not None, "connection closed"
        return self.handle(pkt, answer)

    def run_until_quiet(self, quiet: float = 1.5, limit: float = 30.0) -> None:
        """Answer everything until the server sends nothing for `quiet` seconds."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            try:
                self.recv(timeout=quiet)
            except socket.timeout:
                return
        raise AssertionError("the server kept sending")


def _stored(server, topic_filter: str) -> Counter:
    """Every message stored under `topic_filter`, counted per payload (history from the epoch)."""
    c = RawMQTT(server)
    assert isinstance(c.connect("audit"), P.ConnAck)
    c.send(P.Subscribe(1, [P.SubscriptionRequest(f"$replay/0/{topic_filter}", qos=0)]))
    assert isinstance(c.recv(timeout=10.0), P.SubAck)
    got: Counter = Counter()
    try:
        while True:
            pkt = c.recv(timeout=1.5)
            if isinstance(pkt, P.Publish):
                got[pkt.payload] += 1
    except socket.timeout:
        pass
    c.close()
    return got


def test_qos2_exchanges_of_connected_clients_survive_kill9_exactly_once(lmqtt_server):
    qos2_exchanges_survive_a_crash(lmqtt_server, lambda: lmqtt_server.restart(kill=True))


def qos2_exchanges_survive_a_crash(server, crash) -> None:
    """A subscriber's QoS 2 exchanges in every state and a publisher's stored one awaiting PUBREL,
    `crash()` with both clients connected, both back: every message delivered and stored once,
    nothing held. (test_e2e_qos2_remote_crash runs it on a gateway over a remote store.)"""
    sub = Receiver(server, "dev")
    assert sub.connect() is False
    sub.c.send(P.Subscribe(1, [P.SubscriptionRequest("t/#", qos=2)]))
    assert isinstance(sub.c.recv(timeout=10.0), P.SubAck)

    pub = RawMQTT(server)
    assert isinstance(pub.connect("pub", clean=False), P.ConnAck)
    for i in range(4):                                   # m0..m3: stored, the whole exchange
        pub.send(P.Publish("t/a", b"m%d" % i, qos=2, packet_id=10 + i))
        assert isinstance(pub.recv(timeout=10.0), P.PubRec)
        pub.send(P.PubRel(10 + i))
        assert isinstance(pub.recv(timeout=10.0), P.PubComp)
    # an inbound message stored (PUBREC received) whose PUBREL the publisher has not sent
    pub.send(P.Publish("t/a", b"in", qos=2, packet_id=50))
    assert isinstance(pub.recv(timeout=10.0), P.PubRec)

    got = {}
    for _ in range(5):
        p = sub.recv(answer=False)
        assert isinstance(p, P.Publish)
        got[p.payload] = p
    # m0: the whole exchange; m1: PUBREC sent, PUBREL received, PUBCOMP not yet sent (delivered
    # and released by the client); m2: PUBREC sent, the PUBREL not read yet; m3, in: nothing
    for name in (b"m0", b"m1", b"m2"):
        sub.c.send(P.PubRec(got[name].packet_id))
    rels = set()
    while len(rels) < 3:
        p = sub.c.recv(timeout=10.0)
        assert isinstance(p, P.PubRel), p
        rels.add(p.packet_id)
    sub.handle(P.PubRel(got[b"m0"].packet_id))           # released: PUBCOMP sent
    sub.handle(P.PubRel(got[b"m1"].packet_id), answer=False)
    sub.c.send(P.PingReq())                              # the server has read all of the above
    assert isinstance(sub.c.recv(timeout=10.0), P.PingResp)

    crash()                                              # both clients still connected
    assert sub.c.closed_by_server(timeout=10.0) and pub.closed_by_server(timeout=10.0)
    sub.c.close()
    pub.close()

    assert sub.connect() is True
    # the publisher did not see PUBREC for "in" (lost with the crash) and sends it again (DUP)
    pub = RawMQTT(server)
    assert pub.connect("pub", clean=False).session_present is True
    pub.send(P.Publish("t/a", b"in", qos=2, dup=True, packet_id=50))
    assert isinstance(pub.recv(timeout=10.0), P.PubRec)
    pub.send(P.PubRel(50))
    assert isinstance(pub.recv(timeout=10.0), P.PubComp)
    pub.send(P.Publish("t/a", b"after", qos=2, packet_id=51))
    assert isinstance(pub.recv(timeout=10.0), P.PubRec)
    pub.send(P.PubRel(51))
    assert isinstance(pub.recv(timeout=10.0), P.PubComp)
    sub.run_until_quiet()

    names = [b"m0", b"m1", b"m2", b"m3", b"in", b"after"]
    assert dict(sub.delivered) == {n: 1 for n in names}, server.log_tail()
    assert sub.held == set()
    assert dict(_stored(server, "t/#")) == {n: 1 for n in names}
    sub.c.close()
    pub.close()


def test_paho_qos2_stream_exactly_once_across_kill9(lmqtt_server):
    """paho clients (persistent sessions, QoS 2) connected while `lmqtt serve` is killed in the
    middle of delivering a stream (the publisher's exchanges all done, the subscriber's in every
    state); paho reconnects by itself and resumes its exchanges. (A publisher's exchange cut by
    the crash: the raw test above pins it.)"""
    total = 400
    sub = Paho(lmqtt_server, client_id="paho-sub", clean=False)
    sub.c.reconnect_delay_set(0.2, 1)
    assert sub.subscribe("s/#", qos=2) == [2]
    pub = Paho(lmqtt_server, client_id="paho-pub", clean=False)
    pub.c.reconnect_delay_set(0.2, 1)
    infos = [pub.c.publish("s/x", b"n%04d" % i, qos=2) for i in range(total)]
    for info in infos:
        info.wait_for_publish(30.0)
        assert info.is_published()
    first = sub.get_n(total // 4, timeout=30.0)
    assert len(first) == total // 4
    lmqtt_server.restart(kill=True)                      # mid-stream, everybody connected
    for c in (sub, pub):                                 # paho reconnected by itself
        flags, rc, _ = c.connack.get(timeout=30.0)
        assert not rc.is_failure and flags.session_present
    pub.publish("s/x", b"after", qos=2, timeout=30.0)
    rest = sub.get_n(total + 1 - len(first), timeout=60.0) + sub.drain(2.0)
    counts = Counter(m.payload for m in first + rest)
    assert {k: v for k, v in counts.items() if v != 1} == {}
    assert len(counts) == total + 1
    stored = _stored(lmqtt_server, "s/#")
    assert {k: v for k, v in stored.items() if v != 1} == {} and len(stored) == total + 1
    sub.disconnect()
    pub.disconnect()
