"""Errors raised by the store.

Every error carries a message a user can act on. They all derive from `StoreError` so callers
(the gateway, the SDK server) can catch the family and turn it into a protocol reply without
knowing the details.
"""
from __future__ import annotations

import errno


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class MessageTooLarge(StoreError):
    """The encoded record is above `StoreConfig.max_message_size`; nothing was written."""


class InvalidTopic(StoreError):
    """Topic empty, too long, not UTF-8 encodable, or containing NUL; nothing was written."""


class InvalidMessage(StoreError):
    """Another field is out of range (keys with NUL, negative queue id, ...); nothing was written."""


class DiskFull(StoreError):
    """The store refuses an append for lack of disk space; nothing of it was written.

    Raised when there is no space for a new CommitLog segment (segments are preallocated, so a full
    disk never surfaces later as SIGBUS on a memory-mapped write), while disk usage is above the
    high-water mark, and while dispatch cannot write an index for lack of space (store/disk_space.py).
    The message names the data directory and the free space. Earlier records stay readable, the
    store keeps serving reads, and appends are accepted again once space is freed (no restart).
    """


class CorruptRecord(StoreError):
    """A record failed its CRC or framing check; it is never served as data."""


class StoreClosed(StoreError):
    """The store is not started or has been shut down."""


class NotVisible(StoreError):
    """The offset is at/after the dispatched offset (not yet visible) or before the log start."""


# the OSError errnos that mean "no space left" (a full filesystem, an exhausted quota)
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(exc: BaseException) -> bool:
    """True if `exc` means "no space left": DiskFull, an OSError ENOSPC/EDQUOT, or a RocksDB error
    (rocksdict raises a plain Exception whose text carries the OS message, e.g. "IO error: No space
    left on device: While appending to file: ...")."""
    if isinstance(exc, DiskFull):
        return True
    if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
        return True
    text = str(exc)
    return "No space left on device" in text or "Disk quota exceeded" in text
