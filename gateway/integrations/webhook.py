"""Events POSTed to the user's URL (`--webhook URL`): JSON arrays of events, from a bounded queue,
retried with backoff.

Why a queue and batches: events happen on the event loop at connect/subscribe rate (thousands a
second in a reconnect storm); one request per event would cost more than the events. Events wait
in a queue of `max_queue`; a sender task takes up to `batch` at a time and POSTs them as one JSON
array. A failed POST (the receiver away, a 5xx, no answer within `timeout_s`) is sent again, the
same batch, after 0.1 s, 0.2 s, ... up to 5 s between tries, so nothing is reordered; while it
fails, new events wait in the queue, and when the queue is full the newest are dropped and
counted (`lmqtt_webhook_events_dropped_total`), never blocking the broker. A 4xx answer (the
receiver refuses this batch) drops the batch, counted and logged, since sending it again would be
refused again.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from typing import Any

log = logging.getLogger("lmqtt.gateway.webhook")


class Webhook:
    def __init__(self, url: str, max_queue: int = 10000, batch: int = 100, timeout_s: float = 5.0) -> None:
        self.url = url
        self.max_queue = max_queue
        self.batch = batch
        self.timeout_s = timeout_s
        self.queue: deque[dict] = deque()
        self.sent = self.dropped = self.refused = self.failures = self.batches = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._session: Any = None
        self._closing = False
        import aiohttp  # noqa: F401 - at start, before `lmqtt serve` freezes the start's objects (gc_freeze)

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def put(self, event: dict) -> None:
        """Queue one event (on the loop; never blocks): dropped and counted when the queue is full."""
        if len(self.queue) >= self.max_queue:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("event=webhook_queue_full url=%s dropped=%d queue=%d", self.url, self.dropped,
                            self.max_queue)
            return
        self.queue.append(event)
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        import aiohttp  # only the webhook, when configured
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                              headers={"User-Agent": "lmqtt"})
        assert self._wake is not None
        while True:
            if not self.queue:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            n = min(self.batch, len(self.queue))
            batch = [self.queue[i] for i in range(n)]
            body = json.dumps(batch, separators=(",", ":")).encode()
            backoff = 0.1
            while True:
                outcome = await self._post(body)
                if outcome == "ok":
                    self.sent += n
                    self.batches += 1
                    break
                if outcome == "refused":
                    self.refused += n
                    break
                self.failures += 1
                if self._closing:
                    return
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)
            for _ in range(n):
                self.queue.popleft()

    async def _post(self, body: bytes) -> str:
        try:
            async with self._session.post(self.url, data=body, headers={"Content-Type": "application/json"}) as r:
                await r.read()
                if r.status < 300:
                    return "ok"
                if 400 <= r.status < 500:
                    log.warning("event=webhook_refused url=%s status=%d (batch dropped)", self.url, r.status)
                    return "refused"
                why = f"HTTP {r.status}"
        except asyncio.TimeoutError:
            why = f"no answer within {self.timeout_s:g} s"
        except Exception as e:  # noqa: BLE001 - connection refused, reset: retried
            why = f"{type(e).__name__}: {e}"
        if self.failures == 0 or self.failures % 50 == 0:
            log.warning("event=webhook_failed url=%s error=%r (retried with backoff; %d queued)", self.url, why,
                        len(self.queue))
        return "retry"

    async def close(self, drain_s: float = 2.0) -> None:
        """Send what is queued for up to `drain_s`, then stop (what is left is counted as dropped)."""
        self._closing = True
        if self._task is not None:
            if self._wake is not None:
                self._wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), drain_s)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001
                self._task.cancel()
            self.dropped += len(self.queue)
            self.queue.clear()
        if self._session is not None:
            await self._session.close()
