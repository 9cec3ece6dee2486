"""Young idle connections are parked early (gateway/net/parking.py FRESH_IDLE_S): a client
silent since its handshake is parked after ~0.05 s, not `park_idle_after_s`, so a burst of
thousands never has all its transports alive at once. A client that keeps talking past its first
second keeps the `park_idle_after_s` regime; one parked before its SUBSCRIBE (a long round trip)
is young again when it comes. The console's view of a parked client stays right. On a real `lmqtt serve` with `park_idle_after_s = 60`,
so any park seen within the test's few seconds is the young connections' check."""
from __future__ import annotations

import json
import time
import urllib.request

import pytest

from lmqtt.gateway.mqtt import packets as P
from tests.net.test_park_connections import parked, parking_server, subscriber, wait_parked
from tests.support import RawMQTT

PARK_AFTER = 60.0


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = parking_server(tmp_path_factory, "park-fresh", PARK_AFTER)
    yield s
    s.stop()


def test_a_client_silent_after_its_handshake_is_parked_long_before_park_idle_after_s(srv):
    base = parked(srv)
    c = subscriber(srv, "fresh-silent", "fresh/silent", qos=1)
    # before: parked only after 60 s; the wait ends at 10 s
    assert wait_parked(srv, base + 1, timeout=10) == base + 1
    pub = RawMQTT(srv)
    pub.connect("fresh-pub")
    pub.send(P.Publish("fresh/silent", b"m", qos=1, packet_id=1))
    assert isinstance(pub.recv(), P.PubAck)
    m = c.recv()                                     # the delivery wakes it
    assert isinstance(m, P.Publish) and m.payload == b"m"
    c.send(P.PubAck(m.packet_id))
    for x in (c, pub):
        x.send(P.Disconnect())
        assert x.closed_by_server()
        x.close()
    assert wait_parked(srv, base) == base


def test_a_client_talking_through_its_first_second_keeps_the_long_regime(srv):
    base = parked(srv)
    c = subscriber(srv, "fresh-talker", "fresh/talker", qos=0)
    t_end = time.monotonic() + 1.6                   # a packet every 0.01 s: never 0.05 s silent
    while time.monotonic() < t_end:
        c.send(P.Publish("fresh/other", b"x", qos=0))
        time.sleep(0.01)
    # past its first second: now `park_idle_after_s` (60 s) applies, so silence does not park it
    silent = subscriber(srv, "fresh-marker", "fresh/marker", qos=0)
    assert wait_parked(srv, base + 1, timeout=10) == base + 1      # the marker, 0.25 s silent: parked
    time.sleep(0.6)                                  # the talker has been silent as long, and more
    assert parked(srv) == base + 1
    for x in (c, silent):
        x.send(P.Disconnect())
        assert x.closed_by_server()
        x.close()
    assert wait_parked(srv, base) == base


def test_a_client_parked_before_its_subscribe_is_young_again_when_it_comes(srv):
    base = parked(srv)
    c = RawMQTT(srv)
    ack = c.connect("fresh-slow")
    assert isinstance(ack, P.ConnAck) and ack.reason_code == 0
    assert wait_parked(srv, base + 1, timeout=10) == base + 1       # parked between CONNACK and SUBSCRIBE
    c.send(P.Subscribe(1, [P.SubscriptionRequest("fresh/slow", 1)]))   # wakes it
    assert isinstance(c.recv(), P.SubAck)
    # before: woken, it waited park_idle_after_s (60 s) like a client that talks
    assert wait_parked(srv, base + 1, timeout=10) == base + 1
    c.send(P.Disconnect())
    assert c.closed_by_server()
    c.close()
    assert wait_parked(srv, base) == base


def test_a_young_client_woken_by_its_publish_is_not_parked_again_at_its_next_silence(srv):
    """A device that connects and starts publishing every few tenths of a second: parked while
    silent after its handshake, woken by its first PUBLISH, it then keeps its transport (the
    `park_idle_after_s` regime) instead of being parked at each silence of its first second and
    woken (a transport rebuilt) at each packet."""
    base = parked(srv)
    c = RawMQTT(srv)
    ack = c.connect("fresh-device")
    assert isinstance(ack, P.ConnAck) and ack.reason_code == 0
    assert wait_parked(srv, base + 1, timeout=10) == base + 1       # silent after its handshake
    for i in range(3):
        c.send(P.Publish("fresh/device", b"r%d" % i, qos=1, packet_id=i + 1))
        assert isinstance(c.recv(), P.PubAck)
        time.sleep(0.25)             # 5x FRESH_IDLE_S, within its first second
        # before: young again when woken, it was parked 0.05 s after each PUBLISH
        assert parked(srv) == base, i
    c.send(P.Disconnect())
    assert c.closed_by_server()
    c.close()
    assert wait_parked(srv, base) == base


def test_the_console_shows_how_long_a_parked_client_has_been_connected(srv):
    base = parked(srv)
    t0 = time.monotonic()
    c = subscriber(srv, "fresh-console", "fresh/console", qos=0)
    assert wait_parked(srv, base + 1, timeout=10) == base + 1
    url = f"http://{srv.host}:{srv.metrics_port}/console/api/clients?q=fresh-console"
    with urllib.request.urlopen(url, timeout=10) as r:
        rows = json.load(r)["clients"]
    elapsed = time.monotonic() - t0
    row = next(r for r in rows if r["client_id"] == "fresh-console")
    # before: a parked connection's accept time was dropped (0.0): "connected" since the loop's epoch
    assert 0.0 <= row["connected_s"] <= elapsed + 1.0
    assert row["subscriptions"] == [{"filter": "fresh/console", "qos": 0}]
    c.send(P.Disconnect())
    assert c.closed_by_server()
    c.close()
    assert wait_parked(srv, base) == base
