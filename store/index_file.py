"""Key index: find records by `topic#key` within a time range (after RocketMQ's IndexFile).

One IndexFile = header + hash-slot table + entry area, memory-mapped:

    header 48 B: begin_ts u64, end_ts u64, begin_phys u64, end_phys u64, slots u32, entries u32,
                 used_entries u32, pad u32
    slots:       `slots` x u32 = number (1-based) of the newest entry with this hash, 0 = empty
    entries:     `entries` x 20 B = key_hash u32, phys u64, time_diff_ms u32, prev u32

Entries are chained newest-first through `prev`, so a query walks a slot's chain from the newest
entry and stops once entries are older than the range. The hash is only a hint: the caller must
read the record and compare the real topic and key (a lookup that trusts the hash alone returns
other keys' messages on a collision). Files are named by the CommitLog offset of their first entry; a
new one starts when a file is full or its time span would overflow the u32 ms diff.
"""
from __future__ import annotations

import logging
import os
import struct
import threading
import zlib

from .checkpoint import OffsetCheckpoint
from .mapped_file import MappedFile, file_name, release_idle
from .message import DispatchBatch

log = logging.getLogger("lmqtt.store")

HEAD = struct.Struct("<QQQQIIII")
HEAD_SIZE = HEAD.size  # 48
SLOT = struct.Struct("<I")
ENTRY = struct.Struct("<IQII")
ENTRY_SIZE = ENTRY.size  # 20
MAX_DIFF = 0xFFFFFFFF


def key_hash(topic: str, key: str) -> int:
    return zlib.crc32(f"{topic}#{key}".encode("utf-8"))


class IndexFile:
    def __init__(self, path: str, slots: int, entries: int, create: bool, preallocate: bool) -> None:
        if not create:
            # an existing file keeps the geometry in its header (written with other sizes, e.g.
            # before the defaults changed): mapped at the configured size it would not open
            slots, entries = _geometry(path, slots, entries)
        self.slots = slots
        self.entries = entries
        size = HEAD_SIZE + slots * 4 + entries * ENTRY_SIZE
        # an existing file is mapped when a query or an add needs it (a long retention keeps many:
        # idle ones are unmapped again, IndexService.release_idle); its header is read as a file
        self.mf = MappedFile(path, int(os.path.basename(path)), size, create, preallocate, lazy=not create)
        head = self.mf.mm[:HEAD_SIZE] if create else _read_head(path)
        (self.begin_ts, self.end_ts, self.begin_phys, self.end_phys, s, e, self.used,
         _) = HEAD.unpack_from(head, 0)
        if create or (s == 0 and e == 0):
            self.used = 0
            self.begin_ts = self.end_ts = 0
            self.begin_phys = self.end_phys = int(os.path.basename(path))
            self._write_head()
        elif s != slots or e != entries:
            # written with another configuration: use the file's own geometry
            self.slots, self.entries = s, e
        self.entries_off = HEAD_SIZE + self.slots * 4

    @property
    def mm(self):
        return self.mf.mm

    def _write_head(self) -> None:
        HEAD.pack_into(self.mm, 0, self.begin_ts, self.end_ts, self.begin_phys, self.end_phys,
                       self.slots, self.entries, self.used, 0)

    @property
    def full(self) -> bool:
        return self.used >= self.entries

    def fits_time(self, ts: int) -> bool:
        return self.used == 0 or 0 <= ts - self.begin_ts <= MAX_DIFF

    def add(self, h: int, phys: int, ts: int) -> None:
        mm = self.mm
        if self.used == 0:
            self.begin_ts = ts
            self.begin_phys = phys
        slot_pos = HEAD_SIZE + (h % self.slots) * 4
        prev = SLOT.unpack_from(mm, slot_pos)[0]
        n = self.used + 1  # 1-based entry number
        ENTRY.pack_into(mm, self.entries_off + (n - 1) * ENTRY_SIZE, h, phys, max(0, ts - self.begin_ts), prev)
        SLOT.pack_into(mm, slot_pos, n)
        self.used = n
        if ts > self.end_ts:
            self.end_ts = ts
        self.end_phys = phys

    def lookup(self, h: int, begin_ms: int, end_ms: int, max_count: int, out: list) -> None:
        mm = self.mm
        n = SLOT.unpack_from(mm, HEAD_SIZE + (h % self.slots) * 4)[0]
        steps = 0
        while n and len(out) < max_count and steps <= self.used:
            steps += 1
            eh, phys, diff, prev = ENTRY.unpack_from(mm, self.entries_off + (n - 1) * ENTRY_SIZE)
            ts = self.begin_ts + diff
            if ts < begin_ms:
                break  # newest-first: the rest of the chain is older
            if eh == h and ts <= end_ms:
                out.append(phys)
            if prev >= n:
                break  # defensive: chains only point backwards
            n = prev

    def truncate_phys(self, offset: int) -> None:
        """Undo entries at/after `offset`, newest first, restoring each slot head to `prev`."""
        mm = self.mm
        while self.used:
            pos = self.entries_off + (self.used - 1) * ENTRY_SIZE
            h, phys, _diff, prev = ENTRY.unpack_from(mm, pos)
            if phys < offset:
                break
            SLOT.pack_into(mm, HEAD_SIZE + (h % self.slots) * 4, prev)
            mm[pos:pos + ENTRY_SIZE] = bytes(ENTRY_SIZE)
            self.used -= 1
        if self.used:
            self.end_phys = ENTRY.unpack_from(mm, self.entries_off + (self.used - 1) * ENTRY_SIZE)[1]
        self._write_head()

    def flush(self) -> None:
        self._write_head()
        self.mf.flush()

    def close(self) -> None:
        self.mf.close()

    def destroy(self) -> None:
        self.mf.destroy()


