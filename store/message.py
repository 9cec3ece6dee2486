"""The value types crossing the store's API: what callers append, read back, and what dispatchers see.

`Message` is a plain class with `__slots__`; the types the store creates per record on hot paths
(`StoredMessage`, `DispatchRequest`, `AppendResult`) are immutable named tuples built with
`tuple.__new__` (no Python-level `__init__`).
"""
from __future__ import annotations

import threading
from collections import namedtuple
from concurrent.futures import Future


class Message:
    """A message to append. `props` is opaque bytes (the store never interprets it), `flags` an
    opaque u32, `keys` are indexed under `topic#key`, `dispatch_queues` is the multi-dispatch list
    of light-queue names handed to dispatchers untouched."""

    __slots__ = ("topic", "body", "queue_id", "flags", "props", "keys", "born_ts", "dispatch_queues")

    def __init__(self, topic: str, body: bytes, queue_id: int = 0, flags: int = 0, props: bytes = b"",
                 keys: tuple[str, ...] = (), born_ts: int = 0,
                 dispatch_queues: tuple[str, ...] = ()) -> None:
        self.topic = topic
        self.body = body
        self.queue_id = queue_id
        self.flags = flags
        self.props = props
        self.keys = tuple(keys)
        self.born_ts = born_ts
        self.dispatch_queues = tuple(dispatch_queues)

    def __repr__(self) -> str:
        return (f"Message(topic={self.topic!r}, body={len(self.body)}B, queue_id={self.queue_id}, "
                f"keys={self.keys!r}, dispatch_queues={self.dispatch_queues!r})")


_SM_FIELDS = ("topic", "body", "props", "queue_id", "flags", "queue_offset", "phys_offset", "size",
              "born_ts", "store_ts", "msg_id", "keys", "dispatch_queues")


class StoredMessage(namedtuple("_StoredMessageBase", _SM_FIELDS)):
    """A record read back from the CommitLog (CRC verified). Immutable.

    A named tuple (built with `tuple.__new__` by the decoder) rather than a slotted class: reading
    is on the delivery hot path, and immutability lets the light-queue cache hand one decoded
    object to every reader instead of copying it per reader (a reader that needs another
    `queue_offset` gets a new tuple via `with_queue_offset`, sharing topic/body/props). The
    positional constructor and attribute names are unchanged; attributes cannot be assigned."""

    __slots__ = ()

    def with_queue_offset(self, queue_offset: int) -> "StoredMessage":
        """This message with another `queue_offset` (payload objects shared, nothing copied)."""
        if self[5] == queue_offset:
            return self
        return tuple.__new__(StoredMessage, self[:5] + (queue_offset,) + self[6:])

    def __repr__(self) -> str:
        return (f"StoredMessage(topic={self.topic!r}, phys_offset={self.phys_offset}, size={self.size}, "
                f"queue_offset={self.queue_offset}, body={len(self.body)}B)")


_DR_FIELDS = ("phys_offset", "size", "topic", "queue_id", "queue_offset", "flags", "born_ts", "store_ts",
              "tags_code", "keys", "dispatch_queues")


class DispatchRequest(namedtuple("_DispatchRequestBase", _DR_FIELDS)):
    """One record as the dispatch stage hands it to every dispatcher (no body, no props).

    A named tuple rather than a slotted class: the dispatch stage builds one per record with
    `tuple.__new__` (no Python-level __init__), which measured about 3x cheaper; attributes are
    read by name exactly as with slots, and the positional constructor is unchanged."""

    __slots__ = ()

    def __repr__(self) -> str:
        return (f"DispatchRequest(phys_offset={self.phys_offset}, size={self.size}, topic={self.topic!r}, "
                f"queue_id={self.queue_id}, queue_offset={self.queue_offset})")


class AppendResult(namedtuple("_AppendResultBase", ("phys_offset", "size", "queue_offset", "durable", "ident"))):
    """Where one appended record landed. `durable` (a concurrent.futures.Future) resolves to the end
    offset it covers when the record is durable under the flush mode's promise; a batch shares one
    future. `msg_id` = store identity + physical offset (hex). A named tuple, built without a
    Python-level __init__ because the append path creates one per message."""

    __slots__ = ()

    @property
    def msg_id(self) -> str:
        return f"{self.ident}{self.phys_offset:016X}"

    def __repr__(self) -> str:
        return f"AppendResult(phys_offset={self.phys_offset}, size={self.size}, queue_offset={self.queue_offset})"


_SHARED_CONDITION = threading.Condition()


class ResolvedFuture(Future):
    """A `concurrent.futures.Future` born resolved, for the async modes' `durable`.

    `Future.__init__` allocates a `threading.Condition`, the largest single cost of a one-message
    append in async mode. A future that is already finished is never waited on, so it can share
    one condition (its lock is only taken briefly by result()/add_done_callback). Relies on the
    documented-by-source fields of Future (_state, _result, ...), stable since Python 3.8."""

    def __init__(self, value) -> None:  # noqa: D401 - deliberately not calling super().__init__
        self._condition = _SHARED_CONDITION
        self._state = "FINISHED"
        self._result = value
        self._exception = None
        self._waiters = []
        self._done_callbacks = []
