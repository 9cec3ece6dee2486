"""The store node's side of shared groups across the fleet (store/node/group_assign.py) on a real
`lmqtt store`, driven through its gw_group_* commands as two gateways would send them: each
message handed to one gateway, acknowledged or handed back, a lapsed gateway's messages given to
the other, a restarted gateway process's too, and the committed offset kept across a store
restart."""
from __future__ import annotations

import time

from lmqtt.store.client import connect

Q = "jobs/a"


def _pop(c, gid: str, n: int, inc: str = "p1", ttl_ms: int = 3000, start: int | None = 0) -> list[int]:
    _header, recs = c.cmd("gw_group_pop", gateway=gid, incarnation=inc, group="crew", queue=Q, max_count=n,
                          start=start, ttl_ms=ttl_ms, wait_ms=0)
    return [r[0] for r in recs]


def _ack(c, gid: str, offsets=(), back=(), inc: str = "p1", leave: bool = False) -> int:
    return c.cmd("gw_group_ack", gateway=gid, incarnation=inc, group="crew", queue=Q, offsets=list(offsets),
                 back=list(back), leave=leave, ttl_ms=3000)["count"]


def _until_max(c, want: int) -> None:
    deadline = time.monotonic() + 10
    while c.cmd("gw_max_offsets", queues=[Q])["max_offsets"][Q] < want and time.monotonic() < deadline:
        time.sleep(0.02)


def test_each_message_to_one_gateway_acked_handed_back_and_taken_from_a_lapsed_or_restarted_one(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        p = c.producer()
        for i in range(10):
            p.send(Q, b"%d" % i)
        _until_max(c, 10)
        assert _pop(c, "gw-a", 4) == [0, 1, 2, 3]
        b1 = _pop(c, "gw-b", 4)
        # none of gw-a's; new ones in order (while gw-a is busy with its own, gw-b takes its share
        # of what is there, not necessarily all it asked for)
        assert b1 and b1 == list(range(4, 4 + len(b1)))
        assert _ack(c, "gw-a", offsets=[0, 1], back=[2]) == 2     # 2 handed back: visible again
        b2 = _pop(c, "gw-b", 4)
        assert b2[0] == 2 and 3 not in b2 and not set(b1) & set(b2)   # visible again first
        held = b1 + b2
        for _ in range(20):
            if len(held) >= 7:
                break
            held += _pop(c, "gw-b", 8)
        assert sorted(held) == [2, 4, 5, 6, 7, 8, 9], "every message but gw-a's, once"
        # gw-a stops renewing (ttl 0.3 s): what it holds (3) goes to gw-b once its lease lapses
        _pop(c, "gw-a", 1, ttl_ms=300)
        deadline = time.monotonic() + 10
        got: list[int] = []
        while not got and time.monotonic() < deadline:
            got = _pop(c, "gw-b", 4)
            time.sleep(0.05)
        assert got == [3]
        # gw-b's process restarts (a new incarnation): what the old one held is given out again
        assert sorted(_pop(c, "gw-b", 16, inc="p2")) == [2, 3, 4, 5, 6, 7, 8, 9]
        assert _ack(c, "gw-b", offsets=[2, 3, 4, 6, 7, 8, 9], inc="p2") == 7
        assert _ack(c, "gw-a", offsets=[3]) == 0                # late: given out again and done meanwhile
    lmqtt_store.restart()
    with connect(lmqtt_store.address) as c:
        # the committed offset (5: the lowest not acknowledged) survived; what was in flight at the
        # restart (5) and what was acknowledged after it (6..9) come again: at least once
        assert _pop(c, "gw-c", 16, start=None) == [5, 6, 7, 8, 9]
        assert _ack(c, "gw-c", offsets=[5, 6, 7, 8, 9], leave=True) == 5
        # every gateway left: the group is forgotten, a new one starts where it is told
        c.producer().send(Q, b"10")
        _until_max(c, 11)
        assert _pop(c, "gw-c", 16, start=11) == []
