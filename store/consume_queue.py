"""ConsumeQueue: per (first-level topic, queue id) index of fixed 20-byte entries, kept in RocksDB.

Entry = CommitLog offset u64, record size u32, tag hash u64 (CRC-32 of the full topic), as in
RocketMQ's ConsumeQueue; the entry for queue offset N is the N-th of its queue, O(1) to find.

Why RocksDB and not a file per queue (docs/store.md "ConsumeQueue"): a first-level topic per device
is a common layout, and one preallocated, memory-mapped file per topic cost two file descriptors,
a mapping and 1.25 MB of disk per topic - 100,000 devices exhausted the open-files limit and a
million would pass Linux's map count. RocketMQ 5.3 made the same move (its RocksDB ConsumeQueue).
Here every queue, busy or quiet, is a few keys in one database whose open files RocksDB bounds
(`max_open_files`), and a topic with one message costs tens of bytes.

Layout (raw keys; `qk` = u16 length + first-level topic UTF-8 + u32 queue id, big-endian):
- `E` qk first_qoff(u64 BE) -> a block of consecutive entries from `first_qoff`, as the dispatch
  flushed them (a small last block is extended in place until it holds `MERGE_BELOW` entries, so a
  quiet topic is not a key per message);
- `P` last_phys(u64 BE) qk -> first_qoff u64, entries u32: every block by the CommitLog offset of
  its last entry, so retention deletes exactly the blocks below the log's start and a cut of the
  log finds exactly the blocks past it, without visiting every queue;
- `Q` qk -> min_offset u64, max_offset u64: what a queue holds (its max offset survives
  retention: queue offsets of a topic never go back);
- `C` -> the checkpoint: the CommitLog offset below which every entry is in the database.

Durability follows the light queues' index: the WAL is off (the CommitLog is the log). Dispatch
only appends to a queue's in-memory tail (readers see it at once); `flush` writes every tail, the
blocks' `P` and `Q` keys and the new checkpoint in one WriteBatch, then flushes the memtable. The
database therefore only ever holds whole flushes (RocksDB persists whole batches): after a crash
its entries and its checkpoint agree, and the replay from the checkpoint skips what a queue has.

Queues are loaded on first use (dispatch or read) and unloaded when idle, so memory and start-up
do not grow with the number of topics; only the CommitLog's queue table (the next offset of every
queue, `max_offsets`) is read whole at start.
"""
from __future__ import annotations

import logging
import os
import shutil
import struct
import threading

from rocksdict import Rdict, ReadOptions, WriteBatch, WriteOptions

from . import consume_queue_entries as _cqe
from . import fastpath  # noqa: F401 - binds the C block codec into consume_queue_entries when it is built
from .consume_queue_entries import ENTRY, ENTRY_FIELDS, ENTRY_SIZE, RunGrouper, block_count  # noqa: F401 - ENTRY_FIELDS: re-exported
from .errors import StoreError, is_disk_full
from .message import DispatchBatch
from .record import first_level
from .rocksdb_options import rocksdb_options

log = logging.getLogger("lmqtt.store")

DB_DIR = "consumequeue-db"      # beside the CommitLog; `consumequeue/` held the file-per-queue layout
BLOCK_ENTRIES = 4096            # entries per stored block at most (80 KiB)
MERGE_BELOW = 32                # a last block smaller than this is extended by the next flush
MAX_LOADED = 50_000             # queues kept in memory while idle (a loaded queue is ~300 B)

_U64 = struct.Struct(">Q")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_META = struct.Struct(">QQ")          # Q: min_offset, max_offset
_PVAL = struct.Struct(">QI")          # P: first qoff, entries
K_CKPT = b"C"
K_VERSION = b"V"
VERSION = b"1"

def queue_key(fl: str, qid: int) -> bytes:
    """`qk`: the part of every key that names a queue (length-prefixed, so no topic is a prefix of
    another's keys)."""
    b = fl.encode("utf-8")
    return _U16.pack(len(b)) + b + _U32.pack(qid)


def _split_queue_key(qk: bytes) -> tuple[str, int]:
    n = _U16.unpack_from(qk)[0]
    return qk[2:2 + n].decode("utf-8"), _U32.unpack_from(qk, 2 + n)[0]


def _stored(entries: bytes) -> bytes:
    """A block of entries as the database keeps it: encoded in runs when the C module is built
    (store/consume_queue_entries.py "stored blocks"), raw otherwise; readers take both."""
    enc = _cqe.encode_block
    return entries if enc is None else enc(entries)


