"""LightQueueIndex: the RocksDB index of every light queue, fed by the store's dispatcher.

Why this shape (docs/lightqueue.md; as RocketMQ's light message queues, built for a million queues):

* One record is written once to the CommitLog; each light queue only stores a 20-byte entry
  (CommitLog offset u64, size u32, store time u64) pointing at it.
* Dispatched entries go to in-memory per-queue tails first (readable at once) and are written
  to RocksDB once per `write_records` records: a put per queue per write is the main per-queue
  cost, and the store hands over small batches (docs/lightqueue.md "Dispatch cost").
* The WAL is disabled: the CommitLog is the log. The dispatch checkpoint (CommitLog offset taken
  into the tails) is written in the *same* WriteBatch as the entries it covers, and RocksDB
  applies a batch atomically to one memtable. A crash loses whole trailing writes (and whatever
  was only in the tails), never half of one, so after reopen index and checkpoint agree and the
  store's re-dispatch from that checkpoint rebuilds exactly what was lost (no gaps, no
  duplicates).
* All entries of one queue in one write are packed into ONE value ("run") under the key
  `queue-id (8 bytes BE) + first queue offset (8 bytes BE)`. Runs of a queue are contiguous; a
  read at offset k finds the run with the greatest first offset <= k (`seek_for_prev`), and
  continues in the tail.
* Queue names map to 8-byte queue ids (allocated on first entry, persisted with its first run).
  A queue's max offset is not stored separately: it is `first + count` of its last run, i.e.
  persisted atomically with the entries; in memory it is the tail's end (or `_max`).

Key layout (queue ids are < 2**63, so run keys never start with 0xFF):

    qid(8) + first_offset(8)  -> n × entry(20)      a run of n consecutive entries
    FF 'C'                    -> u64 checkpoint    CommitLog offset fully dispatched
    FF 'N' + name             -> u64 qid   (no reverse map: one put less per new queue)
    FF 'X'                    -> u64 next qid
    FF 'P'                    -> u64 min CommitLog offset        } retention.py: the log start
    FF 'M' + qid              -> u64 floor                       } and the queues' floors
"""
from __future__ import annotations

import logging
import threading
import time
from array import array
from itertools import islice
from typing import Iterable

from rocksdict import Rdict, ReadOptions, WriteBatch, WriteOptions

from lmqtt.store.errors import is_disk_full
from lmqtt.store.rocksdb_options import rocksdb_options, table_options

from .errors import LightQueueError
from .index_reads import RUN_KEY, U64, IndexReads, decode_run, stored_run, stored_run_length  # reads: the runs below, the tail above
from .retention import IndexRetention

# The take loop (dispatched records into the tails) lives in take.py with the entry format;
# ENTRY and ENTRY_SIZE stay importable from here.
from .take import (
    ENTRY,
    ENTRY_SIZE,
    NO_TAILS,
    RES_FILTER_TAILS,
    RES_FIRST_NAME,
    RES_LEN,
    RES_MARK,
    RES_OTHER_NAMES,
    RES_TAIL,
    take_batch,
)

log = logging.getLogger(__name__)

K_CKPT = b"\xffC"
K_NAME = b"\xffN"
K_NEXT = b"\xffX"
# A write stores a busy queue's new entries as runs of at most this many entries' bytes (80 KiB
# raw). Why: one run per queue per write made a value of write_records x 20 bytes (1.3 MB under
# `lmqtt bench lightqueue` fan-out 16), and RocksDB's memtable, flush and compaction each allocate
# a buffer of a value's size; past the store's fixed 1 MiB mmap threshold (store/heap.py) each was
# a fresh mapping, page-faulted and unmapped, ~100 a second. And a read inside an encoded run
# (below) walks the run from its start: 4,096 entries keep that short. Runs are contiguous
# whatever their length, so readers see no difference.
MAX_RUN_BYTES = 4096 * ENTRY_SIZE

_UNKNOWN = 0xFFFFFFFFFFFFFFFF      # "max offset not loaded yet" in the max-offset array


def _scan_options() -> ReadOptions:
    """Read options of a scan over the whole index (retention's sweep, a truncation): its blocks
    are read once, so they stay out of the block cache. A sweep that filled the cache grew a
    broker's memory by the cache's size at the first segment deletion, long after start-up."""
    ro = ReadOptions()
    ro.fill_cache(False)
    return ro


