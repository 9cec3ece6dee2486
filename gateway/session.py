"""MQTT session state: subscriptions, per-queue cursors, outbound QoS 1/2 in-flight window.

Why cursors and not message queues: a session owns no copy of the messages meant for it. For each
light queue it reads (one per non-shared subscription filter) it keeps `next_offset` (the next entry
to pull) and the offsets still in flight; the *committed* offset - what survives a restart through
the store's metadata - is the lowest offset not yet acknowledged, so nothing unacked is ever skipped,
and an offline persistent session costs nothing while messages pile up in the store.
"""
from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmqtt.gateway.mqtt.properties import encode_properties
from lmqtt.gateway.mqtt.wire import encode_varint as _varint
from lmqtt.gateway.record_props import RecordMeta

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.connection import MQTTConnection
    from lmqtt.gateway.shared import SharedGroup

NEVER_EXPIRES = 0xFFFFFFFF


@dataclass(slots=True)
class Subscription:
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


_U16 = struct.Struct(">H")
_TOPIC_CACHE: dict[str, bytes] = {}     # topic -> u16 length + UTF-8 (bounded, cleared when full)
_TOPIC_CACHE_MAX = 65536
_NO_PROPS = b"\x00"                     # MQTT 5 empty property block


def _topic_bytes(topic: str) -> bytes:
    tb = _TOPIC_CACHE.get(topic)
    if tb is None:
        raw = topic.encode("utf-8")
        tb = _U16.pack(len(raw)) + raw
        if len(_TOPIC_CACHE) >= _TOPIC_CACHE_MAX:
            _TOPIC_CACHE.clear()
        _TOPIC_CACHE[topic] = tb
    return tb


class Item:
    """One message pulled from the store, shared by every session that receives it.

    Encoded PUBLISH variants are cached per (QoS, retain, protocol version): a QoS 0 variant is the
    complete packet; a QoS 1/2 variant is the bytes before the packet id (fixed header, topic) and
    the bytes after it (properties, payload), so a subscriber's packet is one `join` of three parts
    with its packet id — no re-encoding of topic, properties or payload, and nothing is built for a
    variant nobody receives (pairs: one variant, one subscriber).
    """

    __slots__ = ("topic", "payload", "meta", "queue_offset", "phys_offset", "dispatch_queues",
                 "store_ts", "sent", "_tpl", "_props")

    def __init__(self, topic: str, payload: bytes, meta: RecordMeta, queue_offset: int | None = None,
                 phys_offset: int = -1, dispatch_queues: tuple[str, ...] = (), store_ts: int = 0) -> None:
        self.topic = topic
        self.payload = payload
        self.meta = meta
        self.queue_offset = queue_offset
        self.phys_offset = phys_offset
        self.dispatch_queues = dispatch_queues
        self.store_ts = store_ts
        self.sent = False
        self._tpl: dict[int, Any] = {}
        self._props = None

    def _variant(self, key: int, qos: int, retain: bool, v5: bool):
        props = b""
        if v5:
            props = _NO_PROPS
            if self.meta.has_app_properties():
                if self._props is None:
                    self._props = encode_properties(self.meta.to_properties())
                props = self._props
        tb = _topic_bytes(self.topic)
        payload = self.payload
        first = 0x30 | (qos << 1) | (0x01 if retain else 0)
        if qos:
            rl = len(tb) + 2 + len(props) + len(payload)
            t = (bytes((first,)) + _varint(rl) + tb, props + payload if props else payload)
        else:
            rl = len(tb) + len(props) + len(payload)
            t = b"".join((bytes((first,)), _varint(rl), tb, props, payload))
        self._tpl[key] = t
        return t

    def encoded(self, qos: int, retain: bool, version: int, pid: int | None = None, dup: bool = False) -> bytes:
        key = qos | (4 if retain else 0) | (8 if version == 5 else 0)
        t = self._tpl.get(key)
        if t is None:
            t = self._variant(key, qos, retain, version == 5)
        if qos == 0:
            return t
        if not 0 < pid <= 0xFFFF:
            raise ValueError(f"packet id must be 1..65535, got {pid}")
        head = t[0]
        if dup:
            head = bytes((head[0] | 0x08,)) + head[1:]
        return b"".join((head, _U16.pack(pid), t[1]))


class InFlight:
    """An outbound QoS 1/2 PUBLISH awaiting PUBACK, or PUBREC then PUBCOMP."""

    __slots__ = ("pid", "item", "qos", "retain", "state", "queue", "offset", "group")

    WAIT_ACK = 1      # PUBACK (QoS 1) or PUBREC (QoS 2) expected
    WAIT_COMP = 2     # PUBREL sent, PUBCOMP expected

    def __init__(self, pid: int, item: Item, qos: int, retain: bool, queue: str | None,
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
        self.subs: dict[str, Subscription] = {}       # by filter as sent (incl. $share prefix)
        self.direct: dict[str, Subscription] = {}     # non-shared, by queue name
        self.cursors: dict[str, Cursor] = {}          # non-shared, by queue name
        self.outbound: dict[int, InFlight] = {}       # by packet id, in send order
        self.inbound_qos2: set[int] = set()           # QoS 2 ids stored, PUBREL not yet received
        self.inbound_pending: set[int] = set()        # QoS 1/2 ids waiting for the store's ack
        self.conn: MQTTConnection | None = None
        self.receive_max = 100
        self.expiry_handle = None
        self.disconnected_at_ms: int | None = None
        self.offsets_dirty = False
        self.retained_backlog: deque[tuple[Item, int]] = deque()   # QoS 1/2 retained waiting for window
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
    def send_item(self, item: Item, qos: int, retain: bool, queue: str | None = None,
                  group: "SharedGroup | None" = None) -> int | None:
        """Encode and queue one PUBLISH; returns the packet id for QoS 1/2 (None for QoS 0)."""
        conn = self.conn
        if qos == 0:
            conn.write(item.encoded(0, retain, self.version))
            conn.metrics.msg_out[0] += 1
            return None
        pid = self.alloc_pid()
        self.outbound[pid] = InFlight(pid, item, qos, retain, queue, item.queue_offset, group)
        conn.write(item.encoded(qos, retain, self.version, pid))
        conn.metrics.msg_out[qos] += 1
        return pid

    def resend_inflight(self) -> int:
        """After a reconnect: PUBLISH again with DUP=1 (same ids), or PUBREL for those past PUBREC."""
        from lmqtt.gateway.mqtt import encode, packets as P
        conn = self.conn
        n = 0
        for inf in self.outbound.values():
            if inf.state == InFlight.WAIT_ACK:
                conn.write(inf.item.encoded(inf.qos, inf.retain, self.version, inf.pid, dup=True))
            else:
                conn.write(encode(P.PubRel(inf.pid), self.version))
            n += 1
        return n
