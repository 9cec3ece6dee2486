"""`lmqtt bench sdk`: the Python SDK against a real `lmqtt store`, next to Redis Streams.

    lmqtt bench sdk [--duration 5] [--sizes 100,1024] [--cases single,batch,...] [--flush-mode async]

Cases (one JSON line each, per payload size; every line has `case`, `size`, `msgs_per_s`):

* `single`     Producer.send, one message per round trip (acked under the flush mode)
* `batch`      Producer.send_batch of `--batch` messages per frame
* `autobatch`  AutoBatchProducer.send (futures), flush at the end; rate counts acknowledged messages
* `aio-autobatch`  the same with AsyncAutoBatchProducer on an AsyncConnection (asyncio services)
* `pull`       Connection.pull_request, 1024 per request, `--pull-ahead` pulls (default 1) in flight
               while a reply is read, over what the produce cases wrote (every body read)
* `group`      PullConsumer.poll(1024) (prefetching) + commit per poll (group offsets kept by the
               store) over the same
* `pop`        PopConsumer.pop(256) + ack over the same messages (its own group)
* `redis-xadd`, `redis-xreadgroup`   the yardstick (loadtest/redis_streams.py), real redis-server
* `latency`    SDK send -> MQTT subscriber of the topic on `lmqtt serve` (p50/p99/max, µs)
* `vs-redis`   (last) one line per lmqtt case with its Redis counterpart in the run: the rate ratio

It starts its own `lmqtt store` (and `lmqtt serve` for `latency`) and `redis-server` on free loopback
ports with temporary data dirs, and stops exactly those processes. Server CPU per message comes from
the server process's /proc stat; client CPU per message from this process (SDK reader thread
included). Progress goes to stderr. Every loop is bounded by `--duration` and by a message count.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

from lmqtt.gateway.mqtt import Decoder, encode, packets as P
from lmqtt.loadtest.brokers import free_port  # below the ephemeral range: a restart finds its port free
from lmqtt.loadtest.proc_stats import cpu_seconds as proc_cpu
from lmqtt.store.client import connect, connect_async

from . import redis_streams as R

ALL_CASES = ("single", "batch", "autobatch", "aio-autobatch", "pull", "group", "pop", "redis-xadd", "redis-xreadgroup", "latency")
MAX_MESSAGES = 5_000_000



class LmqttProc:
    """`lmqtt store` or `lmqtt serve` on free loopback ports in a temp dir; stop() ends only it."""

    def __init__(self, kind: str, flush_mode: str = "async") -> None:
        self.kind = kind
        self.dir = tempfile.mkdtemp(prefix=f"lmqtt-bench-sdk-{kind}-")
        self.store_port = free_port()
        args = [sys.executable, "-m", "lmqtt.gateway.cli", kind, "--host", "127.0.0.1",
                "--data-dir", os.path.join(self.dir, "data"), "--flush-mode", flush_mode]
        if kind == "store":
            args += ["--port", str(self.store_port)]
            wait = [self.store_port]
        else:
            self.mqtt_port = free_port()
            args += ["--port", str(self.mqtt_port), "--store-port", str(self.store_port),
                     "--metrics-port", str(free_port())]
            wait = [self.mqtt_port, self.store_port]
        self.log = open(os.path.join(self.dir, f"{kind}.log"), "wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        print(f"[sdk] lmqtt {kind} pid {self.proc.pid} in {self.dir}", file=sys.stderr, flush=True)
        deadline = time.monotonic() + 30
        for port in wait:
            while True:
                if self.proc.poll() is not None:
                    tail = self.log_tail()
                    self.stop()
                    raise RuntimeError(f"lmqtt {kind} exited with {self.proc.returncode}: {tail}")
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        tail = self.log_tail()
                        self.stop()
                        raise RuntimeError(f"lmqtt {kind} did not listen within 30 s: {tail}")
                    time.sleep(0.05)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.store_port}"

    def cpu(self) -> float:
        return proc_cpu(self.proc.pid)

    def log_tail(self) -> str:
        try:
            with open(os.path.join(self.dir, f"{self.kind}.log"), "rb") as f:
                return f.read()[-2000:].decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _row(case: str, size: int, n: int, el: float, srv_cpu: float, cli_cpu: float, **extra) -> dict:
    out = {"case": case, "size": size, "msgs_per_s": round(n / el, 1) if el > 0 else 0.0, "messages": n,
           "seconds": round(el, 3)}
    if n:
        out["server_cpu_us_per_msg"] = round(srv_cpu / n * 1e6, 2)
        out["client_cpu_us_per_msg"] = round(cli_cpu / n * 1e6, 2)
    out.update(extra)
    return out


class _Meter:
    def __init__(self, server) -> None:
        self.server = server

    def __enter__(self):
        self.s0, self.c0, self.t0 = self.server.cpu(), time.process_time(), time.perf_counter()
        return self

    def done(self):
        return time.perf_counter() - self.t0, self.server.cpu() - self.s0, time.process_time() - self.c0

    def __exit__(self, *exc):
        return False


def bench_single(c, topic, size, duration):
    p = c.producer()
    body = os.urandom(size)
    n = 0
    with _Meter(_SERVER) as m:
        end = time.perf_counter() + duration
        while time.perf_counter() < end and n < MAX_MESSAGES:
            p.send(topic, body)
            n += 1
        el, s, cl = m.done()
    return _row("single", size, n, el, s, cl)


def bench_batch(c, topic, size, duration, batch=256):
    p = c.producer()
    msgs = [(topic, os.urandom(size))] * batch
    n = 0
    with _Meter(_SERVER) as m:
        end = time.perf_counter() + duration
        while time.perf_counter() < end and n < MAX_MESSAGES:
            n += len(p.send_batch(msgs))
        el, s, cl = m.done()
    return _row("batch", size, n, el, s, cl, batch=batch)


def bench_autobatch(c, topic, size, duration):
    """AutoBatchProducer.send for `duration`, then flush(): the rate counts the messages the store
    acknowledged (`acknowledged`), the futures are kept like an application would keep them; one
    in 1,000 is read back to check it resolves."""
    body = os.urandom(size)
    with _Meter(_SERVER) as m:
        with c.auto_batch_producer() as ab:
            end = time.perf_counter() + duration
            sent = 0
            futs = []
            while time.perf_counter() < end and sent < MAX_MESSAGES:
                send = ab.send
                futs.append([send(topic, body) for _ in range(1000)])
                sent += 1000
                if len(futs) >= 100:        # keep memory flat: check a sample, drop the rest
                    for chunk in futs:
                        chunk[-1].result()
                    futs = []
            n = ab.flush()
            for chunk in futs:
                chunk[-1].result()
        el, s, cl = m.done()
    return _row("autobatch", size, n, el, s, cl, sent=sent)


def bench_aio_autobatch(c, topic, size, duration):
    """AsyncAutoBatchProducer.send for `duration` on its own AsyncConnection in an asyncio loop,
    then flush(): the asyncio service's way to produce at volume; counted like `autobatch`."""
    body = os.urandom(size)

    async def run():
        ac = await connect_async(_SERVER.address)
        try:
            async with ac.auto_batch_producer() as ab:
                end = time.perf_counter() + duration
                sent = 0
                while time.perf_counter() < end and sent < MAX_MESSAGES:
                    send = ab.send
                    for _ in range(999):
                        await send(topic, body)
                    last = await send(topic, body)
                    sent += 1000
                    if sent % 100_000 == 0:
                        await last                  # a sample resolves, as in `autobatch`
                n = await ab.flush()
            return n, sent
        finally:
            await ac.close()
    with _Meter(_SERVER) as m:
        n, sent = asyncio.run(run())
        el, s, cl = m.done()
    return _row("aio-autobatch", size, n, el, s, cl, sent=sent)


