"""An independent check of the latency generator: the ``latency`` scenario written with paho-mqtt.

    lmqtt bench paho-latency --port 1883 [--pairs 50] [--rate 5000] [--duration 10]
        [--procs 4] [--qos 1]

Nothing of lmqtt's generator is used (no ``mqtt_client``, ``stamp``, ``histogram``, no lmqtt
codec): paho's clients, the payload is ``!Q`` of ``time.monotonic_ns()`` at ``publish()``, the
receive time is read in paho's ``on_message``, percentiles are taken from the sorted list of
every latency. ``pairs`` publisher/subscriber pairs (publisher ``i`` publishes to ``.../i``, its
subscriber subscribes to it) are spread over ``procs`` processes; each process drives its
clients from one ``select`` loop (paho's ``loop_read``/``loop_write``/``loop_misc``, no paho
threads: with a thread per client the GIL's 5 ms switch interval would be measured) and sends its
share of the rate on an even schedule (message ``s`` of the run at ``t0 + s / rate``, publisher
``s % pairs``), ``select``'s microsecond timeout between sends. The receive time is taken in
user space after paho parsed the packet, so this overstates the broker's latency by paho's own
time; ``lmqtt bench``'s paced worker uses kernel receive timestamps and should read a little
lower, not higher. Needs ``paho-mqtt`` (``pip install paho-mqtt``); prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import select
import struct
import sys
import time

_Q = struct.Struct("!Q")


def _proc(host: str, port: int, pairs: list[int], n_pairs: int, rate: float, qos: int, t0: int,
          t_end: int, run: str, ready, out) -> None:
    import paho.mqtt.client as mqtt  # optional: the bench and spark extras
    lat: list[int] = []
    subs, pubs = {}, {}

    def on_message(_c, _u, msg) -> None:
        lat.append(time.monotonic_ns() - _Q.unpack_from(msg.payload)[0])

    def client(cid: str):
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cid, protocol=mqtt.MQTTv311)
        c.max_inflight_messages_set(10)
        c.connect(host, port, keepalive=300)
        return c

    for i in pairs:
        s = subs[i] = client(f"paho-{run}-s{i}")
        s.on_message = on_message
        s.subscribe(f"paho/{run}/{i}", qos)
        pubs[i] = client(f"paho-{run}-p{i}")
    everyone = list(subs.values()) + list(pubs.values())
    # CONNACK and SUBACK for everyone before the clock starts
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(c.is_connected() for c in everyone):
        _serve(everyone, 0.01)
    _serve(everyone, 0.2)
    ready.send(sum(c.is_connected() for c in everyone))
    interval = 1e9 / rate
    mine = sorted(pairs)
    slot_j, cycle = 0, 0
    next_t = t0 + int(mine[0] * interval)
    sent = 0
    while True:
        now = time.monotonic_ns()
        if now >= t_end:
            break
        while next_t <= now:
            i = mine[slot_j]
            pubs[i].publish(f"paho/{run}/{i}", _Q.pack(time.monotonic_ns()) + b"x" * 48, qos)
            sent += 1
            slot_j += 1
            if slot_j == len(mine):
                slot_j, cycle = 0, cycle + 1
            next_t = t0 + int((cycle * n_pairs + mine[slot_j]) * interval)
        _serve(everyone, max(0.0, (min(next_t, t_end) - time.monotonic_ns()) / 1e9))
    drain = time.monotonic() + 5
    while time.monotonic() < drain and len(lat) < sent:
        _serve(everyone, 0.01)
    for c in everyone:
        c.disconnect()
    out.send((sent, lat))


def _serve(clients, timeout: float, _misc=[0.0]) -> None:
    socks = {c.socket(): c for c in clients}
    socks.pop(None, None)
    wr = [s for s, c in socks.items() if c.want_write()]
    r, w, _ = select.select(list(socks), wr, [], timeout)
    for s in r:
        socks[s].loop_read()
    for s in w:
        socks[s].loop_write()
    if time.monotonic() - _misc[0] > 0.1:  # keepalive and retry bookkeeping, ten times a second
        _misc[0] = time.monotonic()
        for c in clients:
            c.loop_misc()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmqtt bench paho-latency", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--pairs", type=int, default=50)
    ap.add_argument("--rate", type=float, default=5000.0, help="total msg/s")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--qos", type=int, default=1, choices=(0, 1, 2))
    a = ap.parse_args(argv)
    try:
        import paho.mqtt.client  # noqa: F401
    except ImportError:
        print("paho_latency: paho-mqtt is not installed (pip install paho-mqtt)", file=sys.stderr)
        return 2
    ctx = mp.get_context("fork")
    run = f"{os.getpid():x}"
    t0 = time.monotonic_ns() + 3_000_000_000
    t_end = t0 + int(a.duration * 1e9)
    procs = []
    for k in range(a.procs):
        mine = list(range(k, a.pairs, a.procs))
        if not mine:
            continue
        r_a, r_b = ctx.Pipe()
        o_a, o_b = ctx.Pipe()
        p = ctx.Process(target=_proc, args=(a.host, a.port, mine, a.pairs, a.rate, a.qos, t0, t_end, run,
                                           r_b, o_b), daemon=True)
        p.start()
        procs.append((p, r_a, o_a))
    connected = sum(r.recv() for _p, r, _o in procs)
    if time.monotonic_ns() > t0:
        print("paho_latency: connecting took longer than the 3 s before the start", file=sys.stderr)
    sent, lat = 0, []
    for p, _r, o in procs:
        s, lt = o.recv()
        sent += s
        lat.extend(lt)
        p.join(10)
    lat.sort()

    def pct(q: float) -> float | None:
        return round(lat[min(len(lat) - 1, int(q / 100 * len(lat)))] / 1e3, 1) if lat else None
    print(json.dumps({"tool": "paho", "connected": connected, "sent": sent, "received": len(lat),
                      "rate": a.rate, "pairs": a.pairs, "procs": a.procs, "qos": a.qos,
                      "p50_us": pct(50), "p90_us": pct(90), "p99_us": pct(99), "p99.9_us": pct(99.9),
                      "max_us": round(lat[-1] / 1e3, 1) if lat else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
