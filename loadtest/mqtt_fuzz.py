"""Live MQTT fuzzer: random and mutated packets over many short TCP connections to a broker.

`lmqtt bench fuzz --port N [--packets 1000000 --seconds 300 --connections 8]`

Why this shape: a broker's decoder is only trustworthy if hostile bytes cannot take it down or wedge
it for other clients. Each fuzz connection sends a burst (usually a valid CONNECT followed by valid
packets with one mutated packet somewhere, sometimes raw garbage or a mutated CONNECT), half-closes,
reads whatever the broker answers (checking that the answer itself decodes) and closes. Meanwhile, and
once more at the end, a well-behaved client (our codec on a plain socket) connects, subscribes,
publishes QoS 1 and must receive its own message. The run is bounded by both packet count and time.

Progress goes to stderr, a JSON summary to stdout; exit status 0 only when every health check passed.
Only loopback targets are accepted. Retained topics and persistent client ids are drawn from small
pools so the fuzz cannot grow the broker's state without bound.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import random
import socket
import sys
import threading
import time
import uuid

from lmqtt.gateway.mqtt import Decoder, ProtocolError, encode
from lmqtt.gateway.mqtt import packets as P
from lmqtt.gateway.mqtt.decoder import REASON_CODES_V5
from lmqtt.gateway.mqtt.properties import PROPERTY_TABLE, WILL
from lmqtt.gateway.mqtt.wire import encode_varint

__all__ = ["main", "PacketFactory", "mutate", "health_check"]

# ----------------------------------------------------------------------------- valid packets
_WORDS = ["fuzz", "a", "b", "sensor", "温度", "dev-1", "x" * 40, "", "$x", "ü", "😀"]


class PacketFactory:
    """Random *valid* client packets (for a given protocol version) from a seeded RNG."""

    def __init__(self, rng: random.Random) -> None:
        self.r = rng

    def text(self, n: int = 12) -> str:
        r = self.r
        if r.random() < 0.7:
            return "".join(r.choice("abcdefghijklmnopqrstuvwxyz0123456789-_") for _ in range(r.randint(0, n)))
        return "".join(chr(r.choice([r.randint(1, 0x7F), r.randint(0x80, 0xD7FF), r.randint(0xE000, 0x10FFFF)]))
                       for _ in range(r.randint(0, n)))

    def topic(self) -> str:
        r = self.r
        return "fuzz/" + "/".join(r.choice(_WORDS) if r.random() < 0.5 else self.text(6).replace("+", "")
                                  .replace("#", "") for _ in range(r.randint(0, 3)))

    def topic_filter(self) -> str:
        r = self.r
        levels = ["fuzz"] + [r.choice(["+", "a", "b", self.text(4).replace("+", "").replace("#", "")])
                             for _ in range(r.randint(0, 3))]
        if r.random() < 0.3:
            levels.append("#")
        f = "/".join(levels)
        if r.random() < 0.1:
            f = f"$share/g{r.randint(0, 3)}/{f}"
        return f

    def properties(self, ptype: int, version: int) -> P.Properties:
        props = P.Properties()
        if version != 5 or self.r.random() < 0.5:
            return props
        r = self.r
        for attr, kind, types, _ in PROPERTY_TABLE.values():
            if ptype not in types or r.random() < 0.7:
                continue
            if attr == "subscription_identifier":
                props.subscription_identifier.append(r.randint(1, 268_435_455))
            elif attr == "user_property":
                props.user_property.extend((self.text(6), self.text(6)) for _ in range(r.randint(1, 3)))
            elif kind == "byte":
                setattr(props, attr, r.randint(0, 1))
            elif kind == "u16":
                setattr(props, attr, r.randint(1, 0xFFFF))
            elif kind == "u32":
                setattr(props, attr, r.randint(1, 0xFFFFFFFF) if attr != "session_expiry_interval"
                        else r.randint(0, 60))
            elif kind == "str":
                setattr(props, attr, self.text())
            else:
                setattr(props, attr, r.randbytes(r.randint(0, 16)))
        if ptype == 3:  # an alias the broker never heard of is legal to refuse; keep most publishes plain
            props.topic_alias = None
            props.subscription_identifier.clear()  # a client's PUBLISH must not carry one
        if props.authentication_data is not None and props.authentication_method is None:
            props.authentication_method = "fuzz"
        return props

    def connect(self, version: int) -> P.Connect:
        r = self.r
        clean = r.random() < 0.8
        cid = f"fuzz-{uuid.uuid4().hex[:12]}" if clean else f"fuzz-p{r.randint(0, 31)}"
        will = None
        if r.random() < 0.3:
            will = P.Will(self.topic(), r.randbytes(r.randint(0, 32)), r.randint(0, 2), False,
                          self.properties(WILL, version))
        user = self.text() if r.random() < 0.3 else None
        pw = r.randbytes(8) if user is not None and r.random() < 0.5 else None
        return P.Connect(cid, version, clean, r.randint(5, 120), user, pw, will, self.properties(1, version))

    def packet(self, version: int):
        r = self.r
        k = r.random()
        pid = r.randint(1, 0xFFFF)
        if k < 0.45:
            qos = r.randint(0, 2)
            retain = r.random() < 0.05
            topic = f"fuzz/r/{r.randint(0, 15)}" if retain else self.topic()
            return P.Publish(topic, r.randbytes(r.choice([0, 1, 10, 100, 1000])), qos, retain,
                             qos > 0 and r.random() < 0.1, pid if qos else None, self.properties(3, version))
        if k < 0.6:
            subs = []
            for _ in range(r.randint(1, 4)):
                f = self.topic_filter()
                v5 = version == 5
                subs.append(P.SubscriptionRequest(f, r.randint(0, 2),
                                                  v5 and not f.startswith("$share/") and r.random() < 0.3,
                                                  v5 and r.random() < 0.3, r.randint(0, 2) if v5 else 0))
            props = self.properties(8, version)
            del props.subscription_identifier[1:]
            return P.Subscribe(pid, subs, props)
        if k < 0.7:
            return P.Unsubscribe(pid, [self.topic_filter() for _ in range(r.randint(1, 3))],
                                 self.properties(10, version))
        if k < 0.85:
            cls, t = r.choice([(P.PubAck, 4), (P.PubRec, 5), (P.PubRel, 6), (P.PubComp, 7)])
            rc = r.choice(sorted(REASON_CODES_V5[t])) if version == 5 else 0
            return cls(pid, rc, self.properties(t, version))
        if k < 0.97:
            return P.PingReq()
        if version == 5 and r.random() < 0.5:
            return P.Auth(0x19, self.properties(15, version))
        return P.Disconnect(r.choice([0, 4]) if version == 5 else 0, self.properties(14, version))


# ----------------------------------------------------------------------------- mutations
_INTERESTING = [0x00, 0x01, 0x02, 0x7F, 0x80, 0xFF, 0xFE, 0x26, 0x0B, 0x23, 0x3F, 0x30, 0xC0, 0x62]


def mutate(rng: random.Random, data: bytes) -> bytes:
    """1..4 random edits: bit flips, interesting bytes, inserts, deletes, truncation, header lies."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(9)
        i = rng.randrange(len(b)) if b else 0
        if op == 0 and b:
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[i] = rng.choice(_INTERESTING)
        elif op == 2:
            b[i:i] = rng.randbytes(rng.randint(1, 8))
        elif op == 3 and b:
            del b[i:i + rng.randint(1, 4)]
        elif op == 4:
            del b[rng.randint(0, len(b)):]
        elif op == 5 and b:  # change the packet type / flags nibble
            b[0] = rng.randrange(256)
        elif op == 6 and len(b) > 1:  # lie about the remaining length
            rl = rng.choice([0, 1, 127, 128, 16384, 2_097_152, 268_435_455])
            b[1:2] = encode_varint(rl)
        elif op == 7 and len(b) > 1:  # 5-byte remaining length
            b[1:2] = b"\xff\xff\xff\xff\x7f"
        elif op == 8 and b:  # invalid UTF-8 / NUL / surrogate somewhere
            b[i:i + 1] = rng.choice([b"\x00", b"\xff", b"\xed\xa0\x80", b"\xc0\x80"])
    return bytes(b)


