"""The rule every client of a store group (sync, asyncio, the gateway's loop connection) follows
when a probe has found the new primary but that member, still applying its election, names the
old (stopped) primary: it is dialled again, not left for the stopped one (whose HELLO is waited
for 2 s: the slowest SIGSTOP failovers of `lmqtt bench ha` were exactly that)."""
from __future__ import annotations

import asyncio
import time

from lmqtt.store.client.aio import AsyncConnection
from lmqtt.store.client.connection import Connection
from lmqtt.store.client.failover import keeps_expected
from lmqtt.store.client.loop_connection import LoopConnection

A, B, C = ("127.0.0.1", 7001), ("127.0.0.1", 7002), ("127.0.0.1", 7003)
PEERS = "127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003"


def test_a_fresh_finding_is_kept_against_a_member_naming_another_primary():
    fresh = (B, time.monotonic() + 3.0)
    assert keeps_expected(fresh, B, "127.0.0.1:7001")          # B still names the old primary A
    assert keeps_expected(fresh, B, A)
    assert not keeps_expected(fresh, B, None)                  # unreachable: the next member
    assert not keeps_expected(fresh, B, B)                     # names itself: taking over, same place
    assert not keeps_expected(fresh, C, A)                     # aimed elsewhere: not this finding
    assert not keeps_expected((B, time.monotonic() - 0.1), B, A)   # stale: the member is believed
    assert not keeps_expected(None, B, A)


def _aimed(conn) -> tuple[str, int]:
    return (conn.host, conn.port)


def test_sync_async_and_loop_connections_stay_on_the_primary_a_probe_found():
    sync = Connection(PEERS)
    aio = AsyncConnection(PEERS)
    loop = asyncio.new_event_loop()
    link = LoopConnection(PEERS, loop=loop)
    for conn in (sync, aio, link):
        conn.host, conn.port = B
        conn._expected = (B, time.monotonic() + 3.0)
        conn._move("127.0.0.1:7001")       # what B's HELLO says while it applies its election
        assert _aimed(conn) == B, type(conn).__name__
        conn._move(None)                   # B unreachable: the next member, as before
        assert _aimed(conn) == C, type(conn).__name__
        conn.host, conn.port = B
        conn._expected = None              # no probe finding: a member's word is followed
        conn._move("127.0.0.1:7001")
        assert _aimed(conn) == A, type(conn).__name__
    loop.close()
