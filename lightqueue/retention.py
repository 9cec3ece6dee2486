"""Retention of the light-queue index: where each queue starts once the store has deleted old
CommitLog segments, and the sweep that forgets the entries pointing into them, without ever
renumbering a queue.

Why it is separate from `index.py`: the index's job is dispatch (the hot path) and reads. This is
another job with its own trigger (the store deletes expired segments, then calls the index's
`on_segments_deleted`), its own thread (`lightqueue-sweep`: neither the store's retention nor
dispatch waits for a scan of the whole index) and its own persisted state, two kinds of keys in
the index's RocksDB (the full key layout is in the `index.py` docstring):

    FF 'P'        -> u64 min CommitLog offset: the log start the index knows (written with WAL)
    FF 'M' + qid  -> u64 floor: the queue's min offset after its runs were swept or dropped
    FF 'R' + bound(8) + seq(8) -> n × (qid u64, first u64, count u32): runs whose every entry
                     points below CommitLog offset `bound` (the run log, below)
    FF 'r'        -> present once every run is in the run log

The run log is what makes a sweep cost what it deletes, not the size of the index: each write of
the tails adds one record listing the runs it wrote, keyed by one past the highest CommitLog
offset their entries point at (and the write's checkpoint, for uniqueness), in the same atomic
batch as the runs. A sweep
reads the records whose bound is at or below the log start, in key order, deletes their runs and
themselves, and stops at the first newer record. Before it, every sweep scanned every run of the
index: with a 10-minute retention at 2,000 msg/s that was 1.2 million keys in Python per deleted
segment, seconds of the GIL taken from the event loop (p99 delivery latency of 100-400 ms in the
soak at each deletion) and growing with the retention. An index written before the run log
(no FF 'r') gets its records from one scan at its first sweep; a truncation rebuilds them from
its own scan, grouped by 1 MiB of the log their last entries point into (`REBUILD_BUCKET`;
retention deletes whole segments of at least that).

A floor is what keeps a queue's numbering monotonic: once every run of a queue is deleted, no run
says where the queue ended, so its end is written as its floor in the same batch that deletes the
runs (the index's `drop_queue` writes one the same way, through `put_floor`). A queue's min offset
(`min_offset`: its first entry at/after the log start, at least its floor) is computed lazily and
cached until the log start moves.

The index keeps its byte layout and its in-memory tails to itself (it owns where a queue ends and
what it holds; this module, where it starts). This module works under the index's lock and
reaches the index through the members it offers for it: `write_tails()` (write what the tails
buffer, so that they are swept too), `runs_below(min_phys)` (the RocksDB runs whose every entry
points below the log start), `forget_runs(floors)` (the tails forget the deleted runs too),
`iter_entries`, `max_offset`, `qid`, `next_qid`, `lock`, `db` and `closed`.
"""
from __future__ import annotations

import logging
import struct
import threading
from array import array
from typing import TYPE_CHECKING

from rocksdict import WriteBatch, WriteOptions

from .index_reads import RUN_KEY

if TYPE_CHECKING:
    from .index import LightQueueIndex

log = logging.getLogger(__name__)

K_MINPHYS = b"\xffP"
K_FLOOR = b"\xffM"
K_RUNLOG = b"\xffR"
K_RUNLOG_COMPLETE = b"\xffr"
RUNLOG_KEY = struct.Struct(">QQ")       # after K_RUNLOG: bound, seq (a write's checkpoint; 0: rebuilt)
RUNLOG_ENTRY = struct.Struct(">QQI")    # qid, first queue offset, entries
REBUILD_BUCKET = 1 << 20                # rebuilt records group runs by 1 MiB of the log
_U64 = struct.Struct(">Q")
_UNKNOWN = 0xFFFFFFFFFFFFFFFF      # "not computed yet" in the min-offset array


def runlog_record(bound: int, seq: int, runs: list[tuple[int, int, int]]) -> tuple[bytes, bytes]:
    """The run log's record of `runs` ((qid, first, count) each), every entry below `bound`."""
    pack = RUNLOG_ENTRY.pack
    return K_RUNLOG + RUNLOG_KEY.pack(bound, seq), b"".join(pack(*r) for r in runs)


def rebuilt_records(runs) -> list[tuple[bytes, bytes]]:
    """Run-log records for `runs` ((qid, first, count, last entry's CommitLog offset) each) found
    by a scan, one per `REBUILD_BUCKET` of the log their last entries fall in."""
    buckets: dict[int, list[tuple[int, int, int]]] = {}
    tops: dict[int, int] = {}          # bucket -> the highest last offset in it
    for qid, first, count, last_phys in runs:
        b = last_phys // REBUILD_BUCKET
        lst = buckets.get(b)
        if lst is None:
            buckets[b] = [(qid, first, count)]
            tops[b] = last_phys
        else:
            lst.append((qid, first, count))
            if last_phys > tops[b]:
                tops[b] = last_phys
    return [runlog_record(tops[b] + 1, 0, lst) for b, lst in sorted(buckets.items())]


