"""Notify across processes over Redis pub/sub: the store says which light queues have new entries,
every gateway that serves them hears it (RocketMQ-MQTT's push-pull model, the two notify modes).

Events are *hints* — queue names, never payloads; a gateway that hears one pulls from its own
offsets. So nothing here has to be reliable for delivery to be: a lost event, a Redis restart or a
dropped pub/sub connection only delays a delivery until the gateway's next pull, and the
subscriber makes that bounded: after every (re)connect, and every `safety_poll_s` while connected,
it calls its `on_resync` callbacks ("pull every queue you serve"). Nothing is ever lost.

Two modes:
* **broadcast** (default): one channel; every gateway receives every event and ignores the queues
  it does not serve. Simple, and right while the fleet is small or most gateways serve most topics.
* **precise**: each gateway registers the queues it serves (`SADD lmqtt:notify:watch:<queue>
  <gateway>`) and listens on its own channel; the publisher looks up the watchers of the queues
  in each batch (one pipelined round trip per batch) and sends each gateway only its names.
  Right for large fleets where a topic lives on few gateways.

The publisher side coalesces like the in-process bus: names raised within `window_s` are merged
and sent as one message (names joined by newlines), so a hot queue costs one Redis message per
window, not one per dispatched batch.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable, Iterable

log = logging.getLogger("lmqtt.notify.redis")

PREFIX = "lmqtt:notify"
BROADCAST_CHANNEL = f"{PREFIX}:all"
MODES = ("broadcast", "precise")


def gateway_channel(gateway_id: str) -> str:
    return f"{PREFIX}:gw:{gateway_id}"


def watch_key(queue: str) -> str:
    return f"{PREFIX}:watch:{queue}"


def _encode(names: Iterable[str]) -> bytes:
    return "\n".join(sorted(names)).encode()


def _decode(data) -> set[str]:
    if isinstance(data, bytes):
        data = data.decode()
    return {n for n in data.split("\n") if n}


class RedisEventPublisher:
    """Store side: `publish(names)` from any thread (the light-queue listener signature); a
    background thread sends merged sets every `window_s`. Redis being down costs events (hints),
    never an append: errors are counted and logged once per outage."""

    def __init__(self, url: str, mode: str = "broadcast", window_s: float = 0.002) -> None:
        if mode not in MODES:
            raise ValueError(f"notify mode {mode!r}: expected one of {', '.join(MODES)}")
        import redis  # only with --redis: lmqtt serve never loads it
        self._redis = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.mode = mode
        self._window = window_s
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pending: set[str] = set()
        self._closed = False
        self.messages_sent = 0
        self.names_sent = 0
        self.errors = 0
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="lmqtt-notify-redis", daemon=True)
        self._thread.start()

    def publish(self, names: Iterable[str]) -> None:
        with self._lock:
            before = len(self._pending)
            self._pending.update(names)
            if before == 0 and self._pending:
                self._cond.notify()

    __call__ = publish

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed and not self._pending:
                    return
                names, self._pending = self._pending, set()
            try:
                self._send(names)
                if self._failing:
                    log.info("event=notify_redis_recovered")
                    self._failing = False
            except Exception as e:  # hints only: drop them, gateways resync on their own
                self.errors += 1
                if not self._failing:
                    log.warning("event=notify_redis_unavailable error=%r (deliveries wait for the "
                                "gateways' safety poll)", e)
                    self._failing = True
                time.sleep(min(1.0, self._window * 100))
            if self._window:
                time.sleep(self._window)

    def _send(self, names: set[str]) -> None:
        if self.mode == "broadcast":
            self._redis.publish(BROADCAST_CHANNEL, _encode(names))
            self.messages_sent += 1
            self.names_sent += len(names)
            return
        ordered = list(names)
        p = self._redis.pipeline(transaction=False)
        for q in ordered:
            p.smembers(watch_key(q))
        per_gateway: dict[bytes, list[str]] = {}
        for q, gws in zip(ordered, p.execute()):
            for gw in gws:
                per_gateway.setdefault(gw, []).append(q)
        if not per_gateway:
            return
        p = self._redis.pipeline(transaction=False)
        for gw, qs in per_gateway.items():
            p.publish(gateway_channel(gw.decode()), _encode(qs))
            self.names_sent += len(qs)
        p.execute()
        self.messages_sent += len(per_gateway)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._cond.notify()
        self._thread.join(5)
        self._redis.close()


class RedisEventSubscriber:
    """Gateway side, on its asyncio loop: delivers merged name sets to `subscribe`d callbacks and
    calls `on_resync` callbacks after every (re)connect and every `safety_poll_s`.

    In precise mode, `watch(queues)` / `unwatch(queues)` register what this gateway serves;
    registrations are re-made after a reconnect (a restarted Redis has forgotten them).
    """

    def __init__(self, url: str, gateway_id: str, mode: str = "broadcast", safety_poll_s: float = 5.0,
                 reconnect_max_s: float = 2.0) -> None:
        if mode not in MODES:
            raise ValueError(f"notify mode {mode!r}: expected one of {', '.join(MODES)}")
        self.url, self.gateway_id, self.mode = url, gateway_id, mode
        self.safety_poll_s = safety_poll_s
        self.reconnect_max_s = reconnect_max_s
        self._callbacks: list[Callable[[set[str]], None]] = []
        self._resync: list[Callable[[], None]] = []
        self._watched: set[str] = set()
        self._to_watch: set[str] = set()      # watch_later / unwatch_later, not applied yet
        self._to_unwatch: set[str] = set()
        self._changer: asyncio.Task | None = None
        self._task: asyncio.Task | None = None
        self._redis = None
        self.connected = asyncio.Event()
        self.events_received = 0
        self.reconnects = 0
        self.resyncs = 0

    def subscribe(self, callback: Callable[[set[str]], None]) -> None:
        self._callbacks.append(callback)

    def on_resync(self, callback: Callable[[], None]) -> None:
        self._resync.append(callback)

    async def start(self) -> None:
        import redis.asyncio as aioredis  # only with --redis: lmqtt serve never loads it
        self._redis = aioredis.Redis.from_url(self.url, socket_connect_timeout=2.0)
        self._task = asyncio.get_running_loop().create_task(self._run())

    def watch_later(self, queues: Iterable[str]) -> None:
        """`watch` from code that cannot await (the gateway's mirror starts tracking a queue): one
        task registers, the queues added meanwhile in one pipeline. A task per queue wanted a Redis
        connection each, and a burst of new queues (many subscribers arriving at once) failed most
        registrations with the pool's MaxConnectionsError: those queues then waited for the safety
        poll."""
        self._to_watch |= set(queues)
        self._to_unwatch -= self._to_watch
        self._kick()

    def unwatch_later(self, queues: Iterable[str]) -> None:
        """`unwatch` the same way (see `watch_later`)."""
        self._to_unwatch |= set(queues)
        self._to_watch -= self._to_unwatch
        self._kick()

    def _kick(self) -> None:
        if self._changer is None or self._changer.done():
            self._changer = asyncio.get_running_loop().create_task(self._apply_later())

    async def _apply_later(self) -> None:
        while self._to_watch or self._to_unwatch:
            add, self._to_watch = self._to_watch, set()
            drop, self._to_unwatch = self._to_unwatch, set()
            try:
                if drop:
                    await self.unwatch(drop)
                if add:
                    await self.watch(add)
            except Exception as e:  # noqa: BLE001 - re-registered at the next reconnect; the poll covers
                log.warning("event=notify_watch_failed queues=%d error=%r (registered again when Redis "
                            "reconnects; the safety poll delivers meanwhile)", len(add), e)

    async def watch(self, queues: Iterable[str]) -> None:
        new = set(queues) - self._watched
        self._watched |= new
        if self.mode == "precise" and new and self.connected.is_set():
            await self._register(new)

    async def unwatch(self, queues: Iterable[str]) -> None:
        gone = set(queues) & self._watched
        self._watched -= gone
        if self.mode == "precise" and gone and self.connected.is_set():
            try:
                p = self._redis.pipeline(transaction=False)
                for q in gone:
                    p.srem(watch_key(q), self.gateway_id)
                await p.execute()
            except Exception as e:
                log.warning("event=notify_unwatch_failed error=%r", e)

    async def _register(self, queues) -> None:
        p = self._redis.pipeline(transaction=False)
        for q in queues:
            p.sadd(watch_key(q), self.gateway_id)
        await p.execute()

    async def _run(self) -> None:
        backoff = 0.05
        channel = BROADCAST_CHANNEL if self.mode == "broadcast" else gateway_channel(self.gateway_id)
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                if self.mode == "precise" and self._watched:
                    await self._register(self._watched)
                self.connected.set()
                backoff = 0.05
                self._fire_resync()                   # whatever was missed while away
                next_poll = time.monotonic() + self.safety_poll_s
                while True:
                    timeout = max(0.0, next_poll - time.monotonic())
                    msg = await pubsub.get_message(timeout=timeout)
                    if msg is not None and msg.get("type") == "message":
                        self.events_received += 1
                        self._deliver(_decode(msg["data"]))
                    if time.monotonic() >= next_poll:
                        self._fire_resync()
                        next_poll = time.monotonic() + self.safety_poll_s
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if self.connected.is_set():
                    log.warning("event=notify_subscriber_disconnected error=%r", e)
                self.connected.clear()
                self.reconnects += 1
                await asyncio.sleep(backoff)
                backoff = min(self.reconnect_max_s, backoff * 2)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:
                    pass

    def _deliver(self, names: set[str]) -> None:
        if not names:
            return
        for cb in list(self._callbacks):
            try:
                cb(names)
            except Exception:
                log.exception("event=notify_subscriber_failed callback=%r", cb)

    def _fire_resync(self) -> None:
        self.resyncs += 1
        for cb in list(self._resync):
            try:
                cb()
            except Exception:
                log.exception("event=notify_resync_failed callback=%r", cb)

    async def close(self) -> None:
        for t in (self._changer, self._task):
            if t is not None:
                t.cancel()
                try:
                    await t
                except (asyncio.CancelledError, Exception):
                    pass
        if self.mode == "precise" and self._watched and self._redis is not None:
            try:
                await self.unwatch(list(self._watched))
            except Exception:
                pass
        if self._redis is not None:
            await self._redis.aclose()
