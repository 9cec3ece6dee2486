"""The garbage collector's pauses, timed: a collection of 50 ms or more is logged
(`event=slow_gc generation=.. ms=.. collected=..`) and counted.

Why: a collection stops the whole process - the event loop, and the store's threads at their next
bytecode - for as long as it scans, and a full one scans every tracked object not frozen at
start (`lmqtt serve`/`gateway`: `gc_freeze`, gateway/app/config.py): sessions, cursors and messages made since. Under a
steady load full collections come at a steady period, as the store's segment rolls and RocksDB's
flushes do, so a latency spike every few minutes could be any of them. The store's background
service logs its slow duties (`event=slow_duty`, store/flush.py); this names the collector's
pauses with the same threshold, so a spike in a broker's log is matched with what held it up.

Cost: one callback at the start and the end of each collection (a clock read each), against the
collection itself (a young one scans at least `gc_gen0_threshold` objects).
"""
from __future__ import annotations

import gc
import logging
import sys
import time

log = logging.getLogger("lmqtt.gc")

SLOW_S = 0.05      # the store's SLOW_DUTY_S: one threshold for every pause the logs name


class GcPauses:
    """A `gc.callbacks` entry that times every collection (one per process: `install`)."""

    def __init__(self) -> None:
        self._t0 = 0.0
        self.collections = [0, 0, 0]      # per generation
        self.seconds = [0.0, 0.0, 0.0]    # time spent collecting, per generation
        self.longest_s = 0.0
        self.slow = 0                     # collections of SLOW_S or more (logged)
        self._window_s = 0.0              # the longest since `take_longest` was last called

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        took = time.perf_counter() - self._t0
        g = info.get("generation", 0)
        self.collections[g] += 1
        self.seconds[g] += took
        if took > self.longest_s:
            self.longest_s = took
        if took > self._window_s:
            self._window_s = took
        # not the interpreter's own collections at exit: they come after the process said it
        # stopped ("lmqtt store: stopped cleanly" is its last line) and hold nothing back
        if took >= SLOW_S and not sys.is_finalizing():
            self.slow += 1
            log.info("event=slow_gc generation=%d ms=%.0f collected=%d uncollectable=%d", g, took * 1000,
                     info.get("collected", 0), info.get("uncollectable", 0))


    def take_longest(self) -> float:
        """The longest collection (seconds) since the last call: a sampler's row."""
        w, self._window_s = self._window_s, 0.0
        return w


_installed: GcPauses | None = None


def install() -> GcPauses:
    """Time this process's collections from now on (idempotent); returns the counters."""
    global _installed
    if _installed is None:
        _installed = GcPauses()
        gc.callbacks.append(_installed)
    return _installed
