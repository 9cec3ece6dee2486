"""Everything a client relies on survives a failover of the store group (docs/ha.md "Replicated
metadata"): 3 real `lmqtt store --group` members, real `lmqtt gateway --store a,b,c` processes,
paho and SDK clients, `kill -9` of the primary.

The gateway that wrote the sessions, the will and the `$share` offsets is killed together with the
primary, so it cannot write anything again on the new primary (docs/fleet.md): whatever the clients
find afterwards on the other gateway came from the metadata the old primary shipped to its replicas.
"""
from __future__ import annotations

import contextlib
import threading
import time

import paho.mqtt.client as mqtt
import pytest

from lmqtt.store.client import connect
from tests.ha.group import StoreGroup
from tests.support import LmqttGateway

pytestmark = pytest.mark.timeout(300)


def _client(cid: str, clean: bool, gw: LmqttGateway, got: list | None = None, will=None) -> mqtt.Client:
    """A connected paho client (MQTT 3.1.1, QoS 1 subscriptions) recording (topic, payload) into
    `got`; `.present` holds the session-present flags of its CONNACKs."""
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cid, clean_session=clean, protocol=mqtt.MQTTv311)
    c.present = []
    c.subacks = []
    ready = threading.Event()
    if will is not None:
        c.will_set(*will, qos=1)

    def on_connect(_c, _u, flags, rc, _p):
        c.present.append(flags.session_present)
        c.refused = None if rc == 0 else str(rc)
        ready.set()
    c.on_connect = on_connect
    c.on_subscribe = lambda *_a: c.subacks.append(1)
    if got is not None:
        c.on_message = lambda _c, _u, m: got.append((m.topic, m.payload))
    c.connect(gw.host, gw.port, keepalive=30)
    c.loop_start()
    assert ready.wait(20), f"{cid}: no CONNACK\n{gw.log_tail()}"
    assert c.refused is None, f"{cid}: CONNACK refused ({c.refused})\n{gw.log_tail()}"
    return c


def _subscribe(c: mqtt.Client, flt: str) -> None:
    n = len(c.subacks)
    c.subscribe(flt, qos=1)
    _until(lambda: len(c.subacks) > n, 20, f"no SUBACK for {flt}")


def _publish(c: mqtt.Client, topic: str, payloads, retain: bool = False) -> None:
    for p in payloads:
        c.publish(topic, p, qos=1, retain=retain).wait_for_publish(20)


def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what}")


def _close(c: mqtt.Client) -> None:
    c.disconnect()
    c.loop_stop()


def _stop_loops(clients: list[mqtt.Client]) -> None:
    """End the network threads of the clients a test made (their gateway may be gone)."""
    for c in clients:
        try:
            c.loop_stop()
        except Exception:  # noqa: BLE001
            pass


def _resume(cid: str, gw: LmqttGateway, n: int, clients: list, what: str) -> list:
    """The persistent session `cid` connects again, on `gw`: its session is present and at least
    `n` messages come within 30 s; -> them and whatever else came in the next second (a message
    redelivered or sent twice would show)."""
    got: list = []
    c = _client(cid, False, gw, got)
    clients.append(c)
    assert c.present == [True], c.present
    _until(lambda: len(got) >= n, 30, f"{what} ({got})")
    time.sleep(1.0)
    return got


@contextlib.contextmanager
def _metadata_on_disk(member):
    """The metadata store of a stopped member, read from its own data dir."""
    from lmqtt.lightqueue.metadata import MetadataStore
    md = MetadataStore(f"{member.data_dir}/lightqueue/meta")
    try:
        yield md
    finally:
        md.close()


@pytest.fixture
def group(tmp_path):
    g = StoreGroup(tmp_path, 3, election_timeout=2.0).start()
    try:
        yield g
    finally:
        g.stop()


