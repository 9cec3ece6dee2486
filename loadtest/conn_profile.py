"""Where the memory of an idle MQTT connection goes on `lmqtt serve`.

    lmqtt bench conn-memory [--connections 10000] [--top 25] [--no-subscribe]

Starts `lmqtt serve` under tracemalloc (in a fresh data dir, every optional listener off), opens
`--warmup` connections (one-time growth: dict resizes, caches, the first allocations of each kind),
takes a snapshot, opens `--connections` more (CONNECT, then SUBSCRIBE to a topic of its own, as in
`lmqtt bench compare --scenarios conn`), waits `--settle` seconds (the loop settles, and idle
connections are parked: 0.05 s after a silent handshake, gateway/net/parking.py), takes a second snapshot and
prints the difference per source line and per object type, divided by the number of connections.
The broker's RSS growth is printed too (tracemalloc's own bookkeeping inflates it: use
`lmqtt bench compare --scenarios conn` for the figure without it).

`--rss`: no tracemalloc; the broker's RSS growth per connection after `--settle`, the connections
opened in `--batches` batches `--pause` seconds apart (devices arriving over time: what parking
frees is reused by the next arrivals; one burst of 10,000 measures the peak before any is parked),
with `--compare-off` the same run again with parking off (`park_idle_after_s = 0`).

The snapshot is taken inside the broker by a thread that waits for a request file, so the broker
needs no signal handler or admin endpoint for it.
"""
from __future__ import annotations

import argparse
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time

from .brokers import free_port, wait_port
from .conn_hold import Holder

_BOOT = r"""
import gc, os, pickle, sys, threading, time, tracemalloc, collections
tracemalloc.start(int(os.environ.get("CONN_PROFILE_FRAMES", "1")))
d = os.environ["CONN_PROFILE_DIR"]

def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def _watch():
    n = 0
    while True:
        req = os.path.join(d, f"snap-{n}.req")
        if os.path.exists(req):
            gc.collect()
            counts, sizes = collections.Counter(), collections.Counter()
            for o in gc.get_objects():
                t = type(o)
                name = f"{t.__module__}.{t.__qualname__}"
                counts[name] += 1
                sizes[name] += sys.getsizeof(o)
            snap = tracemalloc.take_snapshot()
            tmp = os.path.join(d, f"snap-{n}.tmp")
            with open(tmp, "wb") as f:
                pickle.dump({"snapshot": snap, "counts": counts, "sizes": sizes, "rss": _rss()}, f)
            os.rename(tmp, os.path.join(d, f"snap-{n}.pkl"))
            n += 1
        time.sleep(0.1)

threading.Thread(target=_watch, daemon=True).start()
from lmqtt.gateway.cli import main
sys.exit(main(sys.argv[1:]))
"""



def _stop(holders, proc, log) -> None:
    """Close every held connection, then the broker (SIGTERM, SIGKILL after 30 s), then its log."""
    for h in holders:
        h.close_all()
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()

def _snapshot(d: str, n: int, timeout: float = 120.0) -> dict:
    open(os.path.join(d, f"snap-{n}.req"), "w").close()
    path = os.path.join(d, f"snap-{n}.pkl")
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the broker wrote no snapshot within {timeout:.0f}s")
        time.sleep(0.1)
    with open(path, "rb") as f:
        return pickle.load(f)


