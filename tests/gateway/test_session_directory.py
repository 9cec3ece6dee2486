"""The fleet's session directory (gateway/fleet.py `SessionDirectory`) over a real redis-server:
a reconnect storm's claims all reach the other gateways, in order, and a claim is never heard by
the gateway that made it."""
from __future__ import annotations

import asyncio
import shutil

import pytest

from lmqtt.gateway.fleet import SessionDirectory
from tests.support import redis_server_fixture, wait_until

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")


redis_server = redis_server_fixture()


def test_a_reconnect_storm_of_claims_reaches_every_other_gateway(redis_server):
    """3,000 clients attach to gateway A at once (one claim each, made in the same loop step):
    gateway B hears all of them, in order, and A hears none of its own. Each claim used to be its
    own publish task wanting its own Redis connection, and under such a burst most failed."""
    async def main():
        heard_a: list = []
        heard_b: list = []
        a = SessionDirectory(redis_server.url, "gw-a", lambda cid, ts: heard_a.append((cid, ts)))
        b = SessionDirectory(redis_server.url, "gw-b", lambda cid, ts: heard_b.append((cid, ts)))
        for d in (a, b):
            await d.start()
        try:
            for d in (a, b):
                await asyncio.wait_for(d.connected.wait(), 5)
            for i in range(3000):
                a.claim(f"dev-{i}", 1000 + i)
            assert await wait_until(lambda: len(heard_b) >= 3000, 10), f"heard {len(heard_b)} of 3000"
            assert heard_b == [(f"dev-{i}", 1000 + i) for i in range(3000)]
            assert a.errors == 0 and a.claims_sent == 3000 and b.claims_heard == 3000
            await asyncio.sleep(0.1)
            assert heard_a == []
        finally:
            for d in (a, b):
                await d.close()
    asyncio.run(main())