def test_sessions_retained_wills_and_share_offsets_survive_a_kill9_with_their_gateway(group, tmp_path):
    first = group.wait_primary(in_sync=3)
    gw_a = LmqttGateway(group.peers, log_dir=str(tmp_path)).start()
    gw_b = LmqttGateway(group.peers, log_dir=str(tmp_path)).start()
    clients = []
    try:
        pub = _client("rm-pub", True, gw_b)
        clients.append(pub)
        # a witness on B for the will
        wills: list = []
        witness = _client("rm-witness", True, gw_b, wills)
        clients.append(witness)
        _subscribe(witness, "rm/will")
        # a persistent session on A: 3 messages delivered, then offline while 5 more come
        got: list = []
        sess = _client("rm-sess", False, gw_a, got)
        _subscribe(sess, "rm/s")
        _subscribe(sess, "rm/x/+")           # a wildcard filter: its registration and queue too
        _publish(pub, "rm/s", [f"old{i}".encode() for i in range(3)])
        _publish(pub, "rm/x/1", [b"xold"])
        _until(lambda: len(got) >= 4, 20, f"the session's first messages ({got})")
        # a $share group member of a persistent session on A: the same
        shared: list = []
        sh = _client("rm-share", False, gw_a, shared)
        _subscribe(sh, "$share/g1/rm/sh")
        _publish(pub, "rm/sh", [f"sold{i}".encode() for i in range(3)])
        _until(lambda: len(shared) >= 3, 20, f"the group's first messages ({shared})")
        time.sleep(0.5)          # the delivery offsets are written (every 100 ms) before they go offline
        _close(sess)
        _close(sh)
        _publish(pub, "rm/s", [f"new{i}".encode() for i in range(5)])
        _publish(pub, "rm/x/2", [b"xnew"])
        _publish(pub, "rm/sh", [f"snew{i}".encode() for i in range(4)])
        # a retained message, and a client of A with a will
        _publish(pub, "rm/r", [b"kept"], retain=True)
        holder = _client("rm-will", True, gw_a, will=("rm/will", b"gone"))
        clients.append(holder)
        time.sleep(0.5)          # the will is stored on the store (gw_put_will) after the CONNACK

        # the primary and gateway A die together: A writes nothing to the new primary
        gw_a.kill9()
        first.kill9()
        new = group.wait_primary(exclude=(first.node,), timeout=30)
        assert new.node != first.node

        problems = {}        # each part checked whatever the others found

        def check(name, fn):
            try:
                fn()
            except AssertionError as e:
                problems[name] = str(e)[:600]

        def will():
            # A's client's will: published by the new primary once A stays gone (--will-grace-s)
            _until(lambda: ("rm/will", b"gone") in wills, 40, f"the will was not published ({wills})")

        def retained_msg():
            # the retained message, to a new subscriber after the failover
            retained: list = []
            late = _client("rm-late", True, gw_b, retained)
            clients.append(late)
            _subscribe(late, "rm/r")
            _until(lambda: ("rm/r", b"kept") in retained, 20, f"no retained message ({retained})")

        def session():
            # the persistent session resumes on B: session present, the 6 it missed (5 on its exact
            # topic, 1 on its wildcard filter), not the 4 it had
            got2 = _resume("rm-sess", gw_b, 6, clients, "the session's missed messages")
            assert sorted(got2) == [("rm/s", f"new{i}".encode()) for i in range(5)] + [("rm/x/2", b"xnew")], got2

        def share():
            # the $share group continues from its committed offset
            shared2 = _resume("rm-share", gw_b, 4, clients, "the group's missed messages")
            assert sorted(p for _t, p in shared2) == [f"snew{i}".encode() for i in range(4)], shared2
        for name, fn in (("will", will), ("retained", retained_msg), ("session", session), ("share", share)):
            check(name, fn)
        assert problems == {}, (sorted(problems), problems, gw_b.log_tail(), new.log_text()[-3000:])
        # the other replica followed the new primary without a snapshot (it had followed the same
        # old one): it holds what the old primary wrote and what the new one wrote since
        _publish(pub, "rm/r2", [b"after"], retain=True)
        other = next(m for m in group.members if m.node not in (first.node, new.node))
        group.wait_status(new, lambda s: other.node in s["in_sync"], timeout=30)
        assert f"event=ha_metadata_caught_up node={other.node} " in new.log_text(), new.log_text()[-3000:]
        time.sleep(0.5)
        other.stop()
        with _metadata_on_disk(other) as md:
            assert md.get_retained("rm/r")[0] == b"kept" and md.get_retained("rm/r2")[0] == b"after"
            assert md.get_session("rm-sess") is not None and md.get_session("rm-share") is not None
            assert md.get_will("rm-will") is None          # published by the new primary: gone
    finally:
        _stop_loops(clients)
        gw_a.stop()
        gw_b.stop()


