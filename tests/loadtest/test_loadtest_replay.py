"""`lmqtt bench mqtt --scenario replay`: stored messages of a never-subscribed wildcard filter
asked for with `$replay/{t0}/{filter}` arrive all, once, in order (the benchmark's own accounting)."""
from __future__ import annotations

from lmqtt.loadtest import brokers, mqtt_bench
from lmqtt.loadtest.scenarios import ScenarioConfig


def test_replay_scenario_delivers_the_whole_history_once(tmp_path):
    rb = brokers.start("lmqtt", tmp_path / "lmqtt")
    try:
        cfg = ScenarioConfig(scenario="replay", host=rb.host, port=rb.port, backlog=2000, qos=0,
                             drain_idle=1.0, drain_max=20.0)
        res = mqtt_bench.run(cfg, rb.pid, broker="lmqtt", quiet=True)
    finally:
        rb.stop()
    assert res["sent"] == 2000
    assert (res["received"], res["lost"], res["duplicated"], res["out_of_order"]) == (2000, 0, 0, 0)
    assert res["delivered_per_s"] > 0 and res["params"]["backlog"] == 2000
    assert res["idle_pings"] > 0 and res["idle_ping_max_ms"] >= res["idle_ping_p99_ms"] > 0   # the idle client meanwhile
