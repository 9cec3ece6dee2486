"""A replica is shipped CommitLog bytes in frames that need not end at a record boundary (the
primary cuts a frame at 1 MiB, store/ha/replication.py MAX_CHUNK). Its dispatch must not take the
record the last frame cut short: read from a half-written map, that record's topic (or header) is
zeros, its index entry goes to the wrong queue and its own queue is left with a hole - after a
failover, an acknowledged message that a topic read no longer finds (the kill -9 failover test met
exactly that once replica dispatch was fast enough to catch up with the shipped tail).

And a replica promoted with such a torn tail (its primary died mid-frame) cuts it before it
appends: otherwise its first appends would land after half a record, and dispatch would read them
as that record's rest."""
from __future__ import annotations

import time

import pytest

from lmqtt.store import Message
from lmqtt.store.record import HEADER_SIZE

from .test_log_shipping import _store
from .test_log_shipping_runs import _Capture, _reference


class _Dispatched(_Capture):
    def close(self) -> None:
        pass


def _settle(store, timeout: float = 5.0) -> None:
    """Until the replica's dispatch has done all it will with what it holds."""
    d = store.dispatch
    d.wake()
    deadline = time.monotonic() + timeout
    last, since = d.dispatched, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        if d.dispatched != last:
            last, since = d.dispatched, time.monotonic()
        elif time.monotonic() - since > 0.3:
            return


def _ship_to(primary, replica, end: int) -> None:
    clog = primary.clog
    pos = replica.clog.wrote
    while pos < end:
        mf = clog.mfq.find(pos)
        n = min(end, mf.end_offset) - pos
        rel = pos - mf.start_offset
        replica.clog.append_replicated(pos, bytes(mf.mm[rel:rel + n]))
        pos += n


# where the frame ends inside the cut record: in the header after its size and magic, in the
# topic, in the body
@pytest.mark.parametrize("into", [9, HEADER_SIZE + 2, HEADER_SIZE + 40])
def test_a_record_cut_by_a_frame_is_dispatched_only_once_whole(tmp_path, into):
    p = _store(tmp_path / "p")
    r = _store(tmp_path / "r")
    try:
        r.refuse_appends = "a replica"
        cap = _Dispatched()
        r.dispatch.dispatchers.append(cap)
        p.append_batch([Message(topic="a/1", body=b"a%d" % i) for i in range(100)])
        cut_at = p.clog.wrote + into        # inside the next record
        p.append_batch([Message(topic="b/1", body=b"b%d" % i + b"." * 60) for i in range(100)])
        _ship_to(p, r, cut_at)
        _settle(r)
        assert r.dispatch.dispatched <= cut_at - into, "dispatched a record the replica holds only part of"
        _ship_to(p, r, p.clog.wrote)
        r.dispatch.wake()
        assert r.wait_dispatched(p.clog.wrote, 10)
        got = [req for b in cap.batches for req in b]
        assert got == _reference(p.clog, p.clog.wrote)
        for topic in ("a", "b"):
            assert r.consume_queue_offsets(topic, 0) == p.consume_queue_offsets(topic, 0) == (0, 100)
            assert [m.body for m in r.read_consume_queue(topic, 0, 0, 200)] == \
                [m.body for m in p.read_consume_queue(topic, 0, 0, 200)]
    finally:
        p.shutdown()
        r.shutdown()


@pytest.mark.parametrize("into", [3, 9, HEADER_SIZE + 2, HEADER_SIZE + 40])
def test_a_replica_promoted_with_half_a_record_cuts_it_before_it_appends(tmp_path, into):
    p = _store(tmp_path / "p")
    r = _store(tmp_path / "r")
    try:
        r.refuse_appends = "a replica"
        p.append_batch([Message(topic="a/1", body=b"a%d" % i) for i in range(100)])
        whole = p.clog.wrote
        p.append_batch([Message(topic="a/1", body=b"lost %d" % i + b"." * 60) for i in range(100)])
        _ship_to(p, r, whole + into)     # the primary died after this frame
        _settle(r)
        assert r.dispatch.dispatched == whole
        assert r.clog.cut_partial_record(r.dispatch.dispatched) == into
        assert r.clog.wrote == r.clog.committed == whole
        assert r.clog.cut_partial_record(r.dispatch.dispatched) == 0      # nothing more to cut
        with r.clog.lock:           # as store/ha/member.py's promotion: queue offsets go on
            r.clog.queue_table.update(r.consume_queues.max_offsets())
        r.refuse_appends = None                                          # the new primary appends
        r.append_batch([Message(topic="a/1", body=b"new %d" % i) for i in range(50)])
        assert r.wait_dispatched(r.clog.wrote, 10)
        assert [m.body for m in r.read_consume_queue("a", 0, 0, 500)] == \
            [b"a%d" % i for i in range(100)] + [b"new %d" % i for i in range(50)]
    finally:
        p.shutdown()
        r.shutdown()
    # and the log reopens to the same end: no torn tail left for recovery to find
    r2 = _store(tmp_path / "r")
    try:
        assert [m.body for m in r2.read_consume_queue("a", 0, 0, 500)][-1] == b"new 49"
        assert r2.clog.tail_cut == 0
    finally:
        r2.shutdown()


