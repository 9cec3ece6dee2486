"""The reads of a light queue's entries (`IndexReads`, a part of `LightQueueIndex`): RocksDB runs
below, the in-memory tail above, holes (dropped or swept ranges) skipped.

Why a module of its own: index.py is the Dispatcher that takes dispatched records into the tails
and writes them to RocksDB in large batches (and truncates, drops, counts); a reader - a pull, a
light-queue delivery, `end_at` - only ever reads what that left, by the run key layout of
index.py's docstring.
"""
from __future__ import annotations

import struct
from typing import Iterable, NamedTuple

from lmqtt.store import consume_queue_entries as _blocks, fastpath  # noqa: F401 - fastpath binds the C codec

from .take import ENTRY, ENTRY_SIZE

U64 = struct.Struct(">Q")
RUN_KEY = struct.Struct(">QQ")        # a run's key: qid, first queue offset
_ITER = ENTRY.iter_unpack


def stored_run(entries: bytes) -> bytes:
    """A run as the database keeps it: encoded in runs of adjacent records like a ConsumeQueue
    block (store/consume_queue_entries.py "stored blocks", big-endian entries) when the C module
    is built, raw otherwise; readers take both (`decode_run`). Why: at fan-out 16 the index wrote
    16 x 20 bytes per record, ~90 MB/s into the memtable, flush and compaction, and the write's
    one WriteBatch grew to ~21 MB, each one fresh pages past the 1 MiB mmap threshold."""
    enc = _blocks.encode_block
    return entries if enc is None else enc(entries, True)


def decode_run(v: bytes, start: int = 0, stop: int = -1) -> bytes:
    """Entries [start, stop) of a stored run (raw or encoded), as raw big-endian entries."""
    return _blocks.decode_block(v, start, stop, True)


def stored_run_length(v: bytes) -> int:
    """How many entries a stored run holds."""
    return _blocks.block_count(v)


class IndexEntry(NamedTuple):
    queue_offset: int
    phys_offset: int
    size: int
    store_ts: int


class IndexReads:
    """`LightQueueIndex`'s reads (a mixin over its `_db`, `_tail`, `_qids` and `qid`)."""

    # Entries below a queue's tail are in RocksDB: a tail always starts at or below the queue's
    # written point. Readers take the tail snapshot BEFORE opening the RocksDB iterator, so the
    # iterator sees everything below that snapshot's first offset; the snapshot covers the rest
    # (a newer, possibly trimmed tail could leave a gap). A hole between the last RocksDB entry
    # and the tail is a dropped or swept range and is skipped, as holes between runs are.
    def _db_runs(self, qid: int, offset: int) -> Iterable[tuple[int, bytes]]:
        """(first queue offset, packed entries) of the RocksDB runs of `qid`, from the run
        holding `offset` (or the first one after it) on, in order."""
        pre = U64.pack(qid)
        it = self._db.iter()
        it.seek_for_prev(RUN_KEY.pack(qid, offset))
        if not (it.valid() and it.key()[:8] == pre and len(it.key()) == 16):
            it.seek(RUN_KEY.pack(qid, offset))
        while it.valid():
            k = it.key()
            if len(k) != 16 or k[:8] != pre:
                return
            yield RUN_KEY.unpack(k)[1], it.value()
            it.next()

    def iter_entries(self, qid: int, offset: int) -> Iterable[IndexEntry]:
        """Entries of queue `qid` from `offset` on, in order (RocksDB runs, then the tail)."""
        t = self._tail.get(qid)
        if t is None or offset < t[0]:
            for first, v in self._db_runs(qid, offset):
                v = decode_run(v)
                n = len(v) // ENTRY_SIZE
                i = offset - first if offset > first else 0
                while i < n:
                    phys, size, ts = ENTRY.unpack_from(v, i * ENTRY_SIZE)
                    yield IndexEntry(first + i, phys, size, ts)
                    i += 1
                    offset = first + i
            if t is None:
                return
        first, ba = t
        if offset < first:
            offset = first
        v = ba[(offset - first) * ENTRY_SIZE:]     # a private copy: the tail keeps growing
        for phys, size, ts in _ITER(v):
            yield IndexEntry(offset, phys, size, ts)
            offset += 1

    def read_raw(self, name: str, offset: int, max_count: int) -> list[tuple[int, int, int]]:
        """Up to `max_count` (queue_offset, phys_offset, size) of `name` from `offset` on.

        From the in-memory tail when it covers `offset` (a reader that keeps up), else from
        RocksDB and then the tail. Entries may point at/after the store's dispatched offset (the
        caller stops there) or below the log start (the caller skips them), exactly as `read`."""
        q = self._qids.get(name)
        if q is None:
            q = self.qid(name)
            if q is None:
                return []
        if max_count <= 0:
            return []
        out = []
        append = out.append
        t = self._tail.get(q)
        if t is None or offset < t[0]:
            for first, v in self._db_runs(q, offset):
                i = offset - first if offset > first else 0
                o = first + i
                for phys, size, _ts in _ITER(decode_run(v, i, i + max_count - len(out))):
                    append((o, phys, size))
                    o += 1
                offset = o
                if len(out) >= max_count:
                    return out
            if t is None:
                return out
        first, ba = t
        if offset < first:
            offset = first
        i = (offset - first) * ENTRY_SIZE
        for phys, size, _ts in _ITER(ba[i:i + (max_count - len(out)) * ENTRY_SIZE]):
            append((offset, phys, size))
            offset += 1
        return out

    def tail_piece(self, name: str, offset: int, max_count: int):
        """Up to `max_count` entries of `name` from `offset` as the in-memory tail stores them
        (ENTRY each, consecutive queue offsets), when the tail holds `offset` (a reader that keeps
        up: every push of new entries); None otherwise (`read_raw` reads RocksDB then)."""
        q = self._qids.get(name)
        t = None if q is None else self._tail.get(q)
        if t is None or offset < t[0] or max_count <= 0:
            return None
        i = (offset - t[0]) * ENTRY_SIZE
        return t[1][i:i + max_count * ENTRY_SIZE]

    def read(self, name: str, offset: int, max_count: int) -> list[IndexEntry]:
        """Up to `max_count` entries of `name` starting at `offset` (unknown queue -> [])."""
        q = self.qid(name)
        if q is None or max_count <= 0:
            return []
        out = []
        for e in self.iter_entries(q, offset):
            out.append(e)
            if len(out) >= max_count:
                break
        return out
