"""Delayed messages after a recovery that cut the CommitLog: a timer names its parked
record by CommitLog offset only, and after the cut new appends take the offsets of the lost
records. A timer whose parked record was lost must never release whatever lies at its offset now.

* On opening, the timer wheel drops the timers whose parked record was at/after the recovered end
  (one WARNING: "N delayed messages lost in the cut, due at ..."), for good (a clean restart does
  not bring them back), and a cancellation of a lost record does not cancel a new parked record at
  the same offset.
* Whatever the wheel still holds (a timer directory written before the wheel kept the recovery
  generation), a timer checks, when it fires, that the record at its offset is its parked one,
  and refuses anything else with an ERROR naming the offsets; the other timers still fire.

Real parts: a MessageStore (sync flush) with DelayedMessages on its data dir; the damage is done to
the real segment file between two runs, as tests/store/test_recovery_truncation.py does. The
timer wheel's clock is driven by the test (fired copies carry real store timestamps: the clock
starts at the real time)."""
from __future__ import annotations

import json
import logging
import os
import time

from lmqtt.store import Message, MessageStore, StoreConfig
from lmqtt.store.delayed import DelayedMessages
from tests.store.test_timer import Clock

SEG = 64 * 1024


def _cfg(d) -> StoreConfig:
    return StoreConfig(data_dir=os.path.join(d, "store"), segment_size=SEG, max_message_size=8192,
                       flush_mode="sync", cq_block_entries=64, index_slots=64, index_entries=1024)


class Node:
    """A store and its delayed messages, as `lmqtt serve` / `lmqtt store` open them (the timer
    wheel under <data_dir>/timer, opened after the store started); firing is driven by the test."""

    def __init__(self, d, clock) -> None:
        self.store = MessageStore(_cfg(str(d)))
        self.store.start()
        self.delayed = DelayedMessages(self.store, os.path.join(str(d), "store", "timer"), clock=clock,
                                       precision_ms=100, wheel_ticks=64)

    def publish(self, topic: str, bodies):
        rs = self.store.append_batch([Message(topic, b) for b in bodies])
        rs[-1].durable.result(10)
        assert self.store.wait_dispatched(self.store.max_offset, 10)
        return rs

    def park(self, topic: str, body: bytes, due_ms: int):
        r = self.delayed.schedule(Message(topic, body), due_ms)
        r.durable.result(10)
        assert self.store.wait_dispatched(self.store.max_offset, 10)
        return r

    def fire(self, clock, until: float) -> None:
        while clock.t < until:
            clock.t = round(clock.t + 0.05, 6)
            self.delayed.wheel.fire_due()

    def topic(self, topic: str) -> list[bytes]:
        self.store.wait_dispatched(self.store.max_offset, 10)
        return [m.body for m in self.store.read_consume_queue(topic, 0, 0, 1000) if m.topic == topic]

    def records_from(self, phys: int) -> list[tuple[str, bytes]]:
        """(topic, body) of every record from `phys` to the end of the log."""
        self.store.wait_dispatched(self.store.max_offset, 10)
        out = []
        while phys < self.store.max_offset:
            m = self.store.read(phys)
            out.append((m.topic, m.body))
            phys += m.size
        return out

    def close(self) -> None:
        self.delayed.close()
        self.store.shutdown()


