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

Why not every load is cached (admission): a cache entry costs more than the read it saves unless it
is read again. Decoding a record from the CommitLog's map is one C call per run of records, well
under a microsecond each; putting it in the LRU and evicting it later costs about as much again in
Python. A reader far behind the tail that nobody else follows - one subscriber of a fan-in that
fell behind its publishers - reads every record once: caching its reads spent a sixth of a loaded
broker's loop and pushed out the entries other readers were sharing. So the cache judges itself
every ADMIT_WINDOW loaded records: while the records it cached were read again (REUSE_MIN hits per
cached record on average), it caches every load; below that it caches one pull batch in
SCAN_SAMPLE and serves the others straight from the store. The sampled batches are how it notices
readers sharing records again (a broadcast topic's subscribers reconnecting with backlogs): their
hits bring full admission back at the next judgement. Which records a reader gets never depends on
it, only what they cost.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable


# Admission: judged every ADMIT_WINDOW loaded records; every load is cached while each record the
# window cached was read again REUSE_MIN times on average, else one pull batch in SCAN_SAMPLE
ADMIT_WINDOW = 16384
REUSE_MIN = 0.25
SCAN_SAMPLE = 8


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
        self.misses = 0              # records loaded from the store (cached or not)
        # admission (the module's docstring): cache every load while cached records are read again
        self.admitting = True
        self._batches = 0            # load_many calls: one in SCAN_SAMPLE is cached while not admitting
        self._win_loaded = 0         # this window's loaded records, of them admitted, and its hits
        self._win_admitted = 0
        self._win_hits = 0

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
            self._win_hits += hits
        return out

    def load_many(self, wanted, load: Callable[[int, int], Any],
                  load_batch: Callable[[list], list] | None = None) -> list:
        """Load `wanted` [(phys_offset, size), ...] (each re-checked in the cache first) and cache
        them when the cache admits them (`admitting`). Returns one item per request: the message,
        or the exception its load raised (not cached; the caller decides whether it is an error).

        `load_batch(list of (phys, size))`, when given, loads every miss in one call and returns
        one item per request, message or exception (`MessageStore.read_many`: one decode call per
        segment's run instead of one read per record; a backlog pull misses hundreds at once)."""
        with self._load_lock:
            d = self._d
            with self._lock:
                got = [d.get(p) for p, _ in wanted]
            rechecked = len(got) - got.count(None)
            todo = wanted if not rechecked else [w for w, h in zip(wanted, got) if h is None]
            if load_batch is not None:
                loaded = load_batch(todo) if todo else []
            else:
                loaded = []
                for p, size in todo:
                    try:
                        loaded.append(load(p, size))
                    except Exception as e:  # noqa: BLE001 - handed to the caller per message
                        loaded.append(e)
            if rechecked:
                it = iter(loaded)
                out = [h if h is not None else next(it) for h in got]
            else:
                out = loaded
            admit = self.admitting or not self._batches % SCAN_SAMPLE
            self._batches += 1
            with self._lock:
                n = len(todo)
                self.misses += n
                self.hits += rechecked
                self._win_hits += rechecked
                self._win_loaded += n
                if admit:
                    self._win_admitted += n
                    sizes = self._size
                    nbytes = self._bytes
                    for (p, size), m in zip(todo, loaded):
                        if not isinstance(m, BaseException) and p not in d:   # (a batch may name one twice)
                            d[p] = m
                            sizes[p] = size
                            nbytes += size
                    while d and (nbytes > self.max_bytes or len(d) > self.max_items):
                        nbytes -= sizes.pop(d.popitem(last=False)[0])
                    self._bytes = nbytes
                if self._win_loaded >= ADMIT_WINDOW:
                    self._judge()
        return out

    def _judge(self) -> None:
        """End of a window of ADMIT_WINDOW loaded records: admit every load while the records
        admitted in it were hit at least REUSE_MIN times each on average, else only one batch in
        SCAN_SAMPLE (the module's docstring says why). Called under `_lock`."""
        self.admitting = self._win_hits >= REUSE_MIN * max(self._win_admitted, 1)
        self._win_hits = self._win_loaded = self._win_admitted = 0

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
