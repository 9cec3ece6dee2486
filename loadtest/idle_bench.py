"""What an idle broker costs: wake-ups per second per thread and CPU seconds per minute.

`lmqtt bench idle [--brokers lmqtt,mosquitto] [--clients 0,1000] [--duration 60]`

For each broker and each client count: start the broker (loadtest/brokers.py, as `bench compare`
does), park `clients` idle MQTT connections on it (loadtest/conn_hold.py: CONNECT + SUBSCRIBE,
keep-alive 600 s, then nothing), let it settle, then read `/proc/PID/task/*/status`
(voluntary + involuntary context switches: every time a thread went to sleep or was put off
the CPU, i.e. ~ its wake-ups) and `/proc/PID/stat` (utime + stime) at the start and end of
`duration` seconds. Nothing is sent meanwhile: whatever the broker does is its own idea.

Thread names: CPython 3.11 leaves every thread's kernel name as the process's, so lmqtt is
started through this module (`_serve`), which names each Python thread in the kernel
(prctl(PR_SET_NAME), first 15 characters of its `threading` name) before running `lmqtt serve`
unchanged; `--lmqtt-src DIR` runs another tree's lmqtt the same way (before/after).

Output: one line per run (total wake-ups/s, CPU s/min) and the busiest threads; `--json FILE`
appends the raw figures.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import runpy
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import brokers
from .conn_hold import Holder

PR_SET_NAME = 15


def _name_threads() -> None:
    """Give every Python thread started from now on its `threading` name in the kernel: a profile
    function (`threading.setprofile`) runs once in each new thread before its `run`, names it and
    removes itself."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return

    def name_this_thread(_frame, _event, _arg) -> None:
        sys.setprofile(None)
        try:
            libc.prctl(PR_SET_NAME, threading.current_thread().name.encode()[:15], 0, 0, 0)
        except Exception:  # noqa: BLE001 - decoration only
            pass
    threading.setprofile(name_this_thread)
    libc.prctl(PR_SET_NAME, b"main", 0, 0, 0)


def _serve(argv: list[str]) -> None:
    """`python3 -m lmqtt.loadtest.idle_bench _serve <module> <args...>`: run lmqtt's CLI module
    with named threads."""
    _name_threads()
    module, rest = argv[0], argv[1:]
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def snapshot(pid: int) -> tuple[dict[int, tuple[str, int]], float]:
    """{tid: (name, context switches)}, CPU seconds (utime + stime) of process `pid`."""
    tasks: dict[int, tuple[str, int]] = {}
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/status") as f:
                text = f.read()
        except OSError:
            continue
        name, sw = "?", 0
        for line in text.splitlines():
            if line.startswith("Name:"):
                name = line.split(None, 1)[1] if len(line.split(None, 1)) > 1 else "?"
            elif line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                sw += int(line.split()[1])
        tasks[int(tid)] = (name, sw)
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / tick    # utime, stime (fields 14, 15)
    return tasks, cpu


def measure(pid: int, duration: float) -> dict:
    t0, c0 = snapshot(pid)
    start = time.monotonic()
    time.sleep(duration)
    t1, c1 = snapshot(pid)
    secs = time.monotonic() - start
    per: dict[str, float] = {}
    for tid, (name, sw) in t1.items():
        before = t0.get(tid, (name, 0))[1]
        key = name
        per[key] = per.get(key, 0.0) + (sw - before) / secs
    return {"seconds": round(secs, 1), "wakeups_per_s": round(sum(per.values()), 1),
            "cpu_s_per_min": round((c1 - c0) * 60 / secs, 3),
            "threads": {k: round(v, 1) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}}


def _start(name: str, workdir: Path, lmqtt_src: str | None, metrics: bool = True):
    if name != "lmqtt":
        return brokers.start(name, workdir)
    # brokers.start's argv with the CLI module run through _serve (named threads), and with the
    # metrics/console port on as `lmqtt serve` has it by default (bench compare turns it off)
    real = brokers.command_for

    def wrapped(n, *a, **kw):
        argv, version = real(n, *a, **kw)
        if n == "lmqtt":
            i = argv.index("-m")
            argv = [argv[0], "-m", "lmqtt.loadtest.idle_bench", "_serve", argv[i + 1], *argv[i + 2:]]
            if metrics and "--metrics-port" in argv:
                j = argv.index("--metrics-port")
                argv[j + 1] = str(brokers.free_port())
        return argv, version
    brokers.command_for = wrapped
    try:
        rb = brokers.start(name, workdir, lmqtt_src=lmqtt_src)
    finally:
        brokers.command_for = real
    return rb


def run_one(name: str, clients: int, duration: float, settle: float, lmqtt_src: str | None,
            metrics: bool = True, topics: int = 100) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"idle-{name}-") as tmp:
        rb = _start(name, Path(tmp), lmqtt_src, metrics)
        holder = None
        try:
            if clients:
                holder = Holder(rb.host, rb.port, clients, lambda i: f"idle-{i}",
                                lambda i: f"idle/{i % topics}" if topics else f"idle/{i}", keepalive=600)
                got = holder.open_all(time.monotonic() + 60)
                if got < clients:
                    raise SystemExit(f"{name}: only {got} of {clients} clients connected: {holder.errors}")
            time.sleep(settle)
            res = measure(rb.pid, duration)
            if holder is not None and holder.still_open() < clients:
                res["closed_by_broker"] = clients - holder.still_open()
        finally:
            if holder is not None:
                holder.close_all()
            rb.stop()
    res.update(broker=name if not lmqtt_src else f"{name}@{lmqtt_src}", clients=clients, topics=topics)
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_serve"]:
        _serve(argv[1:])
        return 0
    ap = argparse.ArgumentParser(prog="lmqtt bench idle", description=__doc__.split("\n")[0])
    ap.add_argument("--brokers", default="lmqtt,mosquitto")
    ap.add_argument("--clients", default="0,1000", help="comma-separated idle client counts")
    ap.add_argument("--topics", type=int, default=100,
                    help="distinct topics the clients subscribe to, round robin (0: one each, as devices "
                         "with a topic of their own)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds measured per run")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds waited after start/connect")
    ap.add_argument("--lmqtt-src", default=None, help="run this source tree's lmqtt (before/after)")
    ap.add_argument("--no-metrics", action="store_true", help="lmqtt without its metrics/console port")
    ap.add_argument("--threads", type=int, default=8, help="busiest threads shown per run")
    ap.add_argument("--json", default=None, help="append the raw results (one JSON line a run)")
    a = ap.parse_args(argv)
    if a.duration <= 0 or a.duration > 3600:
        ap.error("--duration: between 0 and 3600 seconds")
    print(f"load {os.getloadavg()[0]:.1f}")
    for clients in [int(c) for c in a.clients.split(",") if c.strip()]:
        for name in [b.strip() for b in a.brokers.split(",") if b.strip()]:
            r = run_one(name, clients, a.duration, a.settle, a.lmqtt_src if name == "lmqtt" else None,
                        not a.no_metrics, a.topics)
            top = ", ".join(f"{k} {v:g}" for k, v in list(r["threads"].items())[:a.threads])
            print(f"{r['broker']:<10} clients {clients:>6}: {r['wakeups_per_s']:8.1f} wake-ups/s, "
                  f"{r['cpu_s_per_min']:.3f} CPU s/min  [{top}]"
                  + (f"  ({r['closed_by_broker']} closed by the broker)" if r.get("closed_by_broker") else ""),
                  flush=True)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps({**r, "load": os.getloadavg()[0]}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
