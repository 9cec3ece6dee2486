"""The load generator against a real Mosquitto subprocess: correctness accounting end to end.

Small counts and ~1-2 s phases so this runs in CI in seconds; no timing assertions (rates are
benchmark figures, recorded in BENCHMARKS.md), only what a benchmark user relies on: every QoS 1
message published is received exactly once, per publisher, and the JSON line is complete.
"""
from __future__ import annotations

import json
import shutil
import time

import pytest

from lmqtt.loadtest import brokers, mqtt_bench
from lmqtt.loadtest.scenarios import ScenarioConfig

pytestmark = pytest.mark.skipif(shutil.which("mosquitto") is None and not
                                __import__("os").path.exists("/usr/sbin/mosquitto"),
                                reason="mosquitto binary not installed")


@pytest.fixture
def mosquitto(tmp_path):
    b = brokers.start("mosquitto", tmp_path)
    yield b
    b.stop()
    assert not b.alive()


def _cfg(b, **kw) -> ScenarioConfig:
    # generous drain: on a loaded CI machine a delivery may pause; it only costs time when
    # something is actually missing
    base = dict(host=b.host, port=b.port, duration=1.5, procs=2, drain_max=20.0, drain_idle=5.0)
    base.update(kw)
    return ScenarioConfig(**base)


def test_pairs_qos1_at_moderate_rate_loses_and_duplicates_nothing(mosquitto):
    cfg = _cfg(mosquitto, scenario="pairs", publishers=8, subscribers=8, qos=1, rate=2000.0)
    res = mqtt_bench.run(cfg, mosquitto.pid, broker="mosquitto", quiet=True)
    assert res["sent"] > 1000
    assert res["lost"] == 0 and res["duplicated"] == 0 and res["unexpected"] == 0
    assert res["received"] == res["expected"] == res["sent"]
    lat = res["latency_us"]
    assert lat["count"] == res["received"]
    assert 0 < lat["p50"] <= lat["p99"] <= lat["max"]
    assert res["broker_cpu_cores"] is not None and res["gen_cpu_cores"] > 0
    line = json.loads(mqtt_bench.to_json(res))
    assert line["scenario"] == "pairs" and line["histogram"]["total"] == res["received"]


def test_fanin_flat_out_qos1_closed_loop_delivers_everything(mosquitto):
    cfg = _cfg(mosquitto, scenario="fanin", publishers=50, subscribers=1, qos=1)
    res = mqtt_bench.run(cfg, mosquitto.pid, quiet=True)
    assert res["sent"] > 0 and res["unacked"] == 0
    assert res["lost"] == 0 and res["duplicated"] == 0
    assert res["received"] == res["sent"]


def test_fanout_qos0_every_subscriber_counts_each_publisher_message(mosquitto):
    cfg = _cfg(mosquitto, scenario="fanout", publishers=1, subscribers=20, qos=0, rate=500.0)
    res = mqtt_bench.run(cfg, mosquitto.pid, quiet=True)
    # 20 streams of the same publisher: expected is 20x what was sent
    assert res["expected"] == 20 * res["sent"] and res["sent"] > 0
    assert res["duplicated"] == 0 and res["lost"] == 0  # loopback, moderate rate, no drops


def test_qos2_exactly_once(mosquitto):
    cfg = _cfg(mosquitto, scenario="pairs", publishers=4, subscribers=4, qos=2, rate=1000.0)
    res = mqtt_bench.run(cfg, mosquitto.pid, quiet=True)
    assert res["sent"] > 0 and res["received"] == res["sent"]
    assert res["lost"] == 0 and res["duplicated"] == 0 and res["unacked"] == 0


def test_state_scenarios_retained_and_persistent_backlog(mosquitto):
    ret = mqtt_bench.run(_cfg(mosquitto, scenario="retained", topics=200, qos=1), mosquitto.pid, quiet=True)
    assert ret["received"] == 200 and ret["lost"] == 0 and ret["duplicated"] == 0
    per = mqtt_bench.run(_cfg(mosquitto, scenario="persistent", backlog=500, qos=1), mosquitto.pid,
                         quiet=True)
    assert per["sent"] == 500 and per["received"] == 500 and per["lost"] == 0


def test_conn_scenario_counts_connections_and_broker_memory(mosquitto):
    res = mqtt_bench.run(_cfg(mosquitto, scenario="conn", connections=300, hold=0.3), mosquitto.pid,
                         quiet=True)
    assert res["connect"]["connected"] == 300 and res["connect"]["failed"] == 0
    assert res["broker_rss_bytes"] > 0 and "rss_per_conn_bytes" in res
    assert 0 <= res["idle_broker_cpu_cores"] < 2
    # the lean raw-socket generator, its handshakes bounded below Mosquitto's accept backlog (100)
    assert res["gen_loop"] == "raw" and res["handshake_window"] <= 100
    assert res["broker_cpu_us_per_conn"] > 0 and res["gen_cpu_us_per_conn"] > 0


def test_conn_scenario_subscribes_each_connection_to_its_own_topic(mosquitto):
    """A held connection is a live subscriber: a message to its topic reaches its socket, and
    only its socket."""
    import select
    import paho.mqtt.publish as publish
    from lmqtt.loadtest.conn_hold import Holder
    h = Holder(mosquitto.host, mosquitto.port, 3, lambda i: f"hold-{i}", lambda i: f"hold/{i}", window=2)
    assert h.open_all(time.monotonic() + 10) == 3
    try:
        publish.single("hold/1", b"x", hostname=mosquitto.host, port=mosquitto.port)
        readable, _, _ = select.select(h.held, [], [], 5)
        time.sleep(0.2)
        readable, _, _ = select.select(h.held, [], [], 0)
        assert len(readable) == 1
        data = readable[0].recv(64)
        assert data[0] >> 4 == 3 and b"hold/1" in data      # a PUBLISH of its topic
    finally:
        h.close_all()


def test_cli_reports_a_clear_error_when_nothing_listens(capsys):
    port = brokers.free_port()
    rc = mqtt_bench.main(["--broker-port", str(port), "--scenario", "pairs", "--pairs", "2",
                          "--duration", "0.5", "--quiet"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "no client could connect" in err and str(port) in err
