"""FilterRegistry: the persisted, reference-counted set of subscribed filters.

Why reference counts: a wildcard filter gets its own light queue while at least one client is
subscribed to it; when the last subscriber goes (`unregister_filter` to 0) the queue stops
receiving entries and can be dropped. The counts live in the metadata DB (WAL on), so the
registry is reloaded exactly on restart; the gateway should re-register filters of sessions it
restores and unregister those of sessions that end. A filter at 0 may stay in the trie a while
(`unregister(keep_indexed=True)`, then `forget`): LightQueueStore lets a filter linger so that a
holder taking it back soon finds its queue whole (light_queue_store.py says why).

`queues_for_topic` is on the publish hot path. It walks the trie (cost ~ topic depth) and keeps
a small LRU of recent results (device topics repeat), cleared whenever the set of wildcard
filters changes.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from .metadata import MetadataStore
from .topics import is_wildcard, validate_filter, validate_topic
from .trie import FilterTrie


class FilterRegistry:
    def __init__(self, metadata: MetadataStore, *, cache_size: int = 65536) -> None:
        self._meta = metadata
        self._trie = FilterTrie()
        self._refs: dict[str, int] = dict(metadata.filters())
        for f in self._refs:
            if is_wildcard(f):
                self._trie.add(f)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, tuple[str, ...]] = OrderedDict()
        self._cache_size = cache_size

    def register(self, flt: str, epoch=None) -> int:
        """Add one reference to `flt` (validated); returns its new reference count. `epoch()`:
        called for a wildcard filter going 0 -> 1 once it is in the trie (every record appended
        from then on is indexed into its queue); the (CommitLog position, ms) it returns is
        written with the count, in one metadata write. The count written is the one held here
        (the metadata's, read at start or by `reload`): no read before the write (a
        new persistent session's SUBSCRIBE wrote a read, a count and an epoch; now one write)."""
        validate_filter(flt)
        with self._lock:
            n = self._refs.get(flt, 0) + 1
            added = n == 1 and is_wildcard(flt)
            # False for a filter lingering in the trie at 0 (`keep_indexed`): it stays there
            inserted = added and self._trie.add(flt)
            if inserted:
                self._cache = OrderedDict()  # publishers holding the old dict write into garbage
            try:
                self._meta.put_filter_ref(flt, n, epoch() if added and epoch is not None else None)
            except BaseException:
                if inserted:                 # not registered: out of the trie again
                    self._trie.remove(flt)
                    self._cache = OrderedDict()
                raise
            self._refs[flt] = n
        return n

    def register_many(self, filters) -> None:
        """Add one reference to each filter with a single metadata write (session restore)."""
        fl = [validate_filter(f) for f in filters]
        deltas: dict[str, int] = {}
        for f in fl:
            deltas[f] = deltas.get(f, 0) + 1
        with self._lock:
            counts = {f: self._refs.get(f, 0) + d for f, d in deltas.items()}
            self._meta.set_filter_refs(counts)
            for f, n in counts.items():
                if n == deltas[f] and is_wildcard(f):
                    self._trie.add(f)
                self._refs[f] = n
            self._cache = OrderedDict()

    def set_counts(self, counts: dict[str, int]) -> None:
        """Set the reference counts of `counts` (each > 0) as given, in one metadata write: a store
        node making its counts agree with the holders it knows of (store/node/gateway_service.py
        `load_holds`). The counts held here change first, also when the write fails (which is
        raised): those holders exist, their filters must be indexed now; the next start writes
        the counts again."""
        with self._lock:
            for f, n in counts.items():
                if n > 0 and self._refs.get(f, 0) == 0 and is_wildcard(f):
                    self._trie.add(f)
                self._refs[f] = n
            self._cache = OrderedDict()
            self._meta.set_filter_refs(counts)

    def unregister(self, flt: str, keep_indexed: bool = False) -> int:
        """Drop one reference; at 0 the filter leaves the trie, unless `keep_indexed` (it is then
        still matched, its count 0, until `forget` or a new registration), and a wildcard
        filter's epoch is deleted with the count (lingering, its queue's epoch is held by the
        light-queue store, not written). Returns the new count. The count written is the one
        held here, as in `register`."""
        with self._lock:
            held = self._refs.get(flt)
            if held is None:
                return 0
            n = held - 1 if held > 0 else 0
            self._meta.release_filter_ref(flt, n, is_wildcard(flt))
            if n == 0:
                del self._refs[flt]
                if is_wildcard(flt) and not keep_indexed:
                    self._trie.remove(flt)
                    self._cache = OrderedDict()
            else:
                self._refs[flt] = n
        return n

    def forget(self, flt: str) -> bool:
        """A filter kept in the trie at 0 (`unregister(keep_indexed=True)`) leaves it, unless it
        was registered again since. Returns whether it left."""
        with self._lock:
            if flt in self._refs or not is_wildcard(flt) or not self._trie.remove(flt):
                return False
            self._cache = OrderedDict()
            return True

    def reload(self) -> None:
        """Read the counts again from the metadata (a store group member that becomes primary:
        its metadata was written by the previous primary, docs/ha.md)."""
        with self._lock:
            self._refs = dict(self._meta.filters())
            self._trie = FilterTrie()
            for f in self._refs:
                if is_wildcard(f):
                    self._trie.add(f)
            self._cache = OrderedDict()

    def refcount(self, flt: str) -> int:
        return self._refs.get(flt, 0)

    def filters(self) -> dict[str, int]:
        return dict(self._refs)

    def wildcard_count(self) -> int:
        return len(self._trie)

    def queues_for_topic(self, topic: str, *, validate: bool = True) -> tuple[str, ...]:
        """The exact-topic queue first, then every registered wildcard filter matching it."""
        cache = self._cache  # captured before matching: see register()
        c = cache.get(topic)
        if c is not None:
            return c
        if validate:
            validate_topic(topic)
        res = (topic, *self._trie.match(topic))
        try:
            cache[topic] = res
            if len(cache) > self._cache_size:
                cache.popitem(last=False)
        except KeyError:  # concurrent pop from another publisher thread: the cache is a hint
            pass
        return res

    def match_uncached(self, topic: str) -> tuple[str, ...]:
        """Same as queues_for_topic without the result cache (benchmarks measure the trie)."""
        return (topic, *self._trie.match(topic))
