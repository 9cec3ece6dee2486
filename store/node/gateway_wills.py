"""The store node's view of its fleet gateways: which connection is which gateway, and the wills of
a gateway that stays gone.

Why the store does it: a gateway holds the wills of the clients connected to it (`gw_put_will`,
stored in the light-queue `MetadataStore` under the gateway's id) and publishes one itself when its
client goes. A gateway that dies (a killed pod, a crashed process) publishes nothing, and MQTT says
its clients' wills must still go out: the only one left to publish them is the store.

Wills of a dead gateway: the store knows each gateway's connection (gw_hello). When the last
connection of gateway G closes, or when the store starts and G holds wills but is not connected,
a grace timer starts (`will_grace_s`, `lmqtt store --will-grace-s`, default 5 s: longer than a
gateway's re-dial backoff). If G is not back when it ends, the store publishes G's wills itself
into the CommitLog like any publish (every gateway delivers them); an MQTT 5 Will Delay Interval
(bounded by the session expiry, 0 for a session that ends with its connection) counts from the
loss, so a longer delay waits on. A will is published only if G still holds it at that moment: a
CONNECT of the same client id on any gateway voids it first (gw_pop_will without gateway).

A gateway cut off from the store for longer than the grace period cannot be told from a dead one:
its clients may still be connected when their wills go out. The client ids whose wills were
published while G was away are answered to G's next `gw_hello` (`hello`), and G forgets those wills
so it does not publish them a second time.

`GatewayService` (gateway_service.py) builds this and calls it from its CALL handlers and when a
connection is lost; it is given only what publishing a will needs (the metadata store, the loop,
the store's appends and topic routing), not the service. The same gateway comings and goings drive
the session sweep (session_sweep.py), told through `on_gone` / `on_back`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from lmqtt.store import Message

from lmqtt.lightqueue.errors import MetadataError
from lmqtt.lightqueue.topics import validate_topic

# logged under the store's gateway-service logger name, with the other gw_* commands' events, so
# operators filter the store's log output for them by one name
log = logging.getLogger("lmqtt.store.node.gateway_service")

# client ids remembered per absent gateway whose wills the store published (told at its gw_hello)
_MAX_PUBLISHED_WHILE_AWAY = 100_000


def _no_op(_gid: str) -> None:
    pass


class GatewayWills:
    _WILL_CHUNK = 512          # wills per append (and per loop step: a big gateway's do not stall the loop)

    def __init__(self, meta, loop, *, grace_s: float = 5.0,
                 append_batch: Callable[[list], object], append: Callable[[Message], object],
                 route: Callable[[str], tuple],
                 retained_props: Callable[[bytes, int], bytes] | None = None,
                 on_gone: Callable[[str], None] = _no_op, on_back: Callable[[str], None] = _no_op) -> None:
        """`meta`: the light-queue `MetadataStore` holding the wills; `grace_s`: how long a
        gateway's connection may stay gone before its wills are published; `append_batch` /
        `append`: the CommitLog's appends (all or none / one message), a will going in like any
        publish; `route(topic)`: a message's dispatch queues (the MQTT filters it matches);
        `retained_props(props, now_ms)`: what a retained will keeps as its props (the gateway's
        encoding: this package knows no MQTT); `on_gone(gid)` / `on_back(gid)`: the last
        connection of gateway `gid` closed / it has one again (the session sweep's)."""
        self.meta = meta
        self.loop = loop
        self.grace_s = max(0.0, float(grace_s))
        self.append_batch = append_batch
        self.append = append
        self.route = route
        self.retained_props = retained_props or (lambda props, _now_ms: props)
        self.on_gone = on_gone
        self.on_back = on_back
        self.gateway_of: dict[object, str] = {}          # StoreConnection -> gateway id
        self.connections_of: dict[str, set] = {}          # gateway id -> its connections
        self._grace: dict[str, asyncio.TimerHandle] = {}  # gateway id -> grace timer
        self._delayed: dict[str, dict[str, asyncio.TimerHandle]] = {}   # gid -> client id -> will delay
        self.published_while_away: dict[str, list[str]] = {}
        self.wills_published = 0
        self.will_publish_errors = 0
        self._closed = False

    def start(self) -> None:
        """Gateways holding wills at the store's start are not connected yet: their grace starts
        now (a gateway that died with the store, or while it was down, still gets its wills out)."""
        try:
            holders = self.meta.will_gateways()
        except Exception as e:  # noqa: BLE001 - a corrupt record must not stop the store
            log.error("event=will_scan_failed error=%r (wills of absent gateways not published)", e)
            holders = set()
        for gid in sorted(holders):
            self._arm_grace(gid)

    def is_connected(self, gid: str) -> bool:
        return bool(self.connections_of.get(gid))

    # ---------------------------------------------------------------- what the CALLs ask
    def hello(self, conn, gid: str) -> list[str]:
        """`conn` is gateway `gid` (gw_hello): the client ids whose wills were published while it
        was away, once (it forgets those wills)."""
        self.attach(conn, gid)
        return self.published_while_away.pop(gid, [])

    def take(self, gid: str) -> list:
        """Remove and return gateway `gid`'s wills (gw_take_wills: it restarted after a crash and
        handles them itself): the will delays still running for it end here."""
        for t in self._delayed.pop(gid, {}).values():
            t.cancel()
        return self.meta.take_wills(gid)

    # ---------------------------------------------------------------- gateways coming and going
    def attach(self, conn, gid: str) -> None:
        if self.gateway_of.get(conn) == gid:
            return
        old = self.gateway_of.get(conn)
        if old is not None:                      # a connection that changed its id (never in practice)
            self.detach(conn)
        self.gateway_of[conn] = gid
        self.connections_of.setdefault(gid, set()).add(conn)
        self.on_back(gid)
        t = self._grace.pop(gid, None)
        if t is not None:
            t.cancel()
            log.info("event=gateway_back gateway=%s (its wills stay with it)", gid)
        for t in self._delayed.pop(gid, {}).values():
            t.cancel()

    def detach(self, conn) -> None:
        """`conn` closed: if it was its gateway's last connection, that gateway's grace starts."""
        gid = self.gateway_of.pop(conn, None)
        if gid is None:
            return
        conns = self.connections_of.get(gid)
        if conns is not None:
            conns.discard(conn)
            if conns:
                return
            del self.connections_of[gid]
        self.on_gone(gid)
        if not self._closed:
            log.info("event=gateway_gone gateway=%s will_grace_s=%g", gid, self.grace_s)
            self._arm_grace(gid)

    def _arm_grace(self, gid: str) -> None:
        if gid in self._grace or gid in self.connections_of or self._closed:
            return
        self._grace[gid] = self.loop.call_later(self.grace_s, self._grace_over, gid)

    def _grace_over(self, gid: str) -> None:
        self._grace.pop(gid, None)
        if gid in self.connections_of:
            return
        try:
            wills = self.meta.list_wills(gid)
        except Exception as e:  # noqa: BLE001 - try again after another grace period
            log.error("event=will_list_failed gateway=%s error=%r (retrying)", gid, e)
            self._grace[gid] = self.loop.call_later(max(1.0, self.grace_s), self._grace_over, gid)
            return
        if wills:
            log.warning("event=gateway_not_back gateway=%s wills=%d (publishing them)", gid, len(wills))
        now = []
        for cid, w in wills:
            left = self._will_delay(cid, w) - self.grace_s
            if left <= 0:
                now.append(cid)
            else:
                self._delayed.setdefault(gid, {})[cid] = self.loop.call_later(left, self._publish_wills, gid, [cid])
        if now:
            self._publish_wills(gid, now)

    # ---------------------------------------------------------------- publishing
    def _will_delay(self, cid: str, w) -> float:
        """MQTT 5: the Will Delay Interval, but no longer than the session lives (a session that
        ends with its connection publishes at once, §3.1.3.2.2)."""
        if w.delay_interval <= 0:
            return 0.0
        try:
            rec = self.meta.get_session(cid, stubs=True)    # a stub: the session is in another group
        except Exception as e:  # noqa: BLE001
            log.error("event=will_session_lookup_failed client_id=%s error=%r", cid, e)
            return 0.0
        if rec is None or rec.expiry_interval <= 0:
            return 0.0
        return float(min(w.delay_interval, rec.expiry_interval))

    def _publish_wills(self, gid: str, cids: list[str]) -> None:
        """Publish the wills of `cids` that gateway `gid` still holds while it is still away: one
        append per chunk, like a gateway's publish batch; a failed append keeps them stored and
        tries again later."""
        chunk, rest = cids[:self._WILL_CHUNK], cids[self._WILL_CHUNK:]
        d = self._delayed.get(gid)
        if d is not None:
            for cid in chunk:
                d.pop(cid, None)
            if not d:
                del self._delayed[gid]
        if gid in self.connections_of or self._closed:
            return
        todo = []
        now_ms = int(time.time() * 1000)
        for cid in chunk:
            try:
                w = self.meta.get_will(cid)
                if w is None or w.gateway != gid:
                    continue               # the client connected again (anywhere) meanwhile
                validate_topic(w.topic)
            except (ValueError, MetadataError) as e:   # a bad topic or a corrupt record: reported, dropped
                log.warning("event=will_dropped client_id=%s gateway=%s error=%s", cid, gid, e)
                self._pop(cid, gid)
                continue
            todo.append((cid, w, Message(w.topic, w.payload, 0, 0, w.props, (), now_ms, self.route(w.topic))))
        if todo:
            try:
                self.append_batch([m for _c, _w, m in todo])
                done = todo
            except Exception as e:  # noqa: BLE001 - all or none: one by one, so one bad will fails alone
                log.warning("event=will_batch_append_failed gateway=%s count=%d error=%r; one by one", gid, len(todo), e)
                done = []
                for cid, w, m in todo:
                    try:
                        self.append(m)
                        done.append((cid, w, m))
                    except Exception as e1:  # noqa: BLE001 - kept: tried again later
                        self.will_publish_errors += 1
                        log.error("event=will_publish_failed client_id=%s gateway=%s error=%r (kept, retrying)",
                                  cid, gid, e1)
                        self._delayed.setdefault(gid, {})[cid] = self.loop.call_later(
                            max(1.0, self.grace_s), self._publish_wills, gid, [cid])
            away = self.published_while_away.setdefault(gid, [])
            for cid, w, _m in done:
                if w.retain:
                    try:
                        self.meta.set_retained(w.topic, w.payload, self.retained_props(w.props, now_ms))
                    except Exception as e:  # noqa: BLE001 - the message itself went out
                        log.error("event=will_retain_failed client_id=%s topic=%s error=%r", cid, w.topic, e)
                self._pop(cid, gid)
                self.wills_published += 1
                if len(away) < _MAX_PUBLISHED_WHILE_AWAY:
                    away.append(cid)
                log.info("event=will_published_for_gateway client_id=%s gateway=%s topic=%s", cid, gid, w.topic)
        if rest:
            self.loop.call_soon(self._publish_wills, gid, rest)

    def _pop(self, cid: str, gid: str) -> None:
        try:
            self.meta.pop_will(cid, gateway=gid)
        except Exception as e:  # noqa: BLE001 - it stays stored: published again if its gateway restarts
            log.error("event=will_pop_failed client_id=%s gateway=%s error=%r", cid, gid, e)

    def pause(self) -> None:
        """A store group member that is not the primary (store/node/ha_member.py): no gateway is
        connected to it and its metadata is the primary's copy, so it publishes no will; the
        timers running stop (`resume` when it becomes primary)."""
        self.close()
        self.gateway_of.clear()
        self.connections_of.clear()

    def resume(self) -> None:
        """This member became the primary: the gateways holding wills in the (replicated)
        metadata are not connected to it yet, so their grace starts now, as at a store's start."""
        self._closed = False
        self.start()

    def close(self) -> None:
        """No more wills from here (the store is stopping): connections closing now are not
        gateways going away."""
        self._closed = True
        for t in self._grace.values():
            t.cancel()
        self._grace.clear()
        for d in self._delayed.values():
            for t in d.values():
                t.cancel()
        self._delayed.clear()
