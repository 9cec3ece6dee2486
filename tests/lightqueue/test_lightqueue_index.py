"""The RocksDB light-queue index driven through the Dispatcher protocol with real DispatchRequests.

These tests run without a MessageStore: they play the dispatch stage by hand, so index
behaviour (offsets, runs, replay, truncate, retention) is checked on its own.
"""
from __future__ import annotations

import sys
import time

import pytest

from lmqtt.lightqueue import LightQueueIndex
from lmqtt.store.message import DispatchRequest


def req(phys, size=100, queues=("t",), ts=1000):
    return DispatchRequest(phys, size, "t", 0, 0, 0, ts, ts, 0, (), tuple(queues))


def feed(idx, records, phys0=0, size=100):
    """Dispatch records = [queues, ...] at consecutive offsets; returns (batch, end_offset)."""
    batch = [req(phys0 + i * size, size, qs) for i, qs in enumerate(records)]
    end = phys0 + len(records) * size
    idx.dispatch(batch, end)
    return batch, end


def phys_list(idx, q, start=0, n=10**6):
    return [e.phys_offset for e in idx.read(q, start, n)]


def test_fanout_offsets_contiguous_per_queue(tmp_path):
    idx = LightQueueIndex(str(tmp_path / "ix"))
    feed(idx, [("a/b", "a/+", "#"), ("a/c", "a/+", "#"), ("x", "#")])
    feed(idx, [("a/b", "#"), ("a/b", "a/+")], phys0=300)
    assert phys_list(idx, "a/b") == [0, 300, 400]
    assert phys_list(idx, "a/+") == [0, 100, 400]
    assert phys_list(idx, "#") == [0, 100, 200, 300]
    assert [e.queue_offset for e in idx.read("#", 0, 100)] == [0, 1, 2, 3]
    assert idx.max_offset("a/b") == 3 and idx.min_offset("a/b") == 0
    # reads starting inside a run and across run boundaries
    assert [e.queue_offset for e in idx.read("#", 2, 100)] == [2, 3]
    assert phys_list(idx, "a/b", 1, 1) == [300]
    assert idx.checkpoint() == 0  # nothing flushed yet
    idx.flush()
    assert idx.checkpoint() == 500


def test_unknown_queue_is_empty_not_an_error(tmp_path):
    idx = LightQueueIndex(str(tmp_path / "ix"))
    assert idx.read("nope", 0, 10) == []
    assert idx.max_offset("nope") == 0 and idx.min_offset("nope") == 0


def test_replay_below_checkpoint_is_skipped(tmp_path):
    idx = LightQueueIndex(str(tmp_path / "ix"))
    batch, end = feed(idx, [("q",), ("q",)])
    idx.dispatch(batch, end)             # the store re-dispatches the same records
    assert phys_list(idx, "q") == [0, 100]


def test_reopen_after_flush_keeps_everything_and_continues_offsets(tmp_path):
    p = str(tmp_path / "ix")
    idx = LightQueueIndex(p)
    feed(idx, [("q", "w/+")] * 5)
    idx.flush()
    idx.close()
    idx = LightQueueIndex(p)
    assert idx.checkpoint() == 500
    assert idx.max_offset("q") == 5
    feed(idx, [("q",)], phys0=500)
    assert phys_list(idx, "q") == [0, 100, 200, 300, 400, 500]
    assert idx.max_offset("w/+") == 5
    idx.close()


def test_truncate_forgets_entries_at_and_after_offset(tmp_path):
    idx = LightQueueIndex(str(tmp_path / "ix"))
    feed(idx, [("q", "r")] * 4)
    feed(idx, [("q",)] * 2, phys0=400)
    idx.truncate(250)
    assert phys_list(idx, "q") == [0, 100, 200]
    assert phys_list(idx, "r") == [0, 100, 200]
    assert idx.max_offset("q") == 3 and idx.checkpoint() == 250
    # re-dispatch after the cut continues the numbering without gaps
    idx.dispatch([req(250, 100, ("q",))], 350)
    assert [(e.queue_offset, e.phys_offset) for e in idx.read("q", 0, 10)][-1] == (3, 250)


