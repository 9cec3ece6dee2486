"""`MappedFile`: one fixed-size, preallocated, memory-mapped segment file.

Why preallocate: with mmap, a write into a file hole on a full disk is reported as SIGBUS, which
kills the process. `os.posix_fallocate` at creation turns a full disk into a clean `DiskFull`
here, before any record is written into the segment; a file that could not be preallocated is
removed again, so no half-allocated file is left for a later load. Every write into a map then
lands in reserved blocks: a full disk can refuse new files, never a write into an existing one.

Positions are relative to the file start; `start_offset` is the global offset of byte 0 (the file
is named by it, 20-digit zero-padded).

Why a file can be unmapped while the store runs: a long retention keeps thousands of sealed
CommitLog segments, and each mapping costs a file descriptor (Python's mmap keeps a duplicate of
the one it was made from) and a memory map. A file opened with `lazy=True` is mapped on first use
(`mm`), its own descriptor is kept only while it is written and flushed, and `release()` drops the
mapping of an idle sealed file (store/file_budget.py decides which): the map is undone when the
last reader holding it lets go, never under a reader's feet, and the next `mm` maps it again.
"""
from __future__ import annotations

import errno
import mmap
import os
import threading

from .errors import NO_SPACE_ERRNOS, DiskFull, StoreError

NAME_DIGITS = 20

# what `mm` gives for a closed file: a closed map, whose reads raise ValueError as a map closed
# under a reader does (the readers handle that: deleted by retention meanwhile)
_CLOSED = mmap.mmap(-1, 1)
_CLOSED.close()


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
    __slots__ = ("path", "start_offset", "size", "fd", "_mm", "wrote_pos", "committed_pos",
                 "flushed_pos", "closed", "used", "_map_lock")

    def __init__(self, path: str, start_offset: int, size: int, create: bool, preallocate: bool = True,
                 sync_dir: bool = True, lazy: bool = False) -> None:
        """`sync_dir=False` (with `create`): the directory entry is not fsynced here; the owner
        makes it durable before the data that needs it (MappedFileQueue.sync_dirs). `lazy` (an
        existing file): checked now, opened and mapped on first use."""
        self.path = path
        self.start_offset = start_offset
        self.size = size
        self.closed = False
        self.used = True
        self._map_lock = threading.Lock()
        self._mm: mmap.mmap | None = None
        self.fd: int | None = None
        self.wrote_pos = 0
        self.committed_pos = 0
        self.flushed_pos = 0
        if lazy and not create:
            try:
                cur = os.path.getsize(path)
            except OSError as e:
                raise StoreError(f"cannot open {path}: {e}") from None
            if cur > size:
                raise StoreError(f"{path} is {cur} bytes, larger than the configured size {size}")
            if cur == size:
                return
            # cut short (torn write test, crash during creation): filled with zeros by the open below
        if create:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except OSError as e:   # a filesystem that needs a block for the directory entry
                if e.errno in NO_SPACE_ERRNOS:
                    raise DiskFull(f"no space left to create {path}: {e.strerror}") from None
                raise _resource_error(e, f"cannot create {path}") from None
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
            fd = _open(path)
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
            self._mm = mmap.mmap(fd, size)
        except OSError as e:
            os.close(fd)
            if create:
                os.unlink(path)     # not left half-made: the next attempt creates it again
            raise _resource_error(e, f"cannot map {path}") from None
        except BaseException:
            os.close(fd)
            raise

    @property
    def mm(self) -> mmap.mmap:
        """The file's mapping (mapped again if it was released)."""
        m = self._mm
        if m is None:
            m = self._map()
        self.used = True
        return m

    @property
    def mapped(self) -> bool:
        return self._mm is not None

    def _map(self) -> mmap.mmap:
        with self._map_lock:
            m = self._mm
            if m is not None:
                return m
            if self.closed:     # destroyed (retention) or closed: what a reader's ValueError tells
                return _CLOSED
            fd = self.fd if self.fd is not None else _open(self.path)
            try:
                m = mmap.mmap(fd, self.size)
            except OSError as e:
                raise _resource_error(e, f"cannot map {self.path}") from None
            finally:
                if fd != self.fd:
                    os.close(fd)        # the map keeps a descriptor of its own
            self._mm = m
            return m

    def release(self) -> bool:
        """Drop the mapping (and the file's own descriptor) of a file nothing writes any more;
        False when there was none. The next `mm` maps it again."""
        with self._map_lock:
            m, self._mm = self._mm, None
            self.close_fd()
        return m is not None

    def close_fd(self) -> None:
        """Close the file's own descriptor (a sealed, flushed file: the map does not need it)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

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
        of this file (Linux: they live in the page cache, whichever descriptor or map wrote them),
        needs no page-aligned range, and releases the GIL while the disk works (checked: a spinning
        thread keeps running during it). A file whose own descriptor was closed (sealed, or opened
        lazily) is synced through a descriptor opened for this flush and closed after it: kept, it
        would stay open beside the map for the file's whole life."""
        fd = self.fd
        if fd is not None:
            os.fdatasync(fd)
            return
        fd = _open(self.path)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with self._map_lock:
            m, self._mm = self._mm, None
            if m is not None:
                try:
                    m.close()
                except BufferError:
                    pass  # a reader still holds a view; the map is released when it is collected
            self.close_fd()

    def destroy(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __repr__(self) -> str:
        return f"MappedFile({self.path}, wrote={self.wrote_pos})"


def release_idle(files: list[MappedFile], keep: int) -> int:
    """Unmap some of `files` (sealed ones) until at most `keep` of them are mapped, the ones not
    used since the last call first, oldest first (a second chance: `used` is set by every `mm`
    and cleared here). Returns how many were released."""
    mapped = [mf for mf in files if mf.mapped]
    over = len(mapped) - max(0, keep)
    released = 0
    for mf in mapped:
        if over <= 0:
            mf.used = False
            continue
        if mf.used:
            mf.used = False
        elif mf.release():
            released += 1
            over -= 1
    return released


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR)
    except OSError as e:
        raise _resource_error(e, f"cannot open {path}") from None


def _resource_error(e: OSError, what: str) -> OSError:
    """An OSError whose text names what could not be done and the resource that ran out (EMFILE:
    the open-files limit; ENOMEM from mmap: the map count or address space), same errno."""
    why = {errno.EMFILE: "too many open files (the process's open-files limit, ulimit -n)",
           errno.ENFILE: "too many open files in the system",
           errno.ENOMEM: "out of memory maps or address space (vm.max_map_count, ulimit -v)"}.get(e.errno)
    return OSError(e.errno, f"{what}: {why or e.strerror}")


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