class LightQueueIndex(IndexReads):
    """The Dispatcher (store protocol) that writes light-queue entries, plus index reads."""

    name = "lightqueue"

    def __init__(self, path: str, *, write_buffer_mb: int = 64, preload_names: int = 2_000_000,
                 max_open_files: int = -1) -> None:
        """Open the index. Up to `preload_names` queue names are loaded into memory at open, so
        that a name missing from memory is known to be new without a RocksDB lookup (profiling
        the million-new-queues load showed that miss as the second cost after the write)."""
        opts = rocksdb_options(max_open_files)       # the store's budget share (store/file_budget.py)
        opts.set_write_buffer_size(write_buffer_mb << 20)
        opts.set_max_background_jobs(2)
        # Name lookups of brand-new queues are misses: bloom filters (SST and memtable) answer
        # most of them without a skiplist/SST search.
        bbo = table_options()                        # the process's shared block cache
        bbo.set_bloom_filter(10, False)
        opts.set_block_based_table_factory(bbo)
        opts.set_memtable_prefix_bloom_ratio(0.05)
        opts.set_memtable_whole_key_filtering(True)
        try:
            self._db = Rdict(str(path), opts)
        except Exception as e:   # e.g. the directory is locked by another process
            raise LightQueueError(f"cannot open light-queue index at {path}: {e}") from e
        self._path, self._opts = str(path), opts
        # the puts written since the last memtable flush: what a failed flush would lose if the
        # database had to be opened again (`_recover`); `_broken`: the failure that closed it
        self._journal: list[tuple[bytes, bytes]] = []
        self._broken: BaseException | None = None
        self._wo = WriteOptions()
        self._wo.disable_wal = True
        v = self._db.get(K_CKPT)
        self._ckpt = 0 if v is None else U64.unpack(v)[0]   # dispatched into memory
        self._written_ckpt = self._ckpt                         # ... and written to RocksDB
        self._durable_ckpt = self._ckpt                         # ... and flushed to SST files
        v = self._db.get(K_NEXT)
        self._next_qid = 1 if v is None else U64.unpack(v)[0]
        # The log start, the queues' floors and the sweep below it (a job of its own).
        self.retention = IndexRetention(self)
        self._qids: dict[str, int] = {}     # name -> qid (cache of FF 'N', + names not written yet)
        # True when _qids holds every name, so a miss means "new queue" without a DB lookup.
        self._all_names = self._next_qid - 1 <= preload_names
        if self._all_names and self._next_qid > 1:
            n = len(K_NAME)
            for k, v in self._db.items(from_key=K_NAME):
                if not k.startswith(K_NAME):
                    break
                self._qids[k[n:].decode("utf-8")] = U64.unpack(v)[0]
        # qid -> next offset to write, for queues WITHOUT an in-memory tail (a queue's tail is
        # the authority while it has one; its end is stored here when the tail is evicted).
        # Lazily loaded; queue ids are dense, so a flat u64 array (8 bytes per queue).
        self._max = array("Q", [_UNKNOWN]) * self._next_qid
        # Guards every change of the in-memory state and of RocksDB against each other
        # (dispatch thread, flush from any thread, drop/sweep/truncate) and lazy loads.
        self._lock = threading.RLock()
        # Since the last take_touched(): first queue of each dispatch tuple (once per batch),
        # and the filter names of each filter set (once per change of filter set).
        self.touched: list[str] = []
        self.touched_f: list[tuple[str, ...]] = []
        self._touched_cap = 65536
        # The in-memory tail: qid -> (first queue offset, bytearray of packed entries from it on).
        # It holds every entry not yet written to RocksDB plus (after a write) the newest
        # `tail_entries` written ones, so that a dispatched entry is readable at once, and a
        # reader that keeps up is served without a RocksDB iterator. The bytearray only ever
        # grows (appends are atomic under the GIL); trimming replaces the tuple, so a reader's
        # snapshot is always consistent. Writes to RocksDB are batched across dispatch calls:
        # see `dispatch`.
        self._tail: dict[int, tuple[int, bytearray]] = {}
        self._dirty: dict[int, int] = {}    # qid -> byte position of its first unwritten entry
        self._taken = 0                     # records taken since the last write
        # dispatch tuple -> its resolved list (the RES_* slots in take.py), built by resolve
        self.resolved: dict[tuple[str, ...], list] = {}
        self._filter_tails: dict[tuple[str, ...], tuple[bytearray, ...]] = {}  # interned
        self._new_names: dict[str, int] = {}   # queues allocated since the last write
        self._closed = False

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
            q = self._qids[name] = U64.unpack(v)[0]
        return q

    def _load_max(self, qid: int) -> int:
        with self._lock:
            t = self._tail.get(qid)
            if t is not None:
                return t[0] + len(t[1]) // ENTRY_SIZE
            m = self._max_get(qid)
            if m is not None:
                return m
            m = self.retention.floor(qid)
            it = self._db.iter()
            it.seek_for_prev(RUN_KEY.pack(qid, 0xFFFFFFFFFFFFFFFF))
            if it.valid():
                k = it.key()
                if len(k) == 16 and k[:8] == U64.pack(qid):
                    m = max(m, RUN_KEY.unpack(k)[1] + stored_run_length(it.value()))
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

    @property
    def min_phys(self) -> int:
        """CommitLog offset below which entries point into deleted segments (see retention)."""
        return self.retention.min_phys

    def max_offset(self, name: str) -> int:
        """Next offset to be written in `name` (0 for an unknown queue)."""
        q = self._qids.get(name)
        if q is None:
            q = self.qid(name)
            if q is None:
                return 0
        t = self._tail.get(q)
        if t is not None:
            return t[0] + len(t[1]) // ENTRY_SIZE
        m = self._max_get(q)
        return m if m is not None else self._load_max(q)

    def min_offset(self, name: str) -> int:
        """Smallest offset still readable: entries below point into deleted CommitLog segments."""
        return self.retention.min_offset(name)

    def end_at(self, name: str, phys: int) -> int:
        """The end (next offset) `name` had when the CommitLog ended at `phys`: one past its last
        entry pointing below phys (entries are in CommitLog order; those at/after phys were
        appended since). Its max offset when nothing was; O(log n) one-entry reads otherwise.
        After a recovery that cut the log (store/recovery.py), consumer offsets beyond it are reset."""
        hi = self.max_offset(name)
        lo = self.min_offset(name)
        if lo >= hi:
            return hi
        last = self.read_raw(name, hi - 1, 1)
        if last and last[0][1] < phys:
            return hi
        while lo < hi:      # read_raw(mid) gives the first entry at/after mid (holes are skipped)
            mid = (lo + hi) // 2
            e = self.read_raw(name, mid, 1)
            if e and e[0][1] < phys:
                lo = e[0][0] + 1
            else:
                hi = mid
        return lo

    def queue_count(self) -> int:
        return self._next_qid - 1

    # ---------------------------------------------------------------- Dispatcher protocol
    def checkpoint(self) -> int:
        return self._durable_ckpt

    # rocksdict holds the GIL during Rdict.write (~0.4 µs per put: a 40,000-put batch stalls every
    # Python thread, gateway event loop included, for ~15 ms). A write therefore carries at most
    # this many queues' runs: when a record would make more queues unwritten, the entries before
    # it are written first (a cut at a record boundary, with that record's offset as checkpoint).
    max_queues_per_write = 2048
    # A flush (the store's dispatch thread, about once a second) writes the unwritten queues in
    # writes of at most this many, taking _lock for each: dispatch (inline, on the gateway's event
    # loop) waits for one slice, not for the whole write. Measured: 2,000 device queues written
    # at once held the lock 5-10 ms every second, the loop's inline dispatch waiting on it; with
    # 5,000 msg/s from those devices 1 % of the deliveries took > 4 ms.
    flush_slice = 256
    flush_pause = 0.0005     # seconds between two slices (the GIL's switch interval in `serve`)
    # flush() takes _lock only for the in-memory part; its RocksDB flush (milliseconds) may run
    # while dispatch() goes on: the dispatch thread then keeps inline dispatch open (store.dispatch)
    flush_during_dispatch = True
    # Records taken into the tails before they are written to RocksDB. One put per queue per
    # write is the index's main per-queue cost: a small dispatch batch (the store hands over a few
    # appends at a time) touches ~1 queue per record, so writing per dispatch batch paid ~1 put
    # per record. Buffering makes a run hold many entries.
    write_records = 32768
    tail_entries = 256       # written entries kept in memory per queue ...
    # ... trimmed back to tail_entries once a written tail holds an eighth more. Trimmed only at
    # twice tail_entries, a soak's 2,000 device queues (a message a second each) grew from 256 to
    # 512 entries together and were trimmed together: a saw of ~10 MiB every ~4 minutes in the
    # broker's memory, ~5 MiB more held on average, and a warm-up of ~9 minutes before the first
    # trim. At +32 a quiet queue pays a copy of its 5 KiB tail every 32 entries; a busy one is
    # trimmed at every write either way.
    tail_queues = 8192       # queues with an in-memory tail; more triggers a write + eviction

    def dispatch(self, batch, end_offset: int) -> None:
        """Append the batch's entries to the in-memory tails (readable at once); write RocksDB
        when enough is buffered (`write_records`, `max_queues_per_write`, `tail_queues`).

        Per record the work is one pack and one bytearray append into the tails (take.py,
        `take_batch`: the Python reference loops and the C one). Resolving a dispatch tuple to its
        tails (`resolve`, called back from the loops) happens once per tuple between two writes,
        which is also when a queue's first unwritten position is noted. The lock is held for the
        whole batch, so a flush or drop from another thread never sees half a batch."""
        with self._lock:
            self._taken += take_batch(self, batch, self._ckpt)
            if len(self.touched) + len(self.touched_f) > self._touched_cap:   # nobody takes
                self.touched = list(set(self.touched))                       # them: dedupe
                self.touched_f = list(set(self.touched_f))
                self._touched_cap = max(65536, 2 * (len(self.touched) + len(self.touched_f)))
            if end_offset > self._ckpt:
                self._ckpt = end_offset
            if self._taken >= self.write_records or len(self._tail) > self.tail_queues:
                self._write()

    def resolve(self, qs: tuple[str, ...], phys: int) -> list:
        """`resolved[qs]` (a resolved list, see take.py), noting where each queue's unwritten entries start. The
        record at `phys` is about to be appended (everything before it is in the tails); if it
        would leave too many queues unwritten, that is written first, with `phys` as checkpoint."""
        dirty = self._dirty
        if dirty and len(dirty) + len(qs) > self.max_queues_per_write:
            if phys > self._ckpt:
                self._ckpt = phys
            self._write()
        t0 = self._tail_for(qs[0])
        if len(qs) == 1:
            f = NO_TAILS
        else:
            rest = qs[1:]
            if qs[0] in rest:   # a name twice in one tuple: one entry, and a tuple of its own
                f = tuple(self._tail_for(n) for n in dict.fromkeys(rest) if n != qs[0])
            else:               # shared by every tuple with these filters
                f = self._filter_tails.get(rest)
                if f is None:
                    f = self._filter_tails[rest] = tuple(self._tail_for(n) for n in dict.fromkeys(rest))
        c = [None] * RES_LEN
        c[RES_TAIL] = t0
        c[RES_FILTER_TAILS] = f
        c[RES_FIRST_NAME] = qs[0]
        c[RES_MARK] = None
        c[RES_OTHER_NAMES] = qs[1:]
        self.resolved[qs] = c
        return c

    def _tail_for(self, name: str) -> bytearray:
        """The tail bytearray of `name` (opened if needed), marked unwritten from its end."""
        q = self._qids.get(name)
        t = self._tail.get(q)
        if t is None:
            return self._open_tail(name, q)[1]
        if q not in self._dirty:
            self._dirty[q] = len(t[1])
        return t[1]

    def _open_tail(self, name: str, q: int | None) -> tuple[int, bytearray]:
        """An empty tail for a queue without one (new, or evicted): it starts at its max offset."""
        if q is None:
            q = self.qid(name)
        if q is None:
            q = self._next_qid
            self._next_qid = q + 1
            self._new_names[name] = q
            start = 0
        else:
            start = self._max_get(q)
            if start is None:
                start = self._load_max(q)
        t = self._tail[q] = (start, bytearray())
        self._dirty[q] = 0
        self._qids[name] = q   # after the tail exists: a reader finding the id finds the entries
        return t

    def _write(self) -> None:
        """One atomic RocksDB write: every unwritten run, new queue names and the checkpoint.
        Then trim the written tails and evict tails over `tail_queues`. Caller holds _lock."""
        dirty = self._dirty
        ckpt = self._ckpt
        if not dirty and ckpt <= self._written_ckpt:
            return
        if self._broken is not None:
            self._reopen()
        tail = self._tail
        ops: list[tuple[bytes, bytes]] = []
        put = ops.append
        self._run_ops(dirty.items(), put)
        self._name_ops(put)
        if ckpt > self._written_ckpt:
            put((K_CKPT, U64.pack(ckpt)))
        self._commit(ops)                # raises on I/O error: nothing below is applied
        self._written_ckpt = ckpt
        self._new_names = {}
        self._dirty = {}
        self.resolved = {}      # tails are replaced below, and every queue is clean again
        self._filter_tails = {}
        self._taken = 0
        self._trim(dirty)
        excess = len(tail) - self.tail_queues
        if excess > 0:   # every tail is written now: evict the oldest, their end goes to _max
            for q in list(islice(tail, excess)):
                first, ba = tail[q]
                self._max_set(q, first + len(ba) // ENTRY_SIZE)
                del tail[q]

    def _write_some(self, qids: list[int]) -> None:
        """Under _lock: one RocksDB write of the unwritten runs of the queues `qids` (those still
        unwritten) and of the new queue names, without the checkpoint: only a write of every
        unwritten queue may move it (`_write`). Those queues are clean and trimmed afterwards."""
        if self._broken is not None:
            self._reopen()
        dirty = self._dirty
        items = [(q, dirty[q]) for q in qids if q in dirty]
        ops: list[tuple[bytes, bytes]] = []
        self._run_ops(items, ops.append)
        named = self._name_ops(ops.append)
        if not ops:
            return
        self._commit(ops)
        if named:
            self._new_names = {}
        for q, _ in items:
            del dirty[q]
        self.resolved = {}      # the written queues must note their next unwritten entry again
        self._filter_tails = {}
        self._trim([q for q, _ in items])

    def _run_ops(self, items, put) -> None:
        """The puts of the unwritten runs of (queue id, first unwritten byte position) `items`."""
        tail = self._tail
        kpack = RUN_KEY.pack
        step = MAX_RUN_BYTES
        for q, pos in items:
            first, ba = tail[q]
            n = len(ba)
            if pos < n:
                if n - pos <= step:
                    put((kpack(q, first + pos // ENTRY_SIZE), stored_run(bytes(memoryview(ba)[pos:]))))
                else:
                    mv = memoryview(ba)
                    for p in range(pos, n, step):
                        put((kpack(q, first + p // ENTRY_SIZE), stored_run(bytes(mv[p:p + step]))))

    def _name_ops(self, put) -> bool:
        """The puts of the queues named since the last write (and the next id); True if any."""
        if not self._new_names:
            return False
        for name, q in self._new_names.items():
            put((K_NAME + name.encode("utf-8"), U64.pack(q)))
        put((K_NEXT, U64.pack(self._next_qid)))
        return True

    def _commit(self, ops: list) -> None:
        """One atomic RocksDB write of `ops`, kept in the journal (replayed after a reopen)."""
        wb = WriteBatch(raw_mode=True)
        for k, v in ops:
            wb.put(k, v)
        try:
            self._db.write(wb, self._wo)
        except Exception as e:
            self._recover(e)
            raise
        self._journal += ops

    def _trim(self, qids) -> None:
        """Trim the written tails of `qids` to the newest tail_entries, once over by an eighth."""
        tail = self._tail
        keep = self.tail_entries * ENTRY_SIZE
        over = keep + max(1, self.tail_entries // 8) * ENTRY_SIZE
        for q in qids:
            first, ba = tail[q]
            if len(ba) > over:
                cut = len(ba) - keep
                tail[q] = (first + cut // ENTRY_SIZE, ba[cut:])   # a new object: readers keep theirs

    def take_touched(self) -> set[str]:
        """Queues that received entries since the last call (for listeners)."""
        p = self.touched
        if not p:
            return set()
        self.touched = []
        out = set(p)
        pf = self.touched_f
        if pf:
            self.touched_f = []
            out.update(*pf)
        return out

    def flush(self) -> None:
        """Write what the tails buffer and persist memtables (the WAL is off); afterwards
        checkpoint() covers every dispatched batch."""
        if self._closed:
            return   # close() already flushed
        self._flush_db()

    def _flush_db(self) -> None:
        with self._lock:
            if self._broken is not None:
                self._reopen()
            slices = 2 * (len(self._dirty) // self.flush_slice) + 4
        # the unwritten queues a slice at a time, the lock let go in between (dispatch goes on);
        # the last slice, with what became unwritten meanwhile, moves the checkpoint (`_write`).
        # Bounded: queues a busy dispatch keeps making unwritten go with the last slice.
        for _ in range(slices):
            with self._lock:
                if len(self._dirty) <= self.flush_slice:
                    break
                self._write_some(list(islice(self._dirty, self.flush_slice)))
            # a lock is not handed over on release: this thread, still holding the GIL, would
            # take it again before a dispatch woken by the release ran. Let that dispatch in.
            time.sleep(self.flush_pause)
        with self._lock:
            self._write()
            ckpt = self._written_ckpt
            journal, self._journal = self._journal, []
        # Outside the lock (dispatch goes on): a write landing before the memtable switch is
        # flushed too, with a checkpoint above `ckpt`; claiming only `ckpt` is conservative.
        try:
            self._db.flush(True)
        except Exception as e:
            with self._lock:
                self._journal = journal + self._journal
                self._recover(e)
            raise
        if ckpt > self._durable_ckpt:
            self._durable_ckpt = ckpt

    @property
    def db(self) -> Rdict:
        """The RocksDB database (replaced when it is opened again after a failed write)."""
        return self._db

    def _recover(self, e: BaseException) -> None:
        """A write or a memtable flush failed. RocksDB refuses every write after that until it is
        opened again, except for a full disk, which it recovers from by itself once there is room:
        so for anything else (no descriptor left for a table file: EMFILE) the database is closed
        and the next write opens it again and writes the journal first. Caller holds _lock."""
        if is_disk_full(e) or self._broken is not None:
            return
        self._broken = e
        log.warning("light-queue index: a write failed (%s); the database is opened again by the next write", e)
        try:
            self._db.close()
        except Exception:  # noqa: BLE001 - a database in error: nothing more to do
            pass

    def _reopen(self) -> None:
        """Open the database again and write what the failed flush may have lost (the journal).
        Raises (and stays broken) while it cannot. Caller holds _lock."""
        db = Rdict(self._path, self._opts)
        if self._journal:
            wb = WriteBatch(raw_mode=True)
            for k, v in self._journal:
                wb.put(k, v)
            db.write(wb, self._wo)
        self._db = db
        log.warning("light-queue index: opened again after %s (%d writes of the journal replayed)",
                    self._broken, len(self._journal))
        self._broken = None

    def truncate(self, offset: int) -> None:
        """Forget every entry pointing at/after CommitLog `offset` (the store cut its tail)."""
        with self._lock:
            if offset >= self._ckpt:
                return
            self._write()     # everything into RocksDB first: then one scan trims it all
            wb = WriteBatch(raw_mode=True)
            it = self._db.iter(_scan_options())
            it.seek_to_first()
            while it.valid():
                k = it.key()
                if k[:1] == b"\xff":
                    break
                v = decode_run(it.value())
                n = len(v) // ENTRY_SIZE
                keep = n
                while keep > 0 and ENTRY.unpack_from(v, (keep - 1) * ENTRY_SIZE)[0] >= offset:
                    keep -= 1
                if keep != n:
                    qid, first = RUN_KEY.unpack(k)
                    if keep:
                        wb.put(k, stored_run(v[:keep * ENTRY_SIZE]))
                    else:
                        wb.delete(k)
                it.next()
            wb.put(K_CKPT, U64.pack(offset))
            self._db.write(wb, self._wo)
            self._db.flush(True)
            self._ckpt = self._written_ckpt = self._durable_ckpt = offset
            self._tail = {}
            self._dirty = {}
            self.resolved = {}
            self._filter_tails = {}
            self._taken = 0
            self._max = array("Q", [_UNKNOWN]) * self._next_qid   # reload from surviving runs
            self.retention.forget_min_offsets()

    # ---------------------------------------------------------------- retention (retention.py)
    def on_segments_deleted(self, min_phys_offset: int) -> None:
        """Dispatcher protocol: the store deleted the CommitLog below `min_phys_offset`."""
        self.retention.on_segments_deleted(min_phys_offset)

    # What retention changes in the index: it decides when and what; these keep the run layout
    # and the tails the index's business.
    def runs_below(self, min_phys: int, start: bytes = b"") -> Iterable[tuple[bytes, int, int]]:
        """(key, qid, end offset) of each RocksDB run at or after key `start` whose every entry
        points below CommitLog offset `min_phys`, in key order; stops when the index closes."""
        it = self._db.iter(_scan_options())
        if start:
            it.seek(start)
        else:
            it.seek_to_first()
        while it.valid() and not self._closed:
            k = it.key()
            if k[:1] == b"\xff":
                break
            v = it.value()
            n = stored_run_length(v)
            if ENTRY.unpack_from(decode_run(v, n - 1, n))[0] < min_phys:
                qid, first = RUN_KEY.unpack(k)
                yield k, qid, first + n
            it.next()

    def forget_runs(self, floors: dict[int, int]) -> None:
        """Runs were deleted: queue `qid` has no entry below `floors[qid]` any more, and its tail
        forgets them too. Caller holds _lock."""
        tail = self._tail
        dirty = self._dirty
        for qid, end in floors.items():
            t = tail.get(qid)
            if t is not None and t[0] < end:   # the tail forgets the deleted runs too;
                first, ba = t                  # unwritten entries all lie above them
                cut = min(end - first, len(ba) // ENTRY_SIZE) * ENTRY_SIZE
                tail[qid] = (first + cut // ENTRY_SIZE, ba[cut:])
                if qid in dirty:
                    dirty[qid] -= cut
                self.resolved = {}   # it held the replaced bytearray
                self._filter_tails = {}

    def drop_queue(self, name: str) -> bool:
        """Delete every entry of `name` (an unused wildcard queue); its offsets do not restart."""
        # Persist the dispatch state first: a crash must not replay pre-drop records into the
        # dropped queue on top of its floor. The memtable flush runs outside the lock, so
        # dispatch goes on meanwhile (it may still append records published before the filter
        # was unregistered; they are dropped too).
        with self._lock:
            q = self.qid(name)
            if q is None:
                return False
            self._write()
            ckpt = self._written_ckpt
        self._db.flush(True)
        with self._lock:
            if ckpt > self._durable_ckpt:
                self._durable_ckpt = ckpt
            end = self.max_offset(name)
            wb = WriteBatch(raw_mode=True)
            wb.delete_range(RUN_KEY.pack(q, 0), RUN_KEY.pack(q, 0xFFFFFFFFFFFFFFFF))
            self.retention.put_floor(wb, q, end)
            self._db.write(wb, WriteOptions())
            self._max_set(q, end)      # before the tail goes: readers fall back to _max
            self._tail.pop(q, None)
            self._dirty.pop(q, None)   # unwritten entries appended meanwhile go with it
            self.resolved = {}
            self._filter_tails = {}
            self.retention.set_min_offset(q, end)
            return True

    def disk_size(self) -> int:
        """Live SST + memtable bytes as RocksDB reports them."""
        try:
            return int(self._db.property_int_value("rocksdb.total-sst-files-size") or 0)
        except Exception:
            return 0

    # What retention.py uses of the index (it works under the index's lock, on its RocksDB).
    @property
    def lock(self) -> threading.RLock:
        return self._lock

    @property
    def next_qid(self) -> int:
        """The id the next new queue gets (ids are dense from 1)."""
        return self._next_qid

    @property
    def closed(self) -> bool:
        return self._closed

    def write_tails(self) -> None:
        """Write what the tails buffer into RocksDB now."""
        with self._lock:
            self._write()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.retention.join(timeout=30)
        try:
            self._flush_db()   # a clean close leaves nothing to re-dispatch
        except Exception as e:
            if not is_disk_full(e):
                log.exception("light-queue index: final flush failed; the store will re-dispatch")
            else:              # one line: the store logged the disk-full episode already
                log.error("light-queue index: final flush failed (disk full: %s); the store re-dispatches "
                          "from the last flushed checkpoint on the next start", str(e)[:200])
        try:
            self._db.close()
        except Exception as e:
            # RocksDB's close flushes too, and refuses after a failed write ("No space left", or
            # "Writer has previous error"): nothing it held is lost, the next start re-dispatches
            if not (is_disk_full(e) or "previous error" in str(e)):
                raise
            log.error("light-queue index: close failed (%s); the store re-dispatches from the last flushed "
                      "checkpoint on the next start", str(e)[:200])
