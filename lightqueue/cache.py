"""MessageCache: one store read serves every reader of a message (seed 000 "缓存模块").

Why: a broadcast topic with 10,000 subscribers, or one message fanned out to 4 light queues,
would otherwise cost one CommitLog read per reader. The cache is keyed by CommitLog offset, so
readers of *different* queues that point at the same record share it too. It is an LRU bounded
by bytes; entries are immutable StoredMessages (the pull path copies the small slots object
to set `.queue_offset`, never the payload).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable


class MessageCache:
    def __init__(self, max_bytes: int = 64 << 20, max_items: int = 200_000) -> None:
        self.max_bytes = max_bytes
        self.max_items = max_items
        self._d: OrderedDict[int, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._inflight: dict[int, threading.Event] = {}   # single flight: one read per miss
        self.hits = 0
        self.misses = 0

    def get(self, phys_offset: int, size: int, load: Callable[[int, int], Any]) -> Any:
        """The message at `phys_offset`, loading it with `load(phys, size)` on a miss.

        Concurrent misses on the same offset wait for the first reader's load (single flight).
        """
        while True:
            with self._lock:
                hit = self._d.get(phys_offset)
                if hit is not None:
                    self._d.move_to_end(phys_offset)
                    self.hits += 1
                    return hit[0]
                ev = self._inflight.get(phys_offset)
                if ev is None:
                    ev = self._inflight[phys_offset] = threading.Event()
                    self.misses += 1
                    break
            ev.wait(5.0)   # another reader is loading it; then retry (it may have failed)
        try:
            m = load(phys_offset, size)   # outside the lock: store reads may block on I/O
            with self._lock:
                self._d[phys_offset] = (m, size)
                self._bytes += size
                while self._d and (self._bytes > self.max_bytes or len(self._d) > self.max_items):
                    _, (_, sz) = self._d.popitem(last=False)
                    self._bytes -= sz
            return m
        finally:
            with self._lock:
                self._inflight.pop(phys_offset, None)
            ev.set()

    def drop_below(self, phys_offset: int) -> None:
        """Forget messages below `phys_offset` (their segments were deleted)."""
        with self._lock:
            for k in [k for k in self._d if k < phys_offset]:
                self._bytes -= self._d.pop(k)[1]

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._d)
