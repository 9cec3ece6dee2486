"""Fixed-rate traffic (``--rate``, the ``latency`` scenario): a lean, paced, synchronous worker.

Why not the asyncio ``Worker`` of ``traffic_worker``: at 5,000 msg/s over 50 QoS 1 pairs it
measured itself. Mosquitto's p50/p99 came out at 0.73 / 4.9 ms on a quiet machine (loaded:
1.8 ms p99), where an independent harness measured about 0.12 / 0.4 ms (``loadtest/c/
latency_harness.c``: 0.04 / 0.2-0.3 ms at load 3; this worker: 0.04 ms p50). Three causes, each
fixed here:

* **Bursts.** The asyncio worker woke every 5 ms and wrote every publisher's due messages at
  once: 25 messages reached the broker together and the last of them queued behind the other 24
  in the broker *and* in the generator's own receive loop. Here every message has its own slot on
  one schedule shared by all worker processes (message ``s`` of the run is due at
  ``t_go + s / rate`` and belongs to publisher ``s % publishers``), so the broker sees one
  message every 200 µs, as from 50 independent devices. The wait for the next slot is a
  CLOCK_MONOTONIC timerfd armed at the slot's absolute time, one more descriptor of the epoll set
  (``epoll``'s own timeout and the asyncio loops' timers are whole milliseconds; Python 3.11 has no
  ``os.timerfd_*``, so it goes through ctypes).
* **Receive timestamps taken after the generator's own work.** ``data_received`` ran after the
  loop had served other sockets and timers of the same iteration, and its timestamp included
  that wait. Here subscriber sockets have ``SO_TIMESTAMPNS``: ``recvmsg`` returns the kernel's
  time of arrival on the socket, which is when the broker's delivery reached the subscriber,
  whatever the generator was doing. (It is CLOCK_REALTIME; it is converted to the stamps'
  CLOCK_MONOTONIC with an offset read at each wake-up, two clock reads apart. Where the kernel
  gives none, the time right after ``recvmsg`` is used.) A read holding several deliveries is
  timed by its last segment: conservative.
* **A heavy client path.** No event loop, futures, transports or callbacks: blocking handshakes,
  then non-blocking sockets, one ``epoll`` wait per wake-up, ``recvmsg`` and ``send`` directly. The
  packet parsing and accounting are ``mqtt_client.Client``'s (the same fast paths and checks as
  every other scenario), fed by this loop instead of asyncio.

What it costs: ~90 µs of CPU per message (four socket calls and the Python around them), 0.45
cores at 5,000 msg/s; on two busy cores that competes with the broker, and the C harness (28 µs)
disturbs it less: compare the two when the tail matters (BENCHMARKS.md).

A message is stamped just before its ``send``; a QoS 1/2 publisher whose window is full sends
late rather than early (``behind_schedule`` counts it, as in the asyncio worker). The parent
side and the pipe protocol are unchanged (``mqtt_bench``): hello → connect → ready → go →
published → drain → result → stop; the pipe is one more descriptor of the epoll set, so
sockets are served while the parent is waited for.

Used for ``--rate`` runs over plain TCP; TLS keeps the asyncio worker (an SSL socket's buffered
records do not show as readable descriptors), and ``LMQTT_BENCH_ASYNC_RATE=1`` forces it.
"""
from __future__ import annotations

import asyncio
import cProfile
import ctypes
import gc
import os
import select
import socket
import struct
import time

from lmqtt.gateway.mqtt import encode, packets as P

from .histogram import Histogram
from .mqtt_client import Client, MqttError, PidAllocator, Sink, StampedPublisher
from .scenarios import ClientSpec, ScenarioConfig
from .stamp import Tracker
from .worker_phases import DrainWatch, cpu_split, published_report, result_report

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux; SCM_TIMESTAMPNS has the same value
_TIMESPEC = struct.Struct("@qq")
_monotonic_ns = time.monotonic_ns
# LMQTT_BENCH_RX_CLOCK=user: time deliveries after recvmsg returns, as a client library would see
# them (to compare with the kernel's arrival time, the default)
_KERNEL_RX = os.environ.get("LMQTT_BENCH_RX_CLOCK", "kernel") != "user"
_time_ns = time.time_ns


def usable(cfg: ScenarioConfig, specs: list[ClientSpec]) -> bool:
    """Whether this worker's share can run paced (fixed rate, plain TCP)."""
    return bool(cfg.rate) and not cfg.tls_ca


