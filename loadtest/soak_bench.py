"""`lmqtt bench soak`: a broker over hours - does anything grow that should not?

    lmqtt bench soak [--duration 7200] [--devices 2000] [--rate 2000] [--churn-per-min 2000]
                     [--retention 10m] [--sample-s 10] [--out DIR] [--plot FILE]

A fresh `lmqtt serve` (defaults, `--retention` so that retention deletes segments during the
run) gets `--devices` MQTT devices each publishing QoS 1 to `soak/<device>` at `--rate` messages
a second in all, reconnecting `--churn-per-min` times a minute in all (each device leaves after its
in-flight messages are acknowledged and comes back at once), and one persistent QoS 1 subscriber
on `soak/#` that acknowledges everything. Every `--sample-s` seconds a row goes to
`DIR/soak.jsonl`: the broker's anonymous and file-backed memory, open files, maps, threads, CPU,
the data dir's size, the publish and delivery rates and the delivery latency (p50/p99 of that
interval, publish to delivery, one clock). Between two rows anonymous memory is also read every
`--fast-s` seconds (default 0.5), and the row carries that interval's lowest, highest and average
reading (`anon_min`, `anon_max`, `anon_avg`): a row's instant alone misses what rises and falls
within a second, and, taken every 10 s, lands in step with the store's own 10-second duties (its
retention check), so it would see one phase of them only. At the end every acknowledged message
must have been delivered (`lost`), and a summary says how each measure moved after the first
`--settle-s` (default: the retention, 10 min): anonymous memory's spread around its mean over
the rows' instants (`anon_spread_pct`) and over every fast reading (`anon_all_spread_pct`: the
highest and lowest reading against the mean of all), the range of open files, maps and disk.
`--plot` draws the rows (matplotlib), anonymous memory with its band of fast readings.

The load generator is this process (asyncio, the gateway's sans-IO codec); its own CPU is in each
row (`gen_cpu_s`), so a saturated generator shows. Load goes to loopback only; the run is bounded
by --duration.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
import time

from lmqtt.gateway.mqtt import Decoder, encode, packets as P
from lmqtt.store import gc_pauses
from lmqtt.store.tier.config import parse_retention

from . import proc_stats
from .topics_bench import Broker

STAMP = struct.Struct("!IQQ")          # device, sequence, send time (monotonic ns)
_U16 = struct.Struct("!H")


class Tally:
    """What the devices had acknowledged and the subscriber received, and the latencies of the
    current interval. Memory stays flat over hours: per device only the acknowledged messages not
    delivered yet (`pending`), those delivered before their acknowledgement reached the device
    (`early`), and the received sequence numbers above the contiguous floor."""

    def __init__(self, devices: int) -> None:
        self.pending: list[set[int]] = [set() for _ in range(devices)]
        self.early: list[set[int]] = [set() for _ in range(devices)]
        self.floor = [0] * devices
        self.above: list[set[int]] = [set() for _ in range(devices)]
        self.sent = self.acked_n = self.delivered = self.duplicates = self.reconnects = self.refused = 0
        self.connect_failures = 0      # reconnects that failed and were retried (a closed socket, a refusal)
        self.lat: list[int] = []

    def on_ack(self, dev: int, seq: int) -> None:
        self.acked_n += 1
        early = self.early[dev]
        if seq in early:
            early.discard(seq)
        else:
            self.pending[dev].add(seq)

    def on_delivery(self, dev: int, seq: int, latency_ns: int) -> None:
        above = self.above[dev]
        if seq <= self.floor[dev] or seq in above:
            self.duplicates += 1
            return
        above.add(seq)
        f = self.floor[dev]
        while f + 1 in above:
            f += 1
            above.discard(f)
        self.floor[dev] = f
        self.delivered += 1
        self.lat.append(latency_ns)
        pending = self.pending[dev]
        if seq in pending:
            pending.discard(seq)
        else:
            self.early[dev].add(seq)

    def lost(self) -> int:
        """Acknowledged to its device and not delivered (yet)."""
        return sum(len(p) for p in self.pending)


class Device:
    """One MQTT 3.1.1 device: connects, publishes its stamped messages when told, reconnects on churn."""

    def __init__(self, i: int, host: str, port: int, tally: Tally) -> None:
        self.i, self.host, self.port, self.tally = i, host, port, tally
        self.topic = f"soak/{i}"
        self.seq = 0
        self.pid = 0
        self.inflight: dict[int, int] = {}     # packet id -> seq
        self.writer: asyncio.StreamWriter | None = None
        self.ready = asyncio.Event()
        self.leaving = False
        self.reading: asyncio.Task | None = None     # reads PUBACKs of the current connection

    async def connect(self) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        writer.write(encode(P.Connect(client_id=f"soak-dev-{self.i}", clean_start=True, keepalive=120), 4))
        dec = Decoder(version=4, server_side=False)
        while True:
            data = await reader.read(4096)
            if not data:
                raise ConnectionError("closed before CONNACK")
            pkts = dec.feed(data)
            if any(isinstance(p, P.ConnAck) for p in pkts):
                ack = next(p for p in pkts if isinstance(p, P.ConnAck))
                if ack.reason_code:
                    self.tally.refused += 1
                    writer.close()
                    raise ConnectionError(f"CONNACK {ack.reason_code}")
                break
        self.writer = writer
        self.ready.set()
        self.reading = asyncio.get_running_loop().create_task(self._read(reader, dec))

    async def _read(self, reader, dec) -> None:
        t = self.tally
        while True:
            data = await reader.read(1 << 16)
            if not data:
                return
            for p in dec.feed(data):
                if isinstance(p, P.PubAck):
                    seq = self.inflight.pop(p.packet_id, None)
                    if seq is not None:
                        t.on_ack(self.i, seq)

    def publish(self) -> None:
        w = self.writer
        if w is None or not self.ready.is_set() or self.leaving:
            return
        self.pid = self.pid % 65535 + 1
        self.seq += 1
        self.inflight[self.pid] = self.seq
        body = STAMP.pack(self.i, self.seq, time.monotonic_ns())
        w.write(encode(P.Publish(topic=self.topic, payload=body, qos=1, packet_id=self.pid), 4))
        self.tally.sent += 1

    async def close(self) -> None:
        """The connection closed and its reader task ended (at a churn and at the end of the run)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.reading is not None:
            self.reading.cancel()
            await asyncio.gather(self.reading, return_exceptions=True)

    async def churn(self) -> None:
        """Leave once every message in flight is acknowledged, and come back."""
        self.leaving = True
        try:
            deadline = time.monotonic() + 10
            while self.inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            self.ready.clear()
            if self.writer is not None:
                self.writer.write(encode(P.Disconnect(), 4))
            # its reader ended here: a task left waiting on a closed connection with nothing
            # referring to it is collected while pending ("Task was destroyed but it is pending")
            await self.close()
            self.inflight.clear()          # not acknowledged: not counted as acknowledged
            for attempt in range(60):      # a device keeps coming back, as a real one would
                try:
                    await self.connect()
                    break
                except (OSError, ConnectionError):
                    self.tally.connect_failures += 1
                    await asyncio.sleep(min(0.1 * 2 ** attempt, 2.0))
            self.tally.reconnects += 1
        finally:
            self.leaving = False


