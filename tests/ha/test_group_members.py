"""Members of a running store group changed online (docs/ha.md "Changing the members"): real member
processes, a real `lmqtt gateway`, paho QoS 1 publishers, and the user's commands (`lmqtt store
--join`, `lmqtt admin --add-member / --remove-member / --members`) as subprocesses. Every PUBACKed
message must be in the group's log once after the changes (the chaos checker's verdict), and no
member but the one added or removed may restart.

`LMQTT_MEMBERS_LONG=1` runs the load test with a longer load and more rounds."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from lmqtt.loadtest.chaos.checker import Checker, failures
from lmqtt.store.client import connect
from tests.ha.group import MqttPublisher, StoreGroup, read_back
from tests.support import ROOT, LmqttGateway

pytestmark = pytest.mark.timeout(300)

LONG = os.environ.get("LMQTT_MEMBERS_LONG") == "1"
TOPIC = "members/t"


@pytest.fixture
def group(tmp_path):
    g = StoreGroup(tmp_path, 3, election_timeout=2.0).start()
    extra: list = []
    g.added = extra
    try:
        yield g
    finally:
        for m in extra:
            m.stop()
        g.stop()


def _members(group: StoreGroup) -> dict:
    out = group.admin("--members", "--format", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _add(group: StoreGroup, label: int):
    """What a user does to add a member: start it with --join, then --add-member. Returns it, with
    its node id as the group gave it."""
    m = group.joining(label)
    group.added.append(m)
    deadline = time.monotonic() + 30
    while "event=ha_join_waiting" not in m.log_text() and time.monotonic() < deadline:
        time.sleep(0.1)     # listening and asking the members (a dial before that is refused)
    out = group.admin("--add-member", m.address)
    assert out.returncode == 0, (out.stdout, out.stderr, m.log_text()[-3000:])
    st = json.loads(group.admin("--members", "--format", "json").stdout)
    node = [int(n) for n, a in st["members"].items() if a == m.address]
    assert len(node) == 1, st
    m.node = node[0]
    assert m.node in st["in_sync"], st       # --add-member waits until it counts toward acknowledgements
    group.members.append(m)
    return m


def _remove(group: StoreGroup, m) -> subprocess.CompletedProcess:
    out = group.admin("--remove-member", str(m.node))
    assert out.returncode == 0, (out.stdout, out.stderr)
    # the removed store stops by itself, saying why
    assert m.proc.wait(30) == 0, m.log_text()[-3000:]
    assert "removed from store group" in m.log_text()
    group.members.remove(m)
    return out


def _role_events(members) -> str:
    """Each member's role and Raft events from its log: what a failed check of who is primary
    needs to be read (elections, handovers, promotions, removals)."""
    keys = ("ha_elect", "ha_handover", "ha_primary ", "ha_becoming", "ha_member_", "ha_raft", "ha_members ",
            "leader")
    out = []
    for m in members:
        lines = [ln for ln in m.log_text().splitlines() if any(k in ln for k in keys)]
        out.append(f"--- node {m.node}:\n" + "\n".join(lines[-40:]))
    return "\n".join(out)


def _starts(m) -> int:
    """How many times this member's store opened (a restart in place keeps the pid: count the log)."""
    return m.log_text().count(" started: log [")


