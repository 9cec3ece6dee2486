"""The group state Raft decides (store/ha/state.py), on a real one-member pysyncobj group: only an
in-sync member may become primary, every election moves the epoch, stale requests are refused."""
from __future__ import annotations

import time

import subprocess
import sys

from lmqtt.store.ha.raft import SyncObj, SyncObjConf
from lmqtt.store.ha.state import GroupState
from tests.support import free_port


def test_elections_and_in_sync_changes_are_fenced_by_epoch():
    st = GroupState()
    raft = SyncObj(f"127.0.0.1:{free_port()}", [], conf=SyncObjConf(autoTick=True), consumers=[st])
    try:
        deadline = time.monotonic() + 10
        while not raft.isReady() and time.monotonic() < deadline:
            time.sleep(0.05)
        call = lambda fn, *a: fn(*a, sync=True, timeout=5)    # noqa: E731
        assert call(st.elect, 0, 1) == 1                    # first election: anyone
        assert (st.epoch, st.primary, st.in_sync) == (1, 1, frozenset({1}))
        assert call(st.change_in_sync, 1, 1, (2, 3), ()) == (1, 2, 3)
        assert call(st.change_in_sync, 1, 2, (), (1,)) is None      # only the primary changes it
        assert call(st.change_in_sync, 0, 1, (), (2,)) is None      # a stale epoch changes nothing
        assert call(st.change_in_sync, 1, 1, (), (3,)) == (1, 2)
        assert call(st.elect, 1, 3) is None                 # 3 is not in sync: never primary
        assert call(st.elect, 0, 2) is None                 # decided on a stale epoch
        assert call(st.elect, 1, 2) == 2
        # the old primary left the in-sync set: it must catch up before it counts again
        assert (st.epoch, st.primary, st.in_sync) == (2, 2, frozenset({2}))
        assert call(st.heartbeat, 1, 1, 100) == (2, 2, (2,))  # what a deposed primary hears back
    finally:
        raft.destroy()


def test_member_list_changes_are_compare_and_set_and_drop_a_removed_node_everywhere():
    """Two changes asked on the same version: the second is refused (one change at a time, never
    crossed); a removed node leaves the in-sync set and the reports at once, is not added back by
    a late in-sync proposal nor recorded by a late heartbeat; the primary is never removed here."""
    st = GroupState()
    raft = SyncObj(f"127.0.0.1:{free_port()}", [], conf=SyncObjConf(autoTick=True), consumers=[st])
    try:
        deadline = time.monotonic() + 10
        while not raft.isReady() and time.monotonic() < deadline:
            time.sleep(0.05)
        call = lambda fn, *a: fn(*a, sync=True, timeout=5)    # noqa: E731
        assert call(st.elect, 0, 1) == 1
        assert call(st.change_in_sync, 1, 1, (2, 3), ()) == (1, 2, 3)
        three = {1: "h:1", 2: "h:2", 3: "h:3"}
        four = {**three, 4: "h:4"}
        assert call(st.set_members, 0, four, {"op": "add", "node": 4}, 4, ()) == 1
        assert call(st.set_members, 0, {**three, 5: "h:5"}, {"op": "add", "node": 5}, 5, ()) is None
        assert (st.members, st.members_version, st.next_node) == (four, 1, 4)
        assert call(st.change_in_sync, 1, 1, (4,), ()) == (1, 2, 3, 4)
        call(st.heartbeat, 3, 1, 50)
        # remove 3: out of the in-sync set and the reports in the same command
        assert call(st.set_members, 1, {1: "h:1", 2: "h:2", 4: "h:4"}, {"op": "remove", "node": 3}, 4, (3,)) == 2
        assert st.in_sync == frozenset({1, 2, 4}) and 3 not in st.reports
        assert call(st.change_in_sync, 1, 1, (3,), ()) == (1, 2, 4)     # proposed before the removal
        call(st.heartbeat, 3, 1, 60)
        assert 3 not in st.reports
        # the primary: refused (membership.py hands over first)
        assert call(st.set_members, 2, {2: "h:2", 4: "h:4"}, None, 4, (1,)) is None
        assert call(st.set_members, 2, dict(st.members), None, 4, ()) == 3     # settled
        assert st.changing is None
    finally:
        raft.destroy()


def test_a_store_group_member_process_keeps_a_working_socket_inet_ntop():
    """pysyncobj replaces socket.inet_ntop with a Windows-only function on import (store/ha/raft.py):
    a member process (and any process that imported store.ha, as a test worker) then failed every
    address formatting with it - psutil's connection listing included (the million bench's bound
    test skipped in CI for exactly that). In a fresh interpreter, as a member imports it."""
    code = ("import socket, psutil, os\n"
            "import lmqtt.store.ha.member, lmqtt.store.ha.state\n"
            "import pysyncobj.tcp_connection\n"
            "assert socket.inet_ntop(socket.AF_INET, b'\\x7f\\x00\\x00\\x01') == '127.0.0.1'\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
            "assert any(c.laddr.port == s.getsockname()[1] for c in psutil.Process().net_connections('tcp'))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_new_raft_leader_does_not_take_a_live_primary_for_silent_next_to_its_own_heartbeats():
    """The controller's liveness rule (store/ha/member.py `alive_members`). The replica that was
    the Raft leader is stopped: the other replica (2) wins the Raft election and its own heartbeats
    are applied at once, while the primary's (1) come back only once it found the new leader. Seen
    from 2, one second into its leadership: 1's last heartbeat 2.6 s before 2's newest. A new
    leader leaves its own heartbeats out of the reference, so 1 stays alive (it was deposed once,
    under CI load); a leader of longer standing, or a primary that is silent next to the other
    members' heartbeats too, is judged as before."""
    from lmqtt.store.ha.member import alive_members
    now = 100.0
    seen = {1: now - 2.6, 2: now, 3: now - 2.9}            # 3: stopped just before 1's gap began
    assert 1 in alive_members(seen, 2, now, 2.5, new_leader=True)        # (3 too: judged against 1)
    assert alive_members(seen, 2, now, 2.5, new_leader=False) == {2}      # the rule before
    # a primary that really died, judged against a third member's heartbeats
    gone = {1: now - 2.6, 2: now, 3: now - 0.1}
    assert alive_members(gone, 2, now, 2.5, new_leader=True) == {2, 3}
    # three members heard from within the bound: all alive either way
    fine = {1: now - 0.3, 2: now, 3: now - 0.2}
    assert alive_members(fine, 2, now, 2.5, new_leader=True) == {1, 2, 3}
