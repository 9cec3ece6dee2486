"""MessageCache: one store read serves every reader of a message (RocketMQ-MQTT's queue cache).

Why: a broadcast topic with 10,000 subscribers, or one message fanned out to 4 light queues,
would otherwise cost one CommitLog read per reader. The cache is keyed by CommitLog offset, so
readers of *different* queues that point at the same record share it too. It is an LRU bounded
by bytes; entries are immutable StoredMessages (named tuples): they are handed out as they are,
and a reader that needs another `.queue_offset` gets a new tuple sharing every field.

Single flight without a per-message Event: misses are loaded while holding `_load_lock`, and a
loader re-checks the cache after taking it, so concurrent misses on one offset cost one store
read (the second reader finds it cached). Loads are serialised, which costs nothing under one
GIL (a store read is CPU work on a memory map). Hits and the LRU bookkeeping of a whole pull batch
take the main lock once (`get_many` / `load_many`), not once per message.

Why the sizes are a dict of their own and not `(message, size)` pairs: the records' decoder hands
over its messages untracked by the garbage collector (they cannot be in a cycle), but a pair holding
one stays tracked for good (the collector untracks an exact tuple only when its items are atomic or
untracked exact tuples, and a message is a tuple *subclass*). 200,000 cached pairs were then
scanned by every older-generation collection: pauses of 0.1-0.4 s on a broker whose subscriber
fell behind. A dict of ints is not tracked at all.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable


class MessageCache:
    def __init__(self, max_bytes: int = 64 << 20, max_items: int = 200_000) -> None:
        self.max_bytes = max_bytes
        self.max_items = max_items
        self._d: OrderedDict[int, Any] = OrderedDict()    # CommitLog offset -> message, LRU order
        self._size: dict[int, int] = {}                   # CommitLog offset -> the record's size
        self._bytes = 0
        self._lock = threading.Lock()        # the dict, the byte count and the counters
        self._load_lock = threading.Lock()   # single flight: one loader at a time, re-checks first
        self.hits = 0
        self.misses = 0

    def get(self, phys_offset: int, size: int, load: Callable[[int, int], Any]) -> Any:
        """The message at `phys_offset`, loading it with `load(phys, size)` on a miss.

        Concurrent misses on the same offset cost one load (single flight); a failing load
        raises here and is not cached (the next reader tries again)."""
        m = self.get_many((phys_offset,))[0]
        if m is not None:
            return m
        m = self.load_many(((phys_offset, size),), load)[0]
        if isinstance(m, BaseException):
            raise m
        return m

    def get_many(self, offsets) -> list:
        """Cached messages for `offsets` (None where missing), one lock round for the batch."""
        out = []
        append = out.append
        with self._lock:
            d = self._d
            get = d.get
            mte = d.move_to_end
            hits = 0
            for p in offsets:
                h = get(p)
                if h is None:
                    append(None)
                else:
                    mte(p)
                    hits += 1
                    append(h)
            self.hits += hits
        return out

    def load_many(self, wanted, load: Callable[[int, int], Any],
                  load_batch: Callable[[list], list] | None = None) -> list:
        """Load `wanted` [(phys_offset, size), ...] (each re-checked in the cache first) and cache
        them. Returns one item per request: the message, or the exception its load raised (not
        cached; the caller decides whether it is an error).

        `load_batch(list of (phys, size))`, when given, loads every miss in one call and returns
        one item per request, message or exception (`MessageStore.read_many`: one decode call per
        segment's run instead of one read per record; a backlog pull misses hundreds at once)."""
        out = []
        append = out.append
        with self._load_lock:
            with self._lock:
                d = self._d
                got = [d.get(p) for p, _ in wanted]
            new = []
            rechecked = 0
            if load_batch is not None:
                miss = [w for w, h in zip(wanted, got) if h is None]
                loaded = iter(load_batch(miss) if miss else ())
            for (p, size), h in zip(wanted, got):
                if h is not None:       # loaded by another reader meanwhile
                    append(h)
                    rechecked += 1
                    continue
                if load_batch is not None:
                    m = next(loaded)
                    append(m)
                    if not isinstance(m, Exception):
                        new.append((p, m, size))
                    continue
                try:
                    m = load(p, size)
                except Exception as e:  # noqa: BLE001 - handed to the caller per message
                    append(e)
                    continue
                append(m)
                new.append((p, m, size))
            with self._lock:
                self.misses += len(new)
                self.hits += rechecked
                sizes = self._size
                for p, m, size in new:
                    if p not in d:
                        d[p] = m
                        sizes[p] = size
                        self._bytes += size
                while d and (self._bytes > self.max_bytes or len(d) > self.max_items):
                    p, _ = d.popitem(last=False)
                    self._bytes -= sizes.pop(p)
        return out

    def drop_below(self, phys_offset: int) -> None:
        """Forget messages below `phys_offset` (their segments were deleted)."""
        with self._lock:
            for k in [k for k in self._d if k < phys_offset]:
                del self._d[k]
                self._bytes -= self._size.pop(k)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self._size.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._d)
