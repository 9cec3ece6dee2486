"""Bridges to other MQTT brokers (TOML `[[bridge]]`), end to end with real processes: Debian's
Mosquitto both ways, including Mosquitto stopped while 1,000 QoS 1 messages are published here and
started again (all 1,000 arrive once, in order: stored here, forwarded when it is back), `both`
lines that do not echo, and two lmqtt servers bridged to each other without a loop."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time

import pytest

from tests.support import LmqttServer, Paho, free_port, listening, metric

pytestmark = pytest.mark.timeout(300)

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto") else None)


class Mosquitto:
    """Debian's mosquitto with persistence (its sessions survive a stop and start)."""

    def __init__(self, folder) -> None:
        self.host, self.port = "127.0.0.1", free_port()
        self.dir = str(folder)
        self.conf = os.path.join(self.dir, "mosquitto.conf")
        lines = [f"listener {self.port} 127.0.0.1", "allow_anonymous true", "persistence true",
                 f"persistence_location {self.dir}/", "autosave_interval 0", "max_queued_messages 100000",
                 "max_inflight_messages 0", "set_tcp_nodelay true", "log_dest stderr", "log_type error",
                 "log_type warning"]
        if os.geteuid() == 0:
            lines.append("user root")
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Mosquitto":
        self.log = open(os.path.join(self.dir, "mosquitto.log"), "ab")
        self.proc = subprocess.Popen([MOSQUITTO, "-c", self.conf], stdout=self.log, stderr=subprocess.STDOUT)
        assert listening(self.host, self.port, 20, self.proc), "mosquitto did not start"
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)        # a clean stop: it writes its sessions to disk
            self.proc.wait(20)


def _bridge_config(path, remote_port: int, *topics: str, name: str = "far", extra: str = "") -> str:
    lines = ["[[bridge]]", f'name = "{name}"', f'address = "127.0.0.1:{remote_port}"', "reconnect_max_s = 1",
             "topics = [" + ", ".join(_toml_str(t) for t in topics) + "]", extra]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _wait_metric(url: str, name: str, want: float, timeout: float = 30.0) -> float | None:
    """The metric once it is `want` (the metrics port opens a moment after MQTT's), else its last value."""
    deadline = time.monotonic() + timeout
    v = None
    while time.monotonic() < deadline:
        try:
            v = metric(url, name)
        except (OSError, AssertionError):
            v = None
        if v == want:
            break
        time.sleep(0.1)
    return v


class _Collector:
    """A paho client that records payloads as they arrive (reconnecting by itself)."""

    def __init__(self, host: str, port: int, cid: str, topic: str, clean: bool = True) -> None:
        import paho.mqtt.client as mqtt
        self.got: list[bytes] = []
        self.lock = threading.Lock()
        self.subscribed = threading.Event()
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cid, clean_session=clean,
                             protocol=mqtt.MQTTv311)
        self.c.reconnect_delay_set(0.1, 1)

        def on_message(_c, _u, m) -> None:
            with self.lock:
                self.got.append(m.payload)
        self.c.on_message = on_message
        self.c.on_connect = lambda c, _u, _f, _rc, _p: c.subscribe(topic, 1)
        self.c.on_subscribe = lambda *_a: self.subscribed.set()
        self.c.connect(host, port, 30)
        self.c.loop_start()
        assert self.subscribed.wait(20), "no SUBACK"

    def wait(self, n: int, timeout: float = 60.0) -> list[bytes]:
        deadline = time.monotonic() + timeout
        while len(self.got) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)                   # a duplicate would arrive now
        with self.lock:
            return list(self.got)

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


