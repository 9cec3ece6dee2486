"""First gateway benchmark: publish -> deliver latency and 1 -> N fan-out throughput.

    python -m lmqtt.loadtest.gateway_latency [--subscribers 100] [--messages 500] [--rate 200]
        [--qos 0 1] [--payload 64] [--flush-mode async] [--client-procs 2] [--host H --port P]

Without --port it starts its own `lmqtt serve` (fresh temp data dir, loopback, free port) and
stops it with SIGTERM afterwards (and then also reports the server's CPU per delivery). Clients are
raw asyncio sockets using the gateway's sans-IO codec (paho's thread per client would measure
paho), spread over `--client-procs` processes because one Python process decoding 100 streams is
slower than the server encoding them once. Per QoS:
  * latency: the publisher sends `--messages` messages at `--rate` msg/s; each carries its send
    time (monotonic ns); every subscriber records receive - send. Reported p50/p99/max over all
    (message, subscriber) pairs.
  * throughput: the publisher sends `--messages` messages flat out (QoS 1: 100 in flight); reported
    deliveries/s = subscribers x messages / time until the last subscriber has the last message.
Bounded: every phase has a timeout; missing deliveries are reported, not waited for forever.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

from lmqtt.gateway.mqtt import Decoder, encode, packets as P
from lmqtt.loadtest.brokers import free_port

_TS = struct.Struct(">QI")   # send time ns, sequence


class Client(asyncio.Protocol):
    def __init__(self, on_publish=None) -> None:
        self.dec = Decoder(version=4, server_side=False)
        self.on_publish = on_publish
        self.waiters: dict[type, asyncio.Future] = {}
        self.acks: asyncio.Queue = asyncio.Queue()
        self.t = None
        self.out: list[bytes] = []

    def connection_made(self, t) -> None:
        self.t = t

    def data_received(self, data: bytes) -> None:
        now = time.monotonic_ns()
        for p in self.dec.feed(data):
            if isinstance(p, P.Publish):
                if p.qos == 1:
                    pid = p.packet_id
                    self.out.append(bytes((0x40, 2, pid >> 8, pid & 0xFF)))   # PUBACK, pre-shaped
                if self.on_publish:
                    self.on_publish(p, now)
            elif isinstance(p, P.PubAck):
                self.acks.put_nowait(p.packet_id)
            else:
                f = self.waiters.pop(type(p), None)
                if f and not f.done():
                    f.set_result(p)
        if self.out:
            self.t.write(b"".join(self.out))
            self.out.clear()

    async def request(self, pkt, reply: type, timeout: float = 10.0):
        f = asyncio.get_running_loop().create_future()
        self.waiters[reply] = f
        self.t.write(encode(pkt, 4))
        return await asyncio.wait_for(f, timeout)


async def _client(host, port, cid, on_publish=None) -> Client:
    loop = asyncio.get_running_loop()
    _, c = await loop.create_connection(lambda: Client(on_publish), host, port)
    ack = await c.request(P.Connect(cid, 4, True, 60), P.ConnAck)
    assert ack.reason_code == 0, ack
    return c


def _pct(xs: list[int], q: float) -> float:
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(q * len(xs)))] / 1e6


def _cpu(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    try:
        import psutil
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except Exception:
        return float("nan")


async def _sub_worker(host, port, qos, sub_ids, n_msgs, pipe) -> None:
    """Runs in a client process: `sub_ids` subscribers; per phase, collect latencies and counts."""
    topic = f"bench/lat/q{qos}"
    lat: list[int] = []
    counts = {i: 0 for i in sub_ids}
    done = asyncio.Event()
    left = [len(sub_ids)]

    def mk(i):
        def on_pub(p, now):
            ts, _seq = _TS.unpack_from(p.payload)
            lat.append(now - ts)
            counts[i] += 1
            if counts[i] == n_msgs:
                left[0] -= 1
                if left[0] == 0:
                    done.set()
        return on_pub

    subs = [await _client(host, port, f"bsub-{qos}-{i}", mk(i)) for i in sub_ids]
    for c in subs:
        await c.request(P.Subscribe(1, [P.SubscriptionRequest(topic, qos)]), P.SubAck)
    loop = asyncio.get_running_loop()
    pipe.send("ready")
    while True:
        cmd = await loop.run_in_executor(None, pipe.recv)
        if cmd == "stop":
            break
        timeout = float(cmd)
        try:
            await asyncio.wait_for(done.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        pipe.send((lat[:], sum(counts.values())))
        lat.clear()
        for i in counts:
            counts[i] = 0
        left[0] = len(sub_ids)
        done.clear()
    for c in subs:
        c.t.close()


def _worker_entry(host, port, qos, sub_ids, n_msgs, pipe) -> None:
    try:
        import uvloop  # type: ignore
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_sub_worker(host, port, qos, sub_ids, n_msgs, pipe))


async def run_qos(host, port, qos, n_subs, n_msgs, rate, payload_size, server_pid=None, procs=2) -> dict:
    import multiprocessing as mp
    topic = f"bench/lat/q{qos}"
    pad = b"x" * max(0, payload_size - _TS.size)
    ctx = mp.get_context("fork")
    workers = []
    for k in range(procs):
        ids = list(range(k, n_subs, procs))
        if not ids:
            continue
        a, b = ctx.Pipe()
        pr = ctx.Process(target=_worker_entry, args=(host, port, qos, ids, n_msgs, b), daemon=True)
        pr.start()
        workers.append((pr, a))
    loop = asyncio.get_running_loop()
    for _, a in workers:
        assert await loop.run_in_executor(None, a.recv) == "ready"
    pub = await _client(host, port, f"bpub-{qos}")
    await asyncio.sleep(0.2)

    async def publish(k: int, paced: bool) -> float:
        t0 = time.monotonic()
        inflight = 0
        pid = 0
        for seq in range(k):
            if paced:
                delay = t0 + seq / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            if qos:
                while inflight >= 100:
                    await pub.acks.get()
                    inflight -= 1
                pid = pid % 65535 + 1
                inflight += 1
            body = _TS.pack(time.monotonic_ns(), seq) + pad
            pub.t.write(encode(P.Publish(topic, body, qos, packet_id=pid if qos else None), 4))
            if not paced and seq % 64 == 63:
                await asyncio.sleep(0)
        return time.monotonic() - t0

    async def collect(timeout: float) -> tuple[list[int], int]:
        for _, a in workers:
            a.send(str(timeout))
        lat: list[int] = []
        n = 0
        for _, a in workers:
            ls, c = await loop.run_in_executor(None, a.recv)
            lat.extend(ls)
            n += c
        return lat, n

    # latency phase (paced)
    waiter = asyncio.ensure_future(collect(n_msgs / rate + 30))
    await publish(n_msgs, paced=True)
    lat, _n = await waiter
    lat_sorted = sorted(lat)
    missing_lat = n_subs * n_msgs - len(lat)
    # throughput phase (flat out)
    t0 = time.monotonic()
    cpu0 = _cpu(server_pid)
    waiter = asyncio.ensure_future(collect(60))
    pub_s = await publish(n_msgs, paced=False)
    _lat2, delivered = await waiter
    elapsed = time.monotonic() - t0
    cpu = _cpu(server_pid) - cpu0
    for pr, a in workers:
        a.send("stop")
        pr.join(10)
    pub.t.close()
    return {
        "qos": qos, "subscribers": n_subs, "messages": n_msgs, "rate": rate, "payload": payload_size,
        "client_procs": procs,
        "latency_ms": {"p50": _pct(lat_sorted, 0.50), "p99": _pct(lat_sorted, 0.99),
                       "max": lat_sorted[-1] / 1e6 if lat_sorted else float("nan"),
                       "samples": len(lat_sorted), "missing": missing_lat},
        "throughput": {"publish_msgs_per_s": n_msgs / pub_s if pub_s else 0.0,
                       "deliveries": delivered, "missing": n_subs * n_msgs - delivered,
                       "deliveries_per_s": delivered / elapsed if elapsed else 0.0,
                       "seconds": elapsed,
                       "server_cpu_us_per_delivery": cpu / delivered * 1e6 if delivered else float("nan")},
    }


def _start_server(flush_mode: str, data_dir: str, extra: list[str] | None = None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.Popen([sys.executable, "-m", "lmqtt.gateway.cli", "serve", "--port", str(port), "--data-dir",
                          data_dir, "--metrics-port", "0", "--flush-mode", flush_mode, "--segment-mb", "64",
                          "--log-level", "WARNING", *(extra or [])], cwd=root, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return p, port
        except OSError:
            time.sleep(0.05)
    p.kill()
    raise SystemExit("lmqtt serve did not start")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lmqtt.loadtest.gateway_latency", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int)
    ap.add_argument("--subscribers", type=int, default=100)
    ap.add_argument("--messages", type=int, default=500)
    ap.add_argument("--rate", type=float, default=200.0, help="paced publish rate for the latency phase")
    ap.add_argument("--qos", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--payload", type=int, default=64)
    ap.add_argument("--flush-mode", default="async")
    ap.add_argument("--client-procs", type=int, default=2, help="processes running the subscribers")
    ap.add_argument("--server-config", help="TOML config for the lmqtt serve this script starts")
    ap.add_argument("--json", action="store_true", help="print JSON only")
    a = ap.parse_args(argv)
    proc = None
    tmp = None
    port = a.port
    if port is None:
        tmp = tempfile.TemporaryDirectory(prefix="lmqtt-bench-")
        extra = []
        if a.server_config:
            extra = ["--config", a.server_config]
        proc, port = _start_server(a.flush_mode, tmp.name, extra)
    try:
        try:
            import uvloop  # type: ignore
            uvloop.install()
        except ImportError:
            pass
        spid = proc.pid if proc is not None else None
        results = [asyncio.run(run_qos(a.host, port, q, a.subscribers, a.messages, a.rate, a.payload, spid,
                                   a.client_procs))
                   for q in a.qos]
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        if tmp is not None:
            tmp.cleanup()
    if a.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"1 publisher -> {a.subscribers} subscribers ({a.client_procs} client processes), {a.messages} msgs, "
          f"payload {a.payload} B, flush {a.flush_mode}")
    print("| QoS | latency p50 ms | p99 ms | max ms | paced rate | fan-out deliveries/s | server CPU us/delivery "
          "| publish msg/s | missing |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        L, T = r["latency_ms"], r["throughput"]
        print(f"| {r['qos']} | {L['p50']:.2f} | {L['p99']:.2f} | {L['max']:.1f} | {r['rate']:.0f}/s | "
              f"{T['deliveries_per_s']:,.0f} | {T['server_cpu_us_per_delivery']:.1f} | "
              f"{T['publish_msgs_per_s']:,.0f} | {L['missing']}+{T['missing']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
