"""POP state on a store group (docs/ha.md "Replicated metadata"): a pop, an ack and a
change of invisible time answer only once the in-sync replicas have the changed POP state, so a
primary killed right after them leaves it on the next one. Real member processes
(tests/ha/group.py), kill -9."""
from __future__ import annotations

import time

from lmqtt.store.client import connect
from tests.ha.group import StoreGroup


def _fill(g: StoreGroup, topic: str, n: int) -> None:
    with connect(g.peers) as c:
        p = c.producer()
        for i in range(0, n, 50):
            p.send_batch([(topic, b"q%04d" % j) for j in range(i, min(n, i + 50))])


def _pop_some(pc, want: int, timeout: float = 10.0) -> list:
    """Pop until `want` records came (an acknowledged send is popped once dispatched)."""
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += pc.pop(want - len(got))
    return got


def _pop_on_new_primary(g: StoreGroup, topic: str, expect: set, linger: float) -> list[bytes]:
    """On the new primary: pop (invisible 1 s, so whatever it takes for in flight and not acked
    comes back at once) until every body of `expect` came, then `linger` seconds more; every body
    popped (with repeats)."""
    bodies: list = []
    with connect(g.peers) as c:
        pc = c.pop_consumer(topic, "workers", invisible_ms=1000)
        deadline = time.monotonic() + 60
        while not expect <= set(bodies) and time.monotonic() < deadline:
            bodies += [r.body for r in pc.pop(32)]
            time.sleep(0.05)
        assert expect <= set(bodies), f"missing after the failover: {sorted(expect - set(bodies))[:10]}"
        end = time.monotonic() + linger
        while time.monotonic() < end:
            bodies += [r.body for r in pc.pop(32)]
            time.sleep(0.1)
    return bodies


def test_an_acknowledged_pop_message_is_not_popped_again_after_a_kill9_right_after_the_ack(tmp_path):
    """Pop and ack 100 of 200 messages in rounds of 20, kill -9 the primary the moment the last
    ack is answered. On the new primary every one of the other 100 comes, and none of the acked
    ones, even after their invisible time (1 s) is long over. An ack answered before its state was
    persisted (every 0.1 s) and shipped would let the last round come again."""
    g = StoreGroup(str(tmp_path), 3, election_timeout=2.0).start()
    try:
        first = g.wait_primary(in_sync=3)
        _fill(g, "popq", 200)
        c = connect(g.peers)
        pc = c.pop_consumer("popq", "workers", invisible_ms=1000)
        acked: list = []
        while len(acked) < 100:
            got = _pop_some(pc, 20)
            assert len(got) == 20
            assert pc.ack(got) == 20
            acked += [r.body for r in got]
        first.kill9()
        c.close()
        g.wait_primary(exclude=(first.node,), timeout=60)
        rest = {b"q%04d" % i for i in range(200)} - set(acked)
        bodies = _pop_on_new_primary(g, "popq", rest, linger=2.5)
        again = sorted(set(bodies) & set(acked))
        assert again == [], f"{len(again)} acknowledged messages popped again: {again[:10]}"
    finally:
        g.stop()


def test_a_pop_and_a_change_of_invisible_time_hold_on_the_next_primary(tmp_path):
    """Pop 10 with an invisible time of 2 minutes, pop 10 more with 1 s and extend 5 of those to
    2 minutes, kill -9 the primary the moment the last change is answered. On the new primary the
    other 5 come back (1 s) with every message never popped, and the 15 invisible ones do not come.
    Had neither change waited for the replicas, the extended ones would come after 1 s (and
    the first 10 again too when the 0.1 s persist had not run)."""
    g = StoreGroup(str(tmp_path), 3, election_timeout=2.0).start()
    try:
        first = g.wait_primary(in_sync=3)
        _fill(g, "popv", 100)
        c = connect(g.peers)
        long_pc = c.pop_consumer("popv", "workers", invisible_ms=120_000)
        short_pc = c.pop_consumer("popv", "workers", invisible_ms=1000)
        held = _pop_some(long_pc, 10)
        assert len(held) == 10
        brief = _pop_some(short_pc, 10)
        assert len(brief) == 10
        for r in brief[:5]:
            assert short_pc.change_invisible_time(r, 120_000) is True
        first.kill9()
        c.close()
        g.wait_primary(exclude=(first.node,), timeout=60)
        invisible = {r.body for r in held + brief[:5]}
        rest = {b"q%04d" % i for i in range(100)} - invisible
        bodies = _pop_on_new_primary(g, "popv", rest, linger=2.5)
        again = sorted(set(bodies) & invisible)
        assert again == [], f"{len(again)} messages still invisible on the old primary popped: {again}"
    finally:
        g.stop()


def test_a_shared_group_starts_after_the_acknowledged_messages_on_the_next_primary(tmp_path):
    """Shared groups across the fleet are POP-style too (store/node/group_assign.py): two gateways'
    gw_group_pop / gw_group_ack, sent here as a gateway sends them. 60 messages handed to gateway
    a, the first 40 acknowledged in order, kill -9 of the primary the moment the ack is answered:
    the next primary starts the group at 40, so gateway b gets 40..59 (what was in flight comes
    again: at least once) and none of the 40 acknowledged ones. A committed offset
    written 0.2 s after the ack and shipped without waiting would start the group over."""
    q = "jobs/a"

    def pop(c, gid: str, n: int, start=None) -> list[int]:
        _h, recs = c.cmd("gw_group_pop", gateway=gid, incarnation="p1", group="crew", queue=q, max_count=n,
                         start=start, ttl_ms=3000, wait_ms=0)
        return [r[0] for r in recs]

    g = StoreGroup(str(tmp_path), 3, election_timeout=2.0).start()
    try:
        first = g.wait_primary(in_sync=3)
        c = connect(g.peers)
        c.producer().send_batch([(q, b"%d" % i) for i in range(60)])
        got: list = []
        deadline = time.monotonic() + 10
        while len(got) < 60 and time.monotonic() < deadline:
            got += pop(c, "gw-a", 64, start=0)
        assert got == list(range(60))
        for lo in range(0, 40, 10):
            n = c.cmd("gw_group_ack", gateway="gw-a", incarnation="p1", group="crew", queue=q,
                      offsets=list(range(lo, lo + 10)), back=[], ttl_ms=3000)["count"]
            assert n == 10
        first.kill9()
        c.close()
        g.wait_primary(exclude=(first.node,), timeout=60)
        with connect(g.peers) as c:
            again: list = []
            deadline = time.monotonic() + 10
            while len(again) < 20 and time.monotonic() < deadline:
                again += pop(c, "gw-b", 64)
                time.sleep(0.05)
        assert sorted(again) == list(range(40, 60)), "the group goes on after the acknowledged messages"
    finally:
        g.stop()
