"""`lmqtt serve` as a user runs it: banner, config file + flags, clean SIGTERM/SIGINT, clear errors."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.support import ROOT, LmqttServer, Paho, free_port, listening

pytestmark = pytest.mark.timeout(60)


def _run(args, timeout=20):
    return subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "serve", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_banner_and_clean_stop(tmp_path, sig):
    srv = LmqttServer(str(tmp_path / "d"), log_path=str(tmp_path / "log")).start()
    c = Paho(srv, "banner-client")
    c.subscribe("b/t", 1)
    assert srv.stop(sig) == 0
    log = open(tmp_path / "log").read()
    assert f"listening on mqtt://127.0.0.1:{srv.port}" in log
    assert f"data dir:   {os.path.abspath(tmp_path / 'd')}" in log
    assert "flush mode: async" in log
    assert f"metrics:    http://127.0.0.1:{srv.metrics_port}/metrics" in log
    assert "stopped cleanly" in log
    assert (tmp_path / "d" / "store").is_dir()


def test_config_file_and_flag_precedence(tmp_path):
    port_file, port_flag = free_port(), free_port()
    cfg = tmp_path / "lmqtt.toml"
    cfg.write_text(f'[serve]\nport = {port_file}\nflush-mode = "sync"\nmetrics_port = 0\n'
                   f'data_dir = "{tmp_path / "from-file"}"\nsegment_mb = 16\n')
    p = subprocess.Popen([sys.executable, "-m", "lmqtt.gateway.cli", "serve", "--config", str(cfg), "--port",
                          str(port_flag)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        listening("127.0.0.1", port_flag, 20, p)   # (if not: the exit code below says why)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert f"mqtt://127.0.0.1:{port_flag}" in err          # the flag wins over the file
    assert "flush mode: sync" in err                        # the file wins over the default
    assert "metrics:    off" in err
    assert (tmp_path / "from-file" / "store").is_dir()


def test_bad_config_values_give_clear_errors(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('flush_mode = "sometimes"\n')
    r = _run(["--config", str(cfg)])
    assert r.returncode == 2 and "flush_mode must be one of" in r.stderr
    r = _run(["--config", str(tmp_path / "missing.toml")])
    assert r.returncode == 2 and "config file not found" in r.stderr
    (tmp_path / "broken.toml").write_text("port = [\n")
    r = _run(["--config", str(tmp_path / "broken.toml")])
    assert r.returncode == 2 and "not valid TOML" in r.stderr


def test_port_in_use_is_reported(tmp_path):
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    try:
        r = _run(["--port", str(port), "--data-dir", str(tmp_path / "d"), "--metrics-port", "0",
                  "--segment-mb", "16"])
    finally:
        blocker.close()
    assert r.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr


def test_structured_logs_are_key_value(tmp_path):
    srv = LmqttServer(str(tmp_path / "d"), log_path=str(tmp_path / "log")).start()
    srv.stop()
    lines = [ln for ln in open(tmp_path / "log") if ln.startswith("ts=")]
    assert lines and all(" level=" in ln and " logger=" in ln for ln in lines)
    assert any("event=broker_started" in ln for ln in lines)
