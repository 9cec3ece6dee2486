"""The paced fixed-rate worker (loadtest/paced.py): an even schedule over all processes, kernel
receive timestamps, and the same accounting as every other scenario, against a real Mosquitto."""
from __future__ import annotations

import itertools
import os
import shutil

import pytest

from lmqtt.loadtest import brokers, mqtt_bench
from lmqtt.loadtest.paced import schedule
from lmqtt.loadtest.scenarios import ScenarioConfig, partition, plan


def test_schedule_spreads_every_message_evenly_over_processes_and_publishers():
    # the latency scenario's layout: 50 pairs over 2 processes (publisher i in process i % 2)
    cfg = ScenarioConfig(scenario="latency", publishers=50, subscribers=50, qos=1, rate=5000.0, procs=2)
    parts = partition(plan(cfg), cfg.procs)
    t_go = 10**12
    merged = []
    for part in parts:
        mine = [sp.pub_id for sp in part if sp.role == "pub"]
        merged += itertools.islice(schedule(mine, cfg.publishers, cfg.rate, t_go), 500)
    merged.sort()
    times = [t for t, _ in merged]
    gaps = {b - a for a, b in zip(times, times[1:])}
    assert gaps <= {200_000}, gaps       # one message every 200 µs: never two at once (no bursts)
    assert times[0] == t_go
    per_pub = {}
    for t, p in merged:
        per_pub.setdefault(p, []).append(t)
    assert sorted(per_pub) == list(range(50))
    for ts in per_pub.values():           # each publisher every 50 / 5000 s = 10 ms
        assert {b - a for a, b in zip(ts, ts[1:])} == {10_000_000}


def _latency_run_on_mosquitto(tmp_path, pairs: int, rate: float, duration: float) -> dict:
    """`lmqtt bench mqtt` latency scenario (QoS 1, 2 processes) against a real Mosquitto: -> its result."""
    b = brokers.start("mosquitto", tmp_path)
    try:
        cfg = ScenarioConfig(scenario="latency", host=b.host, port=b.port, publishers=pairs, subscribers=pairs,
                             qos=1, rate=rate, duration=duration, procs=2, drain_max=20.0, drain_idle=5.0)
        return mqtt_bench.run(cfg, b.pid, broker="mosquitto", quiet=True)
    finally:
        b.stop()


@pytest.mark.skipif(shutil.which("mosquitto") is None and not os.path.exists("/usr/sbin/mosquitto"),
                    reason="mosquitto binary not installed")
def test_latency_scenario_is_paced_and_timed_by_the_kernel(tmp_path):
    res = _latency_run_on_mosquitto(tmp_path, 6, 600.0, 1.5)
    assert res["gen_loop"] == "paced"
    assert res["gen_rx_kernel_reads"] > 0          # SO_TIMESTAMPNS arrival times, not loop time
    assert res["sent"] > 500 and res["received"] == res["expected"] == res["sent"], res.get("connect")
    assert res["lost"] == 0 and res["duplicated"] == 0 and res["unacked"] == 0
    lat = res["latency_us"]
    assert lat["count"] == res["received"] and 0 < lat["p50"] <= lat["p99"] <= lat["max"]


@pytest.mark.skipif(shutil.which("mosquitto") is None and not os.path.exists("/usr/sbin/mosquitto"),
                    reason="mosquitto binary not installed")
def test_asyncio_worker_still_runs_fixed_rate_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("LMQTT_BENCH_ASYNC_RATE", "1")
    res = _latency_run_on_mosquitto(tmp_path, 4, 400.0, 1.0)
    assert res["gen_loop"] == "asyncio" and res["gen_rx_kernel_reads"] == 0
    assert res["received"] == res["sent"] > 0 and res["lost"] == 0, res.get("connect")


@pytest.mark.skipif(shutil.which("cc") is None or (shutil.which("mosquitto") is None
                                                   and not os.path.exists("/usr/sbin/mosquitto")),
                    reason="needs a C compiler and mosquitto")
def test_the_independent_c_harness_builds_and_counts_every_delivery(tmp_path):
    import json
    import subprocess
    from pathlib import Path
    src = Path(__file__).resolve().parents[2] / "benchmarks" / "latency_harness.c"
    exe = tmp_path / "latency_harness"
    subprocess.run(["cc", "-O2", "-o", str(exe), str(src)], check=True, capture_output=True, timeout=120)
    b = brokers.start("mosquitto", tmp_path)
    try:
        out = subprocess.run([str(exe), str(b.port), "4", "400", "1"], capture_output=True, text=True,
                             timeout=60, check=True)
    finally:
        b.stop()
    r = json.loads(out.stdout)
    assert r["sent"] == r["received"] >= 380
    assert 0 < r["p50_us"] <= r["p99_us"] <= r["max_us"]
