"""`OffsetCheckpoint`: one durable integer (a CommitLog offset) in a small file.

Written by `atomic_file.write_atomic` (temp file, fsync, rename, fsync of the directory) so a
crash or a power loss leaves either the old or the new value, never a torn one. Each dispatcher
owns one; the CommitLog keeps its flushed offset in one too. Written about once a second while
the value moves; a save of the value already on disk is skipped (an idle store did a write + two
fsyncs a second for nothing).
"""
from __future__ import annotations

import struct
import zlib

from .atomic_file import write_atomic  # noqa: F401 - also imported from here (store/ha, recovery, delayed)

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

