"""MQTT session state: subscriptions, per-queue cursors, outbound QoS 1/2 in-flight window.

Why cursors and not message queues: a session owns no copy of the messages meant for it. For each
light queue it reads (one per non-shared subscription filter) it keeps `next_offset` (the next entry
to pull) and the offsets still in flight; the *committed* offset - what survives a restart through
the store's metadata - is the lowest offset not yet acknowledged, so nothing unacked is ever skipped,
and an offline persistent session costs nothing while messages pile up in the store.
"""
from __future__ import annotations

import time
from collections import deque
from types import MappingProxyType
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from lmqtt.gateway.mqtt import (PublishTemplate, encode, encode_publish_v5_parts, message_expiry_prop,
                                packets as P, subscription_identifier_props, topic_alias_prop)
from lmqtt.gateway.model.rare import RareField, rare_defaults
from lmqtt.gateway.model.record_props import RecordMeta
from lmqtt.lightqueue import records as _records

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.net.connection import MQTTConnection
    from lmqtt.gateway.model.shared_groups import SharedGroup

NEVER_EXPIRES = _records.NEVER_EXPIRES     # one definition (the store reads it too)

# why a per-subscriber PUBLISH was not sent (Session.publish_bytes returns one of these instead of bytes)
EXPIRED = 1        # its Message Expiry Interval has passed (MQTT 5 §3.3.2.3.3)
TOO_LARGE = 2      # larger than the client's Maximum Packet Size (§3.1.2.11.4: dropped for that client)

# the topic -> alias map of a client that takes no topic aliases (most): one shared read-only
# empty mapping instead of an empty dict per session (64 bytes each)
NO_ALIASES = MappingProxyType({})
NO_IDS: frozenset = frozenset()    # the inbound QoS 2 ids of a session that has none (`inbound_qos2_ids`)


_SUB_FIELDS = ("filter", "queue", "qos", "group", "no_local", "retain_as_published", "retain_handling",
               "subscription_id")


class ClientSubscription:
    """One subscription as the gateway uses it; `queue` is the light queue read (= inner filter).

    `ClientSubscription(filter, queue, qos, group, no_local, retain_as_published, retain_handling,
    subscription_id)`. A plain one (every option at its default: a device's usual subscription)
    is this class, three slots, the options read from the class (64 bytes, not 96);
    one with any option set is a `_FullSubscription`, which keeps them all. Neither is changed
    after it is made (a SUBSCRIBE again replaces it); equal when every field is."""

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
    """Reading position of one consumer (session or shared group) in one light queue."""

    __slots__ = ("next_offset", "_inflight")

    def __init__(self, offset: int) -> None:
        self.next_offset = offset
        # made when first asked for (`inflight`): the cursor of an idle device that was never sent
        # anything keeps no empty dict (64 bytes)
        self._inflight: dict[int, Any] | None = None

    @property
    def inflight(self) -> dict[int, Any]:
        """Queue offset -> owner (pid or session) of what is in flight; insertion = offset order."""
        d = self._inflight
        if d is None:
            d = self._inflight = {}
        return d

    @inflight.setter
    def inflight(self, d: dict[int, Any]) -> None:
        self._inflight = d

    def committed(self) -> int:
        """Lowest offset that is not yet acknowledged: where a restart resumes."""
        d = self._inflight
        if d:
            for off in d:
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


class InFlight:
    """An outbound QoS 1/2 PUBLISH awaiting PUBACK, or PUBREC then PUBCOMP."""

    __slots__ = ("pid", "message", "qos", "retain", "state", "queue", "offset", "group", "sub_ids")

    WAIT_ACK = 1      # PUBACK (QoS 1) or PUBREC (QoS 2) expected
    WAIT_COMP = 2     # PUBREL sent, PUBCOMP expected

    def __init__(self, pid: int, message: OutboundMessage, qos: int, retain: bool, queue: str | None,
                 offset: int | None, group: "SharedGroup | None") -> None:
        self.pid = pid
        self.message = message
        self.qos = qos
        self.retain = retain
        self.state = InFlight.WAIT_ACK
        self.queue = queue
        self.offset = offset
        self.group = group
        self.sub_ids = None     # subscription identifiers it was sent with (a resend repeats them)