def bench_pull(c, first_level, size, duration, ahead=1):
    """Connection.pull_request of 1,024 records at a time from the queue's start, with `ahead`
    pulls in flight while the current records are read (what PullConsumer's prefetch does for 1;
    0: one pull at a time, `Connection.pull`); every record's body is read (a consumer that only
    counted replies would not pay for the records it never looks at)."""
    n = 0
    nbytes = 0
    off = c.admin().offsets(first_level)[0]
    with _Meter(_SERVER) as m:
        end = time.perf_counter() + duration
        pending = []            # pulls in flight, oldest first; `off` is where the next one starts
        if ahead:
            pending.append(c.pull_request(first_level, 0, off, 1024))
            off += 1024         # ConsumeQueue offsets are dense: the next pull starts there
        while time.perf_counter() < end and n < MAX_MESSAGES:
            if ahead:
                r = pending.pop(0).result()
                if len(r.records) < 1024 and pending:   # a short reply: the pulls ahead guessed wrong
                    for p in pending:
                        p.result()
                    pending = []
                    off = r.next_offset
                if r.records:
                    while len(pending) < ahead:
                        pending.append(c.pull_request(first_level, 0, off, 1024))
                        off += 1024
            else:
                r = c.pull(first_level, 0, off, 1024)
                off = r.next_offset
            if not r.records:
                break
            for rec in r.records:
                nbytes += len(rec.body)
            n += len(r.records)
        el, s, cl = m.done()
        for p in pending:
            p.result()
    return _row("pull", size, n, el, s, cl, max_count=1024, pulls_ahead=ahead, body_bytes=nbytes)