def test_retention_moves_min_offset_and_sweep_keeps_numbering(tmp_path):
    p = str(tmp_path / "ix")
    idx = LightQueueIndex(p)
    # A RocksDB write holds every entry buffered since the last one; flush() writes, so each
    # feed below becomes its own run (the sweep deletes whole runs).
    feed(idx, [("q",)] * 3)                      # run 1: offsets 0..2, phys 0..200
    idx.flush()
    feed(idx, [("q",), ("old",)], phys0=300)     # run 2: q 3 (phys 300), old 0 (phys 400)
    idx.flush()
    feed(idx, [("q",)], phys0=500)               # run 3: q 4 (phys 500)
    idx.on_segments_deleted(450)
    idx.retention.join(10)
    assert idx.min_offset("q") == 4
    assert idx.min_offset("old") == 1 == idx.max_offset("old")   # everything gone, numbering kept
    assert phys_list(idx, "q", 0) == [500]       # reading below min skips the swept runs
    idx.flush()
    idx.close()
    idx = LightQueueIndex(p)
    assert idx.min_offset("old") == 1 and idx.max_offset("old") == 1
    feed(idx, [("old",)], phys0=600)
    assert [(e.queue_offset, e.phys_offset) for e in idx.read("old", 0, 10)] == [(1, 600)]
    idx.close()


