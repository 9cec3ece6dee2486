"""A session's subscriptions and its reading positions in the light queues.

Why cursors and not message queues: a session owns no copy of the messages meant for it. For each
light queue it reads (one per non-shared subscription filter) it keeps `next_offset` (the next entry
to pull) and the offsets still in flight; the *committed* offset - what survives a restart through
the store's metadata - is the lowest offset not yet acknowledged, so nothing unacked is ever skipped,
and an offline persistent session costs nothing while messages pile up in the store.
"""
from __future__ import annotations

from typing import Any

_SUB_FIELDS = ("filter", "queue", "qos", "group", "no_local", "retain_as_published", "retain_handling",
               "subscription_id")


class ClientSubscription:
    """One subscription as the gateway uses it; `queue` is the light queue read (= inner filter).

    `ClientSubscription(filter, queue, qos, group, no_local, retain_as_published, retain_handling,
    subscription_id)`. A plain one (every option at its default: a device's usual subscription)
    is this class, three slots, the options read from the class (64 bytes, not 96); one with any
    option set is a `_FullSubscription`, which keeps them all. Neither is changed after it is made
    (a SUBSCRIBE again replaces it); equal when every field is."""

    __slots__ = ("filter", "queue", "qos")
    filter: str         # as sent by the client, including a `$share/g/` prefix
    queue: str          # light-queue name: the topic filter without the share prefix
    qos: int
    # the options of a plain subscription (a `_FullSubscription` has slots for them)
    group: str | None = None                # shared subscription group
    no_local = False
    retain_as_published = False
    retain_handling = 0
    subscription_id: int | None = None      # MQTT 5 Subscription Identifier, sent on each matching PUBLISH

    def __new__(cls, filter: str, queue: str, qos: int = 0, group: str | None = None, no_local: bool = False,
                retain_as_published: bool = False, retain_handling: int = 0,
                subscription_id: int | None = None) -> "ClientSubscription":
        if (group is None and not no_local and not retain_as_published and not retain_handling
                and subscription_id is None):
            o = object.__new__(ClientSubscription)
        else:
            o = object.__new__(_FullSubscription)
            o.group = group
            o.no_local = no_local
            o.retain_as_published = retain_as_published
            o.retain_handling = retain_handling
            o.subscription_id = subscription_id
        o.filter = filter
        o.queue = queue
        o.qos = qos
        return o

    def __init__(self, *args, **kwargs) -> None:
        pass       # made by __new__

    def _key(self) -> tuple:
        return tuple(getattr(self, f) for f in _SUB_FIELDS)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClientSubscription):
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]   # as the dataclass it was: compared, not hashed

    def __repr__(self) -> str:
        return "ClientSubscription(" + ", ".join(f"{f}={getattr(self, f)!r}" for f in _SUB_FIELDS) + ")"


class _FullSubscription(ClientSubscription):
    """A `ClientSubscription` with an option set (shared, no local, retain as published, retain
    handling, a subscription identifier)."""

    __slots__ = ("group", "no_local", "retain_as_published", "retain_handling", "subscription_id")


class Cursor:
    """Reading position of one consumer (a session or a shared group) in one light queue.

    `next_offset`: the next entry to read; the offsets in flight (sent, not acknowledged) with their
    owner - a packet id for a session's cursor, the member session for a shared group's - kept by
    `hold` and `release` in offset order. A session's cursors are held and released by the session
    machine only (gateway/session/); a shared group's by the group."""

    __slots__ = ("next_offset", "_inflight")

    def __init__(self, offset: int) -> None:
        self.next_offset = offset
        # made at the first `hold`: the cursor of an idle device that was never sent anything
        # keeps no empty dict (64 bytes)
        self._inflight: dict[int, Any] | None = None

    def hold(self, offset: int, owner: Any) -> None:
        """`offset` is in flight, with `owner`."""
        d = self._inflight
        if d is None:
            d = self._inflight = {}
        d[offset] = owner

    def release(self, offset: int | None) -> None:
        """`offset` is no longer in flight (acknowledged, or given up)."""
        d = self._inflight
        if d:
            d.pop(offset, None)

    def holds(self, offset: int | None) -> bool:
        """Whether `offset` is in flight."""
        d = self._inflight
        return d is not None and offset in d

    def busy(self) -> bool:
        """Whether any offset is in flight."""
        return bool(self._inflight)

    def held(self) -> dict[int, Any]:
        """A copy of the offsets in flight and their owners, in offset order (for readers: the
        console, tests)."""
        return dict(self._inflight or ())

    def committed(self) -> int:
        """Lowest offset that is not yet acknowledged: where a restart resumes."""
        d = self._inflight
        if d:
            for off in d:
                return off
        return self.next_offset
