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

Latency is measured from the moment a message is stamped and written, not from its scheduled time
(with ``--rate`` and a full QoS 1 window a message is sent late rather than counted late;
``behind_schedule`` is the sum over publishers of the most messages each was behind schedule).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import resource
import sys
import time

from .brokers import raise_nofile
from .histogram import Histogram
from .scenarios import (ALL, STATE, TRAFFIC, ClientSpec, ScenarioConfig, defaults_for, partition,
                        plan, run_persistent, run_replay, run_retained, run_sessions)
from .stamp import Tracker, account, merge_per_publisher

PHASE_TIMEOUT_MARGIN = 30.0


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _cpu_split() -> tuple[float, float]:
    """(user, system) CPU seconds of this process: system time is mostly socket syscalls."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime


def _install_uvloop() -> bool:
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


# ============================================================================================
# worker process
# ============================================================================================

class _Pub:
    __slots__ = ("client", "sp", "alloc", "seq", "behind", "refill")

    def __init__(self, client, sp, alloc) -> None:
        self.client, self.sp, self.alloc, self.seq, self.behind = client, sp, alloc, 0, 0
        self.refill = None


class Worker:
    """One process's share of a traffic scenario."""

    BATCH = 64  # messages per write when flat out at QoS 0

    def __init__(self, cfg: ScenarioConfig, specs: list[ClientSpec], conn, index: int = 0,
                 n_workers: int = 1, credit=None) -> None:
        from .mqtt_client import Sink
        self.cfg, self.specs, self.conn = cfg, specs, conn
        self.index, self.n_workers, self.credit = index, n_workers, credit
        self.n_pubs = cfg.publishers
        self.lead = cfg.resolved_lead()
        self.tracker = Tracker()
        self.sink = Sink(self.tracker)
        self.hist = Histogram()
        self.clients = []
        self.pubs: list[_Pub] = []
        self.running = False
        self.writes = 0  # PUBLISH batches written
        self.blocked: set = set()  # QoS 1/2 publishers waiting for credit, not for acks
        self.low: list[int] = [-1] * self.n_pubs  # per publisher: slowest subscriber's highest seq
        self.done = True  # coalescing naps run from "go" until the drain is over
        self.errors: list[str] = []
        self.inbox: asyncio.Queue = asyncio.Queue()

    # -- pipe -----------------------------------------------------------------------------------
    def _on_pipe(self) -> None:
        try:
            while self.conn.poll():
                self.inbox.put_nowait(self.conn.recv())
        except (EOFError, OSError):
            self.inbox.put_nowait(("stop",))

    async def _recv(self, *names: str):
        while True:
            msg = await self.inbox.get()
            if msg[0] in names or msg[0] == "stop":
                return msg

    def _send(self, *msg) -> None:
        self.conn.send(msg)

    # -- phases --------------------------------------------------------------------------------
    async def _connect_one(self, sp: ClientSpec, sem: asyncio.Semaphore) -> None:
        from .mqtt_client import MqttError, PidAllocator, StampedPublisher, connect
        cfg = self.cfg
        async with sem:
            try:
                if sp.role == "sub":
                    c = await connect(cfg.host, cfg.port_for("sub", sp.sub_id), sp.client_id, cfg.version, sub_id=sp.sub_id,
                                      sink=self.sink, timeout=cfg.connect_timeout, tls_ca=cfg.tls_ca,
                                      username=cfg.username, password=cfg.password)
                    await c.subscribe(sp.topic, cfg.qos, timeout=cfg.connect_timeout)
                    for p in sp.expects:
                        self.tracker.expect(sp.sub_id, p)
                else:
                    c = await connect(cfg.host, cfg.port_for("pub", max(sp.pub_id, 0)), sp.client_id,
                                      cfg.version, timeout=cfg.connect_timeout, tls_ca=cfg.tls_ca,
                                      username=cfg.username, password=cfg.password)
                    if sp.role == "pub":
                        pub = _Pub(c, StampedPublisher(sp.pub_id, sp.topic, cfg.size, cfg.qos, cfg.version),
                                   PidAllocator(c.inflight))
                        self.pubs.append(pub)
                self.clients.append(c)
            except (OSError, asyncio.TimeoutError, MqttError) as e:
                if len(self.errors) < 5:
                    self.errors.append(f"{sp.client_id}: {type(e).__name__}: {e}")
                self.failed += 1

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self.conn.fileno(), self._on_pipe)
        self.failed = 0
        self._send("hello", os.getpid())
        if (await self._recv("connect"))[0] == "stop":
            return
        t0 = time.monotonic_ns()
        sem = asyncio.Semaphore(200)
        await asyncio.gather(*(self._connect_one(sp, sem) for sp in self.specs))
        t1 = time.monotonic_ns()
        self._send("ready", {"t_start": t0, "t_done": t1, "connected": len(self.clients),
                             "failed": self.failed, "errors": self.errors})
        msg = await self._recv("go")
        if msg[0] == "stop":
            await self._close()
            return
        _, t_go, t_end = msg
        gc.collect()
        gc.freeze()  # the connections and plans are long-lived: keep them out of every GC pass
        if not self.cfg.rate:  # flat out: fewer gen-0 passes over the per-read tuples; at a
            gc.set_threshold(50_000, 20, 100)  # fixed rate keep them small (latency is measured)
        reads0 = sum(c.reads for c in self.clients)
        cpu0 = _cpu_split()
        pump = asyncio.ensure_future(self._pump_sink())
        nap = self.cfg.resolved_coalesce()
        self.done = False
        if nap > 0:
            self._start_coalescing(nap)
        await self._sleep_until(t_go)
        await self._publish(t_go, t_end)
        sent = {p.sp.pub_id: p.seq for p in self.pubs}
        unacked = sum(len(p.client.inflight) for p in self.pubs)
        behind = sum(p.behind for p in self.pubs)
        self._send("published", {"sent": sent, "unacked": unacked, "behind_schedule": behind})
        msg = await self._recv("drain")
        if msg[0] == "stop":
            pump.cancel()
            await self._close()
            return
        totals: dict[int, int] = msg[1]
        await self._drain(totals)
        self.done = True
        pump.cancel()
        self._flush_sink()
        cpu1 = _cpu_split()
        self._send("result", {
            "per_pub": self.tracker.to_dict(), "hist": self.hist.to_dict(),
            "last_recv_ns": self.sink.last_ns, "cpu_s": (cpu1[0] - cpu0[0]) + (cpu1[1] - cpu0[1]),
            "cpu_sys_s": cpu1[1] - cpu0[1],
            "reads": sum(c.reads for c in self.clients) - reads0, "writes": self.writes,
            "errors": self.errors + [c.error for c in self.clients if c.error][:5],
            "disconnected": sum(1 for c in self.clients if c.closed.done()),
        })
        await self._recv("stop")
        await self._close()

    def _start_coalescing(self, nap: float) -> None:
        """Let reads pile up: sleep ``nap`` seconds once per event-loop iteration.

        Each read of a flat-out run otherwise holds one or two messages (the broker writes
        every delivery to every socket as it happens, and an idle generator wakes for each),
        so the generator pays a wake-up, an epoll round and a ``recv`` per message — as much
        CPU per message as Mosquitto's ``send``. Sleeping between loop iterations lets the
        kernel queue several messages per socket and one iteration serve many sockets; the
        nap shrinks relative to the work as load grows, so it cannot cap throughput the way a
        fixed polling interval would. Not used at a fixed ``--rate`` (latency scenario).
        """
        loop = asyncio.get_running_loop()
        sleep = time.sleep

        def _nap() -> None:
            sleep(nap)
            if not self.done:
                loop.call_soon(_nap)
        loop.call_soon(_nap)

    async def _close(self) -> None:
        for c in self.clients:
            c.disconnect()
        await asyncio.sleep(0.05)

    @staticmethod
    async def _sleep_until(t_ns: int) -> None:
        d = (t_ns - time.monotonic_ns()) / 1e9
        if d > 0:
            await asyncio.sleep(d)

    # -- receive side -------------------------------------------------------------------------
    def _flush_sink(self) -> None:
        lat = self.sink.take_latencies()
        if lat:
            self.hist.record_many(lat)

    async def _pump_sink(self) -> None:
        dbg = os.environ.get("LT_DEBUG")
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            self._flush_sink()
            self._publish_credit()
            self._retry_blocked()
            if dbg and time.monotonic() - last > 0.5:
                last = time.monotonic()
                print(f"worker {self.index}: recv={sum(c.received for c in self.clients)} "
                      f"sent={sum(p.seq for p in self.pubs)} "
                      f"inflight={sum(len(p.client.inflight) for p in self.pubs)} "
                      f"buf={[len(c.buf) for c in self.clients if c.sink][:3]}", file=sys.stderr)

    async def _drain(self, totals: dict[int, int]) -> None:
        cfg = self.cfg
        want = 0
        for (_s, p) in self.tracker.streams:
            want += totals.get(p, 0)
        deadline = time.monotonic() + cfg.drain_max
        last_n, last_change = -1, time.monotonic()
        while time.monotonic() < deadline:
            self._flush_sink()
            got = sum(st.unique for st in self.tracker.streams.values())
            if got >= want:
                return
            n = got + sum(st.duplicates for st in self.tracker.streams.values())
            if n != last_n:
                last_n, last_change = n, time.monotonic()
            elif time.monotonic() - last_change > cfg.drain_idle:
                return
            await asyncio.sleep(0.02)

    # -- publish side -------------------------------------------------------------------------
    def _publish_credit(self) -> None:
        """Share how far each publisher's slowest subscriber in this process has got.

        Flat-out publishers run closed-loop: at most ``lead`` messages ahead of the highest sequence
        their slowest subscriber has seen (over all processes, via a shared array). Without this a
        QoS 1 fan-in or a QoS 0 fan-out only measures how fast the broker's queues overflow (it
        acknowledges publishers long before subscribers read), and memory on both sides grows
        without bound.
        """
        if self.credit is None:
            return
        lows: dict[int, int] = {}
        for (_s, p), st in self.tracker.streams.items():
            lo = lows.get(p)
            if lo is None or st.hi < lo:
                lows[p] = st.hi
        base = self.index * self.n_pubs
        arr = self.credit
        for p, lo in lows.items():
            arr[base + p] = lo
        if self.pubs:  # snapshot the minimum over workers once per tick, not once per refill
            n = self.n_pubs
            vals = arr[:]
            self.low = list(map(min, *[vals[w * n:(w + 1) * n] for w in range(self.n_workers)])) \
                if self.n_workers > 1 else vals

    def _allowed(self, p: "_Pub") -> int:
        """How many more messages publisher ``p`` may send now (closed loop + window + rate)."""
        cfg = self.cfg
        room = 1 << 30
        if cfg.qos:
            room = cfg.window - len(p.client.inflight)
        if self.credit is not None:
            room = min(room, self.low[p.sp.pub_id] + 1 + self.lead - p.seq)
        return room

    async def _publish(self, t_go: int, t_end: int) -> None:
        cfg = self.cfg
        if not self.pubs:
            await self._sleep_until(t_end)
            return
        self.running = True
        loop = asyncio.get_running_loop()
        qos = cfg.qos
        if cfg.rate:
            per_pub = cfg.rate / max(1, cfg.publishers)
            tick = 0.005
            while True:
                now = time.monotonic_ns()
                if now >= t_end:
                    break
                due_total = (now - t_go) / 1e9 * per_pub
                for p in self.pubs:
                    due = int(due_total) + 1 - p.seq
                    if due <= 0:
                        continue
                    if qos:
                        room = cfg.window - len(p.client.inflight)
                        if room < due:
                            # how far behind schedule this publisher got (its worst moment)
                            p.behind = max(p.behind, due - max(room, 0))
                            due = room
                        if due <= 0:
                            continue
                    self._send_batch(p, due)
                await asyncio.sleep(tick)
        elif qos:
            blocked = self.blocked
            for p in self.pubs:
                p.refill = p.client.on_acks = self._refill(p, blocked)
                p.refill(0)
            while time.monotonic_ns() < t_end:
                await asyncio.sleep(0.002)
                if self.credit is None:  # open loop: only the window holds publishers back
                    self._retry_blocked()
        else:
            for p in self.pubs:
                pump = self._qos0_pump(p, loop)
                p.client.on_resume = pump
                loop.call_soon(pump)
            await self._sleep_until(t_end)
        self.running = False
        # wait for outstanding acks (bounded)
        deadline = time.monotonic() + cfg.drain_max
        while time.monotonic() < deadline and any(p.client.inflight for p in self.pubs
                                                  if not p.client.closed.done()):
            await asyncio.sleep(0.01)

    def _retry_blocked(self) -> None:
        """Refill the publishers the closed loop held back (after the credit moved on)."""
        blocked = self.blocked
        if blocked:
            for p in list(blocked):
                blocked.discard(p)
                p.refill(0)

    def _send_batch(self, p: _Pub, n: int) -> None:
        c = p.client
        if c.transport is None or c.transport.is_closing():
            return
        pids = p.alloc.take(n) if self.cfg.qos else None
        c.transport.write(p.sp.batch(p.seq, pids, n))
        p.seq += n
        self.writes += 1

    def _refill(self, p: _Pub, blocked: set):
        # Refill only once half the window is free: one write of window/2 messages instead of one
        # write per PUBACK. Profiled: with a write per ack the generator spent ~100 µs of (mostly
        # kernel loopback TCP) time per write, 2-3 messages each, more CPU than Mosquitto itself.
        # Closed loop: also wait for half a window of *credit* (retried after every credit
        # refresh) instead of topping up by the one or two messages the lead allows: at fan-in's
        # ~50 msg/s per publisher that made 2.5 messages per write instead of 5.
        threshold = max(1, self.cfg.window // 2)
        if self.credit is not None:
            threshold = max(1, min(threshold, self.lead // 2))
        closed = self.credit is not None

        def on_acks(_n: int) -> None:
            if not self.running:
                return
            room = self._allowed(p)
            if room >= threshold or (room > 0 and not closed and not p.client.inflight):
                self._send_batch(p, room)
            elif len(p.client.inflight) < self.cfg.window:
                blocked.add(p)  # held back by the closed loop, not by acks: retry on the tick
        return on_acks

    def _qos0_pump(self, p: _Pub, loop):
        batch = self.BATCH

        def pump() -> None:
            c = p.client
            if not self.running or c.paused or c.closed.done():
                return
            room = min(self._allowed(p), batch)
            if room > 0:
                self._send_batch(p, room)
                if not c.paused:
                    loop.call_soon(pump)
            else:
                loop.call_later(0.002, pump)
        return pump


def _worker_main(cfg: ScenarioConfig, specs: list[ClientSpec], conn, index: int, n_workers: int,
                 credit) -> None:
    raise_nofile()
    _install_uvloop()
    prof_dir = os.environ.get("LMQTT_BENCH_PROFILE")  # cProfile each worker into this directory
    try:
        if prof_dir:  # CPU time, not wall time: the machine is usually shared
            import cProfile
            prof = cProfile.Profile(time.process_time)
            try:
                prof.runcall(asyncio.run, Worker(cfg, specs, conn, index, n_workers, credit).run())
            finally:
                prof.dump_stats(os.path.join(prof_dir, f"worker{index}.prof"))
        else:
            asyncio.run(Worker(cfg, specs, conn, index, n_workers, credit).run())
    except KeyboardInterrupt:
        pass
    except Exception as e:  # noqa: BLE001 - report to the parent instead of dying silently
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        raise


# ============================================================================================
# parent
# ============================================================================================

class BrokerProbe:
    """CPU seconds and RSS of the broker process (and its children), if we know its PID."""

    def __init__(self, pid: int | None) -> None:
        self.proc = None
        if pid:
            try:
                import psutil
                self.proc = psutil.Process(pid)
            except Exception:  # noqa: BLE001 - psutil missing or process gone: no broker figures
                self.proc = None

    def _procs(self):
        out = [self.proc]
        try:
            out += self.proc.children(recursive=True)
        except Exception:  # noqa: BLE001
            pass
        return out

    def cpu(self) -> float | None:
        if self.proc is None:
            return None
        total = 0.0
        for p in self._procs():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except Exception:  # noqa: BLE001 - a child may exit between listing and reading
                pass
        return total

    @staticmethod
    def _label(p) -> str:
        """A short name for a broker process: its lmqtt subcommand (and gateway id), else its exe."""
        try:
            cmd = p.cmdline()
        except Exception:  # noqa: BLE001
            return f"pid {p.pid}"
        for sub in ("store", "gateway", "serve"):
            if sub in cmd[1:4] or (len(cmd) > 3 and cmd[3] == sub):
                if sub == "gateway" and "--gateway-id" in cmd:
                    return "gateway " + cmd[cmd.index("--gateway-id") + 1].rsplit(":", 1)[-1]
                return sub
        if any("fleet_launcher" in c for c in cmd):
            return "launcher"
        try:
            return p.name()                 # e.g. redis-server (which rewrites its command line)
        except Exception:  # noqa: BLE001
            return f"pid {p.pid}"

    def cpu_by_process(self) -> dict[str, float]:
        """CPU seconds per process of the broker (label -> seconds), for multi-process brokers."""
        out: dict[str, float] = {}
        if self.proc is None:
            return out
        for p in self._procs():
            try:
                t = p.cpu_times()
                k = self._label(p)
                out[k] = out.get(k, 0.0) + t.user + t.system
            except Exception:  # noqa: BLE001
                pass
        return out

    def rss(self) -> int | None:
        if self.proc is None:
            return None
        total = 0
        for p in self._procs():
            try:
                total += p.memory_info().rss
            except Exception:  # noqa: BLE001
                pass
        return total


def find_broker_pid(port: int) -> int | None:
    """PID of the process listening on ``port`` on loopback (our own processes only)."""
    try:
        import psutil
        for c in psutil.net_connections("tcp"):
            if c.status == "LISTEN" and c.laddr and c.laddr.port == port and c.pid:
                return c.pid
    except Exception:  # noqa: BLE001 - no permission / psutil missing
        return None
    return None


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
            p = ctx.Process(target=_worker_main, args=(cfg, part, b, index, len(parts), credit),
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
            "gen_cpu_cores_per_proc": [round(r["cpu_s"] / wall, 3) for r in results],
            "gen_cpu_cores_max_proc": round(max(r["cpu_s"] for r in results) / wall, 3),
            "gen_cpu_sys_frac": round(sum(r["cpu_sys_s"] for r in results) / gen_cpu, 3) if gen_cpu else None,
            "broker_cpu_cores": round((cpu_b1 - cpu_b0) / wall, 3) if cpu_b0 is not None else None,
            # CPU per delivered message: comparable even when other load steals cores
            "gen_cpu_us_per_msg": round(gen_cpu * 1e6 / totals["received"], 2) if totals["received"] else None,
            "broker_cpu_us_per_msg": (round((cpu_b1 - cpu_b0) * 1e6 / totals["received"], 2)
                                      if cpu_b0 is not None and totals["received"] else None),
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
    fn = {"retained": run_retained, "persistent": run_persistent, "replay": run_replay,
          "sessions": run_sessions}[cfg.scenario]
    _install_uvloop()
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
    ap.add_argument("--connections", type=int, default=None, help="conn: idle connections")
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
    for k in ("qos", "rate", "lead", "coalesce_ms", "publishers", "subscribers", "connections", "topics", "backlog"):
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
        from .selfcheck import verdict
        _log(f"who was saturated: {verdict(res)}", a.quiet)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