class _SockTransport:
    """What ``Client`` writes its acks to: a non-blocking ``send``, buffering what did not fit."""

    __slots__ = ("sock", "out", "closing")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.out, self.closing = sock, b"", False

    def write(self, data) -> None:
        if self.closing:
            return
        if self.out:
            self.out += bytes(data)
            return
        try:
            n = self.sock.send(data)
        except BlockingIOError:
            n = 0
        except OSError:
            self.closing = True
            return
        if n < len(data):
            self.out = bytes(data[n:])

    def flush(self) -> None:
        try:
            n = self.sock.send(self.out)
        except BlockingIOError:
            return
        except OSError:
            self.closing = True
            self.out = b""
            return
        self.out = self.out[n:]

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True
        try:
            self.sock.close()
        except OSError:
            pass


def schedule(pub_ids: list[int], publishers: int, rate: float, t_go: int):
    """This process's send slots, ``(t_ns, pub_id)`` in time order, forever.

    One schedule for the whole run, shared by every process without talking: message ``s`` is due
    at ``t_go + s / rate`` and belongs to publisher ``s % publishers``; a process takes the slots
    of the publishers it holds. Together the processes send one message every ``1 / rate``
    seconds, each publisher every ``publishers / rate``: no bursts.
    """
    n = max(1, publishers)
    interval = 1e9 / rate
    offsets = sorted({p % n for p in pub_ids})
    owner = {p % n: p for p in pub_ids}
    base = 0
    while True:
        for off in offsets:
            yield t_go + int((base + off) * interval), owner[off]
        base += n


class _timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _timespec), ("it_value", _timespec)]


class _Timer:
    """A CLOCK_MONOTONIC timerfd armed at absolute times (ns): the pacing clock, in the epoll set.

    Python 3.11 has no ``os.timerfd_*`` (3.13 does), so this goes through ctypes; ``fd`` is -1
    where that fails, and the loop then waits with epoll's millisecond timeouts.
    """

    def __init__(self) -> None:
        self.fd = -1
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            self._settime = libc.timerfd_settime
            fd = libc.timerfd_create(time.CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError):
            return
        if fd >= 0:
            self.fd = fd
            self._spec = _itimerspec()
            self._ref = ctypes.byref(self._spec)

    def arm(self, t_ns: int) -> None:
        """Fire at ``t_ns`` (at once if that has passed); re-arming also clears a past expiry."""
        v = self._spec.it_value
        v.tv_sec, v.tv_nsec = divmod(max(t_ns, 1), 1_000_000_000)
        self._settime(self.fd, 1, self._ref, None)  # TFD_TIMER_ABSTIME

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _Pub:
    __slots__ = ("client", "tr", "sp", "alloc", "seq", "owed", "behind")

    def __init__(self, client: Client, sp: StampedPublisher, alloc) -> None:
        self.client, self.tr, self.sp, self.alloc = client, client.transport, sp, alloc
        self.seq = self.owed = self.behind = 0


