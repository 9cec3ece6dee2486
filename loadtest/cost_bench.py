"""What a broker spends per delivered message: CPU (user, system), syscalls, context switches.

    lmqtt bench cost [--brokers lmqtt,mosquitto] [--scenarios latency,pairs,devices]
        [--rounds 2] [--duration 5] [--pairs 50] [--devices 2000] [--rate 5000] [--strace] [--out FILE]

For each round and each broker in turn (alternated: the order flips every round, so a machine
that grows busier does not favour one side), a fresh broker is started (`brokers.start`, the
configuration `bench compare` uses), a `bench mqtt` scenario is run against it, and over the
whole run `perf stat -p PID` counts the broker's syscalls (`raw_syscalls:sys_enter`), its context
switches (voluntary ones are wake-ups: a thread that slept on epoll, a lock or a condition) and
CPU migrations; /proc gives its user and system CPU. Each figure is divided by the delivered
messages. Connecting 100 clients is a few thousand syscalls, noise beside the 25,000+ messages.
Where the kernel has the `ipi:ipi_send_cpu` tracepoint, `ipis_per_msg` counts the inter-processor
interrupts the broker sends (its writes waking a peer asleep on another CPU, see IPI_EVENT).

Why counts and CPU per message and not rates: on a machine shared with other jobs a rate moves
10-30 % from one run to the next, and these counts barely move (`perf stat`'s software events
need no PMU, so they work in a VM). With `--strace`, a second run per broker under `strace -c -f`
gives the syscalls by name (strace slows the broker: its rates are not reported).

One JSON line per (round, broker, scenario) on stdout, and with `--out` the same lines to FILE.
Scenarios: `latency` (`--pairs` pairs at a fixed `--rate`, QoS 1), `devices` (`--devices`
publishers, one topic each, into one wildcard subscriber at a fixed `--rate`, QoS 1: a fleet of
devices reporting to one backend) and `pairs`, `fanin` (flat out).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import brokers as B
from . import mqtt_bench
from .scenarios import ScenarioConfig, defaults_for

EVENTS = ("raw_syscalls:sys_enter", "context-switches", "cpu-migrations", "task-clock")
# Counted where the kernel has the tracepoint (perf stat refuses an unknown event, so it is probed
# first): the inter-processor interrupts the broker sends. Profiled (`perf record -g -e
# ipi:ipi_send_cpu`), nearly all are its socket writes waking a peer asleep on the other CPU (in a
# VM a costly exit), and there are more of them the longer a broker takes from a PUBLISH read to
# its writes: the peer has gone to sleep meanwhile.
IPI_EVENT = "ipi:ipi_send_cpu"
_ipi_countable: bool | None = None


def _events() -> tuple[str, ...]:
    """EVENTS, and IPI_EVENT when this kernel and perf can count it (probed once)."""
    global _ipi_countable
    if _ipi_countable is None:
        try:
            probe = subprocess.run(["perf", "stat", "-e", IPI_EVENT, "true"], capture_output=True, timeout=30)
            _ipi_countable = probe.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            _ipi_countable = False
    return EVENTS + ((IPI_EVENT,) if _ipi_countable else ())


SCENARIOS = ("latency", "devices", "pairs", "fanin")


def _cfg(scen: str, rb: B.RunningBroker, a) -> ScenarioConfig:
    """`devices` is the `fanin` traffic scenario paced: `a.devices` publishers at `a.rate` in all."""
    traffic = "fanin" if scen == "devices" else scen
    cfg = ScenarioConfig(scenario=traffic, host=rb.host, port=rb.port, version=4, duration=a.duration,
                         procs=a.procs, drain_max=20.0)
    for k, v in defaults_for(traffic).items():
        setattr(cfg, k, v)
    if scen in ("latency", "pairs"):
        cfg.publishers = cfg.subscribers = a.pairs
    if scen in ("latency", "devices"):
        cfg.rate = a.rate
    if scen == "fanin":
        cfg.publishers = a.publishers
    if scen == "devices":
        cfg.publishers = a.devices
        cfg.qos = 1
    if a.qos is not None:
        cfg.qos = a.qos
    return cfg


def _voluntary(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches over the process's threads (/proc)."""
    v = n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            txt = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue
        m1 = re.search(r"^voluntary_ctxt_switches:\s+(\d+)", txt, re.M)
        m2 = re.search(r"^nonvoluntary_ctxt_switches:\s+(\d+)", txt, re.M)
        v += int(m1.group(1)) if m1 else 0
        n += int(m2.group(1)) if m2 else 0
    return v, n


def _cpu(pid: int) -> tuple[float, float]:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return int(f[11]) / tck, int(f[12]) / tck


