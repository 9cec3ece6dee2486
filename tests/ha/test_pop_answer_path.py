"""How a replicated call (a POP pop/ack on a group, docs/ha.md "POP on a group") is shipped and
answered: the MetaLog hands a shipper only the changes after what it sent (read from the end of
the kept 100,000), each change's frame is encoded once for every replica, a replica's
acknowledgement answers the calls it completes on the thread that read it (no hop to the gate's
thread), and several POP consumers at once keep the kill -9 promise of tests/ha/test_replicated_pop.py."""
from __future__ import annotations

import threading
import time
import types

from hypothesis import given, settings, strategies as st

from lmqtt.store.client import connect
from lmqtt.store.ha.ack_gate import AckGate
from lmqtt.store.ha.replication import MetaLog, jframe
from tests.ha.group import StoreGroup
from tests.ha.test_replicated_pop import _fill, _pop_on_new_primary


def _reference_since(kept: list, seq: int, min_pos: int) -> list:
    return [(s, p, op) for s, p, op in kept if s > seq and p >= min_pos]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.just("reset"), st.integers(0, 3)), max_size=60), st.integers(1, 8),
       st.integers(-1, 40), st.integers(-1, 30))
def test_since_is_the_changes_after_a_sequence_as_a_full_scan_finds_them(steps, keep, seq, min_pos):
    """Adds (positions growing), resets and the bound dropping old changes: `since(seq, min_pos)`
    equals a scan of every kept change; each frame is the change's META frame, encoded once."""
    ml = MetaLog(keep=keep)
    kept: list = []
    pos = 0
    for s in steps:
        if s == "reset":
            ml.reset(pos)
            kept.clear()
            continue
        pos += s
        op = {"k": "put_json", "key": f"k{pos}", "s": "{}"}
        n = ml.add(pos, op)
        kept.append((n, pos, op))
        del kept[:-keep]
    for q in (seq, 0, ml.seq, ml.seq - 1):
        got = ml.since(q, min_pos)
        assert [(s, p, op) for s, p, op, _cell in got] == _reference_since(kept, q, min_pos)
        for e in got:
            f = MetaLog.frame(e)
            assert f == jframe(b"M", e[2]) and MetaLog.frame(e) is f


def test_a_replica_acknowledgement_answers_the_waiting_change_without_the_gate_thread():
    """The gate's own thread stopped: the acknowledgement itself (Shipper's reading thread calls
    `replica_acked`) answers a change once every in-sync replica applied it, and not before. Before,
    an acknowledgement only woke the gate's thread (one more thread wake-up per POP call)."""
    clog = types.SimpleNamespace(committed=0, flushed=0, lock=threading.Lock())
    applied = {2: 0, 3: 0}
    gate = AckGate(clog, True, 1, lambda: True, lambda: (2, 3), lambda n: 0)
    gate.replica_meta = lambda n: applied[n]
    gate._stop = True
    gate._ev.set()
    gate._thread.join(5)
    assert not gate._thread.is_alive()
    answered: list = []
    gate.meta_waiting.append((7, lambda err: answered.append((7, err))))
    gate.meta_waiting.append((8, lambda err: answered.append((8, err))))
    applied[2] = 8
    gate.replica_acked()
    assert answered == []            # replica 3 has not applied them yet
    applied[3] = 7
    gate.replica_acked()
    assert answered == [(7, None)]
    applied[3] = 9
    gate.replica_acked()
    assert answered == [(7, None), (8, None)] and not gate.meta_waiting


def test_a_change_the_replicas_applied_before_its_call_waited_is_answered_when_it_waits():
    """The replicas' acknowledgement can come before the call appends its change to the waiting
    list (the change was shipped by the thread that made it): `meta_appended` answers it there,
    with the gate's thread stopped; a change not applied yet stays waiting."""
    clog = types.SimpleNamespace(committed=0, flushed=0, lock=threading.Lock())
    gate = AckGate(clog, True, 1, lambda: True, lambda: (2, 3), lambda n: 0)
    gate.replica_meta = lambda n: 5
    gate._stop = True
    gate._ev.set()
    gate._thread.join(5)
    answered: list = []
    gate.meta_waiting.append((5, lambda err: answered.append((5, err))))
    gate.meta_appended()
    assert answered == [(5, None)]
    gate.meta_waiting.append((6, lambda err: answered.append((6, err))))
    gate.meta_appended()
    assert answered == [(5, None)] and len(gate.meta_waiting) == 1