class IndexRetention:
    """The log start (`min_phys`) of one LightQueueIndex, its queues' floors, and the sweep that
    deletes the runs below the log start."""

    @property
    def _db(self):
        """The index's database now (it is opened again after a failed write)."""
        return self._index.db

    def __init__(self, index: LightQueueIndex) -> None:
        self._index = index
        v = self._db.get(K_MINPHYS)
        self.min_phys = 0 if v is None else _U64.unpack(v)[0]
        # qid -> min offset (lazy; queue ids are dense, so a flat u64 array; reset when
        # min_phys moves)
        self._min = array("Q", [_UNKNOWN]) * index.next_qid
        self._sweeper: threading.Thread | None = None
        self.records_read = 0         # run-log records the sweeps read (and deleted)

    def min_offset(self, name: str) -> int:
        """Smallest offset still readable: entries below point into deleted CommitLog segments."""
        ix = self._index
        q = ix.qid(name)
        if q is None:
            return 0
        mn = self._min
        if q < len(mn) and mn[q] != _UNKNOWN:
            return mn[q]
        with ix.lock:
            m = self.floor(q)
            if self.min_phys:
                for e in ix.iter_entries(q, m):
                    if e.phys_offset >= self.min_phys:
                        m = e.queue_offset
                        break
                else:
                    m = ix.max_offset(name)
            self.set_min_offset(q, m)
            return m

    def set_min_offset(self, qid: int, m: int) -> None:
        mn = self._min
        if qid >= len(mn):
            mn.extend(array("Q", [_UNKNOWN]) * (qid + 1 - len(mn)))
        mn[qid] = m

    def forget_min_offsets(self) -> None:
        """Every queue's min offset is computed again on its next use."""
        self._min = array("Q", [_UNKNOWN]) * self._index.next_qid

    def floor(self, qid: int) -> int:
        """The min offset of queue `qid` after runs were swept or dropped (0: none were)."""
        v = self._db.get(K_FLOOR + _U64.pack(qid))
        return 0 if v is None else _U64.unpack(v)[0]

    @staticmethod
    def put_floor(wb: WriteBatch, qid: int, end: int) -> None:
        """Add to `wb` the floor `end` of queue `qid`."""
        wb.put(K_FLOOR + _U64.pack(qid), _U64.pack(end))

    def on_segments_deleted(self, min_phys_offset: int) -> None:
        """Retention moved the CommitLog start: min offsets move; dead runs are swept later."""
        if min_phys_offset <= self.min_phys:
            return
        ix = self._index
        with ix.lock:
            self.min_phys = min_phys_offset
            wb = WriteBatch(raw_mode=True)
            wb.put(K_MINPHYS, _U64.pack(min_phys_offset))
            self._db.write(wb, WriteOptions())   # with WAL: survives without a flush
            self.forget_min_offsets()
        if self._sweeper is None or not self._sweeper.is_alive():
            self._sweeper = threading.Thread(target=self._sweep_until_current, name="lightqueue-sweep",
                                             daemon=True)
            self._sweeper.start()

    def _sweep_until_current(self) -> None:
        done = -1
        while done < self.min_phys and not self._index.closed:   # retention may move again meanwhile
            done = self.min_phys
            try:
                self.sweep()
            except Exception:
                log.exception("light-queue sweep below %d failed; retried at the next retention", done)
                return

    def sweep(self, batch_runs: int = 10000) -> int:
        """Delete the runs of the run log's records at or below `min_phys`; returns the number
        of runs deleted (`records_read`: the records it read, all of them deleted).

        A queue keeps its offsets: if its last run is deleted, its max offset is written as the
        queue's floor in the same batch, so numbering never restarts.
        """
        ix = self._index
        deleted = 0
        min_phys = self.min_phys
        ix.write_tails()      # sweep what the tails buffer too
        if self._db.get(K_RUNLOG_COMPLETE) is None:
            self.rebuild_run_log()
        keys: list[bytes] = []
        values: list[bytes] = []
        n = 0
        it = self._db.iter(ix.scan_options())
        it.seek(K_RUNLOG)
        while it.valid() and not ix.closed:
            k = it.key()
            if not k.startswith(K_RUNLOG) or RUNLOG_KEY.unpack_from(k, len(K_RUNLOG))[0] > min_phys:
                break
            v = it.value()
            keys.append(k)
            values.append(v)
            self.records_read += 1
            n += len(v) // RUNLOG_ENTRY.size
            if n >= batch_runs:
                deleted += self._delete_runs(keys, values)
                keys, values, n = [], [], 0
            it.next()
        del it
        if keys:
            deleted += self._delete_runs(keys, values)
        return deleted

    def rebuild_run_log(self) -> None:
        """Give every run of an index written before the run log a record (one scan), then mark
        the log complete. Runs written meanwhile have records of their own: listed twice, they
        are deleted twice, which is harmless."""
        ix = self._index
        wb = WriteBatch(raw_mode=True)
        n = 0
        for k, v in rebuilt_records(ix.all_runs()):
            wb.put(k, v)
            n += len(v) // RUNLOG_ENTRY.size
        wb.put(K_RUNLOG_COMPLETE, b"")
        with ix.lock:
            self._db.write(wb, WriteOptions())
        log.info("light-queue index: run log rebuilt from a scan (%d runs)", n)

    def _delete_runs(self, record_keys: list[bytes], records: list[bytes]) -> int:
        ix = self._index
        kpack = RUN_KEY.pack
        n = 0
        with ix.lock:
            wb = WriteBatch(raw_mode=True)
            floors: dict[int, int] = {}
            for v in records:
                for qid, first, count in RUNLOG_ENTRY.iter_unpack(v):
                    wb.delete(kpack(qid, first))
                    end = first + count
                    if end > floors.get(qid, 0):
                        floors[qid] = end
                    n += 1
            for k in record_keys:
                wb.delete(k)
            for qid, end in floors.items():
                self.put_floor(wb, qid, max(end, self.floor(qid)))
            self._db.write(wb, WriteOptions())   # WAL on: a lost floor would reset offsets
            for qid in floors:
                self.set_min_offset(qid, _UNKNOWN)
            ix.forget_runs(floors)
        return n

    def join(self, timeout: float | None = None) -> None:
        """Wait for a running sweep (it stops early once the index is closed)."""
        t = self._sweeper
        if t is not None:
            t.join(timeout)
