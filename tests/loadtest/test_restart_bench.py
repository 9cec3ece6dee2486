"""`lmqtt bench restart`: each broker is restarted with its persistent sessions and still has
them (a sample resumes with its session present); one JSON line per restart."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT


def test_restart_bench_restarts_each_broker_with_its_sessions():
    out = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "bench", "restart", "--brokers",
                          "lmqtt,mosquitto", "--sessions", "120", "--repeat", "2"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["case"], r["rep"]) for r in rows] == [("lmqtt", 1), ("lmqtt", 2), ("mosquitto", 1), ("mosquitto", 2)]
    for r in rows:
        assert r["sessions"] == 120 and r["sample"] == 40 and r["sample_present"] == 40, r
        assert r["restart_s"] > 0 and r["stop_s"] >= 0