def test_a_group_grows_to_five_shrinks_to_three_and_replaces_a_member_under_mqtt_load(group, tmp_path):
    group.wait_primary(in_sync=3)
    originals = list(group.members)
    pids = {m.node: m.proc.pid for m in originals}
    gw = LmqttGateway(group.peers, log_dir=str(tmp_path)).start()
    ck = Checker()
    pubs = []
    try:
        pubs = [MqttPublisher(f"p{i}", gw, ck, topic=TOPIC, limit=200_000, seconds=240 if LONG else 90)
                for i in range(2)]
        for p in pubs:
            p.t.start()

        def load_goes_on(n: int = 300) -> None:
            at = sum(p.acked for p in pubs)
            deadline = time.monotonic() + 60
            while sum(p.acked for p in pubs) < at + n and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sum(p.acked for p in pubs) >= at + n, "the load stopped:\n" + gw.log_tail()

        load_goes_on()
        removed = []
        for _round in range(3 if LONG else 1):
            # grow 3 -> 5
            m4 = _add(group, 10 + 3 * _round)
            load_goes_on()
            m5 = _add(group, 11 + 3 * _round)
            st = _members(group)
            assert len(st["members"]) == 5 and len(st["in_sync"]) == 5, st
            assert st["ack_replicas"] == 2, st         # a majority of five, counting the primary
            load_goes_on()
            # shrink 5 -> 3
            _remove(group, m5)
            load_goes_on()
            _remove(group, m4)
            removed += [m4, m5]
            st = _members(group)
            assert len(st["members"]) == 3 and st["ack_replicas"] == 1, st
            load_goes_on()
        # replace a replica, then the primary: removing the primary first hands over to an in-sync
        # member (the writes in flight go to it as after an election), asked again it is removed
        primary = group.wait_primary()
        replica = next(m for m in originals if m is not primary)
        new = [_add(group, 98)]
        load_goes_on()
        _remove(group, replica)
        load_goes_on()
        new.append(_add(group, 99))
        load_goes_on()
        primary = group.wait_primary()      # asked again: a starved machine may have held an election
        out = _remove(group, primary)
        assert "is the primary: handed over to node" in out.stderr, out.stderr
        load_goes_on()
        st = _members(group)
        assert sorted(st["members"].values()) == sorted(m.address for m in group.members), st
        assert sorted(st["in_sync"]) == sorted(m.node for m in group.members), st
        stayed = [m for m in originals if m in group.members]
        assert 1 <= len(stayed) <= 2 and len(group.members) == 3

        for p in pubs:
            p.stop.set()
            p.t.join(30)
        deadline = time.monotonic() + 60
        while any(p.acked < p.sent for p in pubs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(p.acked == p.sent for p in pubs), ([(p.sent, p.acked) for p in pubs], gw.log_tail())

        # the members now in the group, the added one included, hold the primary's whole log
        primary = group.wait_primary()
        end = primary.status()["log_end"]
        for m in group.members:
            group.wait_status(m, lambda st, n=m.node: st["log_end"] == end and n in st["in_sync"])
        # every acknowledged message is in the group's log once (read from the primary)
        total = sum(p.sent for p in pubs)
        rows = read_back(group.address_list(), "members/#", pubs, "mqtt")
        assert failures(rows) == [] and rows[0]["lost"] == 0 and rows[0]["duplicated"] == 0, rows
        assert total > 0 and rows[0]["acked"] == total, rows

        # the member that stayed was never restarted: same process, its store opened once; the
        # added ones opened theirs once
        for m in stayed:
            assert m.proc.poll() is None and m.proc.pid == pids[m.node], m.node
            assert _starts(m) == 1, m.log_text()[-3000:]
        for m in new:
            if m in group.members:
                assert m.proc.poll() is None and _starts(m) == 1, m.log_text()[-3000:]
        # and no member's control loop failed on the way (it logs and goes on: a bug would hide)
        for m in originals + group.added:
            assert "event=ha_control_failed" not in m.log_text(), m.log_text()[-3000:]
    finally:
        for p in pubs:
            p.stop.set()
            try:
                p.close()
            except Exception:  # noqa: BLE001
                pass
        gw.stop()


def test_member_changes_are_persisted_refused_when_they_cannot_work_and_hand_the_primary_over(group):
    """A member restarted after the group grew uses the current members, not its --peers; the
    refusals name their cause; a dead member is replaced; removing the primary first hands over
    to an in-sync member; a removed member's data dir does not start as that member again; a
    member removed while stopped stops once resumed."""
    group.wait_primary(in_sync=3)
    # an address where nothing listens: named, nothing changed
    out = group.admin("--add-member", "127.0.0.1:1")
    assert out.returncode == 4 and "cannot reach 127.0.0.1:1" in out.stderr and "--join" in out.stderr, out.stderr
    # a member already in the group
    out = group.admin("--add-member", group.members[1].address)
    assert out.returncode == 4 and "is node 2 of store group 'g1' already" in out.stderr, out.stderr
    # someone else's node
    out = group.admin("--remove-member", "127.0.0.1:9")
    assert out.returncode == 4 and "is not a member of store group 'g1'" in out.stderr, out.stderr
    # --join with --peers: refused before anything is created
    bad = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "store", "--group", "g1", "--join",
                          group.address_list(), "--peers", group.peers, "--node-id", "1", "--data-dir",
                          os.path.join(group.root, "bad")], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode != 0 and "leave --peers" in bad.stderr, bad.stderr
    assert not os.path.exists(os.path.join(group.root, "bad"))

    m4 = _add(group, 4)
    assert _members(group)["members"] == {"1": group.members[0].address, "2": group.members[1].address,
                                          "3": group.members[2].address, "4": m4.address}
    # a change under way refuses another: the removal's Raft step waits a moment for the removed
    # member to learn it, and the add asked right after it is refused, naming it
    with connect(group.address_list()) as c:
        c.cmd("member_remove", member=str(m4.node))
        try:
            c.cmd("member_add", address="127.0.0.1:2")
            refused = ""
        except Exception as e:  # noqa: BLE001 - the refusal is what is checked
            refused = str(e)
    assert "a member change is under way (remove node 4" in refused, refused
    assert m4.proc.wait(30) == 0
    group.members.remove(m4)
    deadline = time.monotonic() + 30      # the removal, asked without `lmqtt admin`'s wait, settles
    while _members(group)["changing"] and time.monotonic() < deadline:
        time.sleep(0.2)
    # the removed store's data dir does not start as that member again
    again = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "store", "--group", "g1", "--join",
                            group.address_list(), "--port", str(m4.port), "--data-dir", m4.data_dir],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert again.returncode == 1 and "which was removed from the group" in again.stderr, again.stderr

    m5 = _add(group, 5)
    assert m5.node == 5             # node ids are never given twice
    table = group.admin("--members")
    assert table.returncode == 0 and "5 members" not in table.stdout and "4 members" in table.stdout, table.stdout
    assert m5.address in table.stdout and group.members[0].address in table.stdout, table.stdout
    assert "primary" in table.stdout and "in sync" in table.stdout, table.stdout
    # a member restarted with its first command line (--peers of three) uses the four members
    primary = group.wait_primary(in_sync=4)
    other = next(m for m in group.members[:3] if m is not primary)
    other.proc.send_signal(signal.SIGKILL)
    other.proc.wait(10)
    other.start()
    st = group.wait_status(other, lambda s: s["role"] == "replica" and other.node in s["in_sync"], timeout=60)
    assert sorted(int(n) for n in st["members"]) == sorted(m.node for m in group.members), st
    # a dead member replaced: removed first (3 of the 4 keep the majority), then a new one added
    dead = next(m for m in group.members[:3] if m is not primary and m is not other)
    dead.kill9()
    out = group.admin("--remove-member", dead.address)
    assert out.returncode == 0, (out.stdout, out.stderr)
    group.members.remove(dead)
    m6 = _add(group, 6)
    assert m6.node == 6 and len(_members(group)["members"]) == 4
    # removing the primary: the primary hands over first (the CALL answers so), then the new one
    # removes it; `lmqtt admin` does both
    with connect(group.address_list()) as c:
        try:
            c.cmd("member_remove", member=str(primary.node))
            answer = ""
        except Exception as e:  # noqa: BLE001 - the answer is what is checked
            answer = str(e)
    assert f"node {primary.node} is the primary: handed over to node" in answer, answer
    new = group.wait_primary(exclude=(primary.node,))
    out = _remove(group, primary)
    st = _members(group)
    assert st["primary"] == new.node and len(st["members"]) == 3, (st, answer, _role_events([*group.members, primary]))
    # a member removed while it was stopped (SIGSTOP: it can apply nothing) stops once resumed
    gone = next(m for m in group.members if m is not new)
    gone.pause()
    try:
        out = group.admin("--remove-member", gone.address)
        assert out.returncode == 0, (out.stdout, out.stderr)
    finally:
        gone.resume()
    assert gone.proc.wait(60) == 0, gone.log_text()[-3000:]
    assert "removed from store group 'g1'" in gone.log_text()
    group.members.remove(gone)
    assert len(_members(group)["members"]) == 2


def test_an_sdk_client_given_one_replica_finds_the_primary_and_follows_a_failover(group):
    """`connect()` with one member's address (a replica's): its refusal names the primary, which
    the client writes through; after a kill -9 of it the client tries the members the HELLO_OK
    listed and writes through the next primary (before, it dialled the dead one until it gave up);
    every acknowledged message is read back once."""
    primary = group.wait_primary(in_sync=3)
    replica = next(m for m in group.members if m is not primary)
    conn = connect(replica.address, failover_timeout=60)
    try:
        p = conn.producer()
        acked = [p.send(TOPIC, b"m%d" % i).queue_offset is not None and i for i in range(50)]
        primary.kill9()
        group.members.remove(primary)
        group.wait_primary(exclude=(primary.node,))
        acked += [p.send(TOPIC, b"m%d" % i).queue_offset is not None and i for i in range(50, 100)]
        fc = conn.filter_consumer(TOPIC, start="earliest")
        got: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(got) < 100 and time.monotonic() < deadline:
            got += [r.body for r in fc.poll()]
        assert sorted(got) == sorted(b"m%d" % i for i in range(100)), len(got)
    finally:
        conn.close()