@pytest.mark.skipif(MOSQUITTO is None, reason="needs Debian's mosquitto (.ci/run installs it)")
def test_a_bridge_to_mosquitto_both_ways_stores_and_forwards_through_an_outage(tmp_path):
    mq = Mosquitto(tmp_path).start()
    cfg = _bridge_config(tmp_path / "lmqtt.toml", mq.port, "fact/# out 1", "cmd/# in 1 edge/ cloud/edge/",
                         "chat/# both 1")
    srv = LmqttServer(str(tmp_path / "data"), extra_args=("--config", cfg, "--sys-interval", "0"),
                      log_path=str(tmp_path / "serve.log")).start()
    far = near = None
    try:
        assert _wait_metric(srv.metrics_url, 'lmqtt_bridge_connected{bridge="far"}', 1) == 1, srv.log_tail()
        # a persistent subscriber on Mosquitto's side (its session is kept across Mosquitto's restart)
        far = _Collector(mq.host, mq.port, "far-sub", "fact/#", clean=False)
        near = _Collector(srv.host, srv.port, "near-sub", "edge/#")
        # in: Mosquitto's cloud/edge/cmd/... arrives here as edge/cmd/...
        pub = Paho(mq, client_id="cloud-pub")
        pub.publish("cloud/edge/cmd/reboot", b"now", qos=1)
        assert near.wait(1) == [b"now"]
        near.close()
        # out, through an outage: Mosquitto stopped, 1,000 QoS 1 messages published here meanwhile
        pub.c.loop_stop()
        mq.stop()
        assert _wait_metric(srv.metrics_url, 'lmqtt_bridge_connected{bridge="far"}', 0) == 0
        local = Paho(srv, client_id="edge-pub")
        for i in range(1000):
            local.publish("fact/line7", f"{i:04d}".encode(), qos=1)     # each PUBACKed: stored here
        local.disconnect()
        time.sleep(1.0)
        assert far.got == []
        mq.start()
        got = far.wait(1000, timeout=90)
        assert len(got) == 1000 and got == [f"{i:04d}".encode() for i in range(1000)], (
            len(got), len(set(got)), got[:5], srv.log_tail())
        assert metric(srv.metrics_url, 'lmqtt_bridge_messages_total{bridge="far",direction="out"}') >= 1000
        far.close()
        far = None
        # both: a message from either side crosses once and does not come back (No Local)
        here = _Collector(srv.host, srv.port, "chat-here", "chat/#")
        there = _Collector(mq.host, mq.port, "chat-there", "chat/#")
        Paho(srv, client_id="chat-a").publish("chat/1", b"from-lmqtt", qos=1)
        Paho(mq, client_id="chat-b").publish("chat/2", b"from-mosquitto", qos=1)
        assert sorted(here.wait(2)) == [b"from-lmqtt", b"from-mosquitto"]
        assert sorted(there.wait(2)) == [b"from-lmqtt", b"from-mosquitto"]
        here.close()
        there.close()
    finally:
        if far is not None:
            far.close()
        assert srv.stop() == 0, srv.log_tail()
        mq.stop()


def test_two_lmqtt_servers_bridged_both_ways_do_not_loop(tmp_path):
    a_port, b_port = free_port(), free_port()
    # each pushes its own messages to the other: without the bridges' marker each message would
    # come back (A -> B, B's bridge picks it up -> A ...) for ever
    a_cfg = _bridge_config(tmp_path / "a.toml", b_port, "loop/# out 1", name="to-b")
    b_cfg = _bridge_config(tmp_path / "b.toml", a_port, "loop/# out 1", name="to-a")
    a = LmqttServer(str(tmp_path / "a"), extra_args=("--config", a_cfg, "--sys-interval", "0"),
                    log_path=str(tmp_path / "a.log"))
    a.port = a_port
    b = LmqttServer(str(tmp_path / "b"), extra_args=("--config", b_cfg, "--sys-interval", "0"),
                    log_path=str(tmp_path / "b.log"))
    b.port = b_port
    a.start()
    b.start()
    try:
        for s, name in ((a, "to-b"), (b, "to-a")):
            assert _wait_metric(s.metrics_url, f'lmqtt_bridge_connected{{bridge="{name}"}}', 1) == 1, s.log_tail()
        on_a = _Collector(a.host, a.port, "watch-a", "loop/#")
        on_b = _Collector(b.host, b.port, "watch-b", "loop/#")
        Paho(a, client_id="pub-a").publish("loop/x", b"hello", qos=1)
        Paho(b, client_id="pub-b").publish("loop/y", b"world", qos=1)
        # each side gets each once; a ping-pong would deliver them again and again
        assert sorted(on_a.wait(2, timeout=10)) == [b"hello", b"world"]
        assert sorted(on_b.wait(2, timeout=10)) == [b"hello", b"world"]
        time.sleep(1.5)
        assert sorted(on_a.got) == [b"hello", b"world"] and sorted(on_b.got) == [b"hello", b"world"], (on_a.got, on_b.got)
        on_a.close()
        on_b.close()
    finally:
        assert a.stop() == 0, a.log_tail()
        assert b.stop() == 0, b.log_tail()