class PacedWorker:
    """One process's share of a fixed-rate traffic scenario (see the module docstring)."""

    def __init__(self, cfg: ScenarioConfig, specs: list[ClientSpec], conn, index: int = 0) -> None:
        self.cfg, self.specs, self.conn, self.index = cfg, specs, conn, index
        self.tracker = Tracker()
        self.sink = Sink(self.tracker)
        self.hist = Histogram()
        self.clients: list[Client] = []
        self.by_fd: dict[int, tuple[Client, socket.socket]] = {}
        self.pubs: list[_Pub] = []
        self.writes = 0
        self.errors: list[str] = []
        self.failed = 0
        self.inbox: list = []
        self.stopped = False
        self.kernel_stamps = 0  # reads timed by the kernel (SO_TIMESTAMPNS)

    # -- pipe ------------------------------------------------------------------------------------
    def _send(self, *msg) -> None:
        self.conn.send(msg)

    def _read_pipe(self) -> None:
        try:
            while self.conn.poll():
                msg = self.conn.recv()
                if msg[0] == "stop":
                    self.stopped = True
                self.inbox.append(msg)
        except (EOFError, OSError):
            self.stopped = True
            self.inbox.append(("stop",))

    def _take(self, name: str):
        for i, msg in enumerate(self.inbox):
            if msg[0] == name or msg[0] == "stop":
                return self.inbox.pop(i)
        return None

    # -- connections -----------------------------------------------------------------------------
    def _handshake(self, sp: ClientSpec) -> None:
        cfg = self.cfg
        role_port = cfg.port_for("sub", sp.sub_id) if sp.role == "sub" else cfg.port_for("pub", max(sp.pub_id, 0))
        sock = socket.create_connection((cfg.host, role_port), timeout=cfg.connect_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c = Client(sp.client_id, cfg.version, sub_id=sp.sub_id,
                       sink=self.sink if sp.role == "sub" else None)
            tr = _SockTransport(sock)
            c.connection_made(tr)
            fut = c.expect("ConnAck")
            sock.sendall(encode(P.Connect(sp.client_id, cfg.version, True, 300, cfg.username,
                                          cfg.password.encode() if cfg.password is not None else None),
                                cfg.version))
            self._wait(c, sock, fut)
            ack = fut.result()
            if ack.reason_code != 0:
                raise MqttError(f"{sp.client_id}: CONNACK refused with code {ack.reason_code:#x}")
            if sp.role == "sub":
                fut = c.expect("SubAck")
                sock.sendall(encode(P.Subscribe(1, [P.SubscriptionRequest(sp.topic, cfg.qos)]), cfg.version))
                self._wait(c, sock, fut)
                sub = fut.result()
                if not sub.reason_codes or sub.reason_codes[0] >= 0x80:
                    raise MqttError(f"{sp.client_id}: SUBACK rejected {sp.topic!r}: {sub.reason_codes}")
                for p in sp.expects:
                    self.tracker.expect(sp.sub_id, p)
                sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            elif sp.role == "pub":
                self.pubs.append(_Pub(c, StampedPublisher(sp.pub_id, sp.topic, cfg.size, cfg.qos, cfg.version),
                                      PidAllocator(c.inflight)))
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.clients.append(c)
        self.by_fd[sock.fileno()] = (c, sock)

    @staticmethod
    def _wait(c: Client, sock: socket.socket, fut) -> None:
        while not fut.done():
            data = sock.recv(65536)
            if not data:
                raise MqttError(f"{c.client_id}: connection closed by the broker during the handshake")
            c.data_received(data)
            if c.error:
                raise MqttError(f"{c.client_id}: {c.error}")

    def _connect_all(self) -> None:
        for sp in self.specs:
            try:
                self._handshake(sp)
            except (OSError, MqttError) as e:
                if len(self.errors) < 5:
                    self.errors.append(f"{sp.client_id}: {type(e).__name__}: {e}")
                self.failed += 1

    # -- the loop ----------------------------------------------------------------------------------
    def _poll(self, timeout: float | None) -> None:
        """One wake-up: wait for sockets, the pipe or the pacing timer (``timeout`` s at most, None:
        until something is ready), then serve what is ready."""
        try:
            events = self._ep.poll(-1 if timeout is None else max(timeout, 0.0), 64)
        except InterruptedError:
            return
        if not events:
            return
        off = _time_ns() - _monotonic_ns()
        by_fd = self.by_fd
        for fd, ev in events:
            ent = by_fd.get(fd)
            if ent is None:
                if fd == self._pipe_fd:
                    self._read_pipe()
                continue  # the pacing timer: the caller looks at the clock
            c, sock = ent
            if ev & select.EPOLLOUT:
                c.transport.flush()
                if not c.transport.out:
                    self._ep.modify(fd, select.EPOLLIN)
            if not ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                continue
            try:
                data, anc, _flags, _addr = sock.recvmsg(65536, 64)
            except BlockingIOError:
                continue
            except OSError as e:
                self._lost(fd, c, e)
                continue
            if not data:
                self._lost(fd, c, None)
                continue
            if anc and _KERNEL_RX:
                self.kernel_stamps += 1
                s, ns = _TIMESPEC.unpack_from(anc[0][2])
                c.rx_ns = s * 1_000_000_000 + ns - off
            else:
                c.rx_ns = _monotonic_ns()
            c.data_received(data)
            if c.transport.out:
                self._ep.modify(fd, select.EPOLLIN | select.EPOLLOUT)

    def _lost(self, fd: int, c: Client, exc) -> None:
        del self.by_fd[fd]
        try:
            self._ep.unregister(fd)
        except OSError:
            pass
        c.transport.close()
        c.connection_lost(exc)
        if exc is not None and not c.error:
            c.error = f"{c.client_id}: {type(exc).__name__}: {exc}"

    def _wait_for(self, name: str, deadline: float | None = None):
        """Serve sockets until the parent's ``name`` (or "stop") arrives; None at ``deadline``."""
        while True:
            msg = self._take(name)
            if msg is not None:
                return msg
            if deadline is not None and time.monotonic() >= deadline:
                return None
            self._poll(0.01)
            self._flush_sink()

    def _flush_sink(self) -> None:
        lat = self.sink.take_latencies()
        if lat:
            self.hist.record_many(lat)

    def _publish(self, t_go: int, t_end: int) -> None:
        cfg = self.cfg
        qos, window = cfg.qos, cfg.window
        pubs = sorted(self.pubs, key=lambda p: p.sp.pub_id)
        if not pubs:
            while _monotonic_ns() < t_end and not self.stopped:
                self._poll(min(0.01, (t_end - _monotonic_ns()) / 1e9))
                self._flush_sink()
            return
        by_id = {p.sp.pub_id: p for p in pubs}
        slots = schedule(list(by_id), cfg.publishers, cfg.rate, t_go)
        next_t, next_pub = next(slots)
        owing: list[_Pub] = []
        poll = self._poll
        timer = self._timer
        armed = -1
        while not self.stopped:
            # past t_end, one last pass still sends what fell due before it (a process the
            # machine held back until then sends late, and its latency says so)
            now = _monotonic_ns()
            last = now >= t_end
            while next_t <= now and next_t < t_end:
                p = by_id[next_pub]
                if not p.owed:
                    owing.append(p)
                p.owed += 1
                next_t, next_pub = next(slots)
            if owing:
                still = []
                for p in owing:
                    n = p.owed
                    if qos:
                        room = window - len(p.client.inflight)
                        if room < n:
                            p.behind = max(p.behind, n - max(room, 0))
                            n = room
                    if n > 0 and not p.tr.closing:
                        pids = p.alloc.take(n) if qos else None
                        p.tr.write(p.sp.batch(p.seq, pids, n))
                        p.seq += n
                        p.owed -= n
                        self.writes += 1
                    if p.owed and not p.tr.closing:
                        still.append(p)
                    else:
                        p.owed = 0
                owing = still
            if last:
                break
            wake = next_t if next_t < t_end else t_end
            if owing:  # a full window: look again when acks may have come
                wake = min(wake, _monotonic_ns() + 1_000_000)
            if timer.fd >= 0:
                if wake != armed:
                    timer.arm(wake)
                    armed = wake
                poll(None)
            else:
                poll((wake - _monotonic_ns()) / 1e9)
            if len(self.sink.lat) >= 4096:
                self._flush_sink()
        # wait (bounded) for the acks of what was sent
        deadline = time.monotonic() + cfg.drain_max
        while time.monotonic() < deadline and not self.stopped and any(
                p.client.inflight for p in self.pubs if not p.tr.closing):
            poll(0.01)
        self._flush_sink()

    def _drain(self, totals: dict[int, int]) -> None:
        watch = DrainWatch(self.tracker, totals, self.cfg)
        while not self.stopped:
            self._flush_sink()
            if watch.done():
                return
            self._poll(0.02)

    def _close(self) -> None:
        for c in self.clients:
            tr = c.transport
            if not tr.closing:
                try:
                    tr.sock.setblocking(True)
                    tr.sock.settimeout(1.0)
                    tr.sock.sendall(encode(P.Disconnect(), self.cfg.version))
                except OSError:
                    pass
                tr.close()

    def run(self) -> None:
        self._pipe_fd = self.conn.fileno()
        self._send("hello", os.getpid())
        msg = self.conn.recv()
        while msg[0] not in ("connect", "stop"):
            msg = self.conn.recv()
        if msg[0] == "stop":
            return
        t0 = time.monotonic_ns()
        self._connect_all()
        t1 = time.monotonic_ns()
        self._ep = select.epoll()
        self._ep.register(self._pipe_fd, select.EPOLLIN)
        for fd in self.by_fd:
            self._ep.register(fd, select.EPOLLIN)
        self._timer = _Timer()
        if self._timer.fd >= 0:
            self._ep.register(self._timer.fd, select.EPOLLIN)
        self._send("ready", {"t_start": t0, "t_done": t1, "connected": len(self.clients),
                             "failed": self.failed, "errors": self.errors})
        try:
            msg = self._wait_for("go")
            if msg[0] == "stop":
                return
            _, t_go, t_end = msg
            gc.collect()
            gc.freeze()  # the connections and plans are long-lived: keep them out of every GC pass
            reads0 = sum(c.reads for c in self.clients)
            cpu0 = cpu_split()
            self._publish(t_go, t_end)
            self._send("published", published_report(self.pubs))
            msg = self._wait_for("drain")
            if msg[0] == "stop":
                return
            self._drain(msg[1])
            self._flush_sink()
            result = result_report(self, cpu0, reads0, sum(1 for c in self.clients if c.transport.closing))
            result["rx_kernel_stamps"] = self.kernel_stamps  # reads timed by the kernel
            self._send("result", result)
            self._wait_for("stop")
        finally:
            self._close()
            if getattr(self, "_timer", None) is not None:
                self._timer.close()


def paced_main(cfg: ScenarioConfig, specs: list[ClientSpec], conn, index: int) -> None:
    """Entry point in a worker process (``traffic_worker.worker_main`` picks it for ``usable``)."""
    # Client objects make a future each (their ``closed``); give them a loop that never runs
    asyncio.set_event_loop(asyncio.new_event_loop())
    w = PacedWorker(cfg, specs, conn, index)
    prof_dir = os.environ.get("LMQTT_BENCH_PROFILE")  # cProfile each worker into this directory
    if not prof_dir:
        w.run()
        return
    prof = cProfile.Profile(time.process_time)
    try:
        prof.runcall(w.run)
    finally:
        prof.dump_stats(os.path.join(prof_dir, f"worker{index}.prof"))
