"""A parked client loses nothing: on a real `lmqtt serve` (`park_idle_after_s = 0.3`), an
MQTT 5 client with three subscriptions (QoS 1, a QoS 2 wildcard, a shared one) and an inbound
QoS 2 PUBLISH whose PUBREL it has not sent yet is parked, then woken by each kind of event in
turn, parked again after each: a QoS 1 delivery, a QoS 2 delivery (the full four-packet flow), a
shared-group delivery, its own PUBREL (answered with PUBCOMP; the message went out once), a
PINGREQ (answered without waking it), the console's read of its subscriptions (without waking
it), and a takeover, whose new connection inherits the three subscriptions. At each park its
session is folded (gateway/session/parked.py `fold`: a tuple of the three subscriptions and the two
direct ones' offsets), so each wake also unfolds it: what it keeps through that is what this checks."""
from __future__ import annotations

import json
import socket
import urllib.request

import pytest

from lmqtt.gateway.mqtt import packets as P
from tests.net.test_park_connections import parked, parking_server, wait_parked
from tests.support import RawMQTT

PARK_AFTER = 0.3


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = parking_server(tmp_path_factory, "park-state", PARK_AFTER)
    yield s
    s.stop()


def _client(srv, cid: str, clean: bool = True) -> RawMQTT:
    c = RawMQTT(srv, version=5)
    ack = c.connect(cid, clean=clean, props=P.Properties(session_expiry_interval=300))
    assert isinstance(ack, P.ConnAck) and ack.reason_code == 0
    return c


def _publish(pub: RawMQTT, topic: str, payload: bytes, qos: int, pid: int) -> None:
    pub.send(P.Publish(topic, payload, qos=qos, packet_id=pid if qos else None))
    if qos == 1:
        assert isinstance(pub.recv(), P.PubAck)
    elif qos == 2:
        assert isinstance(pub.recv(), P.PubRec)
        pub.send(P.PubRel(pid))
        assert isinstance(pub.recv(), P.PubComp)


def _console_subs(srv, cid: str) -> list:
    url = f"http://{srv.host}:{srv.metrics_port}/console/api/clients?q={cid}"
    with urllib.request.urlopen(url, timeout=10) as r:
        rows = json.load(r)["clients"]
    return sorted((s["filter"], s["qos"]) for r in rows if r["client_id"] == cid for s in r["subscriptions"])


SUBS = [("$share/g/ps/c", 1), ("ps/a", 1), ("ps/b/+", 2)]


def test_a_parked_client_keeps_its_subscriptions_and_exchanges_through_every_kind_of_wake(srv):
    base = parked(srv)
    watcher = _client(srv, "ps-watch")
    watcher.send(P.Subscribe(1, [P.SubscriptionRequest("ps/x", 1)]))
    assert isinstance(watcher.recv(), P.SubAck)
    c = _client(srv, "ps-dev")
    c.send(P.Subscribe(1, [P.SubscriptionRequest(f, q) for f, q in SUBS]))
    ack = c.recv()
    assert isinstance(ack, P.SubAck) and list(ack.reason_codes) == [1, 1, 2]
    c.send(P.Publish("ps/x", b"q2-in", qos=2, packet_id=21))       # its PUBREL comes later
    assert isinstance(c.recv(), P.PubRec)
    m = watcher.recv()
    assert isinstance(m, P.Publish) and m.payload == b"q2-in"
    watcher.send(P.PubAck(m.packet_id))
    pub = _client(srv, "ps-pub")
    assert wait_parked(srv, base + 3) == base + 3                  # watcher, device, publisher

    # a QoS 1 delivery wakes it
    _publish(pub, "ps/a", b"one", 1, 1)
    m = c.recv()
    assert isinstance(m, P.Publish) and (m.topic, m.payload, m.qos) == ("ps/a", b"one", 1)
    c.send(P.PubAck(m.packet_id))
    assert wait_parked(srv, base + 3) == base + 3

    # a QoS 2 delivery: PUBLISH, PUBREC, PUBREL, PUBCOMP
    _publish(pub, "ps/b/7", b"two", 2, 2)
    m = c.recv()
    assert isinstance(m, P.Publish) and (m.topic, m.payload, m.qos) == ("ps/b/7", b"two", 2)
    c.send(P.PubRec(m.packet_id))
    rel = c.recv()
    assert isinstance(rel, P.PubRel) and rel.packet_id == m.packet_id
    c.send(P.PubComp(m.packet_id))
    assert wait_parked(srv, base + 3) == base + 3

    # a shared-group delivery (the only member)
    _publish(pub, "ps/c", b"shared", 1, 3)
    m = c.recv()
    assert isinstance(m, P.Publish) and (m.topic, m.payload) == ("ps/c", b"shared")
    c.send(P.PubAck(m.packet_id))
    assert wait_parked(srv, base + 3) == base + 3

    # its own PUBREL of the QoS 2 it sent before it was parked: PUBCOMP, the message once
    c.send(P.PubRel(21))
    comp = c.recv()
    assert isinstance(comp, P.PubComp) and comp.packet_id == 21 and comp.reason_code == 0
    assert wait_parked(srv, base + 3) == base + 3

    # a PINGREQ and the console's view: answered without waking it
    c.send(P.PingReq())
    assert isinstance(c.recv(), P.PingResp)
    assert _console_subs(srv, "ps-dev") == sorted(SUBS)
    assert parked(srv) == base + 3

    # a takeover: the new connection has the three subscriptions without subscribing
    new = _client(srv, "ps-dev", clean=False)
    d = c.recv()
    assert isinstance(d, P.Disconnect) and d.reason_code == 0x8E
    assert c.closed_by_server()
    c.close()
    _publish(pub, "ps/a", b"after", 1, 4)
    _publish(pub, "ps/b/8", b"after2", 2, 5)
    got = []
    for _ in range(2):
        m = new.recv()
        assert isinstance(m, P.Publish)
        got.append((m.topic, m.payload))
        if m.qos == 1:
            new.send(P.PubAck(m.packet_id))
        else:
            new.send(P.PubRec(m.packet_id))
            assert isinstance(new.recv(), P.PubRel)
            new.send(P.PubComp(m.packet_id))
    assert sorted(got) == [("ps/a", b"after"), ("ps/b/8", b"after2")]
    assert _console_subs(srv, "ps-dev") == sorted(SUBS)
    watcher.sock.settimeout(0.5)                      # the watcher got the QoS 2 message once only
    try:
        extra = watcher.sock.recv(65536)
    except socket.timeout:
        extra = None
    assert extra is None
    for x in (new, pub, watcher):
        x.send(P.Disconnect())
        x.close()
