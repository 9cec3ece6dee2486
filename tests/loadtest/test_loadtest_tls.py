"""`lmqtt bench compare --tls --password`: both brokers serve the measured port over TLS with a
login, and the generator gets through (the benchmarks over TLS with password authentication)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lmqtt.loadtest import brokers as B


def test_broker_commands_get_the_tls_listener_and_the_password_file(tmp_path):
    sec = B.Security(cert="/c.pem", key="/k.pem", ca="/ca.pem", password_file="/pw", username="u", password="p",
                     lmqtt_args=("--acl-file", "/acl"))
    conf = B.mosquitto_conf(4242, tmp_path, sec).read_text()
    assert "listener 4242 127.0.0.1\ncertfile /c.pem\nkeyfile /k.pem\n" in conf
    assert "allow_anonymous false\npassword_file /pw\n" in conf and "allow_anonymous true" not in conf
    argv, _ = B.command_for("lmqtt", 4242, tmp_path, security=sec)
    i = argv.index("--tls-port")
    assert argv[i:i + 6] == ["--tls-port", "4242", "--cert", "/c.pem", "--key", "/k.pem"]
    assert argv[argv.index("--port") + 1] != "4242"                   # plain MQTT elsewhere
    assert argv[argv.index("--password-file") + 1] == "/pw" and argv[-2:] == ["--acl-file", "/acl"]
    with pytest.raises(B.BrokerUnavailable, match="lmqtt and mosquitto"):
        B.command_for("amqtt", 4242, tmp_path, security=sec)


def test_compare_over_tls_with_password_delivers_everything(tmp_path):
    pytest.importorskip("trustme")
    if not (shutil.which("mosquitto") or Path("/usr/sbin/mosquitto").exists()):
        pytest.skip("mosquitto not installed")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "bench", "compare", "--brokers", "lmqtt,mosquitto",
                        "--scenarios", "pairs", "--pairs", "3", "--duration", "1", "--repeat", "1", "--tls",
                        "--password", "--out", str(out), "--quiet"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(x["broker"] for x in results) == ["lmqtt", "mosquitto"]
    for x in results:
        assert not x.get("error") and x.get("available", True), x
        assert x["params"]["tls"] is True and x["params"]["username"] == "bench"
        assert x["sent"] > 0 and x["lost"] == 0 and x["duplicated"] == 0
    assert "bench-secret" not in (out / "results.jsonl").read_text()   # the password is not recorded
