"""Timer wheel for delayed messages, after RocketMQ's TimerMessageStore: an append-only TimerLog of
fixed-size records chained per slot by `prev_pos`, and a ring of per-tick slots
(`delayed_tick, first_pos, last_pos, num`).

Why this shape: a delayed message costs one 48-byte TimerLog append and one slot update, whatever
its delay; pending timers live on disk (memory-mapped TimerLog files), so a million of them cost
48 MB of page cache and no Python objects, and the in-memory wheel is a fixed set of arrays sized
by the wheel span, not by the number of timers. Firing a tick walks one chain backwards from the
slot's `last_pos`.

The module knows nothing of topics or MQTT: a timer refers to a record the caller wrote elsewhere
(`ref_offset`, `ref_size`: the delayed message parked in the CommitLog) and the caller's `fire`
callback turns due timers into real messages. That keeps the store's layering (the light-queue
dispatch list of a fired MQTT message is computed above the store).

Durability and exactly-once firing:
  * `schedule` returns once the record is in the TimerLog's page cache (process-crash safe, as the
    CommitLog's `async` mode); `flush()` makes it power-safe.
  * The wheel is rebuilt on start from the TimerLog, starting at the oldest record that can still
    be pending (the `fired` checkpoint keeps the first TimerLog position whose tick has not been
    fired completely, and the tick up to which everything fired).
  * Ticks between the checkpoint and the crash may have fired already; on recovery the caller's
    `already_fired(timer)` is asked for exactly those timers (the store answers from its key
    index: a fired message carries the key `timer:<pos>`), so none fires twice and none is lost.

Delays beyond the wheel span are *rolled*: the record is placed at the middle of the wheel with
the ROLL flag and the real due time, and re-enqueued when that tick comes, as many times as needed
(RocketMQ rolls the same way). Cancellation appends a DELETE record for the same tick naming the
cancelled timer; the firing walk collects those first.

After a recovery that cut the parked records' log (the caller's business: the store's
`<data_dir>/recoveries`, store/recovery.py), the caller hands the cut's end to `drop_lost` before
anything is scheduled: every timer and cancellation written so far whose record does not lie
wholly below that end is dropped. The rule `(TimerLog position then, end)` is kept in the
checkpoint (`cuts`), so every later recovery of the TimerLog drops the same records (no TimerLog
record changes: the format is the same as before), together with the last recovery generation
checked (`recovery_generation`); a rule is forgotten once the fired position has passed it.
"""
from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from array import array
from typing import Callable

from .errors import StoreError, is_disk_full
from .mapped_file_queue import MappedFileQueue

# the TimerLog's record format, the fired checkpoint and recovery: timer_log.py
from .timer_log import (
    DUE,
    FLAG_DELETE,
    FLAG_ROLL,
    FLAGS,
    MAGIC,
    NO_POS,
    PREV,
    RECORD,
    RECORD_SIZE,
    REF,
    REF_SIZE,
    Timer,
    TimerLogRecovery,
)

log = logging.getLogger("lmqtt.store.timer")

DEFAULT_PRECISION_MS = 1000
DEFAULT_WHEEL_TICKS = 7 * 24 * 3600          # one week of 1 s ticks: 2.4 MB of slot arrays
DEFAULT_MAX_DELAY_MS = 40 * 24 * 3600 * 1000  # 40 days
RECORDS_PER_FILE = 1 << 20                   # 48 MiB TimerLog files
# TimerLog files are sparse: disk blocks are allocated this far ahead of the write position
# (`reserve`), so a record written into a map never meets a full disk as SIGBUS
RESERVE_BYTES = 64 << 10
MAX_TICKS_PER_ROUND = 3600                   # a long outage catches up in checkpointed steps


class TimerError(StoreError):
    """A timer request that cannot be honoured (delay out of range, bad settings)."""


class FiringDeferred(Exception):
    """Raised by a `fire` callback that may not release these timers yet (a store group replica
    waiting for the primary's release of them to arrive, store/delayed.py): the same timers are
    offered again shortly, without an ERROR."""


DEFERRED_RETRY_S = 0.2


