"""`lmqtt bench compare` end to end on a tiny run: real brokers started and stopped by PID,
JSON lines on stdout, results.jsonl, report.md with a table per scenario and a latency plot."""
from __future__ import annotations

import json
import shutil

import psutil
import pytest

from lmqtt.loadtest import brokers, compare
from lmqtt.loadtest.scenarios import ClientSpec, ScenarioConfig, partition, plan

needs_mosquitto = pytest.mark.skipif(shutil.which("mosquitto") is None and not
                                     __import__("os").path.exists("/usr/sbin/mosquitto"),
                                     reason="mosquitto binary not installed")


def test_plan_expectations_match_the_scenario_shape():
    fan = plan(ScenarioConfig(scenario="fanout", subscribers=5, publishers=1))
    assert [c.role for c in fan].count("sub") == 5 and all(c.expects == [0] for c in fan if c.role == "sub")
    fin = plan(ScenarioConfig(scenario="fanin", publishers=4, subscribers=1))
    sub = [c for c in fin if c.role == "sub"][0]
    assert sub.expects == [0, 1, 2, 3] and sub.topic.endswith("/in/+")
    pairs = plan(ScenarioConfig(scenario="pairs", publishers=3, subscribers=3))
    topics = {c.topic for c in pairs}
    assert len(topics) == 3  # each pair on its own topic
    assert all(len(c.client_id) <= 23 for c in fin + pairs)  # MQTT 3.1.1 servers must accept <= 23


def test_partition_balances_clients_and_keeps_everyone():
    specs = plan(ScenarioConfig(scenario="fanin", publishers=10, subscribers=1))
    parts = partition(specs, 3)
    # the lone subscriber is in the first process; clients (11) spread 4/4/3, so the
    # subscriber's process carries no more connections than any other
    assert parts[0][0].role == "sub" and sum(c.role == "sub" for p in parts for c in p) == 1
    assert sorted(len(p) for p in parts) == [3, 4, 4] and len(parts[0]) <= 4
    assert sorted(c.client_id for p in parts for c in p) == sorted(c.client_id for c in specs)
    rr = partition([ClientSpec("idle", f"c{i}") for i in range(7)], 2)
    assert [len(p) for p in rr] == [4, 3]


@needs_mosquitto
def test_compare_writes_jsonl_report_and_plot_and_stops_its_brokers(tmp_path, capsys):
    out = tmp_path / "cmp"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    rc = compare.main(["--brokers", "mosquitto", "--scenarios", "pairs,conn", "--duration", "1",
                       "--repeat", "2", "--pairs", "3", "--connections", "40", "--out", str(out),
                       "--quiet"])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [(r["broker"], r["scenario"], r["rep"]) for r in lines] == [
        ("mosquitto", "pairs", 1), ("mosquitto", "conn", 1), ("mosquitto", "pairs", 2), ("mosquitto", "conn", 2)]
    assert all(not r.get("error") for r in lines)
    assert lines[0]["lost"] == 0 and lines[0]["duplicated"] == 0
    assert len((out / "results.jsonl").read_text().splitlines()) == 4
    md = (out / "report.md").read_text()
    assert "(`pairs`)" in md and "(`conn`)" in md and "| delivered msg/s |" in md
    assert "RSS per idle connection" in md and "## Targets" in md
    assert (out / "latency_pairs.png").stat().st_size > 1000
    # every broker process this run started has been stopped
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


def test_unknown_broker_is_rejected_with_the_known_list(tmp_path, capsys):
    assert compare.main(["--brokers", "rabbit", "--out", str(tmp_path)]) == 2
    assert "mosquitto" in capsys.readouterr().err


def test_broker_that_cannot_start_is_reported_not_available(tmp_path, monkeypatch):
    # a broker whose command exits at once (a real process, a real failure)
    monkeypatch.setattr(brokers, "command_for", lambda name, port, wd: (["false"], "fake"))
    with pytest.raises(brokers.BrokerUnavailable, match="exited with code 1"):
        brokers.start("mosquitto", tmp_path, ready_timeout=5)


def test_saturation_verdict_names_the_side_that_was_the_limit():
    from lmqtt.loadtest.saturation import verdict
    base = {"gen_cpu_us_per_msg": 5.0, "broker_cpu_us_per_msg": 11.0}
    ok = verdict({**base, "broker_cpu_cores": 0.97, "gen_cpu_cores": 0.45,
                  "gen_cpu_cores_per_proc": [0.23, 0.22]})
    assert ok.startswith("broker saturated, generator below it") and "busiest 0.23" in ok
    gen = verdict({"gen_cpu_us_per_msg": 20.0, "broker_cpu_us_per_msg": 11.0, "broker_cpu_cores": 0.55,
                   "gen_cpu_cores": 1.0, "gen_cpu_cores_per_proc": [0.98]})
    assert gen.startswith("generator-bound") and "--procs" in gen
    # the broker is saturated but costs less per message than the generator: not "below it"
    close = verdict({"gen_cpu_us_per_msg": 12.0, "broker_cpu_us_per_msg": 11.0, "broker_cpu_cores": 0.95,
                     "gen_cpu_cores": 0.8, "gen_cpu_cores_per_proc": [0.4, 0.4]})
    assert close.startswith("broker saturated, but the generator is not clearly below it")
    shared = verdict({**base, "broker_cpu_cores": 0.6, "gen_cpu_cores": 0.3,
                      "gen_cpu_cores_per_proc": [0.15, 0.15]})
    assert shared.startswith("neither saturated")
    # the same broker waited 0.35 cores' worth for a CPU: it wanted a whole core and got a share
    starved = verdict({**base, "broker_cpu_cores": 0.6, "broker_runq_wait_cores": 0.35, "gen_cpu_cores": 0.3,
                       "gen_cpu_cores_per_proc": [0.15, 0.15]})
    assert starved.startswith("broker saturated at its share of a shared machine, generator below it")
    assert "waited 0.35 cores" in starved
    idle = verdict({**base, "broker_cpu_cores": 0.6, "broker_runq_wait_cores": 0.1, "gen_cpu_cores": 0.3,
                    "gen_cpu_cores_per_proc": [0.15, 0.15]})
    assert idle.startswith("neither saturated")
    assert verdict({"gen_cpu_cores": 0.3}).startswith("unknown")
    fixed = verdict({**base, "broker_cpu_cores": 0.17, "gen_cpu_cores": 0.32, "gen_cpu_cores_per_proc": [0.16],
                     "params": {"rate": 5000.0}, "behind_schedule": 0})
    assert fixed.startswith("fixed rate 5,000 msg/s") and "the rate was held" in fixed
