"""The rules every client of a store group (sync, asyncio, the gateway's loop connection) follows,
written once (store/client/failover.py `Members`): when a probe has found the new primary but that
member, still applying its election, names the old (stopped) primary, it is dialled again, not
left for the stopped one (whose HELLO is waited for 2 s: the slowest SIGSTOP failovers of `lmqtt
bench ha` were exactly that); a member silent while requests wait is asked about, then left."""
from __future__ import annotations

import asyncio
import time

from lmqtt.gateway.storage.store_link import LoopConnection
from lmqtt.store.client.aio import AsyncConnection
from lmqtt.store.client.connection import Connection
from lmqtt.store.client.failover import Members, Retry, keeps_expected

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


def test_sync_async_and_loop_connections_follow_one_members_policy():
    sync = Connection(PEERS)
    aio = AsyncConnection(PEERS)
    loop = asyncio.new_event_loop()
    link = LoopConnection(PEERS, loop=loop)
    for conn in (sync, aio, link):
        assert type(conn.members) is Members, type(conn).__name__
        m = conn.members
        m.host, m.port = B
        m.expected = (B, time.monotonic() + 3.0)
        m.move("127.0.0.1:7001")           # what B's HELLO says while it applies its election
        assert _aimed(conn) == B, type(conn).__name__
        m.move(None)                       # B unreachable: the next member, as before
        assert _aimed(conn) == C, type(conn).__name__
        conn.host, conn.port = B           # the connection's own attributes are its members'
        m.expected = None                  # no probe finding: a member's word is followed
        m.move("127.0.0.1:7001")
        assert _aimed(conn) == A, type(conn).__name__
        m.attached()                       # up on A: the first attachment is no failover
        m.move(None)
        m.attached()                       # up on B: one
        assert conn.failovers == 1, type(conn).__name__
    loop.close()


def test_a_member_that_is_not_the_primary_aims_the_connection_where_it_points():
    m = Members(PEERS)
    assert m.refusal({"role": "primary"}) is None
    why = m.refusal({"role": "replica", "primary": "127.0.0.1:7003"})
    assert m.at == C and "127.0.0.1:7001 is not the group's primary (replica; primary 127.0.0.1:7003)" in why
    m.refusal({"role": "replica", "primary": "127.0.0.1:7003"})   # C names itself: taking over
    assert m.at == C and m.stay
    m.unreachable(C)                   # ... so it is dialled again, once
    assert m.at == C and not m.stay
    m.unreachable(C)
    assert m.at == A
    assert Members("127.0.0.1:7001").refusal({"role": "replica"}) is None     # one store: no group rules


def test_silence_while_requests_wait_asks_the_others_then_leaves():
    m = Members(PEERS)
    assert m.silence(time.monotonic(), pending=False) is None
    m.sent(pending=False)
    m.waiting_since -= 2.0                             # two seconds without an answer
    assert m.silence(0.0, pending=True)[0] == "probe"
    assert m.silence(0.0, pending=True) is None        # the next probe waits probe_interval
    assert m.probed(None, [B], 2.0) is None            # the others know no newer primary ...
    m.waiting_since -= 4.0
    assert m.silence(0.0, pending=True) is None        # ... so it waits, up to twice the stall timeout
    m.heard_at = 0.0
    assert m.silence(0.0, pending=True)[0] == "leave"
    why = m.probed(C, [B, C], 6.0)
    assert "the group's primary is now 127.0.0.1:7003" in why and m.expected[0] == C


def test_one_retry_schedule():
    r = Retry(0.05, 0.2, attempts=4)
    assert [r.wait(), r.wait(), r.wait(), r.wait()] == [0.05, 0.1, 0.2, None]
    assert Retry(0.05, 2.0, deadline_s=0.0).wait() is None
    g = Members(PEERS).retry(0.05, 2.0, attempts=6)
    assert g.attempts is None and g.cap == 0.1 and g.deadline is not None     # a group: members in turn


def test_a_member_list_in_a_hello_is_dialled_from_then_on():
    """A HELLO_OK's member list is dialled from then on: a later list (a member added, one
    removed) is followed, the addresses given staying last; a list that does not parse changes
    nothing. A client given one member stays on it (it may be asking that member about itself),
    and once that member is unreachable tries the others it learned of."""
    one = Members("127.0.0.1:7001")
    assert one.refusal({"role": "replica", "primary": "127.0.0.1:7003", "members": PEERS.split(",")}) is None
    assert not one.group and one.at == A and one.addresses == [A, B, C]
    one.unreachable(A)
    assert one.at == B
    alone = Members("127.0.0.1:7001")
    alone.unreachable(A)
    assert alone.at == A                                        # nothing learned: the one address stays
    m = Members(PEERS)
    why = m.refusal({"role": "replica", "primary": "127.0.0.1:7003", "members": PEERS.split(",")})
    assert why is not None and m.group and m.at == C
    assert m.addresses == [A, B, C]
    D = ("127.0.0.1", 7004)
    assert m.refusal({"role": "primary", "members": ["127.0.0.1:7002", "127.0.0.1:7003", "127.0.0.1:7004"]}) is None
    assert m.addresses == [B, C, D, A]            # A was given: tried last, not forgotten
    m.refusal({"role": "primary", "members": ["127.0.0.1:notaport"]})
    m.refusal({"role": "primary", "members": "127.0.0.1:7009"})
    assert m.addresses == [B, C, D, A]
    assert Members(PEERS).refusal({"role": "primary"}) is None and Members(PEERS).addresses == [A, B, C]
