"""Cutting a member's CommitLog back to the primary's (a rejoining old primary's divergent tail).

Done with the store closed: the member writes the cut offset to `<ha dir>/cut` (atomically), and
before its store opens (the member restarts itself in place, same process id) `apply_pending_cut`
zeroes the log from that offset, deletes the segments after it and lowers the CommitLog
checkpoint, then removes the marker. The store's own recovery then does the rest exactly as after
a torn tail: every queue is cut back to the log (each dispatcher's `truncate`), the cut is written
down in `recoveries` and consumer offsets beyond their queue's end are reset (store/recovery.py).
A crash in between finds the marker again and redoes the (idempotent) cut.
"""
from __future__ import annotations

import logging
import os

from ..checkpoint import OffsetCheckpoint, write_atomic
from ..mapped_file import NAME_DIGITS

log = logging.getLogger("lmqtt.store.ha")

MARKER = "cut"
_BLOCK = bytes(1 << 20)


def request_cut(ha_dir: str, offset: int, why: str) -> None:
    os.makedirs(ha_dir, exist_ok=True)
    write_atomic(os.path.join(ha_dir, MARKER), f"{int(offset)} {why}".encode())


def pending_cut(ha_dir: str) -> tuple[int, str] | None:
    try:
        with open(os.path.join(ha_dir, MARKER), encoding="utf-8") as f:
            off, _, why = f.read().partition(" ")
        return int(off), why
    except (FileNotFoundError, ValueError):
        return None


def apply_pending_cut(ha_dir: str, store_dir: str) -> tuple[int, int] | None:
    """Apply a requested cut (store closed). Returns (offset, bytes removed) or None."""
    p = pending_cut(ha_dir)
    if p is None:
        return None
    offset, why = p
    removed = cut_log(store_dir, offset)
    log.warning("event=ha_log_truncated offset=%d bytes_removed=%d reason=%r", offset, removed, why)
    os.unlink(os.path.join(ha_dir, MARKER))
    return offset, removed


def cut_log(store_dir: str, offset: int) -> int:
    """Make the CommitLog under `store_dir` end at `offset`: zero from there to its segment's end,
    delete later segments, lower the flushed checkpoint. Returns the bytes of data removed
    (approximately: non-zero blocks zeroed plus whole segments deleted)."""
    cdir = os.path.join(store_dir, "commitlog")
    try:
        names = sorted(n for n in os.listdir(cdir) if len(n) == NAME_DIGITS and n.isdigit())
    except FileNotFoundError:
        names = []
    removed = 0
    for n in names:
        path = os.path.join(cdir, n)
        start = int(n)
        size = os.path.getsize(path)
        if start >= offset and not (start == offset and n == names[0]):
            removed += size
            os.unlink(path)
            continue
        if start + size <= offset:
            continue
        rel = offset - start
        with open(path, "r+b") as f:
            f.seek(rel)
            pos = rel
            while pos < size:
                chunk = f.read(min(len(_BLOCK), size - pos))
                if not chunk:
                    break
                if chunk.count(0) != len(chunk):
                    removed += len(chunk)
                    f.seek(pos)
                    f.write(_BLOCK[:len(chunk)])
                pos += len(chunk)
            f.flush()
            os.fsync(f.fileno())
    ck = OffsetCheckpoint(os.path.join(store_dir, "commitlog.checkpoint"))
    if ck.load(0) > offset:
        ck.save(offset)
    return removed
