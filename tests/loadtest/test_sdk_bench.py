"""`lmqtt bench sdk` with a tiny duration: every case emits a JSON line with the contract fields,
and the processes it started are gone afterwards."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys


from tests.support import ROOT


def test_bench_sdk_smoke_fields():
    cases = ["single", "batch", "autobatch", "aio-autobatch", "pull", "group", "pop", "latency"]
    if shutil.which("redis-server"):
        cases += ["redis-xadd", "redis-xreadgroup"]
    r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "bench", "sdk", "--duration", "0.3",
                        "--sizes", "100", "--cases", ",".join(cases)], capture_output=True, cwd=ROOT, timeout=180)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    rows = [json.loads(x) for x in r.stdout.decode().splitlines() if x.strip()]
    ratios = [x for x in rows if x["case"] == "vs-redis"]
    rows = [x for x in rows if x["case"] != "vs-redis"]
    if "redis-xadd" in cases:       # the comparison lines are the rates of this run divided
        rate = {(x["case"], x["size"]): x["msgs_per_s"] for x in rows}
        assert {(x["lmqtt_case"], x["size"]) for x in ratios} == {
            (c, s) for c in ("autobatch", "batch", "group", "pop", "pull") for s in (100,)}
        for x in ratios:
            assert x["ratio"] == round(rate[(x["lmqtt_case"], x["size"])] / rate[(x["redis_case"], x["size"])], 2)
    else:
        assert ratios == []
    assert sorted((x["case"], x["size"]) for x in rows) == sorted((c, s) for c in cases for s in (100,))
    for row in rows:
        assert row["msgs_per_s"] > 0 and row["messages"] > 0, row
        assert row["server_cpu_us_per_msg"] >= 0, row
    for row in rows:
        if row["case"] == "latency":
            assert 0 < row["p50_us"] <= row["p99_us"] <= row["max_us"], row
        if row["case"] in ("pull", "group", "pop"):
            # they read what the produce cases of the same size wrote, not more
            produced = sum(x["messages"] for x in rows if x["size"] == row["size"]
                           and x["case"] in ("single", "batch", "autobatch", "aio-autobatch"))
            assert row["messages"] <= produced, (row, produced)
    assert b"[sdk]" in r.stderr
    # exactly its own processes, all stopped: no child of the bench is left (it names each one it
    # starts; other benches may run lmqtt processes of their own meanwhile)
    pids = [int(x) for x in re.findall(rb"\[sdk\] lmqtt \w+ pid (\d+)", r.stderr)]
    assert len(pids) == 2          # the store for the SDK cases, one `serve` per size for latency
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")], pids


def test_bench_sdk_rejects_unknown_case():
    r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "bench", "sdk", "--cases", "nope"],
                       capture_output=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and b"unknown case" in r.stderr


def test_bench_sdk_read_cases_alone_fill_the_queue_they_read():
    """`--cases pull,group` without a produce case: the queue is filled first (by `batch`, not
    reported) instead of measuring an empty queue at 0 msg/s."""
    r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "bench", "sdk", "--duration", "0.3",
                        "--sizes", "100", "--cases", "pull,group"], capture_output=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    rows = [json.loads(x) for x in r.stdout.decode().splitlines() if x.strip()]
    assert [x["case"] for x in rows] == ["pull", "group"]
    for row in rows:
        assert row["messages"] > 0 and row["msgs_per_s"] > 0, row
    assert b"filling the queue with `batch` first" in r.stderr
