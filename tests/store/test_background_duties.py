"""The store's background service (store/flush.py `BackgroundService`) says when one of its duties
held it up: a duty of 50 ms or more is logged with its wall time and its CPU time, so a latency
spike in a broker's metrics can be matched with the duty that caused it, and the CPU time tells a
duty that computed (holding the GIL: appends, dispatch and delivery wait) from one that waited on
the disk. Real MessageStore, its real background thread."""
from __future__ import annotations

import logging
import re
import time

from lmqtt.store import MessageStore, StoreConfig


def _spin(seconds: float) -> None:
    t = time.thread_time()
    while time.thread_time() - t < seconds:
        pass


def test_a_duty_that_held_the_service_up_is_logged_with_its_wall_and_cpu_time(tmp_path, caplog):
    cfg = StoreConfig(data_dir=str(tmp_path / "s"), segment_size=8 << 20, flush_mode="async")
    with MessageStore(cfg) as st, caplog.at_level(logging.INFO, logger="lmqtt.store"):
        bg = st.background
        before = bg.slow_duties
        bg._duty("quick duty", lambda: None)
        bg._duty("waiting duty", time.sleep, 0.08)
        bg._duty("computing duty", _spin, 0.08)
        lines = {m.group(1): (int(m.group(2)), int(m.group(3)))
                 for r in caplog.records
                 for m in [re.search(r"event=slow_duty duty='([^']+)' ms=(\d+) cpu_ms=(\d+)", r.getMessage())] if m}
        assert bg.slow_duties - before >= 2, lines      # (its own duties may be slow too on a busy machine)
    assert "quick duty" not in lines
    wall, cpu = lines["waiting duty"]
    assert wall >= 80 and cpu < 40, lines
    wall, cpu = lines["computing duty"]
    assert wall >= 80 and cpu >= 70, lines
