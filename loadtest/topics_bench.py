"""`lmqtt bench topics`: a broker holding many first-level topics - one per device, the layout
that once made lmqtt unrestartable (a file per topic).

    lmqtt bench topics --topics 1000000 [--conns 8] [--sample 200] [--data-dir DIR] [--keep]
                       [--ulimit N] [--json]

On a fresh `lmqtt serve` (its defaults), N topics `dev{i}/sensor` get one QoS 1 message each
(--conns connections, each with a window of unacknowledged publishes); then the broker is stopped
with SIGTERM and started again, and then killed with SIGKILL and started again. After each start
a sample of the topics is read back over MQTT (`$replay/0/<topic>`, the stored history) and over
the SDK (a pull of the topic's first level). Throughout, a sampler keeps the broker's peak open
files, memory maps and RSS. One JSON line per phase, then a summary:

    {"phase": "publish", "topics": N, "seconds": ..., "msg_s": ..., "open_files": ..., "maps": ...,
     "rss": ..., "rss_anon": ..., "disk_bytes": ...}
    {"phase": "restart-sigterm", "restart_s": ..., "mqtt_read": "200/200", "sdk_read": "200/200", ...}
    {"phase": "restart-kill9", ...}
    {"phase": "summary", "peak_open_files": ..., "peak_maps": ..., "peak_rss": ..., "error_lines": 0, ...}

`restart_s` is from starting the process to its MQTT port accepting connections. `--ulimit N`
runs the broker with its open-files limit lowered to N (soft and hard), as `ulimit -n N` would.
The helpers (`publish_topics`, `read_back_mqtt`, `read_back_sdk`, `Broker`) are what the
end-to-end tests of many topics use.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from lmqtt.gateway.mqtt import Decoder, encode, packets as P
from lmqtt.store.client import connect

from . import proc_stats
from .brokers import free_port, wait_port


def topic_of(i: int, prefix: str = "dev") -> str:
    return f"{prefix}{i}/sensor"


# ------------------------------------------------------------------ publishing
async def _publish_range(host: str, port: int, lo: int, hi: int, prefix: str, window: int, payload: bytes) -> int:
    """QoS 1 publishes to topics lo..hi-1 on one connection, at most `window` unacknowledged;
    -> how many were acknowledged (PUBACK 0)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(encode(P.Connect(client_id=f"topics-{prefix}-{lo}-{os.getpid()}", clean_start=True), 4))
    dec = Decoder(version=4, server_side=False)
    got_connack = False
    while not got_connack:
        data = await reader.read(1 << 16)
        if not data:
            raise ConnectionError("the broker closed the connection before CONNACK")
        for pkt in dec.feed(data):
            if isinstance(pkt, P.ConnAck):
                if pkt.reason_code:
                    raise ConnectionError(f"CONNACK refused: 0x{pkt.reason_code:02X}")
                got_connack = True
    sent = acked = 0
    n = hi - lo
    pid = 0
    while acked < n:
        out = []
        while sent < n and sent - acked < window:
            pid = pid % 65535 + 1
            out.append(encode(P.Publish(topic=topic_of(lo + sent, prefix), payload=payload, qos=1, packet_id=pid), 4))
            sent += 1
        if out:
            writer.write(b"".join(out))
        data = await reader.read(1 << 16)
        if not data:
            raise ConnectionError(f"the broker closed the connection after {acked} acknowledgements")
        for pkt in dec.feed(data):
            if isinstance(pkt, P.PubAck):
                if pkt.reason_code not in (0, None):
                    raise ConnectionError(f"PUBACK 0x{pkt.reason_code:02X}")
                acked += 1
    writer.write(encode(P.Disconnect(), 4))
    await writer.drain()
    writer.close()
    return acked


