"""LightQueueStore: the light-queue API the gateway and notify use (docs/internals.md).

It ties together the pieces, each in its own module:
  FilterRegistry (registry.py)  which queues a topic lands in (trie over registered filters)
  LightQueueIndex (index.py)    the store Dispatcher writing entries into RocksDB (WAL off)
  MessageCache (cache.py)       one store read per message, whatever the number of readers
  MetadataStore (metadata.py)   offsets, sessions, retained, wills, filters (RocksDB, WAL on)

Visibility: the index may hold entries a moment before the store publishes them (the store
advances `dispatched_offset` after every dispatcher took the batch), so `pull` stops at the
first entry at/after `store.dispatched_offset`, and listeners are called from the store's
dispatch listener, i.e. when the entries are readable.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, NamedTuple

from lmqtt.store import StoredMessage
from lmqtt.store.fastpath import BIG_ENDIAN_ENTRY, raw_piece, raw_runs

from . import replay
from .cache import MessageCache
from .errors import LightQueueError
from .index import LightQueueIndex
from .metadata import MetadataStore
from .records import HOST
from .registry import FilterRegistry
from .take import ENTRY as _INDEX_ENTRY
from .topics import is_wildcard


# pull_raw reads the index's entries with the ConsumeQueue's loop (store/fastpath.py raw_piece), which
# reads them as BIG_ENDIAN_ENTRY: the two layouts must stay one (a change on either side fails here)
if _INDEX_ENTRY.format != BIG_ENDIAN_ENTRY.format:
    raise ImportError(f"lightqueue/take.py ENTRY {_INDEX_ENTRY.format} is not store/fastpath.py "
                      f"BIG_ENDIAN_ENTRY {BIG_ENDIAN_ENTRY.format}: pull_raw would read it wrong")

log = logging.getLogger(__name__)


class PullResult(NamedTuple):
    messages: list            # immutable StoredMessage with .queue_offset = light-queue offset
    next_offset: int          # offset to pull from next time
    min_offset: int
    max_offset: int           # next offset to be written


class LightQueueStore:
    def __init__(self, store: Any, path: str, *, cache_bytes: int = 64 << 20,
                 metadata_sync: bool = False, filter_linger_s: float = 0.0) -> None:
        """Open (or create) the light queues under `path`; call before `store.start()`.

        `filter_linger_s`: how long a wildcard filter let go by its last holder stays indexed, its
        queue whole, before the queue is dropped (`unregister_filter`; 0: at once). A store node
        (`lmqtt store --filter-linger-s`, default 60) serves holders that are independent
        processes - the gateways of a fleet or of `serve --workers` - and a release may reach it
        just before the registration that takes over: gateways starting together each reconcile
        their own holds (the one whose sessions moved away lets go, the one that restores them
        registers), in either order. Dropped at once, the queue went with the entries of messages
        still in flight to the sessions it was taken over for, and its numbering went on past
        them: acknowledged messages lost (`lmqtt bench chaos`, `serve --workers 2` across a store
        restart). The single-process `serve` has one set of holders: no linger."""
        os.makedirs(path, exist_ok=True)
        self._store = store
        self.filter_linger_s = filter_linger_s
        # wildcard filters let go by their last holder, still indexed -> when their queue is
        # dropped (insertion order is deadline order: one linger for all); the timer that drops
        # them; the lock that orders a drop against a registration taking the filter back
        self._lingering: dict[str, float] = {}
        self._linger_timer: threading.Timer | None = None
        self._filters_lock = threading.RLock()
        # each database keeps at most the store's per-database share of table files open
        budget = getattr(store, "budget", None)
        tables = budget.rocksdb_tables if budget is not None else -1
        self.metadata = MetadataStore(os.path.join(path, "meta"), sync=metadata_sync, max_open_files=tables)
        try:
            self.index = LightQueueIndex(os.path.join(path, "index"), max_open_files=tables)
        except Exception:
            self.metadata.close()
            raise
        self.registry = FilterRegistry(self.metadata)
        # queues_for_topic(topic) -> exact topic queue + every registered wildcard filter matching
        # it (topic validated). Called once per publish: the registry's method, not a wrapper.
        self.queues_for_topic = self.registry.queues_for_topic
        self.cache = MessageCache(max_bytes=cache_bytes)
        self._listeners: list[Callable[[set[str]], None]] = []
        self._cond = threading.Condition()
        self._data_waiters = 0    # threads in wait_for_data (changed under _cond)
        self._cache_min_phys = self.index.min_phys
        self._closed = False
        self._epochs: dict[str, tuple[int, int]] = {}     # wildcard filter -> epoch (replay.py)
        # called before a wildcard filter's first registration by whoever appends records routed
        # earlier (the embedded gateway's per-tick publish batch): they must be appended before the
        # epoch starts, so that every record after it carries the filter (replay.py)
        self.before_register: Callable[[], None] | None = None
        store.add_dispatcher(self.index)
        store.add_dispatch_listener(self._on_dispatched)
        # a session record read back settles its pending inbound QoS 2 ids against the log's key
        # index (lightqueue/records.py `resolve_pending_qos2`)
        if hasattr(store, "query_by_key"):
            self.metadata.qos2_stored = self._qos2_stored
        # after a recovery that cut the log, consumer offsets beyond their queue's new end are
        # brought back to it before anything is appended (store/recovery.py); and SDK consumer
        # groups on light queues (store/sdk_meta.py) learn the queues' ends at the cut from here
        if hasattr(store, "add_recovery_listener"):
            store.add_recovery_listener(self._check_after_recovery)
            store.add_queue_kind("lq", self.index.end_at)

    def _qos2_stored(self, topic: str, key: str, ms: int) -> bool:
        """Whether the log holds the message of `topic` carrying `key`, stored around `ms` (the
        gateway's clock: ten minutes either side)."""
        now = int(time.time() * 1000)
        return bool(self._store.query_by_key(topic, key, ms - 600_000, max(now, ms) + 600_000, 1))

    # ------------------------------------------------------------ filters and topic mapping
    def register_filter(self, flt: str) -> int:
        """Register one subscriber of `flt` (validated, persisted); returns its reference count.
        A wildcard filter going 0 -> 1 starts an epoch: from the log's end now on, its queue holds
        every matching record (lightqueue/replay.py)."""
        if not is_wildcard(flt):
            return self.registry.register(flt)
        with self._filters_lock:
            lingered = self._take_back([flt])
            new = self.registry.refcount(flt) == 0
            if new and not lingered and self.before_register is not None:
                self.before_register()
            ep = []

            def epoch() -> tuple[int, int]:
                # lingering, the queue held every matching record all along: its epoch goes on;
                # else once in the trie: from the log's end now on
                kept = self._epochs.get(flt) if lingered else None
                ep.append(kept or (int(self._store.max_offset), int(time.time() * 1000)))
                return ep[0]
            try:
                n = self.registry.register(flt, epoch)     # the count and the epoch in one write
            except BaseException:
                self._linger_again(lingered)
                raise
            if ep:
                self._epochs[flt] = ep[0]
            return n

    def register_filters(self, filters) -> None:
        """register_filter for many filters in one metadata write (e.g. restoring sessions)."""
        fl = list(filters)
        with self._filters_lock:
            lingered = self._take_back(fl)
            if self.before_register is not None and any(
                    is_wildcard(f) and not self.registry.refcount(f) and f not in lingered for f in fl):
                self.before_register()
            try:
                self.registry.register_many(fl)
            except BaseException:
                self._linger_again(lingered)
                raise
            for f in set(fl):
                if is_wildcard(f) and self.metadata.get_filter_epoch(f) is None:
                    self._resume_epoch(f, f in lingered)

    def set_filter_counts(self, counts: dict[str, int]) -> None:
        """Set filters' reference counts (each > 0) as given (`FilterRegistry.set_counts`); a
        wildcard filter registered anew starts its epoch, as with `register_filters`."""
        with self._filters_lock:
            lingered = self._take_back([f for f, n in counts.items() if n > 0])
            fresh = [f for f, n in counts.items() if n > 0 and is_wildcard(f) and not self.registry.refcount(f)]
            if self.before_register is not None and any(f not in lingered for f in fresh):
                self.before_register()
            failed: Exception | None = None
            try:
                self.registry.set_counts(counts)        # held in memory even when the write fails
            except Exception as e:  # noqa: BLE001 - raised below, once the epochs are started
                failed = e
            for f in fresh:
                try:
                    if self.metadata.get_filter_epoch(f) is None:
                        self._resume_epoch(f, f in lingered)
                except Exception as e:  # noqa: BLE001 - the epoch is held in memory; raised below
                    failed = failed or e
            if failed is not None:
                raise failed

    def unregister_filter(self, flt: str, *, drop_queue: bool = True) -> int:
        """Drop one reference. A wildcard filter at 0 stays indexed for `filter_linger_s` (a
        registration meanwhile takes it back, its queue whole: `__init__` says why), then
        leaves the trie and its queue is dropped (at once when the linger is 0)."""
        if not is_wildcard(flt):
            return self.registry.unregister(flt)
        with self._filters_lock:
            held = self.registry.refcount(flt) > 0
            linger = held and self.filter_linger_s > 0
            n = self.registry.unregister(flt, keep_indexed=linger)
            if n > 0 or flt in self._lingering:
                return n
            if linger:
                # the epoch is kept here for a registration that takes the filter back; its
                # written copy went with the count (`FilterRegistry.unregister`): a store
                # restarting meanwhile does not index the filter until then
                self._lingering[flt] = time.monotonic() + self.filter_linger_s
                self._arm_linger()
                return 0
            self._epochs.pop(flt, None)
            if drop_queue:
                self.index.drop_queue(flt)
            return n

    def lingering(self) -> list[str]:
        """The wildcard filters let go by their last holder and still indexed (`filter_linger_s`)."""
        with self._filters_lock:
            return list(self._lingering)

    def _take_back(self, filters) -> dict[str, float]:
        """Those of `filters` lingering (with their deadlines): no longer, they are registered
        again. Caller holds _filters_lock."""
        out = {}
        for f in filters:
            d = self._lingering.pop(f, None)
            if d is not None:
                out[f] = d
        return out

    def _linger_again(self, lingered: dict[str, float]) -> None:
        """A registration that took `lingered` back failed: they linger on as before."""
        for f, d in lingered.items():
            if self.registry.refcount(f) == 0:
                self._lingering[f] = d
        self._arm_linger()

    def _arm_linger(self) -> None:
        """Start the timer for the first lingering filter's deadline, unless one is set."""
        if self._linger_timer is not None or not self._lingering or self._closed:
            return
        first = next(iter(self._lingering.values()))
        t = threading.Timer(max(0.0, first - time.monotonic()), self._drop_lingering)
        t.daemon = True
        t.name = "lmqtt-lq-linger"
        self._linger_timer = t
        t.start()

    def _drop_lingering(self) -> None:
        """The timer: every lingering filter whose time is up leaves the trie, its queue dropped."""
        with self._filters_lock:
            self._linger_timer = None
            if self._closed:
                return
            now = time.monotonic()
            while self._lingering:
                flt, deadline = next(iter(self._lingering.items()))
                if deadline > now:
                    break
                del self._lingering[flt]
                if self.registry.refcount(flt) > 0:
                    continue                    # counted again (a new primary's registry, read again)
                self.registry.forget(flt)
                self._epochs.pop(flt, None)
                try:
                    self.index.drop_queue(flt)
                    log.debug("event=filter_dropped filter=%s linger_s=%g", flt, self.filter_linger_s)
                except Exception as e:  # noqa: BLE001 - its entries stay (retention deletes them)
                    log.error("event=filter_drop_failed filter=%r error=%r (no longer indexed; its entries stay "
                              "until retention deletes them)", flt, e)
            self._arm_linger()

    def _start_epoch(self, flt: str) -> None:
        ep = (int(self._store.max_offset), int(time.time() * 1000))
        self._epochs[flt] = ep
        self.metadata.put_filter_epoch(flt, *ep)

    def _resume_epoch(self, flt: str, lingered: bool) -> None:
        """The epoch of `flt` registered anew: the one it had if it was lingering (its queue
        held every matching record all along), else a new one from the log's end."""
        ep = self._epochs.get(flt) if lingered else None
        if ep is None:
            self._start_epoch(flt)
        else:
            self.metadata.put_filter_epoch(flt, *ep)

    def filter_epoch(self, flt: str) -> tuple[int, int] | None:
        """(CommitLog position, ms) since when `flt`'s light queue holds every matching record, while
        it stays registered; None if unknown (not registered, or registered before epochs were kept)."""
        ep = self._epochs.get(flt)
        if ep is None and self.registry.refcount(flt) > 0:
            ep = self.metadata.get_filter_epoch(flt)
            if ep is not None:
                self._epochs[flt] = ep
        return ep

    # ------------------------------------------------------------ subscribing from the past
    def forget_epochs(self) -> None:
        """Read every filter's epoch from the metadata again on its next use (a new primary serves
        what the previous one shipped)."""
        self._epochs.clear()

    def replay_plan(self, flt: str, since_ms: int, wait_s: float = 5.0) -> dict:
        """Where the history of `flt` since `since_ms` is (lightqueue/replay.py `plan`). Call after
        registering a wildcard `flt`; waits (up to `wait_s`) until dispatch passed the log's end, so
        the seam's both sides are final. Raises replay.ReplayRefused outside retention."""
        st = self._store
        target = st.max_offset
        if st.dispatched_offset < target and not st.wait_dispatched(target, wait_s):
            raise replay.ReplayRefused("the store's dispatch is behind; try again")
        return replay.plan(st, self, flt, since_ms)

    def replay_read(self, cursor: dict, max_count: int = 1024, max_bytes: int = 4 << 20):
        """The next history messages of a `replay_plan` cursor: (messages, cursor, done)."""
        return replay.read_history(self._store, cursor, max_count, max_bytes)

    # ------------------------------------------------------------ reads
    def min_offset(self, queue: str) -> int:
        return self.index.min_offset(queue)

    def max_offset(self, queue: str) -> int:
        return self.index.max_offset(queue)

    def pull(self, queue: str, offset: int, max_count: int = 32, max_bytes: int = 1 << 20) -> PullResult:
        """Messages of `queue` from `offset` (clamped up to min_offset); unknown queue -> empty.

        Returns at least one message when one is available, even if it alone exceeds max_bytes.
        `max_bytes` counts CommitLog record sizes (payload + topic + properties + header).
        The messages are the cache's immutable StoredMessages (named tuples), shared with every
        other reader; one whose cached `.queue_offset` is another queue's gets a new tuple
        carrying this queue's offset (its fields, payload included, are shared, never copied).
        """
        index = self.index
        lo = index.min_offset(queue)
        hi = index.max_offset(queue)
        if offset < lo:
            offset = lo
        if offset >= hi or max_count <= 0:
            return PullResult([], offset, lo, hi)
        min_phys = index.min_phys
        if min_phys > self._cache_min_phys:
            self.cache.drop_below(min_phys)
            self._cache_min_phys = min_phys
        visible = self._store.dispatched_offset
        # 1. which entries: visible, within max_bytes (at least one), not below the log start
        take = []
        nbytes = 0
        nxt = offset
        for e in index.read_raw(queue, offset, max_count):
            qoff, phys, size = e
            if phys >= visible:
                break
            if take and nbytes + size > max_bytes:
                break
            nxt = qoff + 1
            if phys < min_phys:
                continue   # its segment is gone: skip, never an error
            take.append(e)
            nbytes += size
        if not take:
            return PullResult([], nxt, lo, hi)
        # 2. the messages: cache hits for the whole batch under one lock, then the misses
        cache = self.cache
        msgs = cache.get_many([e[1] for e in take])
        if None in msgs:
            miss = [i for i, m in enumerate(msgs) if m is None]
            st = self._store
            loaded = cache.load_many([(take[i][1], take[i][2]) for i in miss], st.read,
                                     getattr(st, "read_many", None))
            for i, m in zip(miss, loaded):
                if isinstance(m, BaseException):
                    e = take[i]
                    # deleted while we were reading (the store removes files before it tells us)
                    if e[1] < max(index.min_phys, self._store.min_offset):
                        m = None
                    else:
                        raise LightQueueError(f"pull {queue!r} offset {e[0]}: store read at "
                                              f"{e[1]} failed: {m}") from m
                msgs[i] = m
        out = []
        append = out.append
        new = tuple.__new__
        for e, m in zip(take, msgs):
            if m is None:
                continue
            qoff = e[0]
            if m[5] != qoff:     # .queue_offset: this queue's offset on a shared message
                m = new(StoredMessage, m[:5] + (qoff,) + m[6:])
            append(m)
        return PullResult(out, nxt, lo, hi)

    def pull_raw(self, queue: str, offset: int, max_count: int, max_bytes: int):
        """The entries of `queue` from `offset` as the CommitLog's own record bytes, for a PUSH to
        a gateway (store/node/gateway_service.py): -> (first queue offset, [(phys, record count,
        bytes)], sizes) covering consecutive queue offsets from `offset`, ([], ()) when nothing
        is visible there, or None when this path cannot serve them (an entry below the log start,
        a record it cannot check): the caller sends a hint and the gateway pulls, which reports
        and skips. Same limits as `pull` (visible only, `max_bytes` of records, at least one)."""
        if getattr(self._store, "clog", None) is None:
            return None
        index = self.index
        piece = index.tail_piece(queue, offset, max_count)
        if piece is not None:       # the usual case, a push: one C call over the tail's entries
            return raw_piece(self._store, piece, offset, self._store.dispatched_offset, max_bytes, index.min_phys)
        entries = index.read_raw(queue, offset, max_count)
        if not entries or entries[0][0] != offset:
            return None if entries else (offset, [], ())
        visible = self._store.dispatched_offset
        min_phys = index.min_phys
        take = []
        sizes = []
        nbytes = 0
        for qoff, phys, size in entries:
            if phys >= visible or qoff != offset + len(take):     # the frame says first + i
                break
            if phys < min_phys:
                return None
            if take and nbytes + size > max_bytes:
                break
            take.append((phys, size))
            sizes.append(size)
            nbytes += size
        if not take:
            return offset, [], ()
        runs = raw_runs(self._store, take)
        if runs is None:
            return None
        return offset, runs, sizes

    # ------------------------------------------------------------ new-data hooks
    def add_listener(self, fn: Callable[[set[str]], None]) -> None:
        """fn(queue_names) after each dispatch batch, on the dispatch thread; keep it short."""
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[set[str]], None]) -> None:
        try:
            self._listeners.remove(fn)
        except ValueError:
            pass

    def _on_dispatched(self, dispatched_offset: int) -> None:
        touched = self.index.take_touched()
        if not touched:
            return
        if self._data_waiters:    # the Condition costs ~0.5 us a batch: taken only for a waiter
            with self._cond:
                self._cond.notify_all()
        for fn in list(self._listeners):
            try:
                fn(touched)
            except Exception:   # a broken listener must not stop dispatch
                log.exception("light-queue listener %r failed", fn)

    def wait_for_data(self, queue: str, offset: int, timeout: float) -> bool:
        """Block until `queue` has an entry at `offset` readable, or `timeout` seconds pass."""
        def ready() -> bool:
            return self.index.max_offset(queue) > offset
        with self._cond:
            # counted before `ready` is first checked: _on_dispatched moves the index before it
            # reads this count, so either this check sees the new entry or it sees a waiter
            self._data_waiters += 1
            try:
                return self._cond.wait_for(ready, timeout)
            finally:
                self._data_waiters -= 1

    # ------------------------------------------------------------ after a recovery
    def _check_after_recovery(self, store) -> None:
        """Called by the store's start() before anything can be appended. If the log was cut since
        the offsets were last checked (store/recovery.py: the store's recoveries newer than the
        generation kept in the metadata), every committed offset (persistent sessions, shared
        groups) beyond its queue's end at the cut is reset to that end with a WARNING: left there,
        the consumer would skip the new messages appended at the offsets below it. Wildcard
        filters' epochs beyond the cut move back to it (the queue holds every record from there)."""
        md = self.metadata
        recoveries = store.recoveries
        checked = md.recovery_checked()
        if checked == recoveries.generation:
            return
        cut = recoveries.cut_since(checked)
        if cut is not None:
            ends: dict[str, int] = {}
            resets: dict[str, dict[str, int]] = {}
            for consumer, queue, off in md.iter_offsets():
                end = ends.get(queue)
                if end is None:
                    end = ends[queue] = self.index.end_at(queue, cut)
                if off > end:
                    store.offset_reset(consumer, queue, off, end)
                    resets.setdefault(consumer, {})[queue] = end
            for consumer, offs in resets.items():
                md.set_offsets(consumer, offs)
            # A session record's gateway-private state (`extra`, all but the gateway id) may hold log
            # positions of its own: the QoS 1/2 exchanges in flight and where delivery stood
            # (gateway/clients/session_persistence.py). Past a cut they name offsets that now hold other
            # messages, or none: dropped, so the session resumes from its committed offsets (reset
            # above): the messages after them come again, none is skipped.
            dropped = 0
            for rec in md.list_sessions():
                if rec.extra and set(rec.extra) - {HOST}:
                    rec.extra = {k: v for k, v in rec.extra.items() if k == HOST}
                    md.put_session(rec.client_id, rec)
                    dropped += 1
            if dropped:
                log.warning("light queues: the in-flight state kept in %d session record(s) dropped after the log "
                            "was cut at %d: those sessions resume from their committed offsets", dropped, cut)
            for flt, (phys, ms) in md.filter_epochs().items():
                if phys > cut:
                    log.warning("filter %s: epoch at CommitLog offset %d beyond the log's end %d after recovery: "
                                "moved to %d", flt, phys, cut, cut)
                    md.put_filter_epoch(flt, cut, ms)
                    self._epochs.pop(flt, None)
            log.info("light queues: consumer offsets checked against the recovered log (recoveries %d..%d, "
                     "log cut at %d): %d reset", checked + 1, recoveries.generation, cut,
                     sum(len(o) for o in resets.values()))
        md.set_recovery_checked(recoveries.generation)

    # ------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the index and the metadata DB (shut the store down first)."""
        if self._closed:
            return
        with self._filters_lock:
            self._closed = True
            if self._linger_timer is not None:
                self._linger_timer.cancel()
                self._linger_timer = None
        self.index.close()
        self.metadata.close()