# A run of PUBLISHes (a reader's backlog, gateway/delivery/backlog_runs.py; retained messages on SUBSCRIBE,
# gateway/delivery/retained.py) goes to the socket in growing chunks: the client starts reading the first
# messages while the rest are looked at and encoded (on 2 cores, 1,000 messages written as one
# block at the end took the sum of both sides' time, not the larger one). The first chunk is small
# so the client starts early; each next one twice as large, as a socket write costs ~100 us here
# (the peer's wake-up on loopback).
RUN_FLUSH_FIRST = 64
RUN_FLUSH_MAX = 512


class HeldInFlight(tuple):
    """A QoS 1 PUBLISH of a reader's backlog sent as part of a run (gateway/delivery/backlog_runs.py
    `BacklogRuns.feed`), awaiting PUBACK: what `InFlight` holds, in one object instead of an InFlight, an
    OutboundMessage and its PUBLISH template per message. A tuple (pid, retain, queue, offset,
    pulled message, record) built in C by `HeldInFlight.new`; the pulled message (a StoredMessage
    or the remote store's RemoteMessage: topic, body, store_ts read by name) becomes an
    OutboundMessage only when one is needed (`message`: a resend with DUP after a reconnect). Read like
    an InFlight (pid, qos, retain, state, queue, offset, group, sub_ids)."""

    __slots__ = ()

    qos = 1
    state = InFlight.WAIT_ACK       # QoS 1 only: PUBREC/PUBCOMP never apply
    group = None
    sub_ids = None
    pid = property(itemgetter(0))
    retain = property(itemgetter(1))
    queue = property(itemgetter(2))
    offset = property(itemgetter(3))
    record = property(itemgetter(5))

    @classmethod
    def of(cls, pid: int, retain: bool, queue: str, offset: int, msg, record: RecordMeta) -> "HeldInFlight":
        return tuple.__new__(cls, (pid, retain, queue, offset, msg, record))

    @property
    def message(self) -> OutboundMessage:
        m = self[4]
        return OutboundMessage(m.topic, m.body, self[5], self[3], -1, (), m.store_ts)


class _SessionRare:
    """The part of a `Session` most sessions keep at its defaults (see `Session.__slots__`)."""

    __slots__ = ("expiry_handle", "disconnected_at_ms", "dropped_expired", "dropped_too_large",
                 "saved_inflight", "inbound_keys")

    def __init__(self) -> None:
        rare_defaults(self, Session._RARE_FIELDS)