def bench_group(c, first_level, size, duration):
    """Group consumption with store-kept offsets, the counterpart of XREADGROUP + XACK: a
    PullConsumer polls 1,024 records, reads every body, commits its position after each poll
    (at-least-once: a restarted member resumes after the last commit)."""
    cons = c.consumer(first_level, f"bench-group-{size}-{os.getpid()}", max_count=1024)
    n = 0
    nbytes = 0
    with _Meter(_SERVER) as m:
        end = time.perf_counter() + duration
        while time.perf_counter() < end and n < MAX_MESSAGES:
            recs = cons.poll()
            if not recs:
                break
            for rec in recs:
                nbytes += len(rec.body)
            cons.commit()
            n += len(recs)
        el, s, cl = m.done()
    return _row("group", size, n, el, s, cl, max_count=1024, body_bytes=nbytes)


def bench_pop(c, first_level, size, duration):
    pc = c.pop_consumer(first_level, f"bench-pop-{size}", invisible_ms=60_000)
    n = 0
    with _Meter(_SERVER) as m:
        end = time.perf_counter() + duration
        while time.perf_counter() < end and n < MAX_MESSAGES:
            recs = pc.pop(256)
            if not recs:
                break
            pc.ack(recs)
            n += len(recs)
        el, s, cl = m.done()
    return _row("pop", size, n, el, s, cl, max_count=256)



