"""`lmqtt bench restart`: how long a broker takes to be back, serving, after a restart with N
persistent sessions to restore (a rolling update, a crash, a maintenance restart).

For each broker (`lmqtt`: `lmqtt serve`; `lmqtt-fleet`: a store and two gateways, the
sessions created on the gateways in turn, each gateway restoring those it served; `mosquitto` with
persistence to its db file, written at shutdown), in a fresh data directory, N persistent sessions
(3.1.1 clean session 0), each SUBSCRIBEd to a wildcard filter of its own, are created
(`--create`): `mqtt`, N clients CONNECT + SUBSCRIBE, 200 at a time, and leave (on a fleet, session
i on gateway i mod 2); `direct` (lmqtt only; the default above 100,000 sessions: a million MQTT
connects would take minutes and is not what is measured), the session records and offsets are
written straight into the stopped server's metadata (lightqueue.MetadataStore, the records the
gateway writes for such a client), and the server is started once to register their filters, as
their SUBSCRIBEs did. Then the broker is stopped (SIGTERM) and started again `--repeat` times.
`--foreign M` (lmqtt-fleet): M more session records naming a gateway of the fleet that is gone
(the rest of a bigger fleet's sessions) are written into the stopped store's metadata after the
creation; each restarting gateway restores its own and must not read those (the store's
metadata indexes the records by gateway: lightqueue/metadata.py).

One JSON line per restart:

    {"case": "lmqtt", "sessions": 20000, "rep": 1, "restart_s": 0.61, "first_connack_s": 0.63,
     "all_present_s": 0.66, "sample": 51, "sample_present": 51, "sessions_known": 20000,
     "import_s": 0.21, "interpreter_s": 0.04, "broker_rss_bytes": ..., "stop_s": 0.1, ...}

  restart_s        from starting the process to its MQTT port accepting connections (a fleet:
                   every gateway up)
  cpu_s            the CPU time the (single-process) broker used until then: what restart_s would
                   be on an idle machine, give or take I/O (a loaded VM stretches restart_s)
  first_connack_s  from starting the process to the CONNACK of a first client resuming its session
  all_present_s    from starting the process until a sample spread over every session (`sample`)
                   is resumed: each CONNACK with session present counts (`sample_present`)
  sessions_known   lmqtt serve's `lmqtt_sessions` gauge (sessions it knows: online, offline, and
                   restored not yet resumed), read from /metrics right after
  import_s         lmqtt: the time its start spends importing modules (which ones: read from an
                   extra start under `python -X importtime` after the timed ones; timed in a fresh
                   interpreter without it); `interpreter_s`: `python -c pass`, for scale
  broker_rss_bytes after the sample, single-process brokers only

`--time-cap` bounds the whole run of a broker (creation included): past it, no further restart is
started and the row says `"capped": true`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from lmqtt.lightqueue.metadata import MetadataStore
from lmqtt.lightqueue.records import HOST, NEVER_EXPIRES, SessionRecord, Subscription
from lmqtt.loadtest import brokers
from lmqtt.loadtest.mqtt_client import connect
from lmqtt.loadtest.scenarios import SESSION_STORM_CONCURRENCY

SAMPLE = 50
DIRECT_ABOVE = 100_000       # --create auto: direct record writes above this many sessions


async def _sessions(host: str, ports: list[int], subscribe: bool, ids, timeout: float = 60.0) -> int:
    """CONNECT (clean session 0) each of `ids` (i on `ports[i % len(ports)]`), SUBSCRIBE to its
    own filter if `subscribe`, leave; returns how many found their session present."""
    sem = asyncio.Semaphore(SESSION_STORM_CONCURRENCY)
    present = 0

    async def one(i: int) -> None:
        nonlocal present
        async with sem:
            c = await connect(host, ports[i % len(ports)], f"rs-{i}", 4, clean=False, timeout=timeout)
            present += bool(c.connack.session_present)
            if subscribe:
                await c.subscribe(f"rs/dev/{i}/+", 1, timeout=timeout)
            c.disconnect()
    await asyncio.gather(*(one(i) for i in ids))
    return present


def _write_records(data_dir: Path, n: int, prefix: str, extra: dict) -> None:
    """`n` session records `{prefix}-{i}` subscribed (QoS 1) to `{prefix}/dev/{i}/+`, with their
    offsets, written into a stopped data dir's metadata (`extra`: more record state)."""
    md = MetadataStore(str(data_dir / "lightqueue" / "meta"))
    try:
        now = int(time.time() * 1000)
        for i in range(n):
            flt = f"{prefix}/dev/{i}/+"
            rec = SessionRecord(f"{prefix}-{i}", 4, NEVER_EXPIRES, now, [Subscription(flt, 1)],
                                {"inflight": {"out": [], "next": {flt: 0}, "in2": [], "pid": 1}, **extra})
            md.put_session(rec.client_id, rec)
            md.set_offsets(rec.client_id, {flt: 0})
        md.flush()
    finally:
        md.close()


