"""MQTT session state: subscriptions, per-queue cursors, outbound QoS 1/2 in-flight window.

Why cursors and not message queues: a session owns no copy of the messages meant for it. For each
light queue it reads (one per non-shared subscription filter) it keeps `next_offset` (the next entry
to pull) and the offsets still in flight; the *committed* offset - what survives a restart through
the store's metadata - is the lowest offset not yet acknowledged, so nothing unacked is ever skipped,
and an offline persistent session costs nothing while messages pile up in the store.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmqtt.gateway.mqtt import PublishTemplate, encode, packets as P
from lmqtt.gateway.mqtt.properties import encode_properties
from lmqtt.gateway.record_props import RecordMeta

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.connection import MQTTConnection
    from lmqtt.gateway.shared import SharedGroup

NEVER_EXPIRES = 0xFFFFFFFF


@dataclass(slots=True)
class ClientSubscription:
    """One subscription as the gateway uses it; `queue` is the light queue read (= inner filter)."""

    filter: str                 # as sent by the client, including a `$share/g/` prefix
    queue: str                  # light-queue name: the topic filter without the share prefix
    qos: int = 0
    group: str | None = None
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0


class Cursor:
    """Reading position of one consumer (session or shared group) in one light queue."""

    __slots__ = ("next_offset", "inflight")

    def __init__(self, offset: int) -> None:
        self.next_offset = offset
        self.inflight: dict[int, Any] = {}   # queue offset -> owner (pid or session); insertion = offset order

    def committed(self) -> int:
        """Lowest offset that is not yet acknowledged: where a restart resumes."""
        for off in self.inflight:
            return off
        return self.next_offset


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

    def __init__(self, topic: str, payload: bytes, record: RecordMeta, queue_offset: int | None = None,
                 phys_offset: int = -1, dispatch_queues: tuple[str, ...] = (), store_ts: int = 0) -> None:
        # PublishTemplate.__init__ is not called: this runs once per message pulled, and the
        # template's own qos/retain/version/properties are not used (see properties_block)
        self.topic = topic
        self.payload = payload
        self.record = record
        self.queue_offset = queue_offset
        self.phys_offset = phys_offset
        self.dispatch_queues = dispatch_queues
        self.store_ts = store_ts
        self.sent = False
        self._variants = {}
        self._props = None

    def properties_block(self) -> bytes:
        if self._props is None:
            rec = self.record
            self._props = encode_properties(rec.to_properties() if rec.has_app_properties() else None)
        return self._props


class InFlight:
    """An outbound QoS 1/2 PUBLISH awaiting PUBACK, or PUBREC then PUBCOMP."""

    __slots__ = ("pid", "item", "qos", "retain", "state", "queue", "offset", "group")

    WAIT_ACK = 1      # PUBACK (QoS 1) or PUBREC (QoS 2) expected
    WAIT_COMP = 2     # PUBREL sent, PUBCOMP expected

    def __init__(self, pid: int, item: OutboundMessage, qos: int, retain: bool, queue: str | None,
                 offset: int | None, group: "SharedGroup | None") -> None:
        self.pid = pid
        self.item = item
        self.qos = qos
        self.retain = retain
        self.state = InFlight.WAIT_ACK
        self.queue = queue
        self.offset = offset
        self.group = group


class Session:
    """State of one client id; outlives its connection when the session is persistent."""

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self.version = 4
        self.expiry_interval = 0          # seconds after disconnect; 0 = ends with the connection
        self.subs: dict[str, ClientSubscription] = {}       # by filter as sent (incl. $share prefix)
        self.direct: dict[str, ClientSubscription] = {}     # non-shared, by queue name
        self.cursors: dict[str, Cursor] = {}          # non-shared, by queue name
        self.outbound: dict[int, InFlight] = {}       # by packet id, in send order
        self.inbound_qos2: set[int] = set()           # QoS 2 ids stored, PUBREL not yet received
        self.inbound_pending: set[int] = set()        # QoS 1/2 ids waiting for the store's ack
        self.conn: MQTTConnection | None = None
        self.receive_max = 100
        self.expiry_handle = None
        self.disconnected_at_ms: int | None = None
        self.retained_backlog: deque[tuple[OutboundMessage, int]] = deque()   # QoS 1/2 retained waiting for window
        self._next_pid = 1

    @property
    def persistent(self) -> bool:
        return self.expiry_interval > 0

    @property
    def online(self) -> bool:
        return self.conn is not None

    def alloc_pid(self) -> int:
        out = self.outbound
        for _ in range(65535):
            pid = self._next_pid
            self._next_pid = pid % 65535 + 1
            if pid not in out:
                return pid
        raise RuntimeError("no free packet identifier (65535 messages in flight)")

    def window_open(self) -> bool:
        return len(self.outbound) < self.receive_max

    def can_send(self) -> bool:
        """Online, in-flight window not full and the socket not above its high-water mark."""
        c = self.conn
        return c is not None and not c.write_blocked and len(self.outbound) < self.receive_max

    # -- sending ----------------------------------------------------------------------------
    def send_item(self, item: OutboundMessage, qos: int, retain: bool, queue: str | None = None,
                  group: "SharedGroup | None" = None) -> int | None:
        """Encode and queue one PUBLISH; returns the packet id for QoS 1/2 (None for QoS 0)."""
        conn = self.conn
        if qos == 0:
            conn.write(item.encode(0, retain, self.version))
            conn.metrics.msg_out[0] += 1
            return None
        pid = self.alloc_pid()
        self.outbound[pid] = InFlight(pid, item, qos, retain, queue, item.queue_offset, group)
        conn.write(item.encode(qos, retain, self.version, pid))
        conn.metrics.msg_out[qos] += 1
        return pid

    def resend_inflight(self) -> int:
        """After a reconnect: PUBLISH again with DUP=1 (same ids), or PUBREL for those past PUBREC."""
        conn = self.conn
        n = 0
        for inf in self.outbound.values():
            if inf.state == InFlight.WAIT_ACK:
                conn.write(inf.item.encode(inf.qos, inf.retain, self.version, inf.pid, dup=True))
            else:
                conn.write(encode(P.PubRel(inf.pid), self.version))
            n += 1
        return n