class Session:
    """State of one client id; outlives its connection when the session is persistent."""

    # no per-session __dict__ (one per connected or persisted client)
    # the state most sessions never leave at its default (an offline session's expiry, drop counts,
    # a restored record's QoS 1/2 exchanges, QoS 2 keys written ahead) is one `_SessionRare`
    # made at the first other value (`_rare`): one slot instead of six per idle device
    __slots__ = ("client_id", "version", "expiry_interval", "subs", "direct", "cursors", "outbound",
                 "_inbound_qos2", "_inbound_pending", "conn", "receive_max", "_rare",
                 "retained_backlog", "next_pid", "max_packet", "alias_max", "aliases", "custom")

    # the rare state (`_SessionRare`, made at the first value other than these defaults)
    _RARE_CLASS = _SessionRare
    expiry_handle = RareField(None)         # the timer ending an offline persistent session
    disconnected_at_ms = RareField(None)    # when an offline session's client left (ms)
    dropped_expired = RareField(0)          # messages dropped for this client: expired
    dropped_too_large = RareField(0)        # ... or larger than its Maximum Packet Size
    # the QoS 1/2 exchanges of its record not resumed yet (core/session_persistence.py): a gateway
    # over a remote store restores its sessions at start without their messages, so it keeps the
    # state as read (and writes it back unchanged) until a CONNECT resumes it with the messages
    # read ahead; None: nothing waits (`outbound`, `inbound_qos2` are the truth)
    saved_inflight = RareField(None)
    # inbound QoS 2 ids of a persistent session written ahead of their append, not stored yet:
    # id -> (topic, key, ms), the key the message carries (core/broker.py `_qos2_ahead`)
    inbound_keys = RareField(None)

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self.version = 4
        self.expiry_interval = 0          # seconds after disconnect; 0 = ends with the connection
        self.subs: dict[str, ClientSubscription] = {}       # by filter as sent (incl. $share prefix)
        # non-shared, by queue name: the `subs` dict itself while every subscription is a plain
        # one (not shared, its filter as sent = its queue: a device's usual one or few), so both
        # read the same entries (a dict less per session: 184 bytes with one subscription, issue
        # 29); its own dict from the first other one on (`split_direct`). Changed only by
        # core/subscription_registry.py, which keeps that rule.
        self.direct: dict[str, ClientSubscription] = self.subs
        self.cursors: dict[str, Cursor] = {}          # non-shared, by queue name
        self.outbound: dict[int, InFlight] = {}       # by packet id, in send order
        # QoS 2 ids stored, PUBREL not yet received / QoS 1/2 ids waiting for the store's ack:
        # created at first use (`inbound_qos2`, `inbound_pending`): a device that never publishes
        # QoS 1/2 does not pay two empty sets (432 bytes) for them
        self._inbound_qos2: set[int] | None = None
        self._inbound_pending: set[int] | None = None
        self.conn: MQTTConnection | None = None
        self.receive_max = 100
        self._rare: _SessionRare | None = None      # the `RareField`s above, once one is not at its default
        # QoS 1/2 retained messages waiting for the window: (message, qos, subscription identifiers);
        # () until one waits (`wait_retained`: an empty deque is 600 bytes, per client)
        self.retained_backlog: deque[tuple[OutboundMessage, int, tuple[int, ...] | None]] | tuple = ()
        # where the search for the next free packet id starts (`alloc_pid`; the delivery loops
        # allocate inline from it and store back the id after the last one they used)
        self.next_pid = 1
        # MQTT 5 limits the client set in CONNECT (per connection: reset by `set_client_limits`)
        self.max_packet = 0               # client's Maximum Packet Size; 0 = none
        self.alias_max = 0                # client's Topic Alias Maximum: aliases we may send
        self.aliases: dict[str, int] = NO_ALIASES  # topic -> alias sent on the current connection (alias_max > 0)
        # True when a PUBLISH to this client may need per-subscriber parts (a topic alias or a
        # subscription identifier): delivery then builds it with `publish_bytes` instead of the
        # shared template variant
        self.custom = False

    def split_direct(self) -> None:
        """`direct` as a dict of its own (a shared or prefixed subscription is coming: `subs` and
        `direct` no longer hold the same entries)."""
        if self.direct is self.subs:
            self.direct = {sub.queue: sub for sub in self.subs.values()}

    def join_direct(self) -> None:
        """`direct` back to being `subs` once every subscription is a plain one again."""
        d = self.direct
        if d is not self.subs and len(d) == len(self.subs) and all(
                sub.group is None and sub.filter == sub.queue for sub in self.subs.values()):
            self.direct = self.subs

    @property
    def inbound_qos2(self) -> set[int]:
        v = self._inbound_qos2
        if v is None:
            v = self._inbound_qos2 = set()
        return v

    @inbound_qos2.setter
    def inbound_qos2(self, v: set[int]) -> None:
        self._inbound_qos2 = v

    @property
    def inbound_qos2_ids(self) -> "set[int] | frozenset[int]":
        """The inbound QoS 2 ids awaiting PUBREL, read without creating the set (a reader such as
        the session record's writer must not give every saved session an empty set)."""
        v = self._inbound_qos2
        return NO_IDS if v is None else v

    @property
    def inbound_pending(self) -> set[int]:
        v = self._inbound_pending
        if v is None:
            v = self._inbound_pending = set()
        return v

    @inbound_pending.setter
    def inbound_pending(self, v: set[int]) -> None:
        self._inbound_pending = v

    def wait_retained(self, entry: tuple) -> deque:
        """Queue a retained message behind the QoS 1/2 window; returns the queue."""
        bl = self.retained_backlog
        if type(bl) is not deque:
            bl = self.retained_backlog = deque()
        bl.append(entry)
        return bl

    def set_client_limits(self, max_packet: int | None, alias_max: int | None, alias_cap: int) -> None:
        """CONNECT's Maximum Packet Size and Topic Alias Maximum (aliases are per connection)."""
        self.max_packet = max_packet or 0
        self.alias_max = min(alias_max or 0, alias_cap) if self.version == 5 else 0
        self.aliases = {} if self.alias_max else NO_ALIASES
        self.update_custom()

    def update_custom(self) -> None:
        self.custom = self.version == 5 and (self.alias_max > 0 or any(
            sub.subscription_id for sub in self.subs.values()))

    def sub_ids_for(self, it: OutboundMessage, q: str) -> tuple[int, ...] | None:
        """Subscription identifiers of every direct subscription of this session matching the
        message (MQTT 5 §3.3.4: all of them when overlapping subscriptions match)."""
        direct = self.direct
        sub = direct.get(q)
        ids = [sub.subscription_id] if sub is not None and sub.subscription_id else []
        own = it.record.client_id == self.client_id
        for dq in it.dispatch_queues:
            if dq != q:
                sub = direct.get(dq)
                if sub is not None and sub.subscription_id and not (own and sub.no_local):
                    ids.append(sub.subscription_id)
        return tuple(sorted(set(ids))) if ids else None

    def publish_bytes(self, message: OutboundMessage, qos: int, retain: bool, pid: int | None, dup: bool = False,
                      sub_ids=None, now_ms: float | None = None, resend: bool = False):
        """The PUBLISH for this client with everything MQTT 5 makes per-subscriber: remaining
        message expiry, subscription identifiers, topic alias; checked against the client's
        Maximum Packet Size. Returns bytes, or EXPIRED / TOO_LARGE (not sent: the caller drops it
        for this client). A `resend` (in flight before a reconnect) is not dropped for expiry:
        onward delivery had started (§3.3.2.3.3)."""
        left = message.expiry_left(time.time() * 1000.0 if now_ms is None else now_ms)
        if left == 0:
            if not resend:
                return EXPIRED
            left = 1
        if self.version != 5:
            data = message.encode(qos, retain, self.version, pid, dup)
        elif not sub_ids and not self.alias_max:
            data = (message.encode(qos, retain, 5, pid, dup) if left is None
                    else message.encode_with_expiry(qos, retain, pid, dup, left))
        else:
            extra = message.properties_body()
            if left is not None:
                extra += message_expiry_prop(left)
            if sub_ids:
                extra += subscription_identifier_props(sub_ids)
            topic = message.topic
            new_alias = False
            evicted = None
            if self.alias_max:
                aliases = self.aliases            # topic -> alias, least recently used first
                alias = aliases.pop(topic, None)
                if alias is not None:
                    aliases[topic] = alias         # now the most recently used
                    extra += topic_alias_prop(alias)
                    topic = None           # the client knows the alias: empty topic name
                else:
                    if len(aliases) < self.alias_max:
                        alias = len(aliases) + 1
                    else:
                        # all in use: the least recently used alias now names this topic; the
                        # client re-maps it on this PUBLISH (topic and alias, §3.3.2.3.4)
                        evicted = next(iter(aliases))
                        alias = aliases.pop(evicted)
                    aliases[topic] = alias
                    extra += topic_alias_prop(alias)   # topic and alias: the client records it
                    new_alias = True
            data = encode_publish_v5_parts(topic, message.payload, qos, retain, dup, pid, extra)
            if new_alias and self.max_packet and len(data) > self.max_packet:
                # not sent: the client never learnt this mapping, and still has the one it replaced
                alias = self.aliases.pop(message.topic)
                if evicted is not None:
                    self.aliases[evicted] = alias
        if self.max_packet and len(data) > self.max_packet:
            return TOO_LARGE
        return data

    def subscription_count(self) -> int:
        """len(subs), read without unfolding a parked session (`ParkedSession`)."""
        return len(self.subs)

    def __iter__(self):
        """The session as the readers of a queue: the delivery engine's `direct` (queue -> readers)
        holds a queue's one reader itself, a set from the second on (`DeliveryEngine.add_reader`:
        48 bytes less than a 1-tuple per idle device); iterating it yields it."""
        return iter((self,))

    @property
    def persistent(self) -> bool:
        return self.expiry_interval > 0

    @property
    def online(self) -> bool:
        return self.conn is not None

    def alloc_pid(self) -> int:
        out = self.outbound
        if len(out) >= 65535:
            raise RuntimeError("no free packet identifier (65535 messages in flight)")
        pid = self.next_pid
        while pid in out:
            pid = pid % 65535 + 1
        self.next_pid = pid % 65535 + 1
        return pid

    def window_open(self) -> bool:
        return len(self.outbound) < self.receive_max

    def can_send(self) -> bool:
        """Online, in-flight window not full and the socket not above its high-water mark."""
        c = self.conn
        return c is not None and not c.write_blocked and len(self.outbound) < self.receive_max

    # -- sending ----------------------------------------------------------------------------
    def send_message(self, message: OutboundMessage, qos: int, retain: bool, queue: str | None = None,
                  group: "SharedGroup | None" = None, sub_ids=None) -> int | None | bool:
        """Encode and queue one PUBLISH; returns the packet id for QoS 1/2 (None for QoS 0), or
        False when the message was dropped for this client (expired, or over its Maximum Packet
        Size; counted)."""
        conn = self.conn
        pid = self.alloc_pid() if qos else None
        data = self.publish_bytes(message, qos, retain, pid, False, sub_ids)
        if type(data) is not bytes:
            self.count_drop(data)
            return False
        if qos == 0:
            conn.write(data)
            conn.metrics.msg_out[0] += 1
            return None
        inf = self.outbound[pid] = InFlight(pid, message, qos, retain, queue, message.queue_offset, group)
        inf.sub_ids = sub_ids
        conn.write(data)
        conn.metrics.msg_out[qos] += 1
        return pid

    def hold(self, message: OutboundMessage, qos: int, retain: bool, sub_ids=None) -> int:
        """Register a QoS 1/2 `message` in flight without sending it: its packet id. For a caller that
        encodes a run of PUBLISHes in one go (gateway/delivery/retained.py) and writes them itself, counting
        them in `msg_out`; what send_message does per message, minus the encoding and the write."""
        pid = self.alloc_pid()
        inf = self.outbound[pid] = InFlight(pid, message, qos, retain, None, message.queue_offset, None)
        inf.sub_ids = sub_ids
        return pid

    def count_drop(self, why: int) -> None:
        if why == EXPIRED:
            self.dropped_expired += 1
        else:
            self.dropped_too_large += 1
        c = self.conn
        if c is not None:
            m = c.metrics
            if why == EXPIRED:
                m.dropped_expired.inc()
            else:
                m.dropped_too_large.inc()

    def resend_inflight(self) -> list[InFlight]:
        """After a reconnect: PUBLISH again with DUP=1 (same ids), or PUBREL for those past PUBREC.
        Returns the in-flight messages that no longer fit the client's Maximum Packet Size (the
        new connection may have a smaller one): the caller releases them as dropped."""
        conn = self.conn
        dropped = []
        for inf in self.outbound.values():
            if inf.state == InFlight.WAIT_ACK:
                data = self.publish_bytes(inf.message, inf.qos, inf.retain, inf.pid, True, inf.sub_ids, resend=True)
                if type(data) is not bytes:
                    self.count_drop(data)
                    dropped.append(inf)
                    continue
                conn.write(data)
            else:
                conn.write(encode(P.PubRel(inf.pid), self.version))
        for inf in dropped:
            del self.outbound[inf.pid]
        return dropped


