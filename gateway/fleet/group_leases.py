"""Shared subscriptions across a fleet: one gateway at a time delivers a group's messages.

Why: each gateway keeps its own `SharedGroup` (gateway/model/shared_groups.py) for the members connected to it,
reading the group's light queue from the group's committed offset. Two gateways with members of
`$share/g/...` would each hand every message to one of *their* members: every message twice. The
store therefore grants a lease per (group, queue) (`gw_group_lease`, store/node/gateway_service.py):
the gateway holding it delivers, the others keep their members connected and wait. Each gateway
with online members of a group asks every `tick_s` (the holder renews, the others ask again); a
lease not renewed for `ttl_s` lapses, so when the holder dies or loses all its members another
gateway takes over from the offset the holder committed (messages it had delivered but not yet
committed are delivered again: at least once, as MQTT allows for shared subscriptions after a
member is lost). A gateway stops delivering a little before its lease could lapse at the store,
so two gateways never deliver at once even with a delayed renewal.

The cost: members on gateways without the lease get nothing while the holder has members; the
group is spread over the holder's members only. `lmqtt serve` (one gateway) never uses this.
"""
from __future__ import annotations

import logging
import time

from typing import TYPE_CHECKING

from lmqtt.gateway.model.shared_groups import SharedGroup, group_consumer

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.storage.facades import Answer, GroupLeases as LeaseStore, Lease

log = logging.getLogger("lmqtt.gateway.fleet.group_leases")


class GroupLeases:
    def __init__(self, leases: "LeaseStore", gateway_id: str, delivery, loop, ttl_s: float = 3.0,
                 tick_s: float = 1.0) -> None:
        """`leases`: the storage facade granting them (storage/facades.py `GroupLeases`)."""
        self.leases = leases
        self.gateway_id = gateway_id
        self.delivery = delivery
        self.loop = loop
        self.ttl_s = ttl_s
        self.tick_s = tick_s
        self._handle = None
        self.granted = 0            # times this gateway became a group's deliverer (/metrics)
        delivery.on_group_added = self.added
        delivery.on_group_removed = self.removed

    def start(self) -> None:
        self._handle = self.loop.call_later(self.tick_s, self._tick)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def added(self, g: SharedGroup) -> None:
        """A new group on this gateway: inactive until the store grants its lease."""
        g.active = False
        self._claim(g)

    def removed(self, g: SharedGroup) -> None:
        """The group's last member here is gone for good: hand the lease back with the offset
        reached, which the next holder starts from (this gateway may drop its stored offset)."""
        if g.active:
            self._release(g)

    def _tick(self) -> None:
        try:
            now = time.monotonic()
            for gs in list(self.delivery.groups.values()):
                for g in list(gs.values()):
                    if g.active and now > g.lease_until:
                        g.active = False              # not renewed in time: another may hold it now
                        log.info("event=group_lease_lapsed group=%s queue=%s", g.name, g.queue)
                    if g.members:
                        self._claim(g)
                    elif g.active:
                        self._release(g)
        finally:
            self._handle = self.loop.call_later(self.tick_s, self._tick)

    def _claim(self, g: SharedGroup) -> None:
        sent = time.monotonic()
        self.leases.claim(g.name, g.queue, group_consumer(g.name, g.queue), int(self.ttl_s * 1000)) \
            .add_done_callback(lambda a, g=g, sent=sent: self._answered(g, sent, a))

    def _answered(self, g: SharedGroup, sent: float, a: "Answer[Lease]") -> None:
        if a.exception() is not None:
            return                                    # the tick asks again; lease_until lapses meanwhile
        r = a.result()
        if r.owner != self.gateway_id:
            if g.active:
                log.info("event=group_lease_lost group=%s queue=%s owner=%s", g.name, g.queue, r.owner)
            g.active = False
            return
        # stop a quarter of the ttl before the store could give it away (measured from the request)
        g.lease_until = sent + self.ttl_s * 0.75
        if not g.active:
            off = r.offset
            if off is not None and not g.cursor.inflight:
                g.cursor.next_offset = max(int(off), 0)   # where the previous holder committed
            g.active = True
            self.granted += 1
            log.info("event=group_lease_granted group=%s queue=%s offset=%s", g.name, g.queue, off)
            self.delivery.on_queues({g.queue})

    def _release(self, g: SharedGroup) -> None:
        g.active = False
        self.leases.release(g.name, g.queue, g.cursor.committed())   # lost with the link: the lease lapses
