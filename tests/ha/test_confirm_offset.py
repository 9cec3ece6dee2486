"""The confirm offset (docs/ha.md "What a reader sees"): a group's primary makes visible (dispatch:
ConsumeQueues, light queues, the gateways' pushes, SDK pulls) only what its in-sync replicas
acknowledged, so a failover never takes back a record a reader has seen. Real member processes;
a replica's acknowledgements are blocked with SIGSTOP (our own PID)."""
from __future__ import annotations

import threading
import time

import pytest

from lmqtt.store.client import connect
from tests.ha.group import StoreGroup

pytestmark = pytest.mark.timeout(180)

TOPIC = "ha/confirm"


def _bodies(conn) -> list[bytes]:
    out, off = [], 0
    while True:
        r = conn.pull(TOPIC, 0, off, 256)
        if not r.records:
            return out
        out.extend(x.body for x in r.records)
        off = r.next_offset


def test_a_record_the_replicas_have_not_acknowledged_is_not_readable_on_the_primary(tmp_path):
    """--ack-replicas 2 of a group of 3: with one replica paused, an append on the primary cannot be
    acknowledged. It is in the primary's log, yet a pull does not return it and the dispatched
    offset stays below it; once the replica is resumed and acknowledges, the send is answered and
    the pull returns it. Before the fix the primary dispatched it at once (a pull returned it
    while no replica had it: a kill -9 of the primary then would have taken it back)."""
    group = StoreGroup(tmp_path, 3, election_timeout=2.0, extra=("--flush-mode", "async",
                                                                  "--ack-replicas", "2")).start()
    try:
        prim = group.wait_primary(in_sync=3)
        conn = connect(prim.address, timeout=60.0)
        p = conn.producer("pc")
        p.send(TOPIC, b"before")
        deadline = time.monotonic() + 30
        while _bodies(conn) != [b"before"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _bodies(conn) == [b"before"]
        end_before = conn.cmd("stats")["max_offset"]
        rep = next(m for m in group.members if m is not prim)
        rep.pause()
        result: dict = {}
        try:
            sender = threading.Thread(target=lambda: result.setdefault("r", p.send(TOPIC, b"unacked")))
            sender.start()
            deadline = time.monotonic() + 30
            st = conn.cmd("stats")
            while st["max_offset"] <= end_before and time.monotonic() < deadline:
                time.sleep(0.02)
                st = conn.cmd("stats")
            assert st["max_offset"] > end_before, "the append did not reach the primary's log"
            # give dispatch every chance to (wrongly) make it visible: several of its idle periods
            for _ in range(20):
                assert _bodies(conn) == [b"before"], "an unacknowledged record was readable on the primary"
                st = conn.cmd("stats")
                assert st["dispatched_offset"] <= end_before < st["max_offset"], st
                assert "r" not in result, "the send was acknowledged while a needed replica was paused"
                time.sleep(0.1)
        finally:
            rep.resume()
        sender.join(60)
        assert "r" in result, "the send was not answered after the replica came back"
        deadline = time.monotonic() + 30
        while _bodies(conn) != [b"before", b"unacked"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _bodies(conn) == [b"before", b"unacked"]
        assert conn.cmd("stats")["dispatched_offset"] == conn.cmd("stats")["max_offset"]
        conn.close()
    finally:
        group.stop()
