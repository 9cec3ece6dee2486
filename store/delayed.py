"""Delayed messages on the store: park a message now, have it appear under its real topic at its
due time, exactly once, across crashes (after RocketMQ's timer messages).

How: `schedule` appends the message to the CommitLog under the parking topic `$timer` (its real
topic, due time and original properties wrapped in the record's props) and records a timer for
that record in the `TimerWheel` (store/timer.py). When the timer fires, the parked record is read
back and appended as an ordinary message under its real topic, with the key `timer:<parked
offset>`; from there it flows like any publish (light queues, notify, delivery). The key is what
makes firing exactly-once: after a crash, a timer whose tick may already have fired is looked up in
the key index before it fires again.

The parked record is written with the caller's flush mode and the TimerLog entry right after it;
the caller acknowledges (PUBACK, SDK reply) only after both, so "acknowledged" means "the timer is
durable" under the flush mode's promise. A crash between the two writes leaves an unacknowledged
parked record without a timer: it never fires, and the client's resend schedules it again.

`route(msg)` (given by the layer above, e.g. the light queues) fills in a fired message's
dispatch queues: which wildcard filters want a topic is known only there, and only at firing time
(filters registered during the delay must see the message).

A timer names its parked record by CommitLog offset only, and a recovery that cuts the log hands
the offsets of the lost records to new appends. So:
  * on opening, the recoveries of the store not checked yet (store/recovery.py, generation kept
    in the wheel's checkpoint) drop every timer whose parked record was at/after the cut
    (`TimerWheel.drop_lost`), with one WARNING naming them ("N delayed messages lost in the cut,
    due at ..."): their loss is the one the recovery's ERROR reports;
  * when a timer fires, the record read at its offset must be its parked record: a `$timer`
    record of the size and due time the TimerLog entry recorded. Anything else (another message,
    no readable record, the log ending or starting beyond it) is not released: one ERROR naming
    the offsets, and the timer is done (`refused` in stats()).

In a store group (docs/ha.md, `store.delayed_role` set by store/node/ha_member.py) the timers are
derived from the log on every member: the parked records are in the replicated CommitLog, and a
replica's follower thread reads the `$timer` ConsumeQueue as its dispatch fills it (a cursor kept
in `<timer dir>/follow`) and schedules each parked record's timer in its own wheel. A replica's
wheel releases nothing: when a timer is due it waits (FiringDeferred) until the primary's release
(the key `timer:<offset>`) is in its log, then counts it fired, so it keeps pace with the primary.
A replica that becomes primary (`promote`) first schedules what its follower had not read yet, then
releases for real; a timer due before its promotion (+ a minute of clock skew) is looked up in the
key index first, so one the old primary released is not released twice. On the primary the
follower only moves its cursor (the PRODUCE path arms the timers). A cancellation is shipped on the
group's metadata stream (`cancel` via ha_member).
"""
from __future__ import annotations

import logging
import os
import struct
import threading
import time
from concurrent.futures import Future
from typing import Callable

from .checkpoint import write_atomic
from .errors import DiskFull, NotVisible
from .message import Message, StoredMessage
from .timer import FiringDeferred, Timer, TimerError, TimerWheel

PARK_TOPIC = "$timer"
_WRAP = struct.Struct("<qIHH")       # due_ms, flags, queue_id, topic length; then topic, then props
TIMER_KEY = "timer:"
# what the disk-full episode calls a failed TimerLog reservation (store/disk_space.py)
_TIMERLOG_WRITES = "allocating TimerLog space for delayed messages"

log = logging.getLogger("lmqtt.store.delayed")


_NAMED = 20                          # lost delayed messages named in the WARNING (then "and N more")


