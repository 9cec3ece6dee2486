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
import time
from array import array
from typing import TYPE_CHECKING

from rocksdict import WriteBatch, WriteOptions

if TYPE_CHECKING:
    from .index import LightQueueIndex

log = logging.getLogger(__name__)

K_MINPHYS = b"\xffP"
K_FLOOR = b"\xffM"
_U64 = struct.Struct(">Q")
_UNKNOWN = 0xFFFFFFFFFFFFFFFF      # "not computed yet" in the min-offset array
SWEEP_BATCH_RUNS = 5000             # the background sweep's pace (IndexRetention.sweep):
SWEEP_PAUSE_S = 0.25                # up to 20,000 runs a second, ~300 KiB of tombstones a batch


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
                self.sweep(SWEEP_BATCH_RUNS, SWEEP_PAUSE_S)
            except Exception:
                log.exception("light-queue sweep below %d failed; retried at the next retention", done)
                return

    def sweep(self, batch_runs: int = 10000, pause_s: float = 0.0) -> int:
        """Delete runs whose every entry is below `min_phys`; returns the number deleted.

        A queue keeps its offsets: if its last run is deleted, its max offset is written as the
        queue's floor in the same batch, so numbering never restarts.

        `pause_s`: the background sweep rests this long after each batch of `batch_runs`, and
        starts a new scan after it (a scan held open would pin the memtables flushed meanwhile);
        it stops resting once retention has moved the log start again meanwhile, so under a load
        that deletes segments faster than a paced sweep clears them it does not fall behind.
        Why it is paced: a 32 MiB segment's deletion sweeps ~240,000 runs, and written at once
        their tombstones sat in the memtable until the next flush - a rise of ~12-15 MiB of the
        broker's memory at every deletion. Paced, the flushes every second take them in slices.
        """
        ix = self._index
        deleted = 0
        min_phys = self.min_phys
        ix.write_tails()      # sweep what the tails buffer too
        start = b""
        while True:
            todo: list[tuple[bytes, int, int]] = []
            for run in ix.runs_below(min_phys, start):
                todo.append(run)
                if len(todo) >= batch_runs:
                    break
            if todo:
                deleted += self._delete_runs(todo)
            if len(todo) < batch_runs or ix.closed:
                return deleted
            start = todo[-1][0] + b"\x00"      # the next key after the last one deleted
            if pause_s and self.min_phys == min_phys:
                time.sleep(pause_s)     # not once retention moved on: a sweep behind goes flat out

    def _delete_runs(self, runs: list[tuple[bytes, int, int]]) -> int:
        ix = self._index
        with ix.lock:
            wb = WriteBatch(raw_mode=True)
            floors: dict[int, int] = {}
            for k, qid, end in runs:
                wb.delete(k)
                floors[qid] = max(floors.get(qid, 0), end)
            for qid, end in floors.items():
                self.put_floor(wb, qid, max(end, self.floor(qid)))
            self._db.write(wb, WriteOptions())   # WAL on: a lost floor would reset offsets
            for qid in floors:
                self.set_min_offset(qid, _UNKNOWN)
            ix.forget_runs(floors)
        return len(runs)

    def join(self, timeout: float | None = None) -> None:
        """Wait for a running sweep (it stops early once the index is closed)."""
        t = self._sweeper
        if t is not None:
            t.join(timeout)