def write_sessions_direct(data_dir: Path, n: int) -> None:
    """The records and offsets `lmqtt serve` writes for `n` clients that CONNECTed with
    clean session 0, SUBSCRIBEd (QoS 1) to `rs/dev/{i}/+` and left, written into its stopped data dir's
    metadata: what the MQTT creation leaves, without a million connects."""
    _write_records(data_dir, n, "rs", {})


def write_foreign_direct(data_dir: Path, m: int, host: str = "gone-gw") -> None:
    """`m` session records (and offsets) of clients of gateway `host`, which is not running: the
    records a fleet gateway writes (`SessionRecord.host`), into the stopped store's metadata."""
    _write_records(data_dir, m, "fx", {HOST: host})


def _rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) the process has used so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError, IndexError):
        return None


def _gauge(port: int, name: str = "lmqtt_sessions") -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else None


def interpreter_s() -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "pass"], check=False)
    return round(time.monotonic() - t0, 3)


def import_s(argv: list[str], host: str, port: int, log: Path, timeout: float) -> float | None:
    """The imports of one start of `argv` (an lmqtt command line): which modules it imports is
    read from one more start under `python -X importtime` (until its port accepts, then SIGTERM);
    their time is measured without it (importtime's own bookkeeping doubles it): a fresh
    interpreter imports exactly those top-level modules, timed with perf_counter."""
    if not argv or argv[0] != sys.executable:
        return None
    with open(log, "wb") as err:
        p = subprocess.Popen([argv[0], "-X", "importtime", *argv[1:]], stdout=subprocess.DEVNULL, stderr=err,
                             start_new_session=True)
    try:
        if not brokers.wait_port(host, port, timeout, p):
            return None
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(5)
    mods = []
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+\d+ \| (\S+)$", line)     # depth 0: no indent
        if m and m.group(1) not in ("site", "encodings") and not m.group(1).startswith("_"):
            mods.append(m.group(1))
    code = ("import importlib, time\nt = time.perf_counter()\nfor m in %r:\n    importlib.import_module(m)\n"
            "print(time.perf_counter() - t)" % mods)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    try:
        return round(float(r.stdout.strip().splitlines()[-1]), 3)
    except (ValueError, IndexError):
        return None