def profile(connections: int, warmup: int, subscribe: bool, frames: int, top: int,
            extra_args: list[str], settle: float = 6.0) -> dict:
    work = tempfile.mkdtemp(prefix="lmqtt-connprof-")
    port = free_port()
    env = dict(os.environ, CONN_PROFILE_DIR=work, CONN_PROFILE_FRAMES=str(frames))
    cmd = [sys.executable, "-c", _BOOT, "serve", "--port", str(port), "--data-dir", os.path.join(work, "data"),
           "--metrics-port", "0", "--store-port", "0", "--sys-interval", "0", "--log-level", "WARNING",
           *extra_args]
    log = open(os.path.join(work, "serve.log"), "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    holders = []
    try:
        if not wait_port("127.0.0.1", port, 60, proc):
            raise RuntimeError(f"lmqtt serve did not start (log: {work}/serve.log)")
        run = f"cp{os.getpid():x}"

        def hold(first: int, n: int) -> Holder:
            h = Holder("127.0.0.1", port, n, lambda i: f"{run}-{first + i}",
                       (lambda i: f"{run}/idle/{first + i}") if subscribe else (lambda i: None))
            h.open_all(time.monotonic() + 300)
            if h.failed:
                raise RuntimeError(f"{h.failed} connections failed: {h.errors}")
            holders.append(h)
            return h

        hold(0, warmup)
        time.sleep(settle)
        a = _snapshot(work, 0)
        h = hold(warmup, connections)
        time.sleep(settle)
        b = _snapshot(work, 1)
        open_now = h.still_open()
    finally:
        _stop(holders, proc, log)
    shutil.rmtree(work, ignore_errors=True)
    n = connections
    stats = b["snapshot"].compare_to(a["snapshot"], "traceback" if frames > 1 else "lineno")
    lines = []
    for st in stats[:top]:
        where = " <- ".join(f"{os.path.relpath(fr.filename, os.path.dirname(os.path.dirname(__file__)))}:{fr.lineno}"
                            if "lmqtt" in fr.filename or "/work/" in fr.filename else f"{fr.filename}:{fr.lineno}"
                            for fr in st.traceback)
        lines.append({"bytes_per_conn": round(st.size_diff / n, 1), "blocks_per_conn": round(st.count_diff / n, 2),
                      "where": where})
    types = []
    for name in set(b["counts"]) | set(a["counts"]):
        dc = b["counts"][name] - a["counts"][name]
        ds = b["sizes"][name] - a["sizes"][name]
        if abs(dc) >= n // 2:
            types.append({"type": name, "per_conn": round(dc / n, 2), "bytes_per_conn": round(ds / n, 1)})
    types.sort(key=lambda t: -t["bytes_per_conn"])
    total = sum(st.size_diff for st in stats)
    return {"connections": n, "still_open": open_now, "traced_bytes_per_conn": round(total / n, 1),
            "rss_bytes_per_conn": round((b["rss"] - a["rss"]) / n, 1), "lines": lines, "types": types}


def _rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_profile(connections: int, warmup: int, subscribe: bool, batches: int, pause: float, settle: float,
                extra_args: list[str]) -> dict:
    """RSS growth per idle connection of `lmqtt serve` (no tracemalloc), opened in `batches`."""
    work = tempfile.mkdtemp(prefix="lmqtt-connrss-")
    port = free_port()
    cmd = [sys.executable, "-m", "lmqtt.gateway.cli", "serve", "--port", str(port), "--data-dir",
           os.path.join(work, "data"), "--metrics-port", "0", "--store-port", "0", "--sys-interval", "0",
           "--log-level", "WARNING", *extra_args]
    log = open(os.path.join(work, "serve.log"), "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    holders = []
    try:
        if not wait_port("127.0.0.1", port, 60, proc):
            raise RuntimeError(f"lmqtt serve did not start (log: {work}/serve.log)")
        run = f"cr{os.getpid():x}"
        first = 0

        def hold(n: int) -> None:
            nonlocal first
            f0 = first
            h = Holder("127.0.0.1", port, n, lambda i: f"{run}-{f0 + i}",
                       (lambda i: f"{run}/idle/{f0 + i}") if subscribe else (lambda i: None))
            h.open_all(time.monotonic() + 300)
            if h.failed:
                raise RuntimeError(f"{h.failed} connections failed: {h.errors}")
            holders.append(h)
            first += n

        hold(warmup)
        time.sleep(settle)
        r0 = _rss_of(proc.pid)
        per = max(1, connections // max(1, batches))
        left = connections
        while left > 0:
            hold(min(per, left))
            left -= per
            if left > 0:
                time.sleep(pause)
        time.sleep(settle)
        r1 = _rss_of(proc.pid)
        open_now = sum(h.still_open() for h in holders) - warmup
    finally:
        _stop(holders, proc, log)
    shutil.rmtree(work, ignore_errors=True)
    return {"connections": connections, "still_open": open_now, "batches": batches, "pause_s": pause,
            "rss_bytes_per_conn": round((r1 - r0) / connections, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmqtt bench conn-memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=10_000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--no-subscribe", action="store_true", help="CONNECT only")
    ap.add_argument("--frames", type=int, default=1, help="traceback depth grouped by (1: per line)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--lmqtt-args", default="", help="extra `lmqtt serve` arguments")
    ap.add_argument("--settle", type=float, default=6.0,
                    help="seconds idle before each snapshot (idle connections are parked after 2 s, checked every 2 s)")
    ap.add_argument("--rss", action="store_true", help="RSS growth only, without tracemalloc (see above)")
    ap.add_argument("--batches", type=int, default=1, help="--rss: open the connections in this many batches")
    ap.add_argument("--pause", type=float, default=3.0, help="--rss: seconds between batches")
    ap.add_argument("--compare-off", action="store_true", help="--rss: run again with park_idle_after_s = 0")
    a = ap.parse_args(argv)
    if a.rss:
        runs = [("parking on", a.lmqtt_args.split())]
        if a.compare_off:
            off = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
            off.write("park_idle_after_s = 0\n")
            off.close()
            runs.append(("parking off", a.lmqtt_args.split() + ["--config", off.name]))
        for label, args in runs:
            r = rss_profile(a.connections, a.warmup, not a.no_subscribe, a.batches, a.pause, a.settle, args)
            print(f"{label}: {r['connections']} idle connections in {r['batches']} batch(es) {r['pause_s']} s apart "
                  f"({r['still_open']} still open): RSS {r['rss_bytes_per_conn']} B/conn")
        return 0
    r = profile(a.connections, a.warmup, not a.no_subscribe, a.frames, a.top, a.lmqtt_args.split(), a.settle)
    print(f"{r['connections']} idle connections ({r['still_open']} still open at the end): traced "
          f"{r['traced_bytes_per_conn']} B/conn, RSS (with tracemalloc's bookkeeping) {r['rss_bytes_per_conn']} B/conn")
    print("\nper source line (bytes / blocks per connection):")
    for ln in r["lines"]:
        print(f"  {ln['bytes_per_conn']:8.1f} B {ln['blocks_per_conn']:6.2f}  {ln['where']}")
    print("\nper object type (GC-tracked objects; count and sys.getsizeof per connection):")
    for t in r["types"]:
        print(f"  {t['bytes_per_conn']:8.1f} B {t['per_conn']:6.2f}  {t['type']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
