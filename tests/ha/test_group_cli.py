"""lmqtt produce / consume with a store group's addresses (--store a:p,b:p,c:p): they find the
primary, and after a kill -9 of the primary a consumer group resumes on the new one from the
position it committed on the old one (group positions and the filter's registration are shipped)."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from lmqtt.store.client import connect
from tests.ha.group import StoreGroup
from tests.support import ROOT

pytestmark = pytest.mark.timeout(180)


def _cli(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=60, cwd=ROOT)


def test_produce_and_group_consume_across_a_failover(tmp_path):
    g = StoreGroup(tmp_path, 3, election_timeout=2.0).start()
    try:
        first = g.wait_primary(in_sync=3)
        out = _cli("produce", "--store", g.peers, "--topic", "cli/a", stdin="".join(f"m{i}\n" for i in range(20)))
        assert out.returncode == 0, out.stderr
        c = connect(g.peers)
        fc = c.filter_consumer("cli/+", "g1", start="earliest")
        got = []
        deadline = time.monotonic() + 20
        while len(got) < 10 and time.monotonic() < deadline:
            got += fc.poll()
        assert [r.body for r in got[:10]] == [f"m{i}".encode() for i in range(10)]
        fc.commit(got[9])                 # the group is through m9, on the first primary
        msg_id = got[3].msg_id
        c.close()
        first.kill9()
        g.wait_primary(exclude=(first.node,))
        out = _cli("produce", "--store", g.peers, "--topic", "cli/b", stdin="".join(f"n{i}\n" for i in range(5)))
        assert out.returncode == 0, out.stderr
        out = _cli("consume", "--store", g.peers, "--filter", "cli/+", "--group", "g1", "--timeout", "3",
                   "--format", "json")
        assert out.returncode == 0, out.stderr
        import json
        bodies = [json.loads(ln)["payload"] for ln in out.stdout.splitlines() if ln.strip()]
        assert bodies == [f"m{i}" for i in range(10, 20)] + [f"n{i}" for i in range(5)], (out.stdout, out.stderr)
        # a msg id given out by the old primary names the same record on the new one
        c = connect(g.peers)
        assert c.admin().get_by_msg_id(msg_id).body == b"m3"
        c.close()
    finally:
        g.stop()


def test_pop_state_is_shipped(tmp_path):
    """POP across a failover: the state persisted on the old primary (every 0.1 s, shipped as SDK
    metadata) is what the new primary serves: acknowledged records are not popped again, the
    rest are (at least once)."""
    g = StoreGroup(tmp_path, 3, election_timeout=2.0).start()
    try:
        first = g.wait_primary(in_sync=3)
        c = connect(g.peers)
        p = c.producer()
        for i in range(20):
            p.send("popq", b"q%d" % i)
        pc = c.pop_consumer("popq", "workers", invisible_ms=60_000)
        got: list = []
        deadline = time.monotonic() + 10
        while len(got) < 10 and time.monotonic() < deadline:     # an acknowledged send is popped
            got += pc.pop(10 - len(got))                           # once dispatched (a moment later)
        assert [r.body for r in got] == [b"q%d" % i for i in range(10)]
        assert pc.ack(got) == 10
        time.sleep(1.0)                  # persisted (0.1 s) and shipped
        c.close()
        first.kill9()
        g.wait_primary(exclude=(first.node,))
        c = connect(g.peers)
        pc = c.pop_consumer("popq", "workers", invisible_ms=60_000)
        rest = []
        deadline = time.monotonic() + 10
        while len(rest) < 10 and time.monotonic() < deadline:
            rest += pc.pop(32)
        assert sorted(r.body for r in rest) == sorted(b"q%d" % i for i in range(10, 20))
        c.close()
    finally:
        g.stop()


def test_a_store_with_data_joined_by_empty_members_keeps_its_data(tmp_path):
    """A plain lmqtt store with messages becomes member 3 of a new group whose members 1 and 2 are
    empty and start first (longer ago than the election timeout): the first election waits for
    every member and takes the longest log, so nothing of the old store is cut away."""
    from tests.support import LmqttStore
    g = StoreGroup(tmp_path, 3, election_timeout=2.0)
    m3 = g.members[2]
    s = LmqttStore(m3.data_dir, extra_args=("--segment-mb", "8"),
                   log_path=str(tmp_path / "standalone.log")).start()
    c = connect(s.address)
    p = c.producer()
    for i in range(100):
        p.send("old/t", b"o%d" % i)
    c.close()
    s.stop()
    try:
        g.members[0].start()
        g.members[1].start()
        time.sleep(4.0)
        assert all((m.status() or {}).get("role") != "primary" for m in g.members[:2])
        m3.start()
        prim = g.wait_primary(in_sync=3, timeout=60)
        assert prim is m3
        c = connect(g.peers)
        got = []
        off = 0
        while True:
            r = c.pull("old/t", 0, off, 1000)
            if not r.records:
                break
            got += [x.body for x in r.records]
            off = r.next_offset
        assert got == [b"o%d" % i for i in range(100)]
        c.close()
    finally:
        g.stop()
