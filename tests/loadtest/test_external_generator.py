"""`lmqtt bench external`: fan-in driven by Mosquitto's own clients against real brokers.

No timing assertions: the runs are small, and what is checked is that every message sent was
counted once at the subscriber, the broker's CPU was read, and a missing tool or broker is said
plainly.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(shutil.which("mosquitto_pub") is None or shutil.which("mosquitto_sub") is None,
                                reason="mosquitto-clients not installed (Debian: mosquitto-clients)")


def _bench(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "bench", "external", *args],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.skipif(shutil.which("mosquitto") is None, reason="mosquitto not installed")
def test_every_message_of_each_publisher_is_counted_once_on_lmqtt_and_mosquitto(tmp_path):
    out = tmp_path / "ext.jsonl"
    r = _bench("--brokers", "lmqtt,mosquitto", "--publishers", "3", "--messages", "400", "--qos", "1",
               "--rounds", "1", "--idle-s", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["broker"] for x in rows] == ["lmqtt", "mosquitto"]
    for row in rows:
        # QoS 1 end to end: nothing may be missing, and a duplicate would count above `sent`
        assert row["sent"] == 1200 and row["received"] == 1200, row
        assert row["publisher_errors"] == 0, row
        assert row["broker_cpu_s"] > 0 and row["cpu_us_per_msg"] > 0
    assert "lmqtt: " in r.stderr and "mosquitto: " in r.stderr


def test_a_broker_of_several_processes_is_measured_with_every_process_under_it(tmp_path):
    """`serve --workers 2` is a supervisor over a store and two gateways: the messages cross the
    gateways (the kernel spreads the connections over them), and the CPU is theirs, not the idle
    supervisor's alone."""
    out = tmp_path / "ext.jsonl"
    r = _bench("--brokers", "lmqtt-workers", "--publishers", "4", "--messages", "1500", "--qos", "1",
               "--rounds", "1", "--idle-s", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    row, = [json.loads(x) for x in out.read_text().splitlines()]
    assert row["broker"] == "lmqtt-workers" and row["sent"] == 6000 and row["received"] == 6000, row
    # 6,000 QoS 1 messages through Python gateways cost them well over 0.1 s; the supervisor
    # waiting on its children, measured alone, a few hundredths at most
    assert row["broker_cpu_s"] > 0.1, row


def test_missing_clients_are_named_with_their_package(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "mosquitto_sub").symlink_to(shutil.which("mosquitto_sub"))
    env = {**os.environ, "PATH": f"{bindir}:{os.path.dirname(sys.executable)}"}
    r = _bench("--brokers", "mosquitto", "--rounds", "1", env=env)
    assert r.returncode == 2
    assert "mosquitto_pub not found (Debian: mosquitto-clients)" in r.stderr


def test_a_broker_that_cannot_start_is_reported_and_fails_the_run(tmp_path):
    out = tmp_path / "ext.jsonl"
    r = _bench("--brokers", "lmqtt@/nonexistent/tree", "--publishers", "1", "--messages", "1",
               "--rounds", "1", "--out", str(out))
    assert r.returncode == 1
    row = json.loads(out.read_text())
    assert row["broker"] == "lmqtt@/nonexistent/tree" and row["available"] is False
    assert row["reason"]