def _bodies(conn, topic: str) -> list[bytes]:
    out, off = [], 0
    while True:
        r = conn.pull(topic, 0, off, 1024)
        if not r.records:
            return out
        out += [m.body for m in r.records]
        off = r.next_offset


def test_delayed_messages_survive_a_kill9_of_the_primary(group):
    """A delayed message produced before the failover and due after it is released once by the new
    primary; one released before the failover is not released again; one cancelled before it
    stays cancelled."""
    first = group.wait_primary(in_sync=3)
    c = connect(group.peers)
    try:
        p = c.producer()
        early = p.send("dl/t", b"early", delay=1.0)
        late = p.send("dl/t", b"late", delay=10.0)
        dropped = p.send("dl/t", b"cancelled", delay=10.0)
        assert p.cancel_delayed(dropped.msg_id)
        _until(lambda: _bodies(c, "dl/t") == [b"early"], 20, "the early delayed message")
        due = time.time() + 10.0
    finally:
        c.close()
    assert early.msg_id and late.msg_id
    first.kill9()
    new = group.wait_primary(exclude=(first.node,), timeout=30)
    c = connect(group.peers)
    try:
        _until(lambda: b"late" in _bodies(c, "dl/t"), 40, "the late delayed message after the failover\n"
               + new.log_text()[-3000:])
        while time.time() < due + 3.0:       # past every due time: nothing else comes
            time.sleep(0.2)
        assert _bodies(c, "dl/t") == [b"early", b"late"]
    finally:
        c.close()


def test_an_sdk_filter_unsubscribe_is_shipped(group):
    first = group.wait_primary(in_sync=3)
    c = connect(group.peers)
    try:
        kept = c.filter_consumer("uf/kept/#", start="latest")
        kept.poll()
        gone = c.filter_consumer("uf/gone/#", start="latest")
        gone.poll()
        assert c.cmd("unsubscribe", filter="uf/gone/#")["ok"] is True
    finally:
        c.close()
    first.kill9()
    group.wait_primary(exclude=(first.node,), timeout=30)
    c = connect(group.peers)
    try:
        p = c.producer()
        for i in range(5):
            p.send(f"uf/kept/{i}", b"k")
            p.send(f"uf/gone/{i}", b"g")
        # the new primary indexes the filter still registered, not the one unsubscribed
        _until(lambda: c.cmd("filter_offsets", filter="uf/kept/#")["max_offset"] >= 5, 20, "the kept filter")
        assert c.cmd("filter_offsets", filter="uf/gone/#")["max_offset"] == 0
    finally:
        c.close()



def test_a_member_replaced_with_an_empty_data_dir_gets_the_metadata_by_snapshot(group, tmp_path):
    """"Replacing a dead member" (docs/ha.md): a member restarted on an empty data dir copies the
    log through the stream and the metadata through a snapshot. The metadata here was written under
    the first primary, which is then killed: the second primary never shipped those changes itself
    (they are in no MetaLog), so only a snapshot brings them to the empty member. Checked on the
    member's own disk after it stopped."""
    import shutil
    first = group.wait_primary(in_sync=3)
    gw = LmqttGateway(group.peers, log_dir=str(tmp_path)).start()
    clients = []
    try:
        pub = _client("es-pub", True, gw)
        clients.append(pub)
        _publish(pub, "es/r", [b"kept"], retain=True)
        sess = _client("es-sess", False, gw, [])
        _subscribe(sess, "es/t")
        _close(sess)
        time.sleep(0.5)
        first.kill9()
        second = group.wait_primary(exclude=(first.node,), timeout=30)
        first.start()
        group.wait_status(first, lambda s: s["role"] == "replica" and first.node in s["in_sync"], timeout=60)
        x = next(m for m in group.members if m.node not in (first.node, second.node))
        x.stop()
        shutil.rmtree(x.data_dir)
        x.start()
        end = second.status()["log_end"]
        group.wait_status(x, lambda s: s["role"] == "replica" and x.node in s["in_sync"] and s["log_end"] >= end,
                          timeout=60)
        x.stop()
        with _metadata_on_disk(x) as md:
            assert md.get_retained("es/r") is not None and md.get_retained("es/r")[0] == b"kept"
            rec = md.get_session("es-sess")
            assert rec is not None and [s.filter for s in rec.subscriptions] == ["es/t"], rec
        assert "event=ha_metadata_snapshot_applied" in x.log_text()
    finally:
        _stop_loops(clients)
        gw.stop()