# -- a parked client's session, folded (memory per idle connection) ----------------------
# A parked connection's session (gateway/net/connection_parking.py) keeps its subscriptions and
# reading positions, not the three tables every reader of an awake session uses: `fold` puts its
# subscriptions (a tuple) in the `subs` slot, the next offset of each cursor (a tuple) in `cursors`,
# None in `outbound` (empty: nothing in flight, or it is not folded) and in `direct` (it is `subs`;
# `()`: made again from the subscriptions), and makes the session a `ParkedSession`. A device's
# usual one plain subscription (every option at its default, its filter its queue) is its filter
# string in `subs`, its QoS in `direct`, its offset in `cursors`: made again at unfold, equal to the
# one it was (nothing holds a plain subscription but its session's tables: a shared group holds its
# members' subscriptions, which keep their objects). Reading or setting any of the four on a
# `ParkedSession` unfolds it first (`unfold`: new dicts and cursors, the class back to `Session`), so
# every reader - delivery, the registries, persistence, the console - sees what it always saw and
# the session object itself (what the registries, the delivery engine's readers and the shared
# groups hold) stays the one. The tables of a client with one subscription are ~540 bytes (two
# dicts and their key tables, the empty outbound dict, the cursor, the subscription); folded, an
# int for its QoS and one for its offset (both small: shared).
_SUBS = Session.subs            # the slots' own descriptors (ParkedSession's properties hide them)
_DIRECT = Session.direct
_CURSORS = Session.cursors
_OUTBOUND = Session.outbound


