"""A parked client's session, folded: the machine's compact form while its connection is parked.

A parked connection's session (gateway/net/connection_parking.py) keeps its subscriptions and
reading positions, not the three tables every reader of an awake session uses: `fold` puts its
subscriptions (a tuple) in the `subs` slot, the next offset of each cursor (a tuple) in `cursors`,
None in `_window` (empty: nothing in flight, or it is not folded) and in `direct` (it is `subs`;
`()`: made again from the subscriptions), and makes the session a `ParkedSession`. A device's usual
one plain subscription (every option at its default, its filter its queue) is its filter string in
`subs`, its QoS in `direct`, its offset in `cursors`: made again at unfold, equal to the one it was
(nothing holds a plain subscription but its session's tables: a shared group holds its members'
subscriptions, which keep their objects). Reading or setting any of the four on a `ParkedSession`
unfolds it first (`unfold`: new dicts and cursors, the class back to `MqttSession`), so every
reader - delivery, the registries, persistence, the console - sees what it always saw and the
session object itself (what the registries, the delivery engine's readers and the shared groups
hold) stays the one. The tables of a client with one subscription are ~540 bytes (two dicts and
their key tables, the empty window dict, the cursor, the subscription); folded, an int for its QoS
and one for its offset (both small: shared).
"""
from __future__ import annotations

from typing import Any

from lmqtt.gateway.session.machine import MqttSession
from lmqtt.gateway.session.subscriptions import ClientSubscription, Cursor

_SUBS = MqttSession.subs            # the slots' own descriptors (ParkedSession's properties hide them)
_DIRECT = MqttSession.direct
_CURSORS = MqttSession.cursors
_WINDOW = MqttSession._window


def fold(s: MqttSession) -> bool:
    """Fold `s` (see above) if it is foldable: nothing in flight, every cursor one of a direct
    subscription without an in-flight entry, no subscription sending its history. True when
    folded (now or already)."""
    cls = s.__class__
    if cls is not MqttSession:
        return cls is ParkedSession
    if s._window:
        return False
    subs, direct, cursors = s.subs, s.direct, s.cursors
    same = direct is subs
    if same:
        rd = subs
    else:
        rd = {sub.queue: sub for sub in subs.values() if sub.group is None}
        if len(rd) != len(direct) or any(direct.get(q) is not sub for q, sub in rd.items()):
            return False
    if len(cursors) != len(rd):
        return False
    offs = []
    for q in rd:
        cur = cursors.get(q)
        if cur is None or cur._inflight or cur.__class__ is not Cursor:
            return False
        offs.append(cur.next_offset)
    if len(subs) == 1 and same:
        sub = next(iter(subs.values()))
        if sub.__class__ is ClientSubscription:      # plain; `same`: its filter is its queue
            _SUBS.__set__(s, sub.filter)
            _DIRECT.__set__(s, sub.qos)
            _CURSORS.__set__(s, offs[0])
            _WINDOW.__set__(s, None)
            s.__class__ = ParkedSession
            return True
    _SUBS.__set__(s, tuple(subs.values()))
    _CURSORS.__set__(s, tuple(offs))
    _DIRECT.__set__(s, None if same else ())
    _WINDOW.__set__(s, None)
    s.__class__ = ParkedSession
    return True


def unfold(s: MqttSession) -> None:
    """`s`'s tables made again from its folded form (a no-op on an `MqttSession`)."""
    if s.__class__ is not ParkedSession:
        return
    v = _SUBS.__get__(s)
    offs = _CURSORS.__get__(s)
    how = _DIRECT.__get__(s)
    if v.__class__ is str:               # one plain subscription: its filter, QoS `how`, offset `offs`
        v, offs, how = (ClientSubscription(v, v, how),), (offs,), None
    subs = {sub.filter: sub for sub in v}
    direct = subs if how is None else {sub.queue: sub for sub in v if sub.group is None}
    s.__class__ = MqttSession
    s.subs = subs
    s.direct = direct
    s.cursors = {q: Cursor(off) for q, off in zip(direct, offs)}
    s._window = {}


def _unfolding(name: str) -> Any:
    def get(self: MqttSession) -> Any:
        unfold(self)
        return getattr(self, name)

    def set_(self: MqttSession, value: Any) -> None:
        unfold(self)
        setattr(self, name, value)

    return property(get, set_, doc=f"`{name}`, the session unfolded first")


class ParkedSession(MqttSession):
    """A folded `MqttSession` (`fold`): the same slots; its tables are made again at first use.
    What the drivers ask of every session (counts, a shared group's choice of member, whether it
    can be parked, the record writer's template case) is answered folded: nothing is in flight."""

    __slots__ = ()

    subs = _unfolding("subs")          # type: ignore[assignment]
    direct = _unfolding("direct")      # type: ignore[assignment]
    cursors = _unfolding("cursors")    # type: ignore[assignment]
    _window = _unfolding("_window")    # type: ignore[assignment]

    def subscription_count(self) -> int:
        v = _SUBS.__get__(self)
        return 1 if v.__class__ is str else len(v)

    def window_open(self) -> bool:
        return self._receive_max > 0

    def window_room(self) -> int:
        return self._receive_max

    def inflight_count(self) -> int:
        return 0

    def quiet(self) -> bool:
        return not self._in_wait

    def went_offline(self) -> list:
        self._retained_wait = ()
        return []

    def plain_snapshot_pid(self) -> int | None:
        if self._saved is None and not self._in_keys and not self._in2:
            return self.next_pid
        return None

    def change_mark(self) -> tuple[int, int]:
        return 0, self.next_pid
