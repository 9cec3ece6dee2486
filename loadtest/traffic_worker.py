"""The load generator's traffic worker: what runs inside each process ``lmqtt bench mqtt`` forks.

``mqtt_bench`` (the parent) plans the clients, forks ``--procs`` processes with ``worker_main``
as their target, and steps them through the phases over a pipe (see its docstring for the
protocol). Everything that runs on the child's side of that pipe lives here: ``Worker``, one
process's share of a traffic scenario on its own asyncio loop, and the small helpers only it uses.

Why a separate module: this is the code whose CPU the benchmark measures as "generator" cost, and
it runs once per generator process, so it stays light and self-contained. It imports nothing of
the parent's orchestration (broker probe, process pool, progress output, CLI); the dependency
runs one way only, ``mqtt_bench`` imports ``worker_main`` (and ``install_uvloop``, which
``run_state`` shares) from here.
"""
from __future__ import annotations

import asyncio
import contextlib
import cProfile
import gc
import os
import sys
import time

from . import paced
from .brokers import raise_nofile
from .histogram import Histogram
from .mqtt_client import MqttError, PidAllocator, Sink, StampedPublisher, connect
from .scenarios import ClientSpec, ScenarioConfig
from .stamp import Tracker
from .worker_phases import DrainWatch, cpu_split, published_report, result_report


def install_uvloop() -> bool:
    try:
        import uvloop  # the process chooses its loop, not a library import
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


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
        cpu0 = cpu_split()
        pump = asyncio.ensure_future(self._pump_sink())
        nap = self.cfg.resolved_coalesce()
        self.done = False
        if nap > 0:
            self._start_coalescing(nap)
        await self._sleep_until(t_go)
        await self._publish(t_go, t_end)
        self._send("published", published_report(self.pubs))
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
        self._send("result", result_report(self, cpu0, reads0,
                                           sum(1 for c in self.clients if c.closed.done())))
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
        watch = DrainWatch(self.tracker, totals, self.cfg)
        while True:
            self._flush_sink()
            if watch.done():
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
                # a worker the machine kept from running until after t_end still owes what was
                # due before it: one last pass at t_end sends it (late, and its latency says so)
                now = time.monotonic_ns()
                last = now >= t_end
                if last:
                    now = t_end - 1
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
                if last:
                    break
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


@contextlib.contextmanager
def _errors_to_parent(conn):
    """Around a worker's run: an exception is sent to the parent over ``conn`` (one line, type
    and message) before it ends the process, so the parent reports it instead of the worker dying
    silently; Ctrl-C ends the worker quietly."""
    try:
        yield
    except KeyboardInterrupt:
        pass
    except Exception as e:  # noqa: BLE001 - report to the parent instead of dying silently
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        raise


def worker_main(cfg: ScenarioConfig, specs: list[ClientSpec], conn, index: int, n_workers: int,
                 credit) -> None:
    raise_nofile()
    if paced.usable(cfg, specs) and not os.environ.get("LMQTT_BENCH_ASYNC_RATE"):
        # fixed rate: the lean paced loop (why: paced.py's docstring); LMQTT_BENCH_ASYNC_RATE=1
        # runs the asyncio worker instead, to compare the two generators
        with _errors_to_parent(conn):
            paced.paced_main(cfg, specs, conn, index)
        return
    install_uvloop()
    prof_dir = os.environ.get("LMQTT_BENCH_PROFILE")  # cProfile each worker into this directory
    with _errors_to_parent(conn):
        if prof_dir:  # CPU time, not wall time: the machine is usually shared
            prof = cProfile.Profile(time.process_time)
            try:
                prof.runcall(asyncio.run, Worker(cfg, specs, conn, index, n_workers, credit).run())
            finally:
                prof.dump_stats(os.path.join(prof_dir, f"worker{index}.prof"))
        else:
            asyncio.run(Worker(cfg, specs, conn, index, n_workers, credit).run())