def test_a_whole_log_is_not_cut(tmp_path):
    r = _store(tmp_path / "r")
    try:
        r.append_batch([Message(topic="a/1", body=b"a%d" % i) for i in range(100)])
        assert r.wait_dispatched(r.clog.wrote, 10)
        end = r.clog.wrote
        assert r.clog.cut_partial_record(0) == 0
        assert r.clog.cut_partial_record(r.dispatch.dispatched) == 0
        assert r.clog.wrote == end
    finally:
        r.shutdown()


def test_a_frame_ending_inside_a_blank_filler(tmp_path):
    """The segment's filler is dispatched (skipped) only once the segment's end is there; a replica
    promoted before that cuts back to the filler's start and appends from there."""
    p = _store(tmp_path / "p")
    r = _store(tmp_path / "r")
    try:
        r.refuse_appends = "a replica"
        body = b"x" * 60_000
        for i in range(160):                         # ~9.6 MB: crosses the first segment's end
            p.append(Message(topic="a/1", body=body + b"%d" % i))
        seg_end = p.clog.mfq.files[0].end_offset
        filler_at = max(q.phys_offset + q.size for q in _reference(p.clog, seg_end) if q.phys_offset < seg_end)
        assert seg_end - filler_at > 8
        _ship_to(p, r, seg_end - 4)
        _settle(r)
        assert r.dispatch.dispatched == filler_at
        assert r.clog.cut_partial_record(r.dispatch.dispatched) == seg_end - 4 - filler_at
        with r.clog.lock:
            r.clog.queue_table.update(r.consume_queues.max_offsets())
        r.refuse_appends = None
        r.append_batch([Message(topic="a/1", body=b"new %d" % i) for i in range(20)])
        assert r.wait_dispatched(r.clog.wrote, 10)
        got = [m.body for m in r.read_consume_queue("a", 0, 0, 500)]
        n = sum(1 for q in _reference(p.clog, seg_end) if q.phys_offset < seg_end)
        assert got == [body + b"%d" % i for i in range(n)] + [b"new %d" % i for i in range(20)]
    finally:
        p.shutdown()
        r.shutdown()


def test_a_half_shipped_record_costs_no_dispatch_rounds_and_does_not_hold_up_shutdown(tmp_path):
    """While the rest of a record has not come, the replica's dispatch thread waits for it like
    for any new data: before, it went round after round without taking anything (44,000 rounds
    for 1M messages in `lmqtt bench ha`, a CPU the group did not have), and a store stopped then
    never finished its shutdown (its last dispatch waited for bytes that were never coming)."""
    import threading
    p = _store(tmp_path / "p")
    r = _store(tmp_path / "r")
    try:
        r.refuse_appends = "a replica"
        p.append_batch([Message(topic="a/1", body=b"a%d" % i) for i in range(100)])
        whole = p.clog.wrote
        p.append_batch([Message(topic="a/1", body=b"b%d" % i + b"." * 60) for i in range(10)])
        _ship_to(p, r, whole + HEADER_SIZE + 5)
        _settle(r)
        assert r.dispatch.dispatched == whole
        d = r.dispatch
        calls = [0]
        once = d.dispatch_once

        def counting():
            calls[0] += 1
            once()
        d.dispatch_once = counting
        d.wake()
        time.sleep(0.5)
        # (one more round after each idle wait that no wake-up ended, IDLE_WAIT_MAX = 0.1 s)
        assert calls[0] <= 10, f"{calls[0]} dispatch rounds while waiting for the rest of a record"
        assert d.dispatched == whole
    finally:
        p.shutdown()
    stopped = threading.Thread(target=r.shutdown, daemon=True)
    stopped.start()
    stopped.join(30)
    assert not stopped.is_alive(), "the replica's shutdown waits for the rest of a record"