# ----------------------------------------------------------------------------- health check
def _recv_until(sock: socket.socket, dec: Decoder, want, deadline: float) -> list:
    got: list = []
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("broker closed the connection")
        for p in dec.feed(data):
            got.append(p)
            if want(p):
                return got
    raise TimeoutError("no answer from the broker in time")


def health_check(host: str, port: int, version: int = 4, timeout: float = 5.0) -> tuple[bool, str, float]:
    """Connect, subscribe QoS 1, publish QoS 1 to that topic, expect PUBACK and our own message."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    tag = uuid.uuid4().hex[:12]
    topic = f"fuzz-check/{tag}"
    payload = f"health {tag}".encode()
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            dec = Decoder(version, server_side=False)
            s.sendall(encode(P.Connect(f"fuzz-check-{tag}", version, True, 30), version))
            ack = _recv_until(s, dec, lambda p: isinstance(p, P.ConnAck), deadline)[-1]
            if ack.reason_code != 0:
                return False, f"CONNACK refused with code {ack.reason_code}", time.monotonic() - t0
            s.sendall(encode(P.Subscribe(1, [P.SubscriptionRequest(topic, 1)]), version))
            suback = _recv_until(s, dec, lambda p: isinstance(p, P.SubAck), deadline)[-1]
            if suback.reason_codes[0] >= 0x80:
                return False, f"SUBACK refused with code {suback.reason_codes[0]}", time.monotonic() - t0
            s.sendall(encode(P.Publish(topic, payload, 1, packet_id=2), version))
            seen = {"puback": False, "msg": False}

            def done(p) -> bool:
                if isinstance(p, P.PubAck) and p.packet_id == 2:
                    seen["puback"] = True
                elif isinstance(p, P.Publish) and p.topic == topic and p.payload == payload:
                    seen["msg"] = True
                    if p.qos == 1:
                        s.sendall(encode(P.PubAck(p.packet_id), version))
                return seen["puback"] and seen["msg"]

            _recv_until(s, dec, done, deadline)
            s.sendall(encode(P.Disconnect(), version))
        return True, "ok", time.monotonic() - t0
    except (OSError, ProtocolError, TimeoutError, ConnectionError) as e:
        return False, f"{type(e).__name__}: {e}", time.monotonic() - t0


# ----------------------------------------------------------------------------- fuzz workers
class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.packets = self.connections = self.bytes_sent = self.bytes_received = 0
        self.mutated = self.garbage = 0
        self.connect_errors = self.send_errors = 0
        self.responses_malformed = 0
        self.consecutive_connect_errors = 0
        self.checks: list[dict] = []
        self.first_malformed_response: str | None = None


def _one_connection(host: str, port: int, rng: random.Random, fac: PacketFactory, stats: Stats,
                    budget: int) -> None:
    """One short connection carrying exactly `budget` packets (already reserved in stats.packets)."""
    version = rng.choices([3, 4, 5], [1, 4, 5])[0]
    mode = rng.random()
    chunks: list[bytes] = []
    n_mut = n_garbage = 0
    if mode < 0.05 or budget == 1:  # raw garbage
        chunks.append(rng.randbytes(rng.randint(1, 512)))
        n_garbage = 1
    else:
        connect = encode(fac.connect(version), version)
        if mode < 0.2:
            chunks.append(mutate(rng, connect))
            n_mut = 1
        else:
            chunks.append(connect)
        body = [encode(fac.packet(version), version) for _ in range(budget - 1)]
        if body and rng.random() < 0.8:
            i = rng.randrange(len(body))
            body[i] = mutate(rng, body[i])
            n_mut += 1
        chunks.extend(body)
    data = b"".join(chunks)
    try:
        s = socket.create_connection((host, port), timeout=2.0)
    except OSError:
        with stats.lock:
            stats.packets -= budget  # nothing was sent
            stats.connect_errors += 1
            stats.consecutive_connect_errors += 1
        time.sleep(0.05)
        return
    received = bytearray()
    try:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the broker hung up on a bad packet: expected
            with stats.lock:
                stats.send_errors += 1
        s.settimeout(0.5)
        try:
            while len(received) < 1 << 20:
                d = s.recv(65536)
                if not d:
                    break
                received += d
        except OSError:
            pass
    finally:
        s.close()
    malformed = None
    if received and n_garbage == 0 and n_mut == 0:
        # a well-formed session: the broker's answers must decode too
        try:
            Decoder(version, server_side=False).feed(bytes(received))
        except ProtocolError as e:
            malformed = f"v{version}: {e}"
    with stats.lock:
        stats.consecutive_connect_errors = 0
        stats.connections += 1
        stats.bytes_sent += len(data)
        stats.bytes_received += len(received)
        stats.mutated += n_mut
        stats.garbage += n_garbage
        if malformed:
            stats.responses_malformed += 1
            stats.first_malformed_response = stats.first_malformed_response or malformed


def _worker(host: str, port: int, seed: int, stats: Stats, target: int, deadline: float,
            stop: threading.Event) -> None:
    rng = random.Random(seed)
    fac = PacketFactory(rng)
    while not stop.is_set() and time.monotonic() < deadline:
        want = rng.randint(1, 64)
        with stats.lock:  # reserve this connection's packets so the total never exceeds the target
            n = min(want, target - stats.packets)
            stats.packets += max(n, 0)
            if stats.consecutive_connect_errors > 200:
                stop.set()
        if n <= 0:
            return
        _one_connection(host, port, rng, fac, stats, n)


def _check(host: str, port: int, stats: Stats, phase: str, version: int) -> bool:
    ok, msg, secs = health_check(host, port, version)
    with stats.lock:
        stats.checks.append({"phase": phase, "version": version, "ok": ok, "message": msg,
                             "seconds": round(secs, 4)})
    return ok


def _loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(ai[4][0]).is_loopback
                   for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
    except (OSError, ValueError):
        return False


def run(host: str, port: int, packets: int, seconds: float, connections: int, seed: int,
        check_interval: float = 10.0, progress=sys.stderr) -> dict:
    stats = Stats()
    t0 = time.monotonic()
    deadline = t0 + seconds
    stop = threading.Event()
    pre_ok = _check(host, port, stats, "before", 4)
    workers = [threading.Thread(target=_worker, args=(host, port, seed * 1000 + i, stats, packets,
                                                      deadline, stop), daemon=True, name=f"fuzz-{i}")
               for i in range(connections)]
    for w in workers:
        w.start()
    next_check = time.monotonic() + check_interval
    version = 5
    while any(w.is_alive() for w in workers):
        time.sleep(0.5)
        now = time.monotonic()
        if now >= next_check:
            _check(host, port, stats, "during", version)
            version = 9 - version
            next_check = now + check_interval
            with stats.lock:
                el = now - t0
                print(f"[fuzz] {el:6.1f}s packets={stats.packets} conns={stats.connections} "
                      f"({stats.packets / el:.0f} pkt/s) mutated={stats.mutated} garbage={stats.garbage} "
                      f"connect_errors={stats.connect_errors} checks_failed="
                      f"{sum(not c['ok'] for c in stats.checks)}", file=progress, flush=True)
    for w in workers:
        w.join()
    elapsed = time.monotonic() - t0
    final = [_check(host, port, stats, "after", v) for v in (4, 5)]
    failed = [c for c in stats.checks if not c["ok"]]
    return {
        "target": f"{host}:{port}", "seed": seed, "seconds": round(elapsed, 2),
        "packets_sent": stats.packets, "packets_per_second": round(stats.packets / elapsed, 1),
        "connections": stats.connections, "bytes_sent": stats.bytes_sent,
        "bytes_received": stats.bytes_received, "mutated_packets": stats.mutated,
        "garbage_bursts": stats.garbage, "connect_errors": stats.connect_errors,
        "send_errors_broker_hung_up": stats.send_errors,
        "broker_responses_malformed": stats.responses_malformed,
        "first_malformed_response": stats.first_malformed_response,
        "health_checks": len(stats.checks), "health_checks_failed": len(failed),
        "failed_checks": failed[:10], "healthy_before": pre_ok, "healthy_after": all(final),
        "stopped_early_broker_unreachable": stop.is_set(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmqtt bench fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=1883)
    ap.add_argument("--packets", type=int, default=1_000_000, help="stop after this many packets")
    ap.add_argument("--seconds", type=float, default=300.0, help="stop after this many seconds")
    ap.add_argument("--connections", type=int, default=8, help="concurrent fuzz connections")
    ap.add_argument("--seed", type=int, default=None, help="RNG seed (printed; reuse to replay)")
    ap.add_argument("--check-interval", type=float, default=10.0,
                    help="seconds between well-behaved-client health checks while fuzzing")
    a = ap.parse_args(argv)
    if not _loopback(a.host):
        print(f"mqtt_fuzz: refusing non-loopback target {a.host!r}", file=sys.stderr)
        return 2
    if a.packets <= 0 or a.seconds <= 0 or a.connections <= 0:
        print("mqtt_fuzz: --packets, --seconds and --connections must be positive", file=sys.stderr)
        return 2
    seed = a.seed if a.seed is not None else random.randrange(1 << 31)
    print(f"[fuzz] target {a.host}:{a.port} packets<={a.packets} seconds<={a.seconds} "
          f"connections={a.connections} seed={seed}", file=sys.stderr, flush=True)
    summary = run(a.host, a.port, a.packets, a.seconds, a.connections, seed, a.check_interval)
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    ok = summary["healthy_before"] and summary["healthy_after"] and summary["health_checks_failed"] == 0
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
