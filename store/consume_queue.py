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
import re
import struct
import threading
from itertools import accumulate
from urllib.parse import quote, unquote

from .atomic_file import sync_dir, write_atomic
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


def _entries_py(phys: int, sizes: list, i0: int, i1: int, tags: int) -> bytes:
    """Entries of the consecutive records sizes[i0:i1] (each starts where the previous ends, the
    first at `phys`) sharing one tag hash: one Struct.pack for up to _BULK_MAX entries (~40 %
    cheaper than one pack per entry). The reference of store/_fastpath.c `cq_entries`, which
    store/fastpath.py binds as `_entries` when it is built (tests/store/test_fastpath_accel.py
    compares them): py-spy --gil of a replica under `lmqtt bench ha --cases append-replicated`
    put this at ~35 of 317 GIL samples."""
    if i1 - i0 > _BULK_MAX:
        out = []
        for i in range(i0, i1, _BULK_MAX):
            part = sizes[i:min(i + _BULK_MAX, i1)]
            out.append(_entries_py(phys, part, 0, len(part), tags))
            phys += sum(part)
        return b"".join(out)
    if i0 or i1 != len(sizes):
        sizes = sizes[i0:i1]
    n = len(sizes)
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


# _entries(phys, sizes, i0, i1, tags): what `_dispatch_columns` calls. store/fastpath.py replaces it
# with the C twin (store/_fastpath.c cq_entries) once it has configured that module (it imports
# this module, so this one cannot import it); the store's dispatch imports fastpath
# (store/dispatch.py), so a store's dispatch runs the C one when it is built.
_entries = _entries_py


# the directory of the first level '' (topics that start with '/'); quote() never makes a '%'
# followed by a letter past 'F'. (Before, its queues sat in the root itself: see load.)
EMPTY_LEVEL_DIR = "%empty"


def topic_dir_name(topic: str) -> str:
    """A filesystem-safe, reversible-by-file directory name for a first-level topic."""
    if not topic:
        return EMPTY_LEVEL_DIR
    name = quote(topic, safe="")
    if name.startswith("."):
        name = "%2E" + name[1:]
    if len(name) > 200:
        name = "h_" + hashlib.sha1(topic.encode()).hexdigest()
    return name


# appended to a queue directory set aside (no name, nothing left to name it by); quote() never
# makes '%' followed by a letter past 'F', so no topic's directory holds it
UNNAMED_MARK = "%unnamed"
_HASHED = re.compile(r"h_[0-9a-f]{40}")


def _name_from_dir(dname: str) -> str | None:
    """The first-level topic whose `topic_dir_name` is `dname`, when that name is reversible
    (%-quoted, not a hash of a long name)."""
    if _HASHED.fullmatch(dname):
        return None
    topic = unquote(dname)
    return topic if topic and topic_dir_name(topic) == dname else None


def _holds_queue_files(path: str) -> bool:
    """A queue's directory (entry files named by offset), not a topic's (`.topic`, queue dirs)."""
    try:
        return any(f.isdigit() and os.path.isfile(os.path.join(path, f)) for f in os.listdir(path))
    except NotADirectoryError:
        return False


