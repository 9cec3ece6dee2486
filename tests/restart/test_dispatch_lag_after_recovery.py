"""After a kill -9 and a restart, what a persistent session is handed of the messages stored before
the crash is its backlog, not dispatch lag: `lmqtt_dispatch_lag_seconds` (and the console's chart,
which reads it) measures the messages stored while this gateway runs, from their store time to
their first send. Real `lmqtt serve` killed with SIGKILL, paho clients, /metrics scraped."""
from __future__ import annotations

import time
import urllib.request

import pytest

from tests.support import LmqttServer, Paho

pytestmark = pytest.mark.timeout(120)


def _lag(url: str) -> tuple[float, float, float]:
    """(count, sum, count above 1 s) of lmqtt_dispatch_lag_seconds."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    vals = {}
    for line in text.splitlines():
        if line.startswith("lmqtt_dispatch_lag_seconds"):
            k, v = line.rsplit(" ", 1)
            vals[k] = float(v)
    count = vals["lmqtt_dispatch_lag_seconds_count"]
    return count, vals["lmqtt_dispatch_lag_seconds_sum"], count - vals['lmqtt_dispatch_lag_seconds_bucket{le="1.0"}']


def test_messages_stored_before_a_crash_are_not_dispatch_lag_after_it(tmp_path):
    srv = LmqttServer(str(tmp_path / "d"), log_path=str(tmp_path / "serve.log")).start()
    try:
        dev = Paho(srv, client_id="lag-dev", version=4, clean=False)
        dev.subscribe("lag/t", 1)
        dev.disconnect()
        pub = Paho(srv, client_id="lag-pub")
        for i in range(20):
            pub.publish("lag/t", f"old{i}", qos=1)
        pub.disconnect()
        srv.stop(__import__("signal").SIGKILL)
        time.sleep(2.5)                     # the outage: what was stored before it waits this long
        srv.start()
        dev.connect()
        got = dev.get_n(20, timeout=20)
        assert [m.payload for m in got] == [f"old{i}".encode() for i in range(20)]
        pub = Paho(srv, client_id="lag-pub")
        for i in range(20):                 # live traffic after the restart is measured as before
            pub.publish("lag/t", f"new{i}", qos=1)
        got = dev.get_n(20, timeout=20)
        assert len(got) == 20
        pub.disconnect()
        dev.disconnect()
        count, total, slow = _lag(srv.metrics_url)
        assert count >= 20, (count, total)
        assert slow == 0 and total < 20 * 1.0, (count, total, slow)
    finally:
        srv.stop()
