"""What the session machine sends: a message pulled for delivery (`OutboundMessage`), a message in
flight (`InFlight`, the one shape every outbound QoS 1/2 message has until its ack), and why a
message was not sent to a client (`EXPIRED`, `TOO_LARGE`).

Why `InFlight` is a tuple: a reconnecting session's backlog or a `#` subscribe's retained messages
put thousands of messages in flight in one run; one tuple each (built by `tuple.__new__`, no
`__init__` call) holding what was pulled - an `OutboundMessage`, or the store's record itself
(topic, body, store time read by name) with its decoded props - costs a third of an object with
slots plus the `OutboundMessage` and PUBLISH template it used to need. The `OutboundMessage` is
made only when one is needed: a resend with DUP after a reconnect.
"""
from __future__ import annotations

from operator import itemgetter
from typing import TYPE_CHECKING, Any

from lmqtt.gateway.mqtt import PublishTemplate

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.storage.record_props import RecordMeta

# why a per-subscriber PUBLISH was not sent (`MqttSession.publish_bytes` returns one of these instead of bytes)
EXPIRED = 1        # its Message Expiry Interval has passed (MQTT 5 §3.3.2.3.3)
TOO_LARGE = 2      # larger than the client's Maximum Packet Size (§3.1.2.11.4: dropped for that client)

# A run of PUBLISHes (a reader's backlog, retained messages on SUBSCRIBE) goes to the socket in
# growing chunks: the client starts reading the first messages while the rest are looked at and
# encoded (on 2 cores, 1,000 messages written as one block at the end took the sum of both sides'
# time, not the larger one). The first chunk is small so the client starts early; each next one
# twice as large, as a socket write costs ~100 us here (the peer's wake-up on loopback).
RUN_FLUSH_FIRST = 64
RUN_FLUSH_MAX = 512


class OutboundMessage(PublishTemplate):
    """One message pulled from the store for delivery, shared by every session that receives it
    (not to be confused with the store's own `StoredMessage` record it is built from).

    It is the codec's `PublishTemplate` (each PUBLISH variant encoded once, only the packet id per
    subscriber) plus where the message came from: its queue offset, CommitLog offset, the queues it
    was dispatched to, and `record` - the decoded record properties (QoS, retain, publisher's client
    id, MQTT 5 properties). MQTT 5 properties are encoded from `record` only when a v5 subscriber
    receives the message.
    """

    __slots__ = ("record", "queue_offset", "phys_offset", "dispatch_queues", "store_ts", "sent")

    def __init__(self, topic: str, payload: bytes, record: "RecordMeta", queue_offset: int | None = None,
                 phys_offset: int = -1, dispatch_queues: tuple[str, ...] = (), store_ts: int = 0) -> None:
        # PublishTemplate.__init__ is not called: this runs once per message pulled, and the
        # template's own qos/retain/version/properties are not used (QoS, retain and version are
        # given per subscriber, the properties come from `record`)
        self.topic = topic
        self.payload = payload
        self.encodings = {}
        self.record = record
        self.queue_offset = queue_offset
        self.phys_offset = phys_offset
        self.dispatch_queues = dispatch_queues
        self.store_ts = store_ts
        self.sent = False

    def at_offset(self, queue_offset: int) -> OutboundMessage:
        """This message as read at `queue_offset` of another queue it was dispatched to: the same
        record, sharing its PUBLISH encodings (they do not depend on the queue)."""
        it = OutboundMessage(self.topic, self.payload, self.record, queue_offset, self.phys_offset,
                             self.dispatch_queues, self.store_ts)
        it.encodings = self.encodings
        it.sent = self.sent
        return it

    def expiry_left(self, now_ms: float) -> int | None:
        """Seconds of Message Expiry Interval left (>= 1), 0 when expired, None when it never expires."""
        mei = self.record.message_expiry_interval
        if mei is None:
            return None
        ts = self.store_ts
        if not ts:
            return mei
        waited_ms = now_ms - ts
        if waited_ms >= mei * 1000:
            return 0
        return mei - int(waited_ms // 1000) if waited_ms > 0 else mei

    def message_properties(self):
        """The MQTT 5 properties to forward, from the record (the template keeps their encoding)."""
        rec = self.record
        return rec.to_properties() if rec.has_app_properties() else None


class RetainedMessage(tuple):
    """(topic, body, store_ts) of a retained message held in flight (`InFlight.message` reads these
    three by name, as it reads a pulled record's, when a resend needs the message)."""

    __slots__ = ()
    topic = property(itemgetter(0))
    body = property(itemgetter(1))
    store_ts = property(itemgetter(2))


WAIT_ACK = 1      # PUBACK (QoS 1) or PUBREC (QoS 2) expected
WAIT_COMP = 2     # PUBREL sent, PUBCOMP expected


class InFlight(tuple):
    """An outbound QoS 1/2 PUBLISH awaiting PUBACK, or PUBREC then PUBCOMP: the one shape of a
    message in flight, whichever path sent it (a delivery batch, a backlog run, retained messages,
    a shared group, a history, a restored session).

    `(pid, qos, retain, queue, offset, group, sub_ids, state, held, record)`: `queue`/`offset` the
    light queue and its offset it was read from (None for a retained message or a shared group's,
    whose offset the group keeps); `group` the shared group it was handed out by; `sub_ids` the
    subscription identifiers it was sent with (a resend repeats them); `state` WAIT_ACK or
    WAIT_COMP; `held` what was pulled: an `OutboundMessage`, or a record read by name (topic, body,
    store_ts: the store's `StoredMessage`, the remote store's `RemoteMessage`, a `RetainedMessage`)
    with `record` its decoded props. Made and changed only by the session machine
    (gateway/session/); a PUBREC's state change replaces the entry (`acknowledged`)."""

    __slots__ = ()

    WAIT_ACK = WAIT_ACK
    WAIT_COMP = WAIT_COMP

    pid = property(itemgetter(0))
    qos = property(itemgetter(1))
    retain = property(itemgetter(2))
    queue = property(itemgetter(3))
    offset = property(itemgetter(4))
    group = property(itemgetter(5))
    sub_ids = property(itemgetter(6))
    state = property(itemgetter(7))

    @classmethod
    def of(cls, pid: int, qos: int, retain: bool, queue: str | None, offset: int | None, group: Any,
           sub_ids: tuple[int, ...] | None, held: Any, record: "RecordMeta | None" = None,
           state: int = WAIT_ACK) -> "InFlight":
        return tuple.__new__(cls, (pid, qos, retain, queue, offset, group, sub_ids, state, held, record))

    def acknowledged(self) -> "InFlight":
        """This exchange past PUBREC: PUBREL sent, PUBCOMP awaited."""
        return tuple.__new__(InFlight, self[:7] + (WAIT_COMP,) + self[8:])

    @property
    def message(self) -> OutboundMessage:
        m = self[8]
        if isinstance(m, OutboundMessage):
            return m
        return OutboundMessage(m.topic, m.body, self[9], self[4], -1, (), m.store_ts)

    def __repr__(self) -> str:
        return (f"InFlight(pid={self[0]}, qos={self[1]}, retain={self[2]}, queue={self[3]!r}, offset={self[4]}, "
                f"group={self[5]!r}, sub_ids={self[6]}, state={self[7]})")
