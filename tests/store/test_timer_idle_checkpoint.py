"""The timer wheel's checkpoint (fired.json: json + fsync) is not rewritten every tick while the
wheel is idle (one fsync a second on every `lmqtt serve`); a round that fires writes it
as before, an idle wheel at least every IDLE_CHECKPOINT_S of ticks, and a restart from the older
checkpoint fires nothing twice and loses nothing. Controllable clock, real files; a write is seen
by the tick it records."""
from __future__ import annotations

import json
import os

from lmqtt.store.timer import TimerWheel
from lmqtt.store.timer_log import IDLE_CHECKPOINT_S


class Clock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _run_until(w, clock, until: float, step: float = 0.05) -> None:
    while clock.t < until:
        clock.t = round(clock.t + step, 6)
        w.fire_due()


def test_idle_ticks_do_not_rewrite_the_checkpoint_and_a_restart_fires_once(tmp_path):
    d = str(tmp_path / "timer")
    clock, fired = Clock(), []
    w = TimerWheel(d, lambda ts: fired.extend(t.ref_offset for t in ts), clock=clock, precision_ms=100,
                   wheel_ticks=64, records_per_file=1024)
    cp = os.path.join(d, "fired.json")
    saved = lambda: json.load(open(cp))["tick"]   # noqa: E731
    t0 = clock.t
    _run_until(w, clock, t0 + 0.5)
    first = saved()
    _run_until(w, clock, t0 + 5.5)           # 50 idle ticks
    assert saved() == first, "an idle tick rewrote the checkpoint"

    w.schedule(int((t0 + 6.0) * 1000), 111, 10)
    _run_until(w, clock, t0 + 6.5)
    assert fired == [111]
    tick_fired = saved()                     # the round that fired wrote it
    assert tick_fired >= int((t0 + 6.0) * 1000) // 100 > first

    _run_until(w, clock, t0 + 8.0)           # idle again, shorter than the bound: not written
    assert saved() == tick_fired
    _run_until(w, clock, t0 + 6.5 + IDLE_CHECKPOINT_S + 1)   # past the bound: written once more
    assert saved() > tick_fired

    # a restart from a checkpoint a few idle ticks old (as after a kill -9): the timer that fired
    # before does not fire again, a new one fires once
    w2_fired: list[int] = []
    w2 = TimerWheel(d, lambda ts: w2_fired.extend(t.ref_offset for t in ts), clock=clock, precision_ms=100,
                    wheel_ticks=64, records_per_file=1024)
    assert w2.pending == 0
    w2.schedule(int((clock.t + 1.0) * 1000), 222, 10)
    _run_until(w2, clock, clock.t + 2.0)
    assert w2_fired == [222]
    w2.close()
