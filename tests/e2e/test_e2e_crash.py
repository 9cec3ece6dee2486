"""kill -9 of `lmqtt serve` in the middle of live traffic: every message the server acknowledged
(PUBACK) reaches the persistent QoS 1 subscriber after the restart, in publish order."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.support import RawMQTT
from lmqtt.gateway.mqtt import packets as P

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def _connect(server, cid, clean, deadline):
    while time.monotonic() < deadline:
        try:
            c = RawMQTT(server, version=4, timeout=2)
            ack = c.connect(cid, clean=clean, keepalive=0)
            if isinstance(ack, P.ConnAck) and ack.reason_code == 0:
                return c, ack
            c.close()
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{cid} could not reconnect")


def test_kill9_mid_traffic_loses_no_acknowledged_message(lmqtt_server):
    n = 400
    deadline = time.monotonic() + 90
    sub, _ = _connect(lmqtt_server, "crash-sub", False, deadline)
    sub.send(P.Subscribe(1, [P.SubscriptionRequest("crash/+", 1)]))
    assert isinstance(sub.recv(), P.SubAck)
    received: list[bytes] = []
    acked: list[bytes] = []
    stop = threading.Event()

    def subscriber():
        nonlocal sub
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                p = sub.recv(timeout=0.5)
            except socket.timeout:
                continue
            except OSError:
                p = None
            if p is None:                             # server gone: reconnect, same session
                sub.close()
                sub, ack = _connect(lmqtt_server, "crash-sub", False, deadline)
                assert ack.session_present
                continue
            if isinstance(p, P.Publish):
                received.append(p.payload)
                try:
                    sub.send(P.PubAck(p.packet_id))
                except OSError:
                    pass

    t = threading.Thread(target=subscriber, daemon=True)
    t.start()
    pub, _ = _connect(lmqtt_server, "crash-pub", True, deadline)
    i = 0
    killed = False
    while i < n and time.monotonic() < deadline:
        payload = f"{i:05d}".encode()
        try:
            pub.send(P.Publish(f"crash/{i % 2}", payload, 1, packet_id=i % 65535 + 1))
            ack = pub.recv(timeout=2)
            if isinstance(ack, P.PubAck):
                acked.append(payload)
                i += 1
            else:
                raise OSError("no PUBACK")
        except OSError:
            pub.close()
            pub, _ = _connect(lmqtt_server, "crash-pub", True, deadline)   # resend the same i
        if i == n // 2 and not killed:
            killed = True
            lmqtt_server.restart(kill=True)               # kill -9 mid-stream, then start again
    assert killed and len(acked) == n
    want = set(acked)
    while time.monotonic() < deadline and not want.issubset(received):
        time.sleep(0.1)
    stop.set()
    t.join(5)
    missing = sorted(want - set(received))
    assert not missing, f"{len(missing)} acknowledged messages lost, first {missing[:5]}"
    # per publisher order: first deliveries are in publish order (duplicates allowed after the crash)
    first_seen = []
    seen = set()
    for p in received:
        if p not in seen:
            seen.add(p)
            first_seen.append(p)
    assert first_seen == sorted(first_seen)
