"""`MessageStore`: the in-process API of the store (see docs/internals.md for the contract).

It wires the parts together: CommitLog (append/read/recovery), the flush services (what "durable"
means per flush mode), the dispatch stage with the built-in ConsumeQueue and key-index dispatchers
plus any added ones (light queues, notify), retention and the disk high-water mark.
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time

from .async_append import AsyncAppend      # append_async, append_batch_async
from .atomic_file import write_atomic
from .checkpoint import OffsetCheckpoint
from .commitlog import CommitLog
from .config import StoreConfig
from .consume_queue import DB_DIR as CQ_DB_DIR, ConsumeQueueStore
from .dispatch import DispatchService
from .file_budget import FileBudget
from .errors import CorruptRecord, NotVisible, StoreClosed, StoreError, is_disk_full
from .flush import BackgroundService, GroupCommitService
from .index_file import IndexService
from .prefault import Prefaulter
from .message import AppendResult, Message, ResolvedFuture, StoredMessage
from .record import first_level
from .recovery import RecoveryEvent, RecoveryLog, offset_reset_message
from .mapped_file import file_name
from . import commitlog, retention

log = logging.getLogger("lmqtt.store")

IDENT_FILE = "identity"


def _load_identity(data_dir: str) -> str:
    """16 hex digits, random once per data directory, persisted: the first half of every msg id."""
    path = os.path.join(data_dir, IDENT_FILE)
    try:
        with open(path, encoding="ascii") as f:
            ident = f.read().strip()
        if len(ident) == 16:
            int(ident, 16)
            return ident
    except (FileNotFoundError, ValueError):
        pass
    ident = secrets.token_hex(8).upper()
    write_atomic(path, ident.encode("ascii"))
    return ident


class MessageStore(AsyncAppend):
    def __init__(self, cfg: StoreConfig) -> None:
        self.cfg = cfg
        os.makedirs(cfg.data_dir, exist_ok=True)
        self.ident = _load_identity(cfg.data_dir)
        self.clog = CommitLog(cfg, self.ident)
        self._coalesce: dict = {}  # event loop -> [(Message, loop future)] waiting for this tick's batch
        # the store's share of the process's open files, and how it is spent (store/file_budget.py)
        self.budget = FileBudget.for_process(cfg.max_open_files)
        self.consume_queues = ConsumeQueueStore(os.path.join(cfg.data_dir, CQ_DB_DIR), cfg.cq_block_entries,
                                                max_open_files=self.budget.rocksdb_tables)
        self.index = IndexService(os.path.join(cfg.data_dir, "index"), cfg.index_slots, cfg.index_entries,
                                  cfg.preallocate)
        self._dispatchers: list = [self.consume_queues, self.index]
        self._clog_ckpt = OffsetCheckpoint(os.path.join(cfg.data_dir, "commitlog.checkpoint"))
        self.dispatch = DispatchService(self.clog, self._dispatchers, cfg.dispatch_chunk_bytes,
                                        cfg.dispatcher_flush_interval_ms, cfg.dispatch_max_batch)
        self.group_commit = GroupCommitService(self.clog, cfg.group_commit_gather_ms) if cfg.flush_mode == "sync" else None
        self.clog.group_commit = self.group_commit
        self.background = BackgroundService(self)
        self.prefault = Prefaulter(self.clog, cfg.prefault_bytes)
        self._running = False
        self._closed = False
        self._sync = cfg.flush_mode == "sync"
        self._backpressure = cfg.dispatch_backpressure_bytes
        self._bp_wait = cfg.dispatch_backpressure_max_wait_ms / 1000.0
        self._inline = cfg.dispatch_inline
        self.recovered_end = 0
        # recoveries that cut the log (store/recovery.py); `recovery`: this start's, if it cut
        self.recoveries = RecoveryLog(cfg.data_dir)
        self.recovery: RecoveryEvent | None = None
        self.offsets_reset = 0        # consumer offsets brought back to their queue's end (stats)
        self._recovery_listeners: list = []
        # queue kind -> fn(name, phys): the queue's end when the log ended at phys (queue_end_at)
        self._queue_kinds: dict = {"cq": self._cq_end_at}
        self._state_lock = threading.Lock()
        self.delayed = None          # DelayedMessages once enable_delayed() was called
        # store/ha: why appends are refused on this member (a replica), None when they are taken;
        # what a cut of the log before start() was (the recovery's line names it instead of a loss)
        self.refuse_appends: str | None = None
        self.cut_reason: str | None = None
        self._commit_wake = self.group_commit.wake if self.group_commit else None
        self._gate = None
        self.tier = None             # store/tier TierService once enable_tier() was called

    # ------------------------------------------------------------------ lifecycle
    def add_dispatcher(self, d) -> None:
        """Register a further dispatcher (light queues, notify). Must be called before start()."""
        if self._running:
            raise StoreError("add_dispatcher must be called before start()")
        for attr in ("name", "checkpoint", "dispatch", "flush", "truncate", "on_segments_deleted", "close"):
            if not hasattr(d, attr):
                raise TypeError(f"dispatcher {d!r} lacks {attr!r} (see the Dispatcher protocol)")
        self._dispatchers.append(d)

    def enable_tier(self, tier_cfg) -> None:
        """Tiered storage (store/tier, docs/store.md "Tiered storage"): sealed CommitLog segments
        are uploaded to `tier_cfg.url` in the background and read back from there once local
        retention deleted them. Must be called before start(); ValueError for a bad URL/option."""
        if self._running:
            raise StoreError("enable_tier must be called before start()")
        from .tier.service import TierService
        self.tier = TierService(self, tier_cfg)
        self.clog.tier = self.tier

    def add_recovery_listener(self, fn) -> None:
        """`fn(store)` is called once by start(), after recovery and re-dispatch, before any append
        can happen: where the light queues check their consumer offsets against the recovered
        queues (`recoveries`, `queue_end_at`). Must be called before start()."""
        if self._running:
            raise StoreError("add_recovery_listener must be called before start()")
        self._recovery_listeners.append(fn)

    def add_queue_kind(self, kind: str, end_at) -> None:
        """Make `queue_end_at(kind, name, phys)` answer for queues of `kind` ("lq": the light
        queues register theirs): `end_at(name, phys)` -> the queue's end when the log ended at phys."""
        self._queue_kinds[kind] = end_at

    def start(self) -> None:
        """Open, recover (CRC tail check, cut torn record), re-dispatch, start the threads."""
        if self._running:
            return
        if self._closed:
            raise StoreClosed("a shut-down MessageStore cannot be restarted; create a new one")
        t0 = time.monotonic()
        self.clog.mfq.load()
        if self.tier is not None:
            self.tier.load()      # offloaded ranges are readable (min_offset) before anyone asks
        self.consume_queues.load(self.clog.mfq.min_offset)    # (a queue without its name replays from here)
        self.index.load()
        self.recoveries.load()
        ckpts = [d.checkpoint() for d in self._dispatchers]
        clog_ckpt = self._clog_ckpt.load(0)
        scan_from = min(ckpts + [clog_ckpt])
        recorded = max(ckpts + [clog_ckpt])
        # before recover() cuts anything: is a segment the checkpoints point into missing?
        seg = self.clog.mfq.file_size
        missing = (self.clog.mfq.find(recorded - 1) is None and recorded > self.clog.mfq.min_offset)
        end = self.clog.recover(scan_from, trusted_end=clog_ckpt)
        self.recovered_end = end
        if end < recorded or self.clog.tail_cut:
            # written down (durably) before any checkpoint is lowered: the holders of consumer
            # offsets check theirs against the cut queues, now or whenever they open next
            self.recovery = self.recoveries.add(end, recorded, clog_ckpt, self.clog.tail_cut)
            if end < recorded:
                self._report_lost(end, recorded, clog_ckpt, ckpts,
                                  (recorded - 1) - (recorded - 1) % seg if missing else None)
        log_min = self.clog.mfq.min_offset
        for d in self._dispatchers:
            d.truncate(min(d.checkpoint(), end))
        start = max(min(d.checkpoint() for d in self._dispatchers), log_min)
        self.dispatch.set_start(start)
        self.dispatch.catch_up()
        self.dispatch.flush_dispatchers()
        self.clog.queue_table.update(self.consume_queues.max_offsets())
        self.clog.enable_live(self.dispatch.dispatched)
        self._clog_ckpt.save(self.clog.flushed)
        for fn in self._recovery_listeners:
            fn(self)          # nothing can be appended yet: the queues end where recovery left them
        self.check_disk()
        if self.tier is not None:
            self.tier.start()
        if self.group_commit:
            self.group_commit.start()
        self.dispatch.start()
        self.background.start()
        self.prefault.start()
        self._running = True
        log.info("store %s started: log [%d, %d), replayed from %d in %.3fs, %d corrupt range(s), "
                 "%s record encoder", self.cfg.data_dir, log_min, end, start, time.monotonic() - t0,
                 len(self.clog.corrupt_ranges), commitlog.ENCODER)

    def _report_lost(self, end: int, recorded: int, flushed: int, ckpts: list, missing_seg: int | None) -> None:
        """The loud line of a recovery that found less than the checkpoints recorded."""
        who = ", ".join(f"{d.name} {c}" for d, c in zip(self._dispatchers, ckpts))
        if self.cut_reason:
            log.warning("store recovery: the log was cut at %d on purpose (%s): %d bytes after it are gone, "
                        "queues are cut back to it (dispatched: %s); consumer offsets beyond their queue's end "
                        "are reset to it (recovery %d)", end, self.cut_reason, recorded - end, who,
                        self.recovery.generation)
            return
        where = ""
        if missing_seg is not None:
            where = (f"; the segment file {os.path.join(self.clog.mfq.dir, file_name(missing_seg))} "
                     f"holding offset {recorded - 1} is missing")
        if flushed > end:
            log.error("store recovery: the checkpoints recorded %d bytes of CommitLog (flushed offset %d; "
                      "dispatched: %s) but only %d were found: %d bytes of messages that were fsynced and "
                      "acknowledged are lost (disk or file damage: a segment file truncated, emptied, replaced "
                      "or deleted?)%s. Queues are cut back to the log; consumer offsets beyond their queue's "
                      "end are reset to it (recovery %d, %s)", recorded, flushed, who, end, recorded - end,
                      where, self.recovery.generation, self.recoveries.path)
        else:
            log.warning("store recovery: the dispatch checkpoints recorded %d bytes of CommitLog (%s; flushed "
                        "offset %d) but only %d were found: %d bytes of messages that were not yet fsynced are "
                        "lost, and consumers may have read some of them (power loss, or disk or file damage?)%s. "
                        "Queues are cut back to the log; consumer offsets beyond their queue's end are reset to "
                        "it (recovery %d, %s)", recorded, who, flushed, end, recorded - end, where,
                        self.recovery.generation, self.recoveries.path)

    # ------------------------------------------------------------------ after a recovery that cut the log
    def queue_end_at(self, kind: str, name: str, phys: int) -> int | None:
        """The end (next queue offset) a queue had when the CommitLog ended at `phys`: how many of
        its entries point below phys. `kind` "cq": `name` is "<first-level topic>\\0<queue id>";
        "lq": a light queue (when the light queues registered, see add_queue_kind). None for an
        unknown kind."""
        fn = self._queue_kinds.get(kind)
        return None if fn is None else fn(name, phys)

    def _cq_end_at(self, name: str, phys: int) -> int:
        topic, _, qid = name.rpartition("\0")
        return self.consume_queues.end_at(topic, int(qid), phys)

    def offset_reset(self, consumer: str, queue: str, offset: int, end: int) -> None:
        """Log (WARNING) and count one consumer offset brought back to its queue's end."""
        self.offsets_reset += 1
        log.warning("%s", offset_reset_message(consumer, queue, offset, end))

    def shutdown(self) -> None:
        """Flush everything, checkpoint, stop threads, close files."""
        with self._state_lock:
            if not self._running:
                if not self._closed:
                    self._closed = True
                    self._close_files()
                return
            self._running = False
            self._closed = True
        if self.delayed is not None:
            try:
                self.delayed.close()         # stop firing before the log closes
            except Exception:
                log.exception("store shutdown: closing the timer wheel failed")
        self.background.stop()
        self.prefault.stop()
        if self.tier is not None:
            self.tier.stop()
        if self.clog.buffered:
            self.clog.commit()
        if self.group_commit:
            self.group_commit.stop()
        self.clog.flush()
        self.dispatch.stop()
        try:
            self.dispatch.catch_up()
            self.dispatch.flush_dispatchers()
        except Exception as e:
            if is_disk_full(e):   # one line: the disk-full episode was logged already
                log.error("store shutdown: final dispatch failed (disk full: %s); it will be replayed on the "
                          "next start", e)
            else:
                log.exception("store shutdown: final dispatch failed; it will be replayed on the next start")
        try:
            self._clog_ckpt.save(self.clog.flushed)
        except OSError as e:      # a full disk: the files must still be closed (and flushed)
            log.error("store shutdown: cannot save the CommitLog checkpoint (%s); the next start checks "
                      "the log from the previous one", e)
        self._close_files()

    def enable_delayed(self, route=None, loop=None):
        """Delayed messages on this store (store/delayed.py): the timer wheel under
        `<data_dir>/timer`, rebuilt from its TimerLog and firing from now on. Call after start();
        `route(topic) -> dispatch queues` fills a released message's light-queue list at firing
        time, `loop` is the event loop making the store's other appends (DelayedMessages). A second
        call returns the same object (the first caller's route and loop stay)."""
        with self._state_lock:
            if self.delayed is None:
                if not self._running:
                    raise StoreClosed("enable_delayed needs a running store (call start() first)")
                from .delayed import DelayedMessages
                routed = None
                if route is not None:
                    def routed(m, route=route):
                        m.dispatch_queues = tuple(route(m.topic))
                        return m
                d = DelayedMessages(self, os.path.join(self.cfg.data_dir, "timer"), route=routed, loop=loop,
                                    precision_ms=self.cfg.timer_precision_ms,
                                    max_delay_ms=self.cfg.timer_max_delay_ms)
                d.start()
                self.delayed = d
                log.info("timer wheel started: %d pending, precision %d ms", d.wheel.pending, d.wheel.precision)
            return self.delayed

    def _close_files(self) -> None:
        for d in self._dispatchers:
            try:
                d.close()
            except Exception:
                log.exception("closing dispatcher %s", getattr(d, "name", d))
        self.clog.close()

    def __enter__(self) -> "MessageStore":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ append
    def append(self, msg: Message, dispatch: bool = True) -> AppendResult:
        """Append one message (fast path of append_batch([msg])[0])."""
        if not self._running:
            raise StoreClosed("store is not running (call start(), or it was shut down)")
        if self.refuse_appends is not None:
            raise StoreError(self.refuse_appends)
        if self._sync:
            r, end = self.clog.append_one(msg, None, self.ident)
            self._commit_wake()
        else:
            fut = ResolvedFuture(None)
            r, end = self.clog.append_one(msg, fut, self.ident)
            fut._result = end
        if dispatch:
            self._after_append()
        return r

    def append_batch(self, msgs, dispatch: bool = True) -> list[AppendResult]:
        """Append all of `msgs` (one lock, one copy into the map) or none of them.

        `dispatch=False`: the records reach the light queues at the caller's `dispatch_appended()`
        instead of before this returns. The MQTT publish path writes its PUBACKs in between: in
        `async` mode the ack means "in the map", and the inline dispatch (RocksDB index writes, the
        larger part of a small append) need not delay it; a crash before the dispatch loses
        nothing, recovery dispatches from the CommitLog as it does for the dispatch thread."""
        if not self._running:
            raise StoreClosed("store is not running (call start(), or it was shut down)")
        if not isinstance(msgs, (list, tuple)):
            msgs = list(msgs)
        if len(msgs) == 1:
            return [self.append(msgs[0], dispatch)]
        if self.refuse_appends is not None:
            raise StoreError(self.refuse_appends)
        if self._sync:
            results, end = self.clog.append_batch(msgs, None, self.ident)
            self._commit_wake()
        else:
            fut = ResolvedFuture(None)
            results, end = self.clog.append_batch(msgs, fut, self.ident)
            fut._result = end  # resolved on creation; the end offset is known only now
        if dispatch:
            self._after_append()
        return results

    def dispatch_appended(self) -> None:
        """Dispatch what `append_batch(..., dispatch=False)` appended (inline, or the dispatch
        thread woken). Any later append's dispatch covers it too: dispatch goes by log offset."""
        self._after_append()

    def _after_append(self) -> None:
        """Hand the new records to dispatch, and hold the appender back while dispatch is more than
        `dispatch_backpressure_bytes` behind: appender and dispatch share one GIL, and without
        this a tight append loop wins and visibility lag grows without bound. Only committed data
        can be dispatched (async+buffer commits every 200 ms)."""
        if not (self._inline and self.dispatch.try_inline()):
            self.dispatch.wake()
        bp = self._backpressure
        if bp:
            committed = self.clog.committed
            if committed - self.dispatch.dispatched > bp:
                self.dispatch.wait_for(committed - bp // 2, self._bp_wait)

    def use_ack_gate(self, gate) -> None:
        """store/ha: the durable future of every append from now on is `gate.current` (read under the
        CommitLog lock, as the group commit's), resolved when the replicas have acknowledged it
        (store/ha/ack_gate.py AckGate); None goes back to the flush mode's own futures."""
        with self.clog.lock:
            self._gate = gate
            gc = self.group_commit
            if gate is None:
                self.clog.group_commit = gc
                self._sync = self.cfg.flush_mode == "sync"
                self._commit_wake = gc.wake if gc else None
            else:
                self.clog.group_commit = gate

                def wake(gc=gc, gate=gate):
                    if gc is not None:
                        gc.wake()
                    gate.wake()
                self._commit_wake = wake
                self._sync = True

    # ------------------------------------------------------------------ read
    @property
    def dispatched_offset(self) -> int:
        return self.dispatch.dispatched

    @property
    def min_offset(self) -> int:
        """The first readable offset (with a tier: the tier's first segment)."""
        return self.clog.min_readable

    @property
    def max_offset(self) -> int:
        """End of appended data (not necessarily visible yet)."""
        return self.clog.wrote

    @property
    def flushed_offset(self) -> int:
        return self.clog.flushed

    def read(self, phys_offset: int, size: int | None = None) -> StoredMessage:
        """The record at `phys_offset` (CRC checked). Only offsets below the dispatched offset are
        served; raises NotVisible otherwise and CorruptRecord if the record fails its check."""
        if phys_offset >= self.dispatch.dispatched or phys_offset < self.clog.min_readable or phys_offset < 0:
            raise NotVisible(f"offset {phys_offset} is not visible (log [{self.clog.min_readable}, "
                             f"{self.dispatch.dispatched}) dispatched)")
        return self.clog.read(phys_offset, size)

    def read_many(self, wanted: list) -> list:
        """`read(phys, size)` for each (phys, size) of `wanted`, in one call: a StoredMessage per
        item, or the exception that read would have raised (NotVisible, CorruptRecord), returned,
        not raised (CommitLog.read_many: one decode call per segment's run of records)."""
        visible = self.dispatch.dispatched
        lo = self.clog.min_readable
        if all(lo <= w[0] < visible for w in wanted):
            return self.clog.read_many(wanted)
        ok = [w for w in wanted if lo <= w[0] < visible]
        got = iter(self.clog.read_many(ok))
        return [next(got) if lo <= p < visible else
                NotVisible(f"offset {p} is not visible (log [{lo}, {visible}) dispatched)") for p, _ in wanted]

    def read_consume_queue(self, topic: str, queue_id: int, from_queue_offset: int,
                           max_count: int) -> list[StoredMessage]:
        """Messages of the first-level-topic ConsumeQueue of `topic` (`a/b` reads queue `a`)."""
        cq = self.consume_queues.get(topic, queue_id)
        if cq is None or max_count <= 0:
            return []
        visible = self.dispatch.dispatched
        out = []
        try:
            entries = cq.range(from_queue_offset, max_count)
        except ValueError:  # a file was deleted by retention meanwhile
            entries = cq.range(max(from_queue_offset, cq.min_offset), max_count)
        for qoff, phys, size, _tags in entries:
            if phys >= visible:
                break
            try:
                out.append(self.clog.read(phys, size))
            except CorruptRecord as e:
                log.error("consumequeue %s/%d offset %d: %s (skipped)", first_level(topic), queue_id, qoff, e)
            except NotVisible:
                continue
        return out

    def consume_queue_offsets(self, topic: str, queue_id: int) -> tuple[int, int]:
        """(min, max) queue offsets of the ConsumeQueue of `topic`; max = next offset to be written."""
        cq = self.consume_queues.get(topic, queue_id)
        return (cq.min_offset, cq.max_offset) if cq else (0, 0)

    def get_by_msg_id(self, msg_id: str) -> StoredMessage | None:
        """Decode `msg_id` (store identity + physical offset) and read directly; None if the id is
        not from this store or the offset is not visible. CorruptRecord if the record is bad."""
        if not isinstance(msg_id, str) or len(msg_id) != 32 or msg_id[:16].upper() != self.ident:
            return None
        try:
            phys = int(msg_id[16:], 16)
        except ValueError:
            return None
        try:
            return self.read(phys)
        except NotVisible:
            return None

    def query_by_key(self, topic: str, key: str, begin_ms: int, end_ms: int, max_count: int) -> list[StoredMessage]:
        """Messages of exactly `topic` carrying `key`, stored within [begin_ms, end_ms], newest first."""
        visible = self.dispatch.dispatched
        out = []
        for phys in self.index.query(topic, key, begin_ms, end_ms, max_count * 4 + 16):
            if phys >= visible or phys < self.clog.min_readable:
                continue
            try:
                m = self.clog.read(phys)
            except (CorruptRecord, NotVisible):
                continue
            if m.topic == topic and key in m.keys and begin_ms <= m.store_ts <= end_ms:  # real key check
                out.append(m)
                if len(out) >= max_count:
                    break
        return out

    def keep_recent(self, max_bytes: int = 16 << 20, max_records: int = 65_536) -> None:
        """Keep the most recently appended records in memory (as appended: topic, body, props ...)
        so that `read` of a record just written returns it without re-reading, CRC-checking and
        decoding the CommitLog, for a reader of single records near the head (`read_many`, what
        the light queues read with, does not look there).
        Visibility rules are unchanged (`read` still serves only dispatched offsets). 0 = off."""
        self.clog.keep_recent(max_bytes, max_records)

    def add_dispatch_listener(self, fn) -> None:
        """`fn(dispatched_offset)` is called from the dispatch thread after each batch."""
        self.dispatch.listeners.append(fn)

    def wait_dispatched(self, offset: int, timeout: float | None = None) -> bool:
        """Block until everything below `offset` is visible (tests, tools). False on timeout."""
        return self.dispatch.wait_for(offset, timeout)

    def stats(self) -> dict:
        """Counters for metrics (the gateway exports them to Prometheus): offsets, dispatch lag,
        fsync rounds, disk state. Cheap: attribute reads only."""
        clog = self.clog
        return {
            "min_offset": clog.mfq.min_offset, "max_offset": clog.wrote, "committed_offset": clog.committed,
            "flushed_offset": clog.flushed, "dispatched_offset": self.dispatch.dispatched,
            "dispatch_lag_bytes": clog.committed - self.dispatch.dispatched,
            "group_commit_rounds": self.group_commit.flushes if self.group_commit else 0,
            "segments": len(clog.mfq.files), "corrupt_ranges": len(clog.corrupt_ranges),
            # disk_full (refusing now), disk_full_reason, disk_full_causes, disk_full_refused
            # (messages refused so far), disk_full_episodes, disk_free_bytes: store/disk_space.py
            **clog.disk.stats(),
            "dispatch_error": repr(self.dispatch.error) if self.dispatch.error else None,
            # delayed messages (None until enable_delayed): pending timers, fired, rolled
            "timers_pending": self.delayed.wheel.pending if self.delayed is not None else None,
            "timers_fired": self.delayed.wheel.fired_total if self.delayed is not None else None,
            # recoveries that cut the log (store/recovery.py): how many so far in this data dir,
            # the bytes this start found missing below the checkpoints, consumer offsets reset
            "recoveries": self.recoveries.generation,
            "recovery_lost_bytes": self.recovery.lost_bytes if self.recovery is not None else 0,
            "consumer_offsets_reset": self.offsets_reset,
            # what the topics and the retention cost in files (store/file_budget.py)
            "commitlog_mapped_segments": clog.mfq.mapped_count(),
            "open_files_budget": self.budget.total,
            **self.consume_queues.stats(),
        }

    def tier_stats(self) -> dict | None:
        """What is local, uploading, in the tier, the oldest readable time (store/tier); None without a tier."""
        return self.tier.stats() if self.tier is not None else None

    # ------------------------------------------------------------------ housekeeping
    @property
    def corrupt_ranges(self) -> list[tuple[int, int]]:
        return list(self.clog.corrupt_ranges)

    def check_disk(self) -> None:
        """The high-water mark and the end of a segment-space shortage (store/disk_space.py)."""
        self.clog.disk.check()

    def save_clog_checkpoint(self) -> None:
        self._clog_ckpt.save(self.clog.flushed)

    def release_idle_maps(self) -> int:
        """Unmap idle sealed CommitLog segments beyond the budget's share (the background service
        runs it with retention); they are mapped again when read."""
        return (self.clog.mfq.release_idle(self.budget.commitlog_maps)
                + self.index.release_idle(self.budget.index_maps))

    def delete_expired_segments(self, now_ms: int | None = None) -> int:
        """Run retention now (the background service runs it every retention_check_interval_ms).
        With a tier, local files go only once uploaded (the tier's local and tier retention)."""
        if self.tier is not None:
            return self.tier.housekeep(now_ms)
        return retention.delete_expired(self.clog, self._dispatchers, self.dispatch.dispatched,
                                        self.cfg.retention_ms, now_ms)
