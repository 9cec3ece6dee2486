"""The TimerLog on disk, as the timer wheel (timer.py) reads it back: the record format, the
`fired.json` checkpoint, and the rebuild of the wheel from both after a restart or under a
`drop_lost` rule (`TimerLogRecovery`, a part of `TimerWheel`).

Why a module of its own: timer.py schedules, places and fires timers while the process runs;
what survives a crash - which records can still be pending, which fired, which a cut of the
parked records' log dropped - is read and written here. The rules themselves (exactly-once
firing, rolls, cuts) are told in timer.py's docstring.
"""
from __future__ import annotations

import heapq
import json
import struct
from typing import NamedTuple

from .atomic_file import write_atomic
from .errors import StoreError

# size u32 | magic u32 | prev_pos i64 | due_ms i64 | ref_offset i64 | ref_size u32 | flags u32 | tick i64
RECORD = struct.Struct("<IIqqqIIq")
RECORD_SIZE = RECORD.size          # 48
MAGIC = 0x54494D31                 # "TIM1"
FLAG_ROLL = 1                      # placed at the wheel's middle; re-enqueued when that tick comes
FLAG_DELETE = 2                    # cancels the timer of ref_offset (not chained under any tick)
NO_POS = -1
# field indexes of an unpacked RECORD
PREV, DUE, REF, REF_SIZE, FLAGS, TICK = 2, 3, 4, 5, 6, 7
# A round that fired, dropped and rolled nothing changes only the checkpoint's tick; it is then
# written (json + fsync) at most once per this many seconds of ticks instead of every tick. A
# restart from an older tick re-scans those ticks, all empty of unfired records (an fsync
# a second on an idle wheel, beside the store's own flushes)
IDLE_CHECKPOINT_S = 30


class Timer(NamedTuple):
    """One due timer as handed to `fire`. A timer is named by `ref_offset`, the position of the
    parked record it refers to (for the store: the delayed message's CommitLog offset, i.e. its
    msg id), so the name survives a roll, which moves the timer to a new TimerLog record."""
    ref_offset: int
    ref_size: int
    due_ms: int
    pos: int