async def subscriber(host: str, port: int, tally: Tally, stop: asyncio.Event) -> None:
    """One persistent QoS 1 session on soak/#, reconnecting if the broker drops it."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(0.5)
            continue
        writer.write(encode(P.Connect(client_id="soak-sub", clean_start=False, keepalive=120), 4))
        writer.write(encode(P.Subscribe(packet_id=1, subscriptions=[P.SubscriptionRequest("soak/#", qos=1)]), 4))
        dec = Decoder(version=4, server_side=False)
        while not stop.is_set():
            data = await reader.read(1 << 18)
            if not data:
                break
            acks = []
            now = time.monotonic_ns()
            for p in dec.feed(data):
                if isinstance(p, P.Publish) and len(p.payload) == STAMP.size:
                    dev, seq, t0 = STAMP.unpack(p.payload)
                    tally.on_delivery(dev, seq, now - t0)
                    if p.qos == 1 and p.packet_id is not None:
                        acks.append(encode(P.PubAck(packet_id=p.packet_id), 4))
            if acks:
                writer.write(b"".join(acks))
        writer.close()


def _pct(xs: list[int], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] / 1e6


async def _run(args, b: Broker, rows_path: str) -> dict:
    n = args.devices
    tally = Tally(n)
    devices = [Device(i, "127.0.0.1", b.port, tally) for i in range(n)]
    stop = asyncio.Event()
    # Ctrl-C (or SIGTERM) ends the load early, not the run: the tail is still counted and the
    # summary and plot made of the rows so far (the broker runs in a session of its own: the
    # terminal's Ctrl-C does not reach it)
    interrupted = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupted.set)
    sub = loop.create_task(subscriber("127.0.0.1", b.port, tally, stop))
    await asyncio.sleep(0.5)
    for k in range(0, n, 200):
        await asyncio.gather(*(d.connect() for d in devices[k:k + 200]))
    rng = random.Random(5)
    t_start = time.monotonic()
    t_end = t_start + args.duration
    tick = 0.01
    published = churned = 0         # so far; due ones are sent by elapsed time, whatever a tick took
    nxt = 0
    next_sample = t_start + args.sample_s
    next_fast = t_start
    fast: list[int] = []            # anonymous memory read every --fast-s since the last row
    last = {"sent": 0, "delivered": 0, "t": t_start}
    gen_cpu0 = time.process_time()
    # the generator's own collector, tuned as the broker's (gateway/app/config.py `gc_freeze`): the
    # devices and their connections made above are never scanned again, young collections are
    # rarer. Untuned, its collections took 20-45 ms in most 2-s rows (up to 147 ms), the size of
    # the p99 it measures
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, *gc.get_threshold()[1:])
    gen_gc = gc_pauses.install()
    churning: set[asyncio.Task] = set()
    with open(rows_path, "w") as out:
        while True:
            now = time.monotonic()
            if now >= t_end or interrupted.is_set():
                break
            k = int((now - t_start) * args.rate) - published
            published += k
            for _ in range(k):
                devices[nxt].publish()
                nxt = (nxt + 1) % n
            c = int((now - t_start) * args.churn_per_min / 60.0) - churned
            churned += c
            for _ in range(c):
                d = devices[rng.randrange(n)]
                if not d.leaving:
                    task = asyncio.get_running_loop().create_task(d.churn())
                    churning.add(task)
                    task.add_done_callback(churning.discard)
            if now >= next_fast:
                next_fast += args.fast_s
                fast.append(proc_stats.status(b.proc.pid)["rss_anon"])
            if now >= next_sample:
                next_sample += args.sample_s
                dt = now - last["t"]
                lat, tally.lat = tally.lat, []
                # "utc": the wall clock, to find the row of a line of the broker's log (its `ts`)
                row = {"t_s": round(now - t_start, 1), "utc": time.strftime("%H:%M:%S", time.gmtime()),
                       **proc_stats.sample(b.proc.pid),
                       "disk_bytes": proc_stats.disk_bytes(b.data_dir),
                       "publish_rate": round((tally.sent - last["sent"]) / dt),
                       "deliver_rate": round((tally.delivered - last["delivered"]) / dt),
                       "p50_ms": round(_pct(lat, 0.5), 2), "p99_ms": round(_pct(lat, 0.99), 2),
                       "acked": tally.acked_n, "delivered": tally.delivered, "reconnects": tally.reconnects,
                       "refused": tally.refused,
                       "connect_failures": tally.connect_failures, "gen_cpu_s": round(time.process_time() - gen_cpu0, 1),
                       # the generator's own longest collection in the row: a delivery that waited
                       # for it shows in p99 without the broker being slow
                       "gen_gc_max_ms": round(gen_gc.take_longest() * 1000, 1)}
                if fast:
                    row.update(anon_min=min(fast), anon_max=max(fast), anon_avg=int(sum(fast) / len(fast)),
                               anon_n=len(fast))
                    fast = []
                last = {"sent": tally.sent, "delivered": tally.delivered, "t": now}
                out.write(json.dumps(row) + "\n")
                out.flush()
                if not args.quiet:
                    print(json.dumps(row), flush=True)
            await asyncio.sleep(max(0.0, tick - (time.monotonic() - now)))
        # the tail: every acknowledged message delivered?
        deadline = time.monotonic() + 30
        while tally.lost() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        stop.set()
        sub.cancel()
        for t in churning:
            t.cancel()
        await asyncio.gather(sub, *churning, return_exceptions=True)
        await asyncio.gather(*(d.close() for d in devices))
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)
    loaded = round(min(time.monotonic(), t_end) - t_start, 1)
    if interrupted.is_set():
        print(f"lmqtt bench soak: interrupted after {loaded:g} s of load; the summary covers those",
              file=sys.stderr, flush=True)
    return {"acked": tally.acked_n, "delivered": tally.delivered, "lost": tally.lost(),
            "duplicates": tally.duplicates, "reconnects": tally.reconnects, "refused": tally.refused,
            "connect_failures": tally.connect_failures, "interrupted": interrupted.is_set(), "loaded_s": loaded}


def _malloc_of(pid: int) -> str:
    """The broker's allocator (store/allocator.py): jemalloc when its library is mapped."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "jemalloc" if "libjemalloc" in f.read() else "libc"
    except OSError:
        return "unknown"


