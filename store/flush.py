"""Flush services: what makes an append durable under each flush mode (RocketMQ's GroupCommitService / FlushRealTimeService / CommitRealTimeService).

* `GroupCommitService` (sync): writers enqueue (end_offset, future); the thread takes every waiting
  request, does one fdatasync covering the highest committed offset, and resolves every request
  whose end is covered. 64 writers waiting cost one fsync, not 64.
* `BackgroundService` (all modes): in `async+buffer` commits the write buffer into the maps every
  `commit_interval_ms`; in the async modes flushes every `flush_interval_ms` when at least
  `flush_least_pages` pages are dirty, and everything every `flush_thorough_interval_ms`; in every
  mode it checks disk usage against the high-water mark, saves the CommitLog's flushed-offset
  checkpoint and runs retention, then returns the heaps' free pages to the kernel (store/heap.py).

Idle (issue: an idle broker costs ~nothing): each thread sleeps until it has work. The group commit
waits for an appender's notify (a long safety timeout only); the background thread sleeps until
the next duty that has something to do - a flush only while data is unflushed, a dispatcher flush
only after dispatch moved, the disk check at a growing interval while nothing is written (back to
its interval once something is), retention at its interval - and the dispatch service wakes it
(`kick`, one of `DispatchService.activity_hooks`) when records arrive after a quiet spell, so an
append after hours of idle is flushed on the same schedule as one during traffic.

Both are threads because fdatasync blocks for milliseconds but releases the GIL, so appends and
dispatch keep running meanwhile, whatever the caller's event loop is doing.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

from . import heap
from .errors import StoreError, is_disk_full

log = logging.getLogger("lmqtt.store")

PAGE = 4096


class GroupCommitService:
    """Group commit without a per-append request object.

    Every append made while round N is being collected shares one `Future` (`current`), read under
    the CommitLog lock by the appender. A round swaps in a fresh future and snapshots the committed
    offset under that same lock, so every append holding the old future is below the snapshot; one
    fdatasync then resolves the old future for all of them (result = the flushed offset, which is
    >= each of their end offsets). Per append this costs an attribute read and, only when the
    thread is idle, one notify - the earlier request-queue design spent ~20 us per append on
    Future/Condition objects.
    """

    IDLE_WAIT_S = 5.0

    def __init__(self, clog, gather_ms: float = 0.0) -> None:
        self.clog = clog
        self.gather_s = gather_ms / 1000.0
        self.current: Future = Future()
        self._cond = threading.Condition()
        self._waiting = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self.flushes = 0

    def wake(self) -> None:
        """Called by appenders after their write is committed."""
        if self._waiting:
            with self._cond:
                self._cond.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lmqtt-store-groupcommit", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread:
            self._thread.join()
        self._round()  # resolve whatever is left

    def _run(self) -> None:
        clog = self.clog
        last_bytes = 0
        while True:
            with self._cond:
                self._waiting = True
                while clog.committed <= clog.flushed and not self._stop:
                    # every append notifies a waiting thread (wake); the timeout is only a safety
                    self._cond.wait(self.IDLE_WAIT_S)
                self._waiting = False
                if self._stop:
                    return
            # Gather window: writers released by the previous fsync are usually re-appending right
            # now; waiting (bounded) until as much data is pending as last round lets one fsync
            # serve them all instead of alternating between two half-size groups. Polls with short
            # sleeps rather than being notified, so appends do not each wake this thread.
            if self.gather_s and clog.committed - clog.flushed < last_bytes:
                deadline = time.monotonic() + self.gather_s
                while clog.committed - clog.flushed < last_bytes and not self._stop:
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(0.0002)
            last_bytes = self._round()

    def _round(self) -> int:
        clog = self.clog
        with clog.lock:
            fut = self.current
            self.current = Future()
            target = clog.committed
        start = clog.flushed
        try:
            flushed = clog.flush_to(target)
            self.flushes += 1
        except OSError as e:
            err = StoreError(f"fdatasync of the CommitLog failed: {e}; the append is not durable")
            log.error("group commit: %s", err)
            fut.set_exception(err)
            return 0
        fut.set_result(flushed)
        return target - start


class BackgroundService:
    # an idle store: the disk check's interval doubles up to this while nothing is written (and no
    # disk-full episode is on); every other duty sleeps until it has work
    IDLE_DISK_CHECK_MAX_S = 30.0

    def __init__(self, store) -> None:
        self.store = store
        cfg = store.cfg
        self.cfg = cfg
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._sleeping = False      # in a sleep longer than the shortest interval: kick() wakes it
        self._kicked = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None      # the last error of any duty, None when all work
        self.errors: dict[str, BaseException] = {}   # duty -> its error, while it fails
        self._full: set[str] = set()                 # duties that told DiskSpace they failed for space
        self.wakeups = 0                             # loop turns (tests, idle bench)
        self.slow_duties = 0                         # duties that took SLOW_DUTY_S or more (logged)

    def start(self) -> None:
        hooks = getattr(self.store.dispatch, "activity_hooks", None)
        if hooks is not None:
            # the threads that sleep while the store is idle: this one and the prefaulter
            for fn in (self.kick, getattr(getattr(self.store, "prefault", None), "kick", None)):
                if fn is not None and fn not in hooks:
                    hooks.append(fn)
        heap.tune()
        self._thread = threading.Thread(target=self._run, name="lmqtt-store-background", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join()

    def kick(self) -> None:
        """Records arrived after a quiet spell: stop a long sleep (the flush and dispatcher-flush
        schedules start again). Called on the dispatch thread or an inline appender."""
        if self._sleeping:
            self._sleeping = False
            self._kicked = True
            self._wake.set()

    def _run(self) -> None:
        cfg = self.cfg
        st = self.store
        clog = st.clog
        disp = st.dispatch
        buffered = cfg.flush_mode == "async+buffer"
        async_flush = cfg.flush_mode != "sync"
        now = time.monotonic()
        next_commit = now + cfg.commit_interval_ms / 1000
        next_flush = now + cfg.flush_interval_ms / 1000
        next_thorough = now + cfg.flush_thorough_interval_ms / 1000
        next_disk = now
        next_ckpt = now + 1.0
        next_retention = now + cfg.retention_check_interval_ms / 1000
        next_dflush = now + cfg.dispatcher_flush_interval_ms / 1000
        tick = min(cfg.commit_interval_ms if buffered else 1000, cfg.flush_interval_ms, cfg.disk_check_interval_ms,
                   cfg.dispatcher_flush_interval_ms, 1000) / 1000
        disk_base = cfg.disk_check_interval_ms / 1000
        disk_every = disk_base
        disk_seen = -1              # clog.committed at the last disk check
        dflushed = -1               # disp.dispatched at the last dispatcher flush
        ckpt_seen = -1              # clog.flushed at the last checkpoint save
        wait = tick
        while True:
            if self._wait(wait):
                return
            self.wakeups += 1
            now = time.monotonic()
            if self._kicked:            # writing again: the disk is checked at once, then as usual
                self._kicked = False
                if disk_every > disk_base:
                    disk_every = disk_base / 2
                    next_disk = now
            # Each duty separately: one that fails (a checkpoint on a full disk) must not keep the
            # others from running - retention and the disk check are what end a full disk.
            if buffered and now >= next_commit:
                next_commit = now + cfg.commit_interval_ms / 1000
                if clog.pending:
                    self._duty("commit", self._commit)
            if async_flush and now >= next_flush:
                next_flush = now + cfg.flush_interval_ms / 1000
                thorough = now >= next_thorough
                if thorough:
                    next_thorough = now + cfg.flush_thorough_interval_ms / 1000
                if (thorough and clog.committed > clog.flushed) or \
                        clog.committed - clog.flushed >= cfg.flush_least_pages * PAGE:
                    self._duty("commitlog flush", clog.flush)
            if now >= next_disk:
                c = clog.committed
                quiet = c == disk_seen and not getattr(getattr(clog, "disk", None), "reason", None)
                disk_every = min(disk_every * 2, self.IDLE_DISK_CHECK_MAX_S) if quiet else disk_base
                next_disk = now + disk_every
                disk_seen = c
                self._duty("disk check", st.check_disk)
            if now >= next_dflush:
                next_dflush = now + cfg.dispatcher_flush_interval_ms / 1000
                d = disp.dispatched
                if d != dflushed or "dispatcher flush" in self.errors:
                    dflushed = d
                    self._duty("dispatcher flush", disp.flush_dispatchers, "thread-safe")
            if now >= next_ckpt:
                next_ckpt = now + 1.0
                f = clog.flushed
                if f != ckpt_seen or "commitlog checkpoint" in self.errors:
                    ckpt_seen = f
                    self._duty("commitlog checkpoint", st.save_clog_checkpoint)
            if now >= next_retention:
                next_retention = now + cfg.retention_check_interval_ms / 1000
                self._duty("retention", st.delete_expired_segments)
                release = getattr(st, "release_idle_maps", None)
                if release is not None:
                    self._duty("idle maps", release)
                self._duty("heap trim", heap.trim)
            # the next wake-up: the earliest duty with something to do. Announced as a long sleep
            # before the work is looked at again, so records arriving meanwhile either are seen
            # here or kick() finds the flag set (Event: the wake-up is kept until the wait)
            self._wake.clear()
            self._sleeping = True
            due = [next_disk, next_retention]
            if buffered:
                due.append(next_commit)         # the appender does not wake anyone for a commit
            if async_flush and clog.committed > clog.flushed:
                due.append(next_flush)
            if disp.dispatched != dflushed or "dispatcher flush" in self.errors:
                due.append(next_dflush)
            if clog.flushed != ckpt_seen or self.errors:
                due.append(next_ckpt)
            if self.errors:
                due.append(now + tick)          # a failing duty is retried at the usual pace
            wait = max(0.0, min(due) - time.monotonic())
            if wait <= tick:
                self._sleeping = False

    def _wait(self, timeout: float) -> bool:
        """Sleep up to `timeout` s or until kicked; True when stopping."""
        if timeout > 0:
            self._wake.wait(timeout)
        self._sleeping = False
        return self._stop.is_set()

    def _commit(self) -> None:
        self.store.clog.commit()
        self.store.dispatch.wake()

    # a duty longer than this is logged: what holds appends, dispatch or delivery back for that
    # long is what an operator looking at a latency spike needs to see (its CPU time says whether
    # it computed, holding the GIL, or waited on the disk)
    SLOW_DUTY_S = 0.05

    def _timed(self, name: str, t0: float, c0: float) -> None:
        took = time.monotonic() - t0
        if took >= self.SLOW_DUTY_S:
            self.slow_duties += 1
            log.info("event=slow_duty duty=%r ms=%.0f cpu_ms=%.0f", name, took * 1000,
                     (time.thread_time() - c0) * 1000)

    def _duty(self, name: str, fn, *args) -> None:
        """Run one duty; keep serving if it fails. A full disk is part of the store's disk-full
        episode (store/disk_space.py: one line for all of it); anything else is logged with its
        traceback once per distinct error, and once more when the duty works again."""
        disk = self.store.clog.disk
        t0, c0 = time.monotonic(), time.thread_time()
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - keep serving
            if is_disk_full(e):
                what = name
                failed = self.store.dispatch.failed_flush.get("thread-safe")
                if name == "dispatcher flush" and failed:
                    what = f"the {failed} dispatcher's flush"
                disk.write_failed(what, e, key=name)     # one cause per duty, whoever failed in it
                self._full.add(name)
            else:
                last = self.errors.get(name)
                if last is None or repr(e) != repr(last):
                    log.exception("store background service: %s failed: %s", name, e)
            self.errors[name] = e
            self.error = e
        else:
            self._timed(name, t0, c0)
            if name in self.errors:
                e = self.errors.pop(name)
                if name in self._full:
                    self._full.discard(name)
                    disk.write_ok(name)
                else:
                    log.warning("store background service: %s works again (after: %s)", name, e)
                if not self.errors:
                    self.error = None
