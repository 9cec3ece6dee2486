"""`lmqtt bench mqtt --scenario sessions`: every persistent session of the storm is created,
resumed with its session present, and removed afterwards; the idle client's pings are counted."""
from __future__ import annotations

import pytest

from lmqtt.loadtest import brokers, mqtt_bench
from lmqtt.loadtest.scenarios import ScenarioConfig
from tests.support import Paho


@pytest.mark.parametrize("version", [4, 5])
def test_sessions_scenario_resumes_every_session_and_removes_them(tmp_path, version):
    rb = brokers.start("lmqtt", tmp_path / "lmqtt")
    try:
        cfg = ScenarioConfig(scenario="sessions", host=rb.host, port=rb.port, connections=300, qos=1,
                             version=version, run_id="t")
        try:
            res = mqtt_bench.run(cfg, rb.pid, broker="lmqtt", quiet=True)
        except RuntimeError as e:        # the broker's side of it, to find out why
            raise AssertionError(f"{e}\nbroker log tail:\n{rb.log_tail(40)}") from e
        # removed afterwards: resuming one now finds no session
        c = Paho(rb, "lb-t-d7", version=version, clean=False, expiry=600 if version == 5 else None)
        assert c.session_present is False
        c.disconnect()
    finally:
        rb.stop()
    assert res["sessions"] == 300 and res["session_present"] == 300
    assert res["new_per_s"] > 0 and res["resume_per_s"] > 0
    assert res["pings"] > 0 and res["latency_us"]["count"] == res["pings"]
