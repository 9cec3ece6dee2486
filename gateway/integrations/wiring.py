"""What a gateway runs beside its broker for the systems around it (docs/integrations.md): the
events (webhook and `$events/...` records), the bridges to other brokers, the live users and ACL
rules kept current, the HTTP auth service's connections; and their counters on /metrics.

`Gateway` (gateway/app/gateway.py) makes one `Integrations` before its broker (the drop counters
are wrapped first), `attach`es the broker, `start`s it once the listeners are open and `stop`s it
before the broker shuts down. Each part is built only when configured: a plain `lmqtt serve` pays
nothing.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
from typing import Any

from lmqtt.gateway.net.connection import NO_TOPICS, MQTTConnection

log = logging.getLogger("lmqtt.gateway.integrations")


class Integrations:
    def __init__(self, gw: Any) -> None:
        self.gw = gw
        cfg = gw.cfg
        self.webhook = None
        self.events = None
        self.bridges: list = []
        self.live_feed = None
        self._memo_timer: asyncio.TimerHandle | None = None
        if cfg.webhook or cfg.events:
            from lmqtt.gateway.integrations.events import Events, count_drops  # only when configured
            sinks = []
            if cfg.webhook:
                from lmqtt.gateway.integrations.webhook import Webhook  # only when configured
                self.webhook = Webhook(cfg.webhook, int(cfg.webhook_queue), int(cfg.webhook_batch))
                sinks.append(self.webhook.put)
            node = cfg.gateway_id or f"{socket.gethostname()}:{cfg.port}"
            self.events = Events(node, sinks)
            count_drops(gw.metrics, self.events)
        self._metrics()

    def attach(self, broker: Any) -> None:
        """The broker's hooks: events, and a change of the live rules."""
        if self.events is not None:
            broker.events = self.events
            broker.subscribing.events = self.events
            broker.session_registry.on_expired = self.events.session_expired
            publisher = broker.publisher

            def append(topic: str, body: bytes) -> None:    # as a will: QoS 0, nobody waits
                publisher.submit(None, 0, None, topic, body, False, "$events", None)
            self.events.append = append
        live = self._live()
        if live is not None:
            live.changed.append(broker.acl_changed)

    def _live(self):
        auth = self.gw.auth
        if auth is None:
            return None
        return next((a for a in auth.authenticators if a.name == "live"), None)

    async def start(self) -> None:
        gw = self.gw
        live = self._live()
        if live is not None:
            from lmqtt.gateway.security.live import LiveFeed  # only when configured
            if gw.embedded is not None:
                self.live_feed = LiveFeed(live, local=gw.embedded.security)
            else:
                self.live_feed = LiveFeed(live, call=self._call, poll_s=1.0)
            await self.live_feed.start()
        if self.webhook is not None:
            self.webhook.start()
        auth = gw.auth
        if auth is not None and auth.http is not None:
            self._expire_memos(float(gw.cfg.auth_http_cache_s))
        if gw.cfg.bridge and self._runs_bridges():
            from lmqtt.gateway.integrations.bridge import Bridge  # only when configured
            for bc in gw.cfg.bridge:
                b = Bridge(bc, lambda name=bc.name: self._open_local(name))
                b.start()
                self.bridges.append(b)

    async def stop(self) -> None:
        if self._memo_timer is not None:
            self._memo_timer.cancel()
        for b in self.bridges:
            await b.stop()
        if self.live_feed is not None:
            self.live_feed.close()
        if self.webhook is not None:
            await self.webhook.close()
        auth = self.gw.auth
        if auth is not None and auth.http is not None:
            await auth.http.close()

    # ------------------------------------------------------------------------------ helpers
    def _runs_bridges(self) -> bool:
        """`serve --workers N` starts every worker with the same configuration: only the first
        (gateway id `HOST:PORT:w0`, gateway/app/workers.py) runs the bridges, else N copies of
        each bridge would take its client ids over from each other on both brokers."""
        m = re.search(r":w(\d+)$", self.gw.cfg.gateway_id or "")
        return m is None or m.group(1) == "0"

    def _expire_memos(self, ttl: float) -> None:
        """The HTTP service's publish decisions that connections remember (`acl_publish_ok`) are
        dropped every `ttl` seconds, so one is used at most twice its TTL (gateway/security/acl_chain.py)."""
        loop = asyncio.get_running_loop()
        ttl = max(1.0, ttl)

        def tick() -> None:
            broker = self.gw.broker
            if broker is not None:
                for c in broker.connections:
                    c.acl_publish_ok = NO_TOPICS
            self._memo_timer = loop.call_later(ttl, tick)
        self._memo_timer = loop.call_later(ttl, tick)

    async def _call(self, name: str, **args) -> dict:
        """A CALL of a fleet gateway's store (the live rules' version and document)."""
        link = self.gw.link
        if link is None or not link.connected:
            raise ConnectionError("the store is not connected")
        _op, _flags, body = await asyncio.wait_for(link.cmd(name, **args), 10.0)
        return json.loads(body)

    def _open_local(self, name: str) -> socket.socket:
        """A socket whose other end the broker serves as the internal client of bridge `name`."""
        from lmqtt.gateway.security.auth import Identity  # only when configured
        broker = self.gw.broker
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        ident = Identity(None, f"lmqtt-bridge-{name}", "bridge", None, True)

        def conn() -> MQTTConnection:
            c = MQTTConnection(broker)
            c.internal = ident
            return c
        loop = asyncio.get_running_loop()
        loop.create_task(loop.connect_accepted_socket(conn, sock=ours))
        return theirs

    def _metrics(self) -> None:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # only with the metrics port open
        me = self

        class _Collector:
            def collect(self):
                auth = me.gw.auth
                http = auth.http if auth is not None else None
                if http is not None:
                    c = CounterMetricFamily("lmqtt_auth_http_requests", "Requests to the HTTP auth service by "
                                            "kind (auth, acl) and outcome (allow, deny, ignore, unavailable, "
                                            "http_4xx, http_5xx)", labels=["kind", "outcome"])
                    for (kind, outcome), n in sorted(http.counts.items()):
                        c.add_metric([kind, outcome], n)
                    yield c
                wh = me.webhook
                if wh is not None:
                    for name, doc, v in (("lmqtt_webhook_events_sent", "Events the webhook acknowledged", wh.sent),
                                         ("lmqtt_webhook_events_dropped", "Events dropped: the queue was full "
                                          "(or left at shutdown)", wh.dropped),
                                         ("lmqtt_webhook_events_refused", "Events in batches the webhook "
                                          "refused with a 4xx", wh.refused),
                                         ("lmqtt_webhook_failures", "Failed webhook POSTs (retried)", wh.failures)):
                        yield CounterMetricFamily(name, doc, value=v)
                    yield GaugeMetricFamily("lmqtt_webhook_queue", "Events waiting for the webhook", value=len(wh.queue))
                if me.events is not None:
                    yield CounterMetricFamily("lmqtt_events", "Client, session and message events emitted",
                                              value=me.events.emitted)
                if me.bridges:
                    up = GaugeMetricFamily("lmqtt_bridge_connected", "1 while the bridge's remote broker is "
                                           "connected", labels=["bridge"])
                    pend = GaugeMetricFamily("lmqtt_bridge_pending", "Messages on their way out, awaiting the "
                                             "remote's acknowledgement", labels=["bridge"])
                    msgs = CounterMetricFamily("lmqtt_bridge_messages", "Messages bridged, by direction",
                                               labels=["bridge", "direction"])
                    drop = CounterMetricFamily("lmqtt_bridge_dropped", "QoS 0 messages not sent: the remote "
                                               "was away", labels=["bridge"])
                    for b in me.bridges:
                        st = b.state()
                        up.add_metric([b.name], 1 if st["remote_connected"] else 0)
                        pend.add_metric([b.name], st["pending"])
                        msgs.add_metric([b.name, "out"], st["sent_out"])
                        msgs.add_metric([b.name, "in"], st["received_in"])
                        drop.add_metric([b.name], st["dropped_qos0"])
                    yield from (up, pend, msgs, drop)
                live = me._live()
                if live is not None:
                    yield GaugeMetricFamily("lmqtt_live_security_version", "Version of the live users and ACL "
                                            "rules in force", value=max(0, live.version))

        self.gw.metrics.registry.register(_Collector())
