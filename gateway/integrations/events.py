"""Client, session and message events, for the user's systems: to the webhook (webhook.py) and as
records under `$events/...` in the store, so the SDK and Spark can read connectivity history
(`lmqtt consume --filter '$events'`, the Spark data source on first-level topic `$events`).

Each event is a JSON object in EMQX's webhook shape (`action`, `clientid`, `username`, ...,
`timestamp` in ms, `node` this gateway):

| action | when | more fields |
| --- | --- | --- |
| `client_connected` | CONNACK 0 sent | `ipaddress`, `proto_ver`, `keepalive`, `clean_start`, `session_present`, `connected_at` |
| `client_disconnected` | the connection closed | `reason` (`normal`, `normal_with_will`, `0x8E session taken over`, `keepalive_timeout`, `connection_lost: ...`) |
| `session_subscribed` | a filter granted in SUBACK | `topic`, `qos` |
| `session_unsubscribed` | a filter removed by UNSUBSCRIBE | `topic` |
| `session_expired` | a persistent session ended by its expiry | |
| `message_dropped` | messages not delivered (`lmqtt_dropped_messages_total`) | `reason` (`expired`, `packet_too_large`, `qos0_backpressure`, `offline_backlog`, `store_error`), `count` |

The record of an event is appended as a QoS 0 message (as a will is: nothing waits for it) to
`$events/<action>` with the JSON as its body. MQTT clients cannot publish there (PUBACK 0x87, as
`$SYS`), and `#` never matches a `$` topic; a client may subscribe to `$events/#` explicitly where
the ACL allows it.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

log = logging.getLogger("lmqtt.gateway.events")

PREFIX = "$events/"


def _now_ms() -> int:
    return int(time.time() * 1000)


class Events:
    """The broker's hooks (connected, disconnected, subscribed, unsubscribed, session_expired,
    dropped) turned into events for `sinks` (callables taking the event dict) and, with `append`
    (topic, body bytes), the store's records."""

    def __init__(self, node: str, sinks: list[Callable[[dict], None]],
                 append: Callable[[str, bytes], None] | None = None) -> None:
        self.node = node
        self.sinks = sinks
        self.append = append
        self.emitted = 0
        # CONNECT's user name by client id while connected (without authentication a connection
        # keeps no identity, yet EMQX's events name the user)
        self._users: dict[str, str | None] = {}

    def _emit(self, event: dict) -> None:
        event["timestamp"] = event.get("timestamp") or _now_ms()
        event["node"] = self.node
        self.emitted += 1
        for fn in self.sinks:
            try:
                fn(event)
            except Exception:  # noqa: BLE001 - an event must never cost the broker
                log.exception("event=event_sink_failed action=%s", event.get("action"))
        if self.append is not None:
            try:
                self.append(PREFIX + event["action"], json.dumps(event, separators=(",", ":")).encode())
            except Exception as e:  # noqa: BLE001
                log.warning("event=event_record_failed action=%s error=%r", event.get("action"), e)

    def _who(self, conn: Any) -> dict:
        ident = getattr(conn, "identity", None)
        user = ident.username if ident is not None else self._users.get(conn.client_id)
        return {"clientid": conn.client_id, "username": user}

    # ------------------------------------------------------------------ the broker's hooks
    def connected(self, conn: Any, keepalive: int, clean_start: bool, present: bool, username: str | None = None) -> None:
        self._users[conn.client_id] = username
        host = conn.peer.rpartition(":")[0].strip("[]")
        self._emit({"action": "client_connected", **self._who(conn), "ipaddress": host,
                    "proto_ver": conn.version, "keepalive": keepalive, "clean_start": bool(clean_start),
                    "session_present": bool(present), "connected_at": _now_ms()})

    def disconnected(self, conn: Any, exc: BaseException | None) -> None:
        reason = conn.left_because
        if reason is None:
            reason = f"connection_lost: {exc}" if exc is not None else "closed_by_client"
        self._emit({"action": "client_disconnected", **self._who(conn), "reason": reason})
        self._users.pop(conn.client_id, None)

    def subscribed(self, conn: Any, requests: list, codes: list) -> None:
        for req, code in zip(requests, codes):
            if code < 0x80:
                self._emit({"action": "session_subscribed", **self._who(conn), "topic": req.topic_filter,
                            "qos": code})

    def unsubscribed(self, conn: Any, filters: list, codes: list) -> None:
        for flt, code in zip(filters, codes):
            if code == 0:
                self._emit({"action": "session_unsubscribed", **self._who(conn), "topic": flt})

    def session_expired(self, client_id: str) -> None:
        self._emit({"action": "session_expired", "clientid": client_id})

    def dropped(self, reason: str, count: int) -> None:
        self._emit({"action": "message_dropped", "reason": reason, "count": count})


class DropCounter:
    """A `lmqtt_dropped_messages_total{reason}` counter child that also emits `message_dropped`: put
    in the metrics' place (`GatewayMetrics.dropped_*`) so every place that counts a drop reports it,
    with nothing added where messages are dropped."""

    __slots__ = ("child", "reason", "events")

    def __init__(self, child: Any, reason: str, events: Events) -> None:
        self.child, self.reason, self.events = child, reason, events

    def inc(self, amount: float = 1) -> None:
        self.child.inc(amount)
        if amount:
            self.events.dropped(self.reason, int(amount))


DROP_REASONS = {"dropped_qos0_backpressure": "qos0_backpressure", "dropped_store_error": "store_error",
                "dropped_expired": "expired", "dropped_too_large": "packet_too_large",
                "dropped_offline_backlog": "offline_backlog"}


def count_drops(metrics: Any, events: Events) -> None:
    for attr, reason in DROP_REASONS.items():
        child = getattr(metrics, attr, None)
        if child is not None and not isinstance(child, DropCounter):
            setattr(metrics, attr, DropCounter(child, reason, events))
