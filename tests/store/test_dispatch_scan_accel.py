"""The dispatch round's record scan in C (store/_fastpath.c `dispatch_scan`) against its reference,
the Python loop of `DispatchService.dispatch_round` (store/dispatch.py), on generated CommitLog
segments: mixed topics, keys, dispatch queues, runs (records that continue each other) and records
that only almost do, a corrupt range, a blank filler or a bad record at the end, max_batch and
chunk cuts. Both must deliver the same batches (the columnar chunk itself: sizes, run starts, run
requests, keyed), end offsets, caches, and raise the same error. Plus "built and used": with the
extension built, a real store's dispatch goes through the C scan."""
from __future__ import annotations


import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmqtt.store import Message, MessageStore, StoreConfig, fastpath
from lmqtt.store.dispatch import DispatchService
from lmqtt.store.record import BLANK_MAGIC, HEADER, HEADER_SIZE, MSG_MAGIC, PREFIX, SEP

from .dispatch_rig import run_dispatch

needs_c = pytest.mark.skipif(fastpath.dispatch_scan is None, reason="lmqtt.store._fastpath not built")


_TOPICS = ["t", "a/b", "é/x"]
_KEYS = [(), ("k",), ("k1", "k2")]
_DQS = [(), ("q1",), ("q1", "q2")]

_record = st.fixed_dictionaries({
    "topic": st.sampled_from(_TOPICS), "keys": st.sampled_from(_KEYS), "dq": st.sampled_from(_DQS),
    "qid": st.integers(0, 1), "flags": st.integers(0, 1), "born": st.integers(1, 2), "sts": st.integers(1, 2),
    "tags": st.sampled_from([0, 5]), "body": st.integers(0, 24),
    "qoff": st.sampled_from(["next", "same", "random"]), "phys": st.sampled_from(["at", "at", "off"]),
    "like_prev": st.booleans(),
})


def _segment(recs: list, tail: str, corrupt_at: int | None):
    out = bytearray()
    prev = None
    corrupt = []
    for i, r in enumerate(recs):
        if r["like_prev"] and prev is not None:          # mostly runs: copy the shape before
            r = {**prev, "qoff": r["qoff"], "phys": r["phys"], "body": r["body"]}
        tb = r["topic"].encode()
        kb = SEP.join(r["keys"]).encode()
        db = SEP.join(r["dq"]).encode()
        total = HEADER_SIZE + len(tb) + len(kb) + len(db) + r["body"]
        pos = len(out)
        if r["qoff"] == "next":
            qoff = prev["_qoff"] + 1 if prev else 0
        elif r["qoff"] == "same":
            qoff = prev["_qoff"] if prev else 0
        else:
            qoff = 7 + i
        phys = pos if r["phys"] == "at" else pos + 3
        out += HEADER.pack(total, MSG_MAGIC, 0, r["qid"], r["flags"], qoff, phys, r["born"], r["sts"], r["tags"],
                           r["body"], 0, len(tb), len(kb), len(db)) + tb + kb + db + b"x" * r["body"]
        if corrupt_at == i:
            corrupt.append((pos, pos + total))
        prev = {**r, "_qoff": qoff}
    if tail == "blank":
        out += PREFIX.pack(40, BLANK_MAGIC) + bytes(32)
    elif tail == "short":                  # less than a header left, a blank filler's prefix
        out += PREFIX.pack(12, BLANK_MAGIC) + bytes(4)
    elif tail == "bad":
        out += HEADER.pack(HEADER_SIZE + 4, 0x1234, 0, 0, 0, 0, len(out), 1, 1, 0, 0, 0, 0, 0, 0) + bytes(4)
    elif tail == "bad-topic":              # not UTF-8: the reference raises UnicodeDecodeError
        out += HEADER.pack(HEADER_SIZE + 2, MSG_MAGIC, 0, 0, 0, 0, len(out), 1, 1, 0, 0, 0, 2, 0, 0) + b"\xff\xfe"
    return bytes(out), corrupt


