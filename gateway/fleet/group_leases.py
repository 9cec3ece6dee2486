"""Shared subscriptions across a fleet: members of `$share/g/f` on every gateway share the group's
messages, each message to one member.

Why the store assigns the messages: each gateway keeps its own `SharedGroup`
(gateway/subscriptions/shared_groups.py) for the members connected to it; two gateways reading the group's
light queue would each hand every message to one of *their* members. The store therefore hands
each message to ONE gateway (store/node/group_assign.py, POP-style): this gateway asks for as many
as its members' in-flight windows have room for (`gw_group_pop`, one request per group at a time,
parked at the store until the queue grows), hands them to its members round-robin
(`SharedGroup.pick`), and acknowledges each to the store once its member did (PUBACK, PUBCOMP, or
at once for QoS 0: `gw_group_ack`, the acks of a loop iteration in one request per group). A
member that leaves with messages in flight gives them back to the group: another member here
takes them, or, with none left that can, they go back to the store for the other gateways. Every
`tick_s` the gateway renews its lease (`gw_group_renew`); if it stops (killed, frozen, cut off for
`ttl_s`), what it held is given to the other gateways' members: the lease time bounds that
redelivery's delay.

The group's local cursor is not used to read the queue here (its in-flight offsets still say
which member holds which offset); the group's committed offset is the store's.
`lmqtt serve` (one gateway) never uses this: its groups read the queue directly.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from lmqtt.gateway.storage.record_props import MetaCache
from lmqtt.gateway.session import OutboundMessage
from lmqtt.gateway.subscriptions.shared_groups import SharedGroup

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.storage.remote_groups import RemoteGroups

log = logging.getLogger("lmqtt.gateway.fleet.group_leases")

MAX_POP = 256          # messages asked for at once (the store's limit too)
WAIT_MS = 20_000       # how long a pop waits at the store for new messages


class FleetGroup:
    """One shared group's fleet state on this gateway (`SharedGroup.fleet`)."""

    __slots__ = ("owner", "popping", "done", "back", "gone", "stuck")

    def __init__(self, owner: "FleetGroups") -> None:
        self.owner = owner
        self.popping = False         # a gw_group_pop is on its way
        self.done: list[int] = []    # offsets to acknowledge to the store
        self.back: list[int] = []    # offsets to hand back to the store
        self.gone = False            # the group's last subscription here ended
        self.stuck = False           # messages held here that no member could take at the last tick

    # called by the delivery engine (`_deliver_group`), the group (`acked`, `take_back`)
    def deliver(self, g: SharedGroup, send: Callable) -> bool:
        """Hand what this gateway holds of `g` to its members, then ask the store for more."""
        held = g.redeliver
        cursor = g.cursor
        while held:
            pick = g.pick()
            if pick is None:
                break
            it = held.popleft()
            send(g, pick[0], pick[1], it)
            off = it.queue_offset
            if not cursor.holds(off):    # QoS 0, withheld by the ACL, or dropped for the client: done
                self.done.append(off)
        if self.done:
            self.owner.flush_soon(g)
        self.ask(g)
        return False

    def acked(self, g: SharedGroup, offset: int) -> None:
        self.done.append(offset)
        self.owner.flush_soon(g)

    def take_back(self, g: SharedGroup, message: OutboundMessage) -> None:
        """A member left with `message` unacknowledged: another member here, else the store."""
        if self.gone or not g.members:
            self.back.append(message.queue_offset)
            self.owner.flush_soon(g)
        else:
            g.redeliver.append(message)

    def hand_back_held(self, g: SharedGroup) -> None:
        if g.redeliver:
            self.back.extend(m.queue_offset for m in g.redeliver)
            g.redeliver.clear()
            self.owner.flush_soon(g)

    def credit(self, g: SharedGroup) -> int:
        """Messages this gateway's members can take now, minus those it holds already."""
        n = 0
        for s, _sub in g.members:
            if g.can_take(s):
                n += s.window_room()
        return n - len(g.redeliver)

    def ask(self, g: SharedGroup) -> None:
        if self.popping or self.gone or not g.members:
            return
        n = self.credit(g)
        if n <= 0:
            return
        self.popping = True
        o = self.owner
        o.pops += 1
        o.remote.pop(g.name, g.queue, min(n, MAX_POP), g.cursor.next_offset, o.ttl_ms, WAIT_MS) \
            .add_done_callback(lambda a, g=g: self._popped(g, a))

    def _popped(self, g: SharedGroup, a) -> None:
        self.popping = False
        o = self.owner
        e = a.exception()
        if e is not None:
            log.debug("event=group_pop_failed group=%s queue=%s error=%s", g.name, g.queue, e)
            return                       # asked again at the next tick
        msgs = a.result()
        if not msgs:
            o.loop.call_later(0.05, self.ask, g)
            return
        if self.gone or g.fleet is not self or not g.members:
            self.back.extend(m.queue_offset for m in msgs)
            o.flush_soon(g)
            return
        o.received += len(msgs)
        held = g.redeliver
        for m in msgs:
            held.append(o.outbound(m))
        o.delivery.kick_queue(g.queue)


