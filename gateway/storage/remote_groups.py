"""A fleet gateway's requests for shared groups balanced across the fleet (gw_group_pop / ack /
renew, store/node/group_assign.py): the store hands each message of a group to one gateway; this
is the gateway's end of it, used by gateway/fleet/group_leases.py. Nothing is sent while the link
is down (the fleet's tick asks again; what this gateway held is given to the others when its lease
lapses)."""
from __future__ import annotations

import uuid
from typing import Any

from lmqtt.gateway.storage.facades import Answer
from lmqtt.gateway.storage.grouped_metadata import chain
from lmqtt.gateway.storage.remote_entries import RemoteMessage
from lmqtt.gateway.storage.remote_metadata import ask, down_reason
from lmqtt.gateway.storage.topic_owners import split_part
from lmqtt.store.client.aio import ConnectionLost
from lmqtt.store.client.groups import filter_first_level
from lmqtt.store.node import protocol as P


class RemoteGroups:
    def __init__(self, link, gateway_id: str) -> None:
        self.link = link
        self.gateway_id = gateway_id
        # this process: a gateway restarted under the same id releases what its last process held
        self.incarnation = uuid.uuid4().hex[:16]

    def _down(self) -> Answer[Any] | None:
        if self.link.connected:
            return None
        return Answer.failed(ConnectionLost(down_reason(self.link)))

    def pop(self, group: str, queue: str, max_count: int, start: int | None, ttl_ms: int,
            wait_ms: int) -> Answer[list]:
        """Up to `max_count` of the group's messages for this gateway (RemoteMessages), parked at
        the store up to `wait_ms` until there are some (not bounded by the link's timeout then)."""
        req = P.GroupPop(self.gateway_id, self.incarnation, group, queue, int(max_count), start,
                         int(ttl_ms), int(wait_ms))
        return self._down() or ask(self.link, req, bounded=wait_ms <= 0).then(
            lambda r: [RemoteMessage(t, d) for t, d in zip(r.messages, r.dq)])

    def ack(self, group: str, queue: str, offsets: list[int], back: list[int], leave: bool,
            ttl_ms: int) -> Answer[Any]:
        return self._down() or ask(self.link, P.GroupAck(self.gateway_id, self.incarnation, group, queue,
                                                         offsets, back, leave, int(ttl_ms)), bounded=False)

    def renew(self, ttl_ms: int) -> Answer[Any]:
        return self._down() or ask(self.link, P.GroupRenew(self.gateway_id, self.incarnation, int(ttl_ms)),
                                   bounded=False)


class GroupedRemoteGroups:
    """`RemoteGroups` over several store groups (docs/groups.md): a shared group's messages are in
    the group owning its filter's first level, so its pops and acks go there (a filter whose first
    level is a wildcard: a shared group per group, its part); the lease of this gateway is renewed
    in every group."""

    def __init__(self, groups: list[RemoteGroups], owners) -> None:
        self.groups = groups
        self.owners = owners
        self.gateway_id = groups[0].gateway_id
        for g in groups[1:]:
            g.incarnation = groups[0].incarnation

    @property
    def incarnation(self) -> str:
        return self.groups[0].incarnation

    def _at(self, queue: str, call) -> Answer[Any]:
        """`call(RemoteGroups, the store's name of queue)` in the group holding `queue`: its first
        level's, or for a part of a filter whose first level is a wildcard its part's group
        (topic_owners.py `part_name`: each part is a shared group of its own in its group)."""
        part = split_part(queue)
        if part is not None:
            return call(self.groups[part[1]], part[0])
        first = filter_first_level(queue)
        if first is None:                  # the first group's part
            return call(self.groups[0], queue)
        at = self.owners.known(first)
        if at is not None:
            return call(self.groups[at], queue)
        return chain(self.owners.owner(first), lambda i: call(self.groups[i], queue))

    def pop(self, group: str, queue: str, max_count: int, start: int | None, ttl_ms: int,
            wait_ms: int) -> Answer[list]:
        return self._at(queue, lambda g, q: g.pop(group, q, max_count, start, ttl_ms, wait_ms))

    def ack(self, group: str, queue: str, offsets: list[int], back: list[int], leave: bool,
            ttl_ms: int) -> Answer[Any]:
        return self._at(queue, lambda g, q: g.ack(group, q, offsets, back, leave, ttl_ms))

    def renew(self, ttl_ms: int) -> Answer[Any]:
        return Answer.all_in([g.renew(ttl_ms) for g in self.groups])
