"""`CommitLog`: record framing, batched append under one lock, reads by offset (tail recovery:
commitlog_recovery.py).

Append path (why it looks like this): a whole batch is laid out and encoded into one bytearray per
segment touched (`struct.pack_into` per record, one CRC per record) and copied into the memory map
with one slice assignment - no per-message syscall, no per-message copy into the map. A record
never spans two segments: when the next record does not fit (keeping >= 8 bytes for the filler
header) a blank filler closes the segment and the record goes to the next one.

In `async+buffer` mode the encoded chunks are kept in memory (`pending`) and copied into the map
by `commit()` (every 200 ms from the background service, or inline when the buffer is over its
cap). Only committed bytes are dispatched and visible.
"""
from __future__ import annotations

import logging
import os
import struct
import sys
import threading
import time
import zlib
from collections import deque

from .config import StoreConfig
from .disk_space import DiskSpace
from .errors import DiskFull, InvalidMessage, NotVisible, StoreError
from .mapped_file_queue import MappedFileQueue
from .errors import CorruptRecord
from .record import (HEADER_SIZE, MIN_BLANK, MSG_MAGIC, PREFIX, c_decode, c_decode_many, check_size, decode,
                     decode_many, encode_names, encode_topic, first_level, tags_code_of)
from .encoding import (ENCODER, PREFIX3 as _PREFIX3, TAIL_FORMAT as _TAIL_FORMAT, TI_DQ, TI_DQ_BYTES, TI_DQ_HBASE, TI_DQ_STRUCT,  # noqa: F401
                       TI_FIRST_LEVEL, TI_HBASE, TI_LEN, TI_STRUCT, TI_TAGS, TI_TOPIC_BYTES, TI_TOPIC_LEN,
                       c_encoder, encode_py)   # (ENCODER is read as commitlog.ENCODER)
from .message import AppendResult, AppendResults, DispatchRequest, StoredMessage
from .commitlog_recovery import CommitLogRecovery     # recover(): the tail after a crash

_new = tuple.__new__

# The batch encoder (store.encoding): C when built and not disabled by LMQTT_PURE_PYTHON, else
# `encode_py`. A module global so tests can switch it (monkeypatch `_fast` to None).
_fast = c_encoder
# The record decoders read() and read_many() use (store.record): C when built, else the Python
# reference. Module globals for the same reason (tests set them to record.decode / decode_many).
_decode = c_decode or decode
_decode_many = c_decode_many or decode_many

log = logging.getLogger("lmqtt.store")