def test_sweep_in_small_paced_batches_deletes_every_dead_run_and_keeps_live_ones(tmp_path):
    """The background sweep deletes a segment's runs a slice at a time, scanning again after each
    slice: no dead run may be skipped at a slice's edge and no live run deleted."""
    idx = LightQueueIndex(str(tmp_path / "ix"))
    names = [f"dev{i:03d}" for i in range(53)]
    feed(idx, [(n,) for n in names])                       # one dead run per queue (phys < 5300)
    idx.flush()
    feed(idx, [(n,) for n in names[::2]], phys0=10_000)    # a live run for every other queue
    idx.flush()
    idx.retention.min_phys = 5_300
    idx.retention.forget_min_offsets()
    assert idx.retention.sweep(batch_runs=7, pause_s=0.001) == 53
    assert list(idx.runs_below(5_300)) == []
    for i, n in enumerate(names):
        live = [10_000 + (i // 2) * 100] if i % 2 == 0 else []
        assert phys_list(idx, n, 0) == live
        assert idx.min_offset(n) == 1 and idx.max_offset(n) == (2 if i % 2 == 0 else 1)
    idx.close()


def test_a_paced_sweep_stops_pausing_once_retention_moves_on(tmp_path):
    """Segments deleted faster than a paced sweep clears them: the sweep goes flat out instead of
    falling further behind (8 slices with 3-s pauses would take 21 s)."""
    import threading

    idx = LightQueueIndex(str(tmp_path / "ix"))
    feed(idx, [(f"dev{i:03d}",) for i in range(53)])
    idx.flush()
    idx.retention.min_phys = 5_300
    idx.retention.forget_min_offsets()
    bump = threading.Timer(0.5, lambda: setattr(idx.retention, "min_phys", 5_400))
    bump.start()
    t0 = time.monotonic()
    assert idx.retention.sweep(batch_runs=7, pause_s=3.0) == 53
    assert time.monotonic() - t0 < 12
    bump.join()
    idx.close()


def test_drop_queue_keeps_offsets_monotonic(tmp_path):
    idx = LightQueueIndex(str(tmp_path / "ix"))
    feed(idx, [("a/+",)] * 3)
    assert idx.drop_queue("a/+")
    assert idx.read("a/+", 0, 10) == []
    assert idx.min_offset("a/+") == 3 == idx.max_offset("a/+")
    feed(idx, [("a/+",)], phys0=300)
    assert [e.queue_offset for e in idx.read("a/+", 0, 10)] == [3]
    assert not idx.drop_queue("never-seen")


def test_many_queues_one_batch(tmp_path):
    idx = LightQueueIndex(str(tmp_path / "ix"))
    n = 5000
    feed(idx, [(f"dev/{i}",) for i in range(n)])
    assert idx.queue_count() == n
    assert all(idx.max_offset(f"dev/{i}") == 1 for i in range(0, n, 97))
    assert phys_list(idx, "dev/4321") == [432100]


def test_clean_close_flushes_so_nothing_needs_replay(tmp_path):
    p = str(tmp_path / "ix")
    idx = LightQueueIndex(p)
    feed(idx, [("q",)] * 3)
    idx.close()
    idx.flush()                      # after close: harmless no-op
    idx = LightQueueIndex(p)
    assert idx.checkpoint() == 300 and phys_list(idx, "q") == [0, 100, 200]
    idx.close()


@pytest.mark.parametrize("preload", [0, 10_000])
def test_names_resolve_after_reopen_with_and_without_preload(tmp_path, preload):
    p = str(tmp_path / "ix")
    idx = LightQueueIndex(p)
    feed(idx, [(f"n/{i}", "all/+") for i in range(50)])
    idx.close()
    idx = LightQueueIndex(p, preload_names=preload)
    assert idx._all_names is (preload > 0)
    assert idx.max_offset("n/7") == 1 and idx.max_offset("all/+") == 50
    assert idx.read("missing", 0, 1) == []
    feed(idx, [("n/7",), ("brand/new",)], phys0=5000)
    assert phys_list(idx, "n/7") == [700, 5000]
    assert phys_list(idx, "brand/new") == [5100]
    assert idx.queue_count() == 52
    idx.close()


def test_batch_touching_many_queues_is_cut_into_consistent_writes(tmp_path):
    """Each sub-write carries the checkpoint of its last record, so replay stays exact."""
    p = str(tmp_path / "ix")
    idx = LightQueueIndex(p)
    idx.max_queues_per_write = 10
    feed(idx, [(f"q/{i % 25}", "all") for i in range(100)])
    assert [e.queue_offset for e in idx.read("all", 0, 1000)] == list(range(100))
    assert phys_list(idx, "q/3") == [300, 2800, 5300, 7800]
    assert idx._ckpt == 10000
    # a replay of the whole batch (the store restarting from an older checkpoint) adds nothing
    idx.dispatch([req(i * 100, 100, (f"q/{i % 25}", "all")) for i in range(100)], 10000)
    assert idx.max_offset("all") == 100 and idx.max_offset("q/3") == 4
    idx.close()


def test_reads_span_written_runs_and_the_unwritten_tail(tmp_path):
    """Entries are readable as soon as they are dispatched, before any RocksDB write; reads
    that start in RocksDB continue in memory, at every offset, and a reopen sees the same."""
    p = str(tmp_path / "ix")
    idx = LightQueueIndex(p)
    idx.tail_entries = 4                          # most written entries leave memory
    feed(idx, [("a", "all")] * 20)                # written by the flush below
    idx.flush()
    feed(idx, [("a", "all"), ("b", "all")] * 5, phys0=2000)   # still only in memory
    assert idx.checkpoint() == 2000 and idx._dirty
    want_a = [i * 100 for i in range(20)] + [2000 + i * 200 for i in range(5)]
    want_all = [i * 100 for i in range(20)] + [2000 + i * 100 for i in range(10)]
    for _ in range(2):
        for q, want in (("a", want_a), ("all", want_all)):
            assert idx.max_offset(q) == len(want)
            for off in range(len(want) + 1):
                for n in (1, 3, 100):
                    got = idx.read(q, off, n)
                    assert [e.queue_offset for e in got] == list(range(off, min(len(want), off + n)))
                    assert [e.phys_offset for e in got] == want[off:off + n]
                    assert idx.read_raw(q, off, n) == [(e.queue_offset, e.phys_offset, e.size) for e in got]
        idx.close()
        idx = LightQueueIndex(p)
    idx.close()


def test_a_busy_queues_write_is_stored_as_bounded_runs_read_back_whole(tmp_path, monkeypatch):
    """A write of many entries of one queue becomes several runs of at most MAX_RUN_BYTES (no
    value as large as a write), and every offset still reads back in order, before and after a
    reopen, and after a truncate inside one of them."""
    from lmqtt.lightqueue import index as index_mod
    monkeypatch.setattr(index_mod, "MAX_RUN_BYTES", 7 * index_mod.ENTRY_SIZE)
    p = str(tmp_path / "ix")
    idx = LightQueueIndex(p)
    idx.tail_entries = 2
    feed(idx, [("a", "all")] * 40)
    idx.flush()
    feed(idx, [("all",)] * 9, phys0=4000)
    idx.flush()
    runs = [(k, v) for k, v in idx.db.items() if not k.startswith(b"\xff")]
    assert runs and max(len(v) for _, v in runs) <= 7 * index_mod.ENTRY_SIZE
    assert len(runs) >= 49 // 7
    want = [i * 100 for i in range(40)] + [4000 + i * 100 for i in range(9)]
    for _ in range(2):
        for off in range(len(want) + 1):
            assert phys_list(idx, "all", off, 11) == want[off:off + 11]
        assert phys_list(idx, "a") == want[:40]
        idx.close()
        idx = LightQueueIndex(p)
    idx.truncate(1750)                  # inside the third run of "all"
    assert phys_list(idx, "all") == want[:18]
    idx.close()


def test_runs_written_raw_before_the_encoding_and_encoded_ones_read_as_one_queue(tmp_path, monkeypatch):
    """An index written before runs were encoded holds raw runs: they read back beside the new,
    encoded ones (when the C module is built), at every offset, also after a truncate and a
    retention sweep that meet both kinds."""
    from lmqtt.store import accel, consume_queue_entries as blocks
    p = str(tmp_path / "ix")
    monkeypatch.setattr(blocks, "encode_block", None)
    idx = LightQueueIndex(p)
    idx.tail_entries = 2
    feed(idx, [("a", "all")] * 30)
    idx.close()
    monkeypatch.undo()
    idx = LightQueueIndex(p)
    idx.tail_entries = 2
    raw = [v for k, v in idx.db.items() if not k.startswith(b"\xff")]
    assert raw and all(len(v) % 20 == 0 for v in raw)
    feed(idx, [("a", "all")] * 30, phys0=3000)
    idx.flush()
    values = [v for k, v in idx.db.items() if not k.startswith(b"\xff")]
    if accel.load("lmqtt.store._fastpath") is not None:
        assert sum(map(len, values)) < sum(map(len, raw)) + 100     # 30 more entries in a few bytes
    want = [i * 100 for i in range(60)]
    for off in range(61):
        assert phys_list(idx, "all", off, 7) == want[off:off + 7]
    idx.truncate(5000)
    assert phys_list(idx, "a") == want[:50]
    idx.on_segments_deleted(3000)             # the raw run lies wholly below: swept
    idx.retention.join(10)
    assert idx.min_offset("all") == 30 and phys_list(idx, "all") == want[30:50]
    idx.close()
    idx = LightQueueIndex(p)
    assert phys_list(idx, "a", 30) == want[30:50] and idx.max_offset("a") == 50
    idx.close()


def test_write_threshold_and_queue_cap_write_runs_without_a_flush(tmp_path):
    """Buffered entries go to RocksDB every `write_records` records, checkpoint included."""
    idx = LightQueueIndex(str(tmp_path / "ix"))
    idx.write_records = 10
    feed(idx, [("w", "w/all")] * 9)
    assert idx._written_ckpt == 0
    feed(idx, [("w",)], phys0=900)
    assert idx._written_ckpt == 1000 and not idx._dirty
    assert phys_list(idx, "w") == [i * 100 for i in range(10)]
    idx.close()


def test_dropped_queue_gets_new_entries_after_the_drop(tmp_path):
    """A dispatch tuple seen before a drop (its tails cached) lands in the new tail after it."""
    idx = LightQueueIndex(str(tmp_path / "ix"))
    feed(idx, [("t", "w/+")] * 2)
    assert idx.drop_queue("w/+")
    feed(idx, [("t", "w/+")], phys0=200)
    assert [(e.queue_offset, e.phys_offset) for e in idx.read("w/+", 0, 10)] == [(2, 200)]
    assert phys_list(idx, "t") == [0, 100, 200]
    idx.close()


def test_take_touched_names_every_queue_of_the_batches_since_the_last_call(tmp_path):
    idx = LightQueueIndex(str(tmp_path / "ix"))
    feed(idx, [("x/1", "x/+"), ("x/2", "x/+")])
    feed(idx, [("y",)], phys0=200)
    assert idx.take_touched() == {"x/1", "x/2", "x/+", "y"}
    assert idx.take_touched() == set()
    idx.close()


def test_concurrent_readers_see_exact_contiguous_entries_while_tails_are_written_trimmed_evicted(tmp_path):
    """Reads take no lock: while one thread dispatches (with writes, tail trims and evictions
    forced often), readers at random offsets must only ever get the right entries, contiguous
    from the offset asked, and max offsets that never go back."""
    import random
    import sys
    import threading
    idx = LightQueueIndex(str(tmp_path / "ix"))
    idx.write_records = 50
    idx.tail_entries = 4
    idx.tail_queues = 5
    k = 9
    total = 6000
    names = [f"q/{j}" for j in range(k)] + ["all"]

    def phys_of(name, off):
        return off * 100 if name == "all" else (int(name[2:]) + k * off) * 100

    errors = []
    done = threading.Event()

    def reader(seed):
        rnd = random.Random(seed)
        last = dict.fromkeys(names, 0)
        while not done.is_set():
            name = rnd.choice(names)
            hi = idx.max_offset(name)
            if hi < last[name]:
                errors.append(f"{name}: max offset went back {last[name]} -> {hi}")
            last[name] = hi
            off = rnd.randrange(hi + 1)
            got = idx.read_raw(name, off, rnd.choice((1, 7, 300)))
            for i, (qoff, phys, size) in enumerate(got):
                if qoff != off + i or phys != phys_of(name, qoff) or size != 100:
                    errors.append(f"{name} read at {off}: entry {i} = {(qoff, phys, size)}")
                    break

    readers = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    old_switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)   # interleave readers with the dispatcher as often as possible
    for t in readers:
        t.start()
    try:
        for b in range(0, total, 37):
            n = min(37, total - b)
            feed(idx, [(f"q/{i % k}", "all") for i in range(b, b + n)], phys0=b * 100)
    finally:
        done.set()
        for t in readers:
            t.join(10)
        sys.setswitchinterval(old_switch)
    assert errors == []
    for name in names:
        want = [phys_of(name, o) for o in range(idx.max_offset(name))]
        assert phys_list(idx, name) == want
    assert idx.max_offset("all") == total
    idx.close()


def test_drop_queue_while_dispatching(tmp_path):
    """An unsubscribe drops a wildcard queue while the dispatch thread keeps appending to it:
    nothing fails, the other queues are exact, the dropped queue's numbering only moves on."""
    import threading
    idx = LightQueueIndex(str(tmp_path / "ix"))
    idx.write_records = 40
    errors = []
    stop = threading.Event()

    def dispatcher():
        try:
            for b in range(0, 4000, 20):
                feed(idx, [(f"t/{i % 3}", "w/+") for i in range(b, b + 20)], phys0=b * 100)
                time.sleep(0)          # let the dropping thread in between batches, not only at GIL switches
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(repr(e))
        finally:
            stop.set()

    # Python's 5 ms switch interval let the dispatcher finish all 4,000 records before the main
    # thread ran once (drops == 0, alone; the full suite had a shorter interval set by then)
    old_switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        t = threading.Thread(target=dispatcher)
        t.start()
        drops = 0
        while not stop.is_set() and drops < 20:
            if idx.max_offset("w/+"):
                idx.drop_queue("w/+")
                drops += 1
        t.join(30)
    finally:
        sys.setswitchinterval(old_switch)
    assert errors == [] and drops > 0
    for j in range(3):
        assert phys_list(idx, f"t/{j}") == [i * 100 for i in range(j, 4000, 3)]
    got = idx.read("w/+", 0, 10_000)
    assert [e.queue_offset for e in got] == list(range(idx.max_offset("w/+") - len(got), idx.max_offset("w/+")))
    assert [e.phys_offset for e in got] == list(range(got[0].phys_offset, 400_000, 100)) if got else True
    idx.close()


def test_a_quiet_queues_written_tail_stays_near_tail_entries(tmp_path):
    from lmqtt.lightqueue.take import ENTRY_SIZE
    """Many quiet queues (a device's topic each), an entry each per write: every written tail is
    trimmed back to tail_entries as soon as it holds an eighth more, so what they hold together
    neither waits for twice tail_entries nor swings with it; every offset still reads back."""
    idx = LightQueueIndex(str(tmp_path / "ix"))
    idx.tail_entries = 16
    queues = [f"dev{i}/sensor" for i in range(50)]
    lengths = []
    for w in range(60):
        feed(idx, [(q,) for q in queues], phys0=w * 5000)
        idx.flush()
        lengths.append(max(len(ba) // ENTRY_SIZE for _, ba in idx._tail.values()))
    assert max(lengths) <= 16 + 2                 # trimmed at +2, not at twice 16
    assert min(lengths[16:]) >= 16                # and never below the entries it keeps
    for q in queues[:3]:
        assert [e.queue_offset for e in idx.read(q, 0, 100)] == list(range(60))
        assert phys_list(idx, q)[:2] == [queues.index(q) * 100, 5000 + queues.index(q) * 100]
    idx.close()


def test_a_flush_writes_in_slices_and_keeps_every_record_dispatched_meanwhile(tmp_path):
    """A flush writes the unwritten queues `flush_slice` at a time and lets the lock go in between
    (dispatch, inline on the gateway's event loop, waits for one slice, not for the whole write:
    2,000 device queues at once held it 5-10 ms). Only its last write moves the checkpoint.
    Records dispatched between its slices, into queues written already and not yet, are all kept:
    after a reopen every record below the checkpoint is in each of its queues, in order, once."""
    import random

    from lmqtt.lightqueue.index import K_CKPT, RUN_KEY
    p = str(tmp_path / "ix")
    idx = LightQueueIndex(p)
    idx.flush_slice = 16
    commits = []                       # per RocksDB write: (queues with runs in it, checkpoint moved)
    orig_commit = idx._commit

    def commit(ops):
        commits.append(({RUN_KEY.unpack(k)[0] for k, _ in ops if len(k) == RUN_KEY.size},
                        any(k == K_CKPT for k, _ in ops)))
        orig_commit(ops)
    idx._commit = commit
    sent = []                          # (phys, queues) of every dispatched record, in order
    phys = [0]
    rnd = random.Random(1)

    def send(n):
        recs = [(f"d/{rnd.randrange(200)}", "d/+") for _ in range(n)]
        _b, end = feed(idx, recs, phys0=phys[0])
        sent.extend((phys[0] + i * 100, qs) for i, qs in enumerate(recs))
        phys[0] = end

    class Between:
        """The index's lock; while `on`, each time it is taken from the outside a few records are
        dispatched first: what the event loop does while a flush lets the lock go."""
        def __init__(self, real):
            self.real, self.depth, self.on, self.injected = real, 0, False, 0

        def __enter__(self):
            if self.on and self.depth == 0:
                self.on = False
                send(3)
                self.injected += 1
                self.on = True
            self.real.acquire()
            self.depth += 1

        def __exit__(self, *exc):
            self.depth -= 1
            self.real.release()

        def acquire(self, *a, **k):
            return self.real.acquire(*a, **k)

        def release(self):
            self.real.release()

    send(400)                          # ~200 device queues and the filter's queue unwritten
    lock = idx._lock = Between(idx._lock)
    for _ in range(3):
        n0 = len(commits)
        lock.on = True
        idx.flush()
        lock.on = False
        flush = commits[n0:]
        sliced = [qs for qs, ck in flush if not ck]
        assert all(len(qs) <= 16 for qs in sliced) and flush[-1][1], flush
        assert [ck for _qs, ck in flush].count(True) == 1
        if not n0:
            assert len(sliced) >= 10, flush          # ~200 queues, 16 a write
    assert lock.injected >= 12
    ckpt = idx.checkpoint()
    assert ckpt > 40_000
    idx._db.close()                    # a crash after the flushes (no final flush of the tails)
    idx = LightQueueIndex(p)
    for q in {q for _p, qs in sent for q in qs}:
        want = [x for x, qs in sent if q in qs and x < ckpt]
        assert [x for x in phys_list(idx, q) if x < ckpt] == want, q
    idx.close()
