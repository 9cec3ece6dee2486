"""The `million` scenario: up to 1,000,000 idle MQTT connections held by one broker.

    lmqtt bench compare --brokers lmqtt-workers,mosquitto --scenarios million [--connections N]
    lmqtt bench mqtt --scenario million --broker-port P [--connections N]

Each connection CONNECTs and SUBSCRIBEs to a topic of its own (as in `conn`), then stays idle.
They come from raw non-blocking sockets driven by one epoll per generator process
(loadtest/conn_hold.py), as many processes as the open-files limit asks for, from source addresses
127.0.0.2, .3, ..., each connection bound to a source port of its own (`source_of`: letting the
kernel pick one searched the port range at every connect, half the machine's CPU at 10^5 held).

What it reports: how many were asked for and held, the time to connect them all (and the rate),
the broker's RSS growth per held connection and the kernel's unreclaimable slab growth (both ends
of each connection, system-wide: /proc/meminfo SUnreclaim), an idle client's PINGRESP wait (p99/max, every 5 ms from a process of its
own) while they are held, and a PINGREQ round trip on a sample of the held connections themselves
(every connection still open is checked at the end).

Bounds, said in the result rather than worked around: a process holds at most its open-files
limit of sockets. The bench raises each process's soft limit to its hard limit (never the hard
limit: that is the system's, and needs CAP_SYS_RESOURCE); the broker's processes that listen on the
port can hold the sum of their limits, and the scenario asks for no more than that
(`connections_target`, with `bound` saying why when it is below the request).
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import select
import time

from lmqtt.store.file_budget import MIN_SHARE, default_share

from .conn_hold import Holder, capacity
from .histogram import Histogram
from .probe import BrokerProbe
from .scenarios import IdleProbe

PER_ADDRESS = 25_000       # connections per source address (ephemeral ports 32768-60999: 28,232)
SRC_PORT_BASE = 4096       # source ports SRC_PORT_BASE .. + PER_ADDRESS - 1 (`source_of`)
# handshakes in progress at once over all generator processes: 51 processes of 256 each (13,000 at
# once) against `serve --workers 54` had 44 % of a million CONNECTs refused (0x03: a gateway's store
# link timed out under the storm), 2,048 at once 32 %; 11 processes of 256 (200,000) none
WINDOW_TOTAL = 2048
# the held connections' keep-alive: they send nothing while the rest connect (a million takes ~10
# minutes here), and a broker closes a client silent for 1.5 keep-alives
KEEPALIVE_S = 3600
PING_SAMPLE = 200          # held connections per generator process whose PINGREQ round trip is timed
BROKER_RESERVED_FDS = 256  # left free in each broker process: its store link, logs, the idle probe
BROKER_RESERVED_CLIENTS = 8  # of an `lmqtt serve`'s admitted clients: the idle probe's and the tools'
# what the broker's ConnectionGate (gateway/broker/limits.py, which loadtest does not import) keeps
# besides its store's share: a reserve, and room for refused clients waiting to be told why;
# tests/net/test_million_bench.py checks embedded_store_socket_cap against the gate itself
GATE_RESERVE = 64
GATE_REFUSED_PENDING_MAX = 256


def _gen_main(host: str, port: int, run: str, first: int, count: int, ips: list[str], deadline: float, pipe,
              window: int = 256) -> None:
    """One generator process: open `count` connections (indexes first..), report, then answer
    "ping" (round trips on a sample, and how many are still open) and "close"."""
    try:
        h = Holder(host, port, count, lambda i: f"{run}-m{first + i}", lambda i: f"{run}/m/{first + i}",
                   src_ips=ips, window=window, src_of=lambda i: source_of(first + i, ips), keepalive=KEEPALIVE_S)
        h.open_all(deadline)
        pipe.send(("ready", {"held": len(h.held), "failed": h.failed, "errors": h.errors,
                             "t_start": h.t_start, "t_done": h.t_done}))
        while True:
            cmd = pipe.recv()
            if cmd == "ping":
                pipe.send(("ping", {"rtts": _ping_sample(h.held, PING_SAMPLE), "still_open": h.still_open()}))
            else:
                break
        h.close_all()
        pipe.send(("closed", None))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the scenario
        pipe.send(("error", f"{type(e).__name__}: {e}"))


def source_of(i: int, ips: list[str]) -> tuple[str, int]:
    """Connection i's source address and port, unique over the run: the addresses in turn, each
    address's connections on consecutive ports from SRC_PORT_BASE (below the ephemeral range,
    where the kernel never picks one for anybody else; PER_ADDRESS of them at most)."""
    return ips[i % len(ips)], SRC_PORT_BASE + i // len(ips)


def _ping_sample(held: list, n: int) -> list[int]:
    """PINGREQ on `n` connections spread over `held`, one at a time: each round trip in ns."""
    rtts = []
    if not held:
        return rtts
    step = max(1, len(held) // n)
    ep = select.epoll()
    try:
        for s in held[::step][:n]:
            fd = s.fileno()
            ep.register(fd, select.EPOLLIN)
            t0 = time.monotonic_ns()
            try:
                s.send(b"\xc0\x00")
                got = b""
                while len(got) < 2 and ep.poll(5.0):
                    got += s.recv(2 - len(got))
                    if not got:
                        break
            except OSError:
                got = b""
            if got == b"\xd0\x00":
                rtts.append(time.monotonic_ns() - t0)
            ep.unregister(fd)
    finally:
        ep.close()
    return rtts


def _kernel_slab_bytes() -> int | None:
    """The kernel's unreclaimable slab memory (sockets, their inodes and files live there)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("SUnreclaim:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def embedded_store_socket_cap(cmdline: list[str], soft: int) -> int | None:
    """The client sockets an `lmqtt serve` process admits (it refuses the next with CONNACK 0x97):
    its store keeps a share of the open-files limit (store/file_budget.py), so the broker's own
    cap is below what its free descriptors suggest. None for any other process (a `serve
    --workers` gateway, another broker). The share is the default one or `--max-open-files`
    given on the command line (one set in a config file is not seen)."""
    cmdline = " ".join(cmdline).split()     # `lmqtt serve ...` rewrites its argv into one string
    if "serve" not in cmdline:
        return None
    share = default_share(soft, with_clients=True)
    for i, tok in enumerate(cmdline):
        v = tok.split("=", 1)[1] if tok.startswith("--max-open-files=") else (
            cmdline[i + 1] if tok == "--max-open-files" and i + 1 < len(cmdline) else None)
        if v is not None and v.isdigit() and int(v) > 0:
            share = max(MIN_SHARE // 2, int(v))      # as FileBudget.for_process
    refused_pending = min(GATE_REFUSED_PENDING_MAX, max(8, soft // 16))
    return max(1, soft - share - GATE_RESERVE - refused_pending)


def broker_capacity(pid: int | None, port: int) -> tuple[int | None, list[dict]]:
    """How many more sockets the broker's processes that listen on `port` can open: the sum of
    (soft open-files limit - open fds - a reserve) over them; None when unknown (no PID, no psutil)."""
    if not pid:
        return None, []
    try:
        import psutil  # optional: the bench extra
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except Exception:  # noqa: BLE001 - no psutil or the broker is gone: unknown
        return None, []
    total, seen = 0, []
    # which of them listen on the port: one read of the system's sockets for all of them (a
    # process's own `net_connections` reads every socket of the system too: with 100,000 held
    # and 53 workers that was ~30 s of the generator's CPU before the first connect)
    try:
        listening = {c.pid for c in psutil.net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port}
    except Exception:  # noqa: BLE001 - not ours to read: each process is asked instead
        listening = None
    for p in procs:
        try:
            if listening is not None:
                if p.pid not in listening:
                    continue
            elif not any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                         for c in p.net_connections(kind="tcp")):
                continue
            soft, hard = p.rlimit(psutil.RLIMIT_NOFILE)
            free = max(0, soft - p.num_fds() - BROKER_RESERVED_FDS)
            cap = embedded_store_socket_cap(p.cmdline(), soft)
            if cap is not None:
                free = min(free, max(0, cap - BROKER_RESERVED_CLIENTS))
        except Exception as e:  # noqa: BLE001 - exited meanwhile, or not ours to inspect
            # kept, so a caller that finds no listener can say why (unknown, not zero)
            seen.append({"pid": p.pid, "error": repr(e)})
            continue
        total += free
        seen.append({"pid": p.pid, "nofile_soft": soft, "nofile_hard": hard, "free": free})
    listeners = [x for x in seen if "error" not in x]
    return (total if listeners else None), (listeners or seen)


def run_million(cfg, broker_pid: int | None = None, quiet: bool = True) -> dict:
    requested = cfg.connections
    cap, listeners = broker_capacity(broker_pid, cfg.port)
    target = requested if cap is None else min(requested, cap)
    bound = None
    if target < requested:
        lim = sorted({(x["nofile_soft"], x["nofile_hard"]) for x in listeners})
        bound = (f"the broker's {len(listeners)} listening process(es) can open {cap:,} more sockets: open-files "
                 f"limit (soft, hard) {lim} per process; raising the hard limit needs CAP_SYS_RESOURCE")
    per_proc = capacity()
    nprocs = max(1, -(-target // per_proc))
    # the same share for each process, not as many as fit in all but the last: a process filled to
    # its capacity keeps only RESERVED_FDS free, fewer than the descriptors it inherits at fork
    # (the pipes of the processes started before it), and failed with EMFILE near the end of a
    # million
    share = -(-target // nprocs)
    n_ips = max(1, -(-target // PER_ADDRESS))
    ips = [f"127.0.{(2 + k) // 256}.{(2 + k) % 256}" for k in range(n_ips)]
    run = f"mb{os.getpid():x}{int(time.time()) % 100000:x}"
    probe = BrokerProbe(broker_pid)
    rss0, slab0 = probe.rss(), _kernel_slab_bytes()
    ctx = multiprocessing.get_context("fork")
    deadline = time.monotonic() + cfg.connect_timeout
    gens = []
    shares = []
    first = 0
    for k in range(nprocs):
        n = min(share, target - first)
        shares.append(n)
        a, b = ctx.Pipe()
        p = ctx.Process(target=_gen_main, args=(cfg.host, cfg.port, run, first, n, ips, deadline, b,
                                                max(16, min(256, WINDOW_TOTAL // nprocs))), daemon=True)
        p.start()
        b.close()                 # the child's end: the processes forked after this one need not hold it
        gens.append((p, a))
        first += n
    out: dict = {"connections_requested": requested, "connections_target": target, "bound": bound,
                 "broker_listeners": listeners, "generator_procs": nprocs, "source_addresses": n_ips,
                 "connections_per_process": shares}

    def gather(name: str, timeout: float) -> list:
        res = []
        end = time.monotonic() + timeout
        for p, a in gens:
            if not a.poll(max(0.0, end - time.monotonic())):
                raise TimeoutError(f"million: a generator did not report {name!r} within {timeout:.0f}s")
            msg = a.recv()
            if msg[0] == "error":
                raise RuntimeError(f"million: generator failed: {msg[1]}")
            res.append(msg[1])
        return res

    try:
        ready = gather("ready", cfg.connect_timeout + 60)
        held = sum(r["held"] for r in ready)
        if not held:
            errs = [e for r in ready for e in r["errors"]][:2]
            raise RuntimeError(f"million: no connection to {cfg.host}:{cfg.port} could be opened: {errs}")
        conn_s = max(r["t_done"] for r in ready) - min(r["t_start"] for r in ready)
        out.update({"connected": held, "failed": sum(r["failed"] for r in ready),
                    "errors": [e for r in ready for e in r["errors"]][:5],
                    "connect_s": round(conn_s, 2), "connect_per_s": round(held / conn_s, 1) if conn_s else None})
        time.sleep(1.0)
        probe_ping = IdleProbe(cfg)

        async def hold() -> None:
            async with probe_ping:
                await asyncio.sleep(cfg.hold)

        cpu0, t0 = probe.cpu(), time.monotonic()
        probe_error = None
        try:
            asyncio.run(hold())
        except RuntimeError as e:
            # the idle client is one more socket on a broker held at its open-files limit: one it
            # could not take (reset, seen once under CI load at a 700-descriptor limit) is a result
            # of the run, reported, not a reason to lose the figures of the connections it holds
            probe_error = str(e)
        cpu1, dt = probe.cpu(), time.monotonic() - t0
        rss1, slab1 = probe.rss(), _kernel_slab_bytes()
        for _p, a in gens:
            a.send("ping")
        pings = gather("ping", 120)
        sample = Histogram()
        for r in pings:
            sample.record_many(r["rtts"])
        out["still_open"] = sum(r["still_open"] for r in pings)
        out["broker_rss_bytes"] = rss1
        if rss0 is not None and rss1 is not None and held:
            out["rss_per_conn_bytes"] = round((rss1 - rss0) / held, 1)
        if slab0 is not None and slab1 is not None and held:
            # system-wide: both ends of each connection, and whatever else the machine did meanwhile
            out["kernel_slab_bytes_per_conn"] = round((slab1 - slab0) / held, 1)
        if cpu0 is not None and cpu1 is not None:
            out["idle_broker_cpu_cores"] = round((cpu1 - cpu0) / dt, 4)
        if probe_error is None:
            out.update(probe_ping.summary())
            out["histogram"] = probe_ping.histogram()
        else:
            out["idle_probe_error"] = probe_error
            out["histogram"] = Histogram()          # no idle-client samples: an empty latency row
        p99 = sample.percentile(99.0)
        out["held_ping_sample"] = sample.total
        out["held_ping_p99_ms"] = None if p99 is None else round(p99 / 1e6, 2)
    finally:
        for p, a in gens:
            try:
                a.send("close")
            except OSError:
                pass
        for p, a in gens:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(5)
    return out