def _perf_counts(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        parts = line.split(",")    # -x, : value,unit,event,...
        if len(parts) >= 3 and (parts[2] in EVENTS or parts[2] == IPI_EVENT):
            try:
                out[parts[2]] = float(parts[0])
            except ValueError:
                out[parts[2]] = None
    return out


def _strace_table(text: str) -> dict:
    """strace -c's summary: syscall -> calls."""
    out = {}
    for line in text.splitlines():
        p = line.split()
        if len(p) >= 5 and p[0][0].isdigit() and not p[-1].startswith("total"):
            try:
                out[p[-1]] = int(p[3])
            except ValueError:
                continue
    return out


def measure(spec: str, scen: str, a, work: Path, trace: str = "perf") -> dict:
    """`spec`: a broker name, or `lmqtt@DIR` for lmqtt run from the source tree DIR (a `git archive`
    snapshot with its C modules built in place: two versions alternated in one run)."""
    name, _, src = spec.partition("@")
    rb = B.start(name, work / f"{name}-{scen}-{trace}-{time.monotonic_ns()}", ready_timeout=30,
                 lmqtt_src=src or None)
    tool = None
    try:
        time.sleep(0.5)
        pid = rb.pid
        if name.startswith("lmqtt-"):
            raise SystemExit("cost_bench: multi-process brokers are not measured here (one PID)")
        cfg = _cfg(scen, rb, a)
        out_file = work / f"trace-{os.getpid()}-{time.monotonic_ns()}.txt"
        if trace == "perf":
            tool = subprocess.Popen(["perf", "stat", "-x,", "-e", ",".join(_events()), "-p", str(pid),
                                     "-o", str(out_file)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            tool = subprocess.Popen(["strace", "-c", "-f", "-p", str(pid), "-o", str(out_file)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        v0, n0 = _voluntary(pid)
        u0, s0 = _cpu(pid)
        load0 = os.getloadavg()[0]
        res = mqtt_bench.run(cfg, pid, broker=name, quiet=True)
        v1, n1 = _voluntary(pid)
        u1, s1 = _cpu(pid)
        tool.send_signal(signal.SIGINT)
        tool.wait(30)
        tool = None
        text = out_file.read_text() if out_file.exists() else ""
        n = res.get("received") or 0
        row = {"broker": spec, "scenario": scen, "qos": cfg.qos, "rate": cfg.rate, "trace": trace,
               "delivered": n, "delivered_per_s": res.get("delivered_per_s"),
               "lost": res.get("lost"), "p50_ms": round(res["latency_us"]["p50"] / 1e3, 3) if n else None,
               "p99_ms": round(res["latency_us"]["p99"] / 1e3, 3) if n else None,
               "load": [round(load0, 2), round(os.getloadavg()[0], 2)]}
        if not n:
            return row
        row.update({"user_us_per_msg": round((u1 - u0) * 1e6 / n, 2),
                    "sys_us_per_msg": round((s1 - s0) * 1e6 / n, 2),
                    "voluntary_cs_per_msg": round((v1 - v0) / n, 3),
                    "involuntary_cs_per_msg": round((n1 - n0) / n, 3)})
        if trace == "perf":
            c = _perf_counts(text)
            sc, cs, ipi = c.get("raw_syscalls:sys_enter"), c.get("context-switches"), c.get(IPI_EVENT)
            row.update({"syscalls_per_msg": round(sc / n, 3) if sc is not None else None,
                        "ipis_per_msg": round(ipi / n, 3) if ipi is not None else None,
                        "context_switches_per_msg": round(cs / n, 3) if cs is not None else None,
                        "cpu_us_per_msg": (round(c["task-clock"] * 1e3 / n, 2)
                                           if c.get("task-clock") is not None else None)})
        else:
            t = _strace_table(text)
            row["syscalls_by_name_per_msg"] = {k: round(v / n, 3) for k, v in
                                               sorted(t.items(), key=lambda kv: -kv[1])[:12]}
        return row
    finally:
        if tool is not None:
            tool.kill()
            tool.wait(5)
        rb.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmqtt bench cost", description=__doc__.split("\n")[0])
    ap.add_argument("--brokers", default="lmqtt,mosquitto",
                    help="comma list; lmqtt@DIR runs lmqtt from the source tree DIR")
    ap.add_argument("--scenarios", default="latency,pairs")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--pairs", type=int, default=50)
    ap.add_argument("--publishers", type=int, default=100, help="fanin publishers")
    ap.add_argument("--devices", type=int, default=2000, help="devices: publishers into one subscriber")
    ap.add_argument("--rate", type=float, default=5000.0, help="latency, devices: total msg/s")
    ap.add_argument("--qos", type=int, default=None)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--strace", action="store_true", help="also a run under strace -c: syscalls by name")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not shutil.which("perf"):
        print("cost_bench: perf is not installed (Debian: linux-perf)", file=sys.stderr)
        return 2
    names = [b for b in a.brokers.split(",") if b]
    scens = [s for s in a.scenarios.split(",") if s]
    unknown = [s for s in scens if s not in SCENARIOS]
    if unknown:
        print(f"cost_bench: unknown scenario {', '.join(unknown)} (scenarios: {', '.join(SCENARIOS)})", file=sys.stderr)
        return 2
    out = open(a.out, "a") if a.out else None
    with tempfile.TemporaryDirectory(prefix="lmqtt-cost-") as tmp:
        work = Path(tmp)
        for r in range(a.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for scen in scens:
                for name in order:
                    traces = ["perf"] + (["strace"] if a.strace and r == 0 else [])
                    for trace in traces:
                        row = measure(name, scen, a, work, trace)
                        row["round"] = r + 1
                        line = json.dumps(row)
                        print(line, flush=True)
                        if out:
                            out.write(line + "\n")
                            out.flush()
    if out:
        out.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
