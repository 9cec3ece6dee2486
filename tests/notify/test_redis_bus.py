"""Notify over Redis pub/sub (notify/redis_bus.py) with a real redis-server: broadcast and precise
modes, coalescing, and a Redis restart in the middle (events are hints: the subscriber resyncs)."""
from __future__ import annotations

import asyncio
import shutil
import time

import pytest

from lmqtt.loadtest.redis_streams import RedisServer
from lmqtt.notify.redis_bus import RedisEventPublisher, RedisEventSubscriber
from tests.support import redis_server_fixture, wait_until

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")


redis_server = redis_server_fixture()


async def _wait(pred, timeout=5.0):
    return await wait_until(pred, timeout)


def _collect(sub):
    got: list[set[str]] = []
    sub.subscribe(got.append)
    return got


def test_broadcast_reaches_every_gateway_and_coalesces(redis_server):
    async def main():
        a = RedisEventSubscriber(redis_server.url, "gw-a")
        b = RedisEventSubscriber(redis_server.url, "gw-b")
        ga, gb = _collect(a), _collect(b)
        await a.start()
        await b.start()
        assert await _wait(lambda: a.connected.is_set() and b.connected.is_set())
        await asyncio.sleep(0.05)
        pub = RedisEventPublisher(redis_server.url, window_s=0.05)
        try:
            for i in range(2000):                                    # a hot queue and a few others
                pub.publish({"q/hot", f"q/{i % 5}"})
            assert await _wait(lambda: set().union(*ga) >= {"q/hot", "q/0", "q/4"} if ga else False)
            assert await _wait(lambda: set().union(*gb) >= {"q/hot", "q/0", "q/4"} if gb else False)
            assert pub.messages_sent < 50, f"{pub.messages_sent} Redis messages for 2000 publishes"
        finally:
            pub.close()
            await a.close()
            await b.close()
    asyncio.run(main())


def test_precise_mode_sends_each_gateway_only_its_queues(redis_server):
    async def main():
        a = RedisEventSubscriber(redis_server.url, "gw-a", mode="precise")
        b = RedisEventSubscriber(redis_server.url, "gw-b", mode="precise")
        ga, gb = _collect(a), _collect(b)
        await a.start()
        await b.start()
        assert await _wait(lambda: a.connected.is_set() and b.connected.is_set())
        await a.watch({"sensors/+/temp", "a/only"})
        await b.watch({"sensors/+/temp", "b/only"})
        pub = RedisEventPublisher(redis_server.url, mode="precise", window_s=0.01)
        try:
            pub.publish({"sensors/+/temp", "a/only", "b/only", "nobody/watches"})
            assert await _wait(lambda: ga and gb)
            await asyncio.sleep(0.2)
            assert set().union(*ga) == {"sensors/+/temp", "a/only"}
            assert set().union(*gb) == {"sensors/+/temp", "b/only"}
            await b.unwatch({"sensors/+/temp"})
            gb.clear()
            pub.publish({"sensors/+/temp"})
            assert await _wait(lambda: len(ga) >= 2)
            await asyncio.sleep(0.2)
            assert gb == []
        finally:
            pub.close()
            await a.close()
            await b.close()
    asyncio.run(main())


def test_a_burst_of_new_queues_is_registered_complete(redis_server):
    """Precise mode: 1,000 queues start being served in one loop step (`watch_later`, what the
    gateway calls as its mirrors start), then one is dropped: every other one gets its events.
    Registering each on its own task failed most of them under such a burst (the Redis pool's
    MaxConnectionsError)."""
    async def main():
        a = RedisEventSubscriber(redis_server.url, "gw-burst", mode="precise")
        ga = _collect(a)
        await a.start()
        assert await _wait(lambda: a.connected.is_set())
        names = [f"burst/{i}" for i in range(1000)]
        for q in names:
            a.watch_later((q,))
        a.unwatch_later(["burst/0"])
        pub = RedisEventPublisher(redis_server.url, mode="precise", window_s=0.01)
        try:
            await asyncio.sleep(0.5)
            pub.publish(set(names))
            assert await _wait(lambda: set().union(set(), *ga) >= set(names[1:]))
            await asyncio.sleep(0.1)
            assert set().union(*ga) == set(names[1:])
        finally:
            pub.close()
            await a.close()
    asyncio.run(main())


def test_a_redis_restart_loses_events_but_the_subscriber_resyncs_and_resumes(tmp_path):
    srv = RedisServer()
    port = srv.port

    async def main():
        nonlocal srv
        sub = RedisEventSubscriber(srv.url, "gw-a", mode="precise", safety_poll_s=60, reconnect_max_s=0.2)
        got = _collect(sub)
        resyncs: list[float] = []
        sub.on_resync(lambda: resyncs.append(time.monotonic()))
        await sub.start()
        assert await _wait(lambda: sub.connected.is_set())
        await sub.watch({"q1"})
        assert len(resyncs) == 1                                     # on first connect
        srv.stop()
        assert await _wait(lambda: not sub.connected.is_set())
        pub = RedisEventPublisher(f"redis://127.0.0.1:{port}/0", mode="precise", window_s=0.01)
        pub.publish({"q1"})                                          # Redis is down: a lost hint
        await asyncio.sleep(0.3)
        assert pub.errors >= 1
        srv = RedisServer(port=port)                                 # restarted, empty
        assert await _wait(lambda: sub.connected.is_set(), 10)
        assert len(resyncs) == 2, "no resync after the reconnect: the lost hint would delay delivery"
        pub.publish({"q1"})                                          # watch re-registered on reconnect
        assert await _wait(lambda: any("q1" in g for g in got))
        pub.close()
        await sub.close()

    try:
        asyncio.run(main())
    finally:
        srv.stop()


def test_the_safety_poll_resyncs_while_connected(redis_server):
    async def main():
        sub = RedisEventSubscriber(redis_server.url, "gw-p", safety_poll_s=0.2)
        n = []
        sub.on_resync(lambda: n.append(1))
        await sub.start()
        assert await _wait(lambda: len(n) >= 3, 5)
        await sub.close()
    asyncio.run(main())
