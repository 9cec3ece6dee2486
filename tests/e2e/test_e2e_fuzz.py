"""Fuzz a live `lmqtt serve` with random and mutated MQTT packets; it must keep serving others.

Default run (CI): 30,000 packets. The recorded run uses one million:

    LMQTT_FUZZ_PACKETS=1000000 LMQTT_FUZZ_SECONDS=900 python3 -m pytest tests/test_e2e_fuzz.py -q -s

Each fuzz connection sends CONNECT (usually valid, sometimes mutated) then a burst of packets, each
either a valid packet from a corpus (publish/subscribe/acks/ping/unsubscribe, 3.1.1 and 5.0), a
mutated one (bit flips, truncation, inserted/deleted bytes, a forged remaining length) or random
bytes. The server closes the connection at the first bad packet; the fuzzer then reconnects.
Bounded in packets and in time. A paho client keeps publishing and receiving throughout.
"""
from __future__ import annotations

import os
import random
import socket
import time

import psutil
import pytest

from tests.support import Paho
from lmqtt.gateway.mqtt import encode, packets as P

N_PACKETS = int(os.environ.get("LMQTT_FUZZ_PACKETS", "30000"))
MAX_SECONDS = float(os.environ.get("LMQTT_FUZZ_SECONDS", "60"))
pytestmark = pytest.mark.timeout(int(MAX_SECONDS) + 120)


def _corpus(version: int) -> list[bytes]:
    props = P.Properties(user_property=[("k", "v")], content_type="t") if version == 5 else P.Properties()
    pk = [
        P.Publish("fz/a", b"hello", 0), P.Publish("fz/b/c", b"x" * 40, 1, packet_id=7, properties=props),
        P.Publish("fz/q2", b"two", 2, packet_id=9), P.Publish("fz/r", b"", 1, retain=True, packet_id=3),
        P.Subscribe(5, [P.SubscriptionRequest("fz/#", 1), P.SubscriptionRequest("fz/+/c", 2)]),
        P.Subscribe(6, [P.SubscriptionRequest("$share/g/fz/a", 1)]), P.Unsubscribe(8, ["fz/#"]),
        P.PubAck(1), P.PubRec(2), P.PubRel(9), P.PubComp(4), P.PingReq(),
    ]
    return [encode(p, version) for p in pk]


def _mutate(rng: random.Random, b: bytes) -> bytes:
    b = bytearray(b)
    op = rng.randrange(6)
    if op == 0 and b:                                   # bit flips
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif op == 1 and len(b) > 1:                        # truncation
        b = b[: rng.randrange(1, len(b))]
    elif op == 2:                                       # inserted bytes
        i = rng.randrange(len(b) + 1)
        b[i:i] = rng.randbytes(rng.randint(1, 8))
    elif op == 3 and len(b) > 2:                        # deleted bytes
        i = rng.randrange(1, len(b))
        del b[i:i + rng.randint(1, 4)]
    elif op == 4 and len(b) > 1:                        # forged remaining length
        b[1:2] = rng.choice([b"\xff\xff\xff\x7f", b"\x80\x80\x80\x80\x01", b"\x00", b"\x7f"])
    else:                                               # random bytes
        b = bytearray(rng.randbytes(rng.randint(1, 64)))
    return bytes(b)


def test_fuzz_live_server_keeps_serving(lmqtt_server):
    rng = random.Random(1234)
    watcher = Paho(lmqtt_server, "fuzz-watch", version=5)
    watcher.subscribe("health/t", 1)
    healthy_pub = Paho(lmqtt_server, "fuzz-health-pub")
    corp = {4: _corpus(4), 5: _corpus(5)}
    sent = conns = 0
    t0 = time.monotonic()
    health_every = 20_000         # also throttles the fuzzer to what the server can take
    next_health = health_every
    while sent < N_PACKETS and time.monotonic() - t0 < MAX_SECONDS:
        version = rng.choice((4, 5))
        burst = []
        c = encode(P.Connect(f"fz{conns % 50}", version, True, 30), version)
        burst.append(c if rng.random() < 0.9 else _mutate(rng, c))
        for _ in range(rng.randint(20, 400)):
            r = rng.random()
            if r < 0.985:
                burst.append(rng.choice(corp[version]))
            elif r < 0.995:
                burst.append(_mutate(rng, rng.choice(corp[version])))
            else:
                burst.append(rng.randbytes(rng.randint(1, 32)))
        try:
            s = socket.create_connection((lmqtt_server.host, lmqtt_server.port), timeout=5)
            s.sendall(b"".join(burst))
            s.close()                                    # FIN: the server reads it all (or stops at the first error)
        except OSError:
            pass                                         # server closed first: that is fine
        sent += len(burst)
        conns += 1
        if sent >= next_health:
            next_health += health_every
            # a NEW connection must be accepted (behind the fuzz connections still queued) ...
            probe = Paho(lmqtt_server, "fuzz-probe", connect=False)
            probe.connect(timeout=30)
            probe.publish("health/t", f"{sent}".encode(), qos=1)
            probe.disconnect()
            # ... and the long-lived subscriber is still served
            assert watcher.get(timeout=10).payload == f"{sent}".encode()
    elapsed = time.monotonic() - t0
    import urllib.request
    text = urllib.request.urlopen(lmqtt_server.metrics_url, timeout=5).read().decode()
    errors = [ln for ln in text.splitlines() if ln.startswith("lmqtt_protocol_errors_total")]
    print(f"fuzz: {sent} packets over {conns} connections in {elapsed:.1f}s; server: {errors}")
    assert lmqtt_server.proc.poll() is None, lmqtt_server.log_tail()
    fresh = Paho(lmqtt_server, "after-fuzz")
    fresh.subscribe("health/t", 1)
    healthy_pub.publish("health/t", b"final", qos=1)
    assert fresh.get(timeout=10).payload == b"final"
    mi = psutil.Process(lmqtt_server.proc.pid).memory_info()
    assert mi.rss - mi.shared < 300 * 2**20
    if N_PACKETS <= 100_000:
        assert sent >= N_PACKETS          # the CI-sized run must complete within its time bound
