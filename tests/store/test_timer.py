"""The timer wheel (store/timer.py): firing time and order, rolls beyond the wheel, cancellation,
recovery after kill -9 without loss or double firing, and a million pending timers in bounded
memory. Time is a controllable clock except in the kill -9 test, which runs the real thing."""
from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

import pytest

from lmqtt.store.timer import TimerError, TimerWheel


class Clock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _wheel(tmp_path, clock, fired, **kw):
    kw.setdefault("precision_ms", 100)
    kw.setdefault("wheel_ticks", 64)
    return TimerWheel(str(tmp_path / "timer"), lambda ts: fired.extend((clock.t, t) for t in ts),
                      clock=clock, records_per_file=1024, **kw)


def _run_until(w, clock, until: float, step: float = 0.01) -> None:
    while clock.t < until:
        clock.t = round(clock.t + step, 6)
        w.fire_due()


def test_timers_fire_after_their_due_time_within_one_tick_in_due_order(tmp_path):
    clock, fired = Clock(), []
    w = _wheel(tmp_path, clock, fired)
    rng = random.Random(7)
    t0 = clock.t
    due = {}
    for ref in range(500):
        d = int((t0 + rng.uniform(0.0, 5.0)) * 1000)   # within the 6.4 s wheel
        due[ref] = d
        w.schedule(d, ref, 10)
    assert w.pending == 500
    _run_until(w, clock, t0 + 6.0)
    assert sorted(t.ref_offset for _at, t in fired) == list(range(500))
    for at, t in fired:
        assert t.due_ms == due[t.ref_offset]
        assert at * 1000 >= t.due_ms, "fired before its due time"
        assert at * 1000 <= t.due_ms + 100 + 10 + 1, "fired more than one tick (+ one step) late"
    dues = [t.due_ms for _at, t in fired]
    assert dues == sorted(dues)
    assert w.pending == 0 and w.fired_total == 500
    w.close()


def test_delays_beyond_the_wheel_roll_and_fire_on_time(tmp_path):
    clock, fired = Clock(), []
    w = _wheel(tmp_path, clock, fired, wheel_ticks=16)       # a 1.6 s wheel
    t0 = clock.t
    w.schedule(int((t0 + 10.0) * 1000), 1, 5)
    w.schedule(int((t0 + 4.25) * 1000), 2, 5)
    _run_until(w, clock, t0 + 12.0)
    got = {t.ref_offset: at for at, t in fired}
    assert set(got) == {1, 2}
    assert t0 + 10.0 <= got[1] <= t0 + 10.0 + 0.12
    assert t0 + 4.25 <= got[2] <= t0 + 4.25 + 0.12
    assert w.rolled_total >= 3
    w.close()


def test_delay_beyond_the_maximum_is_refused_with_the_limit(tmp_path):
    clock, fired = Clock(), []
    w = _wheel(tmp_path, clock, fired, max_delay_ms=60_000)
    with pytest.raises(TimerError, match="exceeds the maximum of 60 s"):
        w.schedule(int((clock.t + 61) * 1000), 1, 1)
    with pytest.raises(TimerError):
        TimerWheel(str(tmp_path / "bad"), lambda ts: None, precision_ms=5)
    w.close()


def test_cancelled_timers_never_fire_also_after_a_roll_and_a_restart(tmp_path):
    clock, fired = Clock(), []
    w = _wheel(tmp_path, clock, fired, wheel_ticks=16)
    t0 = clock.t
    for ref in range(20):
        w.schedule(int((t0 + 0.5 + ref * 0.2) * 1000), ref, 1)
    w.schedule(int((t0 + 8.0) * 1000), 100, 1)              # rolled
    w.cancel(3)
    w.cancel(100)
    _run_until(w, clock, t0 + 2.0)
    w.cancel(15)                                             # cancelled after others fired
    w.close()
    w = _wheel(tmp_path, clock, fired, wheel_ticks=16)       # restart: cancellations survive
    _run_until(w, clock, t0 + 10.0)
    refs = sorted(t.ref_offset for _at, t in fired)
    assert refs == [r for r in range(20) if r not in (3, 15)]
    assert w.pending == 0
    w.close()


