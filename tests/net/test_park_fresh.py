"""Young idle connections are parked early (gateway/net/parking.py FRESH_IDLE_S, issue 29): a client
silent since its handshake is parked after ~0.25 s, not `park_idle_after_s`, so a burst of
thousands never has all its transports alive at once. A client that keeps talking past its first
second keeps the `park_idle_after_s` regime. On a real `lmqtt serve` with `park_idle_after_s = 60`,
so any park seen within the test's few seconds is the young connections' check."""
from __future__ import annotations

import time

import pytest

from lmqtt.gateway.mqtt import packets as P
from tests.net.test_park_connections import parked, subscriber, wait_parked
from tests.support import LmqttServer, RawMQTT

PARK_AFTER = 60.0


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("park-fresh")
    cfg = d / "park.toml"
    cfg.write_text(f"park_idle_after_s = {PARK_AFTER}\n")
    (d / "data").mkdir()
    s = LmqttServer(str(d / "data"), extra_args=("--config", str(cfg))).start()
    deadline = time.monotonic() + 20
    while True:                                      # /metrics comes up just after the listeners
        try:
            parked(s)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
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
    t_end = time.monotonic() + 1.6                   # a packet every 0.1 s: never 0.25 s silent
    while time.monotonic() < t_end:
        c.send(P.Publish("fresh/other", b"x", qos=0))
        time.sleep(0.1)
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
