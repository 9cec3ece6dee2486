"""`write_atomic`: the one way the store writes a small file it reads back after a restart.

A checkpoint, a ConsumeQueue's `.topic` (the queue's name), the store id, the timer's fired
position, the tier manifest's local copy, the HA epoch list... Four steps, each needed for the
file to survive a power loss, not only a crash of the process:

1. write the bytes to `<path>.tmp`;
2. fsync it (without it, the rename can reach the disk before the data: an empty file after a
   power loss);
3. rename it over `path` (atomic: a reader sees the old or the new file, never a torn one);
4. fsync the directory (without it, the rename itself can be lost: the old file, or none).

On an error (a full disk) the temp file is removed and the error raised; `path` keeps its old
content, and a later call writes it again.
"""
from __future__ import annotations

import os

TMP_SUFFIX = ".tmp"


def write_atomic(path: str, data: bytes) -> None:
    """Replace the file `path` by `data`: a crash or a power loss leaves the old or the new
    content, never a mix (temp file, fsync, rename, fsync of the directory)."""
    tmp = path + TMP_SUFFIX
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    sync_dir(os.path.dirname(path) or ".")


def sync_dir(directory: str) -> None:
    """fsync a directory: the entries created, renamed or removed in it are durable."""
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