def _iso(ms: int) -> str:
    """How the log lines write a due time: ISO 8601 UTC with milliseconds."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"


def _segment(d, phys) -> str:
    return os.path.join(str(d), "store", "commitlog", f"{phys - phys % SEG:020d}")


def _lines(caplog, level) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno == level)


def _park_and_cut(tmp_path, clock):
    """One delayed message parked below the cut (`keep`), five ordinary messages, then three
    delayed messages and a fourth one cancelled; the segment is cut inside the first of the three.
    All due at t0 + 2 s. Returns (t0, keep, lost, cancelled)."""
    n = Node(tmp_path, clock)
    t0 = clock.t
    due = int((t0 + 2) * 1000)
    keep = n.park("cmd/keep", b"kept", due)
    n.publish("t", [f"m-{i}".encode() for i in range(1, 6)])
    lost = [n.park("cmd/lost", f"lost-{i}".encode() * 40, due) for i in range(3)]
    cancelled = n.park("cmd/cancelled", b"cancelled", due)
    assert n.delayed.cancel(cancelled.msg_id)
    assert n.delayed.wheel.pending == 5          # the cancelled one until its tick passes
    n.close()
    cut = lost[0].phys_offset
    os.truncate(_segment(tmp_path, cut), cut % SEG + 7)       # inside the first lost record
    return t0, keep, lost, cancelled


def test_timers_of_parked_records_lost_in_the_cut_are_dropped_and_named(tmp_path, caplog):
    clock = Clock(time.time())
    t0, keep, lost, cancelled = _park_and_cut(tmp_path, clock)
    cut = lost[0].phys_offset
    caplog.set_level(logging.INFO)
    n = Node(tmp_path, clock)
    try:
        assert "acknowledged are lost" in _lines(caplog, logging.ERROR)       # the recovery's ERROR
        assert n.delayed.wheel.pending == 1                                   # `keep`
        warned = _lines(caplog, logging.WARNING)
        due = _iso(int((t0 + 2) * 1000))
        assert (f"store recovery: 3 delayed messages lost in the cut, due at {due} (msg id {lost[0].msg_id}), "
                f"{due} (msg id {lost[1].msg_id}), {due} (msg id {lost[2].msg_id}): their parked records "
                f"(CommitLog offsets {cut}..{lost[2].phys_offset}) lay at/after the recovered end {cut} of the "
                f"log (recovery 1); they will not be delivered") in warned, warned
        assert cancelled.msg_id not in warned                                 # cancelled: not a loss
        assert n.delayed.stats()["lost_in_cut"] == 3
        # new ordinary messages take the offsets of the lost parked records (and beyond)
        rs = n.publish("other", [b"o" * 40 for _ in range(14)])
        assert rs[0].phys_offset == cut
        assert n.store.max_offset > cancelled.phys_offset + cancelled.size
        fresh = n.park("cmd/fresh", b"fresh", int((t0 + 2) * 1000))
        n.close()
        # dropped for good: a clean restart brings none of them back, and says nothing
        caplog.clear()
        n = Node(tmp_path, clock)
        assert "delayed message" not in _lines(caplog, logging.WARNING) + _lines(caplog, logging.ERROR)
        assert n.delayed.wheel.pending == 2                                   # `keep`, `fresh`
        end = n.store.max_offset
        n.fire(clock, t0 + 3)
        # released: the two real delayed messages, nothing else; nothing refused (none was left)
        assert sorted(n.records_from(end)) == [("cmd/fresh", b"fresh"), ("cmd/keep", b"kept")]
        assert n.topic("cmd/keep") == [b"kept"] and n.topic("cmd/fresh") == [b"fresh"]
        assert n.topic("cmd/lost") == [] and n.topic("cmd/cancelled") == []
        assert n.topic("other") == [b"o" * 40] * 14
        assert n.delayed.wheel.pending == 0 and n.delayed.stats()["refused"] == 0
        assert "not released" not in _lines(caplog, logging.ERROR)
        assert keep.phys_offset < cut and fresh.phys_offset > cut
    finally:
        n.close()


def test_a_cancellation_of_a_lost_record_does_not_cancel_a_new_parked_record_at_its_offset(tmp_path, caplog):
    """A delayed message parked and cancelled, both lost in the cut; the first delayed message
    parked after the restart lands at the same CommitLog offset and must still fire."""
    clock = Clock(time.time())
    n = Node(tmp_path, clock)
    t0 = clock.t
    n.publish("t", [b"m-1", b"m-2"])
    old = n.park("cmd/old", b"old", int((t0 + 1) * 1000))
    assert n.delayed.cancel(old.msg_id)
    n.close()
    os.truncate(_segment(tmp_path, old.phys_offset), old.phys_offset % SEG + 7)
    caplog.set_level(logging.INFO)
    n = Node(tmp_path, clock)
    try:
        new = n.park("cmd/new", b"new", int((t0 + 1) * 1000))
        assert new.phys_offset == old.phys_offset
        n.fire(clock, t0 + 2)
        assert n.topic("cmd/new") == [b"new"] and n.topic("cmd/old") == []
        assert n.delayed.stats()["lost_in_cut"] == 0      # it was cancelled: nothing to report
        assert "lost in the cut" not in _lines(caplog, logging.WARNING)
    finally:
        n.close()


def test_a_timer_refuses_to_release_a_record_that_is_not_its_parked_one(tmp_path, caplog):
    """The timer directory was written before the wheel kept the recovery generation (an older
    lmqtt: no `recovery_generation` in fired.json), so nothing is dropped on opening: when the
    timers fire, each finds another record at its offset (a new ordinary message, the middle of
    one) or the log ending before it, and refuses it with an ERROR; `keep` still fires."""
    clock = Clock(time.time())
    t0, keep, lost, cancelled = _park_and_cut(tmp_path, clock)
    cp_path = os.path.join(tmp_path, "store", "timer", "fired.json")
    with open(cp_path) as f:
        cp = json.load(f)
    cp.pop("recovery_generation", None)
    with open(cp_path, "w") as f:
        json.dump(cp, f)
    caplog.set_level(logging.INFO)
    n = Node(tmp_path, clock)
    try:
        assert n.delayed.wheel.pending == 5
        # new ordinary messages: one exactly at lost[0]'s offset, the next one over lost[1]'s,
        # ending where lost[2] starts: lost[2] lies beyond the log's end
        cut = lost[0].phys_offset
        first = n.publish("other", [b""])[0]
        assert first.phys_offset == cut
        body = b"a" * (lost[2].phys_offset - (cut + first.size) - first.size)
        second = n.publish("other", [body])[0]
        end = n.store.max_offset
        assert second.phys_offset < lost[1].phys_offset and end == lost[2].phys_offset
        n.fire(clock, t0 + 3)
        assert n.records_from(end) == [("cmd/keep", b"kept")]
        assert n.topic("cmd/lost") == [] and n.topic("cmd/cancelled") == []
        assert n.topic("other") == [b"", body]
        assert n.delayed.wheel.pending == 0
        assert n.delayed.stats()["refused"] == 3 and n.delayed.stats()["lost_in_cut"] == 0
        errors = _lines(caplog, logging.ERROR)
        due = _iso(int((t0 + 2) * 1000))

        def refusal(r):
            return (f"delayed message {r.msg_id} due at {due} not released: its timer points at CommitLog offset "
                    f"{r.phys_offset} ({r.size} bytes) where its parked record was, but ")
        assert refusal(lost[0]) + f"a message to 'other' of {first.size} bytes is there" in errors, errors
        assert refusal(lost[1]) + "no readable record starts there (" in errors, errors
        assert refusal(lost[2]) + f"the log now ends at {end}" in errors, errors
        assert "nothing else is released in its place" in errors
    finally:
        n.close()
