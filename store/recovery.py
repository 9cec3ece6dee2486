"""Recoveries that cut the CommitLog, remembered for whoever holds consumer offsets into the queues.

When recovery ends the log below where it ended before (a torn tail cut, or less data than the
checkpoints recorded: a segment truncated, emptied or deleted), every queue is cut back with it
(each dispatcher's `truncate`) and new appends take the queue offsets of the lost entries again.
A consumer offset saved before the cut can then lie beyond its queue's end; left alone it would
skip the new messages written at the offsets below it (a session at 10 on a queue cut
back to 5 received only the 6th new message).

So each such recovery is written down as a `RecoveryEvent` with a generation number, in
`<data_dir>/recoveries` (JSON lines), before any checkpoint is lowered. Each holder of consumer
offsets (the light queues' metadata, the SDK metadata) stores the last generation it checked; when
it finds newer ones it checks every offset it holds against its queue's end *as it was right
after those recoveries* and resets the offsets beyond it to that end, with a WARNING each
(`offset_reset_message`). A holder opened only later (the SDK metadata of a `lmqtt serve` started
without its store port in between) still finds that end: the entries of a queue that point below
the CommitLog end P of the recovery are the ones it had then, those at/after P were appended
since (`RecoveryLog.cut_since`: the lowest P of the recoveries a holder has not checked).

The timer wheel of delayed messages checks the same generations (store/delayed.py
`DelayedMessages._check_recoveries`): a timer names its parked record by CommitLog offset, so the
timers whose parked record lay at/after P are dropped when the wheel opens, with one WARNING.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass

from .checkpoint import write_atomic

log = logging.getLogger("lmqtt.store")

FILE_NAME = "recoveries"
KEEP = 1000            # events kept in the file (the newest); a holder further behind checks against all


@dataclass(frozen=True)
class RecoveryEvent:
    generation: int        # 1, 2, ... per data directory
    end: int               # the CommitLog end recovery found: appends went on from here
    recorded: int          # the highest CommitLog offset the checkpoints recorded before it
    flushed: int           # the CommitLog's flushed checkpoint (fsynced data ended there)
    tail_cut: int          # bytes of an invalid tail zeroed by the cut
    ts_ms: int

    @property
    def lost_bytes(self) -> int:
        """CommitLog bytes the checkpoints recorded that recovery did not find."""
        return max(0, self.recorded - self.end)


class RecoveryLog:
    """The recoveries of one store data directory (`<data_dir>/recoveries`)."""

    def __init__(self, data_dir: str) -> None:
        self.path = os.path.join(data_dir, FILE_NAME)
        self.events: list[RecoveryEvent] = []
        self._generation = 0

    def load(self) -> None:
        events = []
        try:
            with open(self.path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            lines = []
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                events.append(RecoveryEvent(**json.loads(line)))
            except (ValueError, TypeError) as e:
                log.error("store: %s line %d is not a recovery record (%s); ignored", self.path, i + 1, e)
        self.events = events
        self._generation = max((e.generation for e in events), default=0)

    @property
    def generation(self) -> int:
        """The generation of the latest recovery that cut the log (0: none)."""
        return self._generation

    def add(self, end: int, recorded: int, flushed: int, tail_cut: int) -> RecoveryEvent:
        """Write down one more recovery (durably, before the caller lowers any checkpoint)."""
        ev = RecoveryEvent(self._generation + 1, end, recorded, flushed, tail_cut, int(time.time() * 1000))
        events = (self.events + [ev])[-KEEP:]
        write_atomic(self.path, "".join(json.dumps(asdict(e)) + "\n" for e in events).encode())
        self.events = events
        self._generation = ev.generation
        return ev

    def since(self, generation: int) -> list[RecoveryEvent]:
        """The recoveries after `generation` (all kept ones when `generation` is beyond the latest:
        a holder from another data directory, or one whose store lost this file)."""
        if generation > self._generation:
            return list(self.events)
        return [e for e in self.events if e.generation > generation]

    def cut_since(self, generation: int) -> int | None:
        """The lowest CommitLog end of the recoveries after `generation` (None: none since). A
        queue's entries pointing below it are those it had after all of them."""
        evs = self.since(generation)
        return min(e.end for e in evs) if evs else None


def offset_reset_message(consumer: str, queue: str, offset: int, end: int) -> str:
    """The WARNING of one consumer offset brought back to its queue's end after a recovery."""
    return (f"consumer {consumer}: offset {offset} of queue {queue} beyond its end {end} after recovery: "
            f"reset to {end} ({offset - end} entries lost from the log)")
