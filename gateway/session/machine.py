"""`MqttSession`: the MQTT session state machine of one client id, sans-IO (after h11's `_state.py`:
everything that changes a session's MQTT flow state lives in this package).

Why one machine: packet ids, the QoS 1/2 windows both ways, inbound QoS 2, topic aliases, the
client's Receive Maximum and Maximum Packet Size, message expiry at delivery and what a persistent
session saves are one set of rules (MQTT 3.1.1 §4.3-4.6, MQTT 5 §4.3-4.9); spread over the
connection, the broker, the delivery paths and persistence they could not be read, tested or
compiled as one. The machine imports no asyncio, no socket and nothing of the store: its inputs are
plain calls - packets received (`publish_received`, `puback_received`, `pubrec_received`,
`pubcomp_received`, `pubrel_received`, `resolve_alias`, `disconnect_received`), messages offered for
delivery in batches (`offer`, `offer_records`, `offer_retained`, `send`), the store's answer to an
inbound append (`publish_stored`, `publish_failed`), a new connection (`connect`, `resume`), its end
(`went_offline`, `ended`) and a record read back (`restore`) - and its outputs are return values and
what it hands to the sinks a driver passes in: frames to `write`, counts to a `Tally`, the cursor
moves and the window in its own state, the snapshot a persistent record keeps (`snapshot`).
Drivers - the connection (gateway/net/), the broker (gateway/broker/), the delivery engine, the
backlog/retained/history runs and session persistence - call it and read its answers; none of them
reads or writes its private fields (tests/architecture/test_session_machine.py).

The tests: tests/session/ (tables of state, input -> actions, new state, one or more rows per rule of
the specifications; docs/session.md maps each normative statement to its test) and a
state-machine test against a small model (tests/session/test_session_model.py).

Memory: one `MqttSession` per connected or persisted client, most of them idle: slots only, the
rarely used state out of line (`RareField`), the tables made at first use, and a parked client's
session folded into its own slots (gateway/session/parked.py).
"""
from __future__ import annotations

from collections import deque
from types import MappingProxyType
from typing import Any

from lmqtt.gateway.mqtt import ProtocolError, ReasonCode as RC
from lmqtt.gateway.session.inbound import NO_TOPIC_ALIASES, Inbound
from lmqtt.gateway.session.messages import InFlight, OutboundMessage
from lmqtt.gateway.session.outbound import Outbound
from lmqtt.gateway.session.rare import RareField, rare_defaults
from lmqtt.gateway.session.saved import Saved
from lmqtt.gateway.session.subscriptions import ClientSubscription, Cursor

NEVER_EXPIRES = 0xFFFFFFFF    # a Session Expiry Interval that never ends (MQTT 5 §3.1.2.11.2)

# the topic -> alias map of a client that takes no topic aliases (most): one shared read-only
# empty mapping instead of an empty dict per session (64 bytes each)
NO_ALIASES: Any = MappingProxyType({})


class _SessionRare:
    """The part of an `MqttSession` most sessions keep at its defaults (see `MqttSession.__slots__`)."""

    __slots__ = ("expiry_handle", "disconnected_at_ms", "dropped_expired", "dropped_too_large",
                 "_saved", "_in_keys", "_aliases_in")

    def __init__(self) -> None:
        rare_defaults(self, MqttSession._RARE_FIELDS)


