"""ConsumeQueue: per (first-level topic, queue id) index of fixed 20-byte entries.

Entry = CommitLog offset u64, record size u32, tag hash u64 (CRC-32 of the full topic);
`StoreConfig.cq_entries_per_file` entries per file (65,536 = 1.25 MiB; RocketMQ: 300,000), files
named by the 20-digit byte offset of their first entry, so the entry for queue offset N is at byte
N*20: O(1) seek, no search. (as RocketMQ's ConsumeQueue.)

`ConsumeQueueStore` is the built-in dispatcher that maintains all of them. Its checkpoint is the
CommitLog offset below which every entry is durable; on recovery it truncates entries at/after
that offset so replay neither duplicates nor skips an entry.
"""
from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
from itertools import accumulate
from urllib.parse import quote

from .checkpoint import OffsetCheckpoint
from .mapped_file_queue import MappedFileQueue
from .message import (CHUNK_CQ, CHUNK_RUNS, CHUNK_SIZES, CHUNK_STARTS, DR_PHYS, DR_QUEUE_ID, DR_QUEUE_OFFSET,
                      DR_SIZE, DR_TAGS_CODE, DR_TOPIC, DispatchBatch)
from .record import first_level

log = logging.getLogger("lmqtt.store")

ENTRY = struct.Struct("<QIQ")
# its fields, one per code of the format (the C modules that read or pack entries, store/_fastpath.c
# and store/_append.c, check these names, not only the offsets: phys_offset and tags_code are both
# u64 and could trade places without changing the format)
ENTRY_FIELDS = ("phys_offset", "size", "tags_code")
ENTRY_SIZE = ENTRY.size  # 20
assert ENTRY_SIZE == 20 and len(ENTRY_FIELDS) == len(ENTRY.format) - 1

_BULK: dict[int, struct.Struct] = {}   # n -> Struct of n entries
_BULK_MAX = 1024


def _entries(phys: int, sizes: list, tags: int) -> bytes:
    """Entries of consecutive records (each starts where the previous ends) sharing one tag hash:
    one Struct.pack for up to _BULK_MAX entries (~40 % cheaper than one pack per entry)."""
    n = len(sizes)
    if n > _BULK_MAX:
        out = []
        for i in range(0, n, _BULK_MAX):
            part = sizes[i:i + _BULK_MAX]
            out.append(_entries(phys, part, tags))
            phys += sum(part)
        return b"".join(out)
    st = _BULK.get(n)
    if st is None:
        if len(_BULK) > 256:
            _BULK.clear()
        st = _BULK[n] = struct.Struct("<" + "QIQ" * n)
    flat = [tags] * (3 * n)
    offs = list(accumulate(sizes, initial=phys))
    del offs[-1]
    flat[0::3] = offs
    flat[1::3] = sizes
    return st.pack(*flat)


def topic_dir_name(topic: str) -> str:
    """A filesystem-safe, reversible-by-file directory name for a first-level topic."""
    name = quote(topic, safe="")
    if name.startswith("."):
        name = "%2E" + name[1:]
    if len(name) > 200:
        name = "h_" + hashlib.sha1(topic.encode()).hexdigest()
    return name


