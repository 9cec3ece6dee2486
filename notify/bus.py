"""In-process notify bus: light-queue events from the dispatch thread to the gateway's event loop.

Why a coalescing window: dispatch runs in batches on its own thread and a hot topic can raise an
event for the same queue hundreds of times a second. The gateway only needs to know *which* queues
have new entries (it pulls from its own offsets), so names are merged into one set and handed to the
loop in a single `call_soon_threadsafe`: at most one delivery per `window_s`, i.e. one wake-up of the
loop per window instead of one per dispatch batch (RocketMQ-MQTT's push-pull model: events for the
same topic are merged).

Why leading edge: the first event after a quiet window is delivered at once (next loop iteration),
later ones wait until `window_s` after the previous delivery. Names keep merging while a delivery is
pending, so under load a busy loop coalesces by itself. A trailing-edge timer (arm on the loop,
then `call_later(window_s)`) would put two extra loop iterations plus the whole window on *every*
message's path, which shows in p50/p99 at a fixed 5,000 msg/s (docs/gateway.md "The QoS 1 hot
path").

Why no hop when the loop itself dispatched: with the store's inline dispatch the listener runs on
the event-loop thread, inside the append. A `call_soon_threadsafe` there costs a self-pipe write and
one more loop iteration, and the window would hold back every later tick's messages. Names raised on
the loop thread are therefore kept for `drain()`, which the appender calls once its append returned
(same loop callback: publish -> deliver with no extra iteration); a plain `call_soon` is the safety
net should nobody drain, skipped while an appender that drains itself says so (`drain_follows`).
The tick is the coalescing unit there, so the window does not apply.

The bus carries queue *names*, never payloads, so the cross-process Redis bus can share this shape.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable, Iterable

log = logging.getLogger("lmqtt.notify")

Callback = Callable[[set[str]], None]


class InProcessBus:
    """Collects queue names from any thread and delivers merged sets to callbacks on `loop`.

    `publish(names)` is thread-safe and cheap (a set update under a lock); the first call while
    nothing is pending schedules one delivery on the loop (at once, or when `window_s` has passed
    since the previous delivery); when it runs, the accumulated set is swapped out and every
    subscriber is called once with it. Subscribers run on the loop and must not block.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, window_s: float = 0.002) -> None:
        self._loop = loop
        self._window = max(0.0, float(window_s))
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._armed = False
        self._next_allowed = 0.0   # monotonic time before which no new delivery starts
        self._closed = False
        self._subscribers: list[Callback] = []
        # the loop's thread: built on the running loop (Gateway.start); else learnt on first _fire
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        self._loop_tid: int | None = threading.get_ident() if running is loop else None
        self._local_armed = False  # names raised on the loop thread wait for drain()
        # set by an appender on the loop thread that calls drain() itself once its append returned
        # (PublishPipeline.flush): the safety-net call_soon is then not needed. It was one loop
        # callback per publish batch that found nothing to do (CPU per message)
        self.drain_follows = False
        # Counters readable by metrics without locking (ints are updated atomically under the GIL).
        self.events_in = 0        # publish() calls (one per dispatch batch)
        self.names_in = 0         # queue names received, before merging
        self.deliveries = 0       # merged sets handed to subscribers
        self.names_out = 0        # queue names after merging
        self.first_pending_ts = 0.0

    # -- producer side (any thread) -------------------------------------------------------
    def publish(self, names: Iterable[str]) -> None:
        """Record that these queues have new entries. Called from the dispatch thread."""
        if self._closed:
            return
        if threading.get_ident() == self._loop_tid:
            self._publish_local(names)
            return
        with self._lock:
            before = len(self._pending)
            self._pending.update(names)
            self.events_in += 1
            self.names_in += len(self._pending) - before
            if self._armed or not self._pending:
                return
            self._armed = True
            now = time.monotonic()
            self.first_pending_ts = now
            delay = self._next_allowed - now
        try:
            if delay <= 0:
                self._loop.call_soon_threadsafe(self._fire)
            else:
                self._loop.call_soon_threadsafe(self._fire_later)
        except RuntimeError:  # loop closed during shutdown: nothing left to notify
            self._closed = True

    def _publish_local(self, names: Iterable[str]) -> None:
        with self._lock:
            before = len(self._pending)
            self._pending.update(names)
            self.events_in += 1
            self.names_in += len(self._pending) - before
            if self._local_armed or not self._pending:
                return
            self._local_armed = True
            if not self.first_pending_ts:
                self.first_pending_ts = time.monotonic()
        if not self.drain_follows:
            self._loop.call_soon(self.drain)

    def drain(self) -> None:
        """On the loop: deliver names raised on the loop thread now (no window, no hop)."""
        if self._local_armed:
            self._local_armed = False
            self._deliver()

    # Light-queue listener signature: fn(queue_names: set[str]).
    __call__ = publish

    # -- consumer side (the loop) ---------------------------------------------------------
    def subscribe(self, callback: Callback) -> None:
        self._subscribers.append(callback)

    def unsubscribe(self, callback: Callback) -> None:
        try:
            self._subscribers.remove(callback)
        except ValueError:
            pass

    def _fire_later(self) -> None:
        delay = self._next_allowed - time.monotonic()
        if delay > 0:
            self._loop.call_later(delay, self._fire)
        else:
            self._fire()

    def _fire(self) -> None:
        if self._loop_tid is None:
            self._loop_tid = threading.get_ident()
        with self._lock:
            self._armed = False
            self._next_allowed = time.monotonic() + self._window
        self._deliver()

    def _deliver(self) -> None:
        with self._lock:
            names, self._pending = self._pending, set()
            self.first_pending_ts = 0.0
        if not names:
            return
        self.deliveries += 1
        self.names_out += len(names)
        for cb in list(self._subscribers):
            try:
                cb(names)
            except Exception:  # one bad subscriber must not stop delivery to the others
                log.exception("event=notify_subscriber_failed callback=%r", cb)

    def close(self) -> None:
        self._closed = True
        self._subscribers.clear()
