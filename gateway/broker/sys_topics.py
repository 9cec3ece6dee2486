"""`$SYS/broker/...`: the broker's own state as retained MQTT messages, in Mosquitto's naming.

Dashboards and tools written for Mosquitto (MQTT Explorer, mosquitto_sub -t '$SYS/#', Telegraf's
mqtt_consumer recipes) read these topics; lmqtt publishes the same names so they work unchanged.
Every `interval` seconds (`sys_interval`, default 10, 0 = off) the values that changed since the
last round are published as retained QoS 0 messages. Wildcard subscriptions starting with `+` or
`#` do not match `$SYS` (MQTT 5 §4.7.2): a client asks for them explicitly.

Served from memory, never stored (`SysRetained`): `$SYS` state is this gateway's and ephemeral, so
it is not appended to the CommitLog (an idle broker's log does not grow: a record per changed
value every tick was 786 records after ten idle minutes) nor kept as a retained message in the
store. The gateway holds the latest value of each topic; a SUBSCRIBE to a `$SYS` filter gets the
matching ones as retained messages at once (the retained lookup answers a filter whose first level
is `$SYS` from `SysRetained`, not the store: nothing else can be published there), and each
published value goes straight to the online sessions subscribed to a matching filter (QoS 0, as a
live message: retain flag per Retain As Published). Like any QoS 0 message it is not queued for an
offline session or a socket over its write high-water mark; the next change of the value reaches it.

Published (a subset of Mosquitto's list; values are plain decimal text as Mosquitto sends them):
  version, uptime ("N seconds"),
  clients/connected, clients/disconnected (persistent sessions offline), clients/total,
  clients/maximum (highest connected count since start),
  messages/received, messages/sent, publish/messages/received, publish/messages/sent,
  publish/messages/dropped, bytes/received, bytes/sent,
  subscriptions/count, retained messages/count,
  load/{messages,publish/received,publish/sent,bytes,connections}/{received,sent}/{1min,5min,15min}
  as Mosquitto computes them: exponentially damped per-minute rates.

The numbers come from a `stats()` callable (the gateway's metrics and registries), so `SysTopics`
knows nothing of connections or the store. In a fleet each `lmqtt gateway` publishes its own
figures under `$SYS/broker/gateways/<gateway id>/...` to its own clients (a client sees the `$SYS`
of the gateway it is connected to).
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Callable, Iterator

from lmqtt.gateway.delivery.retained import is_sys_filter
from lmqtt.gateway.storage.record_props import encode_cached, safe_decode
from lmqtt.gateway.session import OutboundMessage, MqttSession
from lmqtt.gateway.storage.facades import Answer, Retained
from lmqtt.lightqueue.topics import topic_matches

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.delivery.engine import DeliveryEngine
    from lmqtt.gateway.storage.facades import RetainedStore

PREFIX = "$SYS/broker/"

# raw counters (monotonic) whose per-minute rates get load averages, with their load topic names
_LOADS = {
    "messages_received": "load/messages/received",
    "messages_sent": "load/messages/sent",
    "publish_received": "load/publish/received",
    "publish_sent": "load/publish/sent",
    "bytes_received": "load/bytes/received",
    "bytes_sent": "load/bytes/sent",
    "connects": "load/connections",
}
_WINDOWS = ((60.0, "1min"), (300.0, "5min"), (900.0, "15min"))

# raw counter or gauge name -> topic (under PREFIX)
_PLAIN = {
    "connected": "clients/connected",
    "disconnected": "clients/disconnected",
    "messages_received": "messages/received",
    "messages_sent": "messages/sent",
    "publish_received": "publish/messages/received",
    "publish_sent": "publish/messages/sent",
    "publish_dropped": "publish/messages/dropped",
    "bytes_received": "bytes/received",
    "bytes_sent": "bytes/sent",
    "subscriptions": "subscriptions/count",
    "retained": "retained messages/count",
}


class SysTopics:
    """Computes the `$SYS` values and publishes the changed ones.

    `stats()` returns a dict with (any of) the keys of `_PLAIN` and `_LOADS` plus `connects`;
    `publish(topic, payload)` publishes one retained QoS 0 message. `tick()` is called by the
    owner's timer (every `sys_interval` seconds, gateway/app/gateway.py)."""

    def __init__(self, stats: Callable[[], dict], publish: Callable[[str, bytes], None], *,
                 version: str, clock: Callable[[], float] = time.monotonic,
                 prefix: str = PREFIX) -> None:
        self.prefix = prefix
        self.stats = stats
        self.publish = publish
        self.version = version
        self.clock = clock
        self.started = clock()
        self.maximum = 0
        self._last: dict[str, str] = {}
        self._prev: dict[str, float] | None = None
        self._prev_t = self.started
        self._load: dict[tuple[str, float], float] = {}

    def values(self) -> dict[str, str]:
        """topic -> payload text of every `$SYS` topic now (also advances the load averages)."""
        now = self.clock()
        raw = self.stats()
        connected = int(raw.get("connected", 0))
        self.maximum = max(self.maximum, connected)
        out = {self.prefix + "version": f"lmqtt version {self.version}",
               self.prefix + "uptime": f"{int(now - self.started)} seconds",
               self.prefix + "clients/maximum": str(self.maximum),
               self.prefix + "clients/total": str(connected + int(raw.get("disconnected", 0)))}
        for key, topic in _PLAIN.items():
            if key in raw:
                out[self.prefix + topic] = str(int(raw[key]))
        dt = now - self._prev_t
        if self._prev is not None and dt > 0:
            for key, topic in _LOADS.items():
                if key not in raw:
                    continue
                rate = max(0.0, raw[key] - self._prev.get(key, raw[key])) / dt * 60.0   # per minute
                for window, name in _WINDOWS:
                    # Mosquitto's damping: new = rate + exp(-dt/window) * (old - rate)
                    old = self._load.get((key, window), rate)
                    val = rate + math.exp(-dt / window) * (old - rate)
                    self._load[(key, window)] = val
                    out[f"{self.prefix}{topic}/{name}"] = f"{val:.2f}"
        self._prev = {k: float(raw[k]) for k in _LOADS if k in raw}
        self._prev_t = now
        return out

    def tick(self) -> int:
        """Publish the values that changed since the last tick; returns how many were published."""
        n = 0
        for topic, text in self.values().items():
            if self._last.get(topic) != text:
                self.publish(topic, text.encode())
                self._last[topic] = text
                n += 1
        return n


