"""`$SYS/broker/...`: the broker's own state as retained MQTT messages, in Mosquitto's naming.

Dashboards and tools written for Mosquitto (MQTT Explorer, mosquitto_sub -t '$SYS/#', Telegraf's
mqtt_consumer recipes) read these topics; lmqtt publishes the same names so they work unchanged.
Every `interval` seconds (`sys_interval`, default 10, 0 = off) the values that changed since the
last round are published retained at QoS 0 through the ordinary publish path, so they are stored
like any retained message and a new subscriber gets the latest at once. Wildcard subscriptions
starting with `+` or `#` do not match `$SYS` (MQTT 5 §4.7.2): a client asks for them explicitly.

Published (a subset of Mosquitto's list; values are plain decimal text as Mosquitto sends them):
  version, uptime ("N seconds"),
  clients/connected, clients/disconnected (persistent sessions offline), clients/total,
  clients/maximum (highest connected count since start),
  messages/received, messages/sent, publish/messages/received, publish/messages/sent,
  publish/messages/dropped, bytes/received, bytes/sent,
  subscriptions/count, retained messages/count,
  load/{messages,publish/received,publish/sent,bytes,connections}/{received,sent}/{1min,5min,15min}
  as Mosquitto computes them: exponentially damped per-minute rates.

The numbers come from a `stats()` callable (the gateway's metrics and registries), so this
module knows nothing of connections or the store. In a fleet each `lmqtt gateway` publishes its
own figures under `$SYS/broker/gateways/<gateway id>/...` (one broker's `clients/connected` would
otherwise be overwritten by every gateway in turn).
"""
from __future__ import annotations

import math
import time
from typing import Callable

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
