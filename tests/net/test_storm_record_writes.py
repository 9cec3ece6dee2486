"""Reconnect storm: how many session records a persistent client's CONNECT + SUBSCRIBE +
DISCONNECT writes on `lmqtt serve` (counted by `lmqtt_session_record_writes_total`), and that the
writes left out lose nothing a client was told, across kill -9.

Before: 3 writes per round, new or resumed (CONNECT, SUBSCRIBE, disconnect). Now: a new session
with nothing in it is first written by its SUBSCRIBE (CONNACK said no session present), and a
SUBSCRIBE repeating a subscription the session has with the same options writes nothing: 2 each;
and a resumed session that never expires has its record say "connected" only once it stayed
connected a while (tests/restart/test_resumed_connected_record.py): 1 per resumed round."""
from __future__ import annotations

import re
import time
import urllib.request

import pytest

from lmqtt.gateway.mqtt import packets as P
from tests.support import RawMQTT

pytestmark = pytest.mark.timeout(120)

N = 20


def _writes(srv, what: str = "record") -> int:
    deadline = time.monotonic() + 10
    while True:
        try:                            # the metrics port opens just after the MQTT port
            text = urllib.request.urlopen(srv.metrics_url, timeout=5).read().decode()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    name = what if what == "lmqtt_connections" else f"lmqtt_session_{what}_writes_total"
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    assert m, f"{name} is not exported"
    return int(float(m.group(1)))


def _settled(srv, at_least: int, timeout: float = 20.0) -> int:
    """The counter once it reached `at_least` (the disconnects are written when the server sees
    each socket close); whatever it then is, exactly."""
    deadline = time.monotonic() + timeout
    n = _writes(srv)
    while n < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
        n = _writes(srv)
    time.sleep(0.3)                     # a write more than expected would show up now
    return _writes(srv)


def _round(srv, i: int, qos: int = 1, expect_present: bool | None = None) -> None:
    c = RawMQTT(srv, version=4)
    ack = c.connect(f"storm-{i}", clean=False)
    assert isinstance(ack, P.ConnAck) and ack.reason_code == 0
    if expect_present is not None:
        assert ack.session_present == expect_present, f"storm-{i}"
    c.send(P.Subscribe(1, [P.SubscriptionRequest(f"storm/{i}/+", qos)]))
    sa = c.recv()
    assert isinstance(sa, P.SubAck) and sa.reason_codes == [qos]
    c.send(P.Disconnect())
    c.close()


def test_a_storm_writes_each_session_record_twice_per_new_round_once_per_resumed(lmqtt_server):
    srv = lmqtt_server
    base, obase = _writes(srv), _writes(srv, "offset")
    for i in range(N):                           # new sessions: SUBSCRIBE + disconnect
        _round(srv, i, expect_present=False)
    assert _settled(srv, base + 2 * N) - base == 2 * N
    assert _writes(srv, "offset") - obase == N   # the new subscription's start (not again at disconnect)
    base, obase = _writes(srv), _writes(srv, "offset")
    for i in range(N):                           # resumed, the same SUBSCRIBE: the disconnect
        _round(srv, i, expect_present=True)
    assert _settled(srv, base + N) - base == N
    assert _writes(srv, "offset") - obase == 0   # nothing delivered: no offset moved
    base, obase = _writes(srv), _writes(srv, "offset")
    _round(srv, 0, qos=0, expect_present=True)   # the same filter at another QoS: the record changes
    assert _settled(srv, base + 2) - base == 2
    assert _writes(srv, "offset") - obase == 1


def test_the_writes_left_out_lose_nothing_across_kill9(lmqtt_server):
    srv = lmqtt_server
    for i in range(3):
        _round(srv, i, expect_present=False)
    for i in range(3):
        _round(srv, i, expect_present=True)      # SUBSCRIBE written no more
    _round(srv, 2, qos=0, expect_present=True)   # changed: written
    idle = RawMQTT(srv, version=4)               # connected, never subscribed, at the kill
    assert idle.connect("storm-idle", clean=False).session_present is False
    srv.kill9()
    idle.close()
    srv.start()
    pub = RawMQTT(srv, version=4)
    assert pub.connect("storm-pub").reason_code == 0
    for i in range(3):
        pub.send(P.Publish(topic=f"storm/{i}/x", payload=b"m%d" % i, qos=1, packet_id=i + 1))
        assert isinstance(pub.recv(), P.PubAck)
    for i, qos in ((0, 1), (1, 1), (2, 0)):      # each subscription as last SUBACK'd, with its QoS
        c = RawMQTT(srv, version=4)
        ack = c.connect(f"storm-{i}", clean=False)
        assert ack.session_present is True
        m = c.recv()
        assert isinstance(m, P.Publish) and m.payload == b"m%d" % i and m.qos == qos, (i, m)
        if qos:
            c.send(P.PubAck(m.packet_id))
        c.send(P.Disconnect())                   # its offsets moved: written at this disconnect
        c.close()
    # the session that held nothing was not kept: CONNACK says so (the client subscribes again)
    c = RawMQTT(srv, version=4)
    assert c.connect("storm-idle", clean=False).session_present is False
    c.close()
    pub.close()
    deadline = time.monotonic() + 20             # every disconnect handled (its offsets written)
    while _writes(srv, "lmqtt_connections") and time.monotonic() < deadline:
        time.sleep(0.05)
    srv.kill9()
    srv.start()
    for i in range(3):                           # what was acknowledged is not delivered again
        c = RawMQTT(srv, version=4)
        assert c.connect(f"storm-{i}", clean=False).session_present is True
        with pytest.raises(OSError):             # socket.timeout: nothing comes
            c.recv(timeout=1.0)
        c.close()