class CommitLog(CommitLogRecovery):
    def __init__(self, cfg: StoreConfig, ident: str) -> None:
        self.cfg = cfg
        self.ident = ident
        self.seg_size = cfg.segment_size
        # a new segment's directory entry is made durable by the next flush, not by the appender
        self.mfq = MappedFileQueue(os.path.join(cfg.data_dir, "commitlog"), cfg.segment_size, cfg.preallocate,
                                   defer_dir_sync=True, lazy=True)
        self.lock = threading.Lock()
        self.buffered = cfg.flush_mode == "async+buffer"
        self.wrote = 0       # end of appended data (global offset; always a record boundary)
        self.committed = 0   # end of data in the maps (== wrote unless buffered); dispatch reads up to here
        self.flushed = 0     # end of data known durable (fdatasync done)
        self._flush_lock = threading.Lock()
        self.queue_table: dict[tuple[str, int], int] = {}
        self._topic_cache: dict[str, list] = {}
        self._names_cache: dict[tuple[str, ...], bytes] = {}
        self._struct_cache: dict[tuple[int, int, int], struct.Struct] = {}
        self.pending: list[tuple[int, bytearray]] = []
        self.pending_bytes = 0
        # set while appends are refused for lack of space (store/disk_space.py owns it)
        self.disk_full_reason: str | None = None
        self.disk = DiskSpace(self, cfg.data_dir, cfg.segment_size, cfg.disk_high_water)
        self.corrupt_ranges: list[tuple[int, int]] = []
        self.group_commit = None  # set by MessageStore in sync mode
        # Recently appended records kept as their fields (keep_recent(); off by default):
        # phys -> a tuple of store.message.RECENT_FIELDS.
        # read() serves them without slicing the map, CRC-checking and decoding again (a reader
        # of single records near the head; the light queues' pulls decode in runs with
        # read_many, which does not look here). Only bytes bodies/props are kept (immutable),
        # FIFO-bounded.
        self._recent: dict[int, tuple] = {}
        self._recent_chunks: deque = deque()   # (bytes, [phys, ...]) in append order
        self._recent_bytes = 0
        self._recent_max_bytes = 0
        self._recent_max_records = 0
        # live hand-off to dispatch (see StoreConfig.dispatch_from_memory): (start, end, requests)
        # per append call, contiguous from live[0].start while live_enabled
        self.live: deque = deque()
        self.live_enabled = False
        self.live_count = 0
        self.live_cap = cfg.dispatch_memory_max_records if cfg.dispatch_from_memory else 0
        # store/tier TierService when a tier is enabled: reads below the first local segment go there
        self.tier = None

    def keep_recent(self, max_bytes: int, max_records: int) -> None:
        """Keep the last appended records (up to both bounds) for read(); 0 turns it off."""
        with self.lock:
            self._recent_max_bytes = max(0, int(max_bytes))
            self._recent_max_records = max(0, int(max_records))
            if not self._recent_max_bytes or not self._recent_max_records:
                self._recent = {}
                self._recent_chunks.clear()
                self._recent_bytes = 0

    def _recent_add(self, offsets: list, fields: list, nbytes: int) -> None:
        """Under self.lock, after the records are in place. Two parallel lists rather than
        (phys, fields) pairs: one tuple less per record to allocate and for the GC to visit."""
        d = self._recent
        d.update(zip(offsets, fields))
        chunks = self._recent_chunks
        chunks.append((nbytes, offsets))
        self._recent_bytes += nbytes
        mb, mr = self._recent_max_bytes, self._recent_max_records
        while chunks and (self._recent_bytes > mb or len(d) > mr):
            n, old = chunks.popleft()
            self._recent_bytes -= n
            pop = d.pop
            for p in old:
                pop(p, None)

    # ------------------------------------------------------------------ append
    def _topic_info(self, topic: str) -> list:
        """[topic bytes, first-level name, tags code, topic length, tail Struct w/o keys/queues,
        HEADER_SIZE+len, + the last dispatch-queue tuple seen with this topic and its (encoded,
        Struct, HEADER_SIZE+len+dq)] (slots named TI_* in store.encoding, read by the C encoder):
        a publisher's topic usually comes with the same dispatch-queue tuple object every time,
        and this saves hashing that tuple and looking up its Struct per record."""
        tb = encode_topic(topic, self.cfg.max_topic_bytes)
        S0 = self._tail_struct(len(tb), 0, 0)
        info = [None] * TI_LEN
        info[TI_TOPIC_BYTES] = tb
        info[TI_FIRST_LEVEL] = sys.intern(first_level(topic))
        info[TI_TAGS] = tags_code_of(tb)
        info[TI_TOPIC_LEN] = len(tb)
        info[TI_STRUCT] = info[TI_DQ_STRUCT] = S0
        info[TI_HBASE] = info[TI_DQ_HBASE] = HEADER_SIZE + len(tb)
        info[TI_DQ] = ()
        info[TI_DQ_BYTES] = b""
        if len(self._topic_cache) > 100_000:
            self._topic_cache.clear()
        self._topic_cache[topic] = info
        return info

    def _tail_struct(self, tl: int, kl: int, dl: int) -> struct.Struct:
        """Struct packing everything after the CRC field up to props: fixed fields + topic + keys +
        queues, so one call writes them (cached per length triple)."""
        key = (tl, kl, dl)
        st = self._struct_cache.get(key)
        if st is None:
            st = struct.Struct(f"{_TAIL_FORMAT}{tl}s{kl}s{dl}s")
            if len(self._struct_cache) > 10_000:
                self._struct_cache.clear()
            self._struct_cache[key] = st
        return st

    def _names(self, names: tuple[str, ...], what: str) -> bytes:
        b = self._names_cache.get(names)
        if b is None:
            b = encode_names(names, what)
            if len(self._names_cache) > 100_000:
                self._names_cache.clear()
            self._names_cache[names] = b
        return b

    def check_writable(self) -> None:
        if self.disk_full_reason:
            raise self.disk.refuse(1, self.disk_full_reason)

    def append_batch(self, msgs, fut, ident: str) -> tuple[list, int]:
        """`fut` is the durable future for the results, or None to use `self.group_commit.current`
        (read under the lock, see GroupCommitService)."""
        return self._append_batch(msgs, fut, ident)

    def _append_batch(self, msgs, fut, ident: str) -> tuple:
        """Append `msgs` atomically (all or none). Returns (AppendResults, end offset).

        The batch is encoded first (store.encoding: C when built, else `encode_py`: one buffer per segment
        touched), then copied into the map with one slice assignment per segment. Nothing touches
        the map or the queue table until the whole batch is encoded and its segments exist, so a
        bad message or DiskFull leaves no trace.

        Per record it keeps only its size: records that share topic, queue, flags, born_ts, keys
        and dispatch queues form one *run* (see store.message), which is all the caller's results
        and the live hand-off to dispatch need. No tuple per record survives the call (that was
        40 % of the time for small messages, plus the GC scans of those tuples).
        """
        if type(msgs) is not list:
            msgs = list(msgs)
        if self.disk_full_reason:
            raise self.disk.refuse(len(msgs), self.disk_full_reason)
        seg = self.seg_size
        with self.lock:
            if fut is None:
                fut = self.group_commit.current
            start_phys = self.wrote
            seg_end = start_phys - start_phys % seg + seg
            store_ts = int(time.time() * 1000)
            want_recent = self._recent_max_records > 0
            if _fast is not None:
                (chunks, sizes, starts, runs, keyed, assigned, phys, recent_offs,
                 recent, cq) = _fast.encode(msgs, self, self._topic_cache, self._names_cache, self.queue_table,
                                        start_phys, seg_end, seg, store_ts, self.cfg.max_message_size,
                                        want_recent)
            else:
                (chunks, sizes, starts, runs, keyed, assigned, phys, recent_offs,
                 recent) = encode_py(self, msgs, start_phys, seg_end, store_ts, want_recent)
                cq = None
            if not sizes:
                return [], self.wrote
            # make sure every segment exists before writing anything (DiskFull -> nothing written)
            for c, _ in chunks:
                if self.mfq.find(c) is None:
                    try:
                        self._new_segment(c - c % seg)
                    except DiskFull as e:
                        self.disk.refused += len(msgs)
                        raise e from None
            if self.buffered:
                self.pending += chunks     # (start offset, encoded bytes) per segment touched
                # the bytes buffered, not phys - start_phys (a blank filler is 8 bytes written that
                # move phys to the segment's end); a plain loop: sum() over a generator is ~2x slower
                for _, buf in chunks:
                    self.pending_bytes += len(buf)
                self.wrote = phys
                if self.pending_bytes > self.cfg.commit_buffer_max:
                    self._commit_locked()
            else:
                find = self.mfq.find
                for c, buf in chunks:
                    mf = find(c)
                    rel = c - mf.start_offset
                    mf.mm[rel:rel + len(buf)] = buf
                    mf.wrote_pos = rel + len(buf)
                self.wrote = phys
                self.committed = phys
            self.queue_table.update(assigned)
            if recent:
                self._recent_add(recent_offs, recent, phys - start_phys)
            # a chunk, in store.message CHUNK_* order; cq: ConsumeQueue entries per (first level,
            # queue id) as encoded, or None (the ConsumeQueue dispatcher packs them from the runs)
            chunk = (sizes, starts, runs, keyed, cq)
            if self.live_enabled:
                self._live_add(start_phys, phys, chunk, len(sizes))
                if self.buffered and self.live_count > self.live_cap // 2:
                    # commit before the live hand-off overflows: past its cap dispatch falls back
                    # to parsing the log (~3x its CPU), and a fast appender fills it within the
                    # 200 ms commit period (800k msg/s did: lag p99 0.5 -> 1.2 s)
                    self._commit_locked()
        return AppendResults(chunk, fut, ident, phys), phys

    def _dq_info(self, t: list, dq: tuple) -> None:
        """Remember `dq` (and its encoding, Struct, header size) as topic info `t`'s last
        dispatch-queue tuple (see _topic_info)."""
        db = self._names_cache.get(dq) or self._names(dq, "dispatch_queues")
        S = self._tail_struct(t[TI_TOPIC_LEN], 0, len(db))
        t[TI_DQ], t[TI_DQ_BYTES], t[TI_DQ_STRUCT], t[TI_DQ_HBASE] = dq, db, S, t[TI_HBASE] + len(db)

    def _live_add(self, start: int, end: int, chunk, count: int) -> None:
        """Under self.lock: queue one append's chunk (of `count` records) for the dispatch thread."""
        self.live.append((start, end, chunk))
        self.live_count += count
        if self.live_count > self.live_cap:
            # dispatch is far behind: stop queueing, it will read the CommitLog instead
            self.live_enabled = False
            self.live.clear()
            self.live_count = 0

    def append_one(self, m, fut, ident: str):
        """Single-message fast path (the gateway appends one PUBLISH at a time): the same record
        as append_batch, with ~1/3 of its fixed per-call cost. Falls back to append_batch when the
        record needs a new segment. Returns (AppendResult, end offset)."""
        if self.disk_full_reason:
            raise self.disk.refuse(1, self.disk_full_reason)
        topic = m.topic
        t = self._topic_cache.get(topic)
        if t is None:
            t = self._topic_info(topic)
        # the topic info (store.encoding TI_*) unpacked whole, in slot order: cheaper than indexing
        # six slots (a reordered TI_* shows in tests/store/test_encoding.py's byte-for-byte test)
        tb, fl, tags, tl, S, hbase, _dq, _db, _dS, _dh = t
        body = m.body
        props = m.props
        keys = m.keys
        dq = m.dispatch_queues
        try:
            bl = len(body)
            pl = len(props)
        except TypeError as e:
            raise InvalidMessage(f"body and props must be bytes-like: {e}; nothing was written") from None
        if keys or dq:
            ncache = self._names_cache
            kb = (ncache.get(keys) or self._names(keys, "keys")) if keys else b""
            db = (ncache.get(dq) or self._names(dq, "dispatch_queues")) if dq else b""
            kl = len(kb)
            dl = len(db)
            S = self._tail_struct(tl, kl, dl)
        else:
            kb = db = b""
            kl = dl = 0
        total = hbase + kl + dl + bl + pl
        if total > self.cfg.max_message_size:
            check_size(total, self.cfg.max_message_size)
        qid = m.queue_id
        flags = m.flags
        born = m.born_ts
        key = (fl, qid)
        seg = self.seg_size
        with self.lock:
            phys = self.wrote
            mf = self.mfq.find(phys)
            if mf is None or phys + total > phys - phys % seg + seg - MIN_BLANK:
                mf = None
            else:
                if fut is None:
                    fut = self.group_commit.current
                qoff = self.queue_table.get(key, 0)
                store_ts = int(time.time() * 1000)
                try:
                    tail = S.pack(qid, flags, qoff, phys, born, store_ts, tags, bl, pl, tl, kl, dl, tb, kb, db)
                    crc = zlib.crc32(body, zlib.crc32(props, zlib.crc32(tail)))
                    rec = b"".join((_PREFIX3.pack(total, MSG_MAGIC, crc), tail, props, body))
                except struct.error as e:
                    raise InvalidMessage(f"a numeric field is out of range (queue_id/flags u32, born_ts u64 "
                                         f"non-negative): {e}; nothing was written") from None
                except TypeError as e:
                    raise InvalidMessage(f"body and props must be bytes-like: {e}; nothing was written") from None
                end = phys + total
                if self.buffered:
                    self.pending.append((phys, rec))
                    self.pending_bytes += total
                    self.wrote = end
                    if self.pending_bytes > self.cfg.commit_buffer_max:
                        self._commit_locked()
                else:
                    rel = phys - mf.start_offset
                    mf.mm[rel:rel + total] = rec
                    mf.wrote_pos = rel + total
                    self.wrote = end
                    self.committed = end
                self.queue_table[key] = qoff + 1
                new = tuple.__new__
                if self._recent_max_records and type(body) is bytes and type(props) is bytes:
                    # in store.message.RECENT_FIELDS order (tests/store/test_encoding.py checks it)
                    self._recent_add([phys], [(topic, body, props, qid, qoff, flags, total, born, store_ts,
                                               keys, dq)], total)
                if self.live_enabled:
                    # a chunk of one record, in store.message CHUNK_* order like append_batch's;
                    # no packed ConsumeQueue entries (the dispatcher packs the one from the run)
                    self._live_add(phys, end, ([total], [0], [new(DispatchRequest, (
                        phys, total, topic, qid, qoff, flags, born, store_ts, tags, keys, dq))], bool(keys), None),
                        1)
                return new(AppendResult, (phys, total, qoff, fut, ident)), end
        results, end = self._append_batch((m,), fut, ident)
        return results[0], end

    def append_replicated(self, offset: int, data) -> int:
        """A replica's append (store/ha/replication.py): the primary's CommitLog bytes `data`, which it
        appended at `offset`, written at the same offset (== `wrote`: the stream is contiguous),
        blank fillers and the zeros after them included, so segments line up byte for byte. Records
        are visible once dispatch parsed them from the log (no live hand-off on a replica).
        Returns the new end."""
        if self.disk_full_reason:
            raise self.disk.refuse(1, self.disk_full_reason)
        seg = self.seg_size
        view = memoryview(data)
        with self.lock:
            if offset != self.wrote:
                raise StoreError(f"replicated bytes at offset {offset}, but this log ends at {self.wrote}")
            pos, i, n = offset, 0, len(view)
            while i < n:
                mf = self.mfq.find(pos)
                if mf is None:
                    mf = self._new_segment(pos - pos % seg)
                rel = pos - mf.start_offset
                k = min(n - i, mf.size - rel)
                mf.mm[rel:rel + k] = view[i:i + k]
                mf.wrote_pos = rel + k
                pos += k
                i += k
            self.wrote = self.committed = pos
        return pos

    def enable_live(self, dispatched: int) -> bool:
        """Called by the dispatch thread when it has caught up: start queueing requests again.
        Chunks queued from now on start at `wrote`; dispatch reads the log up to there."""
        if not self.live_cap:
            return False
        with self.lock:
            if dispatched >= self.committed and not self.live_enabled:
                self.live.clear()
                self.live_count = 0
                self.live_enabled = True
        return self.live_enabled

    def _new_segment(self, start: int):
        """Create (preallocate) the segment at `start`, under self.lock. DiskFull when the disk is
        above the high-water mark or the segment does not fit; after such a failure, no new
        fallocate is tried until the filesystem reports room for a segment (store/disk_space.py:
        one log line per episode, not one per refused append)."""
        disk = self.disk
        blocked = disk.segment_blocked()
        if blocked:
            raise DiskFull(blocked)
        disk.check_high_water()
        try:
            mf = self.mfq.create(start)
        except DiskFull as e:
            raise disk.segment_failed(e) from None
        disk.segment_created()
        return mf

    def commit(self) -> int:
        """async+buffer: copy pending chunks into the maps. Returns the new committed offset."""
        with self.lock:
            return self._commit_locked()

    def _commit_locked(self) -> int:
        for cstart, buf in self.pending:
            mf = self.mfq.find(cstart)
            rel = cstart - mf.start_offset
            mf.mm[rel:rel + len(buf)] = buf
            mf.wrote_pos = rel + len(buf)
        self.pending = []
        self.pending_bytes = 0
        self.committed = self.wrote
        return self.committed

    # ------------------------------------------------------------------ flush
    def flush(self) -> int:
        """fdatasync every segment holding committed-but-unflushed data. Returns the flushed offset."""
        return self.flush_to(self.committed)

    def flush_to(self, target: int) -> int:
        with self._flush_lock:
            start = self.flushed
            if target <= start:
                return start
            self.mfq.sync_dirs()        # new segments' entries, before their data counts as durable
            files = self.mfq.files
            for mf in reversed(files):      # the newest first: stop at the flushed ones
                if mf.end_offset <= start:
                    break
                if mf.start_offset < target:
                    mf.flush()
                    if mf.end_offset <= target and mf is not files[-1]:
                        # sealed and durable: nothing writes or flushes it any more, and its map
                        # (if any) holds a descriptor of its own
                        mf.close_fd()
            self.flushed = target
            return target

    # ------------------------------------------------------------------ read
    def read(self, phys: int, size: int | None = None) -> StoredMessage:
        mf = self.mfq.find(phys)
        if mf is None:
            if self.tier is not None and phys < self.mfq.min_offset:
                return self.tier.read(phys, size)     # offloaded (store/tier): read from the tier
            raise NotVisible(f"offset {phys} is outside the CommitLog [{self.mfq.min_offset}, {self.wrote})")
        t = self._recent.get(phys)
        if t is not None:
            # the fields as appended, unpacked in store.message.RECENT_FIELDS order (one unpack is
            # cheaper than indexing them one by one; tests/store/test_encoding.py checks that this
            # gives the record as decoded from the log)
            topic, body, props, queue_id, queue_offset, flags, rsize, born_ts, store_ts, keys, dq = t
            if size is None or size == rsize:
                return _new(StoredMessage, (topic, body, props, queue_id, flags, queue_offset, phys, rsize,
                                            born_ts, store_ts, f"{self.ident}{phys:016X}", keys, dq))
        rel = phys - mf.start_offset
        mm = mf.mm
        try:
            if size is None:
                size = PREFIX.unpack_from(mm, rel)[0]
            if size < HEADER_SIZE or rel + size > mf.size:
                raise CorruptRecord(f"no valid record at offset {phys} (size field {size})")
            # decoded in place from the map, bounded by `size` (no slice copy first)
            return _decode(mm, rel, phys, self.ident, True, rel + size)
        except ValueError:
            if mm.closed:   # map closed by retention meanwhile
                if self.tier is not None:       # deleted after its upload: the tier has it
                    return self.tier.read(phys, size)
                raise NotVisible(f"offset {phys} was deleted by retention") from None
            raise

    @property
    def min_readable(self) -> int:
        """The first readable offset: the tier's first segment when a tier holds older ones."""
        return self.tier.min_offset() if self.tier is not None else self.mfq.min_offset

    def read_many(self, wanted: list) -> list:
        """The records at `wanted` [(phys, size), ...] (sizes as the index recorded them), in that
        order: one StoredMessage per item, or the exception its read raised (NotVisible outside
        the log or deleted by retention meanwhile, CorruptRecord) - never raised, so one bad record
        does not cost the others; the caller decides. The one exception raised: TierReadError
        (an offloaded range while the tier is unreachable), which fails the whole read. The same checks and results as read() per
        item, with one decode call per run of items in the same segment (store.record.decode_many)
        instead of one read() per record: a history read or a pull asks for hundreds at once.
        The recently-appended cache is not consulted: decoding from the map gives the same fields."""
        out: list = []
        i = 0
        n = len(wanted)
        find = self.mfq.find
        many = _decode_many
        ident = self.ident
        while i < n:
            phys = wanted[i][0]
            mf = find(phys)
            if mf is None and self.tier is not None and phys < self.mfq.min_offset:
                i = self.tier.read_many(wanted, i, out)     # offloaded (store/tier)
                continue
            if mf is None:
                out.append(NotVisible(f"offset {phys} is outside the CommitLog [{self.mfq.min_offset}, "
                                      f"{self.wrote})"))
                i += 1
                continue
            mm = mf.mm
            base = len(out)
            try:
                j = many(mm, mf.start_offset, wanted, i, ident, out)
            except ValueError:
                if not mm.closed:
                    raise
                del out[base:]
                if self.tier is not None:       # deleted after its upload: read the tier
                    i = self.tier.read_many(wanted, i, out)
                    continue
                j = i
                while j < n and mf.start_offset <= wanted[j][0] < mf.end_offset:
                    out.append(NotVisible(f"offset {wanted[j][0]} was deleted by retention"))
                    j += 1
            if j == i:      # a map shorter than its segment (never expected): not served
                out.append(NotVisible(f"offset {phys} is outside its segment's map"))
                j += 1
            i = j
        return out

    def close(self) -> None:
        self.mfq.close()