def fold(s: Session) -> bool:
    """Fold `s` (see above) if it is foldable: nothing in flight, every cursor one of a direct
    subscription without an in-flight entry, no subscription sending its history. True when
    folded (now or already)."""
    cls = s.__class__
    if cls is not Session:
        return cls is ParkedSession
    if s.outbound:
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
            _OUTBOUND.__set__(s, None)
            s.__class__ = ParkedSession
            return True
    _SUBS.__set__(s, tuple(subs.values()))
    _CURSORS.__set__(s, tuple(offs))
    _DIRECT.__set__(s, None if same else ())
    _OUTBOUND.__set__(s, None)
    s.__class__ = ParkedSession
    return True


def unfold(s: Session) -> None:
    """`s`'s tables made again from its folded form (a no-op on a `Session`)."""
    if s.__class__ is not ParkedSession:
        return
    v = _SUBS.__get__(s)
    offs = _CURSORS.__get__(s)
    how = _DIRECT.__get__(s)
    if v.__class__ is str:               # one plain subscription: its filter, QoS `how`, offset `offs`
        v, offs, how = (ClientSubscription(v, v, how),), (offs,), None
    subs = {sub.filter: sub for sub in v}
    direct = subs if how is None else {sub.queue: sub for sub in v if sub.group is None}
    s.__class__ = Session
    s.subs = subs
    s.direct = direct
    s.cursors = {q: Cursor(off) for q, off in zip(direct, offs)}
    s.outbound = {}


def _unfolding(name: str) -> Any:
    def get(self: Session) -> Any:
        unfold(self)
        return getattr(self, name)

    def set_(self: Session, value: Any) -> None:
        unfold(self)
        setattr(self, name, value)

    return property(get, set_, doc=f"`{name}`, the session unfolded first")


class ParkedSession(Session):
    """A folded `Session` (`fold`): the same slots; its tables are made again at first use."""

    __slots__ = ()

    subs = _unfolding("subs")          # type: ignore[assignment]
    direct = _unfolding("direct")      # type: ignore[assignment]
    cursors = _unfolding("cursors")    # type: ignore[assignment]
    outbound = _unfolding("outbound")  # type: ignore[assignment]

    def subscription_count(self) -> int:
        v = _SUBS.__get__(self)
        return 1 if v.__class__ is str else len(v)

    # what a shared group asks of each member before it picks one: answered folded (nothing in flight)
    def window_open(self) -> bool:
        return self.receive_max > 0

    def can_send(self) -> bool:
        c = self.conn
        return c is not None and not c.write_blocked and self.receive_max > 0