@needs_c
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recs=st.lists(_record, min_size=1, max_size=40),
       tail=st.sampled_from(["none", "blank", "short", "bad", "bad-topic"]),
       corrupt_at=st.none() | st.integers(0, 39),
       chunk=st.sampled_from([60, 300, 1 << 20]), max_batch=st.sampled_from([1, 3, 7, 2048]),
       cut=st.none() | st.floats(0, 1))
def test_the_c_scan_delivers_what_the_python_loop_does(recs, tail, corrupt_at, chunk, max_batch, cut):
    data, corrupt = _segment(recs, tail, corrupt_at)
    committed = None if cut is None else int(len(data) * cut)
    if committed is not None and corrupt:        # a corrupt range is one recovery found in the log
        committed = max(committed, corrupt[0][1])
    ref = run_dispatch(data, corrupt, chunk, max_batch, None, committed)
    got = run_dispatch(data, corrupt, chunk, max_batch, fastpath.dispatch_scan, committed)
    assert got == ref
    if committed is not None and ref[2] is None:
        # nothing delivered past the committed end: no record taken that is only partly there
        assert ref[1] <= committed
        ends = [end for _chunks, end in ref[0]]
        assert all(e <= committed for e in ends)


@needs_c
def test_the_dispatch_thread_uses_the_c_scan_when_built(tmp_path, monkeypatch):
    calls = []
    c = fastpath.dispatch_scan

    def counting(*a):
        calls.append(a[1])
        return c(*a)

    monkeypatch.setattr(DispatchService, "c_scan", staticmethod(counting))
    # without the live hand-off every record is parsed from the CommitLog by dispatch_round (as on
    # a replica, or in a restart's replay)
    s = MessageStore(StoreConfig(data_dir=str(tmp_path / "d"), flush_mode="async", dispatch_from_memory=False))
    s.start()
    try:
        s.append_batch([Message("t/1", b"x%d" % i) for i in range(50)])
        assert s.wait_dispatched(s.clog.wrote, 20)
        assert calls, "dispatch_round did not call the C scan"
        got = s.read_consume_queue("t/1", 0, 0, 100)
        assert [m.body for m in got] == [b"x%d" % i for i in range(50)]
    finally:
        s.shutdown()


def test_the_c_scan_is_the_one_the_loader_built():
    from lmqtt.store import accel
    mod = accel.load("lmqtt.store._fastpath")
    assert DispatchService.c_scan is (mod.dispatch_scan if mod is not None else None)


@needs_c
def test_the_c_scan_takes_the_records_itself_and_hands_back_the_odd_one():
    """Called directly: it takes every ordinary record (runs and run starts, keys, dispatch queues)
    and stops at the blank filler, leaving it to the Python loop."""
    recs = [{"topic": "t", "keys": (), "dq": (), "qid": 0, "flags": 0, "born": 1, "sts": 1, "tags": 0, "body": 5,
             "qoff": "next", "phys": "at", "like_prev": False} for _ in range(6)]
    recs[3] = {**recs[3], "keys": ("k",), "dq": ("q1", "q2")}
    data, _ = _segment(recs, "blank", None)
    blank_at = len(data) - 40
    sizes, starts, runs, tc, nc = [], [], [], {}, {}
    state = (None, -1, -1, -1, -1, -1, -1, -1, b"", 0)
    rel, keyed, state = fastpath.dispatch_scan(data, 0, len(data), len(data), -1, 2048, sizes, starts, runs, tc, nc,
                                               state)
    assert rel == blank_at and keyed is True
    assert len(sizes) == 6 and starts == [0, 3, 4]            # a run of 3, the keyed record, a run of 2
    assert [r.keys for r in runs] == [(), ("k",), ()] and runs[1].dispatch_queues == ("q1", "q2")
    assert tc == {b"t": "t"} and nc == {b"q1\x00q2": ("q1", "q2")}
    assert state[0] == b"t" and state[2] == 6                 # the open run: next queue offset 6
