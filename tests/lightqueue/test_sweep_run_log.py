"""Retention's sweep of the light-queue index reads the run log (lightqueue/retention.py): it
deletes the runs of the writes below the log start and reads nothing newer, however large the
index is; an index written before the run log, and one cut by a truncation, get their log from a
scan, and every queue keeps its numbering."""
from __future__ import annotations

from lmqtt.lightqueue import LightQueueIndex
from lmqtt.lightqueue.retention import K_RUNLOG, K_RUNLOG_COMPLETE
from lmqtt.store.message import DispatchRequest

SIZE = 100


def _write(idx: LightQueueIndex, phys0: int, queues: list[str], size: int = SIZE) -> int:
    """One record per queue at consecutive CommitLog offsets, written as one RocksDB write (one
    run per queue); -> the next free offset."""
    batch = [DispatchRequest(phys0 + i * size, size, "t", 0, 0, 0, 1000, 1000, 0, (), (q,))
             for i, q in enumerate(queues)]
    end = phys0 + len(queues) * size
    idx.dispatch(batch, end)
    idx.flush()
    return end


def _fill(idx: LightQueueIndex, writes: int, queues: int, size: int = SIZE) -> list[int]:
    """`writes` writes of one entry on each of `queues` queues; -> the log offset after each."""
    names = [f"dev{i}/t" for i in range(queues)]
    ends, phys = [], 0
    for _ in range(writes):
        phys = _write(idx, phys, names, size)
        ends.append(phys)
    return ends


def _record_count(idx: LightQueueIndex) -> int:
    return sum(1 for k in idx.db.keys(from_key=K_RUNLOG) if k.startswith(K_RUNLOG))


def _sweep_to(idx: LightQueueIndex, phys: int) -> None:
    idx.on_segments_deleted(phys)
    idx.retention.join(30)


def test_a_sweep_reads_only_the_writes_below_the_log_start(tmp_path):
    idx = LightQueueIndex(str(tmp_path / "ix"))
    try:
        ends = _fill(idx, writes=60, queues=20)
        assert _record_count(idx) == 60
        _sweep_to(idx, ends[9])                       # the first 10 writes point below it
        assert idx.retention.records_read == 10       # not the 60 of the index, nor its 1,200 runs
        assert _record_count(idx) == 50
        for i in (0, 7, 19):
            q = f"dev{i}/t"
            assert idx.min_offset(q) == 10 and idx.max_offset(q) == 60
            assert [e.queue_offset for e in idx.read(q, 0, 3)] == [10, 11, 12]
        _sweep_to(idx, ends[-1])                      # everything: numbering is kept in the floors
        assert _record_count(idx) == 0
        assert idx.min_offset("dev3/t") == 60 == idx.max_offset("dev3/t")
    finally:
        idx.close()


def test_an_index_without_a_run_log_gets_one_from_a_scan_at_its_first_sweep(tmp_path):
    path = str(tmp_path / "ix")
    idx = LightQueueIndex(path)
    # records of 256 KiB on 4 queues: each write covers one MiB of the log, as retention
    # deletes whole segments of at least a MiB
    ends = _fill(idx, writes=30, queues=4, size=256 << 10)
    # as an index written before the run log: runs, no records, no mark
    for k in [k for k in idx.db.keys(from_key=K_RUNLOG) if k.startswith(K_RUNLOG)]:
        idx.db.delete(k)
    idx.db.delete(K_RUNLOG_COMPLETE)
    idx.close()
    idx = LightQueueIndex(path)
    try:
        assert idx.db.get(K_RUNLOG_COMPLETE) is None
        _sweep_to(idx, ends[14])
        assert idx.db.get(K_RUNLOG_COMPLETE) is not None
        assert idx.min_offset("dev3/t") == 15 and idx.max_offset("dev3/t") == 30
        assert [e.queue_offset for e in idx.read("dev3/t", 0, 2)] == [15, 16]
        end = _write(idx, ends[-1], ["dev3/t"])       # new writes have records of their own
        _sweep_to(idx, end)
        assert idx.min_offset("dev3/t") == 31 == idx.max_offset("dev3/t")
        assert idx.read("dev0/t", 0, 10) == []
    finally:
        idx.close()


def test_after_a_truncation_the_sweep_uses_the_cut_runs_and_keeps_numbering(tmp_path):
    idx = LightQueueIndex(str(tmp_path / "ix"))
    try:
        # one write of 10 records on one queue: a single run of 10 entries, phys 0..900
        end = _write(idx, 0, ["a/t"] * 10)
        idx.truncate(450)                             # the log was cut: entries 0..4 stay
        assert idx.max_offset("a/t") == 5
        end = _write(idx, 450, ["a/t"] * 3)           # re-dispatched after the cut: 5, 6, 7
        assert [e.queue_offset for e in idx.read("a/t", 0, 10)] == list(range(8))
        # the kept run ends at phys 400: a log start past it deletes it and only it (with the
        # old record's count of 10 it would have set the floor to 10, past the queue's end)
        _sweep_to(idx, 450)
        assert idx.min_offset("a/t") == 5 and idx.max_offset("a/t") == 8
        assert [e.phys_offset for e in idx.read("a/t", 0, 10)] == [450, 550, 650]
        _sweep_to(idx, end)
        assert idx.min_offset("a/t") == 8 == idx.max_offset("a/t")
    finally:
        idx.close()