async def publish_topics_async(host: str, port: int, n: int, *, conns: int = 8, prefix: str = "dev",
                               window: int = 500, payload: bytes = b"1") -> int:
    step = -(-n // conns)
    jobs = [_publish_range(host, port, lo, min(n, lo + step), prefix, window, payload)
            for lo in range(0, n, step)]
    return sum(await asyncio.gather(*jobs))


def publish_topics(host: str, port: int, n: int, **kw) -> int:
    """One QoS 1 message to each of the topics `dev0/sensor` .. `dev{n-1}/sensor`; -> acknowledged."""
    return asyncio.run(publish_topics_async(host, port, n, **kw))


# ------------------------------------------------------------------ reading back
def read_back_mqtt(host: str, port: int, topics: list[str], timeout: float = 30.0) -> dict[str, list[bytes]]:
    """Subscribe to `$replay/0/<topic>` for each topic (the stored history, QoS 1) on one
    connection; -> {topic: payloads received} once each topic has one or `timeout` passed."""
    s = socket.create_connection((host, port), timeout=timeout)
    dec = Decoder(version=4, server_side=False)
    got: dict[str, list[bytes]] = {t: [] for t in topics}
    try:
        s.sendall(encode(P.Connect(client_id=f"readback-{os.getpid()}-{time.monotonic_ns()}", clean_start=True), 4))
        for i in range(0, len(topics), 100):
            part = topics[i:i + 100]
            subs = [P.SubscriptionRequest(f"$replay/0/{t}", qos=1) for t in part]
            s.sendall(encode(P.Subscribe(packet_id=i // 100 + 1, subscriptions=subs), 4))
        deadline = time.monotonic() + timeout
        missing = set(topics)
        while missing and time.monotonic() < deadline:
            s.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                data = s.recv(1 << 16)
            except socket.timeout:
                break
            if not data:
                break
            acks = []
            for pkt in dec.feed(data):
                if isinstance(pkt, P.Publish):
                    if pkt.topic in got:
                        got[pkt.topic].append(pkt.payload)
                        missing.discard(pkt.topic)
                    if pkt.qos == 1 and pkt.packet_id is not None:
                        acks.append(encode(P.PubAck(packet_id=pkt.packet_id), 4))
            if acks:
                s.sendall(b"".join(acks))
        s.sendall(encode(P.Disconnect(), 4))
    finally:
        s.close()
    return got


def read_back_sdk(store: str, topics: list[str]) -> dict[str, list[bytes]]:
    """Each topic's messages over the SDK: a pull of its first level's queue 0 from the start."""
    c = connect(store)
    try:
        out = {}
        for t in topics:
            res = c.pull(t.split("/", 1)[0], queue_id=0, offset=0, max_count=16)
            out[t] = [r.body for r in res.records if r.topic == t]
        return out
    finally:
        c.close()


# ------------------------------------------------------------------ the broker
class Broker:
    """`lmqtt serve` on free loopback ports in `data_dir`, its log in `log_path`; `ulimit`: its
    open-files limit (soft and hard) when given. Ends only its own process."""

    def __init__(self, data_dir: str, log_path: str, ulimit: int = 0, extra: list[str] | None = None) -> None:
        self.data_dir = data_dir
        self.log_path = log_path
        self.ulimit = ulimit
        self.extra = list(extra or [])
        self.port = free_port()
        self.store_port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def store(self) -> str:
        return f"127.0.0.1:{self.store_port}"

    def _limit(self) -> None:
        if self.ulimit:
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.ulimit, self.ulimit))

    def start(self, timeout: float = 120.0) -> float:
        """Start it; -> seconds until its MQTT port accepts connections."""
        args = [sys.executable, "-m", "lmqtt.gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                "--data-dir", self.data_dir, "--metrics-port", "0", "--store-port", str(self.store_port),
                *self.extra]
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=log, preexec_fn=self._limit,
                                         start_new_session=True)
        if not (wait_port("127.0.0.1", self.port, timeout, self.proc)
                and wait_port("127.0.0.1", self.store_port, timeout, self.proc)):
            rc = self.proc.poll()
            raise RuntimeError(f"lmqtt serve did not start ({'exited ' + str(rc) if rc is not None else 'timeout'}); "
                               f"log: {self.log_path}")
        return time.monotonic() - t0

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120.0) -> float:
        """Send `sig` and wait for the process to end; -> seconds it took."""
        p = self.proc
        if p is None or p.poll() is not None:
            return 0.0
        t0 = time.monotonic()
        p.send_signal(sig)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        return time.monotonic() - t0

    def error_lines(self) -> list[str]:
        """Log lines at level error or critical, and tracebacks."""
        try:
            with open(self.log_path, errors="replace") as f:
                return [ln.rstrip() for ln in f if "level=error" in ln or "level=critical" in ln
                        or ln.startswith("Traceback")]
        except OSError:
            return []