class TimerWheel(TimerLogRecovery):
    """The TimerLog + the wheel + the firing thread.

    `fire(timers)` runs on the firing thread with the due timers of one or more ticks, in due
    order; it must make them durable before returning (the checkpoint moves after it returns). If
    it raises, the same ticks are offered again after `retry_s`; nothing is skipped. It may return
    how many of them it refused to release (not counted as fired; they are done with all the same).
    """

    def __init__(self, directory: str, fire: Callable[[list[Timer]], None], *,
                 precision_ms: int = DEFAULT_PRECISION_MS, wheel_ticks: int = DEFAULT_WHEEL_TICKS,
                 max_delay_ms: int = DEFAULT_MAX_DELAY_MS,
                 already_fired: Callable[[Timer], bool] | None = None,
                 clock: Callable[[], float] = time.time, scan_interval_s: float = 0.05,
                 retry_s: float = 1.0, records_per_file: int = RECORDS_PER_FILE) -> None:
        if not 10 <= precision_ms <= 60_000:
            raise TimerError(f"timer precision {precision_ms} ms is outside 10..60000 ms")
        if wheel_ticks < 16:
            raise TimerError(f"a timer wheel of {wheel_ticks} ticks is too small (at least 16)")
        self.dir = directory
        self.precision = precision_ms
        self.ticks = wheel_ticks
        self.max_delay_ms = max_delay_ms
        self._fire = fire
        self._already_fired = already_fired
        self._clock = clock
        self._scan_interval = scan_interval_s
        self._retry_s = retry_s
        os.makedirs(directory, exist_ok=True)
        self.log = MappedFileQueue(os.path.join(directory, "timerlog"), records_per_file * RECORD_SIZE,
                                   preallocate=False, defer_dir_sync=True)     # synced by flush()
        self.log.load()
        # the wheel, one entry per slot: the tick it holds, its chain's first/last position, count
        self._slot_tick = array("q", [-1]) * wheel_ticks
        self._slot_first = array("q", [NO_POS]) * wheel_ticks
        self._slot_last = array("q", [NO_POS]) * wheel_ticks
        self._slot_num = array("l", [0]) * wheel_ticks
        self._firsts: list[tuple[int, int]] = []   # heap of (first position, tick) of unfired ticks
        self._ticks: list[int] = []                # heap of the ticks holding timers (fired ones popped late)
        self._recovered: dict[int, list[int]] = {}  # tick -> positions re-chained at recovery
        self._cancelled: set[int] = set()          # ref_offsets cancelled and not yet passed
        self._write_pos = 0
        self._reserved = 0                         # TimerLog position blocks are allocated up to
        self._lock = threading.Lock()              # appends and slot updates (any thread)
        self._cp_path = os.path.join(directory, "fired.json")
        self._cp_saved: tuple[int, dict] | None = None     # (tick, the rest) last written
        self._cp_early: tuple[int, list[int]] | None = None     # set by _load_checkpoint
        # drop_lost's rules, (TimerLog position, CommitLog end): a record below the position whose
        # parked record does not end below the end is dropped (set by _load_checkpoint)
        self._cuts: list[tuple[int, int]] = []
        self.recovery_generation: int | None = None   # last recovery of the caller's log checked
        self._lost: list[Timer] = []      # set by _recover: the timers the newest rule dropped
        self._fired_tick, self._fired_pos = self._load_checkpoint()
        if not os.path.exists(self._cp_path):
            # written before the first timer: a crash before the first firing must find every
            # record pending, not assume "everything before the restart fired"
            self._save_checkpoint()
        self._recheck_until = self._fired_tick     # ticks up to this may have fired before a crash
        self._pending = 0
        # the tick in progress (see _fire_early): its timers sorted by due time as walked, the
        # newest position walked, positions already released or dropped, refs released
        self._early_tick = -1
        self._early_queue: list[tuple[int, int, tuple]] = []
        self._early_seen = NO_POS
        self._early_done: set[int] = set()
        self._early_refs: set[int] = set()
        self._early_fresh = True          # the tick's chain is still to be walked whole
        self._stop = threading.Event()         # set by close(); `stopping` for who waits with the wheel
        # the firing thread sleeps until its next due timer (`_next_wake`); a timer scheduled
        # before that wakes it (`_kick`), so an idle wheel does not scan 20 times a second
        self._kick = threading.Event()
        self._wake_at_ms = float("inf")       # when the sleeping thread means to wake (epoch ms)
        self.wakeups = 0                      # firing-thread loop turns (tests, idle bench)
        self._thread: threading.Thread | None = None
        self.fired_total = 0
        self.rolled_total = 0
        self._recover()
        self._opened_at = self._write_pos          # drop_lost: nothing written since the recovery

    # ------------------------------------------------------------------------------ public API
    def schedule(self, due_ms: int, ref_offset: int, ref_size: int) -> int:
        """Park a timer due at `due_ms` (epoch ms) for the record at `ref_offset` (its name).

        A due time in the past or inside the current tick fires on the next scan. Returns the
        TimerLog position written.
        """
        now = int(self._clock() * 1000)
        if due_ms - now > self.max_delay_ms:
            raise TimerError(f"a delay of {(due_ms - now) / 1000:.0f} s exceeds the maximum of "
                             f"{self.max_delay_ms / 1000:.0f} s")
        with self._lock:
            pos = self._place(due_ms, ref_offset, ref_size)    # DiskFull: nothing changed
            self._pending += 1
            if due_ms < self._wake_at_ms:        # due before the firing thread means to look
                self._kick.set()
            return pos

    def cancel(self, ref_offset: int) -> None:
        """Cancel the pending timer of `ref_offset`: it will not fire (durable like `schedule`).

        Whether it was still pending is the caller's knowledge (the store checks that the delayed
        message has not fired yet); the wheel keeps no per-timer index, so that a million pending
        timers cost no memory.
        """
        with self._lock:
            if ref_offset in self._cancelled:
                return
            self._reserve(1)
            pos = self._write_pos
            f = self.log.find(pos) or self.log.create(pos)
            f.write(pos - f.start_offset, RECORD.pack(RECORD_SIZE, MAGIC, NO_POS, 0, ref_offset, 0,
                                                      FLAG_DELETE, -1))
            self._write_pos = pos + RECORD_SIZE
            self._cancelled.add(ref_offset)

    def reserve(self, count: int) -> None:
        """Make sure the next `count` records have disk blocks; DiskFull when the disk has no room
        for them (nothing is written). The delayed messages call it before appending their parked
        records, so that a full disk refuses the publish instead of leaving a parked record
        without its timer."""
        with self._lock:
            self._reserve(count)

    def _reserve(self, count: int) -> None:
        """Under the lock: allocate the blocks of the next `count` records (and RESERVE_BYTES
        ahead, so this is one comparison per record). The TimerLog files are sparse."""
        end = self._write_pos + count * RECORD_SIZE
        if end <= self._reserved:
            return
        pos = max(self._reserved, self._write_pos)
        while pos < end:
            f = self.log.find(pos) or self.log.create(pos)
            n = min(max(end, pos + RESERVE_BYTES), f.end_offset) - pos
            f.reserve(pos - f.start_offset, n)
            pos += n
            self._reserved = pos

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lmqtt-timer", daemon=True)
        self._thread.start()

    @property
    def stopping(self) -> threading.Event:
        """Set once the wheel is closing: a thread waiting on the wheel's behalf gives up then."""
        return self._stop

    def close(self) -> None:
        self._stop.set()
        self._kick.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        if self._early_done:
            with self._lock:
                self._save_checkpoint(early=True)
        self.flush()
        self.log.close()

    def flush(self) -> None:
        """Make every scheduled timer power-safe (fdatasync of the TimerLog's open files)."""
        self.log.sync_dirs()
        for f in self.log.files[-2:]:
            f.flush()

    @property
    def pending(self) -> int:
        """Timers scheduled and neither fired nor cancelled."""
        return self._pending

    def stats(self) -> dict:
        return {"pending": self._pending, "fired": self.fired_total, "rolled": self.rolled_total,
                "timerlog_bytes": self._write_pos - self.log.min_offset,
                "precision_ms": self.precision, "wheel_ticks": self.ticks}

    # ------------------------------------------------------------------------------- placing
    def _place(self, due_ms: int, ref: int, ref_size: int) -> int:
        """Chain a timer under its tick, or under the wheel's middle (ROLL) when it is beyond."""
        tick = max(due_ms // self.precision, self._fired_tick + 1)
        flags = 0
        if tick > self._fired_tick + self.ticks - 1:
            tick = self._fired_tick + self.ticks // 2
            flags = FLAG_ROLL
        return self._append(tick, due_ms, ref, ref_size, flags)

    def _append(self, tick: int, due_ms: int, ref: int, ref_size: int, flags: int) -> int:
        self._reserve(1)                         # DiskFull before anything changes
        i = tick % self.ticks
        if self._slot_tick[i] != tick:          # the slot last held an older, fired tick
            self._slot_tick[i] = tick
            self._slot_first[i] = NO_POS
            self._slot_last[i] = NO_POS
            self._slot_num[i] = 0
        pos = self._write_pos
        f = self.log.find(pos)
        if f is None:
            f = self.log.create(pos)
        f.write(pos - f.start_offset, RECORD.pack(RECORD_SIZE, MAGIC, self._slot_last[i], due_ms, ref,
                                                  ref_size, flags, tick))
        if self._slot_first[i] == NO_POS:
            self._slot_first[i] = pos
            heapq.heappush(self._firsts, (pos, tick))
            heapq.heappush(self._ticks, tick)
        self._slot_last[i] = pos
        self._slot_num[i] += 1
        self._write_pos = pos + RECORD_SIZE
        return pos

    def _read(self, pos: int):
        if pos < self.log.min_offset or pos % RECORD_SIZE or pos >= self._write_pos:
            return None
        f = self.log.find(pos)
        rec = RECORD.unpack_from(f.mm, pos - f.start_offset)
        if rec[0] != RECORD_SIZE or rec[1] != MAGIC:
            raise StoreError(f"TimerLog record at {pos} is corrupt (size {rec[0]}, magic {rec[1]:#x})")
        return rec

    def _chain(self, tick: int) -> list[tuple[int, tuple]]:
        """(position, record) chained under `tick`: the slot's on-disk chain plus recovered
        positions (each record read once: the walk needs it for `prev_pos` anyway)."""
        out: list[tuple[int, tuple]] = []
        i = tick % self.ticks
        read = self._read
        if self._slot_tick[i] == tick:
            p = self._slot_last[i]
            while p != NO_POS:
                r = read(p)
                out.append((p, r))
                p = r[PREV]
        for p in self._recovered.get(tick, ()):
            out.append((p, read(p)))
        return out

    # ---------------------------------------------------- after a cut (checkpoint, recovery: timer_log.py)
    def drop_lost(self, end: int, generation: int) -> list[Timer]:
        """After a recovery that cut the log of the parked records at `end` (and earlier ones,
        up to `generation`): drop every timer and cancellation written so far whose record does
        not lie wholly below `end`, for good (the rule is checkpointed; see the module
        docstring). Returns the pending timers dropped (one per record, cancelled ones left out),
        in due order. Call before `start()` and before anything is scheduled or cancelled."""
        with self._lock:
            if self._thread is not None or self._write_pos != self._opened_at:
                raise TimerError("drop_lost must be called before the timer wheel starts or writes")
            self._cuts.append((self._write_pos, end))
            # recovered again from the TimerLog under the new rule: the same state as a restart
            self._firsts = []
            self._ticks = []
            self._recovered = {}
            self._cancelled = set()
            self._pending = 0
            self._early_tick = -1
            self._early_queue = []
            self._early_seen = NO_POS
            self._early_done = set()
            self._early_refs = set()
            self._early_fresh = True
            self._recover()
            lost, self._lost = self._lost, []
            self.recovery_generation = generation
            self._save_checkpoint(early=True)
        return lost

    def note_recovery_generation(self, generation: int) -> None:
        """Record (durably) that the caller's recoveries up to `generation` were checked."""
        with self._lock:
            if self.recovery_generation != generation:
                self.recovery_generation = generation
                self._save_checkpoint(early=True)

    # --------------------------------------------------------------------------------- firing
    def _run(self) -> None:
        failing = None        # the error of the failing firing round, said once (not every retry)
        while not self._stop.is_set():
            try:
                busy = self.fire_due()
            except FiringDeferred:
                self._stop.wait(min(self._retry_s, DEFERRED_RETRY_S))
                continue
            except Exception as e:  # the fire callback failed: the same ticks are offered again
                what = f"{type(e).__name__}: {e}"
                # a full disk is the store's disk-full episode, said there; a close abandons firing
                if what != failing and not self._stop.is_set() and not is_disk_full(e):
                    log.error("timer wheel %s: releasing due timers failed (%s); no timer fires until it "
                              "succeeds, retried every %.1f s", self.dir, what, self._retry_s)
                failing = what
                self._stop.wait(self._retry_s)
                continue
            if failing is not None:
                log.info("timer wheel %s: releasing due timers works again", self.dir)
                failing = None
            if not busy:
                wait = self._next_wake()
                if wait > 0:
                    self._kick.wait(wait)
                self._kick.clear()
                self.wakeups += 1

    # the longest sleep of an idle wheel (a clock stepped forward is noticed within it)
    IDLE_WAIT_MAX_S = 10.0

    def _next_wake(self) -> float:
        """Seconds until the firing thread has something to do: the next timer of the tick in
        progress, the end of a tick holding timers (whole ticks are released and checkpointed when
        they have passed), or the start of the next tick holding timers (walked then, its timers
        released as they come due). Announced in `_wake_at_ms` under the lock, so `schedule` of
        an earlier timer wakes the thread (`_kick`). With an injected clock (tests) the thread
        still scans every `scan_interval_s`, real time meaning nothing to that clock."""
        cap = self.IDLE_WAIT_MAX_S if self._clock is time.time else self._scan_interval
        with self._lock:
            now_ms = self._clock() * 1000
            cur = int(now_ms // self.precision)
            wake = now_ms + cap * 1000
            q = self._early_queue
            if q:
                wake = min(wake, q[0][0])
            ticks = self._ticks
            while ticks and ticks[0] <= self._fired_tick:
                heapq.heappop(ticks)
            if ticks:
                t = ticks[0]
                wake = min(wake, ((cur + 1) if t <= cur else t) * self.precision)
            i = cur % self.ticks
            if cur == self._fired_tick + 1 and self._slot_tick[i] == cur and self._slot_last[i] != NO_POS and (
                    self._early_tick != cur or self._early_fresh or self._slot_last[i] > self._early_seen):
                wake = now_ms                   # timers of the tick in progress not walked yet
            self._wake_at_ms = wake
        return max(0.001, (wake - now_ms) / 1000 + 0.0005)

    def fire_due(self) -> int:
        """Fire every timer that is due now; returns how many timers fired (the firing thread's
        loop, callable directly by tests and tools)."""
        # whole ticks are released once they have fully passed (checkpointed); inside the tick in
        # progress, timers are released as their due time comes (_fire_early). Either way no
        # timer fires before its due time.
        now_ms = int(self._clock() * 1000)
        now_tick = now_ms // self.precision - 1
        if self._fired_tick >= now_tick:
            return self._fire_early(now_ms)
        last = min(now_tick, self._fired_tick + MAX_TICKS_PER_ROUND)
        due: list[Timer] = []
        rolled: list[tuple] = []
        dropped: list[int] = []              # refs cancelled, or found already fired at recovery
        with self._lock:
            for tick in range(self._fired_tick + 1, last + 1):
                positions = self._chain(tick)
                if not positions:
                    continue
                cancelled = self._cancelled
                early = tick == self._early_tick
                for p, r in positions:
                    if early:
                        if p in self._early_done:        # released (or dropped) while in progress
                            continue
                        if r[REF] in self._early_refs:  # a copy of a released timer
                            dropped.append(-1)
                            continue
                    if r[REF] in cancelled:
                        dropped.append(r[REF])
                        continue
                    if r[FLAGS] & FLAG_ROLL and r[DUE] // self.precision > tick:
                        rolled.append(r)
                        continue
                    t = Timer(r[REF], r[REF_SIZE], r[DUE], p)
                    if tick <= self._recheck_until and self._already_fired is not None \
                            and self._already_fired(t):
                        dropped.append(-1)
                        continue
                    due.append(t)
            # room for the rolled timers' new records before anything fires: on a full disk the
            # ticks are offered again later rather than half-rolled
            self._reserve(len(rolled))
        due.sort(key=lambda t: (t.due_ms, t.pos))
        if len(due) > 1:
            # one timer per ref fires: a ref scheduled twice (a retried PRODUCE re-arming timers
            # that its first attempt may have written, DelayedMessages.rearm) has one due time,
            # hence one tick, and its copies meet here
            seen: set[int] = set()
            uniq = []
            for t in due:
                if t.ref_offset in seen:
                    dropped.append(-1)
                else:
                    seen.add(t.ref_offset)
                    uniq.append(t)
            due = uniq
        refused = 0
        if due:
            refused = self._fire(due) or 0       # raises -> nothing below runs; retried
        with self._lock:
            self._pending -= len(due) + len(dropped)
            self.fired_total += len(due) - refused
            self._cancelled.difference_update(dropped)
            for tick in range(self._fired_tick + 1, last + 1):
                self._recovered.pop(tick, None)
            self._fired_tick = last
            # timers of a passed tick released early (inside it) are not in `due`: not an idle round
            early_fired = self._early_tick <= last and bool(self._early_done)
            if self._early_tick <= last:
                self._early_tick = -1
                self._early_queue = []
                self._early_done = set()
                self._early_refs = set()
                self._early_fresh = True
            for r in rolled:                     # still beyond the wheel, or now inside it
                self._place(r[DUE], r[REF], r[REF_SIZE])
                self.rolled_total += 1
            while self._firsts and self._firsts[0][1] <= last:
                heapq.heappop(self._firsts)
            self._fired_pos = self._firsts[0][0] if self._firsts else self._write_pos
        self._save_checkpoint(idle=not (due or dropped or rolled or early_fired))
        self.log.delete_before(self._fired_pos)
        n = len(due)
        if last == now_tick:                     # caught up: the tick in progress too
            n += self._fire_early(now_ms)
        return n or 1

    def _fire_early(self, now_ms: int) -> int:
        """Release the timers of the tick in progress whose due time has come.

        Why: waiting for the whole tick to pass delays a timer due at its start by one precision
        (1 s by default) plus the release of the whole tick (10,000 timers at once at 10,000
        firings/s). Here the tick's chain is walked once when it becomes current (then only the
        records appended since), kept as a heap by due time, and each scan releases what is due.
        Nothing is checkpointed until the tick has passed: after a crash the tick is offered
        again and the recheck (`already_fired`, the store's key index) drops what was released,
        as for any tick between the checkpoint and the crash."""
        cur = now_ms // self.precision
        if self._fired_tick != cur - 1:
            return 0
        due: list[Timer] = []
        accounted: list[int] = []           # positions dropped (cancelled, copies, fired before a crash)
        cancelled_refs: list[int] = []
        with self._lock:
            i = cur % self.ticks
            slot_holds = self._slot_tick[i] == cur
            if self._early_tick != cur:
                self._early_tick = cur
                self._early_queue = []
                self._early_done = set()
                self._early_refs = set()
                self._early_seen = NO_POS
                self._early_fresh = True
            if self._early_fresh:
                self._early_fresh = False
                done = self._early_done
                new = [x for x in self._chain(cur) if x[0] not in done]
            else:
                new = []
                if slot_holds:
                    p = self._slot_last[i]
                    while p != NO_POS and p > self._early_seen:
                        r = self._read(p)
                        new.append((p, r))
                        p = r[PREV]
            if slot_holds and self._slot_last[i] != NO_POS:
                self._early_seen = max(self._early_seen, self._slot_last[i])
            q = self._early_queue
            for p, r in new:
                if r[FLAGS] & FLAG_ROLL and r[DUE] // self.precision > cur:
                    continue                    # re-placed when the tick has passed
                heapq.heappush(q, (r[DUE], p, r))
            if not q or q[0][0] > now_ms:
                return 0
            ready = []
            while q and q[0][0] <= now_ms:
                ready.append(heapq.heappop(q))
            seen: set[int] = set()
            for d, p, r in ready:
                ref = r[REF]
                if ref in self._cancelled:
                    cancelled_refs.append(ref)
                    accounted.append(p)
                    continue
                if ref in self._early_refs or ref in seen:
                    accounted.append(p)
                    continue
                t = Timer(ref, r[REF_SIZE], d, p)
                if cur <= self._recheck_until and self._already_fired is not None and self._already_fired(t):
                    accounted.append(p)
                    continue
                seen.add(ref)
                due.append(t)
        refused = 0
        if due:
            try:
                refused = self._fire(due) or 0
            except BaseException:
                with self._lock:                # offered again at the next scan
                    if self._early_tick == cur:
                        for item in ready:
                            heapq.heappush(self._early_queue, item)
                raise
        with self._lock:
            if self._early_tick == cur:
                self._early_done.update(accounted)
                self._early_done.update(t.pos for t in due)
                self._early_refs.update(t.ref_offset for t in due)
            self._pending -= len(due) + len(accounted)
            self.fired_total += len(due) - refused
            self._cancelled.difference_update(cancelled_refs)
        return len(due)