class TimerLogRecovery:
    """`TimerWheel`'s checkpoint and recovery (a mixin: they read and set the wheel's state)."""

    def _load_checkpoint(self) -> tuple[int, int]:
        try:
            with open(self._cp_path) as f:
                cp = json.load(f)
            if int(cp.get("precision_ms", self.precision)) != self.precision:
                raise StoreError(f"{self._cp_path}: the timer wheel was written with a precision of "
                                 f"{cp['precision_ms']} ms, not {self.precision} ms")
            if "early_tick" in cp:      # a clean close inside a tick: what it released already
                self._cp_early = (int(cp["early_tick"]), [int(x) for x in cp["early_done"]])
            # absent in a checkpoint written before drop_lost existed: no rules, generation unknown
            self._cuts = [(int(w), int(e)) for w, e in cp.get("cuts", ())]
            if "recovery_generation" in cp:
                self.recovery_generation = int(cp["recovery_generation"])
            return int(cp["tick"]), int(cp["pos"])
        except FileNotFoundError:
            return int(self._clock() * 1000) // self.precision - 1, 0
        except (ValueError, KeyError, TypeError) as e:
            raise StoreError(f"{self._cp_path}: unreadable timer checkpoint ({e})") from e

    def _save_checkpoint(self, early: bool = False, idle: bool = False) -> None:
        """`early` (at close): also the positions of the tick in progress released so far, so a
        clean restart does not offer them again (after a crash the caller's recheck does that).
        `idle`: the round fired, dropped and rolled nothing: skipped when only the tick moved, for
        less than IDLE_CHECKPOINT_S of ticks since the last write."""
        cp = {"tick": self._fired_tick, "pos": self._fired_pos, "precision_ms": self.precision}
        # a rule below the fired position is never needed again: recovery starts there
        self._cuts = [c for c in self._cuts if c[0] > self._fired_pos]
        if self._cuts:
            cp["cuts"] = [list(c) for c in self._cuts]
        if self.recovery_generation is not None:
            cp["recovery_generation"] = self.recovery_generation
        if early and self._early_tick == self._fired_tick + 1 and self._early_done:
            cp["early_tick"] = self._early_tick
            cp["early_done"] = sorted(self._early_done)
        rest = {k: v for k, v in cp.items() if k != "tick"}
        last = self._cp_saved
        if idle and last is not None and last[1] == rest and \
                0 <= self._fired_tick - last[0] < max(1, IDLE_CHECKPOINT_S * 1000 // self.precision):
            return
        write_atomic(self._cp_path, json.dumps(cp).encode())
        self._cp_saved = (self._fired_tick, rest)

    def _recover(self) -> None:
        """Rebuild the wheel from the TimerLog, from the oldest record that can still be pending.

        The log ends at the first slot without a valid record (files are zero-filled, so space
        never written reads as size 0). Re-chained positions are kept per tick in memory (their
        on-disk `prev_pos` belongs to the chains before the restart); new timers chain on disk.
        A cancellation below the scan start needs no replay: its timer sat in a tick that fired
        (the scan starts at the first record of the oldest unfired tick), and a rolled timer is
        dropped at its roll when cancelled.

        Records a `drop_lost` rule covers are skipped, timers and cancellations alike (a
        cancellation of a lost record must not cancel a new parked record at the same offset);
        the timers the newest rule covers are listed in `_lost` for drop_lost's report.
        """
        files = self.log.files
        if not files:
            return
        pos = max(self._fired_pos, files[0].start_offset)
        end = files[-1].end_offset
        live: list[tuple[int, int]] = []
        cuts = self._cuts
        newest = len(cuts) - 1
        lost: list[tuple[int, tuple]] = []
        lost_cancelled: set[int] = set()
        while pos < end:
            f = self.log.find(pos)
            rec = RECORD.unpack_from(f.mm, pos - f.start_offset)
            if rec[0] != RECORD_SIZE or rec[1] != MAGIC:
                break
            cut = self._cut_by(pos, rec) if cuts else -1
            if rec[FLAGS] & FLAG_DELETE:
                if cut < 0:
                    self._cancelled.add(rec[REF])
                elif cut == newest:
                    lost_cancelled.add(rec[REF])
            elif rec[TICK] > self._fired_tick:
                if cut < 0:
                    live.append((pos, rec[TICK]))
                elif cut == newest:
                    lost.append((pos, rec))
            pos += RECORD_SIZE
        self._write_pos = pos
        if self._cp_early is not None and self._cp_early[0] == self._fired_tick + 1:
            et, done = self._cp_early
            self._early_tick, self._early_done, self._early_fresh = et, set(done), True
            live = [(p, tick) for p, tick in live if not (tick == et and p in self._early_done)]
            lost = [(p, r) for p, r in lost if not (r[TICK] == et and p in self._early_done)]
            for p in done:
                r = self._read(p)
                if r is not None and (not cuts or self._cut_by(p, r) < 0):
                    self._early_refs.add(r[REF])
        # one per parked record (a re-armed timer has copies), and not the cancelled ones
        seen: dict[int, Timer] = {}
        for p, r in lost:
            if r[REF] not in lost_cancelled and r[REF] not in seen:
                seen[r[REF]] = Timer(r[REF], r[REF_SIZE], r[DUE], p)
        self._lost = sorted(seen.values(), key=lambda t: (t.due_ms, t.ref_offset))
        for p, tick in live:
            chain = self._recovered.setdefault(tick, [])
            if not chain:
                heapq.heappush(self._firsts, (p, tick))
                heapq.heappush(self._ticks, tick)
            chain.append(p)
            self._pending += 1
        self._recheck_until = int(self._clock() * 1000) // self.precision

    def _cut_by(self, pos: int, rec: tuple) -> int:
        """The index of the first `drop_lost` rule covering the record at `pos` (-1: none)."""
        last = rec[REF] + max(rec[REF_SIZE], 1)        # a cancellation names its ref only
        for i, (below, end) in enumerate(self._cuts):
            if pos < below and last > end:
                return i
        return -1