def bench_latency(size, duration, flush_mode, max_count=20_000):
    """SDK send -> raw MQTT subscriber (the gateway's codec) on `lmqtt serve`, one message in flight."""
    srv = LmqttProc("serve", flush_mode)
    try:
        sock = socket.create_connection(("127.0.0.1", srv.mqtt_port), timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        dec = Decoder(version=4, server_side=False)
        pending: list = []

        def recv():
            while not pending:
                data = sock.recv(1 << 16)
                if not data:
                    raise RuntimeError("lmqtt serve closed the MQTT connection")
                pending.extend(dec.feed(data))
            return pending.pop(0)

        sock.sendall(encode(P.Connect("bench-sdk-lat", 4, True, 60, None, None, None, P.Properties()), 4))
        recv()
        sock.sendall(encode(P.Subscribe(1, [P.SubscriptionRequest("lat/x", 0)]), 4))
        recv()
        lats = []
        with connect(srv.address) as c:
            p = c.producer()
            pad = os.urandom(max(0, size - 8))
            t_end = time.perf_counter() + duration
            s0, c0, t0 = srv.cpu(), time.process_time(), time.perf_counter()
            while time.perf_counter() < t_end and len(lats) < max_count:
                stamp = time.perf_counter_ns()
                p.send("lat/x", struct.pack("!q", stamp) + pad, qos=0)
                while True:
                    pkt = recv()
                    if isinstance(pkt, P.Publish):
                        got = struct.unpack("!q", bytes(pkt.payload[:8]))[0]
                        if got == stamp:
                            lats.append((time.perf_counter_ns() - stamp) / 1000)
                            break
            el, s, cl = time.perf_counter() - t0, srv.cpu() - s0, time.process_time() - c0
        sock.close()
    finally:
        srv.stop()
    lats.sort()
    q = lambda f: round(lats[min(len(lats) - 1, int(f * len(lats)))], 1) if lats else None  # noqa: E731
    return _row("latency", size, len(lats), el, s, cl, p50_us=q(0.50), p99_us=q(0.99),
                max_us=round(lats[-1], 1) if lats else None, path="SDK send -> lmqtt serve -> MQTT QoS 0 subscriber")


_SERVER = None
_READ_CASES = ("pull", "group", "pop")


def _sdk_rows(a, sizes, sdk_cases, emit, connect) -> int:
    global _SERVER
    if not sdk_cases:
        return 0
    print(f"[sdk] starting lmqtt store (flush {a.flush_mode})", file=sys.stderr, flush=True)
    _SERVER = LmqttProc("store", a.flush_mode)
    try:
        with connect(_SERVER.address) as c:
            for size in sizes:
                first = f"sdk{size}"
                topic = f"{first}/bench"
                produced = False
                for case in sdk_cases:
                    if case in _READ_CASES and not produced:
                        # the read cases read what a produce case wrote: alone they measured an
                        # empty queue (0 msg/s)
                        print(f"[sdk] {case} reads what a produce case wrote and none ran for size={size}: "
                              f"filling the queue with `batch` first ({a.duration:g} s, not reported)",
                              file=sys.stderr, flush=True)
                        bench_batch(c, topic, size, a.duration)
                    produced = True
                    print(f"[sdk] {case} size={size} ...", file=sys.stderr, flush=True)
                    fn = {"single": bench_single, "batch": bench_batch, "autobatch": bench_autobatch,
                          "aio-autobatch": bench_aio_autobatch, "pull": bench_pull, "group": bench_group, "pop": bench_pop}[case]
                    extra = {"ahead": a.pull_ahead} if case == "pull" else {}
                    emit(fn(c, first if case in _READ_CASES else topic, size, a.duration, **extra))
    finally:
        _SERVER.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmqtt bench sdk", description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per case (default 5)")
    ap.add_argument("--sizes", default="100,1024", help="payload sizes in bytes (default 100,1024)")
    ap.add_argument("--cases", default=",".join(ALL_CASES), help=f"subset of {','.join(ALL_CASES)}")
    ap.add_argument("--flush-mode", default="async", choices=("async", "sync", "async+buffer"))
    ap.add_argument("--pull-ahead", type=int, default=1,
                    help="pull case: pulls in flight while a reply is read (0 = one at a time; default 1, "
                         "what PullConsumer's prefetch does)")
    a = ap.parse_args(argv)
    cases = [x for x in a.cases.split(",") if x]
    bad = [x for x in cases if x not in ALL_CASES]
    if bad or a.duration <= 0:
        print(f"lmqtt bench sdk: unknown case(s) {bad} or duration <= 0", file=sys.stderr)
        return 2
    sizes = [int(x) for x in a.sizes.split(",") if x]

    rc = 0

    rows: dict[tuple[str, int], float] = {}

    def emit(row):
        row.setdefault("flush_mode", a.flush_mode if not row["case"].startswith("redis") else "redis-no-aof")
        rows[(row["case"], row["size"])] = row["msgs_per_s"]
        print(json.dumps(row), flush=True)

    sdk_cases = [x for x in cases if x in ("single", "batch", "autobatch", "aio-autobatch", "pull", "group", "pop")]
    try:
        rc = _sdk_rows(a, sizes, sdk_cases, emit, connect) or rc
    except (RuntimeError, OSError) as e:
        print(f"lmqtt bench sdk: store cases failed: {e}", file=sys.stderr)
        rc = 1
    redis_cases = [x for x in cases if x.startswith("redis")]
    if redis_cases:
        try:
            rs = R.RedisServer()
        except R.RedisUnavailable as e:
            print(f"[sdk] redis rows skipped: {e}", file=sys.stderr)
            rc = 1
        else:
            try:
                for size in sizes:
                    for case in redis_cases:
                        print(f"[sdk] {case} size={size} ...", file=sys.stderr, flush=True)
                        c0 = time.process_time()
                        row = (R.xadd(rs, size, a.duration) if case == "redis-xadd"
                               else R.xreadgroup(rs, size, a.duration))
                        n = row["messages"]
                        if n:
                            row["server_cpu_us_per_msg"] = round(row["server_cpu_s"] / n * 1e6, 2)
                            if case == "redis-xadd":
                                row["client_cpu_us_per_msg"] = round((time.process_time() - c0) / n * 1e6, 2)
                        row["msgs_per_s"] = round(row["msgs_per_s"], 1)
                        row["seconds"] = round(row["seconds"], 3)
                        row["server_cpu_s"] = round(row["server_cpu_s"], 3)
                        emit(row)
            finally:
                rs.stop()
    if "latency" in cases:
        for size in sizes:
            print(f"[sdk] latency size={size} (lmqtt serve) ...", file=sys.stderr, flush=True)
            try:
                emit(bench_latency(size, a.duration, a.flush_mode))
            except (RuntimeError, OSError) as e:
                print(f"lmqtt bench sdk: latency case failed: {e}", file=sys.stderr)
                rc = 1
    for row in vs_redis(rows, sizes):
        print(json.dumps(row), flush=True)
    return rc


# lmqtt case -> the Redis Streams case it is compared with (same run, same size)
VS_REDIS = {"autobatch": "redis-xadd", "batch": "redis-xadd", "group": "redis-xreadgroup",
            "pop": "redis-xreadgroup", "pull": "redis-xreadgroup"}


def vs_redis(rows: dict, sizes) -> list[dict]:
    """One `vs-redis` line per lmqtt case that has its Redis counterpart in this run: the ratio of
    the two rates (>= 1: lmqtt is at least as fast)."""
    out = []
    for size in sizes:
        for case, other in VS_REDIS.items():
            mine, theirs = rows.get((case, size)), rows.get((other, size))
            if mine and theirs:
                out.append({"case": "vs-redis", "size": size, "lmqtt_case": case, "redis_case": other,
                            "ratio": round(mine / theirs, 2), "msgs_per_s": mine, "redis_msgs_per_s": theirs})
    return out


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