# the props (record_props) of every `$SYS` message: QoS 0, retained, published by "$SYS"
_PROPS = encode_cached(0, True, "$SYS")


class SysRetained:
    """The gateway's `$SYS` values, served from memory (see the module docstring).

    `publish(topic, payload)` (SysTopics' publish callable) keeps the value and sends it to the
    online subscribers of matching filters: the direct readers of `delivery.direct` and one member
    of each shared group of `delivery.groups`, with the ACL's read rule. `over(retained)` is the
    store's retained messages with `$SYS` filters answered from here (what the SUBSCRIBE
    path sends as retained messages)."""

    def __init__(self, delivery: "DeliveryEngine", acl=None, dropped=None) -> None:
        self.values: dict[str, bytes] = {}
        self._delivery = delivery
        self._acl = acl
        self._dropped = dropped          # a counter (`.inc()`) of values not sent: socket above high water
        self._record = safe_decode(_PROPS)

    def publish(self, topic: str, payload: bytes) -> None:
        self.values[topic] = payload
        d = self._delivery
        queues = tuple(q for q in d.sys_queues if topic_matches(q, topic))
        if not queues:
            return
        it = OutboundMessage(topic, payload, self._record, dispatch_queues=queues)
        # a session on overlapping filters gets it once, through the subscription the delivery
        # engine would take: the highest QoS, then the smallest filter (DeliveryEngine._owner)
        owners: dict[MqttSession, str] = {}
        for q in queues:
            for s in d.direct.get(q, ()):
                cur = owners.get(s)
                if cur is None or (s.direct[q].qos, cur) > (s.direct[cur].qos, q):
                    owners[s] = q
        for s, q in owners.items():
            self._send(s, q, s.direct[q], it)
        for q in queues:
            for g in d.groups.get(q, {}).values():
                pick = g.pick()
                if pick is not None:
                    self._send(pick[0], q, pick[1], it, shared=True)

    def _send(self, s: MqttSession, q: str, sub, it: OutboundMessage, shared: bool = False) -> None:
        conn = s.conn
        if conn is None or (sub.no_local and s.client_id == "$SYS"):
            return
        if conn.write_blocked:
            if self._dropped is not None:
                self._dropped.inc()
            return
        if conn.read_checks is not None and q in conn.read_checks \
                and not self._acl.can_read(conn.identity, it.topic):
            return
        ids = None
        if s.version == 5:
            if shared:
                ids = (sub.subscription_id,) if sub.subscription_id else None
            else:
                ids = s.sub_ids_for(it, q)
        s.send(it, 0, sub.retain_as_published, conn.write, conn.metrics, sub_ids=ids)

    def batches(self, flt: str) -> "Answer[Iterator[list[Retained]]]":
        """The values matching `flt`, as the retained facade's `batches` answers (done)."""
        found = [(t, p, _PROPS) for t, p in self.values.items() if topic_matches(flt, t)]
        return Answer.of(iter((found,)) if found else iter(()))

    def over(self, retained: "RetainedStore") -> "_WithSys":
        return _WithSys(retained, self)


class _WithSys:
    """The store's retained messages (a `RetainedStore`, storage/facades.py), with `$SYS` filters
    answered by `SysRetained`: what the SUBSCRIBE path sends as retained messages."""

    def __init__(self, retained: "RetainedStore", sys_retained: SysRetained) -> None:
        self._retained = retained
        self._sys = sys_retained

    def set(self, topic: str, payload: bytes, props: bytes = b"") -> "Answer[None]":
        return self._retained.set(topic, payload, props)

    def matching(self, flt: str) -> "Answer[list[Retained]]":
        if is_sys_filter(flt):
            return self._sys.batches(flt).then(lambda it: [m for batch in it for m in batch])
        return self._retained.matching(flt)

    def batches(self, flt: str) -> "Answer[Iterator[list[Retained]]]":
        if is_sys_filter(flt):
            return self._sys.batches(flt)
        return self._retained.batches(flt)

    def clear_if(self, topic: str, props: bytes) -> "Answer[bool]":
        return self._retained.clear_if(topic, props)