# ------------------------------------------------------------------ the benchmark
def _read_sample(b: Broker, sample: list[str]) -> dict:
    via_mqtt = read_back_mqtt("127.0.0.1", b.port, sample)
    via_sdk = read_back_sdk(b.store, sample)
    return {"mqtt_read": f"{sum(1 for t in sample if via_mqtt[t] == [b'1'])}/{len(sample)}",
            "sdk_read": f"{sum(1 for t in sample if via_sdk[t] == [b'1'])}/{len(sample)}"}


def run(args) -> list[dict]:
    work = args.data_dir or tempfile.mkdtemp(prefix="lmqtt-bench-topics-")
    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, "data")
    b = Broker(data, os.path.join(work, "serve.log"), ulimit=args.ulimit)
    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    rng = random.Random(7)
    sample = sorted({topic_of(rng.randrange(args.topics)) for _ in range(args.sample)})
    try:
        b.start()
        with proc_stats.PeakSampler(b.proc.pid) as peaks:
            t0 = time.monotonic()
            acked = publish_topics("127.0.0.1", b.port, args.topics, conns=args.conns)
            secs = time.monotonic() - t0
            time.sleep(2.0)             # the dispatchers' flush
            emit({"phase": "publish", "topics": args.topics, "acknowledged": acked, "seconds": round(secs, 1),
                  "msg_s": round(acked / secs), **proc_stats.sample(b.proc.pid),
                  "disk_bytes": proc_stats.disk_bytes(data)})
            for phase, sig in (("restart-sigterm", signal.SIGTERM), ("restart-kill9", signal.SIGKILL)):
                stop_s = b.stop(sig)
                restart_s = b.start()
                peaks.switch(b.proc.pid)
                row = {"phase": phase, "stop_s": round(stop_s, 2), "restart_s": round(restart_s, 2),
                       **_read_sample(b, sample), **proc_stats.sample(b.proc.pid),
                       "disk_bytes": proc_stats.disk_bytes(data)}
                emit(row)
            b.stop()
        errors = b.error_lines()
        emit({"phase": "summary", "topics": args.topics, "peak_open_files": peaks.peak["open_files"],
              "peak_maps": peaks.peak["maps"], "peak_rss": peaks.peak["rss"],
              "disk_bytes": proc_stats.disk_bytes(data), "error_lines": len(errors),
              "first_error": errors[0] if errors else None, "ulimit": args.ulimit or None})
    finally:
        b.stop(signal.SIGKILL)
        if not args.keep and not args.data_dir:
            shutil.rmtree(work, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lmqtt bench topics", description=__doc__.split("\n\n")[0])
    p.add_argument("--topics", type=int, default=100_000, help="first-level topics, one message each (default 100000)")
    p.add_argument("--conns", type=int, default=8, help="publishing connections (default 8)")
    p.add_argument("--sample", type=int, default=200, help="topics read back after each restart (default 200)")
    p.add_argument("--ulimit", type=int, default=0, help="the broker's open-files limit (default: as inherited)")
    p.add_argument("--data-dir", help="work directory (default: a temp dir, removed afterwards)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = p.parse_args(argv)
    rows = run(args)
    s = rows[-1]
    print(f"\n{args.topics:,} topics: peak open files {s['peak_open_files']:,}, peak maps {s['peak_maps']:,}, "
          f"peak RSS {s['peak_rss'] / 2**20:.0f} MiB, disk {s['disk_bytes'] / 2**20:.0f} MiB, "
          f"restart {rows[1]['restart_s']} s (SIGTERM) / {rows[2]['restart_s']} s (kill -9), "
          f"read back {rows[1]['mqtt_read']} MQTT, {rows[1]['sdk_read']} SDK; error lines {s['error_lines']}",
          file=sys.stderr)
    return 0 if s["error_lines"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