def summarize(rows: list[dict], settle_s: float) -> dict:
    """How each measure moved after `settle_s`: anonymous memory's spread around its mean, and the
    ranges of open files, maps, threads and disk."""
    late = [r for r in rows if r["t_s"] >= settle_s] or rows
    if not late:
        return {}
    anon = [r["rss_anon"] for r in late]
    mean = sum(anon) / len(anon)
    out = {"rows": len(late), "anon_mean": int(mean),
           "anon_spread_pct": round(100 * max(abs(a - mean) for a in anon) / mean, 1) if mean else 0.0}
    fast = [r for r in late if r.get("anon_n")]
    if fast:
        n = sum(r["anon_n"] for r in fast)
        m = sum(r["anon_avg"] * r["anon_n"] for r in fast) / n
        lo, hi = min(r["anon_min"] for r in fast), max(r["anon_max"] for r in fast)
        out.update(anon_all_mean=int(m), anon_all_range=[lo, hi],
                   anon_all_spread_pct=round(100 * max(hi - m, m - lo) / m, 1) if m else 0.0)
    for k in ("open_files", "maps", "threads", "disk_bytes", "rss_file"):
        vals = [r[k] for r in late]
        out[k] = [min(vals), max(vals)]
    out["p99_ms"] = [min(r["p99_ms"] for r in late), max(r["p99_ms"] for r in late)]
    return out


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib  # optional: the bench extra
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: the bench extra
    t = [r["t_s"] / 60 for r in rows]
    fig, ax = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    ax[0].plot(t, [r["rss_anon"] / 2**20 for r in rows], label="anonymous")
    band = [r for r in rows if r.get("anon_n")]
    if band:
        ax[0].fill_between([r["t_s"] / 60 for r in band], [r["anon_min"] / 2**20 for r in band],
                           [r["anon_max"] / 2**20 for r in band], alpha=0.3,
                           label="anonymous, lowest-highest between two rows")
    ax[0].plot(t, [r["rss_file"] / 2**20 for r in rows], label="file-backed")
    ax[0].set_ylabel("memory (MiB)")
    ax[1].plot(t, [r["open_files"] for r in rows], label="open files")
    ax[1].plot(t, [r["maps"] for r in rows], label="memory maps")
    ax[1].plot(t, [r["threads"] for r in rows], label="threads")
    ax[1].set_ylabel("count")
    ax[2].plot(t, [r["disk_bytes"] / 2**20 for r in rows], label="data dir")
    ax[2].set_ylabel("disk (MiB)")
    ax[3].plot(t, [r["p99_ms"] for r in rows], label="p99")
    ax[3].plot(t, [r["p50_ms"] for r in rows], label="p50")
    ax[3].set_ylabel("latency (ms)")
    ax[3].set_xlabel("minutes")
    for a in ax:
        a.legend(loc="upper left")
        a.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lmqtt bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=7200, help="seconds of load (default 7200)")
    p.add_argument("--devices", type=int, default=2000, help="MQTT devices (default 2000)")
    p.add_argument("--rate", type=float, default=2000, help="QoS 1 messages per second in all (default 2000)")
    p.add_argument("--churn-per-min", type=float, default=2000, help="reconnects per minute in all (default 2000)")
    p.add_argument("--retention", default="10m", help="the broker's --retention (default 10m)")
    p.add_argument("--segment-mb", type=int, default=32, help="the broker's --segment-mb (default 32)")
    p.add_argument("--sample-s", type=float, default=10, help="seconds between samples (default 10)")
    p.add_argument("--fast-s", type=float, default=0.5,
                   help="seconds between the readings of anonymous memory within a row (default 0.5)")
    p.add_argument("--settle-s", type=float, default=None, help="the summary's measures start after this "
                                                                "(default: the retention)")
    p.add_argument("--out", help="directory for soak.jsonl and the broker's log (default: a temp dir)")
    p.add_argument("--plot", help="draw the samples into this PNG")
    p.add_argument("--quiet", action="store_true", help="no row per sample on stdout")
    args = p.parse_args(argv)
    settle = args.settle_s if args.settle_s is not None else (parse_retention(args.retention, "--retention")[0] or 0) / 1000
    out = args.out or tempfile.mkdtemp(prefix="lmqtt-bench-soak-")
    os.makedirs(out, exist_ok=True)
    data = os.path.join(out, "data")
    shutil.rmtree(data, ignore_errors=True)
    b = Broker(data, os.path.join(out, "serve.log"),
               extra=["--retention", args.retention, "--segment-mb", str(args.segment_mb)])
    rows_path = os.path.join(out, "soak.jsonl")
    b.start()
    malloc = _malloc_of(b.proc.pid) if b.proc is not None else "unknown"
    try:
        result = asyncio.run(_run(args, b, rows_path))
    finally:
        b.stop(signal.SIGTERM)
    with open(rows_path) as f:
        rows = [json.loads(ln) for ln in f]
    summary = {"phase": "summary", "duration_s": args.duration, "devices": args.devices, "rate": args.rate,
               "churn_per_min": args.churn_per_min, "retention": args.retention, "settle_s": settle,
               "malloc": malloc,
               **result, **summarize(rows, settle), "error_lines": len(b.error_lines())}
    print(json.dumps(summary), flush=True)
    if args.plot and rows:
        plot(rows, args.plot, f"lmqtt serve ({malloc}), {args.devices} devices, {args.rate:g} msg/s QoS 1, "
                              f"{args.churn_per_min:g} reconnects/min, retention {args.retention}")
    return 0 if result["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
