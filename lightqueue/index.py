"""LightQueueIndex: the RocksDB index of every light queue, fed by the store's dispatcher.

Why this shape (DESIGN.md "Light queues", seed 000 "轻型队列 / 百万队列能力"):

* One record is written once to the CommitLog; each light queue only stores a 20-byte entry
  (CommitLog offset u64, size u32, store time u64) pointing at it.
* The WAL is disabled: the CommitLog is the log. The dispatch checkpoint (CommitLog offset
  dispatched) is written in the *same* WriteBatch as the entries, and RocksDB applies a batch
  atomically to one memtable. A crash loses whole trailing batches, never half of one, so after
  reopen index and checkpoint agree and the store's re-dispatch from that checkpoint rebuilds
  exactly what was lost (no gaps, no duplicates).
* One `WriteBatch.put` costs ~3 µs in Python, too slow for 800,000 entries/s. So within one
  dispatch batch, all entries of one queue are packed into ONE value ("run") under the key
  `queue-id (8 bytes BE) + first queue offset (8 bytes BE)`. Runs of a queue are contiguous; a
  read at offset k finds the run with the greatest first offset <= k (`seek_for_prev`).
* Queue names map to 8-byte queue ids (allocated on first entry, persisted in the same batch).
  A queue's max offset is not stored separately: it is `first + count` of its last run, i.e.
  persisted atomically with the entries; it is cached in memory after first use.

Key layout (queue ids are < 2**63, so run keys never start with 0xFF):

    qid(8) + first_offset(8)  -> n × entry(20)      a run of n consecutive entries
    FF 'C'                    -> u64 checkpoint    CommitLog offset fully dispatched
    FF 'N' + name             -> u64 qid   (no reverse map: one put less per new queue)
    FF 'X'                    -> u64 next qid      FF 'P' -> u64 min CommitLog offset (retention)
    FF 'M' + qid              -> u64 floor         min offset after runs were swept/dropped
"""
from __future__ import annotations

import logging
import struct
import threading
from array import array
from collections import defaultdict
from itertools import islice
from typing import Iterable, NamedTuple

from rocksdict import BlockBasedOptions, Options, Rdict, WriteBatch, WriteOptions

from .errors import LightQueueError

log = logging.getLogger(__name__)

ENTRY = struct.Struct(">QIQ")      # phys_offset, size, store_ts
ENTRY_SIZE = ENTRY.size            # 20
_U64 = struct.Struct(">Q")
_KEY = struct.Struct(">QQ")        # qid, first queue offset

K_CKPT = b"\xffC"
K_NAME = b"\xffN"
K_NEXT = b"\xffX"
K_MINPHYS = b"\xffP"
K_FLOOR = b"\xffM"
_UNKNOWN = 0xFFFFFFFFFFFFFFFF      # "max offset not loaded yet" in the max-offset array
_ITER = ENTRY.iter_unpack


class IndexEntry(NamedTuple):
    queue_offset: int
    phys_offset: int
    size: int
    store_ts: int


