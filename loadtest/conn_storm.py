"""Broker CPU per persistent session of a reconnect storm, on `lmqtt serve`.

    lmqtt bench storm [--sessions 3000] [--rounds 3] [--lmqtt-src DIR] [--mosquitto] [--drop] [--clean]

The `sessions` scenario of `lmqtt bench compare` reports rates, which on a shared machine the
generator and the other processes set as much as the broker. This counts what the broker spends:
its process CPU time (user + system, /proc/PID/stat) across a storm of `--sessions` clients, 200
at a time, each CONNECT (3.1.1, clean session 0) + SUBSCRIBE to a filter of its own + DISCONNECT,
first as new sessions, then resuming them (`--rounds` of each, fresh data dir per round), divided
by the number of sessions: microseconds per CONNECT + SUBSCRIBE + DISCONNECT (`--drop`: the
client closes its socket instead of sending DISCONNECT, as in an outage; `--clean`: clean session 1,
devices that connect, subscribe and leave with nothing kept, both phases alike). `--mosquitto`
measures Mosquitto (in memory, as `lmqtt bench compare` runs it) the same way.
`--lmqtt-src DIR`: run lmqtt from that source tree (a `git archive` of a commit, its compiled
modules copied in), to compare commits on the same machine in the same minutes.
Prints one JSON line per round and a summary (medians).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .brokers import BrokerUnavailable, free_port, mosquitto_conf, source_path, wait_port
from .mqtt_client import connect

CONCURRENCY = 200


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _storm(port: int, n: int, tag: str, drop: bool = False, clean: bool = False) -> int:
    sem = asyncio.Semaphore(CONCURRENCY)
    present = 0

    async def one(i: int) -> None:
        nonlocal present
        async with sem:
            c = await connect("127.0.0.1", port, f"st-{tag}-{i}", 4, clean=clean, timeout=60)
            present += bool(c.connack.session_present)
            await c.subscribe(f"st/{tag}/{i}/+", 1, timeout=60)
            if drop:                         # the connection just goes (an outage), no DISCONNECT
                c.transport.close()
            else:
                c.disconnect()
    await asyncio.gather(*(one(i) for i in range(n)))
    return present


def _start(kind: str, workdir: str, port: int, lmqtt_src: str | None) -> subprocess.Popen:
    log = open(os.path.join(workdir, "broker.log"), "ab")
    if kind == "mosquitto":
        # the configuration `lmqtt bench compare` runs it with
        return subprocess.Popen(["mosquitto", "-c", str(mosquitto_conf(port, Path(workdir)))],
                                stdout=log, stderr=subprocess.STDOUT)
    env = dict(os.environ)
    if lmqtt_src:
        src, module = source_path(lmqtt_src, workdir)
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    else:
        module = "lmqtt.gateway.cli"
    return subprocess.Popen([sys.executable, "-m", module, "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--data-dir", os.path.join(workdir, "data"), "--metrics-port", "0",
                             "--store-port", str(free_port())],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def run_round(kind: str, n: int, lmqtt_src: str | None, drop: bool = False, clean: bool = False) -> dict:
    workdir = tempfile.mkdtemp(prefix="conn-storm-")
    port = free_port()
    proc = _start(kind, workdir, port, lmqtt_src)
    try:
        wait_port("127.0.0.1", port, 30)
        time.sleep(1.0)                     # start-up work done
        out = {"broker": kind, "sessions": n, "drop": drop, "clean": clean}
        for phase in ("new", "resumed"):
            c0, t0 = _cpu_s(proc.pid), time.monotonic()
            present = asyncio.run(_storm(port, n, "d", drop, clean))
            time.sleep(0.5)                 # the last disconnects handled
            c1, t1 = _cpu_s(proc.pid), time.monotonic()
            out[f"{phase}_us_per_session"] = round((c1 - c0) / n * 1e6, 1)
            out[f"{phase}_per_s"] = round(n / (t1 - t0 - 0.5), 1)
            out[f"{phase}_present"] = present
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="lmqtt bench storm", description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lmqtt-src", default=None)
    ap.add_argument("--mosquitto", action="store_true", help="also measure Mosquitto, round by round")
    ap.add_argument("--drop", action="store_true",
                    help="clients close their sockets without DISCONNECT (an outage's storm) instead of disconnecting")
    ap.add_argument("--clean", action="store_true",
                    help="clean sessions (clean session 1: nothing outlives the connection) instead of persistent ones")
    a = ap.parse_args(argv)
    kinds = ["lmqtt"] + (["mosquitto"] if a.mosquitto else [])
    if a.lmqtt_src:
        try:                                # a wrong directory: said in one line, before any round
            with tempfile.TemporaryDirectory(prefix="conn-storm-") as d:
                source_path(a.lmqtt_src, d)
        except BrokerUnavailable as e:
            raise SystemExit(f"lmqtt bench storm: {e}") from None
    rows: dict[str, list[dict]] = {k: [] for k in kinds}
    for _ in range(a.rounds):
        for k in kinds:
            r = run_round(k, a.sessions, a.lmqtt_src, a.drop, a.clean)
            rows[k].append(r)
            print(json.dumps(r), flush=True)
    for k, rs in rows.items():
        print(json.dumps({"summary": k, "load": os.getloadavg()[0], **{
            key: statistics.median(r[key] for r in rs) for key in
            ("new_us_per_session", "resumed_us_per_session", "new_per_s", "resumed_per_s")}}), flush=True)


if __name__ == "__main__":
    main()
