"""End-to-end: shared subscriptions `$share/{group}/{filter}` — each message to exactly one member."""
from __future__ import annotations

import asyncio
import collections

import pytest

from lmqtt.gateway.mqtt import packets as P
from tests.support import Paho, RawMQTT, both_kinds_fixtures


shared_server, lmqtt_server = both_kinds_fixtures()


def _collect(members, n, timeout=10.0):
    """Messages of all members until `n` arrived in total (plus a short drain for extras)."""
    import time
    out = [[] for _ in members]
    deadline = time.monotonic() + timeout
    while sum(map(len, out)) < n and time.monotonic() < deadline:
        for k, m in enumerate(members):
            out[k].extend(m.drain(0.02))
    for k, m in enumerate(members):
        out[k].extend(m.drain(0.2))
    return out

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("version", [4, 5])
def test_each_message_to_exactly_one_member(lmqtt_server, version):
    members = [Paho(lmqtt_server, f"sh{version}-{i}", version=version) for i in range(3)]
    for m in members:
        assert m.subscribe("$share/g1/sh/+", 1) == [1]
    plain = Paho(lmqtt_server, f"sh{version}-plain")
    plain.subscribe("sh/+", 1)
    pub = Paho(lmqtt_server, f"sh{version}-pub")
    n = 60
    for i in range(n):
        pub.publish(f"sh/{i % 4}", f"{i}".encode(), qos=1)
    received = [[int(x.payload) for x in r] for r in _collect(members, n)]
    counts = collections.Counter(i for r in received for i in r)
    assert sorted(counts) == list(range(n))               # every message delivered ...
    assert set(counts.values()) == {1}                    # ... to exactly one member
    assert all(len(r) >= 10 for r in received)            # round-robin spreads the load
    for r in received:
        assert r == sorted(r)                             # each member sees increasing order
    # a non-shared subscription still gets everything
    assert [int(x.payload) for x in plain.get_n(n)] == list(range(n))


def test_two_groups_each_get_every_message(lmqtt_server):
    a = [Paho(lmqtt_server, f"ga-{i}") for i in range(2)]
    b = [Paho(lmqtt_server, f"gb-{i}") for i in range(2)]
    for m in a:
        m.subscribe("$share/A/two/#", 0)
    for m in b:
        m.subscribe("$share/B/two/#", 0)
    pub = Paho(lmqtt_server, "two-pub")
    for i in range(20):
        pub.publish("two/x", f"{i}".encode(), qos=1)
    got_a = sorted(int(x.payload) for r in _collect(a, 20) for x in r)
    got_b = sorted(int(x.payload) for r in _collect(b, 20) for x in r)
    assert got_a == list(range(20))
    assert got_b == list(range(20))


def test_unacked_message_of_departed_member_goes_to_another(lmqtt_server):
    raw = RawMQTT(lmqtt_server, version=4)          # a member that never acks, then dies
    raw.connect("sh-dies")
    raw.send(P.Subscribe(1, [P.SubscriptionRequest("$share/g/dep/t", 1)]))
    raw.recv()
    pub = Paho(lmqtt_server, "dep-pub")
    pub.publish("dep/t", b"only", qos=1)
    got = raw.recv()
    assert got.payload == b"only"
    live = Paho(lmqtt_server, "sh-lives")
    live.subscribe("$share/g/dep/t", 1)
    raw.close()
    assert live.get().payload == b"only"


def test_amqtt_shared_members(lmqtt_server):
    from amqtt.client import MQTTClient

    async def run():
        url = f"mqtt://{lmqtt_server.host}:{lmqtt_server.port}/"
        cs = [MQTTClient(client_id=f"am-sh-{i}") for i in range(2)]
        for c in cs:
            await c.connect(url)
            await c.subscribe([("$share/am/amq/t", 1)])
        pub = MQTTClient(client_id="am-sh-pub")
        await pub.connect(url)
        for i in range(10):
            await pub.publish("amq/t", f"{i}".encode(), qos=1)
        got = []
        for c in cs:
            while True:
                try:   # amqtt raises TimeoutError when nothing more arrives
                    m = await c.deliver_message(timeout_duration=1.0)
                except asyncio.TimeoutError:
                    break
                got.append(int(bytes(m.data)))
        for c in cs + [pub]:
            await c.disconnect()
        return got

    got = asyncio.run(run())
    assert sorted(got) == list(range(10))
