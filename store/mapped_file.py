"""`MappedFile`: one fixed-size, preallocated, memory-mapped segment file.

Why preallocate: with mmap, a write into a file hole on a full disk is reported as SIGBUS, which
kills the process. `os.posix_fallocate` at creation turns a full disk into a clean `DiskFull`
here, before any record is written into the segment; a file that could not be preallocated is
removed again, so no half-allocated file is left for a later load. Every write into a map then
lands in reserved blocks: a full disk can refuse new files, never a write into an existing one.

Positions are relative to the file start; `start_offset` is the global offset of byte 0 (the file
is named by it, 20-digit zero-padded).
"""
from __future__ import annotations

import errno
import mmap
import os

from .errors import NO_SPACE_ERRNOS, DiskFull, StoreError

NAME_DIGITS = 20


def file_name(start_offset: int) -> str:
    return f"{start_offset:0{NAME_DIGITS}d}"


def _preallocate(fd: int, offset: int, length: int, path: str) -> None:
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as e:
        if e.errno in NO_SPACE_ERRNOS:
            raise DiskFull(f"no space left to preallocate {length} bytes for {path}: {e.strerror}") from None
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # filesystem without fallocate
            os.ftruncate(fd, offset + length)
            return
        raise StoreError(f"cannot preallocate {path}: {e}") from None


class MappedFile:
    __slots__ = ("path", "start_offset", "size", "fd", "mm", "wrote_pos", "committed_pos",
                 "flushed_pos", "closed")

    def __init__(self, path: str, start_offset: int, size: int, create: bool, preallocate: bool = True,
                 sync_dir: bool = True) -> None:
        """`sync_dir=False` (with `create`): the directory entry is not fsynced here; the owner
        makes it durable before the data that needs it (MappedFileQueue.sync_dirs)."""
        self.path = path
        self.start_offset = start_offset
        self.size = size
        self.closed = False
        if create:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except OSError as e:   # a filesystem that needs a block for the directory entry
                if e.errno in NO_SPACE_ERRNOS:
                    raise DiskFull(f"no space left to create {path}: {e.strerror}") from None
                raise
            try:
                if preallocate:
                    _preallocate(fd, 0, size, path)
                else:
                    os.ftruncate(fd, size)
            except BaseException:
                os.close(fd)
                try:
                    os.unlink(path)
                except OSError:
                    pass
                raise
            if sync_dir:
                _fsync_dir(os.path.dirname(path))
        else:
            fd = os.open(path, os.O_RDWR)
            try:
                cur = os.fstat(fd).st_size
                if cur > size:
                    raise StoreError(f"{path} is {cur} bytes, larger than the configured size {size}")
                if cur < size:  # cut short (torn write test, crash during creation): fill with zeros
                    if preallocate:
                        _preallocate(fd, cur, size - cur, path)
                    else:
                        os.ftruncate(fd, size)
            except BaseException:
                os.close(fd)
                raise
        self.fd = fd
        try:
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.wrote_pos = 0
        self.committed_pos = 0
        self.flushed_pos = 0

    @property
    def end_offset(self) -> int:
        return self.start_offset + self.size

    def reserve(self, pos: int, length: int) -> None:
        """Allocate the disk blocks of [pos, pos + length) of a file created sparse
        (preallocate=False): a write into the map over a hole meets a full disk as SIGBUS, which
        kills the process; this meets it as DiskFull, before anything is written there. Blocks
        already allocated cost nothing. On a filesystem without fallocate it does nothing."""
        try:
            os.posix_fallocate(self.fd, pos, length)
        except OSError as e:
            if e.errno in NO_SPACE_ERRNOS:
                raise DiskFull(f"no space left to allocate {length} bytes of {self.path}: {e.strerror}") from None
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                return
            raise StoreError(f"cannot allocate space in {self.path}: {e}") from None

    def write(self, pos: int, data) -> None:
        """Copy `data` into the map at `pos` (one slice assignment, no syscall)."""
        self.mm[pos:pos + len(data)] = data

    def flush(self) -> None:
        """Make the mapped pages durable. fdatasync on the fd writes back the MAP_SHARED dirty pages
        of this file (Linux: they live in the page cache), needs no page-aligned range, and releases
        the GIL while the disk works (checked: a spinning thread keeps running during it)."""
        os.fdatasync(self.fd)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.mm.close()
        except BufferError:
            pass  # a reader still holds a view; the map is released when it is collected
        os.close(self.fd)

    def destroy(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __repr__(self) -> str:
        return f"MappedFile({self.path}, wrote={self.wrote_pos})"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