def _read_head(path: str) -> bytes:
    with open(path, "rb") as f:
        head = f.read(HEAD_SIZE)
    return head + bytes(HEAD_SIZE - len(head))


def _geometry(path: str, slots: int, entries: int) -> tuple[int, int]:
    """(slots, entries) of the existing index file at `path` from its header; the given ones when
    the header is not written yet (a crash while the file was created)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEAD_SIZE)
    except FileNotFoundError:
        return slots, entries
    if len(head) < HEAD_SIZE:
        return slots, entries
    s, e = HEAD.unpack(head)[4:6]
    if s and e:
        return s, e
    return slots, entries


class IndexService:
    """Built-in dispatcher maintaining the key index files."""

    name = "index"
    flush_thread_safe = True  # see ConsumeQueueStore.flush_thread_safe

    def __init__(self, root: str, slots: int, entries: int, preallocate: bool = True) -> None:
        self.root = root
        self.slots = slots
        self.entries = entries
        self.preallocate = preallocate
        self.files: list[IndexFile] = []
        self._ckpt_file = OffsetCheckpoint(os.path.join(root, "checkpoint"))
        self._ckpt = 0
        self._last_end = 0
        self._dirty = False
        self._resume: tuple[int, int] | None = None   # see dispatch()
        self._lock = threading.Lock()  # self.files is replaced by dispatch (roll) and retention
        self._flush_lock = threading.Lock()

    def load(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        self._ckpt = self._ckpt_file.load(0)
        self._last_end = self._ckpt
        names = sorted(n for n in os.listdir(self.root) if n.isdigit() and len(n) == 20)
        self.files = [IndexFile(os.path.join(self.root, n), self.slots, self.entries, False, self.preallocate)
                      for n in names]

    def checkpoint(self) -> int:
        return self._ckpt

    def dispatch(self, batch, end_offset: int) -> None:
        if type(batch) is DispatchBatch and not batch.has_keys():
            self._last_end = end_offset  # nothing to index: no DispatchRequest is built
            return
        done = self._last_end  # a batch retried after another dispatcher failed: skip what we have
        # a batch retried after THIS dispatcher failed (no space for a new index file): the keys
        # it added before the failure, up to (phys, key number), are not added twice
        resume = self._resume
        r = k = None
        i = 0
        try:
            for r in batch:
                if r.keys and r.phys_offset >= done:
                    ts = r.store_ts
                    for i, k in enumerate(r.keys):
                        if resume is not None and (r.phys_offset, i) < resume:
                            continue
                        f = self.files[-1] if self.files else None
                        if f is None or f.full or not f.fits_time(ts):
                            f = self._roll(f, r.phys_offset)
                        f.add(key_hash(r.topic, k), r.phys_offset, ts)
                        self._dirty = True
        except BaseException:
            if r is not None and k is not None:
                self._resume = (r.phys_offset, i)
            raise
        self._resume = None
        self._last_end = end_offset

    def _roll(self, f: IndexFile | None, phys: int) -> IndexFile:
        """Seal the newest file (flushed, its own descriptor closed: its map needs none) and start
        the next. Under the flush lock: a background flush that took the newest file before the
        roll would otherwise sync it after the seal, beside the roll."""
        with self._flush_lock:
            if f is not None:
                f.flush()
                f.mf.close_fd()
            nf = IndexFile(os.path.join(self.root, file_name(phys)), self.slots, self.entries, True,
                           self.preallocate)
            with self._lock:
                self.files = self.files + [nf]
        return nf

    def query(self, topic: str, key: str, begin_ms: int, end_ms: int, max_count: int) -> list[int]:
        """Candidate CommitLog offsets, newest first (hash matches only: verify the real key)."""
        h = key_hash(topic, key)
        out: list[int] = []
        for f in reversed(self.files):
            if len(out) >= max_count:
                break
            if f.used == 0 or f.end_ts < begin_ms or f.begin_ts > end_ms:
                continue
            f.lookup(h, begin_ms, end_ms, max_count, out)
        return out

    def flush(self) -> None:
        # one flush at a time: the background service's and an explicit flush of every dispatcher
        # (shutdown, admin, tests) may meet, and two saves of the checkpoint share its temp file
        # (the second rename found it gone: FileNotFoundError)
        with self._flush_lock:
            end = self._last_end
            if end == self._ckpt:
                return
            if self._dirty and self.files:
                self._dirty = False
                files = self.files
                for f in files[-2:]:  # a roll may have happened since the last flush
                    f.flush()
                    if f is not files[-1]:
                        f.mf.close_fd()     # full and flushed: its map (if any) needs no descriptor
            self._ckpt_file.save(end)
            self._ckpt = end

    def truncate(self, offset: int) -> None:
        keep = []
        for f in self.files:
            if f.begin_phys >= offset and f is not self.files[0]:
                f.destroy()
            else:
                keep.append(f)
        self.files = keep
        if keep:
            keep[-1].truncate_phys(offset)
        if self._ckpt > offset:
            self._ckpt = offset
            self._ckpt_file.save(offset)
        self._last_end = min(self._last_end, offset)

    def on_segments_deleted(self, min_phys_offset: int) -> None:
        with self._lock:
            files = self.files
            n = 0
            while n < len(files) - 1 and files[n].end_phys < min_phys_offset:
                n += 1
            self.files = files[n:]
        for f in files[:n]:
            f.destroy()

    def release_idle(self, keep: int) -> int:
        """Unmap idle full index files (never the newest) beyond `keep` mapped; mapped again when
        queried (store/file_budget.py)."""
        return release_idle([f.mf for f in self.files[:-1]], keep - 1)

    def close(self) -> None:
        for f in self.files:
            if f.mf.mapped:
                f.flush()
            f.close()
