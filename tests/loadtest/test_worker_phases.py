"""The drain phase's stop rule (loadtest/worker_phases.py), shared by the asyncio and the paced worker."""
from __future__ import annotations

from lmqtt.loadtest.worker_phases import DrainWatch
from lmqtt.loadtest.scenarios import ScenarioConfig
from lmqtt.loadtest.stamp import Tracker


def test_drain_waits_for_every_stream_of_the_publishers_this_worker_subscribes_to():
    tr = Tracker()
    for sub in (0, 1):               # two subscribers of publisher 7; publisher 8 is not ours
        tr.expect(sub, 7)
    cfg = ScenarioConfig(drain_max=60.0, drain_idle=60.0)
    watch = DrainWatch(tr, {7: 3, 8: 100}, cfg)
    assert watch.want == 6
    for seq in range(3):
        tr.see(0, 7, seq)
    tr.see(1, 7, 0)
    tr.see(1, 7, 0)                  # a duplicate is progress, not an arrival
    assert not watch.done()
    tr.see(1, 7, 1)
    assert not watch.done()
    tr.see(1, 7, 2)
    assert watch.done()


def test_drain_stops_at_drain_max_whatever_is_missing():
    tr = Tracker()
    tr.expect(0, 1)
    watch = DrainWatch(tr, {1: 10}, ScenarioConfig(drain_max=0.0, drain_idle=60.0))
    assert watch.done()
