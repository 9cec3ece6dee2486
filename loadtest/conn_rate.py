"""The `conn` scenario on the lean connection generator: C idle connections (CONNECT, then
SUBSCRIBE to a topic of their own) opened by raw-socket processes (`conn_hold.Holder`), then held
idle; connect rate, the broker's memory per connection and its CPU while they are held.

Why not the asyncio workers of the traffic scenarios: a Protocol, a transport and two awaited
handshake steps per socket cost the generator ~100 µs a connection, so it measured Mosquitto at
5,500-7,800 connects/s where an independent generator measured 28,000/s on the same machine. The
Holder writes CONNECT and SUBSCRIBE together as soon as the socket is connected and reads the two
fixed-size answers back (~23 µs of generator CPU a connection).

Why a bounded handshake window: the broker's accept queue. Mosquitto listens with a backlog of 100;
more connections in flight than its accept queue holds make the kernel drop SYNs, and each drop
costs that client a one-second SYN retransmit. Measured against Mosquitto at load 5: 512 handshakes
in flight 3,566/s, 200 9,511/s, 96 18,000-25,700/s, 48 and fewer 14,000-19,000/s. The window is the
generator's and the same for every broker (lmqtt's backlog is 1,024, so it is not the bound there).
TLS and password logins keep the asyncio path (`Holder` speaks plain MQTT without credentials).
"""
from __future__ import annotations

import multiprocessing as mp
import resource
import time

from .conn_hold import Holder

HANDSHAKE_WINDOW = 96      # handshakes in flight over all generator processes (see above)
READY_TIMEOUT_MARGIN = 30.0


def usable(cfg) -> bool:
    """The lean path serves the scenario unless it needs TLS or a login."""
    return not cfg.tls_ca and cfg.username is None


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _gen_main(cfg, first: int, count: int, step: int, window: int, go, pipe) -> None:
    """One generator process: connections first, first + step, ... (`count` of them); report,
    hold them until told to close."""
    try:
        run = f"lb/{cfg.run_id}"
        idx = range(first, first + count * step, step)
        every = (cfg.port, *cfg.ports)
        # subscriber i's port as the traffic scenarios choose it (ScenarioConfig.port_for): the
        # Holder sends connection k to ports[k % len(ports)], so rotate by this process's first
        ports = tuple(cfg.port_for("sub", i) for i in idx[:len(every)]) if cfg.ports else ()
        h = Holder(cfg.host, cfg.port, count, lambda k: f"{run}-c{idx[k]}", lambda k: f"{run}/idle/{idx[k]}",
                   version=cfg.version, window=window, ports=ports)
        go.wait(READY_TIMEOUT_MARGIN)
        cpu0 = _cpu_s()
        h.open_all(time.monotonic() + cfg.connect_timeout)
        pipe.send(("ready", {"held": len(h.held), "failed": h.failed, "errors": h.errors,
                             "t_start": h.t_start, "t_done": h.t_done, "cpu_s": _cpu_s() - cpu0}))
        pipe.recv()
        h.close_all()
        pipe.send(("closed", None))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the scenario
        pipe.send(("error", f"{type(e).__name__}: {e}"))


def run_conn(cfg, probe, progress, quiet: bool) -> dict:
    """The scenario's JSON body (see docs/loadtest.md `conn`)."""
    ctx = mp.get_context("fork")
    procs = max(1, min(cfg.procs, cfg.connections))
    window = max(1, HANDSHAKE_WINDOW // procs)
    go = ctx.Event()
    pool = []
    rss_before = probe.rss()
    for k in range(procs):
        n = len(range(k, cfg.connections, procs))
        a, b = ctx.Pipe()
        p = ctx.Process(target=_gen_main, args=(cfg, k, n, procs, window, go, b), daemon=True)
        p.start()
        b.close()
        pool.append((p, a))
    try:
        time.sleep(0.2)           # the processes are forked and waiting: start them together
        sched0 = probe.sched()    # ns resolution (psutil's CPU times count 10 ms ticks)
        go.set()
        ready = []
        for _p, a in pool:
            if not a.poll(cfg.connect_timeout + READY_TIMEOUT_MARGIN):
                raise TimeoutError(f"a connection generator did not report within {cfg.connect_timeout:.0f}s")
            msg = a.recv()
            if msg[0] == "error":
                raise RuntimeError(f"connection generator failed: {msg[1]}")
            ready.append(msg[1])
        sched1 = probe.sched()
        connected = sum(r["held"] for r in ready)
        failed = sum(r["failed"] for r in ready)
        errors = [e for r in ready for e in r["errors"]][:5]
        if not connected:
            raise RuntimeError(f"no client could connect to {cfg.host}:{cfg.port}: {errors[:2]}")
        conn_s = max(1e-9, max(r["t_done"] for r in ready) - min(r["t_start"] for r in ready))
        gen_cpu = sum(r["cpu_s"] for r in ready)
        result: dict = {"connect": {"connected": connected, "failed": failed, "seconds": round(conn_s, 3),
                                    "per_s": round(connected / conn_s, 1)},
                        "gen_loop": "raw", "handshake_window": window * procs,
                        "gen_cpu_us_per_conn": round(gen_cpu * 1e6 / connected, 1)}
        if sched0 is not None and sched1 is not None:
            # the connect phase's broker CPU per connection (it includes what the broker did
            # while the generators' reports travelled: a few ms)
            result["broker_cpu_us_per_conn"] = round((sched1[0] - sched0[0]) * 1e6 / connected, 1)
        # the broker's CPU while every connection is held idle (a fleet of devices that stay
        # connected and quiet): its own timers and threads, nothing the clients ask for
        cpu0, hold0 = probe.cpu(), time.monotonic()
        t_hold = hold0 + cfg.hold
        while time.monotonic() < t_hold:
            progress("conn: holding idle", 1 - (t_hold - time.monotonic()) / cfg.hold, quiet)
            time.sleep(0.1)
        progress("conn: holding idle", 1.0, quiet)
        cpu1, held = probe.cpu(), time.monotonic() - hold0
        rss_after = probe.rss()
        result.update({"connections": connected, "errors": errors, "broker_rss_bytes": rss_after})
        if cpu0 is not None and cpu1 is not None:
            result["idle_broker_cpu_cores"] = round((cpu1 - cpu0) / held, 4)
        if rss_after is not None and rss_before is not None and connected:
            result["rss_per_conn_bytes"] = round((rss_after - rss_before) / connected, 1)
        return result
    finally:
        go.set()
        for p, a in pool:
            try:
                a.send("close")
                a.poll(10)
            except OSError:
                pass
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