@pytest.mark.parametrize("table, says", [
    ('name = "x"\naddress = "h:1883"\ntopics = ["a/# sideways 1"]', "direction must be out, in or both, got 'sideways'"),
    ('name = "x"\naddress = "h:1883"\ntopics = ["a/# out 3"]', "qos must be 0, 1 or 2, got '3'"),
    ('name = "x"\naddress = "h:1883"\ntopics = ["# in 1 local/"]', "give both prefixes"),
    ('name = "x"\naddress = "h:1883"\ntopics = ["a/#/b out"]', "'a/#/b' is not a valid topic filter"),
    ('name = "x"\naddress = "h:port"\ntopics = ["a/#"]', "'port' is not a port number"),
    ('name = "x"\ntopics = ["a/#"]', "address = \\\"HOST:PORT\\\" of the remote broker is required"),
    ('name = "x"\naddress = "h:1"\ntopic = ["a/#"]', "unknown key 'topic' (did you mean 'topics'?)"),
])
def test_a_bridge_that_cannot_work_is_refused_in_one_line(tmp_path, table, says):
    from tests.gateway.test_config_strict import run_refused
    cfg = tmp_path / "lmqtt.toml"
    cfg.write_text("[[bridge]]\n" + table + "\n")
    data = tmp_path / "d"
    r = run_refused(["serve", "--config", str(cfg), "--data-dir", str(data), "--port", "0", "--metrics-port", "0"])
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "[[bridge]] 'x'" in lines[0] and says.replace('\\"', '"') in lines[0], lines
    assert not data.exists()


def test_a_remote_broker_that_cannot_be_reached_is_named_in_the_log(tmp_path):
    """A bridge whose remote is away logs why, and where it tried: an OS error alone ("Connection
    refused", "Name or service not known") does not say which broker of which address it was."""
    port = free_port()                     # nothing listens there
    cfg = _bridge_config(tmp_path / "lmqtt.toml", port, "w/# out 1", name="away")
    log = tmp_path / "serve.log"
    srv = LmqttServer(str(tmp_path / "data"), extra_args=("--config", cfg, "--sys-interval", "0"), log_path=str(log))
    srv.start()
    try:
        deadline = time.monotonic() + 30
        lines: list[str] = []
        while not lines and time.monotonic() < deadline:
            lines = [x for x in log.read_text().splitlines() if "event=bridge_connect_failed" in x]
            time.sleep(0.1)
        assert lines, srv.log_tail()
        assert "bridge=away" in lines[0] and f"remote=127.0.0.1:{port}" in lines[0], lines[0]
        assert "Traceback" not in log.read_text()
    finally:
        assert srv.stop() == 0, srv.log_tail()


def test_serve_workers_runs_each_bridge_in_its_first_worker_only(tmp_path):
    """Every worker of `serve --workers 2` reads the same [[bridge]] tables; two copies of a bridge
    would take its client ids over from each other, so only the first worker runs it."""
    cfg = _bridge_config(tmp_path / "lmqtt.toml", free_port(), "w/# out 1", name="one")
    srv = LmqttServer(str(tmp_path / "data"), extra_args=("--config", cfg, "--workers", "2", "--sys-interval", "0"),
                      log_path=str(tmp_path / "serve.log"))
    srv.start(timeout=60)
    try:
        def has_bridge(port: int) -> bool | None:
            import urllib.request
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    return "lmqtt_bridge_connected" in r.read().decode()
            except OSError:
                return None
        deadline = time.monotonic() + 60
        seen = (None, None)
        while None in seen and time.monotonic() < deadline:
            seen = (has_bridge(srv.metrics_port), has_bridge(srv.metrics_port + 1))
            time.sleep(0.2)
        assert seen == (True, False), (seen, srv.log_tail())
    finally:
        assert srv.stop() == 0, srv.log_tail()
