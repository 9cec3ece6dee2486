"""Shared-subscription throughput: messages/s through one `$share/` group of 4 QoS 1 members, on
`lmqtt serve` (one gateway), on a fleet (`lmqtt store` + 2 gateways, 2 members on each: the store
hands each message to one gateway, docs/fleet.md "Shared subscriptions across gateways") and on
Mosquitto, in the same run.

    lmqtt bench shared --messages 20000 --repeat 2 [--brokers mosquitto,lmqtt,lmqtt-fleet]
        [--lmqtt-src DIR] [--out FILE.json]

One publisher (MQTT 3.1.1, QoS 1, 64-byte payloads, `--window` PUBLISHes in flight) on the first
port; the members subscribe `$share/bench/bench/shared` at QoS 1 and acknowledge each message at
once. The figure is N / (time from the first PUBLISH to the N-th distinct message received by the
members); each run also checks every message arrived once (duplicates and missing counted) and
prints each member's share. Everything is bounded: `--messages` per run, `--timeout` s per run,
loopback only, brokers started as our own children (loadtest/brokers.py) and stopped by PID.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

from lmqtt.gateway.mqtt import Decoder, encode, packets as P
from lmqtt.gateway.mqtt.encoder import encode_publish
from lmqtt.loadtest import brokers

TOPIC = "bench/shared"
FILTER = f"$share/bench/{TOPIC}"
_SEQ = struct.Struct("!Q")


class _Conn(asyncio.Protocol):
    """One MQTT 3.1.1 connection: CONNECT/SUBSCRIBE by the codec, PUBLISH acknowledged at once."""

    def __init__(self, client_id: str, on_message=None) -> None:
        self.client_id = client_id
        self.dec = Decoder(4, server_side=False)
        self.on_message = on_message
        self.on_puback = None
        self.waiting: dict[type, asyncio.Future] = {}
        self.transport = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)

    def data_received(self, data: bytes) -> None:
        acks = []
        for pkt in self.dec.feed(data):
            t = type(pkt)
            if t is P.Publish:
                if pkt.qos == 1:
                    acks.append(encode(P.PubAck(pkt.packet_id), 4))
                if self.on_message is not None:
                    self.on_message(pkt.payload)
            elif t is P.PubAck:
                if self.on_puback is not None:
                    self.on_puback(pkt.packet_id)
            else:
                f = self.waiting.pop(t, None)
                if f is not None and not f.done():
                    f.set_result(pkt)
        if acks:
            self.transport.write(b"".join(acks))

    async def expect(self, t: type, send: bytes, timeout: float = 10.0):
        f = asyncio.get_running_loop().create_future()
        self.waiting[t] = f
        self.transport.write(send)
        return await asyncio.wait_for(f, timeout)


async def _connect(port: int, client_id: str, on_message=None) -> _Conn:
    loop = asyncio.get_running_loop()
    _t, c = await loop.create_connection(lambda: _Conn(client_id, on_message), "127.0.0.1", port)
    ack = await c.expect(P.ConnAck, encode(P.Connect(client_id=client_id, protocol_level=4, keepalive=60), 4))
    if ack.reason_code:
        raise RuntimeError(f"CONNACK {ack.reason_code} for {client_id}")
    return c


async def one_run(ports: list[int], n: int, window: int, members_per_port: int, timeout: float) -> dict:
    received: list[list[int]] = []
    seen: set[int] = set()
    dups = 0
    done = asyncio.get_running_loop().create_future()
    members = []
    for pi, port in enumerate(ports):
        for k in range(members_per_port):
            box: list[int] = []
            received.append(box)

            def got(payload: bytes, box=box) -> None:
                nonlocal dups
                seq = _SEQ.unpack_from(payload)[0]
                box.append(seq)
                if seq in seen:
                    dups += 1
                else:
                    seen.add(seq)
                    if len(seen) >= n and not done.done():
                        done.set_result(time.perf_counter())
            c = await _connect(port, f"shb-m{pi}-{k}-{time.monotonic_ns() % 10**9}", got)
            await c.expect(P.SubAck, encode(P.Subscribe(1, [P.SubscriptionRequest(FILTER, qos=1)]), 4))
            members.append(c)
    await asyncio.sleep(0.5)        # every member's group known to the broker (fleet: to the store)
    pub = await _connect(ports[0], f"shb-pub-{time.monotonic_ns() % 10**9}")
    free = asyncio.Event()
    inflight: set[int] = set()

    def puback(pid: int) -> None:
        inflight.discard(pid)
        if len(inflight) < window:
            free.set()
    pub.on_puback = puback
    pad = b"x" * 56
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout
    seq = 0
    pid = 0
    while seq < n and time.monotonic() < deadline:
        room = window - len(inflight)
        if room <= 0:
            free.clear()
            try:
                await asyncio.wait_for(free.wait(), max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
            continue
        out = []
        for _ in range(min(room, n - seq, 64)):
            pid = pid % 65535 + 1
            inflight.add(pid)
            out.append(encode_publish(TOPIC, _SEQ.pack(seq) + pad, qos=1, packet_id=pid))
            seq += 1
        pub.transport.write(b"".join(out))
        await asyncio.sleep(0)
    t_pub = time.perf_counter()
    try:
        t1 = await asyncio.wait_for(done, max(0.1, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        t1 = None
    await asyncio.sleep(0.3)        # a late duplicate would show
    for c in (*members, pub):
        c.transport.write(encode(P.Disconnect(), 4))
        c.transport.close()
    shares = [len(r) for r in received]
    return {"messages": n, "received_distinct": len(seen), "missing": n - len(seen), "duplicates": dups,
            "shares": shares, "publish_s": round(t_pub - t0, 3),
            "msgs_per_s": round(n / (t1 - t0)) if t1 else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmqtt bench shared", description=__doc__.split("\n\n")[0])
    ap.add_argument("--brokers", default="mosquitto,lmqtt,lmqtt-fleet")
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--window", type=int, default=256, help="the publisher's PUBLISHes in flight")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=60.0, help="bound of one run (s)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--lmqtt-src", help="run lmqtt from this source tree (a `git archive` snapshot with its C "
                                        "modules built), not the installed package")
    a = ap.parse_args(argv)
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="shared-bench-") as tmp:
        for name in a.brokers.split(","):
            try:
                rb = brokers.start(name, Path(tmp) / name, lmqtt_src=a.lmqtt_src if name.startswith("lmqtt") else None)
            except brokers.BrokerUnavailable as e:
                print(f"{name}: not available: {e}", file=sys.stderr)
                continue
            try:
                ports = [rb.port, *rb.extra_ports] if name == "lmqtt-fleet" else [rb.port]
                per = 4 // len(ports)
                runs = []
                for _ in range(a.repeat):
                    r = asyncio.run(one_run(ports, a.messages, a.window, per, a.timeout))
                    runs.append(r)
                    print(f"{name:12s} {r['msgs_per_s']} msg/s  shares {r['shares']}  missing {r['missing']}"
                          f"  duplicates {r['duplicates']}", flush=True)
                results[name] = runs
            finally:
                rb.stop()
    print("\nmedian msg/s through a group of 4 QoS 1 members (loaded VM: compare within this run):")
    med = {k: statistics.median([r["msgs_per_s"] or 0 for r in v]) for k, v in results.items()}
    for k, v in med.items():
        ratio = f"  {v / med['mosquitto']:.2f}x Mosquitto" if med.get("mosquitto") else ""
        print(f"  {k:12s} {v:>8.0f}{ratio}")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "runs": results, "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
