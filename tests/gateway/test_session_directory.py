"""The fleet's session directory (gateway/fleet/sessions.py), over a real redis-server (`SessionDirectory`)
and relayed by a real `lmqtt store` (`StoreSessionDirectory`): a reconnect storm's claims all
reach the other gateways, in order, and a claim is never heard by the gateway that made it."""
from __future__ import annotations

import asyncio
import shutil

import pytest

from lmqtt.gateway.fleet.sessions import SessionDirectory, StoreSessionDirectory, outlives_claim
from lmqtt.gateway.storage.remote_metadata import RemoteMetadata
from lmqtt.gateway.storage.store_link import LoopConnection
from lmqtt.store import protocol as W
from tests.support import LmqttStore, redis_server_fixture, wait_until

needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")


redis_server = redis_server_fixture()


@needs_redis
def test_a_reconnect_storm_of_claims_reaches_every_other_gateway(redis_server):
    """3,000 clients attach to gateway A at once (one claim each, made in the same loop step):
    gateway B hears all of them, in order, and A hears none of its own. Each claim used to be its
    own publish task wanting its own Redis connection, and under such a burst most failed."""
    async def main():
        heard_a: list = []
        heard_b: list = []
        a = SessionDirectory(redis_server.url, "gw-a", lambda cid, ts, gid: heard_a.append((cid, ts, gid)))
        b = SessionDirectory(redis_server.url, "gw-b", lambda cid, ts, gid: heard_b.append((cid, ts, gid)))
        for d in (a, b):
            await d.start()
        try:
            for d in (a, b):
                await asyncio.wait_for(d.connected.wait(), 5)
            for i in range(3000):
                a.claim(f"dev-{i}", 1000 + i)
            assert await wait_until(lambda: len(heard_b) >= 3000, 10), f"heard {len(heard_b)} of 3000"
            assert heard_b == [(f"dev-{i}", 1000 + i, "gw-a") for i in range(3000)]
            assert a.errors == 0 and a.claims_sent == 3000 and b.claims_heard == 3000
            await asyncio.sleep(0.1)
            assert heard_a == []
        finally:
            for d in (a, b):
                await d.close()
    asyncio.run(main())


def test_the_store_relays_a_reconnect_storm_of_claims_to_every_other_gateway(tmp_path):
    """Without Redis: 3,000 clients attach to gateway A in one loop step; the store relays the
    claims and gateways B and C hear all of them, in order; A hears none of its own, and hears B's
    claim."""
    store = LmqttStore(str(tmp_path / "store"), log_path=str(tmp_path / "store.log")).start()

    async def main():
        loop = asyncio.get_running_loop()
        heard: dict[str, list] = {}
        dirs: dict[str, StoreSessionDirectory] = {}
        links = []
        try:
            for gid in ("gw-a", "gw-b", "gw-c"):
                link = LoopConnection(store.address, loop=loop)
                link.connect_blocking()
                links.append(link)
                meta = RemoteMetadata(link, gid)
                link.on_push(lambda op, body, meta=meta: meta.sessions.session_claims_frame(body)
                             if op == W.OP_SESSION_CLAIMS else None)
                meta.hello()
                await link.cmd("gw_flush")            # answered after the hello: B and C are known
                heard[gid] = []
                dirs[gid] = StoreSessionDirectory(loop, meta.sessions, lambda cid, ts, by, h=heard[gid]: h.append((cid, ts, by)))
            for i in range(3000):
                dirs["gw-a"].claim(f"dev-{i}", 1000 + i)
            assert await wait_until(lambda: len(heard["gw-b"]) >= 3000 and len(heard["gw-c"]) >= 3000, 10), \
                {g: len(h) for g, h in heard.items()}
            want = [(f"dev-{i}", 1000 + i, "gw-a") for i in range(3000)]
            assert heard["gw-b"] == want and heard["gw-c"] == want
            assert dirs["gw-a"].errors == 0 and dirs["gw-a"].claims_sent == 3000
            assert dirs["gw-b"].claims_heard == 3000
            dirs["gw-b"].claim("dev-0", 5000)             # B takes one back: A and C hear it
            assert await wait_until(lambda: heard["gw-a"] == [("dev-0", 5000, "gw-b")], 5), heard["gw-a"]
            assert await wait_until(lambda: heard["gw-c"][-1] == ("dev-0", 5000, "gw-b"), 5)
            await asyncio.sleep(0.1)
            assert len(heard["gw-b"]) == 3000             # never its own
            # B and C claim in the same moment: relayed together, each hears the other's, not its own
            dirs["gw-b"].claim("x-1", 6000)
            dirs["gw-c"].claim("x-2", 6001)
            assert await wait_until(lambda: len(heard["gw-a"]) == 3, 5), heard["gw-a"]
            assert sorted(heard["gw-a"][1:]) == [("x-1", 6000, "gw-b"), ("x-2", 6001, "gw-c")]
            assert await wait_until(lambda: heard["gw-b"][3000:] == [("x-2", 6001, "gw-c")], 5), heard["gw-b"][3000:]
            assert await wait_until(lambda: heard["gw-c"][3001:] == [("x-1", 6000, "gw-b")], 5), heard["gw-c"][3001:]
        finally:
            for link in links:
                link.close()
    try:
        asyncio.run(main())
    finally:
        assert store.stop() == 0, store.log_tail()


def test_of_two_connections_the_newer_one_stays_and_a_tie_keeps_exactly_one():
    """What each gateway decides alone when another claims a client id it holds: the connection
    attached later stays; attached in the same millisecond, the one on the greater gateway id
    stays, so the two gateways never both close theirs (nor both keep theirs)."""
    assert outlives_claim(1001, "gw-a", 1000, "gw-b") and not outlives_claim(999, "gw-a", 1000, "gw-b")
    for ours, theirs in (("gw-a", "gw-b"), ("gw-b", "gw-a"), ("gw-1", "gw-10")):
        kept = [outlives_claim(1000, ours, 1000, theirs), outlives_claim(1000, theirs, 1000, ours)]
        assert kept.count(True) == 1, (ours, theirs, kept)
    assert not outlives_claim(1000, "gw-a", 1000, "")      # a claim of no id: the claim wins