def test_a_replica_stopped_while_only_metadata_is_written_leaves_the_in_sync_set(group, tmp_path):
    """A replica stopped (SIGSTOP) while only metadata is written (an SDK subscribe, a persistent
    session's record: no log append) leaves the in-sync set after the lag bound like one behind on
    the log, so the writes waiting for it are answered; it is not put back while it lacks them,
    and once resumed it applies them and is. Checked on its own disk."""
    first = group.wait_primary(in_sync=3)
    gw = LmqttGateway(group.peers, log_dir=str(tmp_path)).start()
    clients = []
    c = connect(group.peers, timeout=30.0)
    try:
        # a replica that is not the Raft leader: stopping the leader stalls Raft for an election,
        # which is not what this test is about (and can depose the primary, whose heartbeats then
        # reach the new leader late)
        leader = first.status()["raft_leader"]
        behind = max((m for m in group.members if m.node != first.node and leader != m.raft_address),
                     key=lambda m: m.node)
        behind.pause()
        t0 = time.monotonic()
        assert c.cmd("subscribe", filter="ic/f/#")["filter"] == "ic/f/#"     # answered without it
        assert time.monotonic() - t0 < 20
        sess = _client("ic-sess", False, gw)
        clients.append(sess)
        _subscribe(sess, "ic/t")
        st = first.status()
        assert behind.node not in st["in_sync"], st
        time.sleep(1.0)                  # not put back while stopped (it lacks those changes)
        assert behind.node not in first.status()["in_sync"]
        behind.resume()
        group.wait_status(first, lambda s: behind.node in s["in_sync"], timeout=60)
        behind.stop()
        with _metadata_on_disk(behind) as md:
            rec = md.get_session("ic-sess")
            assert rec is not None and [s.filter for s in rec.subscriptions] == ["ic/t"], rec
            assert md.filters().get("ic/f/#") == 1, md.filters()
    finally:
        c.close()
        _stop_loops(clients)
        gw.stop()


def test_which_replica_a_new_primary_brings_up_to_date_without_a_snapshot():
    """Member._catch_up, the new primary's choice (no processes): a replica that followed the same
    old primary gets the changes after its last one, if the new primary applied them all; one that
    has changes the new primary lacks, followed another numbering, or was cut short needs a
    snapshot (None)."""
    from types import SimpleNamespace
    from lmqtt.store.ha.member import Member
    ops = [(n, {"k": "md", "n": n}) for n in range(11, 16)]          # applied 11..15, tail from 10
    me = SimpleNamespace(_promoted_from=("old-primary", 4, 15, 10, ops))

    def hs(**kw):
        return {"follow_id": "old-primary", "meta_epoch": 4, "follow_seq": 12, **kw}
    assert [op["n"] for op in Member._catch_up(me, hs())] == [13, 14, 15]
    assert Member._catch_up(me, hs(follow_seq=15)) == []
    assert Member._catch_up(me, hs(follow_seq=10)) == [op for _n, op in ops]
    assert Member._catch_up(me, hs(follow_seq=16)) is None           # it has a change we lack
    assert Member._catch_up(me, hs(follow_seq=9)) is None            # older than the tail kept
    assert Member._catch_up(me, hs(follow_id="another")) is None
    assert Member._catch_up(me, hs(meta_epoch=3)) is None
    assert Member._catch_up(me, hs(meta_incomplete=True)) is None
    assert Member._catch_up(me, hs(follow_seq=None)) is None
    assert Member._catch_up(SimpleNamespace(_promoted_from=None), hs()) is None
