"""`OffsetCheckpoint`: one durable integer (a CommitLog offset) in a small file.

Written atomically (temp file, fsync, rename, fsync of the directory: `write_atomic`) so a crash
leaves either the old or the new value, never a torn one. Each dispatcher owns one; the CommitLog
keeps its flushed offset in one too. Written about once a second while the value moves; a save of
the value already on disk is skipped (an idle store did a write + two fsyncs a second for nothing).
"""
from __future__ import annotations

import os
import struct
import zlib

_FMT = struct.Struct("<QI")  # value, crc32(value bytes)


class OffsetCheckpoint:
    def __init__(self, path: str) -> None:
        self.path = path
        self._saved: int | None = None      # the value this object last wrote (or read back)

    def load(self, default: int = 0) -> int:
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return default
        if len(raw) != _FMT.size:
            return default
        value, crc = _FMT.unpack(raw)
        if zlib.crc32(raw[:8]) != crc:
            return default
        self._saved = value
        return value

    def save(self, value: int) -> None:
        """Write `value` durably; nothing to do when it is the value already written."""
        if value == self._saved:
            return
        raw = struct.pack("<Q", value)
        raw += struct.pack("<I", zlib.crc32(raw))
        self._saved = None          # a failed write leaves the file unknown: written next time
        write_atomic(self.path, raw)
        self._saved = value


def write_atomic(path: str, data: bytes) -> None:
    """Replace the file `path` by `data`: a crash leaves the old or the new content, never a mix
    (temp file, fsync, rename, fsync of the directory)."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
