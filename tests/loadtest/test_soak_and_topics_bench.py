"""`lmqtt bench soak` and `lmqtt bench topics`, run short: each drives a real `lmqtt serve`, checks
what it promises (every acknowledged message delivered; every sampled topic read back after both
restarts) and writes the rows, the summary and the plot it documents."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT


def test_soak_bench_samples_the_broker_and_loses_nothing(tmp_path):
    out = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "bench", "soak", "--duration", "8",
                          "--devices", "50", "--rate", "200", "--churn-per-min", "120", "--retention", "5s",
                          "--segment-mb", "8", "--sample-s", "2", "--out", str(tmp_path / "soak"),
                          "--plot", str(tmp_path / "soak.png"), "--quiet"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["phase"] == "summary" and summary["lost"] == 0 and summary["error_lines"] == 0
    assert summary["acked"] > 1000 and summary["reconnects"] > 5
    with open(tmp_path / "soak" / "soak.jsonl") as f:
        rows = [json.loads(ln) for ln in f]
    assert len(rows) >= 3
    for key in ("rss_anon", "rss_file", "open_files", "maps", "threads", "disk_bytes", "p99_ms"):
        assert all(r[key] > 0 for r in rows), key
    # the wall clock of each row (to find it beside a log line) and the generator's own longest GC
    assert all(len(r["utc"]) == 8 and r["utc"][2] == ":" and r["gen_gc_max_ms"] >= 0 for r in rows), rows[0]
    # between two rows (2 s) anonymous memory is read every 0.5 s: the row's band holds them all
    for r in rows:
        assert r["anon_n"] >= 3 and 0 < r["anon_min"] <= r["anon_avg"] <= r["anon_max"], r
    lo, hi = summary["anon_all_range"]
    assert lo == min(r["anon_min"] for r in rows if r["t_s"] >= 5) and hi >= lo > 0
    assert summary["anon_all_spread_pct"] >= 0
    assert (tmp_path / "soak.png").stat().st_size > 10_000


def test_a_soak_ended_with_ctrl_c_still_counts_its_tail_and_writes_its_summary_and_plot(tmp_path):
    import signal
    import time
    rows_path = tmp_path / "soak" / "soak.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "lmqtt.gateway.cli", "bench", "soak", "--duration", "600",
                             "--devices", "20", "--rate", "100", "--churn-per-min", "60", "--retention", "5s",
                             "--segment-mb", "8", "--sample-s", "1", "--out", str(tmp_path / "soak"),
                             "--plot", str(tmp_path / "soak.png"), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if rows_path.exists() and len(rows_path.read_text().splitlines()) >= 3:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stdout[-2000:] + stderr[-2000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["interrupted"] is True and 2 < summary["loaded_s"] < 600
    assert summary["lost"] == 0 and summary["acked"] > 100
    assert "interrupted after" in stderr
    assert (tmp_path / "soak.png").stat().st_size > 10_000


def test_topics_bench_reads_every_sampled_topic_back_after_both_restarts(tmp_path):
    out = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "bench", "topics", "--topics", "3000",
                          "--sample", "30", "--data-dir", str(tmp_path / "w")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert [r["phase"] for r in rows] == ["publish", "restart-sigterm", "restart-kill9", "summary"]
    assert rows[0]["acknowledged"] == 3000
    for r in rows[1:3]:
        got, sampled = r["mqtt_read"].split("/")
        assert got == sampled and int(sampled) >= 25 and r["sdk_read"] == r["mqtt_read"] and r["restart_s"] > 0
    assert rows[3]["error_lines"] == 0 and 0 < rows[3]["peak_open_files"] < 1000
