"""Retention: delete whole CommitLog segments older than the configured time.

A segment is deleted only when (1) it is not the active (last) segment, (2) its file's last
modification is older than `retention_ms`, and (3) every dispatcher's durable checkpoint is past
its end - a dispatcher that still needs a segment for replay keeps it alive. Dispatchers are then
told the new log start so they drop their own files (ConsumeQueue files, IndexFiles) below it.
"""
from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("lmqtt.store")


def expired_prefix(files, retention_ms: int, safe_offset: int, now_ms: int) -> int:
    """How many leading segments may be deleted."""
    n = 0
    for mf in files[:-1]:
        if mf.end_offset > safe_offset:
            break
        try:
            mtime_ms = os.stat(mf.path).st_mtime * 1000
        except FileNotFoundError:
            mtime_ms = 0
        if now_ms - mtime_ms < retention_ms:
            break
        n += 1
    return n


def delete_expired(clog, dispatchers, dispatched: int, retention_ms: int, now_ms: int | None = None) -> int:
    """Delete expired segments; returns how many were deleted."""
    if now_ms is None:
        now_ms = int(time.time() * 1000)
    files = clog.mfq.files
    safe = min([dispatched] + [d.checkpoint() for d in dispatchers])
    n = expired_prefix(files, retention_ms, safe, now_ms)
    if not n:
        return 0
    new_min = files[n].start_offset
    for mf in files[:n]:
        log.info("retention: deleting segment %s (all dispatchers past %d)", mf.path, mf.end_offset)
    clog.mfq.delete_before(new_min)
    for d in dispatchers:
        try:
            d.on_segments_deleted(new_min)
        except Exception:
            log.exception("retention: dispatcher %s failed on_segments_deleted(%d)", d.name, new_min)
    return n
