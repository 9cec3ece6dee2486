"""`lmqtt serve --workers 2`: one store process and two gateway processes on one port
(SO_REUSEPORT), notified by the store itself; clients spread over both and see one broker: every
message crosses workers, a persistent session resumes wherever the reconnect lands, a client id
connected twice is taken over across workers, and a worker killed with SIGKILL is restarted while
the other keeps serving."""
import os
import signal
import subprocess
import time
import urllib.request

import pytest

from lmqtt.loadtest.brokers import free_port_pair
from tests.support import LmqttServer, Paho


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    d = tmp_path_factory.mktemp("workers")
    srv = LmqttServer(str(d / "data"), extra_args=("--workers", "2"), log_path=str(d / "serve.log"))
    srv.metrics_port = free_port_pair()        # worker i serves /metrics on metrics_port + i
    srv.start()
    _wait_ready(srv)
    yield srv
    srv.stop()


def _wait_ready(srv, timeout=30):
    """Both workers answer /readyz (the port opens with the first one)."""
    deadline = time.monotonic() + timeout
    for i in (0, 1):
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port + i}/readyz", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"worker {i} not ready: {srv.log_tail()}"
            time.sleep(0.1)


def _connections(srv, i):
    body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port + i}/metrics", timeout=5).read().decode()
    return int(float(next(line.split()[1] for line in body.splitlines() if line.startswith("lmqtt_connections "))))


def _children(srv):
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(srv.proc.pid)], capture_output=True, text=True).stdout
    return {int(line.split()[0]): line for line in out.splitlines() if line.strip()}


def test_clients_spread_over_both_workers_and_every_message_crosses(workers):
    subs = [Paho(workers, client_id=f"sub-{i}", version=5) for i in range(12)]
    for s in subs:
        s.subscribe("spread/+/t", qos=1)
    assert _connections(workers, 0) > 0 and _connections(workers, 1) > 0      # both workers serve
    pubs = [Paho(workers, client_id=f"pub-{i}", version=5) for i in range(4)]
    for i, p in enumerate(pubs):
        for q in (0, 1, 2):
            p.publish(f"spread/{i}/t", f"{i}-{q}".encode(), qos=q)
    want = sorted(f"{i}-{q}".encode() for i in range(4) for q in (0, 1, 2))
    for s in subs:
        assert sorted(m.payload for m in s.get_n(12, timeout=10)) == want
    for c in subs + pubs:
        c.disconnect()


def test_persistent_session_resumes_on_whichever_worker_and_takeover_crosses_workers(workers):
    c = Paho(workers, client_id="roamer", version=5, clean=False, expiry=300)
    c.subscribe("roam/#", qos=1)
    c.disconnect()
    pub = Paho(workers, client_id="roam-pub", version=5)
    for i in range(20):
        pub.publish("roam/x", str(i).encode(), qos=1)
    got = []
    for attempt in range(4):           # reconnects land on either worker; the session follows
        c = Paho(workers, client_id="roamer", version=5, clean=False, expiry=300)
        assert c.session_present
        got += [int(m.payload) for m in c.get_n(20 - len(got), timeout=5)]
        c.disconnect()
        if len(got) >= 20:
            break
    assert sorted(set(got)) == list(range(20))
    # the same client id twice: the first connection is taken over (0x8E), wherever it was
    first = Paho(workers, client_id="twice", version=5)
    second = Paho(workers, client_id="twice", version=5)
    rc = first.disconnects.get(timeout=10)
    assert int(getattr(rc, "value", rc)) == 0x8E
    second.disconnect()
    pub.disconnect()


def test_a_killed_worker_is_restarted_and_the_other_keeps_serving(workers):
    gateways = {pid: cmd for pid, cmd in _children(workers).items() if " gateway " in cmd}
    assert len(gateways) == 2
    victim = sorted(gateways)[0]
    os.kill(victim, signal.SIGKILL)
    # once the victim is gone its listening socket is closed, and the kernel hands every new
    # connection on the shared port (SO_REUSEPORT) to the other worker; a connection that reached
    # the victim's accept queue in the instant before is reset, as for any crashed listener
    deadline = time.monotonic() + 10
    while not _gone(victim) and time.monotonic() < deadline:
        time.sleep(0.02)
    c = Paho(workers, client_id="after-kill", version=5)          # the other worker answers
    c.subscribe("k/t", qos=1)
    c.publish("k/t", b"still here", qos=1)
    assert c.get(timeout=5).payload == b"still here"
    c.disconnect()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = {pid for pid, cmd in _children(workers).items() if " gateway " in cmd}
        if len(now) == 2 and victim not in now:
            break
        time.sleep(0.2)
    assert len(now) == 2 and victim not in now                      # restarted as a new process
    _wait_ready(workers)
    assert "worker 0" in workers.log_tail(50_000) or "worker 1" in workers.log_tail(50_000)


def _gone(pid: int) -> bool:
    """Exited (a zombie not yet reaped by whoever adopted it counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_killed_supervisor_takes_its_workers_with_it_and_a_restart_finds_the_data(tmp_path):
    """`kill -9` of `lmqtt serve --workers 2` itself: the store and the gateways stop
    too (nothing left holding the ports or the data directory), and `lmqtt serve --workers 2`
    started again on the same port and data has the acknowledged retained message."""
    srv = LmqttServer(str(tmp_path / "data"), extra_args=("--workers", "2"), log_path=str(tmp_path / "serve.log"))
    srv.metrics_port = free_port_pair()
    srv.start()
    try:
        _wait_ready(srv)
        pub = Paho(srv, client_id="before-kill", version=5)
        pub.publish("kept/state", b"on", qos=1, retain=True)          # returns once acknowledged
        pub.disconnect()
        children = _children(srv)
        assert len(children) >= 3, children                          # store + 2 gateways
        srv.stop(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not all(_gone(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {p: line for p, line in children.items() if not _gone(p)}
        assert not left, f"still running after the supervisor was killed: {left}"
        srv.start()                                                  # same ports, same data
        _wait_ready(srv)
        sub = Paho(srv, client_id="after-restart", version=5)
        sub.subscribe("kept/#", qos=1)
        assert [(m.topic, m.payload, m.retain) for m in sub.get_n(1, timeout=10)] == [("kept/state", b"on", True)]
        sub.disconnect()
    finally:
        srv.stop()


def test_serve_workers_passes_sys_interval_to_its_gateways(tmp_path):
    """`lmqtt serve --workers 2 --sys-interval 1`: every gateway takes the flag (`lmqtt gateway`
    refused it, so the supervisor exited) and publishes $SYS at that interval."""
    srv = LmqttServer(str(tmp_path / "data"), extra_args=("--workers", "2", "--sys-interval", "1"),
                      log_path=str(tmp_path / "serve.log")).start()
    try:
        c = Paho(srv, client_id="sys-watcher")
        assert c.subscribe("$SYS/broker/gateways/+/uptime", qos=0) == [0]     # per gateway in a fleet
        got = c.get_n(3, timeout=10)          # the retained value, then one per second
        assert len(got) == 3, open(tmp_path / "serve.log").read()[-2000:]
        c.disconnect()
    finally:
        srv.stop()