class FleetGroups:
    """Every shared group's fleet state on this gateway; its tick renews the lease."""

    def __init__(self, remote: "RemoteGroups", delivery, loop, ttl_s: float = 3.0, tick_s: float = 1.0) -> None:
        self.remote = remote
        self.delivery = delivery
        self.loop = loop
        self.ttl_ms = int(ttl_s * 1000)
        self.tick_s = tick_s
        self._handle = None
        self._dirty: set[SharedGroup] = set()
        self._flush_scheduled = False
        self._metas = MetaCache()
        self.used = False
        # counters (/metrics)
        self.pops = 0              # gw_group_pop requests sent
        self.received = 0          # messages the store handed to this gateway
        self.handed_back = 0       # messages handed back to the store (no member here could take them)
        delivery.on_group_added = self.added
        delivery.on_group_removed = self.removed

    def start(self) -> None:
        self._handle = self.loop.call_later(self.tick_s, self._tick)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def added(self, g: SharedGroup) -> None:
        g.fleet = FleetGroup(self)
        self.used = True
        self.delivery.kick_queue(g.queue)

    def removed(self, g: SharedGroup) -> None:
        """The group's last subscription here ended: what is held goes back, the store is told."""
        f = g.fleet
        if f is None:
            return
        f.gone = True
        f.hand_back_held(g)
        self._send(g, f, leave=True)

    def outbound(self, m) -> OutboundMessage:
        rec = self._metas[m.props]
        return OutboundMessage(m.topic, m.body, rec, m.queue_offset, m.phys_offset, m.dispatch_queues, m.store_ts)

    # ------------------------------------------------------------------ acks, hand-backs
    def flush_soon(self, g: SharedGroup) -> None:
        self._dirty.add(g)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        dirty, self._dirty = self._dirty, set()
        for g in dirty:
            f = g.fleet
            if f is not None and (f.done or f.back):
                self._send(g, f)

    def _send(self, g: SharedGroup, f: FleetGroup, leave: bool = False) -> None:
        done, back = f.done, f.back
        f.done, f.back = [], []
        self.handed_back += len(back)
        a = self.remote.ack(g.name, g.queue, done, back, leave, self.ttl_ms)
        a.add_done_callback(lambda a, g=g, n=len(done), b=len(back): self._acked(g, a, n, b))

    @staticmethod
    def _acked(g: SharedGroup, a, n: int, b: int) -> None:
        e = a.exception()
        if e is not None:      # the link is down: the store gives them out again when the lease lapses
            log.warning("event=group_ack_failed group=%s queue=%s acks=%d handed_back=%d error=%s",
                        g.name, g.queue, n, b, e)

    # ------------------------------------------------------------------ the tick
    def _tick(self) -> None:
        try:
            if self.used:
                self.remote.renew(self.ttl_ms)
            for gs in list(self.delivery.groups.values()):
                for g in list(gs.values()):
                    f = g.fleet
                    if f is None:
                        continue
                    if g.redeliver and g.pick() is None:
                        # held here, no member could take them for a whole tick: the others may
                        if f.stuck:
                            f.hand_back_held(g)
                            f.stuck = False
                        else:
                            f.stuck = True
                    else:
                        f.stuck = False
                    f.ask(g)
        finally:
            self._handle = self.loop.call_later(self.tick_s, self._tick)
