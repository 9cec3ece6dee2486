"""`lmqtt bench compare --selfcheck`: is the load generator trustworthy on this machine?

The generator must show two things, checked here against Mosquitto (a C
broker whose numbers do not move while lmqtt is being changed):

1. *Correctness*: at a moderate fixed rate, QoS 1 loses, duplicates and reorders nothing
   (`pairs` at ``--selfcheck-rate`` msg/s; every count must be exactly 0 and received == sent).
2. *Who is saturated*: flat out (`fanout` QoS 0, `fanin` QoS 1, `pairs` QoS 1) the broker should
   be the limit. Mosquitto is single-threaded, so "saturated" means about one core; the generator
   is "below it" when it uses less CPU per delivered message than the broker *and* none of its
   worker processes (each one Python thread) is busier than the broker. ``verdict`` turns one
   result into that sentence, so ``compare`` and the report print it next to every figure.

On a shared machine neither side may reach a full core (both wait for the CPU): the broker's
run-queue wait (`broker_runq_wait_cores`, from /proc/PID/task/*/schedstat) tells a broker that
wanted a whole core and was given a share of one (on-CPU + waiting >= 0.9: saturated at its share)
from one the generator left idle; when neither holds, the verdict says so rather than calling
either side the bottleneck.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from . import brokers as B, mqtt_bench
from .saturation import FLAT_OUT, verdict
from .scenarios import ScenarioConfig, defaults_for


def _config(scen: str, rb: B.RunningBroker, a) -> ScenarioConfig:
    cfg = ScenarioConfig(scenario=scen, host=rb.host, port=rb.port, version=4, size=a.size,
                         duration=a.duration, procs=a.procs, window=a.window, drain_max=a.drain_max)
    for k, v in defaults_for(scen).items():
        setattr(cfg, k, v)
    return cfg


def _one(name: str, scen: str, a, work: Path, **over) -> dict:
    rb = B.start("mosquitto", work / name, ready_timeout=a.start_timeout)
    try:
        time.sleep(0.3)
        cfg = _config(scen, rb, a)
        for k, v in over.items():
            setattr(cfg, k, v)
        res = mqtt_bench.run(cfg, rb.pid, broker="mosquitto", quiet=True)
        res["check"] = name
        return res
    finally:
        rb.stop()


def run(a) -> int:
    """Both checks against fresh Mosquitto processes; JSON lines to OUT/selfcheck.jsonl + stdout."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    ok = True
    load0 = os.getloadavg()[0]

    def say(msg: str) -> None:
        lines.append(msg)
        print(f"[selfcheck] {msg}", file=sys.stderr, flush=True)

    say(f"machine: {os.cpu_count()} cores, load average {load0:.2f} at start")
    with tempfile.TemporaryDirectory(prefix="lmqtt-selfcheck-") as tmp, \
            open(out / "selfcheck.jsonl", "w") as jl:
        def keep(res: dict) -> None:
            line = mqtt_bench.to_json(res)
            jl.write(line + "\n")
            jl.flush()
            print(line, flush=True)

        try:
            res = _one("correctness", "pairs", a, Path(tmp), qos=1, rate=a.selfcheck_rate)
        except B.BrokerUnavailable as e:
            say(f"FAIL: Mosquitto not available: {str(e).splitlines()[0]}")
            return 2
        keep(res)
        clean = (res["lost"] == 0 and res["duplicated"] == 0 and res["out_of_order"] == 0
                 and res["unexpected"] == 0 and res["received"] == res["sent"] > 0)
        ok &= clean
        say(f"(a) QoS 1 pairs ×{res['params']['publishers']} at {a.selfcheck_rate:,.0f} msg/s: sent "
            f"{res['sent']:,}, received {res['received']:,}, lost {res['lost']}, duplicated "
            f"{res['duplicated']}, out of order {res['out_of_order']} -> "
            f"{'OK' if clean else 'FAIL'}")
        for scen in FLAT_OUT:
            res = _one(f"flat-{scen}", scen, a, Path(tmp))
            keep(res)
            v = verdict(res)
            res_ok = v.startswith("broker saturated, generator below it")
            clean = res["lost"] == 0 and res["duplicated"] == 0
            ok &= clean
            ratio = (res["gen_cpu_us_per_msg"] / res["broker_cpu_us_per_msg"]
                     if res.get("gen_cpu_us_per_msg") and res.get("broker_cpu_us_per_msg") else None)
            say(f"(b) {scen} QoS {res['params']['qos']} flat out: {res['delivered_per_s']:,.0f} msg/s "
                f"delivered, lost {res['lost']}, dup {res['duplicated']}; generator/broker CPU per "
                f"message {'?' if ratio is None else f'{ratio:.2f}'}; {v}")
            if not res_ok:
                ok = False
    load1 = os.getloadavg()[0]
    say(f"load average {load1:.2f} at the end"
        + (" — the machine was shared: rerun on a quiet machine before trusting a "
           "'neither saturated' verdict" if max(load0, load1) > 0.5 * (os.cpu_count() or 1) else ""))
    say("RESULT: " + ("PASS (0 lost / 0 duplicated; broker saturated with the generator below it "
                      "in every flat-out scenario)" if ok else "NOT PASSED (see the lines above)"))
    (out / "selfcheck.txt").write_text("\n".join(lines) + "\n")
    return 0 if ok else 1


def summary_json(path: Path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
