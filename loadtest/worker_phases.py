"""What both traffic workers (``traffic_worker.Worker`` on asyncio and ``paced.PacedWorker`` on
its own epoll loop) do alike on the child's side of the phase protocol (``mqtt_bench``):

* the ``published`` report after the publish phase (``published_report``);
* the drain phase's stop rule (``DrainWatch``): a worker keeps receiving until it has every message
  its subscribers were meant to get, or nothing new (not even a duplicate) has arrived for
  ``cfg.drain_idle`` seconds, or ``cfg.drain_max`` seconds have passed. Each worker drives its own
  loop (``await asyncio.sleep`` or an ``epoll`` poll) and asks ``DrainWatch.done()`` after
  flushing its sink, once per turn;
* the ``result`` report (``result_report``), CPU measured with ``cpu_split``.
"""
from __future__ import annotations

import resource
import time

from .scenarios import ScenarioConfig
from .stamp import Tracker


def cpu_split() -> tuple[float, float]:
    """(user, system) CPU seconds of this process: system time is mostly socket syscalls."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime


def published_report(pubs) -> dict:
    """The ``published`` message: what each publisher sent, what is not acknowledged yet, and how
    many messages went out late (``behind_schedule``)."""
    return {"sent": {p.sp.pub_id: p.seq for p in pubs},
            "unacked": sum(len(p.client.inflight) for p in pubs),
            "behind_schedule": sum(p.behind for p in pubs)}


def result_report(w, cpu0: tuple[float, float], reads0: int, disconnected: int) -> dict:
    """The ``result`` message of worker ``w`` (its tracker, histogram, sink, clients, writes and
    errors): ``cpu0`` and ``reads0`` were taken at the go message; ``disconnected`` is how many of
    its clients lost their connection (each worker knows it its own way)."""
    cpu1 = cpu_split()
    return {
        "per_pub": w.tracker.to_dict(), "hist": w.hist.to_dict(),
        "last_recv_ns": w.sink.last_ns, "cpu_s": (cpu1[0] - cpu0[0]) + (cpu1[1] - cpu0[1]),
        "cpu_sys_s": cpu1[1] - cpu0[1],
        "reads": sum(c.reads for c in w.clients) - reads0, "writes": w.writes,
        "errors": w.errors + [c.error for c in w.clients if c.error][:5],
        "disconnected": disconnected,
    }


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