def test_a_failing_fire_callback_is_retried_and_nothing_is_skipped(tmp_path):
    clock, fired = Clock(), []
    fail = {"n": 2}

    def fire(ts):
        if fail["n"]:
            fail["n"] -= 1
            raise OSError("store refused the append")
        fired.extend(ts)

    w = TimerWheel(str(tmp_path / "timer"), fire, clock=clock, precision_ms=100, wheel_ticks=64)
    for ref in range(10):
        w.schedule(int((clock.t + 0.3) * 1000), ref, 1)
    clock.t += 1.0
    for _ in range(2):
        with pytest.raises(OSError):
            w.fire_due()
    w.fire_due()
    assert sorted(t.ref_offset for t in fired) == list(range(10))
    w.close()


def test_restart_rebuilds_pending_timers_from_the_timerlog(tmp_path):
    clock, fired = Clock(), []
    w = _wheel(tmp_path, clock, fired)
    t0 = clock.t
    for ref in range(300):
        w.schedule(int((t0 + 0.05 + ref * 0.01) * 1000), ref, 1)
    _run_until(w, clock, t0 + 1.0)                           # about a third fired
    first = {t.ref_offset for _at, t in fired}
    assert 0 < len(first) < 300
    w.close()
    w = _wheel(tmp_path, clock, fired)
    assert w.pending == 300 - len(first)
    _run_until(w, clock, t0 + 4.0)
    refs = [t.ref_offset for _at, t in fired]
    assert sorted(refs) == list(range(300)), "lost or fired twice across the restart"
    w.close()


class Crash(BaseException):
    """Stands for the process dying right after `fire` made its timers durable."""


def test_a_crash_between_firing_and_the_checkpoint_fires_nothing_twice(tmp_path):
    clock, delivered = Clock(), []

    def fire_then_die(ts):
        delivered.extend(t.ref_offset for t in ts)   # durable downstream ...
        raise Crash()                                  # ... and the process dies before the checkpoint

    d = str(tmp_path / "timer")
    w = TimerWheel(d, fire_then_die, clock=clock, precision_ms=100, wheel_ticks=64)
    t0 = clock.t
    for ref in range(50):
        w.schedule(int((t0 + 0.1 + ref * 0.02) * 1000), ref, 1)
    clock.t = t0 + 0.75
    with pytest.raises(Crash):
        w.fire_due()
    first = set(delivered)
    assert first and len(first) < 50
    seen = set(first)
    w2 = TimerWheel(d, lambda ts: delivered.extend(t.ref_offset for t in ts), clock=clock,
                    precision_ms=100, wheel_ticks=64, already_fired=lambda t: t.ref_offset in seen)
    clock.t = t0 + 3.0
    w2.fire_due()
    assert sorted(delivered) == list(range(50)), "fired twice or lost across the crash"
    w2.close()