class LightQueueIndex:
    """The Dispatcher (store protocol) that writes light-queue entries, plus index reads."""

    name = "lightqueue"

    def __init__(self, path: str, *, write_buffer_mb: int = 64, preload_names: int = 2_000_000) -> None:
        """Open the index. Up to `preload_names` queue names are loaded into memory at open, so
        that a name missing from memory is known to be new without a RocksDB lookup (profiling
        the million-new-queues load showed that miss as the second cost after the write)."""
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_write_buffer_size(write_buffer_mb << 20)
        opts.set_max_background_jobs(2)
        # Name lookups of brand-new queues are misses: bloom filters (SST and memtable) answer
        # most of them without a skiplist/SST search.
        bbo = BlockBasedOptions()
        bbo.set_bloom_filter(10, False)
        opts.set_block_based_table_factory(bbo)
        opts.set_memtable_prefix_bloom_ratio(0.05)
        opts.set_memtable_whole_key_filtering(True)
        try:
            self._db = Rdict(str(path), opts)
        except Exception as e:   # e.g. the directory is locked by another process
            raise LightQueueError(f"cannot open light-queue index at {path}: {e}") from e
        self._wo = WriteOptions()
        self._wo.disable_wal = True
        v = self._db.get(K_CKPT)
        self._ckpt = 0 if v is None else _U64.unpack(v)[0]
        self._durable_ckpt = self._ckpt
        v = self._db.get(K_NEXT)
        self._next_qid = 1 if v is None else _U64.unpack(v)[0]
        v = self._db.get(K_MINPHYS)
        self.min_phys = 0 if v is None else _U64.unpack(v)[0]
        self._qids: dict[str, int] = {}     # name -> qid (cache of FF 'N')
        # True when _qids holds every name, so a miss means "new queue" without a DB lookup.
        self._all_names = self._next_qid - 1 <= preload_names
        if self._all_names and self._next_qid > 1:
            n = len(K_NAME)
            for k, v in self._db.items(from_key=K_NAME):
                if not k.startswith(K_NAME):
                    break
                self._qids[k[n:].decode("utf-8")] = _U64.unpack(v)[0]
        # qid -> next offset to write, lazily loaded. Queue ids are dense, so a flat u64 array
        # (8 bytes per queue) instead of a dict (~100 bytes per queue at a million queues).
        self._max = array("Q", [_UNKNOWN]) * self._next_qid
        self._min = array("Q", [_UNKNOWN]) * self._next_qid   # qid -> min offset (lazy; reset on retention)
        self._lock = threading.RLock()      # guards lazy loads vs. sweeps/truncate
        self._pending: set[str] = set()     # queues that got entries since last take_touched()
        # Recently written entries per queue, in memory: qid -> (first offset, packed entries),
        # the newest <= tail_entries of the queue, contiguous. A reader that keeps up (the
        # gateway's live delivery) is served from here without a RocksDB iterator + seek, which
        # was most of a small pull's cost. Bounded to tail_queues queues (oldest write evicted).
        # Replaced wholesale (never mutated) so a reader's snapshot tuple is always consistent.
        self._tail: dict[int, tuple[int, bytes]] = {}
        self._closed = False
        self._sweeper: threading.Thread | None = None

    # ---------------------------------------------------------------- names and offsets
    def qid(self, name: str) -> int | None:
        """The queue id of `name`, or None if the queue never got an entry."""
        q = self._qids.get(name)
        if q is None:
            if self._all_names:
                return None
            v = self._db.get(K_NAME + name.encode("utf-8"))
            if v is None:
                return None
            q = self._qids[name] = _U64.unpack(v)[0]
        return q

    def _load_max(self, qid: int) -> int:
        with self._lock:
            m = self._max_get(qid)
            if m is not None:
                return m
            m = self._floor(qid)
            it = self._db.iter()
            it.seek_for_prev(_KEY.pack(qid, 0xFFFFFFFFFFFFFFFF))
            if it.valid():
                k = it.key()
                if len(k) == 16 and k[:8] == _U64.pack(qid):
                    m = max(m, _KEY.unpack(k)[1] + len(it.value()) // ENTRY_SIZE)
            self._max_set(qid, m)
            return m

    def _max_get(self, qid: int) -> int | None:
        mx = self._max
        if qid < len(mx):
            m = mx[qid]
            if m != _UNKNOWN:
                return m
        return None

    def _max_set(self, qid: int, m: int) -> None:
        mx = self._max
        if qid >= len(mx):
            mx.extend(array("Q", [_UNKNOWN]) * (qid + 1 - len(mx)))
        mx[qid] = m

    def _min_set(self, qid: int, m: int) -> None:
        mn = self._min
        if qid >= len(mn):
            mn.extend(array("Q", [_UNKNOWN]) * (qid + 1 - len(mn)))
        mn[qid] = m

    def _floor(self, qid: int) -> int:
        v = self._db.get(K_FLOOR + _U64.pack(qid))
        return 0 if v is None else _U64.unpack(v)[0]

    def max_offset(self, name: str) -> int:
        """Next offset to be written in `name` (0 for an unknown queue)."""
        q = self.qid(name)
        if q is None:
            return 0
        m = self._max_get(q)
        return m if m is not None else self._load_max(q)

    def min_offset(self, name: str) -> int:
        """Smallest offset still readable: entries below point into deleted CommitLog segments."""
        q = self.qid(name)
        if q is None:
            return 0
        mn = self._min
        if q < len(mn) and mn[q] != _UNKNOWN:
            return mn[q]
        with self._lock:
            m = self._floor(q)
            if self.min_phys:
                for e in self._iter_entries(q, m):
                    if e.phys_offset >= self.min_phys:
                        m = e.queue_offset
                        break
                else:
                    m = self.max_offset(name)
            self._min_set(q, m)
            return m

    # ---------------------------------------------------------------- reads
    def _iter_entries(self, qid: int, offset: int) -> Iterable[IndexEntry]:
        """Entries of queue `qid` from `offset` on, in order (runs are contiguous)."""
        pre = _U64.pack(qid)
        it = self._db.iter()
        it.seek_for_prev(_KEY.pack(qid, offset))
        if not (it.valid() and it.key()[:8] == pre and len(it.key()) == 16):
            it.seek(_KEY.pack(qid, offset))
        while it.valid():
            k = it.key()
            if len(k) != 16 or k[:8] != pre:
                return
            first = _KEY.unpack(k)[1]
            v = it.value()
            n = len(v) // ENTRY_SIZE
            i = offset - first if offset > first else 0
            while i < n:
                phys, size, ts = ENTRY.unpack_from(v, i * ENTRY_SIZE)
                yield IndexEntry(first + i, phys, size, ts)
                i += 1
            it.next()

    def read_raw(self, name: str, offset: int, max_count: int) -> list[tuple[int, int, int]]:
        """Up to `max_count` (queue_offset, phys_offset, size) of `name` from `offset` on.

        From the in-memory tail when it covers `offset` (a reader that keeps up), else from
        RocksDB. Entries may point at/after the store's dispatched offset (the caller stops
        there) or below the log start (the caller skips them), exactly as `read`."""
        q = self._qids.get(name)
        if q is None:
            q = self.qid(name)
            if q is None:
                return []
        if max_count <= 0:
            return []
        t = self._tail.get(q)
        if t is not None:
            first, v = t
            if first <= offset < first + len(v) // ENTRY_SIZE:
                i = offset - first
                out = []
                append = out.append
                k = offset
                for phys, size, _ts in _ITER(v[i * ENTRY_SIZE:(i + max_count) * ENTRY_SIZE]):
                    append((k, phys, size))
                    k += 1
                return out
        out = []
        append = out.append
        pre = _U64.pack(q)
        it = self._db.iter()
        it.seek_for_prev(_KEY.pack(q, offset))
        if not (it.valid() and it.key()[:8] == pre and len(it.key()) == 16):
            it.seek(_KEY.pack(q, offset))
        while it.valid():
            k = it.key()
            if len(k) != 16 or k[:8] != pre:
                break
            first = _KEY.unpack(k)[1]
            v = it.value()
            i = offset - first if offset > first else 0
            o = first + i
            for phys, size, _ts in _ITER(v[i * ENTRY_SIZE:(i + max_count - len(out)) * ENTRY_SIZE]):
                append((o, phys, size))
                o += 1
            if len(out) >= max_count:
                break
            it.next()
        return out

    def read(self, name: str, offset: int, max_count: int) -> list[IndexEntry]:
        """Up to `max_count` entries of `name` starting at `offset` (unknown queue -> [])."""
        q = self.qid(name)
        if q is None or max_count <= 0:
            return []
        out = []
        for e in self._iter_entries(q, offset):
            out.append(e)
            if len(out) >= max_count:
                break
        return out

    def queue_count(self) -> int:
        return self._next_qid - 1

    # ---------------------------------------------------------------- Dispatcher protocol
    def checkpoint(self) -> int:
        return self._durable_ckpt

    # rocksdict holds the GIL during Rdict.write (~0.4 µs per put: a 40,000-put batch stalls every
    # Python thread, gateway event loop included, for ~15 ms). A dispatch batch touching more
    # queues than this is therefore cut into several writes at record boundaries, each carrying
    # its own checkpoint (end of its last record), so every write stays atomic and consistent.
    max_queues_per_write = 2048
    tail_entries = 256       # newest entries kept in memory per queue (5 KiB)
    tail_queues = 8192       # queues with an in-memory tail (<= 42 MiB, usually far less)

    def dispatch(self, batch, end_offset: int) -> None:
        """Index one batch of DispatchRequests (one RocksDB write per <= 2048 queues touched)."""
        ckpt = self._ckpt
        # defaultdict: the missing-key path runs in C; measured 15-25 % faster than get/append
        # (and faster than grouping by dispatch tuple + sorting, which loses on wildcard queues).
        groups: defaultdict[str, list[bytes]] = defaultdict(list)
        pack = ENTRY.pack
        limit = self.max_queues_per_write
        for r in batch:
            qs = r.dispatch_queues
            if not qs or r.phys_offset < ckpt:
                continue   # no light queue, or already indexed (idempotent replay)
            e = pack(r.phys_offset, r.size, r.store_ts)   # one entry, shared by all its queues
            for q in qs:
                groups[q].append(e)
            if len(groups) >= limit:
                self._write_groups(groups, r.phys_offset + r.size)
                groups = defaultdict(list)
        if groups or end_offset > self._ckpt:
            self._write_groups(groups, end_offset)

    def _write_groups(self, groups: dict[str, list[bytes]], end_offset: int) -> None:
        """One atomic RocksDB write: the runs of `groups` + the checkpoint `end_offset`."""
        ckpt = self._ckpt
        wb = WriteBatch(raw_mode=True)
        new_ids: dict[str, int] = {}
        new_max: list[tuple[int, int]] = []
        next_qid = self._next_qid
        qids = self._qids
        runs: list[tuple[int, int, bytes]] = []
        for name, entries in groups.items():
            q = qids.get(name)
            if q is None:
                q = self.qid(name)
                if q is None:
                    q = next_qid
                    next_qid += 1
                    wb.put(K_NAME + name.encode("utf-8"), _U64.pack(q))
                    new_ids[name] = q
            start = self._max_get(q)
            if start is None:
                start = 0 if name in new_ids else self._load_max(q)
            v = b"".join(entries)
            wb.put(_KEY.pack(q, start), v)
            new_max.append((q, start + len(entries)))
            runs.append((q, start, v))
        if next_qid != self._next_qid:
            wb.put(K_NEXT, _U64.pack(next_qid))
        if end_offset > ckpt:
            wb.put(K_CKPT, _U64.pack(end_offset))
        self._db.write(wb, self._wo)     # raises on I/O error: nothing below is applied
        # Only now publish the new state in memory.
        qids.update(new_ids)
        self._next_qid = next_qid
        maxes = self._max
        if len(maxes) < next_qid:
            maxes.extend(array("Q", [_UNKNOWN]) * (next_qid - len(maxes)))
        for q, m in new_max:
            maxes[q] = m
        tail = self._tail
        keep = self.tail_entries * ENTRY_SIZE
        for q, start, v in runs:
            t = tail.pop(q, None)     # pop + set: the dict's order is the order of last writes
            if t is not None and t[0] + len(t[1]) // ENTRY_SIZE == start:
                v = t[1] + v
                start = t[0]
            if len(v) > keep:
                cut = len(v) - keep
                v = v[cut:]
                start += cut // ENTRY_SIZE
            tail[q] = (start, v)
        if len(tail) > self.tail_queues:
            for q in list(islice(tail, len(tail) - self.tail_queues)):
                tail.pop(q, None)
        if end_offset > ckpt:
            self._ckpt = end_offset
        self._pending.update(groups.keys())

    def take_touched(self) -> set[str]:
        """Queues that received entries since the last call (for listeners)."""
        p = self._pending
        self._pending = set()
        return p

    def flush(self) -> None:
        """Persist memtables (the WAL is off); afterwards checkpoint() covers every batch."""
        if self._closed:
            return   # close() already flushed
        self._flush_db()

    def _flush_db(self) -> None:
        ckpt = self._ckpt
        self._db.flush(True)
        self._durable_ckpt = ckpt

    def truncate(self, offset: int) -> None:
        """Forget every entry pointing at/after CommitLog `offset` (the store cut its tail)."""
        with self._lock:
            if offset >= self._ckpt:
                return
            wb = WriteBatch(raw_mode=True)
            it = self._db.iter()
            it.seek_to_first()
            while it.valid():
                k = it.key()
                if k[:1] == b"\xff":
                    break
                v = it.value()
                n = len(v) // ENTRY_SIZE
                keep = n
                while keep > 0 and ENTRY.unpack_from(v, (keep - 1) * ENTRY_SIZE)[0] >= offset:
                    keep -= 1
                if keep != n:
                    qid, first = _KEY.unpack(k)
                    if keep:
                        wb.put(k, v[:keep * ENTRY_SIZE])
                    else:
                        wb.delete(k)
                it.next()
            wb.put(K_CKPT, _U64.pack(offset))
            self._db.write(wb, self._wo)
            self._db.flush(True)
            self._ckpt = self._durable_ckpt = offset
            self._tail = {}
            self._max = array("Q", [_UNKNOWN]) * self._next_qid   # reload from surviving runs
            self._min = array("Q", [_UNKNOWN]) * self._next_qid

    def on_segments_deleted(self, min_phys_offset: int) -> None:
        """Retention moved the CommitLog start: min offsets move; dead runs are swept later."""
        if min_phys_offset <= self.min_phys:
            return
        with self._lock:
            self.min_phys = min_phys_offset
            wb = WriteBatch(raw_mode=True)
            wb.put(K_MINPHYS, _U64.pack(min_phys_offset))
            self._db.write(wb, WriteOptions())   # with WAL: survives without a flush
            self._min = array("Q", [_UNKNOWN]) * self._next_qid
        if self._sweeper is None or not self._sweeper.is_alive():
            self._sweeper = threading.Thread(target=self._sweep_until_current, name="lightqueue-sweep",
                                             daemon=True)
            self._sweeper.start()

    def _sweep_until_current(self) -> None:
        done = -1
        while done < self.min_phys and not self._closed:   # retention may move again meanwhile
            done = self.min_phys
            try:
                self.sweep()
            except Exception:
                log.exception("light-queue sweep below %d failed; retried at the next retention", done)
                return

    def sweep(self, batch_runs: int = 10000) -> int:
        """Delete runs whose every entry is below `min_phys`; returns the number deleted.

        A queue keeps its offsets: if its last run is deleted, its max offset is written as the
        queue's floor in the same batch, so numbering never restarts.
        """
        deleted = 0
        min_phys = self.min_phys
        it = self._db.iter()
        it.seek_to_first()
        todo: list[tuple[bytes, int, int]] = []
        while it.valid() and not self._closed:
            k = it.key()
            if k[:1] == b"\xff":
                break
            v = it.value()
            if ENTRY.unpack_from(v, len(v) - ENTRY_SIZE)[0] < min_phys:
                qid, first = _KEY.unpack(k)
                todo.append((k, qid, first + len(v) // ENTRY_SIZE))
                if len(todo) >= batch_runs:
                    deleted += self._delete_runs(todo)
                    todo = []
            it.next()
        if todo:
            deleted += self._delete_runs(todo)
        return deleted

    def _delete_runs(self, runs: list[tuple[bytes, int, int]]) -> int:
        with self._lock:
            wb = WriteBatch(raw_mode=True)
            floors: dict[int, int] = {}
            for k, qid, end in runs:
                wb.delete(k)
                floors[qid] = max(floors.get(qid, 0), end)
            for qid, end in floors.items():
                wb.put(K_FLOOR + _U64.pack(qid), _U64.pack(max(end, self._floor(qid))))
            self._db.write(wb, WriteOptions())   # WAL on: a lost floor would reset offsets
            for qid in floors:
                self._min_set(qid, _UNKNOWN)
                self._tail.pop(qid, None)
        return len(runs)

    def drop_queue(self, name: str) -> bool:
        """Delete every entry of `name` (an unused wildcard queue); its offsets do not restart."""
        with self._lock:
            q = self.qid(name)
            if q is None:
                return False
            end = self.max_offset(name)
            wb = WriteBatch(raw_mode=True)
            # Persist the dispatch state first: a crash must not replay pre-drop records into
            # the dropped queue on top of its floor.
            self._db.flush(True)
            self._durable_ckpt = self._ckpt
            wb.delete_range(_KEY.pack(q, 0), _KEY.pack(q, 0xFFFFFFFFFFFFFFFF))
            wb.put(K_FLOOR + _U64.pack(q), _U64.pack(end))
            self._db.write(wb, WriteOptions())
            self._tail.pop(q, None)
            self._min_set(q, end)
            return True

    def disk_size(self) -> int:
        """Live SST + memtable bytes as RocksDB reports them."""
        try:
            return int(self._db.property_int_value("rocksdb.total-sst-files-size") or 0)
        except Exception:
            return 0

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.join(timeout=30)
        try:
            self._flush_db()   # a clean close leaves nothing to re-dispatch
        except Exception:
            log.exception("light-queue index: final flush failed; the store will re-dispatch")
        self._db.close()