def _iso(ms: int) -> str:
    """Epoch ms as an ISO 8601 UTC time with milliseconds."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"


class DelayError(ValueError):
    """A delay request that cannot be honoured; the message says why."""


def _wrap(msg: Message, due_ms: int) -> bytes:
    t = msg.topic.encode()
    return _WRAP.pack(due_ms, msg.flags, msg.queue_id, len(t)) + t + bytes(msg.props)


def _unwrap(parked: StoredMessage) -> tuple[str, int, int, int, bytes]:
    props = parked.props
    due, flags, queue_id, tlen = _WRAP.unpack_from(props)
    o = _WRAP.size
    topic = bytes(props[o:o + tlen]).decode()
    return topic, due, flags, queue_id, bytes(props[o + tlen:])


class DelayedMessages:
    """Delayed delivery for one MessageStore. `start()` after the store started; `close()` before
    the store shuts down."""

    def __init__(self, store, directory: str, route: Callable[[Message], Message] | None = None,
                 clock: Callable[[], float] = time.time, loop=None, **wheel_options) -> None:
        """`loop`: an asyncio loop that makes every other append of this store (the embedded
        gateway's, the store server's). Released messages are then appended on it too, so that
        appender stays the store's only one (the gateway's delivery relies on that to know the
        queue offsets of what it just appended, gateway/delivery/engine.py `record_appended`)."""
        self.store = store
        self._route = route or (lambda m: m)
        self._clock = clock
        self._loop = loop
        cfg = getattr(store, "cfg", None)
        self._sync = getattr(cfg, "flush_mode", "") == "sync"
        self.wheel = TimerWheel(directory, self._fire, already_fired=self._already_fired, clock=clock,
                                **wheel_options)
        self._full = False      # the last TimerLog reservation failed for lack of space
        self.lost_in_cut = 0    # timers dropped on opening: their parked record was cut from the log
        self.refused = 0        # timers that found another record than their parked one when due
        self._check_recoveries()
        # a store group member: "replica" (timers followed from the log, released by the primary)
        # or "primary"; None: a store of its own (see the module docstring)
        self.role = getattr(store, "delayed_role", None)
        self.recheck_before_ms = 0        # a new primary's: timers due before this are looked up first
        self.released_elsewhere = 0       # a replica's timers found released by the primary
        self._follow_path = os.path.join(directory, "follow")
        self._follow_lock = threading.RLock()
        self._follow_next = self._load_follow()
        self._follow_stop = threading.Event()
        self._follow_thread: threading.Thread | None = None
        self._follow_failing = ""
        # fn(ref offset) after a cancellation (a group ships it to the replicas)
        self.on_cancel = getattr(store, "delayed_on_cancel", None)
        # a member that became primary before its wheel existed catches up first (`start`)
        self._promote_at_start = self.role == "primary"
        if self._promote_at_start:
            self.role = "replica"

    # --------------------------------------------------------------------------------- API
    def schedule(self, msg: Message, due_ms: int):
        """Park `msg` until `due_ms` (epoch ms). Returns the parked record's AppendResult: its
        `msg_id` names the delayed message (for `cancel`), its `durable` future is the ack."""
        if not msg.topic or msg.topic.startswith("$"):
            raise DelayError(f"cannot delay a message to {msg.topic!r}: delayed messages need a real topic")
        now = int(self._clock() * 1000)
        if due_ms - now > self.wheel.max_delay_ms:
            raise DelayError(f"a delay of {(due_ms - now) / 1000:.0f} s exceeds the maximum of "
                             f"{self.wheel.max_delay_ms / 1000:.0f} s")
        parked = Message(PARK_TOPIC, msg.body, 0, 0, _wrap(msg, due_ms), msg.keys, msg.born_ts or now)
        self._reserve(1)
        r = self.store.append(parked)
        self.wheel.schedule(due_ms, r.phys_offset, r.size)
        return r

    def schedule_batch(self, msgs: list[Message], due_ms: list[int]):
        """`schedule` for many messages: one CommitLog append for all parked records (all or none),
        then their timers. Returns the AppendResults in order."""
        now = int(self._clock() * 1000)
        parked = []
        for m, due in zip(msgs, due_ms, strict=True):
            if not m.topic or m.topic.startswith("$"):
                raise DelayError(f"cannot delay a message to {m.topic!r}: delayed messages need a real topic")
            if due - now > self.wheel.max_delay_ms:
                raise DelayError(f"a delay of {(due - now) / 1000:.0f} s exceeds the maximum of "
                                 f"{self.wheel.max_delay_ms / 1000:.0f} s")
            parked.append(Message(PARK_TOPIC, m.body, 0, 0, _wrap(m, due), m.keys, m.born_ts or now))
        self._reserve(len(parked))
        results = self.store.append_batch(parked)
        schedule = self.wheel.schedule
        for r, due in zip(results, due_ms):
            schedule(due, r.phys_offset, r.size)
        return results

    def check(self, topic: str, due_ms: int, now: int | None = None) -> None:
        """Raise DelayError when a message to `topic` cannot be delayed until `due_ms`."""
        if not topic or topic.startswith("$"):
            raise DelayError(f"cannot delay a message to {topic!r}: delayed messages need a real topic")
        if now is None:
            now = int(self._clock() * 1000)
        if due_ms - now > self.wheel.max_delay_ms:
            raise DelayError(f"a delay of {(due_ms - now) / 1000:.0f} s exceeds the maximum of "
                             f"{self.wheel.max_delay_ms / 1000:.0f} s")

    def park(self, msgs: list[Message], due_ms: list[int]) -> tuple[list[Message], list[int]]:
        """For a batch mixing ordinary and delayed messages (`due_ms[i]` 0 = ordinary): the list
        to append in ONE `append_batch` (delayed ones replaced by their parked records) and the
        indexes of the parked ones. Validates every delayed message first (DelayError: nothing is
        appended). After the append, `arm(results, indexes, due_ms)` records their timers."""
        now = int(self._clock() * 1000)
        out = list(msgs)
        idx = []
        for i, (m, due) in enumerate(zip(msgs, due_ms, strict=True)):
            if due:
                self.check(m.topic, due, now)
                out[i] = Message(PARK_TOPIC, m.body, 0, 0, _wrap(m, due), m.keys, m.born_ts or now)
                idx.append(i)
        if idx:
            self._reserve(len(idx))
        return out, idx

    def _reserve(self, count: int) -> None:
        """TimerLog space for `count` timers, before their parked records are appended: a full
        disk refuses the publish (DiskFull, the store's disk-full episode, store/disk_space.py)
        instead of storing a parked record whose timer cannot be written."""
        disk = getattr(getattr(self.store, "clog", None), "disk", None)
        try:
            self.wheel.reserve(count)
        except DiskFull as e:
            if disk is None:
                raise
            self._full = True
            raise disk.write_refused(_TIMERLOG_WRITES, e, count, "delayed messages are refused until space is "
                                                                 "freed") from None
        if self._full:
            self._full = False
            disk.write_ok(_TIMERLOG_WRITES)

    def arm(self, results, indexes: list[int], due_ms: list[int]) -> None:
        """The timers of the parked records of a batch appended after `park`."""
        if not indexes:
            return
        schedule = self.wheel.schedule
        for i in indexes:
            r = results[i]
            schedule(due_ms[i], r.phys_offset, r.size)
        if self._sync:
            # `sync` promises no loss on power failure for what is acknowledged: the TimerLog
            # records too (one fdatasync, GIL released; the CommitLog's own fsync covers the
            # parked records before the ack)
            self.wheel.flush()

    def rearm(self, phys_offsets: list[int], indexes: list[int], due_ms: list[int]) -> int:
        """Timers for parked records found in the log by a retried PRODUCE (its first attempt died
        after the append, maybe before the timers): scheduled again unless already fired; a copy
        of a timer that exists fires once (TimerWheel.fire_due keeps one per ref). -> re-armed."""
        n = 0
        for i in indexes:
            phys = phys_offsets[i]
            self.store.wait_dispatched(phys + 1, timeout=30)
            parked = self.store.read(phys)
            due = _unwrap(parked)[1]      # the due time the record carries (what firing checks)
            t = Timer(phys, parked.size, due, -1)
            if self._already_fired(t):
                continue
            self.wheel.schedule(due, phys, parked.size)
            n += 1
        if n and self._sync:
            self.wheel.flush()
        return n

    def cancel(self, msg_id: str) -> bool:
        """Cancel a delayed message by the msg id `schedule` returned. False when the id is not a
        parked message of this store, or it already fired."""
        parked = self.store.get_by_msg_id(msg_id)
        if parked is None and isinstance(msg_id, str) and len(msg_id) == 32:
            # just acknowledged, maybe not dispatched yet (a read serves dispatched offsets only)
            try:
                phys = int(msg_id[16:], 16)
            except ValueError:
                return False
            if phys < self.store.max_offset and self.store.wait_dispatched(phys + 1, timeout=5):
                parked = self.store.get_by_msg_id(msg_id)
        if parked is None or parked.topic != PARK_TOPIC:
            return False
        topic, due, _f, _q, _p = _unwrap(parked)
        t = Timer(parked.phys_offset, parked.size, due, -1)
        if self._already_fired(t):
            return False
        self.wheel.cancel(parked.phys_offset)
        if self.on_cancel is not None:
            self.on_cancel(parked.phys_offset)
        return True

    def start(self) -> None:
        if self._promote_at_start:
            self.promote()
        self.wheel.start()
        if self.role is not None:
            self._follow_thread = threading.Thread(target=self._follow_run, name="lmqtt-timer-follow", daemon=True)
            self._follow_thread.start()

    def close(self) -> None:
        self._follow_stop.set()
        if self._follow_thread is not None:
            self._follow_thread.join(10)
            self._follow_thread = None
        self.wheel.close()

    # ------------------------------------------------------------------ store groups (docs/ha.md)
    def _load_follow(self) -> int:
        try:
            with open(self._follow_path) as f:
                return int(f.read().strip() or 0)
        except (OSError, ValueError):
            return 0

    def _follow_run(self) -> None:
        # an idle log is polled less and less often, down to twice a second: a replica's timers
        # are only released once it is promoted, and `promote` reads what is left first (an idle
        # member polling 20 times a second cost ~0.5 % of a core, six of them on a machine)
        idle_wait = 0.05
        while not self._follow_stop.is_set():
            try:
                n = self.follow_log()
                if self._follow_failing:
                    log.info("delayed messages: following the log's parked records works again")
                    self._follow_failing = ""
            except Exception as e:  # noqa: BLE001 - retried; said once
                what = f"{type(e).__name__}: {e}"
                if what != self._follow_failing:
                    log.error("delayed messages: scheduling the timers of replicated parked records failed (%s); "
                              "retried every second", what)
                self._follow_failing = what
                self._follow_stop.wait(1.0)
                continue
            if n:
                idle_wait = 0.05
            else:
                self._follow_stop.wait(idle_wait)
                idle_wait = min(0.5, idle_wait * 2)

    def follow_log(self, max_count: int = 512) -> int:
        """Read the parked records after the cursor from the `$timer` ConsumeQueue (dispatched
        ones); on a replica schedule their timers (on the primary the append path did). -> how
        many records were read."""
        st = self.store
        with self._follow_lock:
            lo, hi = st.consume_queue_offsets(PARK_TOPIC, 0)
            nxt = min(max(self._follow_next, lo), hi)     # a cut log ends lower; retention starts higher
            if nxt >= hi:
                if nxt != self._follow_next:
                    self._save_follow(nxt)
                return 0
            msgs = st.read_consume_queue(PARK_TOPIC, 0, nxt, max_count)
            if not msgs:
                return 0
            if self.role == "replica":
                schedule = self.wheel.schedule
                for m in msgs:
                    try:
                        due = _unwrap(m)[1]
                    except Exception as e:  # noqa: BLE001 - not a parked message: nothing to time
                        log.error("delayed messages: the %s record at CommitLog offset %d is not a parked message "
                                  "(%s); no timer", PARK_TOPIC, m.phys_offset, e)
                        continue
                    try:
                        schedule(due, m.phys_offset, m.size)
                    except TimerError as e:        # the primary's clock allowed it; said, not retried
                        log.error("delayed messages: no timer for the parked record at %d: %s", m.phys_offset, e)
                if self._sync:
                    self.wheel.flush()
            self._save_follow(msgs[-1].queue_offset + 1)
            return len(msgs)

    def _save_follow(self, nxt: int) -> None:
        write_atomic(self._follow_path, str(nxt).encode())
        self._follow_next = nxt

    def promote(self) -> None:
        """This replica became the primary: the parked records it has not scheduled yet first, then
        it releases timers itself (those due before now + a minute are looked up first: the old
        primary may have released them)."""
        with self._follow_lock:
            while self.follow_log(4096):
                pass
            self.recheck_before_ms = int(self._clock() * 1000) + 60_000
            self.role = "primary"

    def demote(self) -> None:
        with self._follow_lock:
            self.role = "replica"

    def _found_released(self, t: Timer, parked: StoredMessage) -> bool:
        """Whether the log holds the release of `t` (the key `timer:<offset>` under its topic)."""
        topic = _unwrap(parked)[0]
        now = int(self._clock() * 1000)
        return bool(self.store.query_by_key(topic, f"{TIMER_KEY}{t.ref_offset}", max(0, t.due_ms - 60_000),
                                            now + 60_000, 1))

    def stats(self) -> dict:
        return {**self.wheel.stats(), "lost_in_cut": self.lost_in_cut, "refused": self.refused}

    # --------------------------------------------------------- after a recovery that cut the log
    def _check_recoveries(self) -> None:
        """Drop the timers whose parked record a recovery not checked yet has cut from the log
        (before anything is scheduled: the wheel was just opened), with one WARNING."""
        recoveries = getattr(self.store, "recoveries", None)
        if recoveries is None:
            return
        seen = self.wheel.recovery_generation
        current = recoveries.generation
        if seen is None:
            # a new timer directory, or one written before the wheel kept the generation: from
            # now on. Timers of such a directory that a cut lost are refused when due (_parked).
            self.wheel.note_recovery_generation(current)
            return
        events = [e for e in recoveries.events if e.generation > seen]
        if not events:
            self.wheel.note_recovery_generation(current)
            return
        end = min(e.end for e in events)
        lost = self.wheel.drop_lost(end, current)
        self.lost_in_cut = len(lost)
        if lost:
            gens = ", ".join(str(e.generation) for e in events)
            ident = getattr(self.store, "ident", "")
            shown = ", ".join(f"{_iso(t.due_ms)} (msg id {ident}{t.ref_offset:016X})" for t in lost[:_NAMED])
            more = f" and {len(lost) - _NAMED} more" if len(lost) > _NAMED else ""
            lo, hi = min(t.ref_offset for t in lost), max(t.ref_offset for t in lost)
            if len(lost) == 1:
                what = f"1 delayed message lost in the cut, due at {shown}: its parked record (CommitLog offset {lo})"
            else:
                what = (f"{len(lost)} delayed messages lost in the cut, due at {shown}{more}: their parked records "
                        f"(CommitLog offsets {lo}..{hi})")
            log.warning("store recovery: %s lay at/after the recovered end %d of the log (recovery %s); %s not be "
                        "delivered", what, end, gens, "it will" if len(lost) == 1 else "they will")

    # ------------------------------------------------------------------------------ firing
    def _parked(self, t: Timer) -> tuple[StoredMessage | None, str]:
        """The parked record of `t`, read back and checked: a `$timer` record of the size and
        due time its TimerLog entry recorded. Else (None, what is at its offset instead).
        NotVisible when the record is in the log but not dispatched yet (offered again)."""
        st = self.store
        if t.ref_offset < st.min_offset:
            return None, f"the log now starts at {st.min_offset}"
        if t.ref_offset + t.ref_size > st.max_offset:
            return None, f"the log now ends at {st.max_offset}"
        if not st.wait_dispatched(t.ref_offset + t.ref_size, timeout=30):
            raise NotVisible(f"the parked record at {t.ref_offset} is not dispatched yet")
        try:
            rec = st.read(t.ref_offset)       # its own size: what is there, whatever it is
        except NotVisible:
            if t.ref_offset < st.min_offset:          # deleted by retention meanwhile
                return None, f"the log now starts at {st.min_offset}"
            raise
        except Exception as e:  # noqa: BLE001 - whatever lies there, it is not a readable record
            return None, f"no readable record starts there ({e})"
        if rec.topic != PARK_TOPIC or rec.size != t.ref_size:
            return None, f"a message to {rec.topic!r} of {rec.size} bytes is there"
        try:
            due = _unwrap(rec)[1]
        except Exception as e:  # noqa: BLE001 - struct.error, UnicodeDecodeError
            return None, f"a {PARK_TOPIC} record of {rec.size} bytes that is not a parked message ({e}) is there"
        if due != t.due_ms:
            return None, f"another parked message ({rec.size} bytes, due at {_iso(due)}) is there"
        return rec, ""

    def _released(self, t: Timer, parked: StoredMessage) -> Message:
        topic, _due, flags, queue_id, props = _unwrap(parked)
        keys = tuple(parked.keys) + (f"{TIMER_KEY}{t.ref_offset}",)
        return Message(topic, parked.body, queue_id, flags, props, keys, parked.born_ts)

    def _fire(self, timers: list[Timer]) -> int:
        """Release `timers` (the wheel's fire callback); -> how many were refused: their offset
        no longer holds their parked record (see the module docstring)."""
        if self.role == "replica":
            # the primary releases; this wheel counts a timer fired once the release is in the log
            for t in timers:
                parked, _why = self._parked(t)
                if parked is not None and not self._found_released(t, parked):
                    raise FiringDeferred(f"the release of the timer at {t.ref_offset} is not in the log yet")
            self.released_elsewhere += len(timers)
            return 0
        # a timer due at once can fire before dispatch made its parked record readable
        end = self.store.max_offset
        ends = [t.ref_offset + t.ref_size for t in timers if t.ref_offset + t.ref_size <= end]
        if ends:
            self.store.wait_dispatched(max(ends), timeout=30)
        msgs = []
        refused = []
        for t in timers:
            parked, why = self._parked(t)
            if parked is None:
                refused.append((t, why))
            elif t.due_ms < self.recheck_before_ms and self._found_released(t, parked):
                continue                 # released by the previous primary of the group
            else:
                msgs.append(self._released(t, parked))
        if msgs:
            if self._loop is not None:
                results = self._append(msgs)
            else:
                route = self._route
                results = self.store.append_batch([route(m) for m in msgs])
            if results:
                results[-1].durable.result(timeout=30)       # durable before the checkpoint moves
        # said once the release is done (a failed one is offered again, and would say it twice)
        ident = getattr(self.store, "ident", "")
        for t, why in refused:
            log.error("delayed message %s%016X due at %s not released: its timer points at CommitLog offset %d "
                      "(%d bytes) where its parked record was, but %s; the parked record is gone (a recovery "
                      "that cut the log?) and nothing else is released in its place", ident, t.ref_offset,
                      _iso(t.due_ms), t.ref_offset, t.ref_size, why)
        self.refused += len(refused)
        return len(refused)

    def _append(self, msgs: list[Message]):
        """append_batch on `self._loop` (see __init__), waited for from the firing thread. Gives up
        (raises: the wheel offers the same ticks again) when the wheel is closing or the loop is
        gone; an abandoned append may still run, which the key-index check on the next start
        covers (it fires nothing twice)."""
        done: Future = Future()

        def run() -> None:
            if not done.set_running_or_notify_cancel():
                return                              # abandoned by the firing thread
            try:
                # routed here, right before the append, on the thread that registers filters: a
                # filter registered before this append gets the message, one registered after it
                # starts after it (the same rule as for any publish)
                route = self._route
                done.set_result(self.store.append_batch([route(m) for m in msgs]))
            except BaseException as e:  # noqa: BLE001 - handed to the firing thread
                done.set_exception(e)
        self._loop.call_soon_threadsafe(run)        # RuntimeError when the loop is closed: retried
        stop = self.wheel.stopping
        while True:
            try:
                return done.result(timeout=0.05)
            except TimeoutError:
                if (stop.is_set() or self._loop.is_closed()) and done.cancel():
                    raise RuntimeError("firing abandoned: the timer wheel is closing") from None

    def _already_fired(self, t: Timer) -> bool:
        parked, _why = self._parked(t)
        if parked is None:
            return False        # not its parked record: refused (and said) when it fires
        topic = _unwrap(parked)[0]
        now = int(self._clock() * 1000)
        hits = self.store.query_by_key(topic, f"{TIMER_KEY}{t.ref_offset}", max(0, t.due_ms - 60_000),
                                       now + 60_000, 1)
        return bool(hits)