CHILD = r"""
import os, sys, time
from lmqtt.store.timer import TimerWheel
d, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
def fire(ts):
    # durable before returning, as the contract asks (page cache survives kill -9)
    os.write(fd, b"".join(b"%d\n" % t.ref_offset for t in ts))
w = TimerWheel(d, fire, precision_ms=10, wheel_ticks=4096, scan_interval_s=0.002)
now = int(time.time() * 1000)
for ref in range(n):
    w.schedule(now + 300 + (ref * 1500) // n, ref, 1)
for ref in range(0, n, 10):
    w.cancel(ref)
print("scheduled", flush=True)
w.start()
time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.parametrize("kill_after", [0.5, 0.9, 1.3])
def test_kill_9_with_pending_timers_loses_none_and_fires_none_twice(tmp_path, kill_after):
    d, out, n = str(tmp_path / "timer"), str(tmp_path / "fired.txt"), 3000
    p = subprocess.Popen([sys.executable, "-c", CHILD, d, out, str(n)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "scheduled"
        time.sleep(kill_after)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    with open(out) as f:
        before = [int(x) for x in f.read().split()]
    assert len(before) == len(set(before))
    seen = set(before)
    after: list[int] = []
    w = TimerWheel(d, lambda ts: after.extend(t.ref_offset for t in ts), precision_ms=10, wheel_ticks=4096,
                   already_fired=lambda t: t.ref_offset in seen)
    deadline = time.monotonic() + 10
    expected = {r for r in range(n) if r % 10}
    while set(before) | set(after) != expected and time.monotonic() < deadline:
        w.fire_due()
        time.sleep(0.01)
    w.close()
    assert not (set(after) & seen), "a timer fired before the crash fired again"
    assert len(after) == len(set(after))
    assert set(before) | set(after) == expected, "lost or cancelled timers fired / missing"


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return 0


@pytest.mark.slow
def test_a_million_pending_timers_in_bounded_memory(tmp_path):
    clock = Clock()
    w = TimerWheel(str(tmp_path / "timer"), lambda ts: None, clock=clock, precision_ms=1000)
    base = _rss_anon_kib()
    now_ms = int(clock.t * 1000)
    rng = random.Random(1)
    for ref in range(1_000_000):
        w.schedule(now_ms + rng.randrange(1, 30 * 86400 * 1000), ref, 100)
    grown_mib = (_rss_anon_kib() - base) / 1024
    assert w.pending == 1_000_000
    assert w.stats()["timerlog_bytes"] == 48 * 1_000_000
    # the wheel's arrays are allocated up front; timers themselves live in the mapped TimerLog
    assert grown_mib < 32, f"anonymous memory grew by {grown_mib:.1f} MiB for 1M pending timers"
    w.close()
    w = TimerWheel(str(tmp_path / "timer"), lambda ts: None, clock=clock, precision_ms=1000)
    assert w.pending == 1_000_000
    w.close()


def test_timers_inside_the_tick_in_progress_fire_at_their_due_time_not_at_the_tick_end(tmp_path):
    """A 1 s tick: timers due 100 ms, 400 ms and 900 ms into it fire within one scan step of
    their due time (not ~1 s late), in order, each once; one scheduled into the tick while it is
    in progress (even already due) is found too; a cancelled one never fires."""
    clock, fired = Clock(1_800_000_000.0), []
    w = _wheel(tmp_path, clock, fired, precision_ms=1000, wheel_ticks=64)
    t0 = clock.t
    for ref, off in ((1, 1.1), (2, 1.4), (3, 1.9), (4, 1.5)):
        w.schedule(int((t0 + off) * 1000), ref, 1)
    w.cancel(4)
    _run_until(w, clock, t0 + 1.45)
    assert [t.ref_offset for _at, t in fired] == [1, 2]
    w.schedule(int((t0 + 1.3) * 1000), 5, 1)            # already due, into the tick in progress
    _run_until(w, clock, t0 + 3.0)
    assert [t.ref_offset for _at, t in fired] == [1, 2, 5, 3]
    for at, t in fired:
        assert at * 1000 >= t.due_ms
        if t.ref_offset != 5:
            assert at * 1000 <= t.due_ms + 10 + 1, f"timer {t.ref_offset} fired {at * 1000 - t.due_ms:.0f} ms late"
    assert w.pending == 0 and w.fired_total == 4
    w.close()


def test_a_crash_inside_a_tick_in_progress_fires_nothing_twice(tmp_path):
    clock, delivered = Clock(), []
    d = str(tmp_path / "timer")
    w = TimerWheel(d, lambda ts: delivered.extend(t.ref_offset for t in ts), clock=clock, precision_ms=1000,
                   wheel_ticks=64)
    t0 = clock.t
    for ref in range(40):
        w.schedule(int((t0 + 1.0 + ref * 0.02) * 1000), ref, 1)   # all in one 1 s tick
    clock.t = t0 + 1.35
    w.fire_due()
    first = set(delivered)
    assert 0 < len(first) < 40                               # released early, nothing checkpointed
    w.log.close()                                            # the process dies here
    clock.t = t0 + 1.5
    w2 = TimerWheel(d, lambda ts: delivered.extend(t.ref_offset for t in ts), clock=clock, precision_ms=1000,
                    wheel_ticks=64, already_fired=lambda t: t.ref_offset in first)
    assert w2.pending == 40                                  # the whole tick is offered again ...
    _run_until(w2, clock, t0 + 3.0)
    assert sorted(delivered) == list(range(40)), "fired twice or lost across the crash"   # ... and rechecked
    assert w2.pending == 0
    w2.close()
