"""A resumed session that never expires (a reconnect storm): on `lmqtt serve` its record says
"connected" only once it has stayed connected CONNECTED_RECORD_AFTER_S (a client that comes and goes
has its record written once per round, by its disconnect, not also by its CONNECT); `lmqtt admin
--sessions` shows it connected from then on and offline after it left; a kill -9 before that write
loses nothing of the session."""
from __future__ import annotations

import json
import time

from lmqtt.gateway.clients.session_persistence import CONNECTED_RECORD_AFTER_S
from lmqtt.gateway.mqtt import packets as P
from tests.gateway.test_console_tools import lmqtt
from tests.support import RawMQTT


def _connected(srv, cid: str) -> bool | None:
    r = lmqtt("admin", "--store", srv.store_address, "--sessions", "--format", "json")
    assert r.returncode == 0, r.stderr.decode()
    rows = {x["client_id"]: x for x in json.loads(r.stdout)["sessions"]}
    return rows[cid]["connected"] if cid in rows else None


def _until(fn, want, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    got = fn()
    while got != want and time.monotonic() < deadline:
        time.sleep(0.2)
        got = fn()
    return got


def _subscribed(srv, cid: str, flt: str) -> None:
    c = RawMQTT(srv, version=4)
    assert c.connect(cid, clean=False).session_present is False
    c.send(P.Subscribe(1, [P.SubscriptionRequest(flt, 1)]))
    assert isinstance(c.recv(), P.SubAck)
    c.send(P.Disconnect())
    c.close()


def test_a_resumed_session_shows_connected_once_it_stayed_and_offline_after(lmqtt_server):
    srv = lmqtt_server
    _subscribed(srv, "rc-stay", "rc/stay/+")
    assert _until(lambda: _connected(srv, "rc-stay"), False) is False
    c = RawMQTT(srv, version=4)
    t0 = time.monotonic()
    assert c.connect("rc-stay", clean=False).session_present is True
    assert _until(lambda: _connected(srv, "rc-stay"), True) is True
    assert time.monotonic() - t0 >= CONNECTED_RECORD_AFTER_S * 0.9   # not written by the CONNECT itself
    c.send(P.Disconnect())
    c.close()
    assert _until(lambda: _connected(srv, "rc-stay"), False) is False


def test_a_kill9_before_the_connected_record_loses_nothing(lmqtt_server):
    srv = lmqtt_server
    _subscribed(srv, "rc-kill", "rc/kill/+")
    c = RawMQTT(srv, version=4)
    assert c.connect("rc-kill", clean=False).session_present is True
    srv.kill9()                                  # within CONNECTED_RECORD_AFTER_S of the CONNECT
    c.close()
    srv.start()
    pub = RawMQTT(srv, version=4)
    assert pub.connect("rc-pub").reason_code == 0
    pub.send(P.Publish(topic="rc/kill/x", payload=b"after", qos=1, packet_id=1))
    assert isinstance(pub.recv(), P.PubAck)
    c = RawMQTT(srv, version=4)
    assert c.connect("rc-kill", clean=False).session_present is True
    m = c.recv()
    assert isinstance(m, P.Publish) and m.payload == b"after" and m.qos == 1, m
    c.send(P.PubAck(m.packet_id))
    c.send(P.Disconnect())
    c.close()
    pub.close()