def _last_phys(block: bytes | bytearray) -> int:
    """The CommitLog offset of the block's last written entry (a gap is zero-filled; see put)."""
    for pos in range(len(block) - ENTRY_SIZE, -1, -ENTRY_SIZE):
        phys, size, _ = ENTRY.unpack_from(block, pos)
        if size:
            return phys
    return 0


class ConsumeQueue:
    """One queue: what is in the database (from `min_offset`) and its in-memory tail.

    `tail` is one tuple (first queue offset not in the database, bytearray of the entries from
    there), replaced as a whole by flush and truncate and only ever extended in place by
    dispatch, so a reader's snapshot of it is consistent without a lock."""

    __slots__ = ("cqs", "fl", "qid", "qk", "min_offset", "tail", "last_block", "used")

    def __init__(self, cqs: "ConsumeQueueStore", fl: str, qid: int, qk: bytes, min_offset: int,
                 max_offset: int) -> None:
        self.cqs = cqs
        self.fl = fl
        self.qid = qid
        self.qk = qk
        self.min_offset = min_offset
        self.tail: tuple[int, bytearray] = (max_offset, bytearray())
        # (first qoff, entries) of the newest block in the database; None: not known (looked up
        # when a flush needs it)
        self.last_block: tuple[int, int] | None = None
        self.used = True

    @property
    def max_offset(self) -> int:
        """The next queue offset to write."""
        first, buf = self.tail
        return first + len(buf) // ENTRY_SIZE

    # ------------------------------------------------------------------ reads (any thread)
    def pieces(self, from_off: int, max_count: int) -> list[tuple[int, bytes]]:
        """The raw entries from `from_off`, at most max_count: [(first queue offset, entry bytes)],
        one piece per stored block touched plus the in-memory tail. Unwritten entries (size 0: a
        gap) are included; `range` is the decoded view of the same bytes."""
        self.used = True
        first, buf = self.tail
        tail_end = first + len(buf) // ENTRY_SIZE
        q = max(from_off, self.min_offset)
        end = min(tail_end, q + max_count)
        out: list[tuple[int, bytes]] = []
        if q >= end:
            return out
        if q < first:
            out = self.cqs._stored_pieces(self.qk, q, min(end, first))
        if end > first:
            a = max(q, first)
            out.append((a, bytes(buf[(a - first) * ENTRY_SIZE:(end - first) * ENTRY_SIZE])))
        return out

    def range(self, from_off: int, max_count: int) -> list[tuple[int, int, int, int]]:
        """[(queue_offset, phys, size, tags)] from `from_off`, at most max_count, only written ones."""
        out = []
        for q, piece in self.pieces(from_off, max_count):
            for i, (phys, size, tags) in enumerate(ENTRY.iter_unpack(piece)):
                if size:
                    out.append((q + i, phys, size, tags))
        return out

    def entry(self, qoff: int) -> tuple[int, int, int] | None:
        """(phys, size, tags) of queue offset `qoff`, None outside the queue."""
        if qoff < self.min_offset:
            return None
        first, buf = self.tail
        if qoff >= first:
            pos = (qoff - first) * ENTRY_SIZE
            return ENTRY.unpack_from(buf, pos) if pos + ENTRY_SIZE <= len(buf) else None
        got = self.cqs._stored_pieces(self.qk, qoff, qoff + 1)
        if not got or got[0][0] != qoff:
            return None
        return ENTRY.unpack_from(got[0][1], 0)

    def first_at_or_after(self, phys: int) -> int:
        """The queue offset of the first entry whose CommitLog offset is >= phys (max_offset if
        none): the queue's end when the log ended at phys (entries are in CommitLog order)."""
        lo, hi = self.min_offset, self.max_offset
        while lo < hi:
            mid = (lo + hi) // 2
            e = self.entry(mid)
            if e is not None and e[0] < phys and e[1] != 0:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def __repr__(self) -> str:
        return f"ConsumeQueue({self.fl!r}, {self.qid}, [{self.min_offset}, {self.max_offset}))"