def test_concurrent_pop_consumers_keep_every_ack_across_a_kill9(tmp_path):
    """Four POP consumers of one group pop and ack at once (their calls in flight together, answered
    from the replicas' acknowledgements by two reading threads), 240 of 400 messages; the primary is
    killed -9 the moment the last ack is answered. On the new primary the other 160 come and no
    acknowledged one comes again."""
    g = StoreGroup(str(tmp_path), 3, election_timeout=2.0).start()
    try:
        first = g.wait_primary(in_sync=3)
        _fill(g, "popc", 400)
        acked: list = []
        lock = threading.Lock()
        errors: list = []

        def consume() -> None:
            try:
                with connect(g.peers) as c:
                    pc = c.pop_consumer("popc", "workers", invisible_ms=60_000)
                    deadline = time.monotonic() + 60
                    while time.monotonic() < deadline:
                        with lock:
                            if len(acked) >= 240:
                                return
                        got = pc.pop(10)
                        if got:
                            assert pc.ack(got) == len(got)
                            with lock:
                                acked.extend(r.body for r in got)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=consume) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        first.kill9()
        assert not errors, errors
        assert len(acked) >= 240 and len(set(acked)) == len(acked)
        g.wait_primary(exclude=(first.node,), timeout=60)
        rest = {b"q%04d" % i for i in range(400)} - set(acked)
        bodies = _pop_on_new_primary(g, "popc", rest, linger=1.5)
        again = sorted(set(bodies) & set(acked))
        assert again == [], f"{len(again)} acknowledged messages popped again: {again[:10]}"
    finally:
        g.stop()


def _frames(sock, want: int) -> list:
    """`want` frames read from `sock` (kind, payload)."""
    from lmqtt.store.ha.replication import FrameReader
    reader = FrameReader(sock)
    out: list = []
    sock.settimeout(5)
    while len(out) < want:
        out += reader.feed(sock.recv(65536))
    return out


def test_a_change_is_sent_from_the_thread_that_made_it_only_where_the_stream_rule_allows():
    """Shipper._direct (a change sent by the thread that made it, not the stream's thread): the
    changes made at or below the log position the replica's stream reached go out at once, in
    order; one made beyond it waits for the stream (its log bytes first), as does any change while
    another thread writes the socket; a partial send leaves the rest for the stream's thread and
    nothing is sent directly after it until that rest went out."""
    import json
    import socket

    from lmqtt.store.ha.replication import Shipper, _Stream

    ml = MetaLog()
    sh = types.SimpleNamespace(meta=ml)
    a, b = socket.socketpair()
    try:
        a.settimeout(None)
        st = _Stream(a, 100, 0)
        ml.add(50, {"k": "put_json", "key": "x", "s": "1"})
        ml.add(100, {"k": "put_json", "key": "y", "s": "2"})
        assert Shipper._direct(sh, st) is True and st.meta_seq == 2
        got = _frames(b, 2)
        assert [json.loads(p)["key"] for _k, p in got] == ["x", "y"]
        ml.add(150, {"k": "put_json", "key": "z", "s": "3"})
        assert Shipper._direct(sh, st) is False and st.meta_seq == 2      # log bytes 100..150 first
        st.pos = 150                     # the stream shipped them
        with st.lock:                    # the stream's thread is writing
            assert Shipper._direct(sh, st) is False
        assert Shipper._direct(sh, st) is True and st.meta_seq == 3
        assert json.loads(_frames(b, 1)[0][1])["key"] == "z"
        # the replica reads nothing: the socket's buffer fills, a send goes out in part
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        big = "v" * 200_000
        ml.add(150, {"k": "put_json", "key": "big", "s": big})
        assert Shipper._direct(sh, st) is False
        assert st.pending and st.meta_seq == 4
        ml.add(150, {"k": "put_json", "key": "after", "s": "5"})
        assert Shipper._direct(sh, st) is False and st.meta_seq == 4       # the rest goes first
        from lmqtt.store.ha.replication import FrameReader
        reader = FrameReader(b)
        b.settimeout(5)
        got = []
        with st.lock:                    # what the stream's thread does first: the rest, then on
            t = threading.Thread(target=lambda: a.sendall(st.pending))
            t.start()
            while not got:
                got += reader.feed(b.recv(1 << 20))
            t.join(10)
            st.pending = b""
        assert [json.loads(p)["key"] for _k, p in got] == ["big"]
        assert Shipper._direct(sh, st) is True and st.meta_seq == 5
        while len(got) < 2:
            got += reader.feed(b.recv(1 << 20))
        assert [json.loads(p)["key"] for _k, p in got] == ["big", "after"]
    finally:
        a.close()
        b.close()
