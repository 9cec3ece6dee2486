"""`lmqtt bench restart`: how long a broker takes to be back, serving, after a restart with N
persistent sessions to restore (a rolling update, a crash, a maintenance restart).

For each broker (`lmqtt`: `lmqtt serve`; `lmqtt-fleet`: a store and two gateways, the
sessions created on the gateways in turn, each gateway restoring those it served; `mosquitto` with
persistence to its db file, written at shutdown), in a fresh data directory: `--sessions` clients
CONNECT with a persistent session (3.1.1 clean session 0) and SUBSCRIBE to a wildcard filter of
their own, 200 at a time, and leave (on a fleet, session i on gateway i mod 2); then the
broker is stopped (SIGTERM) and started again `--repeat` times. `restart_s` is from starting the
process to its MQTT port accepting connections (for the fleet: every gateway up); then a sample of
the sessions is resumed and `sample_present` says how many the broker still had. One JSON line per
restart:

    {"case": "lmqtt", "sessions": 20000, "rep": 1, "restart_s": 1.2, "stop_s": 0.4,
     "sample": 50, "sample_present": 50, "broker_rss_bytes": ...}

(`broker_rss_bytes`: after the restart, single-process brokers only.)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from lmqtt.loadtest import brokers
from lmqtt.loadtest.mqtt_client import connect
from lmqtt.loadtest.scenarios import SESSION_STORM_CONCURRENCY

SAMPLE = 50


async def _sessions(host: str, ports: list[int], subscribe: bool, ids: range) -> int:
    """CONNECT (clean session 0) each of `ids` (i on `ports[i % len(ports)]`), SUBSCRIBE to its
    own filter if `subscribe`, leave; returns how many found their session present."""
    sem = asyncio.Semaphore(SESSION_STORM_CONCURRENCY)
    present = 0

    async def one(i: int) -> None:
        nonlocal present
        async with sem:
            c = await connect(host, ports[i % len(ports)], f"rs-{i}", 4, clean=False, timeout=60.0)
            present += bool(c.connack.session_present)
            if subscribe:
                await c.subscribe(f"rs/dev/{i}/+", 1, timeout=60.0)
            c.disconnect()
    await asyncio.gather(*(one(i) for i in ids))
    return present


def _rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def bench_broker(name: str, n: int, repeat: int, base: Path) -> list[dict]:
    workdir = base / name
    out = []
    rb = brokers.start(name, workdir, persist=True, ready_timeout=120.0)
    try:
        t0 = time.monotonic()
        asyncio.run(_sessions(rb.host, [rb.port, *rb.extra_ports], True, range(n)))
        created_s = time.monotonic() - t0
        for rep in range(1, repeat + 1):
            t0 = time.monotonic()
            rb.stop(timeout=300.0)
            stop_s = time.monotonic() - t0
            t0 = time.monotonic()
            rb = brokers.start(name, workdir, port=rb.port, persist=True, ready_timeout=600.0)
            restart_s = time.monotonic() - t0
            rss = None if rb.extra_ports or name == "lmqtt-workers" else _rss(rb.pid)   # one process only
            step = max(1, n // SAMPLE) | 1          # odd: a fleet's sample spans both gateways
            sample = range(0, n, step)
            present = asyncio.run(_sessions(rb.host, [rb.port, *rb.extra_ports], False, sample))
            out.append({"case": name, "version": rb.version, "sessions": n, "rep": rep,
                        "restart_s": round(restart_s, 3), "stop_s": round(stop_s, 3),
                        "created_per_s": round(n / created_s, 1), "sample": len(sample),
                        "sample_present": present, "broker_rss_bytes": rss})
    finally:
        rb.stop(timeout=300.0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmqtt bench restart", description=__doc__.split("\n\n")[0])
    ap.add_argument("--brokers", default="lmqtt,lmqtt-fleet,mosquitto")
    ap.add_argument("--sessions", type=int, default=20000, help="persistent sessions to restore (default 20000)")
    ap.add_argument("--repeat", type=int, default=2, help="restarts per broker (default 2)")
    args = ap.parse_args(argv)
    if args.sessions < SAMPLE:
        ap.error(f"--sessions must be at least {SAMPLE}")
    base = Path(tempfile.mkdtemp(prefix="lmqtt-bench-restart-"))
    try:
        for name in [b.strip() for b in args.brokers.split(",") if b.strip()]:
            try:
                for row in bench_broker(name, args.sessions, args.repeat, base):
                    print(json.dumps(row), flush=True)
            except brokers.BrokerUnavailable as e:
                print(json.dumps({"case": name, "error": str(e)}), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
