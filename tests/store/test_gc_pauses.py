"""Garbage-collector pauses are timed and the long ones logged (store/gc_pauses.py), so that a
latency spike in a broker's log can be matched with a full collection."""
from __future__ import annotations

import gc
import logging

from lmqtt.store import gc_pauses


def test_a_long_collection_is_logged_with_its_generation_and_every_collection_counted(caplog, monkeypatch):
    pauses = gc_pauses.install()
    pauses.take_longest()
    monkeypatch.setattr(gc_pauses, "SLOW_S", 0.002)     # what "long" is, scaled to a test's heap
    assert gc_pauses.install() is pauses and gc.callbacks.count(pauses) == 1    # once per process
    gc.disable()          # only the collections asked for here
    try:
        before = list(pauses.collections), pauses.slow
        held = [{"i": i} for i in range(200_000)]       # a full collection scans them all
        gc.collect(0)                                   # young: the threshold or not, counted
        assert pauses.collections[0] == before[0][0] + 1
        slow_young = pauses.slow - before[1]
        with caplog.at_level(logging.INFO, logger="lmqtt.gc"):
            gc.collect()
        del held
    finally:
        gc.enable()
    assert pauses.collections[2] == before[0][2] + 1
    assert pauses.longest_s >= gc_pauses.SLOW_S and pauses.slow == before[1] + slow_young + 1
    # a sampler's row: the longest since it last asked, then nothing until the next collection
    assert pauses.take_longest() >= gc_pauses.SLOW_S and pauses.take_longest() == 0.0
    lines = [r.getMessage() for r in caplog.records if "event=slow_gc" in r.getMessage()]
    assert len(lines) == 1 and "generation=2 " in lines[0] and " ms=" in lines[0], lines
