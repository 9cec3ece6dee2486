"""Flush services: what makes an append durable under each flush mode (RocketMQ's GroupCommitService / FlushRealTimeService / CommitRealTimeService).

* `GroupCommitService` (sync): writers enqueue (end_offset, future); the thread takes every waiting
  request, does one fdatasync covering the highest committed offset, and resolves every request
  whose end is covered. 64 writers waiting cost one fsync, not 64.
* `BackgroundService` (all modes): in `async+buffer` commits the write buffer into the maps every
  `commit_interval_ms`; in the async modes flushes every `flush_interval_ms` when at least
  `flush_least_pages` pages are dirty, and everything every `flush_thorough_interval_ms`; in every
  mode it checks disk usage against the high-water mark, saves the CommitLog's flushed-offset
  checkpoint and runs retention.

Both are threads because fdatasync blocks for milliseconds but releases the GIL, so appends and
dispatch keep running meanwhile, whatever the caller's event loop is doing.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

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
                    self._cond.wait(0.5)
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
    def __init__(self, store) -> None:
        self.store = store
        cfg = store.cfg
        self.cfg = cfg
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None      # the last error of any duty, None when all work
        self.errors: dict[str, BaseException] = {}   # duty -> its error, while it fails
        self._full: set[str] = set()                 # duties that told DiskSpace they failed for space

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lmqtt-store-background", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()

    def _run(self) -> None:
        cfg = self.cfg
        st = self.store
        clog = st.clog
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
        while not self._stop.wait(tick):
            now = time.monotonic()
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
                if thorough or clog.committed - clog.flushed >= cfg.flush_least_pages * PAGE:
                    self._duty("commitlog flush", clog.flush)
            if now >= next_disk:
                next_disk = now + cfg.disk_check_interval_ms / 1000
                self._duty("disk check", st.check_disk)
            if now >= next_dflush:
                next_dflush = now + cfg.dispatcher_flush_interval_ms / 1000
                self._duty("dispatcher flush", st.dispatch.flush_dispatchers, "thread-safe")
            if now >= next_ckpt:
                next_ckpt = now + 1.0
                self._duty("commitlog checkpoint", st.save_clog_checkpoint)
            if now >= next_retention:
                next_retention = now + cfg.retention_check_interval_ms / 1000
                self._duty("retention", st.delete_expired_segments)

    def _commit(self) -> None:
        self.store.clog.commit()
        self.store.dispatch.wake()

    def _duty(self, name: str, fn, *args) -> None:
        """Run one duty; keep serving if it fails. A full disk is part of the store's disk-full
        episode (store/disk_space.py: one line for all of it); anything else is logged with its
        traceback once per distinct error, and once more when the duty works again."""
        disk = self.store.clog.disk
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
            if name in self.errors:
                e = self.errors.pop(name)
                if name in self._full:
                    self._full.discard(name)
                    disk.write_ok(name)
                else:
                    log.warning("store background service: %s works again (after: %s)", name, e)
                if not self.errors:
                    self.error = None
