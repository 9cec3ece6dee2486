"""The dispatch ("reput") stage: read the CommitLog in order, hand records to every dispatcher.

It runs on its own thread so it keeps going whatever the caller's event loop does. It reads up to
~4 MB of committed CommitLog per round straight from the memory map with `struct.unpack_from`
(no CRC re-check on the hot path: records were CRC-checked by recovery or written by this process),
builds one columnar chunk (a size per record, a `DispatchRequest` per run of records that continue
each other; the scan is in C when store/_fastpath.c is built, this module's loop is its reference)
and gives the batch to each dispatcher in registration order; only then does `dispatched_offset`
move, so a record is visible only after every index has it. A record is taken only once it lies
wholly below the committed end: a replica is shipped bytes in frames that may end inside one.
While caught up it takes the appenders' chunks from memory instead of parsing (the live
hand-off, delivered as a columnar `DispatchBatch`, see store.message). Each dispatcher keeps its own durable checkpoint; during replay after a restart a dispatcher
only receives records at/after its checkpoint, which makes replay exact.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Protocol, Sequence, runtime_checkable

from .errors import is_disk_full
from .fastpath import dispatch_scan as _c_scan
from .message import CHUNK_SIZES, DispatchBatch, DispatchRequest
from .record import BLANK_MAGIC, HEADER, HEADER_SIZE, MSG_MAGIC, PREFIX, SEP

log = logging.getLogger("lmqtt.store")

# how the disk-full episode (store/disk_space.py) keys a failing flush of the dispatch thread's
# dispatchers (those without flush_thread_safe: the light-queue index)
DISPATCH_THREAD_FLUSH = "the dispatch thread's flush of its dispatchers"


@runtime_checkable
class Dispatcher(Protocol):
    name: str

    def checkpoint(self) -> int: ...
    # batch: a list of DispatchRequest (replay) or a DispatchBatch (live hand-off), read-only
    def dispatch(self, batch: Sequence[DispatchRequest], end_offset: int) -> None: ...
    def flush(self) -> None: ...
    def truncate(self, offset: int) -> None: ...
    def on_segments_deleted(self, min_phys_offset: int) -> None: ...
    def close(self) -> None: ...


class DispatchService:
    IDLE_WAIT_MAX = 0.1     # seconds an idle dispatch thread sleeps at most while a flush is owed
    # seconds a quiet one sleeps at most: nothing dispatched since its dispatchers' last flush, so
    # nothing to do until an append wakes it (every commit does, wake(); this only bounds the lag
    # should a wake-up ever be missed)
    QUIET_WAIT_MAX = 10.0
    # the C record scan of dispatch_round (None: not built / LMQTT_PURE_PYTHON; the Python loop
    # there is its reference, and tests set None on an instance to run that loop alone)
    c_scan = _c_scan

    def __init__(self, clog, dispatchers: list, chunk_bytes: int, flush_interval_ms: int,
                 max_batch: int = 2048) -> None:
        self.clog = clog
        # records per delivery: bounds the time a record waits for the rest of its round (lag)
        self.max_batch = max_batch
        self.dispatchers = dispatchers
        self.chunk = chunk_bytes
        self.flush_interval = flush_interval_ms / 1000.0
        self.dispatched = 0
        # what bounds dispatch: an object whose `committed` is the end that may be made visible.
        # The CommitLog; on a store group's primary its AckGate (store/ha/ack_gate.py), whose
        # `committed` is the end the in-sync replicas acknowledged: readers see only that prefix
        self.limit = clog
        self.listeners: list[Callable[[int], None]] = []
        # the error the last round failed with (None once a round gets through again), and the
        # name of the dispatcher that raised it; the same for the dispatchers' periodic flush
        self.error: BaseException | None = None
        self.failed_dispatcher: str | None = None
        self.flush_error: BaseException | None = None
        # per `which` of flush_dispatchers (the dispatch thread and the background service flush
        # different dispatchers, concurrently): the name of the one whose flush failed last
        self.failed_flush: dict[str, str] = {}
        self._flush_full = False                # a disk-full flush failure was told to DiskSpace
        self._ckpts: list[int] = []
        self._idle = False
        self._partial_at = -1                   # the committed end a round took nothing at (_pending)
        # quiet: the thread sleeps up to QUIET_WAIT_MAX; the first delivery after it calls
        # `activity_hooks` (the background service's kick, store/flush.py) so the other threads
        # that sleep while the store is idle start their schedules again
        self._quiet = False
        self.activity_hooks: list[Callable[[], None]] = []
        self._flushed_at = -1                  # `dispatched` when the thread's dispatchers last flushed
        # wake-up signal: a Lock used as a binary semaphore (released = "wake pending"). An
        # appender wakes the idle thread after every append call; Lock.release is one C call,
        # where Event.set takes a Condition in Python (~5 us, a few % of a small-message append)
        self._wake = threading.Lock()
        self._wake.acquire()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._last_flush = time.monotonic()
        self._progress = threading.Condition()
        self._waiters = 0                       # threads in wait_for (changed under _progress)
        self._dispatching = threading.Lock()   # one dispatcher at a time: thread or inline append
        self._topic_cache: dict[bytes, str] = {}
        self._names_cache: dict[bytes, tuple[str, ...]] = {}

    # ------------------------------------------------------------------ control
    def set_start(self, offset: int) -> None:
        self.dispatched = offset
        self._ckpts = [d.checkpoint() for d in self.dispatchers]

    def wake(self) -> None:
        if self._idle:
            self._signal()

    def _signal(self) -> None:
        w = self._wake
        if w.locked():   # else a wake-up is already pending (raising is costly: check first)
            try:
                w.release()
            except RuntimeError:  # released by another thread meanwhile
                pass

    def try_inline(self) -> bool:
        """Dispatch what is committed now on the caller's thread (StoreConfig.dispatch_inline).

        Only when the dispatch thread is idle and nobody else is dispatching (never waits for
        the lock); bounded to a few rounds. True when everything committed is dispatched; False
        means the caller should wake the thread. An error is logged and left to the thread
        (which retries); it never reaches the appender, whose append succeeded."""
        if not self._idle or self.error is not None or self._stop:
            return False
        if not self._dispatching.acquire(blocking=False):
            return False
        try:
            for _ in range(4):
                if self.dispatched >= self.limit.committed:
                    break
                self.dispatch_once()
            return self.dispatched >= self.limit.committed
        except Exception as e:  # noqa: BLE001 - the dispatch thread retries and reports
            if is_disk_full(e):
                self._failed(e)     # the store refuses appends now (one log line)
            else:
                log.warning("inline dispatch at offset %d failed (%s); left to the dispatch thread",
                            self.dispatched, e)
            return False
        finally:
            self._dispatching.release()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lmqtt-store-dispatch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._signal()
        if self._thread:
            self._thread.join()

    def catch_up(self) -> None:
        """Dispatch synchronously until the committed offset (used at start and shutdown)."""
        self.limit = self.clog
        while self.dispatched < self.clog.committed:
            before = self.dispatched
            self.dispatch_once()
            if self.dispatched == before:   # a replica's half-shipped last record: all there is
                break

    def dispatch_once(self) -> None:
        """One delivery: from the live hand-off queue when it continues exactly at the dispatched
        offset, else parsed from the CommitLog."""
        clog = self.clog
        if clog.live_enabled and self._live_ready():
            self._dispatch_live()
        else:
            self.dispatch_round()
            if not clog.live_enabled and clog.live_cap and self.dispatched >= clog.committed:
                clog.enable_live(self.dispatched)

    def _live_ready(self) -> bool:
        live = self.clog.live
        try:
            while live:
                start, end, _ = live[0]
                if end <= self.dispatched:  # already delivered from the log
                    live.popleft()
                    continue
                return start == self.dispatched
        except IndexError:  # cleared by the appender meanwhile
            pass
        return False

    def _dispatch_live(self) -> None:
        """Deliver queued append chunks as one columnar DispatchBatch (see store.message)."""
        clog = self.clog
        live = clog.live
        committed = self.limit.committed
        end = self.dispatched
        chunks: list = []
        count = 0
        max_batch = self.max_batch
        at_sizes = CHUNK_SIZES
        try:
            while live and count < max_batch:
                start, e, chunk = live[0]
                if start != end or e > committed:
                    break
                live.popleft()
                chunks.append(chunk)
                count += len(chunk[at_sizes])
                end = e
        except IndexError:
            pass
        clog.live_count = max(0, clog.live_count - count)
        if end > self.dispatched:
            self._deliver(DispatchBatch(chunks, count), end)

    def wait_for(self, offset: int, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._progress:
            # counted before `dispatched` is read: _deliver writes `dispatched` before it reads
            # this count, so either this wait sees the new offset or _deliver sees a waiter
            self._waiters += 1
            try:
                while self.dispatched < offset:
                    rem = None if deadline is None else deadline - time.monotonic()
                    if rem is not None and rem <= 0:
                        return False
                    self._progress.wait(rem if rem is not None else 0.1)
            finally:
                self._waiters -= 1
        return True

    def flush_dispatchers(self, which: str = "all") -> None:
        """Flush dispatchers. `which`: "all", "dispatch-thread" (those not declaring
        `flush_thread_safe = True`; called on the dispatch thread) or "thread-safe" (the others;
        called from the background thread so their fsyncs never stall dispatch). The dispatch
        thread's periodic flush goes through `_flush_on_thread` (see there).

        A dispatcher whose flush fails (a full disk: a checkpoint file, a RocksDB flush) does not
        keep the others from flushing; the first error is raised after all were tried, with the
        failing one's name in `failed_flush[which]`. Its checkpoint stays where it was, so a restart
        replays from there: nothing is lost, only replayed."""
        self._flush_some([d for d in self.dispatchers if which == "all"
                          or (which == "thread-safe") == getattr(d, "flush_thread_safe", False)], which)

    def _flush_some(self, dispatchers: list, which: str) -> None:
        at = self.dispatched
        err = None
        for d in dispatchers:
            try:
                d.flush()
            except Exception as e:  # noqa: BLE001 - raised below, after the others flushed
                if err is None:
                    err = e
                    self.failed_flush[which] = getattr(d, "name", repr(d))
        if which != "thread-safe":
            self._last_flush = time.monotonic()   # also after a failure: retried next interval
            if err is None and which == "dispatch-thread":
                self._flushed_at = at
        if err is not None:
            raise err

    def _activity(self) -> None:
        """Records after a quiet spell: the sleeping threads start their schedules again (this
        one too, when an inline appender delivered them: its dispatchers' flush is owed)."""
        if not self._quiet:
            return
        self._quiet = False
        if threading.current_thread() is not self._thread:
            self._signal()
        for fn in self.activity_hooks:
            try:
                fn()
            except Exception:  # noqa: BLE001 - a hook must not stall dispatch
                log.exception("dispatch activity hook %r failed", fn)

    # ------------------------------------------------------------------ loop
    def _pending(self) -> bool:
        """Something to dispatch: committed data past `dispatched`, unless the last round took
        nothing at this same committed end. That happens on a replica holding only the start of a
        record (a frame of the primary's log ended inside it, store/ha/replication.py); the thread
        then waits for the next bytes like for any new data (the follower wakes it) instead of
        going round after round: 44,000 empty rounds for 1M messages in `lmqtt bench ha`."""
        c = self.limit.committed
        return self.dispatched < c and c != self._partial_at

    def _run(self) -> None:
        while not self._stop:
            phase = "dispatch"
            try:
                if self._pending():
                    with self._dispatching:
                        if self._pending():         # an inline append may have done it meanwhile
                            c, before = self.limit.committed, self.dispatched
                            self.dispatch_once()
                            # took nothing: the rest of a record is not there (see _pending)
                            self._partial_at = c if self.dispatched == before else -1
                    if self.error is not None:
                        self._resumed()
                else:
                    self._idle = True
                    # quiet when everything dispatched is flushed: announced before `dispatched`
                    # is read again, so a delivery meanwhile (inline) either is seen here or finds
                    # the flag and signals (_deliver)
                    quiet = self.flush_error is None and self.dispatched == self._flushed_at
                    if quiet:
                        self._quiet = True
                        if self.dispatched != self._flushed_at:     # delivered inline meanwhile
                            self._activity()
                            quiet = False
                    if not self._pending():
                        # every commit wakes an idle thread (wake()); the timeout only brings the
                        # next dispatcher flush, so an idle store does not wake 200 times a second
                        # (IDLE_WAIT_MAX bounds the lag should a wake-up ever be missed)
                        if quiet:
                            timeout = self.QUIET_WAIT_MAX
                        else:
                            due = self.flush_interval - (time.monotonic() - self._last_flush)
                            timeout = min(self.IDLE_WAIT_MAX, max(0.005, due))
                        if self._wake.acquire(timeout=timeout):
                            if self._quiet:
                                self._activity()
                            # coalesce: let a few more appends land before the next round, so
                            # single appends do not each cost a whole round plus a GIL hand-off
                            time.sleep(0.0005)
                        else:
                            # no wake-up: try again even at the same committed end (_pending), so
                            # a round that took nothing for any other reason cannot stall dispatch
                            self._partial_at = -1
                    if self._quiet and self._pending():
                        self._activity()        # records arrived as the thread went quiet
                    self._quiet = False
                    self._idle = False
                if time.monotonic() - self._last_flush >= self.flush_interval and \
                        (self.dispatched != self._flushed_at or self.flush_error is not None):
                    phase = "flush"
                    self._flush_on_thread()
                    if self.flush_error is not None:
                        self._flushed_again()
            except BaseException as e:  # keep the thread alive
                if phase == "flush":    # dispatch goes on; the flush is retried next interval
                    self._flush_failed(e)
                else:                   # nothing past this point is visible; retried
                    self._failed(e)
                    time.sleep(0.5)

    def _flush_on_thread(self) -> None:
        """The dispatch thread's periodic flush of its dispatchers ("dispatch-thread").

        A dispatcher declaring `flush_during_dispatch = True` (the light-queue index: its flush
        takes its own lock for the in-memory part, then waits milliseconds, up to hundreds on a
        busy disk, for a RocksDB memtable flush) is flushed without `_dispatching` held and with
        the thread marked idle, so appends made meanwhile are dispatched inline (or by this
        thread right after): every second that flush held up every delivery, the p99 of a
        5,000 msg/s run. The others are flushed as before, with no dispatch running."""
        mine = [d for d in self.dispatchers if not getattr(d, "flush_thread_safe", False)]
        held = [d for d in mine if not getattr(d, "flush_during_dispatch", False)]
        free = [d for d in mine if getattr(d, "flush_during_dispatch", False)]
        err = None
        if held or not free:
            try:
                with self._dispatching:
                    self._flush_some(held, "dispatch-thread")
            except Exception as e:  # noqa: BLE001 - raised below, after the others flushed
                err = e
                first = self.failed_flush.get("dispatch-thread", "")
        if free:
            self._idle = True
            try:
                self._flush_some(free, "dispatch-thread")
            except Exception as e:  # noqa: BLE001
                if err is None:
                    err = e
                else:               # the first failure is the one named, as in flush_dispatchers
                    self.failed_flush["dispatch-thread"] = first
            finally:
                self._idle = False
        if err is not None:
            raise err

    def _failed(self, e: BaseException) -> None:
        """A round failed. Lack of space: the store refuses appends and says so once
        (store/disk_space.py); anything else is logged with its traceback, once per error."""
        name, self.failed_dispatcher = self.failed_dispatcher, None    # set by _deliver, if there
        disk = getattr(self.clog, "disk", None)
        if disk is not None and is_disk_full(e):
            disk.dispatch_failed(name or "index files", self.dispatched, e)
        elif self.error is None or repr(e) != repr(self.error):
            log.exception("dispatch stalled at offset %d%s: %s (will retry)", self.dispatched,
                          f" in the {name} dispatcher" if name else "", e)
        self.error = e

    def _resumed(self) -> None:
        """A round got through after failures: visibility moves again."""
        e, self.error = self.error, None
        self.failed_dispatcher = None
        disk = getattr(self.clog, "disk", None)
        if disk is not None and disk.active("dispatch"):
            disk.dispatch_resumed(self.dispatched)
        elif e is not None:
            log.warning("dispatch resumed at offset %d (after: %s)", self.dispatched, e)

    def _flush_failed(self, e: BaseException) -> None:
        name = self.failed_flush.get("dispatch-thread", "light-queue")
        disk = getattr(self.clog, "disk", None)
        if disk is not None and is_disk_full(e):
            # part of the disk-full episode: logged once
            disk.write_failed(f"the {name} dispatcher's flush", e, key=DISPATCH_THREAD_FLUSH)
            self._flush_full = True
        elif self.flush_error is None or repr(e) != repr(self.flush_error):
            log.exception("flush of the %s dispatcher failed: %s (retried every %.1f s)", name, e,
                          self.flush_interval)
        self.flush_error = e

    def _flushed_again(self) -> None:
        if self._flush_full:
            self.clog.disk.write_ok(DISPATCH_THREAD_FLUSH)
            self._flush_full = False
        else:
            log.warning("the dispatchers flush again (after: %s)", self.flush_error)
        self.flush_error = None

    def dispatch_round(self) -> None:
        clog = self.clog
        pos = self.dispatched
        committed = self.limit.committed
        mf = clog.mfq.find(pos)
        if mf is None:
            raise RuntimeError(f"dispatch: no segment holds offset {pos}")
        base = mf.start_offset
        rel = pos - base
        size = mf.size
        try:  # stop where the live hand-off queue takes over
            s0 = clog.live[0][0] if clog.live else 0
            if s0 > pos:
                committed = min(committed, s0)
        except IndexError:
            pass
        hard = min(committed - base, size)
        soft = min(hard, rel + self.chunk)
        mm = mf.mm
        unpack_from = HEADER.unpack_from
        tcache = self._topic_cache
        ncache = self._names_cache
        new = tuple.__new__
        DR = DispatchRequest
        corrupt = clog.corrupt_ranges
        bad_rel = corrupt[0][0] - base if corrupt else -1
        # the records as one columnar chunk (store.message: sizes, run starts, each run's first
        # DispatchRequest), as the live hand-off delivers them: a record that continues the run
        # before it (same topic, queue, flags, timestamps, tags and dispatch queues, no keys, the
        # next queue offset, right after it in the log) costs a size only, and the dispatchers
        # take a run at once (a replica's dispatch, which parses everything it holds, spent most
        # of its CPU building and consuming a tuple per record; docs/ha.md "Measured")
        sizes: list = []
        starts: list = []
        runs: list = []
        add_size = sizes.append
        keyed = False
        max_batch = self.max_batch
        # the open run: its topic bytes, queue id, next queue offset, next log offset, flags,
        # timestamps, tags, dispatch-queue bytes (None: no run open / it cannot be continued)
        r_tb = None
        r_qid = r_qoff = r_phys = r_flags = r_born = r_sts = r_tags = -1
        r_db = b""
        r_dlen = 0
        # the C twin of this loop (store/_fastpath.c dispatch_scan; this loop is its reference):
        # it takes every record it can the way the loop below would, carrying the open run in and
        # out, and stops where the loop stops or before a record it leaves to the loop below (a
        # corrupt range's start, a blank filler, a record not wholly below `hard`, anything odd),
        # which handles that one record
        scan = self.c_scan
        while rel < soft:
            if len(sizes) >= max_batch:
                break
            if rel == bad_rel:
                rel = self._skip_corrupt(base + rel) - base
                corrupt = clog.corrupt_ranges
                bad_rel = corrupt[0][0] - base if corrupt else -1
                continue
            if scan is not None:
                rel, k, (r_tb, r_qid, r_qoff, r_phys, r_flags, r_born, r_sts, r_tags, r_db, r_dlen) = scan(
                    mm, rel, soft, hard, bad_rel, max_batch, sizes, starts, runs, tcache, ncache,
                    (r_tb, r_qid, r_qoff, r_phys, r_flags, r_born, r_sts, r_tags, r_db, r_dlen))
                keyed = keyed or k
                if rel >= soft or rel == bad_rel or len(sizes) >= max_batch:
                    continue
            if rel + HEADER_SIZE > hard:
                if hard < size:
                    # not committed yet: on a replica, the frame that shipped this record's start
                    # (or a blank filler's) ended inside it; the rest comes with the next frame
                    break
                if PREFIX.unpack_from(mm, rel)[1] == BLANK_MAGIC:   # only a filler's header fits
                    rel = size
                    break
                raise RuntimeError(f"dispatch: no record at offset {base + rel}")
            (total, magic, _crc, qid, flags, qoff, phys, born, sts, tags, _blen, _plen, tlen, klen,
             dlen) = unpack_from(mm, rel)
            if magic != MSG_MAGIC:
                if magic == BLANK_MAGIC:
                    if hard < size:     # the segment's end is not committed yet (as above)
                        break
                    rel = size
                    break
                raise RuntimeError(f"dispatch: no record at offset {base + rel} (magic {magic:#x})")
            if rel + total > hard:      # a replica holds only this record's start (as above)
                break
            p = rel + HEADER_SIZE
            tb = mm[p:p + tlen]
            if (qoff == r_qoff and phys == r_phys and qid == r_qid and not klen and sts == r_sts
                    and born == r_born and flags == r_flags and tags == r_tags and tb == r_tb
                    and dlen == r_dlen and (not dlen or mm[p + tlen:p + tlen + dlen] == r_db)):
                add_size(total)          # continues the open run
                r_qoff = qoff + 1
                r_phys = phys + total
                rel += total
                continue
            topic = tcache.get(tb)
            if topic is None:
                topic = tb.decode("utf-8")
                if len(tcache) > 100_000:
                    tcache.clear()
                tcache[tb] = topic
            db = b""
            if klen or dlen:
                p += tlen
                keys = tuple(mm[p:p + klen].decode("utf-8").split(SEP)) if klen else ()
                p += klen
                if dlen:
                    db = mm[p:p + dlen]
                    dq = ncache.get(db)
                    if dq is None:
                        dq = tuple(db.decode("utf-8").split(SEP))
                        if len(ncache) > 100_000:
                            ncache.clear()
                        ncache[db] = dq
                else:
                    dq = ()
                r = new(DR, (phys, total, topic, qid, qoff, flags, born, sts, tags, keys, dq))
            else:
                keys = ()
                r = new(DR, (phys, total, topic, qid, qoff, flags, born, sts, tags, (), ()))
            starts.append(len(sizes))
            runs.append(r)
            add_size(total)
            if keys:
                keyed = True
                r_tb = None              # a record with keys is a run of its own
                r_qoff = -1
            else:
                r_tb, r_qid, r_qoff, r_phys = tb, qid, qoff + 1, phys + total
                r_flags, r_born, r_sts, r_tags, r_db, r_dlen = flags, born, sts, tags, db, dlen
            rel += total
        end = base + rel
        if rel >= size:
            end = mf.end_offset
        self._deliver(DispatchBatch([(sizes, starts, runs, keyed, None)], len(sizes)) if sizes else [], end)

    def _skip_corrupt(self, offset: int) -> int:
        for a, b in self.clog.corrupt_ranges:
            if a == offset:
                self.clog.corrupt_ranges = [r for r in self.clog.corrupt_ranges if r[0] != a]
                return b
        return offset

    def _deliver(self, batch: list, end: int) -> None:
        ckpts = self._ckpts
        for i, d in enumerate(self.dispatchers):
            c = ckpts[i] if i < len(ckpts) else 0
            if c and c >= end:
                continue  # replay: this dispatcher already has everything below end
            # A dispatcher that raises (a full disk) gets the same batch again on the retry, and
            # so do the ones before it: each skips what it already has (ConsumeQueue by queue
            # offset, the key index and the light queues by CommitLog offset)
            try:
                if c and batch and batch[0].phys_offset < c:
                    d.dispatch([r for r in batch if r.phys_offset >= c], end)
                else:
                    d.dispatch(batch, end)
            except BaseException:
                self.failed_dispatcher = getattr(d, "name", repr(d))
                raise
        if ckpts and max(ckpts) <= end:
            self._ckpts = []
        self.dispatched = end
        if self._quiet:           # the first records after a quiet spell (see _run)
            self._activity()
        if self._waiters:         # the Condition costs ~0.8 us a round: taken only for a waiter
            with self._progress:
                self._progress.notify_all()
        for fn in self.listeners:
            try:
                fn(end)
            except Exception:  # a listener must not stall dispatch
                log.exception("dispatch listener %r failed", fn)