class MqttSession(Outbound, Inbound, Saved):
    """State of one client id; outlives its connection when the session is persistent.

    Public (the drivers read and write them): `client_id`, `version`, `expiry_interval`, the
    subscriptions `subs` (by filter as sent) and `direct` (non-shared, by queue), the reading
    positions `cursors`, `conn` (the driver's handle of the client's current connection, None while
    offline: the machine never uses it), and the driver-kept `expiry_handle`, `disconnected_at_ms`.
    Private to the machine (underscored, and `next_pid`): the window, the inbound QoS 2 ids, the
    client's limits, the topic aliases both ways, retained messages waiting for the window."""

    # no per-session __dict__ (one per connected or persisted client); the state most sessions never
    # leave at its default is one `_SessionRare` made at the first other value (`_rare`)
    __slots__ = ("client_id", "version", "expiry_interval", "subs", "direct", "cursors", "_window",
                 "_in2", "_in_wait", "conn", "_receive_max", "_rare",
                 "_retained_wait", "next_pid", "_max_packet", "_alias_max", "_aliases", "_custom")

    _RARE_CLASS = _SessionRare
    expiry_handle = RareField(None)         # the driver's timer ending an offline persistent session
    disconnected_at_ms = RareField(None)    # when an offline session's client left (ms)
    dropped_expired = RareField(0)          # messages dropped for this client: expired
    dropped_too_large = RareField(0)        # ... or larger than its Maximum Packet Size
    # a record's exchanges kept as read, not resumed yet (`keep_saved`); None: nothing waits
    _saved = RareField(None)
    # inbound QoS 2 ids of a persistent session written ahead of their append, not stored yet:
    # id -> (topic, key, ms), the key the message carries (`write_ahead`)
    _in_keys = RareField(None)
    # MQTT 5 topic aliases the client set on its current connection (alias -> topic)
    _aliases_in = RareField(NO_TOPIC_ALIASES)

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self.version = 4
        self.expiry_interval = 0          # seconds after disconnect; 0 = ends with the connection
        self.subs: dict[str, ClientSubscription] = {}       # by filter as sent (incl. $share prefix)
        # non-shared, by queue name: the `subs` dict itself while every subscription is a plain
        # one (not shared, its filter as sent = its queue: a device's usual one or few), so both
        # read the same entries (a dict less per session: 184 bytes with one subscription); its
        # own dict from the first other one on (`split_direct`). Changed only by
        # subscriptions/subscription_registry.py, which keeps that rule.
        self.direct: dict[str, ClientSubscription] = self.subs
        self.cursors: dict[str, Cursor] = {}          # non-shared, by queue name
        self._window: dict[int, InFlight] = {}        # outbound QoS 1/2 in flight, by packet id, in send order
        # inbound QoS 2 ids stored, PUBREL not yet received / QoS 1/2 ids waiting for the store's
        # answer: made at first use: a device that never publishes QoS 1/2 does not pay two empty
        # sets (432 bytes) for them
        self._in2: set[int] | None = None
        self._in_wait: set[int] | None = None
        self.conn: Any = None
        self._receive_max = 100           # the client's Receive Maximum, capped (`connect`)
        self._rare: _SessionRare | None = None      # the `RareField`s above, once one is not at its default
        # QoS 1/2 retained messages waiting for the window: (message, qos, subscription identifiers);
        # () until one waits (an empty deque is 600 bytes, per client)
        self._retained_wait: deque[tuple[OutboundMessage, int, tuple[int, ...] | None]] | tuple = ()
        # where the search for the next free packet id starts (`_take_ids`)
        self.next_pid = 1
        # MQTT 5 limits the client set in CONNECT (per connection: reset by `connect`)
        self._max_packet = 0               # client's Maximum Packet Size; 0 = none
        self._alias_max = 0                # client's Topic Alias Maximum: aliases we may send
        self._aliases: dict[str, int] = NO_ALIASES  # topic -> alias sent on the current connection
        # True when a PUBLISH to this client may need per-subscriber parts (a topic alias or a
        # subscription identifier): delivery then builds it with `publish_bytes` instead of the
        # shared template variant
        self._custom = False

    # -- a new connection and its end ----------------------------------------------------------
    def connect(self, version: int, receive_max: int | None, max_packet: int | None, alias_max: int | None,
                alias_cap: int, inflight_cap: int) -> None:
        """A CONNECT accepted: the client's protocol `version`, and the limits it set (MQTT 5,
        None when absent): its Receive Maximum (MQTT-3.3.4-7: no more QoS 1/2 in flight to it;
        absent: 65535) capped by `inflight_cap` (the server's max_inflight), its Maximum Packet
        Size (MQTT-3.1.2-24: nothing larger is sent), its Topic Alias Maximum (MQTT-3.3.2-10:
        no alias above it; 0 for MQTT 3.1.1) capped by `alias_cap`. Topic aliases belong to a
        network connection (MQTT-3.3.2-7): both ways they start empty."""
        self.version = version
        self._receive_max = max(1, min(receive_max or 65535, inflight_cap))
        self._max_packet = max_packet or 0
        self._alias_max = min(alias_max or 0, alias_cap) if version == 5 else 0
        self._aliases = {} if self._alias_max else NO_ALIASES
        self._aliases_in = NO_TOPIC_ALIASES
        self.update_custom()

    def went_offline(self) -> list[InFlight]:
        """The client's connection is gone: the shared-group messages in flight are taken out
        (returned: each goes back to its group, MQTT 5 §4.8.2), retained messages waiting for the
        window are dropped. What else is in flight stays, for `resume`."""
        self._retained_wait = ()
        return self.take_group_inflight()

    def ended(self) -> None:
        """The session ends (clean start, expiry): nothing of it is in flight any more."""
        self._window.clear()

    def disconnect_received(self, expiry: int | None, max_expiry: int) -> bool:
        """MQTT 5 DISCONNECT with a Session Expiry Interval (None: absent): the new interval,
        capped by `max_expiry`. Setting one when CONNECT had 0 is a protocol error (MQTT-3.14.2-2).
        True when the session stops being persistent (its record is deleted)."""
        if expiry is None:
            return False
        if self.expiry_interval == 0 and expiry > 0:
            raise ProtocolError("session expiry cannot be set on DISCONNECT when CONNECT had 0", RC.PROTOCOL_ERROR)
        was = self.expiry_interval > 0
        self.expiry_interval = min(expiry, max_expiry)
        return was and self.expiry_interval == 0

    def expired(self, now_ms: int) -> bool:
        """Offline for at least its Session Expiry Interval at `now_ms` (MQTT-4.1.0-2, MQTT 5
        §3.1.2.11.2): a connected session, or one that never expires, never is."""
        left = self.disconnected_at_ms
        if self.conn is not None or left is None or self.expiry_interval == NEVER_EXPIRES:
            return False
        return now_ms - left >= self.expiry_interval * 1000

    def quiet(self) -> bool:
        """Nothing in flight either way (a connection may be parked)."""
        return not self._in_wait and not self._window

    # -- subscriptions ------------------------------------------------------------------------
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

    def update_custom(self) -> None:
        """The subscriptions or the client's limits changed: whether a PUBLISH to this client
        may need per-subscriber parts (a topic alias, a subscription identifier)."""
        self._custom = self.version == 5 and (self._alias_max > 0 or any(
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

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.client_id!r} v{self.version} expiry={self.expiry_interval}>"
