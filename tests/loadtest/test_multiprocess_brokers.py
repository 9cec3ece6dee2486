"""`lmqtt bench compare`'s multi-process brokers: `lmqtt-fleet` (store + 2 gateways on their own
ports) and `lmqtt-workers` (`serve --workers 2`) start as one broker, carry messages
between their gateways, and leave no process behind when stopped by PID."""
from __future__ import annotations

from types import SimpleNamespace

import psutil
import pytest

from lmqtt.loadtest import brokers
from lmqtt.loadtest.scenarios import ScenarioConfig
from tests.support import Paho

def test_scenario_puts_subscribers_on_the_other_gateway():
    cfg = ScenarioConfig(port=1000, ports=(2000,))
    assert [cfg.port_for("pub", i) for i in range(4)] == [1000, 2000, 1000, 2000]
    assert [cfg.port_for("sub", i) for i in range(4)] == [2000, 1000, 2000, 1000]
    assert ScenarioConfig(port=1000).port_for("sub", 3) == 1000


@pytest.mark.parametrize("name", ["lmqtt-fleet", "lmqtt-workers"])
def test_multiprocess_broker_carries_messages_and_stops_whole(tmp_path, name):
    rb = brokers.start(name, tmp_path / name)
    try:
        family = psutil.Process(rb.pid).children(recursive=True)
        labels = " ".join(" ".join(p.cmdline()) for p in family)
        # the store relays the gateways' client id claims: no Redis process any more
        assert labels.count(" gateway ") == 2 and " store " in labels and "redis-server" not in labels
        assert len(family) == 3, labels
        if name == "lmqtt-fleet":
            assert len(rb.extra_ports) == 1 and rb.extra_ports[0] != rb.port
            sub_at = SimpleNamespace(host=rb.host, port=rb.extra_ports[0])
        else:
            assert rb.extra_ports == []
            sub_at = rb
        sub = Paho(sub_at, f"mp-sub-{name}")
        sub.subscribe("mp/#", 1)
        pub = Paho(rb, f"mp-pub-{name}")
        for i in range(20):
            pub.publish(f"mp/{i % 3}", f"{i}".encode(), qos=1)
        got = sub.get_n(20)
        assert sorted(int(m.payload) for m in got) == list(range(20))
        pub.disconnect()
        sub.disconnect()
    finally:
        rb.stop()
    assert rb.proc.returncode is not None
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_fleet_reads_each_message_once_per_gateway_whatever_the_subscribers(tmp_path):
    """1,000 subscribers of one topic spread over two gateways: each published message costs the
    store two light-queue reads (one per gateway), not one per subscriber."""
    from lmqtt.loadtest import mqtt_bench
    rb = brokers.start("lmqtt-fleet", tmp_path / "fleet")
    try:
        cfg = ScenarioConfig(scenario="fanout", host=rb.host, port=rb.port, ports=tuple(rb.extra_ports),
                             publishers=1, subscribers=1000, qos=0, rate=20.0, duration=1.5, procs=2,
                             drain_idle=1.0, drain_max=10.0)
        before = rb.store_reads()
        assert before is not None, f"no gateway metrics at {rb.metrics_ports}: {rb.log_tail(40)}"
        res = mqtt_bench.run(cfg, rb.pid, broker=rb.name, quiet=True)
        after = rb.store_reads()
        assert after is not None, f"no gateway metrics at {rb.metrics_ports}: {rb.log_tail(40)}"
        reads = after - before
    finally:
        rb.stop()
    assert res["connect"]["connected"] == 1001 and res["lost"] == 0
    assert res["received"] == res["sent"] * 1000 and res["sent"] >= 20
    assert 2 <= reads <= 2 * res["sent"], (reads, res["sent"])
