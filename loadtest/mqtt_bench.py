"""`lmqtt bench mqtt`: one MQTT load scenario against a running broker, one JSON line out.

Process layout: the parent plans the clients (``scenarios.plan``), starts ``--procs`` worker
processes, each with an asyncio loop (uvloop when installed) that owns its share of the
connections, and steps them through phases over a pipe:

    hello → connect → ready → go(t_go, t_end) → published(sent) → drain(sent totals) → result → stop

All subscribers are connected and subscribed before any publisher sends; publishers stop at
``t_end`` and wait for their acks; subscribers then wait until every expected message arrived or
nothing arrived for ``drain_idle`` seconds. The parent merges histograms and per-publisher
accounting and samples the broker's CPU/RSS (psutil on its PID) over the same window as the
workers' own CPU, so the report shows which side was saturated.

This module is the parent's side only (broker probe, process pool, phases, merging, CLI). The
worker's side of the pipe, ``Worker`` and its ``worker_main`` entry point, is in
``traffic_worker``, which imports nothing from here: it is what every generator process runs.

Latency is measured from the moment a message is stamped and written, not from its scheduled time
(with ``--rate`` and a full QoS 1 window a message is sent late rather than counted late;
``behind_schedule`` is the sum over publishers of the most messages each was behind schedule).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import resource
import sys
import time

from . import conn_rate
from .brokers import raise_nofile
from .histogram import Histogram
from .million_bench import run_million
from .probe import BrokerProbe, find_broker_pid
from .saturation import verdict
from .scenarios import (
    ALL,
    STATE,
    TRAFFIC,
    ClientSpec,
    ScenarioConfig,
    defaults_for,
    partition,
    plan,
    run_persistent,
    run_replay,
    run_retained,
    run_sessions,
)
from .stamp import account, merge_per_publisher
from .traffic_worker import install_uvloop, worker_main

PHASE_TIMEOUT_MARGIN = 30.0


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[bench mqtt] {msg}", file=sys.stderr, flush=True)


_last_step: dict[str, int] = {}


def _progress(label: str, frac: float, quiet: bool) -> None:
    """A progress bar on a terminal; on a pipe/log only every 25 % (no carriage-return soup)."""
    if quiet:
        return
    frac = max(0.0, min(1.0, frac))
    width = 30
    n = int(width * frac)
    line = f"[bench mqtt] {label:<28} [{'#' * n}{'.' * (width - n)}] {frac * 100:5.1f}%"
    if sys.stderr.isatty():
        sys.stderr.write("\r" + line + ("\n" if frac >= 1.0 else ""))
    else:
        step = int(frac * 4)
        if _last_step.get(label) == step:
            return
        _last_step[label] = step
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


class _Pool:
    def __init__(self, cfg: ScenarioConfig, parts: list[list[ClientSpec]]) -> None:
        ctx = mp.get_context("fork")
        self.procs, self.conns = [], []
        credit = None
        if cfg.scenario != "conn" and not cfg.rate and cfg.resolved_lead() > 0:
            # one slot per (worker, publisher): the highest seq its slowest local subscriber saw;
            # workers without subscribers of a publisher leave it at +inf
            n = cfg.publishers * len(parts)
            credit = ctx.Array("q", [(1 << 62)] * n, lock=False)
            for w, part in enumerate(parts):
                for sp in part:
                    if sp.role == "sub":
                        for pub in sp.expects:
                            credit[w * cfg.publishers + pub] = -1
        for index, part in enumerate(parts):
            a, b = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(cfg, part, b, index, len(parts), credit),
                            daemon=True)
            p.start()
            b.close()
            self.procs.append(p)
            self.conns.append(a)

    def broadcast(self, *msg) -> None:
        for c in self.conns:
            try:
                c.send(msg)
            except OSError:
                pass

    def gather(self, name: str, timeout: float, label: str = "", quiet: bool = True) -> list:
        out: list = [None] * len(self.conns)
        deadline = time.monotonic() + timeout
        while any(o is None for o in out):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"workers did not report {name!r} within {timeout:.0f}s")
            for i, c in enumerate(self.conns):
                if out[i] is None and c.poll(min(0.05, max(left, 0))):
                    try:
                        msg = c.recv()
                    except EOFError:
                        raise RuntimeError(f"worker {i} exited (exit code {self.procs[i].exitcode})") from None
                    if msg[0] == "error":
                        raise RuntimeError(f"worker {i} failed: {msg[1]}")
                    if msg[0] == name:
                        out[i] = msg[1]
        return out

    def close(self) -> None:
        self.broadcast("stop")
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


def run_traffic(cfg: ScenarioConfig, broker_pid: int | None = None, quiet: bool = False) -> dict:
    if cfg.scenario == "conn" and conn_rate.usable(cfg):
        return conn_rate.run_conn(cfg, BrokerProbe(broker_pid), _progress, quiet)
    specs = plan(cfg)
    parts = partition(specs, cfg.procs)
    probe = BrokerProbe(broker_pid)
    rss_before = probe.rss()
    pool = _Pool(cfg, parts)
    result: dict = {}
    try:
        pool.gather("hello", 30)
        _log(f"{cfg.scenario}: {len(specs)} clients in {len(parts)} processes, connecting", quiet)
        pool.broadcast("connect")
        ready = pool.gather("ready", cfg.connect_timeout + PHASE_TIMEOUT_MARGIN)
        t_first = min(r["t_start"] for r in ready)
        t_last = max(r["t_done"] for r in ready)
        connected = sum(r["connected"] for r in ready)
        failed = sum(r["failed"] for r in ready)
        errors = [e for r in ready for e in r["errors"]][:5]
        conn_s = max(1, t_last - t_first) / 1e9
        result["connect"] = {"connected": connected, "failed": failed, "seconds": round(conn_s, 3),
                             "per_s": round(connected / conn_s, 1)}
        if failed:
            _log(f"{failed} connections failed, e.g. {errors[:2]}", quiet)
        if not connected:
            raise RuntimeError(f"no client could connect to {cfg.host}:{cfg.port}: {errors[:2]}")
        if cfg.scenario == "conn":
            # the broker's CPU while every connection is held idle (a fleet of devices that stay
            # connected and quiet): its own timers and threads, nothing the clients ask for
            cpu0, hold0 = probe.cpu(), time.monotonic()
            t_hold = hold0 + cfg.hold
            while time.monotonic() < t_hold:
                _progress("conn: holding idle", 1 - (t_hold - time.monotonic()) / cfg.hold, quiet)
                time.sleep(0.1)
            _progress("conn: holding idle", 1.0, quiet)
            cpu1, held = probe.cpu(), time.monotonic() - hold0
            rss_after = probe.rss()
            result.update({"connections": connected, "errors": errors,
                           "broker_rss_bytes": rss_after})
            if cpu0 is not None and cpu1 is not None:
                result["idle_broker_cpu_cores"] = round((cpu1 - cpu0) / held, 4)
            if rss_after is not None and rss_before is not None and connected:
                result["rss_per_conn_bytes"] = round((rss_after - rss_before) / connected, 1)
            return result
        cpu_b0 = probe.cpu()
        cpu_p0 = probe.cpu_by_process()
        sched0 = probe.sched()
        t_go = time.monotonic_ns() + 100_000_000
        t_end = t_go + int(cfg.duration * 1e9)
        wall0 = time.monotonic()
        pool.broadcast("go", t_go, t_end)
        # progress while publishing
        while time.monotonic_ns() < t_end:
            _progress(f"{cfg.scenario}: publishing", 1 - (t_end - time.monotonic_ns()) / (t_end - t_go), quiet)
            time.sleep(0.25)
        published = pool.gather("published", cfg.drain_max + PHASE_TIMEOUT_MARGIN)
        _progress(f"{cfg.scenario}: publishing", 1.0, quiet)
        sent: dict[int, int] = {}
        for p in published:
            sent.update(p["sent"])
        pool.broadcast("drain", sent)
        results = pool.gather("result", cfg.drain_max + PHASE_TIMEOUT_MARGIN)
        wall = time.monotonic() - wall0
        cpu_b1 = probe.cpu()
        cpu_p1 = probe.cpu_by_process()
        sched1 = probe.sched()
        rss_after = probe.rss()
        hist = Histogram()
        for r in results:
            hist.merge(Histogram.from_dict(r["hist"]))
        per_pub = merge_per_publisher([r["per_pub"] for r in results])
        totals = account(per_pub, sent)
        last_recv = max(r["last_recv_ns"] for r in results)
        deliver_s = max(1, last_recv - t_go) / 1e9 if last_recv else cfg.duration
        n_sent = sum(sent.values())
        gen_cpu = sum(r["cpu_s"] for r in results)
        result.update({
            "sent": n_sent, **totals,
            "unacked": sum(p["unacked"] for p in published),
            "behind_schedule": sum(p["behind_schedule"] for p in published),
            "published_per_s": round(n_sent / cfg.duration, 1),
            "delivered_per_s": round(totals["received"] / deliver_s, 1),
            "latency_us": hist.summary(1e3),
            "gen_cpu_cores": round(gen_cpu / wall, 3),
            # per worker process: one Python process can use at most one core, so a worker near
            # 1.0 is generator-bound even when the total looks small next to the broker's
            # socket reads (all connections) and PUBLISH batch writes over the whole run: how many
            # messages each costs the generator shows whether its reads and writes batch up
            "gen_reads": sum(r["reads"] for r in results),
            "gen_publish_writes": sum(r["writes"] for r in results),
            # fixed rate: the paced worker (paced.py) times deliveries by the kernel's arrival
            # time (SO_TIMESTAMPNS); the asyncio worker when it reads the socket
            "gen_loop": "paced" if all("rx_kernel_stamps" in r for r in results) else "asyncio",
            "gen_rx_kernel_reads": sum(r.get("rx_kernel_stamps", 0) for r in results),
            "gen_cpu_cores_per_proc": [round(r["cpu_s"] / wall, 3) for r in results],
            "gen_cpu_cores_max_proc": round(max(r["cpu_s"] for r in results) / wall, 3),
            "gen_cpu_sys_frac": round(sum(r["cpu_sys_s"] for r in results) / gen_cpu, 3) if gen_cpu else None,
            "broker_cpu_cores": round((cpu_b1 - cpu_b0) / wall, 3) if cpu_b0 is not None else None,
            # CPU per delivered message: comparable even when other load steals cores
            "gen_cpu_us_per_msg": round(gen_cpu * 1e6 / totals["received"], 2) if totals["received"] else None,
            "broker_cpu_us_per_msg": (round((cpu_b1 - cpu_b0) * 1e6 / totals["received"], 2)
                                      if cpu_b0 is not None and totals["received"] else None),
            # seconds per second the broker's threads waited for a CPU while runnable: on a
            # shared machine, on-CPU + waiting is what it would have used with cores to itself
            "broker_runq_wait_cores": (round((sched1[1] - sched0[1]) / wall, 3)
                                       if sched0 is not None and sched1 is not None else None),
            "broker_rss_bytes": rss_after,
            # a multi-process broker (lmqtt-workers, lmqtt-fleet): CPU per delivered message in
            # each of its processes, to see which one bounds it
            "broker_cpu_us_per_msg_by_process": ({k: round((v - cpu_p0.get(k, 0.0)) * 1e6 / totals["received"], 2)
                                                  for k, v in sorted(cpu_p1.items())}
                                                 if len(cpu_p1) > 1 and totals["received"] else None),
            "window_s": round(wall, 3),
            "disconnected": sum(r["disconnected"] for r in results),
            "errors": (errors + [e for r in results for e in r["errors"]])[:5],
            "histogram": hist,
        })
        return result
    finally:
        pool.close()


def run_state(cfg: ScenarioConfig, broker_pid: int | None = None, quiet: bool = False) -> dict:
    probe = BrokerProbe(broker_pid)
    cpu_b0, cpu_g0, wall0 = probe.cpu(), _cpu_seconds(), time.monotonic()
    _log(f"{cfg.scenario}: running", quiet)
    if cfg.scenario == "million":
        out = run_million(cfg, broker_pid, quiet)
        out["latency_us"] = out["histogram"].summary(1e3)
        out["gen_cpu_cores"] = None
        out["broker_cpu_cores"] = None
        return out
    fn = {"retained": run_retained, "persistent": run_persistent, "replay": run_replay,
          "sessions": run_sessions}[cfg.scenario]
    install_uvloop()
    out = asyncio.run(fn(cfg))
    wall = time.monotonic() - wall0
    cpu_b1 = probe.cpu()
    hist = out["histogram"]
    out["latency_us"] = hist.summary(1e3)
    out["gen_cpu_cores"] = round((_cpu_seconds() - cpu_g0) / wall, 3)
    out["broker_cpu_cores"] = round((cpu_b1 - cpu_b0) / wall, 3) if cpu_b0 is not None else None
    out["broker_rss_bytes"] = probe.rss()
    return out


def run(cfg: ScenarioConfig, broker_pid: int | None = None, broker: str = "", quiet: bool = False) -> dict:
    """Run one scenario; the returned dict is the JSON line (``histogram`` kept as an object)."""
    raise_nofile()
    t0 = time.time()
    if cfg.scenario in TRAFFIC:
        body = run_traffic(cfg, broker_pid, quiet)
    elif cfg.scenario in STATE:
        body = run_state(cfg, broker_pid, quiet)
    else:
        raise ValueError(f"unknown scenario {cfg.scenario!r}; known: {', '.join(ALL)}")
    return {"scenario": cfg.scenario, "broker": broker or f"{cfg.host}:{cfg.port}",
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
            "params": cfg.to_params(), **body}


def to_json(result: dict) -> str:
    out = dict(result)
    h = out.pop("histogram", None)
    if h is not None:
        out["histogram"] = h.to_dict()
    return json.dumps(out, sort_keys=False)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lmqtt bench mqtt", description=__doc__.split("\n")[0])
    ap.add_argument("--broker-host", default="127.0.0.1")
    ap.add_argument("--broker-port", type=int, default=1883)
    ap.add_argument("--broker-pid", type=int, default=None,
                    help="broker PID for CPU/RSS figures (default: the process listening on the port)")
    ap.add_argument("--scenario", choices=ALL, default="fanout")
    ap.add_argument("--protocol", type=int, choices=(4, 5), default=4, help="MQTT 3.1.1 (4) or 5")
    ap.add_argument("--qos", type=int, choices=(0, 1, 2), default=None)
    ap.add_argument("--size", type=int, default=64, help="payload bytes (>= 16, the stamp)")
    ap.add_argument("--duration", type=float, default=10.0, help="publish phase in seconds")
    ap.add_argument("--rate", type=float, default=None, help="total msg/s (default: flat out)")
    ap.add_argument("--window", type=int, default=10, help="QoS 1/2 in-flight messages per publisher")
    ap.add_argument("--lead", type=int, default=None,
                    help="flat out: max messages a publisher runs ahead of its slowest subscriber "
                         "(closed loop; 0 = open loop, let broker queues fill)")
    ap.add_argument("--coalesce-ms", type=float, default=None,
                    help="flat out: each worker sleeps this long per event-loop iteration so reads "
                         "batch up (default 20 fanout, 10 fanin, 5 others; 0 = off; never with --rate)")
    ap.add_argument("--publishers", type=int, default=None)
    ap.add_argument("--subscribers", type=int, default=None)
    ap.add_argument("--pairs", type=int, default=None, help="pairs/latency: number of pairs")
    ap.add_argument("--connections", type=int, default=None, help="conn, million: idle connections")
    ap.add_argument("--connect-timeout", type=float, default=None,
                    help="seconds allowed to connect (conn, million: all of them; default 120, million 600)")
    ap.add_argument("--topics", type=int, default=None, help="retained: retained topics")
    ap.add_argument("--backlog", type=int, default=None, help="persistent: queued messages; replay: stored messages")
    ap.add_argument("--procs", type=int, default=2, help="worker processes")
    ap.add_argument("--drain-max", type=float, default=20.0)
    ap.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return ap


def config_from_args(a: argparse.Namespace) -> ScenarioConfig:
    cfg = ScenarioConfig(scenario=a.scenario, host=a.broker_host, port=a.broker_port,
                         version=a.protocol, size=a.size, duration=a.duration, window=a.window,
                         procs=a.procs, drain_max=a.drain_max)
    for k, v in defaults_for(a.scenario).items():
        setattr(cfg, k, v)
    if a.pairs is not None:
        cfg.publishers = cfg.subscribers = a.pairs
    for k in ("qos", "rate", "lead", "coalesce_ms", "publishers", "subscribers", "connections", "topics", "backlog",
              "connect_timeout"):
        v = getattr(a, k)
        if v is not None:
            setattr(cfg, k, v)
    if cfg.size < 16:
        raise SystemExit("lmqtt bench mqtt: --size must be >= 16 (the stamp)")
    return cfg


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    cfg = config_from_args(a)
    pid = a.broker_pid or find_broker_pid(cfg.port)
    try:
        res = run(cfg, pid, quiet=a.quiet)
    except (OSError, TimeoutError, RuntimeError) as e:
        print(f"lmqtt bench mqtt: {cfg.scenario} against {cfg.host}:{cfg.port} failed: {e}", file=sys.stderr)
        return 1
    print(to_json(res), flush=True)
    if cfg.scenario in TRAFFIC and cfg.scenario != "conn":
        _log(f"who was saturated: {verdict(res)}", a.quiet)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
