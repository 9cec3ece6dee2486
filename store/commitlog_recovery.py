"""The CommitLog's tail recovery at start: where valid data ends, what is corrupt in the middle
(reported, skipped, never served), and the torn tail cut and zeroed (`CommitLogRecovery`, a part
of `CommitLog`); and the one tail cut made while the store runs, a promoted replica's half-shipped
last record (`cut_partial_record`).

Why a module of its own: commitlog.py appends, commits, flushes and reads while the store runs;
this runs once, before any of that, and decides what the log is after a crash or a damaged file.
It shares only the record framing (store/record.py) with the append path.
"""
from __future__ import annotations

import logging
import struct

from .record import BLANK_MAGIC, HEADER_SIZE, MSG_MAGIC, PREFIX, valid_at

log = logging.getLogger("lmqtt.store")     # the CommitLog's log, as before the split

_MSG_MAGIC_BYTES = struct.pack("<I", MSG_MAGIC)
_ZERO_BLOCK = bytes(1 << 20)


class CommitLogRecovery:
    """`CommitLog.recover` and its helpers (a mixin: they set the log's positions and files)."""

    # bytes the last recover() rewrote with zeros after the end of valid data (0: it found a clean
    # end); the store writes a recovery that cut down (store/recovery.py): consumer offsets get checked
    tail_cut = 0

    def recover(self, scan_from: int, trusted_end: int = 0) -> int:
        """Find the end of valid data scanning (with CRC) from `scan_from` (a record boundary, or any
        offset: it is rounded down to its segment start). Returns the end offset.

        `trusted_end` is the flushed offset saved before the crash: everything below it was fsynced
        and complete, so a bad record there is corruption *in the middle* - reported, skipped, and
        scanning resumes at the next valid record. At/after it a bad record is the *torn tail*: the
        log ends there, even if valid-looking records follow. They can: a batch is copied into the
        map with one memcpy, which does not necessarily store front to back, so a process killed
        inside it can leave a hole before the batch's last records; a power failure writes pages
        back in any order. Neither was acknowledged (sync acks after the fsync of the whole batch),
        and keeping them would break batch atomicity and leave gaps in the queues.

        The log ending below `trusted_end` (fsynced data missing: a segment truncated, emptied or
        deleted) is logged at ERROR here; the store says how much the checkpoints recorded."""
        self.tail_cut = 0
        files = self.mfq.files
        if not files:
            self.wrote = self.committed = self.flushed = 0
            return 0
        scan_from = max(scan_from, files[0].start_offset)
        mf = self.mfq.find(scan_from)
        if mf is None:
            mf = files[-1]
            scan_from = mf.start_offset
        # Like RocketMQ's recovery (which re-checks the last files with CRC even after a clean
        # shutdown), scan the whole segment holding scan_from: a record cut or damaged below a
        # checkpoint (disk trouble, a copied or truncated file) is then still found. Cost: one CRC
        # pass over at most one segment plus what follows it.
        pos = mf.start_offset
        idx = files.index(mf)
        corrupt = []
        while True:
            mf = files[idx]
            rel = pos - mf.start_offset
            size = mf.size
            mm = mf.mm
            while rel < size:
                if rel + 8 <= size:
                    total, magic = PREFIX.unpack_from(mm, rel)
                    if magic == BLANK_MAGIC and total == size - rel:
                        rel = size
                        break
                n = valid_at(mm, rel, mf.start_offset + rel, size)
                if n:
                    rel += n
                    continue
                if mf.start_offset + rel >= trusted_end:
                    end = mf.start_offset + rel
                    self._cut(mf, rel, idx, files, trusted_end)
                    self.corrupt_ranges = corrupt
                    return end
                nxt = self._resync(mf, rel)
                if nxt >= 0:
                    corrupt.append((mf.start_offset + rel, mf.start_offset + nxt))
                    log.error("commitlog: corrupt data at offsets [%d, %d) in %s; skipped, never served",
                              mf.start_offset + rel, mf.start_offset + nxt, mf.path)
                    rel = nxt
                    continue
                if idx + 1 < len(files) and self._segment_has_data(files[idx + 1]):
                    corrupt.append((mf.start_offset + rel, mf.end_offset))
                    log.error("commitlog: corrupt data at offsets [%d, %d) in %s; skipped, never served",
                              mf.start_offset + rel, mf.end_offset, mf.path)
                    rel = size
                    break
                # torn / absent tail: the end of the log
                end = mf.start_offset + rel
                self._cut(mf, rel, idx, files, trusted_end)
                self.corrupt_ranges = corrupt
                return end
            pos = mf.end_offset
            idx += 1
            if idx >= len(files):
                # ended exactly at a segment end: the next append creates the next segment
                self.wrote = self.committed = self.flushed = pos
                self.corrupt_ranges = corrupt
                return pos

    def cut_partial_record(self, boundary: int) -> int:
        """A store group's replica becoming primary (store/ha/member.py): its log may end inside a
        record, because the primary ships its log in frames of at most 1 MiB that need not end at a
        record boundary (store/ha/replication.py) and may die between two of them. No byte of that
        record was acknowledged (an acknowledged record is whole on every in-sync replica), and
        the new primary must not append after half a record: dispatch would read its first appends
        as that record's rest. So the log is cut back to the end of its last whole record, found by
        hopping over the records from `boundary` (a record start below the end: where dispatch
        stands; a replica's dispatch never takes a record it holds only part of).

        Cut only when what follows the last whole record is the start of one (a header or part of
        one, or a blank filler whose segment end was not shipped yet); anything else is left as it
        is and logged. Returns the bytes cut."""
        with self.lock:
            end = self.wrote
            pos = boundary
            cut = False
            while pos < end:
                mf = self.mfq.find(pos)
                if mf is None:
                    break
                rel = pos - mf.start_offset
                have = min(end, mf.end_offset) - pos
                if have < PREFIX.size:
                    cut = True                      # not even a record's size and magic
                    break
                total, magic = PREFIX.unpack_from(mf.mm, rel)
                if magic == BLANK_MAGIC:
                    if mf.end_offset <= end:
                        pos = mf.end_offset
                        continue
                    cut = True                      # a filler shipped without its segment's end
                    break
                if magic != MSG_MAGIC or total < HEADER_SIZE:
                    log.warning("commitlog: no record at offset %d while looking for the end of the last whole "
                                "record below %d; nothing cut", pos, end)
                    break
                if total > have:
                    cut = True                      # the record's start only
                    break
                pos += total
            if not cut or pos >= end:
                return 0
            mf = self.mfq.find(pos)
            files = self.mfq.files
            self._cut(mf, pos - mf.start_offset, files.index(mf), files)
            log.warning("commitlog: the last record was shipped only in part (offsets [%d, %d)); cut, it was "
                        "never acknowledged", pos, end)
            return end - pos

    def _segment_has_data(self, mf) -> bool:
        total, magic = PREFIX.unpack_from(mf.mm, 0)
        return (magic == BLANK_MAGIC and total == mf.size) or bool(valid_at(mf.mm, 0, mf.start_offset, mf.size))

    def _resync(self, mf, rel: int) -> int:
        """Relative position of the next valid record after `rel` in this segment, or -1."""
        mm = mf.mm
        i = rel + 1
        while True:
            j = mm.find(_MSG_MAGIC_BYTES, i + 4)
            if j < 0:
                return -1
            cand = j - 4
            if cand > rel and valid_at(mm, cand, mf.start_offset + cand, mf.size):
                return cand
            i = cand + 1

    def _cut(self, mf, rel: int, idx: int, files, trusted_end: int = 0) -> None:
        end = mf.start_offset + rel
        # zero non-zero blocks after the end so a later recovery cannot see stale bytes
        mm = mf.mm
        p = rel
        step = len(_ZERO_BLOCK)
        cut = 0
        while p < mf.size:
            q = min(p + step, mf.size)
            if mm[p:q] != _ZERO_BLOCK[:q - p]:
                mm[p:q] = _ZERO_BLOCK[:q - p]
                cut += q - p
            p = q
        if end < trusted_end:
            # not a torn write: data below the flushed checkpoint was fsynced and complete
            log.error("commitlog: valid data ends at offset %d (%s +%d), below the flushed checkpoint %d: "
                      "%d bytes that were fsynced are missing or unreadable%s", end, mf.path, rel, trusted_end,
                      trusted_end - end, "; the rest of the segment zeroed" if cut else "")
        elif cut:
            log.warning("commitlog: torn/invalid tail at offset %d (%s +%d) cut", end, mf.path, rel)
        if cut:
            mf.flush()
        self.tail_cut = cut
        for later in files[idx + 1:]:
            log.warning("commitlog: deleting segment %s after the end of valid data", later.path)
        self.mfq.files = files[:idx + 1]
        for later in files[idx + 1:]:
            later.destroy()
        mf.wrote_pos = mf.committed_pos = mf.flushed_pos = rel
        self.wrote = self.committed = self.flushed = end