class ConsumeQueue:
    """One queue: a MappedFileQueue of entry files plus min/max offsets (in entries)."""

    def __init__(self, directory: str, entries_per_file: int, preallocate: bool) -> None:
        # a new file's (and new topic directory's) entry is made durable by the flush that covers
        # its entries, off the appender's thread (inline dispatch runs on the event loop)
        self.mfq = MappedFileQueue(directory, entries_per_file * ENTRY_SIZE, preallocate, defer_dir_sync=True)
        self.file_bytes = entries_per_file * ENTRY_SIZE
        self.max_offset = 0  # next queue offset to write
        self.min_offset = 0
        self.dirty = False

    def load(self) -> None:
        self.mfq.load()
        files = self.mfq.files
        if not files:
            return
        self.min_offset = files[0].start_offset // ENTRY_SIZE
        # entries fill each file from its start; find the first empty slot of the last file
        last = files[-1]
        lo, hi = 0, self.file_bytes // ENTRY_SIZE
        mm = last.mm
        while lo < hi:
            mid = (lo + hi) // 2
            if ENTRY.unpack_from(mm, mid * ENTRY_SIZE)[1] != 0:
                lo = mid + 1
            else:
                hi = mid
        self.max_offset = last.start_offset // ENTRY_SIZE + lo
        last.wrote_pos = lo * ENTRY_SIZE

    def entry(self, qoff: int) -> tuple[int, int, int] | None:
        mf = self.mfq.find(qoff * ENTRY_SIZE)
        if mf is None:
            return None
        return ENTRY.unpack_from(mf.mm, qoff * ENTRY_SIZE - mf.start_offset)

    def put(self, qoff: int, data: bytes) -> None:
        """Write consecutive entries starting at queue offset `qoff` (slice copies per file)."""
        pos = qoff * ENTRY_SIZE
        view = memoryview(data)
        i = 0
        while i < len(data):
            mf = self.mfq.find(pos)
            if mf is None:
                start = pos - pos % self.file_bytes
                mf = self.mfq.create(start)
                if len(self.mfq.files) == 1:
                    self.min_offset = start // ENTRY_SIZE
            rel = pos - mf.start_offset
            n = min(len(data) - i, mf.size - rel)
            mf.mm[rel:rel + n] = view[i:i + n]
            mf.wrote_pos = rel + n
            i += n
            pos += n
        self.max_offset = qoff + len(data) // ENTRY_SIZE
        self.dirty = True

    def pieces(self, from_off: int, max_count: int) -> list[tuple[int, bytes]]:
        """The raw entries from `from_off`, at most max_count: [(first queue offset, entry bytes)],
        one piece per ConsumeQueue file touched (usually one). Unwritten entries (size 0) are
        included; `range` is the decoded view of the same bytes."""
        out = []
        q = max(from_off, self.min_offset)
        end = min(self.max_offset, q + max_count)
        while q < end:
            mf = self.mfq.find(q * ENTRY_SIZE)
            if mf is None:
                break
            rel = q * ENTRY_SIZE - mf.start_offset
            n = min(end - q, (mf.size - rel) // ENTRY_SIZE)
            out.append((q, mf.mm[rel:rel + n * ENTRY_SIZE]))
            q += n
        return out

    def range(self, from_off: int, max_count: int) -> list[tuple[int, int, int, int]]:
        """[(queue_offset, phys, size, tags)] from `from_off`, at most max_count, only written ones."""
        out = []
        for q, piece in self.pieces(from_off, max_count):
            for i, (phys, size, tags) in enumerate(ENTRY.iter_unpack(piece)):
                if size:
                    out.append((q + i, phys, size, tags))
        return out

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

    def truncate_phys(self, offset: int) -> None:
        """Forget entries whose CommitLog offset is >= offset (entries are in CommitLog order).
        The zeroed entries are fsynced at once: an entry left on disk past a cut log would point at
        whatever record is appended there next."""
        lo = self.first_at_or_after(offset)
        if lo >= self.max_offset:
            return
        pos = lo * ENTRY_SIZE
        end = self.max_offset * ENTRY_SIZE
        touched = []
        while pos < end:
            mf = self.mfq.find(pos)
            if mf is None:
                break
            rel = pos - mf.start_offset
            n = min(end - pos, mf.size - rel)
            mf.mm[rel:rel + n] = bytes(n)
            touched.append(mf)
            pos += n
        self.mfq.truncate_files_after(max(lo * ENTRY_SIZE, self.mfq.min_offset + 1))
        for mf in touched:
            if not mf.closed:      # (files after the cut were deleted)
                mf.flush()
        self.max_offset = lo
        self.dirty = True

    def flush(self) -> None:
        if self.dirty:
            self.dirty = False
            self.mfq.sync_dirs()
            for mf in self.mfq.files[-2:]:
                mf.flush()

    def delete_below_phys(self, min_phys: int) -> None:
        """Drop whole files whose last entry points below `min_phys` (retention)."""
        files = self.mfq.files
        n = 0
        for mf in files[:-1]:
            last_phys = ENTRY.unpack_from(mf.mm, mf.size - ENTRY_SIZE)[0]
            if last_phys < min_phys:
                n += 1
            else:
                break
        if n:
            self.mfq.delete_before(files[n].start_offset)
            self.min_offset = self.mfq.min_offset // ENTRY_SIZE

    def close(self) -> None:
        self.mfq.close()


class ConsumeQueueStore:
    """Built-in dispatcher maintaining every first-level-topic ConsumeQueue."""

    name = "consumequeue"
    # flush() may run on another thread than dispatch(): it snapshots the dispatched end first,
    # then fsyncs, so the checkpoint never claims more than what was on disk before the fsync
    flush_thread_safe = True

    def __init__(self, root: str, entries_per_file: int = 65_536, preallocate: bool = True) -> None:
        self.root = root
        self.entries_per_file = entries_per_file
        self.preallocate = preallocate
        self.queues: dict[tuple[str, int], ConsumeQueue] = {}
        self._ckpt_file = OffsetCheckpoint(os.path.join(root, "checkpoint"))
        self._ckpt = 0
        self._last_end = 0
        self._fl_cache: dict[str, str] = {}
        self._lock = threading.Lock()  # queue table creation vs readers
        self.dirty_end = 0

    def load(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        self._ckpt = self._ckpt_file.load(0)
        self._last_end = self._ckpt
        for d in os.listdir(self.root):
            tdir = os.path.join(self.root, d)
            tfile = os.path.join(tdir, ".topic")
            if not os.path.isfile(tfile):
                continue
            with open(tfile, encoding="utf-8") as f:
                topic = f.read()
            for q in os.listdir(tdir):
                if q.isdigit():
                    cq = ConsumeQueue(os.path.join(tdir, q), self.entries_per_file, self.preallocate)
                    cq.load()
                    self.queues[(topic, int(q))] = cq

    def _queue(self, fl: str, qid: int) -> ConsumeQueue:
        key = (fl, qid)
        cq = self.queues.get(key)
        if cq is None:
            tdir = os.path.join(self.root, topic_dir_name(fl))
            new_topic = not os.path.isdir(tdir)
            os.makedirs(tdir, exist_ok=True)
            tfile = os.path.join(tdir, ".topic")
            if not os.path.exists(tfile):
                # written whole or not at all (temp file + rename): on a full disk the write fails
                # and the retry writes it again, where an in-place write would leave an empty
                # .topic - the queue then loads under the wrong name after a restart
                tmp = tfile + ".tmp"
                try:
                    with open(tmp, "w", encoding="utf-8") as f:
                        f.write(fl)
                    os.replace(tmp, tfile)
                except BaseException:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
                    raise
            cq = ConsumeQueue(os.path.join(tdir, str(qid)), self.entries_per_file, self.preallocate)
            cq.mfq.load()
            if new_topic:           # its entry in the root is synced with the queue's first file
                cq.mfq.created_dir(tdir)
            with self._lock:
                self.queues[key] = cq
        return cq

    def get(self, topic: str, qid: int) -> ConsumeQueue | None:
        return self.queues.get((first_level(topic), qid))

    def max_offsets(self) -> dict[tuple[str, int], int]:
        return {k: q.max_offset for k, q in self.queues.items()}

    def end_at(self, topic: str, qid: int, phys: int) -> int:
        """The end (next queue offset) the ConsumeQueue of `topic` had when the CommitLog ended at
        `phys`: how many of its entries point below phys (0 for a queue that does not exist)."""
        cq = self.get(topic, qid)
        return 0 if cq is None else cq.first_at_or_after(phys)

    # -------------------------------------------------------------- Dispatcher protocol
    def checkpoint(self) -> int:
        return self._ckpt

    def dispatch(self, batch, end_offset: int) -> None:
        """Group entries per queue into runs of consecutive queue offsets; one slice copy per run.
        A DispatchBatch is read as its columns (no DispatchRequest built); a plain list of
        DispatchRequests is read by index on this hot path (store.message DR_*, bound to locals:
        a named tuple's attribute is slower to read)."""
        if type(batch) is DispatchBatch:
            self._dispatch_columns(batch)
            self._last_end = end_offset
            return
        groups: dict[tuple[str, int], list] = {}
        flc = self._fl_cache
        pack = ENTRY.pack
        last_topic = None
        last_qid = -1
        g: list = []
        nxt = 0
        at_phys, at_size, at_topic, at_qid, at_qoff, at_tags = (DR_PHYS, DR_SIZE, DR_TOPIC, DR_QUEUE_ID,
                                                                DR_QUEUE_OFFSET, DR_TAGS_CODE)
        for r in batch:
            topic = r[at_topic]
            qid = r[at_qid]
            if topic is not last_topic or qid != last_qid:
                fl = flc.get(topic) or self._first_level(topic)
                key = (fl, qid)
                g = groups.get(key)
                if g is None:
                    g = groups[key] = [r[at_qoff]]
                nxt = g[0] + len(g) - 1
                last_topic = topic
                last_qid = qid
            qoff = r[at_qoff]
            if qoff != nxt:  # not consecutive: write what we have and start a new run
                self._write_run(key, g[0], g[1:])
                g = groups[key] = [qoff]
                nxt = qoff
            g.append(pack(r[at_phys], r[at_size], r[at_tags]))
            nxt += 1
        for key, g in groups.items():
            self._write_run(key, g[0], g[1:])
        self._last_end = end_offset

    def _dispatch_columns(self, batch) -> None:
        """One packed block of entries per run of the batch (records of one queue with consecutive
        offsets, see store.message), blocks of one queue joined while they continue each other."""
        groups: dict[tuple[str, int], list] = {}   # key -> [first qoff, next qoff, [blocks]]
        flc = self._fl_cache
        pack = ENTRY.pack
        last_topic = None
        last_qid = -1
        key = None
        g: list = []
        at_sizes, at_starts, at_runs, at_cq = CHUNK_SIZES, CHUNK_STARTS, CHUNK_RUNS, CHUNK_CQ
        at_phys, at_size, at_topic, at_qid, at_qoff, at_tags = (DR_PHYS, DR_SIZE, DR_TOPIC, DR_QUEUE_ID,
                                                                DR_QUEUE_OFFSET, DR_TAGS_CODE)
        for c in batch.chunks:
            sizes, starts, runs, cqs = c[at_sizes], c[at_starts], c[at_runs], c[at_cq]
            if cqs is not None:   # packed by the encoder: a block per queue of this append
                for key, (qoff, data) in cqs.items():
                    g = groups.get(key)
                    if g is None:
                        g = groups[key] = [qoff, qoff, []]
                    elif g[1] != qoff:
                        self._write_run(key, g[0], g[2])
                        g = groups[key] = [qoff, qoff, []]
                    g[1] = qoff + len(data) // ENTRY_SIZE
                    g[2].append(data)
                last_topic = None   # `g`/`key` of the row path below no longer apply
                continue
            ns = len(sizes)
            if len(runs) == ns:   # one record per run (the usual single append): runs = records
                blocks = None
            else:
                blocks = []
                nr = len(runs)
                for k in range(nr):
                    i0 = starts[k]
                    i1 = starts[k + 1] if k + 1 < nr else ns
                    r = runs[k]
                    if i1 - i0 == 1:
                        blocks.append((1, pack(r[at_phys], sizes[i0], r[at_tags])))
                    else:
                        blocks.append((i1 - i0, _entries(r[at_phys], sizes if i1 - i0 == ns else sizes[i0:i1],
                                                         r[at_tags])))
            for k, r in enumerate(runs):
                if blocks is None:
                    n = 1
                    data = pack(r[at_phys], r[at_size], r[at_tags])
                else:
                    n, data = blocks[k]
                topic = r[at_topic]
                qid = r[at_qid]
                qoff = r[at_qoff]
                if topic is not last_topic or qid != last_qid:
                    fl = flc.get(topic) or self._first_level(topic)
                    key = (fl, qid)
                    g = groups.get(key)
                    if g is None:
                        g = groups[key] = [qoff, qoff, []]
                    last_topic = topic
                    last_qid = qid
                if g[1] != qoff:  # not consecutive: write what we have and start a new run
                    self._write_run(key, g[0], g[2])
                    g = groups[key] = [qoff, qoff, []]
                g[1] = qoff + n
                g[2].append(data)
        for key, g in groups.items():
            if g[2]:
                self._write_run(key, g[0], g[2])

    def _first_level(self, topic: str) -> str:
        """first_level(topic), remembered (the dispatch loops look the cache up inline first)."""
        flc = self._fl_cache
        fl = first_level(topic)
        if len(flc) > 100_000:
            flc.clear()
        flc[topic] = fl
        return fl

    def _write_run(self, key, qoff: int, blocks: list) -> None:
        """Write consecutive entries (packed blocks) starting at queue offset `qoff`."""
        cq = self._queue(*key)
        data = blocks[0] if len(blocks) == 1 else b"".join(blocks)
        if qoff < cq.max_offset:  # replayed entries this queue already has
            skip = (cq.max_offset - qoff) * ENTRY_SIZE
            if skip >= len(data):
                return
            data = data[skip:]
            qoff = cq.max_offset
        elif qoff > cq.max_offset and cq.max_offset:
            log.warning("consumequeue %s/%d: gap between %d and %d", key[0], key[1], cq.max_offset, qoff)
        cq.put(qoff, data)

    def flush(self) -> None:
        end = self._last_end
        if end == self._ckpt:
            return
        for cq in list(self.queues.values()):
            if cq.dirty:
                cq.dirty = False
                cq.mfq.sync_dirs()      # the entries of files created since, before the checkpoint
                for mf in cq.mfq.files[-2:]:
                    mf.flush()
        self._ckpt_file.save(end)
        self._ckpt = end

    def truncate(self, offset: int) -> None:
        for cq in self.queues.values():
            cq.truncate_phys(offset)
        if self._ckpt > offset:
            self._ckpt = offset
            self._ckpt_file.save(offset)
        self._last_end = min(self._last_end, offset)

    def on_segments_deleted(self, min_phys_offset: int) -> None:
        for cq in list(self.queues.values()):
            cq.delete_below_phys(min_phys_offset)

    def close(self) -> None:
        for cq in self.queues.values():
            cq.close()
