"""`MappedFileQueue`: a directory of equal-size `MappedFile`s forming one contiguous address space.

Used by the CommitLog (`segment_size` segments), the key index and the timer log. Files are
named by their 20-digit zero-padded start offset, so offset -> file is one division. The list is
replaced, never mutated in place (copy-on-write), so readers on other threads can take a snapshot
without a lock.

`defer_dir_sync`: creating a file does not fsync its directory (2-28 ms, and files are created by
the appender, on the caller's event loop: a new CommitLog segment, a new topic's ConsumeQueue);
the directories with new entries are remembered and `sync_dirs()` makes them durable - the
flusher calls it before the fdatasync (and the checkpoint) that declares their data durable, so
no entry is acknowledged as durable in a file whose directory entry could still vanish.
"""
from __future__ import annotations

import os
import threading

from .errors import NO_SPACE_ERRNOS, DiskFull, StoreError
from .mapped_file import NAME_DIGITS, MappedFile, _fsync_dir, file_name, release_idle


def _missing_dirs(path: str) -> list[str]:
    """The directories of `path` that do not exist yet (itself first, then its parents)."""
    out = []
    while path and not os.path.isdir(path):
        out.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return out


class MappedFileQueue:
    def __init__(self, directory: str, file_size: int, preallocate: bool = True,
                 defer_dir_sync: bool = False, lazy: bool = False) -> None:
        """`lazy`: files found at load are mapped on first use, and `release_idle` may unmap them
        (the CommitLog: see MappedFile)."""
        self.dir = directory
        self.lazy = lazy
        self.file_size = file_size
        self.preallocate = preallocate
        self.defer_dir_sync = defer_dir_sync
        self._unsynced: set[str] = set()     # directories with entries not fsynced yet (defer_dir_sync)
        self._created_dirs: list[str] = []   # made by load(), not yet holding a file
        self.files: list[MappedFile] = []
        self._lock = threading.Lock()  # serialises create/delete (rare)

    def load(self) -> None:
        """Open every existing file; a gap in the sequence is an error (data would be missing)."""
        if self.defer_dir_sync:     # directories created here: their entries synced with the first file's
            self._created_dirs = _missing_dirs(self.dir)
        os.makedirs(self.dir, exist_ok=True)
        names = sorted(n for n in os.listdir(self.dir) if len(n) == NAME_DIGITS and n.isdigit())
        files = []
        for n in names:
            start = int(n)
            if start % self.file_size:
                raise StoreError(f"{os.path.join(self.dir, n)}: start offset is not a multiple of the "
                                 f"file size {self.file_size} (was the segment size changed?)")
            if files and start != files[-1].start_offset + self.file_size:
                raise StoreError(f"{self.dir}: missing file between {files[-1].path} and {n}")
            files.append(MappedFile(os.path.join(self.dir, n), start, self.file_size, create=False,
                                    preallocate=self.preallocate, lazy=self.lazy))
        self.files = files

    @property
    def min_offset(self) -> int:
        f = self.files
        return f[0].start_offset if f else 0

    def last(self) -> MappedFile | None:
        f = self.files
        return f[-1] if f else None

    def find(self, offset: int) -> MappedFile | None:
        f = self.files
        if not f:
            return None
        i = (offset - f[0].start_offset) // self.file_size
        if 0 <= i < len(f):
            return f[i]
        return None

    def create(self, start_offset: int) -> MappedFile:
        """Create (preallocate) the file starting at `start_offset`; DiskFull when it does not fit
        (then no file is left behind and `files` is unchanged)."""
        with self._lock:
            f = self.files
            if f and start_offset != f[-1].end_offset:
                raise StoreError(f"{self.dir}: new file at {start_offset} does not follow {f[-1].path}")
            defer = self.defer_dir_sync
            new_dirs = _missing_dirs(self.dir) if defer else ()
            if defer and self._created_dirs:
                new_dirs, self._created_dirs = new_dirs + self._created_dirs, []
            try:
                os.makedirs(self.dir, exist_ok=True)
            except OSError as e:
                if e.errno in NO_SPACE_ERRNOS:
                    raise DiskFull(f"no space left to create the directory {self.dir}: {e.strerror}") from None
                raise
            mf = MappedFile(os.path.join(self.dir, file_name(start_offset)), start_offset, self.file_size,
                            create=True, preallocate=self.preallocate, sync_dir=not defer)
            if defer:      # the file's entry, and the entry of each directory created for it
                self._unsynced.add(self.dir)
                self._unsynced.update(os.path.dirname(d) for d in new_dirs)
            self.files = f + [mf]
            return mf

    def created_dir(self, path: str) -> None:
        """The owner created directory `path` for this queue: its entry (in its parent) is synced
        with this queue's first file's (defer_dir_sync)."""
        if self.defer_dir_sync:
            with self._lock:
                self._created_dirs.append(path)

    def sync_dirs(self) -> None:
        """fsync the directories whose new entries (files created with defer_dir_sync) are not
        durable yet; a no-op when there are none (one attribute test)."""
        if not self._unsynced:
            return
        with self._lock:
            dirs, self._unsynced = self._unsynced, set()
        for d in sorted(dirs, key=len, reverse=True):      # deepest first
            _fsync_dir(d)

    def delete_before(self, offset: int) -> int:
        """Delete files whose whole range is below `offset`, keeping at least the last one.
        Returns how many were deleted."""
        with self._lock:
            f = self.files
            n = 0
            while n < len(f) - 1 and f[n].end_offset <= offset:
                n += 1
            if not n:
                return 0
            self.files = f[n:]
        for mf in f[:n]:
            mf.destroy()
        return n

    def truncate_files_after(self, offset: int) -> None:
        """Delete whole files starting at/after `offset` (recovery of a cut log)."""
        with self._lock:
            f = self.files
            keep = [mf for mf in f if mf.start_offset < offset or mf is f[0]]
            drop = [mf for mf in f if mf not in keep]
            self.files = keep
        for mf in drop:
            mf.destroy()

    def mapped_count(self) -> int:
        return sum(1 for mf in self.files if mf.mapped)

    def release_idle(self, keep: int) -> int:
        """Unmap files (never the last two: the one written and the one before it) until at most
        `keep` are mapped (see `mapped_file.release_idle`). Returns how many were released."""
        return release_idle(self.files[:-2], keep - min(2, len(self.files)))

    def close(self) -> None:
        for mf in self.files:
            mf.close()
