"""Errors raised by the store.

Every error carries a message a user can act on. They all derive from `StoreError` so callers
(the gateway, the SDK server) can catch the family and turn it into a protocol reply without
knowing the details.
"""
from __future__ import annotations


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class MessageTooLarge(StoreError):
    """The encoded record is above `StoreConfig.max_message_size`; nothing was written."""


class InvalidTopic(StoreError):
    """Topic empty, too long, not UTF-8 encodable, or containing NUL; nothing was written."""


class InvalidMessage(StoreError):
    """Another field is out of range (keys with NUL, negative queue id, ...); nothing was written."""


class DiskFull(StoreError):
    """No space for a new segment, or disk usage above the high-water mark.

    Raised at segment creation (the segment is preallocated, so a full disk never surfaces later as
    SIGBUS on a memory-mapped write) or before an append while usage is above the mark. Earlier
    records stay readable and the store keeps serving reads.
    """


class CorruptRecord(StoreError):
    """A record failed its CRC or framing check; it is never served as data."""


class StoreClosed(StoreError):
    """The store is not started or has been shut down."""


class NotVisible(StoreError):
    """The offset is at/after the dispatched offset (not yet visible) or before the log start."""
