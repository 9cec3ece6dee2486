"""Shared subscriptions (`$share/{group}/{filter}`): each message to exactly one group member.

Why a group-level cursor: the group, not each member, consumes the light queue. The group keeps one
offset (persisted under consumer name `$share/{group}`), hands each pulled message to the next
member (round-robin) whose window and socket have room, and commits the offset only when the member
acks. If a member goes away with messages in flight, those go back to the group and are re-offered
to the other members first, so nothing acknowledged by the store is lost and nothing is sent to two
members unless one disconnected before acking (MQTT 5 §4.8.2 allows that redelivery).
"""
from __future__ import annotations

from collections import deque

from lmqtt.gateway.session import Cursor, OutboundMessage, MqttSession, ClientSubscription


def group_consumer(group: str, queue: str) -> str:
    """Metadata consumer name holding a group's offset in `queue`."""
    return f"$share/{group}"


class SharedGroup:
    __slots__ = ("name", "queue", "cursor", "members", "refs", "rr", "redeliver", "fleet")

    def __init__(self, name: str, queue: str, offset: int) -> None:
        self.name = name
        self.queue = queue
        self.cursor = Cursor(offset)
        self.members: list[tuple[MqttSession, ClientSubscription]] = []   # online members
        self.refs = 0                                           # sessions (online or not) holding the sub
        self.rr = 0
        # taken back from departed members (in a fleet: also what the store handed to this gateway)
        self.redeliver: deque[OutboundMessage] = deque()
        # in a fleet the store assigns each message to one gateway (gateway/fleet/group_leases.py
        # `FleetGroup`); None alone (lmqtt serve): the group reads its queue with its own cursor
        self.fleet = None

    @staticmethod
    def can_take(s: MqttSession) -> bool:
        """Whether member `s` can take a message now: online, its socket below its high-water mark
        and its window (the session machine's) not full."""
        c = s.conn
        return c is not None and not c.write_blocked and s.window_room() > 0

    @property
    def consumer(self) -> str:
        return group_consumer(self.name, self.queue)

    def add_member(self, s: MqttSession, sub: ClientSubscription) -> None:
        self.remove_member(s)
        self.members.append((s, sub))

    def remove_member(self, s: MqttSession) -> None:
        self.members = [(m, sub) for m, sub in self.members if m is not s]

    def pick(self) -> tuple[MqttSession, ClientSubscription] | None:
        """Next member (round-robin) that can take a message now, or None."""
        ms = self.members
        n = len(ms)
        for i in range(n):
            k = (self.rr + i) % n
            s, sub = ms[k]
            if self.can_take(s):
                self.rr = (k + 1) % n
                return s, sub
        return None

    def acked(self, offset: int | None) -> None:
        if offset is not None:
            self.cursor.release(offset)
            f = self.fleet
            if f is not None:
                f.acked(self, offset)

    def take_back(self, message: OutboundMessage) -> None:
        """A member left with `message` unacked: offer it to another member (keeps the offset pinned;
        in a fleet, with no member left here, the store gives it to another gateway)."""
        f = self.fleet
        if f is not None:
            f.take_back(self, message)
        else:
            self.redeliver.append(message)
