"""An idle `lmqtt serve` (no client) barely wakes: every periodic job follows need (the store's
threads, the timer wheel, the session-offset and POP-state persist timers, the keep-alive wheel
only while there are connections). And once a client comes, everything works as before: its
keep-alive is enforced (the wheel ticks again), a delayed message fires, a message flows.
Real process, the kernel's per-thread context-switch counts (/proc/PID/task/*/status)."""
from __future__ import annotations

import os
import time

import pytest

from tests.support import LmqttServer, Paho, RawMQTT

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")


def _switches(pid: int) -> int:
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                total += sum(int(line.split()[1]) for line in f
                             if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")))
        except OSError:
            pass
    return total


def test_idle_serve_sleeps_then_serves(tmp_path):
    (tmp_path / "data").mkdir()
    srv = LmqttServer(str(tmp_path / "data")).start()
    try:
        time.sleep(4.0)                                  # start-up done, first flushes made
        before = _switches(srv.proc.pid)
        time.sleep(4.0)
        woke = _switches(srv.proc.pid) - before
        # before: ~67 wake-ups a second (timer 20, prefault 12, dispatch 10, background 10,
        # event loop 14); Mosquitto idles at ~10
        assert woke <= 40, f"{woke} context switches in 4 s of idle"

        # a client after the idle spell: its keep-alive is enforced (1 s: closed after 1.5 s)
        raw = RawMQTT(srv)
        ack = raw.connect("idle-ka", keepalive=1)
        assert ack is not None and ack.reason_code == 0
        assert raw.closed_by_server(timeout=8.0)
        raw.close()

        # and messages, delayed ones included, still flow
        sub = Paho(srv, client_id="idle-sub")
        sub.connect()
        sub.subscribe("idle/t", qos=1)
        pub = Paho(srv, client_id="idle-pub")
        pub.connect()
        pub.publish("idle/t", b"now", qos=1)
        pub.publish("$delayed/1/idle/t", b"later", qos=1)
        got = [m.payload for m in sub.get_n(2, timeout=15.0)]
        assert got == [b"now", b"later"]
        sub.disconnect()
        pub.disconnect()
    finally:
        srv.stop()
