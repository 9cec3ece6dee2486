"""The drain phase's stop rule, shared by both traffic workers (``traffic_worker.Worker`` on
asyncio and ``paced.PacedWorker`` on its own epoll loop): after the publish phase a worker keeps
receiving until it has every message its subscribers were meant to get, or nothing new (not even
a duplicate) has arrived for ``cfg.drain_idle`` seconds, or ``cfg.drain_max`` seconds have passed.

Each worker drives its own loop (``await asyncio.sleep`` or an ``epoll`` poll) and asks
``DrainWatch.done()`` after flushing its sink, once per turn.
"""
from __future__ import annotations

import time

from .scenarios import ScenarioConfig
from .stamp import Tracker


class DrainWatch:
    """Whether a worker's drain may stop; ``totals`` is the parent's ``{publisher id: sent}``."""

    __slots__ = ("streams", "want", "deadline", "idle", "last_n", "last_change")

    def __init__(self, tracker: Tracker, totals: dict[int, int], cfg: ScenarioConfig) -> None:
        self.streams = tracker.streams
        self.want = sum(totals.get(p, 0) for (_s, p) in tracker.streams)
        now = time.monotonic()
        self.deadline = now + cfg.drain_max
        self.idle = cfg.drain_idle
        self.last_n, self.last_change = -1, now

    def done(self) -> bool:
        """True once everything wanted has arrived, arrivals stalled, or the time is up."""
        now = time.monotonic()
        if now >= self.deadline:
            return True
        streams = self.streams.values()
        got = sum(st.unique for st in streams)
        if got >= self.want:
            return True
        n = got + sum(st.duplicates for st in streams)
        if n != self.last_n:
            self.last_n, self.last_change = n, now
            return False
        return now - self.last_change > self.idle
