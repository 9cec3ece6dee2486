"""Scenario definitions: who connects, who publishes where, who expects what.

A *traffic* scenario (``fanout``, ``fanin``, ``pairs``, ``latency``, ``conn``) is a list of
``ClientSpec`` that ``mqtt_bench`` spreads over worker processes; the worker code is generic. The
two *state* scenarios (``retained``, ``persistent``) measure how fast a broker hands over stored
messages; they are sequential by nature and run in one process (``run_retained`` /
``run_persistent``).

Topics carry a per-run prefix (``lb/<run>/...``) so runs against a long-lived broker never see
each other's retained messages or sessions.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import socket
import time
from dataclasses import asdict, dataclass, field

from lmqtt.gateway.mqtt import encode, encode_publish, packets as P

from .histogram import Histogram
from .mqtt_client import PidAllocator, Sink, StampedPublisher, connect
from .stamp import Tracker, account

TRAFFIC = ("fanout", "fanin", "pairs", "latency", "conn")
STATE = ("retained", "persistent", "replay", "sessions", "million")
ALL = TRAFFIC + STATE


@dataclass
class ScenarioConfig:
    scenario: str = "fanout"
    host: str = "127.0.0.1"
    port: int = 1883
    # further MQTT ports of the same broker (gateways of a fleet): publisher i connects to
    # all_ports[i % n], subscriber j to all_ports[(j + 1) % n], so with two gateways a pair's
    # messages always cross from one to the other
    ports: tuple = ()
    version: int = 4            # amqtt speaks 3.1.1 only, so comparisons use 4
    qos: int = 0
    size: int = 64
    duration: float = 10.0      # publish phase, seconds
    rate: float | None = None   # total msg/s over all publishers; None = flat out
    window: int = 10            # max unacknowledged QoS 1/2 messages per publisher
    lead: int | None = None     # flat out: max messages a publisher runs ahead of its slowest
                                # subscriber (closed loop); 0 = open loop; None = auto
    publishers: int = 1
    subscribers: int = 1
    connections: int = 1000     # conn; sessions: persistent clients
    topics: int = 1000          # retained: M retained topics
    backlog: int = 10000        # persistent: K queued messages
    procs: int = 2
    coalesce_ms: float | None = None  # flat out: sleep per loop iteration so reads batch up;
                                      # None = auto (see resolved_coalesce), 0 = off
    hold: float = 2.0           # conn: idle time before sampling broker memory
    drain_idle: float = 1.5     # stop waiting for deliveries after this long without any
    drain_max: float = 20.0     # ... and never wait longer than this after the publish phase
    connect_timeout: float = 120.0
    tls_ca: str | None = None   # connect over TLS trusting this CA file (bench compare --tls)
    username: str | None = None  # CONNECT credentials (bench compare --password)
    password: str | None = None
    run_id: str = field(default_factory=lambda: f"{os.getpid():x}{int(time.time()) % 100000:x}")
    # pairs: the first levels of the pairs' topics, taken in turn (pair i: roots[i % n]); a
    # gateway over several store groups stores each first level in one group (docs/groups.md)
    roots: tuple = ()

    def to_params(self) -> dict:
        d = asdict(self)
        for k in ("host", "port", "ports", "run_id", "drain_idle", "drain_max", "connect_timeout", "password"):
            d.pop(k)
        d["tls"] = bool(d.pop("tls_ca"))
        return d


    def port_for(self, role: str, index: int) -> int:
        if not self.ports:
            return self.port
        every = (self.port, *self.ports)
        return every[(index + (1 if role == "sub" else 0)) % len(every)]

    def resolved_coalesce(self) -> float:
        """Seconds a worker naps per event-loop iteration when flat out; never at a fixed rate.

        Default 5 ms; fan-out 20 ms and fan-in 10 ms (``defaults_for``): the more sockets a
        delivery stream is spread over, the longer a nap it takes before reads hold several
        messages. The closed loop bounds what a nap can cost in throughput: ``lead`` and the
        QoS 1 window must cover about two naps of the broker's rate.
        """
        if self.rate:
            return 0.0
        if self.coalesce_ms is not None:
            return max(0.0, self.coalesce_ms) / 1e3
        return 0.005

    def resolved_lead(self) -> int:
        """Auto lead: about 10,000 deliveries outstanding in total, at least 2 windows.

        Enough to cover the 10 ms feedback loop at millions of deliveries per second, small
        enough that latency measures the broker and not a queue we built on purpose.
        """
        if self.lead is not None:
            return self.lead
        fan = self.subscribers if self.scenario == "fanout" else 1
        return max(2 * self.window, 10_000 // max(1, self.publishers * fan))


@dataclass
class ClientSpec:
    role: str               # "pub" | "sub" | "idle"
    client_id: str
    topic: str = ""         # publish topic or subscription filter
    pub_id: int = -1
    sub_id: int = -1
    expects: list[int] = field(default_factory=list)


def defaults_for(scenario: str) -> dict:
    """The target settings per scenario (CLI flags override)."""
    return {
        # coalesce_ms: see ScenarioConfig.resolved_coalesce (measured against Mosquitto, docs)
        "fanout": {"publishers": 1, "subscribers": 1000, "qos": 0, "coalesce_ms": 20.0},
        "fanin": {"publishers": 1000, "subscribers": 1, "qos": 1, "coalesce_ms": 10.0},
        "pairs": {"publishers": 100, "subscribers": 100, "qos": 1},
        "latency": {"publishers": 50, "subscribers": 50, "qos": 1, "rate": 5000.0},
        # held idle 6 s before memory is sampled: past `park_idle_after_s` (2 s) and its next check,
        # so the figure is that of idle connections (gateway/net/parking.py), not of fresh ones
        "conn": {"connections": 10000, "hold": 6.0},
        "retained": {"topics": 1000, "qos": 1},
        "persistent": {"backlog": 10000, "qos": 1},
        "replay": {"backlog": 100000, "qos": 0},
        "sessions": {"connections": 2000, "qos": 1},
        # loadtest/million_bench.py: held for `hold` s; connecting them all bounded by connect_timeout
        "million": {"connections": 1_000_000, "hold": 10.0, "connect_timeout": 600.0},
    }.get(scenario, {})


def plan(cfg: ScenarioConfig) -> list[ClientSpec]:
    r = f"lb/{cfg.run_id}"
    s = cfg.scenario
    if s == "fanout":
        pubs = [ClientSpec("pub", f"{r}-p0", f"{r}/fan", pub_id=0)]
        subs = [ClientSpec("sub", f"{r}-s{i}", f"{r}/fan", sub_id=i, expects=[0])
                for i in range(cfg.subscribers)]
    elif s == "fanin":
        # fixed-width topic numbers: every PUBLISH the subscriber receives has the same shape,
        # so the generator's fast receive path applies (see mqtt_client.Client.data_received)
        w = len(str(max(0, cfg.publishers - 1)))
        pubs = [ClientSpec("pub", f"{r}-p{i}", f"{r}/in/{i:0{w}d}", pub_id=i)
                for i in range(cfg.publishers)]
        subs = [ClientSpec("sub", f"{r}-s{j}", f"{r}/in/+", sub_id=j, expects=list(range(cfg.publishers)))
                for j in range(cfg.subscribers)]
    elif s in ("pairs", "latency"):
        n = cfg.publishers
        roots = cfg.roots or ("lb",)
        t = [f"{roots[i % len(roots)]}/{cfg.run_id}/pair/{i}" for i in range(n)]
        pubs = [ClientSpec("pub", f"{r}-p{i}", t[i], pub_id=i) for i in range(n)]
        subs = [ClientSpec("sub", f"{r}-s{i}", t[i], sub_id=i, expects=[i]) for i in range(n)]
    elif s == "conn":
        # an idle device: CONNECT, then SUBSCRIBE to a topic of its own (the measure of
        # memory per idle connection), then silence
        return [ClientSpec("sub", f"{r}-c{i}", f"{r}/idle/{i}", sub_id=i) for i in range(cfg.connections)]
    else:
        raise ValueError(f"{s!r} is not a traffic scenario; traffic scenarios: {', '.join(TRAFFIC)}")
    # subscribers first: they are connected and subscribed before any publisher sends
    return subs + pubs


def partition(specs: list[ClientSpec], procs: int) -> list[list[ClientSpec]]:
    """Spread clients over processes so no process carries a disproportionate load.

    Round-robin per role (subscribers first, then the others), so a fan-in's lone subscriber
    shares its process with a fair share of the publishers: with the fast receive path it
    costs ~1-2 µs per message, less than the publishers' side of each message, so giving it
    a process of its own left that process mostly idle and the other one doing everything.
    """
    procs = max(1, procs)
    subs = [sp for sp in specs if sp.role == "sub"]
    others = [sp for sp in specs if sp.role != "sub"]
    parts: list[list[ClientSpec]] = [[] for _ in range(procs)]
    for i, sp in enumerate(subs):
        parts[i % procs].append(sp)
    # publishers continue the round-robin where the subscribers stopped, so with fewer
    # subscribers than processes the subscriber-less processes get the first publishers
    for i, sp in enumerate(others):
        parts[(len(subs) + i) % procs].append(sp)
    return [p for p in parts if p]


# -- state scenarios (one process, sequential phases) -------------------------------------------

async def _publish_all(cfg: ScenarioConfig, topics: list[str], retain: bool) -> int:
    """Publish one stamped message per topic (QoS 1, acknowledged) from one connection."""
    c = await connect(cfg.host, cfg.port, f"lb-{cfg.run_id}-loader", cfg.version)
    try:
        done = asyncio.get_running_loop().create_future()
        left = [len(topics)]

        def on_acks(n: int) -> None:
            left[0] -= n
            if left[0] <= 0 and not done.done():
                done.set_result(None)

        c.on_acks = on_acks
        pid = 0
        for i, t in enumerate(topics):
            sp = StampedPublisher(i if retain else 0, t, cfg.size, 1, cfg.version, retain=retain)
            pid = pid % 0xFFFF + 1
            while pid in c.inflight:
                await asyncio.sleep(0.001)
            c.inflight.add(pid)
            c.transport.write(sp.batch(0 if retain else i, [pid], 1))
            if len(c.inflight) >= 500 or c.paused:
                while len(c.inflight) >= 100 or c.paused:
                    await asyncio.sleep(0.001)
        if topics:
            await asyncio.wait_for(done, 60)
        return len(topics)
    finally:
        c.disconnect()


async def _wait_deliveries(sink: Sink, tracker: Tracker, hist: Histogram, want: int,
                           cfg: ScenarioConfig) -> tuple[int, int]:
    """Pump the sink into the tracker until ``want`` unique messages or idle/deadline."""
    got = 0
    deadline = time.monotonic() + cfg.drain_max + cfg.duration
    last_progress = time.monotonic()
    while time.monotonic() < deadline:
        lat = sink.take_latencies()
        if lat:
            last_progress = time.monotonic()
            hist.record_many(lat)
        got = sum(st.unique for st in tracker.streams.values())
        if got >= want or time.monotonic() - last_progress > max(cfg.drain_idle, 3.0):
            break
        await asyncio.sleep(0.005)
    return got, sink.last_ns


async def run_retained(cfg: ScenarioConfig) -> dict:
    """M retained topics, then one wildcard subscriber: time until all M arrived."""
    r = f"lb/{cfg.run_id}/ret"
    topics = [f"{r}/{i}" for i in range(cfg.topics)]
    await _publish_all(cfg, topics, retain=True)
    tracker, hist = Tracker(), Histogram()
    sink = Sink(tracker)
    for i in range(cfg.topics):
        tracker.expect(0, i)
    t0 = time.monotonic_ns()
    c = await connect(cfg.host, cfg.port, f"lb-{cfg.run_id}-rsub", cfg.version, sub_id=0, sink=sink)
    try:
        await c.subscribe(f"{r}/#", cfg.qos)
        got, last_ns = await _wait_deliveries(sink, tracker, hist, cfg.topics, cfg)
    finally:
        c.disconnect()
    totals = account({int(k): v for k, v in tracker.to_dict().items()}, {i: 1 for i in range(cfg.topics)})
    elapsed = max(1, last_ns - t0) / 1e9 if got else None
    # clear the retained messages (empty retained payload) so the broker is left as found
    await _clear_retained(cfg, topics)
    return {"sent": cfg.topics, **totals, "elapsed_s": elapsed and round(elapsed, 4),
            "delivered_per_s": round(got / elapsed, 1) if got else 0.0,
            "histogram": hist}


async def _clear_retained(cfg: ScenarioConfig, topics: list[str]) -> None:
    c = await connect(cfg.host, cfg.port, f"lb-{cfg.run_id}-clr", cfg.version)
    try:
        c.transport.write(b"".join(encode_publish(t, b"", 0, True, False, None, None, cfg.version)
                                   for t in topics))
        await asyncio.sleep(0.2)
    finally:
        c.disconnect()


async def _publish_backlog(cfg: ScenarioConfig, topic: str, n: int) -> int:
    """One publisher, `n` QoS 1 messages with seq 0..n-1 (publisher id 0), 200 in flight; returns
    how many were sent (bounded by time)."""
    pub = await connect(cfg.host, cfg.port, f"lb-{cfg.run_id}-ppub", cfg.version)
    sp = StampedPublisher(0, topic, cfg.size, 1, cfg.version)
    alloc = PidAllocator(pub.inflight)
    seq = 0
    t_pub = time.monotonic()
    while seq < n:
        room = min(200 - len(pub.inflight), n - seq)
        if room > 0 and not pub.paused:
            pids = alloc.take(room)
            pub.transport.write(sp.batch(seq, pids, room))
            seq += room
        await asyncio.sleep(0.001)
        if time.monotonic() - t_pub > cfg.drain_max * 5:
            break
    while pub.inflight and time.monotonic() - t_pub < cfg.drain_max * 5:
        await asyncio.sleep(0.005)
    pub.disconnect()
    return seq


async def run_replay(cfg: ScenarioConfig) -> dict:
    """lmqtt only (subscribing from the past, docs/gateway.md): K messages stored while nobody
    subscribed, then one subscriber asks for `$replay/{t0}/{filter}` with a wildcard filter never
    subscribed before (so the history is read from the log) at `cfg.qos`: time until all K arrived."""
    base = f"lb/{cfg.run_id}/rp"
    since_ms = int(time.time() * 1000) - 1000
    seq = await _publish_backlog(cfg, f"{base}/x", cfg.backlog)
    tracker, hist = Tracker(), Histogram()
    sink = Sink(tracker)
    tracker.expect(0, 0)
    probe = IdleProbe(cfg)
    async with probe:
        t0 = time.monotonic_ns()
        c = await connect(cfg.host, cfg.port, f"lb-{cfg.run_id}-rpsub", cfg.version, sub_id=0, sink=sink)
        try:
            await c.subscribe(f"$replay/{since_ms}/{base}/+", cfg.qos)
            got, last_ns = await _wait_deliveries(sink, tracker, hist, seq, cfg)
        finally:
            c.disconnect()
    totals = account({int(k): v for k, v in tracker.to_dict().items()}, {0: seq})
    elapsed = max(1, last_ns - t0) / 1e9 if got else None
    return {"sent": seq, **totals, "elapsed_s": elapsed and round(elapsed, 4),
            "delivered_per_s": round(got / elapsed, 1) if got else 0.0, **probe.summary(), "histogram": hist}


async def run_persistent(cfg: ScenarioConfig) -> dict:
    """An offline QoS 1 session collects K messages; time to receive them on reconnect."""
    topic = f"lb/{cfg.run_id}/persist"
    cid = f"lb-{cfg.run_id}-psub"
    expiry = 3600 if cfg.version == 5 else None
    c = await connect(cfg.host, cfg.port, cid, cfg.version, clean=False, session_expiry=expiry)
    await c.subscribe(topic, cfg.qos)
    c.disconnect()
    await asyncio.sleep(0.2)
    seq = await _publish_backlog(cfg, topic, cfg.backlog)
    tracker, hist = Tracker(), Histogram()
    sink = Sink(tracker)
    tracker.expect(0, 0)
    probe = IdleProbe(cfg)
    async with probe:
        t0 = time.monotonic_ns()
        c = await connect(cfg.host, cfg.port, cid, cfg.version, clean=False, session_expiry=expiry,
                          sub_id=0, sink=sink)
        try:
            got, last_ns = await _wait_deliveries(sink, tracker, hist, seq, cfg)
        finally:
            c.disconnect()
    # remove the session
    c2 = await connect(cfg.host, cfg.port, cid, cfg.version, clean=True, session_expiry=0 if expiry else None)
    c2.disconnect()
    totals = account({int(k): v for k, v in tracker.to_dict().items()}, {0: seq})
    elapsed = max(1, last_ns - t0) / 1e9 if got else None
    return {"sent": seq, **totals, "elapsed_s": elapsed and round(elapsed, 4),
            "session_present": c.connack.session_present,
            "delivered_per_s": round(got / elapsed, 1) if got else 0.0, **probe.summary(), "histogram": hist}


SESSION_STORM_CONCURRENCY = 200     # clients connecting at once in `sessions`


class IdleProbe:
    """An idle client sending PINGREQ every 5 ms from a process of its own (the generator's loop
    is busy with the scenario) while the `async with` block runs: how long it waits for PINGRESP
    is how long the broker kept its other clients waiting (a loop stalled on the store, a long
    run of work without a break)."""

    def __init__(self, cfg: ScenarioConfig) -> None:
        self.cfg = cfg
        self.rtts: list[int] = []

    async def __aenter__(self) -> "IdleProbe":
        cfg = self.cfg
        ctx = multiprocessing.get_context("fork")
        self._stop = ctx.Event()
        self._back, out = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_ping_until, args=(cfg.host, cfg.port, f"lb-{cfg.run_id}-probe",
                                                           cfg.version, self._stop, out), daemon=True)
        self._proc.start()
        ready = await asyncio.get_running_loop().run_in_executor(None, self._back.recv)
        if ready != "connected":
            self._proc.join(5)
            raise RuntimeError(f"{cfg.scenario}: the idle client could not connect: {ready}")
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        rtts = await asyncio.get_running_loop().run_in_executor(None, self._back.recv)
        self._proc.join(5)
        if isinstance(rtts, str):
            raise RuntimeError(f"{self.cfg.scenario}: the idle client failed: {rtts}")
        self.rtts = rtts

    def histogram(self) -> Histogram:
        h = Histogram()
        h.record_many(self.rtts)
        return h

    def summary(self) -> dict:
        """`idle_ping_*`: the PINGRESP wait while the scenario ran (p99 and max, ms)."""
        h = self.histogram()
        p99 = h.percentile(99.0)
        return {"idle_pings": len(self.rtts),
                "idle_ping_p99_ms": None if p99 is None else round(p99 / 1e6, 2),
                "idle_ping_max_ms": round(max(self.rtts) / 1e6, 2) if self.rtts else None}


async def run_sessions(cfg: ScenarioConfig) -> dict:
    """A reconnect storm of persistent sessions, as after a gateway restart or a network outage:
    `connections` clients each CONNECT with a persistent session (3.1.1 clean session 0, MQTT 5 an
    hour's expiry) and SUBSCRIBE to a wildcard filter of their own (`.../dev/{i}/+`), 200 at a
    time, and disconnect; then all of them again, resuming their sessions. Meanwhile an idle client
    sends PINGREQ every 5 ms from a process of its own (this one's loop is busy with the storm): its
    wait for PINGRESP (the histogram) is how long the broker kept everyone else waiting. The
    sessions are removed afterwards."""
    r = f"lb/{cfg.run_id}/dev"
    expiry = 3600 if cfg.version == 5 else None
    n = cfg.connections
    probe = IdleProbe(cfg)

    async def storm(clean: bool, subscribe: bool) -> tuple[float, int]:
        sem = asyncio.Semaphore(SESSION_STORM_CONCURRENCY)
        present = 0

        async def one(i: int) -> None:
            nonlocal present
            async with sem:
                c = await connect(cfg.host, cfg.port, f"lb-{cfg.run_id}-d{i}", cfg.version, clean=clean,
                                  session_expiry=(0 if clean else expiry) if expiry else None,
                                  timeout=cfg.connect_timeout)
                present += bool(c.connack.session_present)
                if subscribe:
                    await c.subscribe(f"{r}/{i}/+", cfg.qos, timeout=cfg.connect_timeout)
                c.disconnect()
        t0 = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(n)))
        return time.monotonic() - t0, present

    async with probe:
        new_s, _ = await storm(False, True)
        resume_s, present = await storm(False, True)
    hist = probe.histogram()
    await storm(True, False)                 # the sessions go
    return {"sessions": n, "new_s": round(new_s, 3), "new_per_s": round(n / new_s, 1),
            "resume_s": round(resume_s, 3), "resume_per_s": round(n / resume_s, 1),
            "session_present": present, "pings": hist.total, "histogram": hist}


def _ping_until(host: str, port: int, client_id: str, version: int, stop, out) -> None:
    """The `sessions` idle client (a forked process with a blocking socket): CONNECT, then PINGREQ
    every 5 ms until `stop`; sends "connected" (or the error), then the round trips in ns."""
    try:
        sock = socket.create_connection((host, port), timeout=30)
        sock.sendall(encode(P.Connect(client_id, version, True, 600), version))
        first = sock.recv(64)
        if first[:1] != b"\x20":
            raise ConnectionError(f"no CONNACK: the broker answered {first[:16]!r}"
                                  if first else "no CONNACK: the broker closed the connection")
        out.send("connected")
        rtts = []
        ping = encode(P.PingReq(), version)
        while not stop.is_set():
            t0 = time.monotonic_ns()
            sock.sendall(ping)
            if len(sock.recv(2)) < 2:                  # PINGRESP is two bytes
                raise ConnectionError("closed by the broker")
            rtts.append(time.monotonic_ns() - t0)
            time.sleep(0.005)
        sock.close()
        out.send(rtts)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the scenario
        out.send(f"{type(e).__name__}: {e}")