class ConsumeQueueStore:
    """The built-in dispatcher that maintains every first-level-topic ConsumeQueue."""

    name = "consumequeue"
    # flush() may run on another thread than dispatch(): it snapshots the dispatched end first,
    # then writes, so the checkpoint never claims more than what was in the tails it wrote
    flush_thread_safe = True

    def __init__(self, path: str, block_entries: int = BLOCK_ENTRIES, max_open_files: int = 256,
                 max_loaded: int = MAX_LOADED) -> None:
        """`path`: the database directory; `max_open_files`: RocksDB's table files open at once
        (part of the store's file budget, store/file_budget.py)."""
        self.path = path
        self.block_entries = max(1, block_entries)
        self.max_open_files = max_open_files
        self.max_loaded = max_loaded
        self._db: Rdict | None = None
        self._wo = WriteOptions()
        self._wo.disable_wal = True
        self.queues: dict[tuple[str, int], ConsumeQueue] = {}   # the loaded ones
        self._dirty: dict[tuple[str, int], ConsumeQueue] = {}  # with entries not in the database
        self._ckpt = 0
        self._last_end = 0
        self._runs = RunGrouper()
        # queue table and tails (dispatch, flush, loads by readers); never held during disk I/O
        self._lock = threading.Lock()
        # one writer of the database at a time: flush, retention, truncate
        self._write_lock = threading.Lock()

    # ------------------------------------------------------------------ open
    def load(self, log_min: int = 0) -> None:
        """Open the database; a data dir of the file-per-queue layout (`consumequeue/` beside it)
        is imported first (store/consume_queue_import.py). `log_min`: the CommitLog's first local
        offset (an old queue whose name is lost is replayed from there)."""
        from .consume_queue_import import OLD_DIR, import_file_queues
        old = os.path.join(os.path.dirname(self.path), OLD_DIR)
        self._open()
        db = self._db
        assert db is not None
        if os.path.isdir(old):
            if db.get(K_VERSION) is None:    # not imported yet (or interrupted: start again)
                self._clear()
                ckpt = import_file_queues(old, self._import_queue, log_min)
                db.put(K_CKPT, _U64.pack(ckpt), self._wo)
                db.put(K_VERSION, VERSION, self._wo)
                db.flush(True)
            shutil.rmtree(old)
        elif db.get(K_VERSION) is None:
            db.put(K_VERSION, VERSION, self._wo)
        v = db.get(K_CKPT)
        self._ckpt = self._last_end = 0 if v is None else _U64.unpack(v)[0]

    def _open(self) -> None:
        opts = rocksdb_options(self.max_open_files)
        opts.set_max_background_jobs(2)
        opts.set_write_buffer_size(16 << 20)
        try:
            os.makedirs(self.path, exist_ok=True)
            self._db = Rdict(self.path, opts)
        except Exception as e:  # noqa: BLE001 - rocksdict raises plain Exceptions
            raise StoreError(f"cannot open the ConsumeQueue database at {self.path}: {e}") from e

    def _clear(self) -> None:
        """Remove every key (an import that a crash interrupted starts again from nothing)."""
        db = self._db
        assert db is not None
        wb = WriteBatch(raw_mode=True)
        wb.delete_range(b"\x00", b"\xff")
        db.write(wb, self._wo)

    def _import_queue(self, fl: str, qid: int, min_offset: int, max_offset: int, blocks) -> None:
        """One queue of the old layout: `blocks` yields (first qoff, entry bytes) in order."""
        db = self._db
        assert db is not None
        qk = queue_key(fl, qid)
        wb = WriteBatch(raw_mode=True)
        for first, data in blocks:
            for i in range(0, len(data), self.block_entries * ENTRY_SIZE):
                part = data[i:i + self.block_entries * ENTRY_SIZE]
                q = first + i // ENTRY_SIZE
                wb.put(b"E" + qk + _U64.pack(q), _stored(bytes(part)))
                wb.put(b"P" + _U64.pack(_last_phys(part)) + qk, _PVAL.pack(q, len(part) // ENTRY_SIZE))
        wb.put(b"Q" + qk, _META.pack(min_offset, max_offset))
        db.write(wb, self._wo)

    # ------------------------------------------------------------------ the queue table
    def _queue(self, fl: str, qid: int) -> ConsumeQueue:
        """The queue, loaded (or created) on first use. Under self._lock."""
        key = (fl, qid)
        cq = self.queues.get(key)
        if cq is None:
            qk = queue_key(fl, qid)
            v = self._open_db().get(b"Q" + qk)
            lo, hi = (0, 0) if v is None else _META.unpack(v)
            cq = self.queues[key] = ConsumeQueue(self, fl, qid, qk, lo, hi)
        return cq

    def get(self, topic: str, qid: int) -> ConsumeQueue | None:
        """The queue of `topic`'s first level, None when it never had an entry."""
        fl = first_level(topic)
        cq = self.queues.get((fl, qid))
        if cq is not None:
            cq.used = True
            return cq
        if self._open_db().get(b"Q" + queue_key(fl, qid)) is None:
            return None
        with self._lock:
            return self._queue(fl, qid)

    def _open_db(self) -> Rdict:
        """The database, or a StoreError while it is closed after a failed write: a queue is never
        taken for new or empty because its keys could not be read (dispatch and readers retry)."""
        db = self._db
        if db is None:
            raise StoreError("the ConsumeQueue database is being opened again after a failed write; retry")
        return db

    def max_offsets(self) -> dict[tuple[str, int], int]:
        """{(first-level topic, queue id): next offset} of every queue (a scan of the `Q` keys:
        what the CommitLog's queue table starts from)."""
        out: dict[tuple[str, int], int] = {}
        for k, v in self._scan(b"Q"):
            out[_split_queue_key(k[1:])] = _META.unpack(v)[1]
        for key, cq in list(self.queues.items()):
            out[key] = cq.max_offset
        return out

    def queue_ids(self, fl: str) -> list[int]:
        """The queue ids of first-level topic `fl` that hold or held entries."""
        b = fl.encode("utf-8")
        prefix = b"Q" + _U16.pack(len(b)) + b
        ids = {_U32.unpack_from(k, len(prefix))[0] for k, _ in self._scan(prefix)}
        ids.update(q for (f, q) in list(self.queues) if f == fl)
        return sorted(ids)

    def _scan(self, prefix: bytes):
        db = self._open_db()
        ro = ReadOptions()
        ro.set_iterate_upper_bound(_prefix_end(prefix))
        it = db.iter(ro)
        it.seek(prefix)
        while it.valid():
            yield it.key(), it.value()
            it.next()

    def end_at(self, topic: str, qid: int, phys: int) -> int:
        """The end (next queue offset) the ConsumeQueue of `topic` had when the CommitLog ended at
        `phys`: how many of its entries point below phys (0 for a queue that does not exist)."""
        cq = self.get(topic, qid)
        return 0 if cq is None else cq.first_at_or_after(phys)

    def _stored_pieces(self, qk: bytes, q: int, end: int) -> list[tuple[int, bytes]]:
        """The stored entries of queue `qk` in [q, end): a piece per block."""
        db = self._open_db()    # never an empty answer that would skip entries
        base = b"E" + qk
        ro = ReadOptions()
        ro.set_iterate_upper_bound(base + _U64.pack(end))
        it = db.iter(ro)
        it.seek_for_prev(base + _U64.pack(q))   # the block holding q, if it starts before q
        if not it.valid() or not it.key().startswith(base):
            it.seek(base + _U64.pack(q))
        out = []
        n = len(base)
        while it.valid():
            first = _U64.unpack_from(it.key(), n)[0]
            block = it.value()
            try:
                stop = first + block_count(block)
                if stop > q:
                    a = max(q, first)
                    b = min(stop, end)
                    out.append((a, _cqe.decode_block(block, a - first, b - first)))
            except ValueError as e:
                fl, qid = _split_queue_key(qk)
                raise StoreError(f"ConsumeQueue {fl}/{qid}: the stored block from offset {first} is damaged: {e}") from e
                q = b
                if q >= end:
                    break
            it.next()
        return out

    # -------------------------------------------------------------- Dispatcher protocol
    def checkpoint(self) -> int:
        return self._ckpt

    def dispatch(self, batch, end_offset: int) -> None:
        """Group entries per queue into runs of consecutive queue offsets; one append per run.
        A DispatchBatch is read as its columns (no DispatchRequest built); a plain list of
        DispatchRequests is read by index on this hot path (store.message DR_*, bound to locals:
        a named tuple's attribute is slower to read)."""
        with self._lock:
            if type(batch) is DispatchBatch:
                self._runs.columns(batch, self._write_run)
            else:
                self._runs.rows(batch, self._write_run)
        self._last_end = end_offset

    def _write_run(self, key, qoff: int, blocks: list) -> None:
        """Append consecutive entries (packed blocks) starting at queue offset `qoff` to the queue's
        tail. Under self._lock."""
        cq = self.queues.get(key)
        if cq is None:
            cq = self._queue(*key)
        cq.used = True
        data = blocks[0] if len(blocks) == 1 else b"".join(blocks)
        first, buf = cq.tail
        mx = first + len(buf) // ENTRY_SIZE
        if qoff < mx:  # replayed entries this queue already has
            skip = (mx - qoff) * ENTRY_SIZE
            if skip >= len(data):
                return
            data = data[skip:]
        elif qoff > mx:
            if mx == cq.min_offset and not buf:
                # an empty queue: it starts there (a queue replayed from the middle of its topic,
                # after its first records left the log)
                cq.tail = (qoff, buf)
                cq.min_offset = qoff
            else:
                # records missing from the log (a corrupt range was skipped): the queue keeps their
                # offsets as unwritten entries (size 0), which every reader steps over
                log.warning("consumequeue %s/%d: gap between %d and %d", key[0], key[1], mx, qoff)
                buf += bytes((qoff - mx) * ENTRY_SIZE)
        buf += data
        self._dirty[key] = cq

    def flush(self) -> None:
        """Write every queue's tail to the database with the checkpoint, in one batch, and flush
        it to disk (see the module doc). The tails are trimmed only once that flush is done: a
        failure (a full disk, no descriptor for a table file) keeps them, the next flush writes
        them again (the same keys, the same values), and the checkpoint stays where it was."""
        end = self._last_end
        with self._write_lock:
            if self._db is None:
                self._open()            # after a failure that closed it; raises while it cannot
                for cq in list(self.queues.values()):
                    cq.last_block = None
            with self._lock:
                dirty = list(self._dirty.values())
                snaps = [(cq, cq.tail[0], bytes(cq.tail[1])) for cq in dirty]
            if end == self._ckpt and not snaps:
                return
            db = self._db
            assert db is not None
            try:
                wb = WriteBatch(raw_mode=True)
                for cq, first, data in snaps:
                    if data:
                        self._put_tail(wb, cq, first, data)
                    wb.put(b"Q" + cq.qk, _META.pack(cq.min_offset, first + len(data) // ENTRY_SIZE))
                wb.put(K_CKPT, _U64.pack(end))
                db.write(wb, self._wo)
                db.flush(True)
            except BaseException as e:
                for cq, _, _ in snaps:
                    cq.last_block = None        # looked up again: the write may not have happened
                if not is_disk_full(e):
                    # RocksDB refuses every write after a failed one until it is opened again
                    # (a full disk it recovers from by itself, once there is room)
                    self._reopen_later(e)
                raise
            with self._lock:
                for cq, first, data in snaps:
                    f, buf = cq.tail
                    if f != first:     # truncated meanwhile (not while a flush runs: _write_lock)
                        continue
                    if data:
                        cq.tail = (first + len(data) // ENTRY_SIZE, buf[len(data):])
                    if not cq.tail[1]:
                        self._dirty.pop((cq.fl, cq.qid), None)
            self._ckpt = end
            if len(self.queues) > self.max_loaded:
                self._unload_idle()

    def _reopen_later(self, e: BaseException) -> None:
        """Close the database after a failed write; the next flush opens it again. Readers meanwhile
        get a StoreError for the stored part of a queue (their in-memory tails still answer)."""
        db, self._db = self._db, None
        log.warning("consumequeue: a write failed (%s); the database is opened again by the next flush", e)
        if db is not None:
            try:
                db.close()
            except Exception:  # noqa: BLE001 - closing a database in error: nothing more to do
                pass

    def _put_tail(self, wb, cq: ConsumeQueue, first: int, data: bytes) -> None:
        """The blocks of a queue's tail into `wb`; a small newest block is extended instead of
        a new one started."""
        lb = cq.last_block
        if lb is None:
            lb = cq.last_block = self._find_last_block(cq.qk)
            stored_end = lb[0] + lb[1]
            if lb[1] and first < stored_end:
                # a failed flush (a full disk) whose batch did reach the database: entries up to
                # stored_end are there already (one atomic batch). Written again they would extend
                # that block with copies of its own entries, which readers then return twice
                skip = min(stored_end - first, len(data) // ENTRY_SIZE)
                first, data = first + skip, data[skip * ENTRY_SIZE:]
                if not data:
                    return
        if lb[1] and lb[1] < MERGE_BELOW and lb[0] + lb[1] == first:
            old = self._open_db().get(b"E" + cq.qk + _U64.pack(lb[0]))
            try:
                old = None if old is None else _cqe.decode_block(old)
            except ValueError:          # damaged: left as it is, the tail starts a block of its own
                old = None
            if old is not None and len(old) == lb[1] * ENTRY_SIZE:
                wb.delete(b"P" + _U64.pack(_last_phys(old)) + cq.qk)
                first, data = lb[0], old + data
        step = self.block_entries * ENTRY_SIZE
        for i in range(0, len(data), step):
            part = data[i:i + step]
            q = first + i // ENTRY_SIZE
            n = len(part) // ENTRY_SIZE
            wb.put(b"E" + cq.qk + _U64.pack(q), _stored(part))
            wb.put(b"P" + _U64.pack(_last_phys(part)) + cq.qk, _PVAL.pack(q, n))
            cq.last_block = (q, n)

    def _find_last_block(self, qk: bytes) -> tuple[int, int]:
        """(first qoff, entries) of the queue's newest stored block; (0, 0) when it has none."""
        base = b"E" + qk
        ro = ReadOptions()
        ro.set_iterate_upper_bound(_prefix_end(base))
        it = self._open_db().iter(ro)
        it.seek_to_last()      # (rocksdict honours the upper bound here, not the lower one)
        if not it.valid() or not it.key().startswith(base):
            return (0, 0)
        first = _U64.unpack_from(it.key(), len(base))[0]
        try:
            return (first, block_count(it.value()))
        except ValueError as e:
            # a damaged newest block is left as it is (its readers get a StoreError naming it);
            # the flush must go on: the tail starts a block of its own instead of extending it
            fl, qid = _split_queue_key(qk)
            log.warning("consumequeue %s/%d: the stored block from offset %d is damaged (%s); not extended",
                        fl, qid, first, e)
            return (first, 0)

    def _unload_idle(self) -> None:
        """Forget loaded queues that nothing used since the last time (second chance) and whose
        entries are all in the database. Under _write_lock."""
        with self._lock:
            drop = []
            for key, cq in self.queues.items():
                if cq.used:
                    cq.used = False
                elif not cq.tail[1] and key not in self._dirty:
                    drop.append(key)
            for key in drop:
                del self.queues[key]

    def truncate(self, offset: int) -> None:
        """Forget every entry whose CommitLog offset is >= offset (the log was cut there: recovery
        of a torn tail, a replica's divergent tail). Written and flushed at once: an entry left
        past a cut log would point at whatever record is appended there next."""
        with self._write_lock:
            if self._db is None:
                self._open()
            db = self._open_db()
            cuts: dict[bytes, int] = {}      # qk -> first queue offset to forget
            blocks: list[tuple[bytes, bytes, int, int]] = []   # (P key, qk, first, n)
            for k, v in self._scan_from(b"P" + _U64.pack(offset), b"Q"):
                qk = k[9:]
                first, n = _PVAL.unpack(v)
                blocks.append((k, qk, first, n))
                block = _cqe.decode_block(db.get(b"E" + qk + _U64.pack(first)) or b"")
                i = 0
                while i < n:
                    phys, size, _ = ENTRY.unpack_from(block, i * ENTRY_SIZE)
                    if size and phys >= offset:
                        break
                    i += 1
                cuts[qk] = min(cuts.get(qk, first + i), first + i)
            wb = WriteBatch(raw_mode=True)
            for pk, qk, first, n in blocks:
                cut = cuts[qk]
                if first + n <= cut:
                    continue
                wb.delete(pk)
                ek = b"E" + qk + _U64.pack(first)
                if first >= cut:
                    wb.delete(ek)
                else:
                    part = _cqe.decode_block(db.get(ek) or b"", 0, cut - first)
                    wb.put(ek, _stored(part))
                    wb.put(b"P" + _U64.pack(_last_phys(part)) + qk, _PVAL.pack(first, cut - first))
            with self._lock:
                for qk, cut in cuts.items():
                    fl, qid = _split_queue_key(qk)
                    cq = self._queue(fl, qid)
                    cq.tail = (cut, bytearray())
                    cq.min_offset = min(cq.min_offset, cut)
                    cq.last_block = None
                    self._dirty.pop((fl, qid), None)
                    wb.put(b"Q" + qk, _META.pack(cq.min_offset, cut))
                for cq in list(self.queues.values()):   # entries only in memory
                    first, buf = cq.tail
                    if not buf or cq.qk in cuts:
                        continue
                    n = len(buf) // ENTRY_SIZE
                    lo, hi = 0, n
                    while lo < hi:
                        mid = (lo + hi) // 2
                        phys, size, _ = ENTRY.unpack_from(buf, mid * ENTRY_SIZE)
                        if size == 0 or phys < offset:
                            lo = mid + 1
                        else:
                            hi = mid
                    if lo < n:
                        cq.tail = (first, buf[:lo * ENTRY_SIZE])
            if self._ckpt > offset:
                self._ckpt = offset
            wb.put(K_CKPT, _U64.pack(self._ckpt))
            db.write(wb, self._wo)
            db.flush(True)
            self._last_end = min(self._last_end, offset)

    def _scan_from(self, start: bytes, stop: bytes):
        """Keys in [start, stop): a truncation's or retention's one pass, kept out of the block
        cache (its blocks are read once; filling the cache would only grow memory)."""
        db = self._open_db()
        ro = ReadOptions()
        ro.set_iterate_upper_bound(stop)
        ro.fill_cache(False)
        it = db.iter(ro)
        it.seek(start)
        while it.valid():
            yield it.key(), it.value()
            it.next()

    def on_segments_deleted(self, min_phys_offset: int) -> None:
        """Retention: drop the blocks whose last entry points below the log's new start; each
        queue's `min_offset` moves past them (while the database is closed after a failed write:
        done by the next check)."""
        db = self._db
        if db is None:
            return
        with self._write_lock:
            wb = WriteBatch(raw_mode=True)
            mins: dict[bytes, int] = {}
            for k, v in self._scan_from(b"P", b"P" + _U64.pack(min_phys_offset)):
                qk = k[9:]
                first, n = _PVAL.unpack(v)
                wb.delete(k)
                wb.delete(b"E" + qk + _U64.pack(first))
                mins[qk] = max(mins.get(qk, 0), first + n)
            if not mins:
                return
            with self._lock:
                for qk, floor in mins.items():
                    fl, qid = _split_queue_key(qk)
                    cq = self.queues.get((fl, qid))
                    if cq is None:
                        v = db.get(b"Q" + qk)
                        hi = floor if v is None else _META.unpack(v)[1]
                        wb.put(b"Q" + qk, _META.pack(floor, hi))
                        continue
                    cq.min_offset = max(cq.min_offset, floor)
                    first, buf = cq.tail
                    if first < floor:
                        # blocks a failed flush did store (a full disk, see _put_tail) went while
                        # their entries were still in the tail: they point below the log's start too
                        cq.tail = (floor, buf[(floor - first) * ENTRY_SIZE:])
                        if not cq.tail[1]:
                            self._dirty.pop((fl, qid), None)
                    lb = cq.last_block
                    if lb is not None and lb[0] < floor:     # its newest block went: it has none
                        cq.last_block = (0, 0)
                    # the stored end (its tail is written by the next flush, with its Q key)
                    wb.put(b"Q" + qk, _META.pack(cq.min_offset, cq.tail[0]))
                db.write(wb, self._wo)

    def stats(self) -> dict:
        """What the queues cost: loaded queues, the database's live size and table files."""
        db = self._db
        out = {"cq_loaded_queues": len(self.queues)}
        if db is not None:
            for name, prop in (("cq_db_bytes", "rocksdb.total-sst-files-size"),
                               ("cq_db_memtable_bytes", "rocksdb.cur-size-all-mem-tables")):
                try:
                    out[name] = int(db.property_int_value(prop) or 0)
                except Exception:  # noqa: BLE001 - a property this RocksDB does not know
                    pass
        return out

    def close(self) -> None:
        db, self._db = self._db, None
        if db is None:
            return
        try:
            db.close()
        except Exception as e:  # noqa: BLE001 - rocksdict raises plain Exceptions
            # RocksDB's close flushes too, and fails on a full disk or after a failed write:
            # nothing it held is lost, the next start replays from the last durable checkpoint
            if not (is_disk_full(e) or "previous error" in str(e)):
                raise
            log.error("consumequeue: close failed (%s); the next start replays from the checkpoint %d",
                      str(e)[:200], self._ckpt)


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key that starts with `prefix`."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return b"\xff" * (len(prefix) + 1)
    p[-1] += 1
    return bytes(p)