def _read_topic_file(tdir: str, dname: str) -> tuple[str | None, str]:
    """The first-level topic a queue directory's `.topic` names, or None and why not: missing,
    empty, unreadable, or a name whose directory is not this one (a torn write)."""
    if dname == EMPTY_LEVEL_DIR:
        return "", ""           # its name is its directory's ('.topic' is empty)
    try:
        with open(os.path.join(tdir, ".topic"), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None, "missing"
    except OSError as e:
        return None, f"unreadable ({e.strerror or e})"
    if not raw:
        return None, "empty"
    try:
        topic = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, f"not UTF-8 ({len(raw)} bytes)"
    if topic_dir_name(topic) != dname:
        return None, f"{topic[:64]!r}, a name whose directory is not this one"
    return topic, ""


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
        # queue directories whose `.topic` was missing, empty or unreadable at load (directory name
        # -> {queue id: queue}): named again by the first record of their topic that is dispatched
        self.unnamed: dict[str, dict[int, ConsumeQueue]] = {}
        # `.topic` files to write (path -> first-level topic): by flush(), before the checkpoint
        # covers any entry of their queue - off the appending thread (inline dispatch runs on the
        # gateway's event loop: no fsync there, as for the queue files' directory entries)
        self._names_unwritten: dict[str, str] = {}
        self._ckpt_file = OffsetCheckpoint(os.path.join(root, "checkpoint"))
        self._ckpt = 0
        self._last_end = 0
        self._fl_cache: dict[str, str] = {}
        self._lock = threading.Lock()  # queue table creation vs readers
        self.dirty_end = 0

    def load(self, log_min: int = 0) -> None:
        """Open every queue. `log_min`: the CommitLog's first local offset (a queue without a name
        is replayed only from a record still in the local log, never below it)."""
        os.makedirs(self.root, exist_ok=True)
        self._ckpt = self._ckpt_file.load(0)
        self._last_end = self._ckpt
        self._move_empty_level_queues()
        resume = None
        for d in os.listdir(self.root):
            tdir = os.path.join(self.root, d)
            if not os.path.isdir(tdir):
                continue
            if UNNAMED_MARK in d:
                continue        # set aside by an earlier start (below): not a queue any more
            topic, why = _read_topic_file(tdir, d)
            qids = [q for q in os.listdir(tdir) if q.isdigit() and os.path.isdir(os.path.join(tdir, q))]
            if topic is None and not qids:
                self.unnamed[d] = {}    # no queue in it (a crash right after its mkdir): named by its next record
                continue
            queues = {}
            for q in qids:
                cq = ConsumeQueue(os.path.join(tdir, q), self.entries_per_file, self.preallocate)
                cq.load()
                queues[int(q)] = cq
            if topic is not None:
                for qid, cq in queues.items():
                    self.queues[(topic, qid)] = cq
                continue
            # A missing, empty or torn .topic: the queue is not loaded under a wrong name (its
            # messages would be unreadable by topic, and its offsets taken again by new records)
            ends = [(cq.entry(cq.min_offset), cq.entry(cq.max_offset - 1))
                    for cq in queues.values() if cq.max_offset > cq.min_offset]
            durable = any(first is not None and first[1] and first[0] < self._ckpt for first, _ in ends)
            say = log.warning if durable else log.info  # (else: a crash before the flush that writes it)
            topic = _name_from_dir(d)
            if topic is not None:       # the directory name is the %-quoted topic: exact
                for qid, cq in queues.items():
                    self.queues[(topic, qid)] = cq
                self._names_unwritten[os.path.join(tdir, ".topic")] = topic   # by the flush after the replay
                say("consumequeue %s: its .topic is %s; named %r from the directory name (written again)",
                    tdir, why, topic)
                continue
            # a hashed directory name (a long topic): the name is in the CommitLog - replay from the
            # queue's last entry, whose record names the topic (_queue adopts the queue then)
            at = min((last[0] for _, last in ends if last is not None and last[1]
                      and log_min <= last[0] < self._ckpt), default=None)
            if at is not None or not durable:
                self.unnamed[d] = queues
                if at is not None:
                    resume = at if resume is None else min(resume, at)
                say("consumequeue %s: its .topic is %s, so its topic is unknown (a file written without "
                    "fsync before a power loss?); %s", tdir, why,
                    f"ConsumeQueue dispatch replays the CommitLog from offset {at}, and the queue takes "
                    "its name back from its record there" if at is not None else "named again by the replay")
                continue
            # none of its records is left in the local CommitLog (retention, the tier) to name it
            for cq in queues.values():
                cq.close()
            aside = tdir + UNNAMED_MARK
            n = 0
            while os.path.exists(aside):
                n += 1
                aside = f"{tdir}{UNNAMED_MARK}{n}"
            os.rename(tdir, aside)
            log.warning("consumequeue %s: its .topic is %s and none of its records is left in the local "
                        "CommitLog to name it again: set aside as %s (its messages stay readable by "
                        "CommitLog offset, not by topic; new messages of its topic start a new queue)",
                        tdir, why, aside)
        if resume is not None:
            # written down first: a crash during the replay starts it again from there (the queues'
            # entries at/after it are cut by truncate() and written again)
            self._ckpt_file.save(resume)
            self._ckpt = self._last_end = resume

    def _move_empty_level_queues(self) -> None:
        """An older version kept the queues of the first level '' (topics starting with '/') in
        the root itself (`<root>/<qid>/<files>`, `<root>/.topic` empty) and never loaded them after
        a restart: moved into their own directory (EMPTY_LEVEL_DIR), where load finds them."""
        old = [q for q in os.listdir(self.root) if q.isdigit() and _holds_queue_files(os.path.join(self.root, q))]
        if not old:
            return
        dest = os.path.join(self.root, EMPTY_LEVEL_DIR)
        os.makedirs(dest, exist_ok=True)
        for q in old:
            os.rename(os.path.join(self.root, q), os.path.join(dest, q))
        write_atomic(os.path.join(dest, ".topic"), b"")
        sync_dir(self.root)
        try:
            os.unlink(os.path.join(self.root, ".topic"))
        except FileNotFoundError:
            pass
        log.warning("consumequeue %s: the queue(s) %s of the topics that start with '/' (first level '') "
                    "moved into %s (an older version kept them in the root and did not load them after a "
                    "restart)", self.root, ", ".join(sorted(old)), dest)

    def _queue(self, fl: str, qid: int) -> ConsumeQueue:
        key = (fl, qid)
        cq = self.queues.get(key)
        if cq is None:
            dname = topic_dir_name(fl)
            tdir = os.path.join(self.root, dname)
            new_topic = not os.path.isdir(tdir)
            os.makedirs(tdir, exist_ok=True)
            tfile = os.path.join(tdir, ".topic")
            adopted = self.unnamed.get(dname)
            if adopted is not None or new_topic or not os.path.exists(tfile):
                # written by the next flush (atomic_file.write_atomic: whole and durable, or not at
                # all - on a full disk the flush fails and the next one writes it), before the
                # checkpoint covers any entry of the queue; a crash before leaves no .topic, and
                # the replay from the checkpoint names the queue again (load)
                with self._lock:
                    self._names_unwritten[tfile] = fl
            if adopted is not None:
                with self._lock:
                    for q, aq in adopted.items():
                        self.queues[(fl, q)] = aq
                del self.unnamed[dname]
                if adopted:
                    log.warning("consumequeue %s: named %r again (from the CommitLog), %d queue(s)", tdir,
                                fl, len(adopted))
                cq = self.queues.get(key)
                if cq is not None:
                    return cq
            cq = ConsumeQueue(os.path.join(tdir, str(qid)), self.entries_per_file, self.preallocate)
            cq.mfq.load()
            if new_topic:           # its entry in the root is synced with the queue's first file
                cq.mfq.created_dir(tdir)
            with self._lock:
                self.queues[key] = cq
        return cq

    def _all_queues(self) -> list[ConsumeQueue]:
        """The named queues and those waiting for their name (truncate, retention and close
        treat both alike)."""
        return list(self.queues.values()) + [cq for qs in list(self.unnamed.values()) for cq in qs.values()]

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
                        blocks.append((i1 - i0, _entries(r[at_phys], sizes, i0, i1, r[at_tags])))
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
        if end == self._ckpt and not self._names_unwritten:
            return
        if self._names_unwritten:
            with self._lock:
                names = list(self._names_unwritten.items())
            for tfile, fl in names:
                write_atomic(tfile, fl.encode("utf-8"))
                with self._lock:
                    if self._names_unwritten.get(tfile) == fl:
                        del self._names_unwritten[tfile]
        for cq in list(self.queues.values()):
            if cq.dirty:
                cq.dirty = False
                cq.mfq.sync_dirs()      # the entries of files created since, before the checkpoint
                for mf in cq.mfq.files[-2:]:
                    mf.flush()
        self._ckpt_file.save(end)
        self._ckpt = end

    def truncate(self, offset: int) -> None:
        for cq in self._all_queues():
            cq.truncate_phys(offset)
        if self._ckpt > offset:
            self._ckpt = offset
            self._ckpt_file.save(offset)
        self._last_end = min(self._last_end, offset)

    def on_segments_deleted(self, min_phys_offset: int) -> None:
        for cq in self._all_queues():
            cq.delete_below_phys(min_phys_offset)

    def close(self) -> None:
        for cq in self._all_queues():
            cq.close()