def bench_broker(name: str, n: int, repeat: int, base: Path, create: str, cap_s: float,
                 lmqtt_src: str | None = None, foreign: int = 0) -> list[dict]:
    started = time.monotonic()
    left = lambda: max(10.0, cap_s - (time.monotonic() - started))     # noqa: E731
    if create == "auto":
        create = "direct" if n > DIRECT_ABOVE and name == "lmqtt" else "mqtt"
    if create == "direct" and name != "lmqtt":
        return [{"case": name, "sessions": n, "skipped": f"--create direct is for lmqtt serve only ({name}: "
                 f"sessions are created over MQTT, pass --create mqtt for {n:,} connects)"}]
    if foreign and name != "lmqtt-fleet":
        return [{"case": name, "sessions": n, "skipped": "--foreign is for lmqtt-fleet (a gateway restoring its own "
                 "among other gateways' sessions)"}]
    workdir = base / name
    mport = brokers.free_port() if name == "lmqtt" else None
    sec = brokers.Security(lmqtt_args=("--metrics-port", str(mport), "--no-console")) if mport else None
    out: list[dict] = []
    src = {"lmqtt_src": lmqtt_src} if lmqtt_src and name.startswith("lmqtt") else {}
    rb = brokers.start(name, workdir, persist=True, ready_timeout=120.0, security=sec, **src)
    try:
        t0 = time.monotonic()
        if create == "direct":
            rb.stop(timeout=300.0)
            write_sessions_direct(workdir / "lmqtt-data", n)
            # the first start registers their filters with the store (what their SUBSCRIBEs did)
            rb = brokers.start(name, workdir, port=rb.port, persist=True, ready_timeout=left(), security=sec, **src)
        else:
            asyncio.run(_sessions(rb.host, [rb.port, *rb.extra_ports], True, range(n)))
        if foreign:
            rb.stop(timeout=300.0)
            write_foreign_direct(workdir / "lmqtt-data", foreign)
            rb = brokers.start(name, workdir, port=rb.port, persist=True, ready_timeout=left(), security=sec, **src)
        created_s = time.monotonic() - t0
        step = max(1, n // SAMPLE) | 1          # odd: a fleet's sample spans both gateways
        sample = range(1, n, step)
        for rep in range(1, repeat + 1):
            if time.monotonic() - started > cap_s:
                out.append({"case": name, "sessions": n, "rep": rep, "capped": True, "time_cap_s": cap_s})
                break
            t0 = time.monotonic()
            rb.stop(timeout=300.0)
            stop_s = time.monotonic() - t0
            t0 = time.monotonic()
            rb = brokers.start(name, workdir, port=rb.port, persist=True, ready_timeout=min(600.0, left()),
                               security=sec, **src)
            restart_s = time.monotonic() - t0
            single = not rb.extra_ports and name != "lmqtt-workers"
            cpu = _cpu_s(rb.pid) if single else None
            ports = [rb.port, *rb.extra_ports]
            first = asyncio.run(_sessions(rb.host, ports, False, [0], timeout=min(600.0, left())))
            first_s = time.monotonic() - t0
            present = asyncio.run(_sessions(rb.host, ports, False, sample, timeout=min(600.0, left())))
            all_s = time.monotonic() - t0
            rss = _rss(rb.pid) if single else None          # one process only
            out.append({"case": name, "version": rb.version, "sessions": n, "foreign": foreign, "rep": rep,
                        "created": create,
                        "created_s": round(created_s, 1), "restart_s": round(restart_s, 3),
                        "cpu_s": cpu, "first_connack_s": round(first_s, 3), "first_present": bool(first),
                        "all_present_s": round(all_s, 3), "sample": len(sample), "sample_present": present,
                        "sessions_known": _gauge(mport) if mport else None, "stop_s": round(stop_s, 3),
                        "broker_rss_bytes": rss})
        if name == "lmqtt" and not lmqtt_src and time.monotonic() - started < cap_s:
            rb.stop(timeout=300.0)
            imp = import_s(rb.argv, rb.host, rb.port, workdir / "importtime.log", min(600.0, left()))
            for row in out:
                row.update(import_s=imp, interpreter_s=interpreter_s())
    finally:
        rb.stop(timeout=300.0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmqtt bench restart", description=__doc__.split("\n\n")[0])
    ap.add_argument("--brokers", default="lmqtt,lmqtt-fleet,mosquitto")
    ap.add_argument("--sessions", type=int, default=20000, help="persistent sessions to restore (default 20000)")
    ap.add_argument("--repeat", type=int, default=2, help="restarts per broker (default 2)")
    ap.add_argument("--create", choices=("auto", "mqtt", "direct"), default="auto",
                    help=f"how the sessions are made: MQTT connects, or (lmqtt) records written into the stopped "
                         f"server's metadata (default auto: direct above {DIRECT_ABOVE:,} sessions)")
    ap.add_argument("--lmqtt-src", help="run lmqtt from this source tree (a `git archive` snapshot with its C modules "
                                        "built in place), to compare two versions")
    ap.add_argument("--time-cap", type=float, default=1800.0,
                    help="seconds a broker's run may take, creation included (default 1800)")
    ap.add_argument("--foreign", type=int, default=0,
                    help="lmqtt-fleet: this many more session records of a gone gateway in the store, which a "
                         "restarting gateway must not read (default 0)")
    args = ap.parse_args(argv)
    if args.sessions < SAMPLE:
        ap.error(f"--sessions must be at least {SAMPLE}")
    base = Path(tempfile.mkdtemp(prefix="lmqtt-bench-restart-"))
    try:
        for name in [b.strip() for b in args.brokers.split(",") if b.strip()]:
            try:
                for row in bench_broker(name, args.sessions, args.repeat, base, args.create, args.time_cap,
                                        args.lmqtt_src, args.foreign):
                    print(json.dumps(row), flush=True)
            except brokers.BrokerUnavailable as e:
                print(json.dumps({"case": name, "error": str(e)}), flush=True)
            shutil.rmtree(base / name, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
