"""`lmqtt bench fuzz-store`: random and mutated native-protocol frames at a live `lmqtt store`, then
check that it still serves and that nothing stored is corrupt or foreign.

    lmqtt bench fuzz-store [--store HOST:PORT | (starts its own lmqtt store)] [--frames 20000]
                           [--seed N] [--workers 4] [--max-seconds 600]

Frames are built from valid HELLO / PRODUCE / PULL / PULL_FILTER / CALL frames, then (most of
them) mutated: truncated, bit-flipped, length field corrupted (below the header, off by a few,
huge), oversized (above the announced frame limit), opcode changed, spliced with another frame,
replaced by random bytes; CALLs also get arguments of the wrong type. They go out on many short
connections (a few with no HELLO first), several in flight at once; each connection is closed
after its burst and its replies are drained until the server closes or 2 s pass.

Checks after the run (exit 1 if one fails, the JSON summary names it):
* the server process is alive (when started here) and a fresh SDK connection does a send + pull
  round trip, and control messages sent with the SDK during the run are all stored byte-exact;
* every record of every ConsumeQueue pulls and decodes (`pull` from min to max);
* no stored record is foreign: each (topic, body) was in a PRODUCE frame that the server could
  have parsed from some connection's byte stream (the stream is replayed through the same frame
  decoder, so a corrupted length that re-frames the following bytes is accounted for);
* the store's `corrupt_ranges` stat stays 0.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import socket
import struct
import sys
import threading
import time

from lmqtt.store import protocol as W
from lmqtt.store.client import connect

from .sdk_bench import LmqttProc

TOPICS = ["fz/a", "fz/b/c", "fz/dev/1/temp", "fzq/x", "fz", "fz/\u00e9t\u00e9"]
BAD_TOPICS = ["fz/+/bad", "fz/#", ""]
FILTERS = ["fz/#", "fz/+/c", "fz/dev/+/temp", "+/b/#", "fz/#/bad", "", "#"]
CMDS = ["offsets", "topics", "stats", "commit", "committed", "lag", "get_by_msg_id", "query_by_key",
        "offset_for_time", "pop", "ack", "change_invisible_time", "pop_info", "subscribe", "filter_offsets",
        "nope"]
WEIRD = [None, -1, 0, 2 ** 63, 2 ** 64 + 5, 1.5, "x", "", [], {}, [1, "a"], True, "fz/#", "\u0000", 10 ** 30]


def _key(topic: str, body: bytes) -> bytes:
    return hashlib.blake2b(topic.encode("utf-8", "surrogatepass") + b"\0" + body, digest_size=16).digest()


class Gen:
    def __init__(self, rnd: random.Random, max_frame: int) -> None:
        self.r = rnd
        self.max_frame = max_frame
        self.rid = 0

    def _rid(self) -> int:
        self.rid = (self.rid + 1) & 0xFFFFFFFF
        return self.rid

    def produce(self) -> bytes:
        r = self.r
        msgs = []
        for _ in range(r.choice((1, 1, 2, 5, 20))):
            body = r.randbytes(r.choice((0, 1, 10, 100, 1000)))
            keys = tuple(r.choice(("k1", "k2", "dev-a")) for _ in range(r.randint(0, 2)))
            props = r.choice((b"", b"\x01", r.randbytes(r.randint(0, 20))))
            topic = r.choice(BAD_TOPICS) if r.random() < 0.02 else r.choice(TOPICS)
            msgs.append((topic, body, keys, props, r.choice((0, 0, 1, 7)), r.choice((0, 0, 123))))
        pid = r.choice(("", "fz-p1", "fz-p2"))
        seq = r.choice((0, r.randint(1, 2 ** 40)))
        return W.frame(W.OP_PRODUCE, self._rid(),
                       W.encode_produce(pid, seq, len(msgs), W.encode_messages_for_produce(msgs)))

    def pull(self) -> bytes:
        r = self.r
        op = r.choice((W.OP_PULL, W.OP_PULL_FILTER))
        name = r.choice(FILTERS if op == W.OP_PULL_FILTER else ["fz", "fzq", "nope", "", "fz/a"])
        body = W.encode_pull(name, r.choice((0, 1, 2 ** 31)), r.choice((0, 5, 2 ** 62)),
                             r.choice((0, 1, 256, 2 ** 32 - 1)), r.choice((0, 1, 4096, 2 ** 32 - 1)),
                             r.choice(("", "g")))
        return W.frame(op, self._rid(), body)

    def call(self) -> bytes:
        r = self.r
        args = {"cmd": r.choice(CMDS)}
        for k in r.sample(["topic", "queue_id", "group", "offset", "offsets", "filter", "msg_id", "key", "ts",
                           "max_count", "invisible_ms", "max_attempts", "begin_ms", "end_ms"], r.randint(0, 6)):
            args[k] = r.choice(WEIRD + ["fz", "fzq", "g1"])
        if r.random() < 0.1:
            return W.frame(W.OP_CALL, self._rid(), r.randbytes(r.randint(0, 40)))
        return W.frame(W.OP_CALL, self._rid(), json.dumps(args).encode())

    def hello(self) -> bytes:
        return W.json_frame(W.OP_HELLO, self._rid(), {"version": 1, "client": "fuzz"})

    def valid(self) -> bytes:
        return self.r.choice((self.produce, self.produce, self.pull, self.call, self.hello))()

    def mutate(self, f: bytes) -> tuple[str, bytes]:
        r = self.r
        kind = r.choice(("valid", "truncate", "bitflip", "bitflip", "length", "oversized", "opcode", "splice",
                         "random", "bodyflip"))
        b = bytearray(f)
        if kind == "valid":
            pass
        elif kind == "truncate":
            b = b[:r.randrange(0, len(b))]
        elif kind in ("bitflip", "bodyflip"):
            lo = W.HEADER_SIZE if kind == "bodyflip" and len(b) > W.HEADER_SIZE else 0
            for _ in range(r.randint(1, 8)):
                i = r.randrange(lo, len(b))
                b[i] ^= 1 << r.randrange(8)
        elif kind == "length":
            n = len(b) - 4
            struct.pack_into(">I", b, 0, r.choice((0, 1, 5, max(0, n - 1), n + 1, n + r.randint(2, 100),
                                                   r.randint(0, 2 ** 32 - 1))))
        elif kind == "oversized":
            struct.pack_into(">I", b, 0, r.randint(self.max_frame + 1, 2 ** 32 - 1))
        elif kind == "opcode":
            b[4] = r.randrange(256)
        elif kind == "splice":
            other = self.valid()
            b = b[:r.randrange(0, len(b) + 1)] + other[r.randrange(0, len(other)):]
        elif kind == "random":
            b = bytearray(r.randbytes(r.randint(0, 300)))
        return kind, bytes(b)


def possible_messages(stream: bytes, max_frame: int) -> list[bytes]:
    """Keys of every message the server could have stored from this connection's bytes."""
    dec = W.FrameDecoder(max_frame)
    try:
        frames = dec.feed(stream)
    except W.ProtocolError:
        # the server closes at the first fatal header; frames before it still count
        frames = []
        pos = 0
        while len(stream) - pos >= W.HEADER_SIZE:
            length = struct.unpack_from(">I", stream, pos)[0]
            if length < W.HEADER_SIZE - 4 or length > max_frame or pos + 4 + length > len(stream):
                break
            frames.append((stream[pos + 4], 0, 0, stream[pos + W.HEADER_SIZE:pos + 4 + length]))
            pos += 4 + length
    out = []
    for op, _f, _rid, body in frames:
        if op != W.OP_PRODUCE:
            continue
        try:
            _pid, _seq, msgs = W.decode_produce(body)
        except (W.ProtocolError, ValueError, struct.error):
            continue
        out += [_key(m[0], m[1]) for m in msgs]
    return out


def _drain(s: socket.socket, deadline: float) -> str:
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "open"
            s.settimeout(left)
            if not s.recv(1 << 16):
                return "closed"
    except socket.timeout:
        return "open"
    except OSError:
        return "reset"


def run(address: str, frames: int, seed: int, workers: int, max_seconds: float, progress=None) -> dict:
    host, port = address.rsplit(":", 1)
    port = int(port)
    with connect(address) as c:
        max_frame = int(c.server_info.get("max_frame", W.DEFAULT_MAX_FRAME))
    possible: set[bytes] = set()
    lock = threading.Lock()
    counts = {"frames": 0, "connections": 0, "no_hello": 0, "kinds": {}, "conn_errors": 0, "left_open": 0}
    controls: list[tuple[str, bytes, str]] = []
    t_end = time.monotonic() + max_seconds
    budget = [frames]

    def take(n: int) -> int:
        with lock:
            k = min(n, budget[0])
            budget[0] -= k
            return k

    def worker(wid: int) -> None:
        r = random.Random(seed * 1000 + wid)
        g = Gen(r, max_frame)
        ctl = connect(address)
        p = ctl.producer(f"fuzz-control-{wid}")
        i = 0
        try:
            while time.monotonic() < t_end:
                n = take(r.choice((1, 2, 3, 5, 8, 40)))
                if n == 0:
                    break
                parts = []
                no_hello = r.random() < 0.05
                if not no_hello:
                    parts.append(g.hello())
                kinds = []
                for _ in range(n):
                    kind, f = g.mutate(g.valid())
                    kinds.append(kind)
                    parts.append(f)
                stream = b"".join(parts)
                # also without a leading HELLO: a generated frame may itself be a HELLO
                keys = possible_messages(stream, max_frame)
                with lock:
                    possible.update(keys)       # before sending: the server may store it at once
                try:
                    s = socket.create_connection((host, port), timeout=5)
                    try:
                        # in pieces of random size, as a real peer's writes arrive
                        pos = 0
                        while pos < len(stream):
                            step = r.choice((1, 7, 100, 4096, len(stream)))
                            s.sendall(stream[pos:pos + step])
                            pos += step
                        s.shutdown(socket.SHUT_WR)
                        st = _drain(s, time.monotonic() + 2.0)
                    finally:
                        s.close()
                except OSError:
                    st = "reset"
                with lock:
                    counts["frames"] += n
                    counts["connections"] += 1
                    counts["no_hello"] += no_hello
                    counts["left_open"] += st == "open"
                    for k in kinds:
                        counts["kinds"][k] = counts["kinds"].get(k, 0) + 1
                i += 1
                if i % 10 == 0:     # a control message on a proper SDK connection, must be stored exactly
                    body = b"control-%d-%d-" % (wid, i) + r.randbytes(32)
                    res = p.send(f"fzctl/{wid}", body)
                    with lock:
                        controls.append((f"fzctl/{wid}", body, res.msg_id))
                        possible.add(_key(f"fzctl/{wid}", body))
                    if progress and wid == 0:
                        progress(counts["frames"])
        finally:
            ctl.close()

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, t_end - time.monotonic() + 30))
    elapsed = time.monotonic() - t0
    hung = sum(t.is_alive() for t in threads)
    return {**counts, "seconds": round(elapsed, 2), "hung_workers": hung, **verify(address, possible, controls)}


def verify(address: str, possible: set, controls) -> dict:
    """Round trip, everything pulls and decodes, nothing foreign, controls exact."""
    out = {"problems": []}
    try:
        c = connect(address)
    except Exception as e:  # noqa: BLE001
        out["problems"].append(f"store does not accept a connection after the fuzz: {e!r}")
        return out
    try:
        p = c.producer()
        body = b"after-fuzz-" + os.urandom(8)
        r = p.send("fzcheck/x", body)
        # a record is readable once dispatched (just after the ack): wait for it, bounded
        deadline = time.monotonic() + 10
        got, pulled = None, []
        while time.monotonic() < deadline and (got is None or not pulled):
            got = c.admin().get_by_msg_id(r.msg_id)
            pulled = [x.body for x in c.pull("fzcheck", 0, r.queue_offset, 1).records]
            if got is None or not pulled:
                time.sleep(0.02)
        if got is None or got.body != body:
            out["problems"].append(f"send + get_by_msg_id round trip failed after the fuzz: {got!r}")
        if pulled != [body]:
            out["problems"].append(f"send + pull round trip failed after the fuzz: {pulled!r}")
        possible.add(_key("fzcheck/x", body))
        stored = 0
        foreign = []
        seen_controls = {}
        for q in c.admin().topics():
            lo, hi = c.admin().offsets(q["topic"], q["queue_id"])
            off = lo
            for _ in range(100_000):                    # bounded: at most 100k pages per queue
                if off >= hi:
                    break
                try:
                    res = c.pull(q["topic"], q["queue_id"], off, 1024)
                except Exception as e:  # noqa: BLE001
                    out["problems"].append(f"pull {q['topic']}[{q['queue_id']}]@{off} failed: {e!r}")
                    break
                if not res.records:
                    if res.next_offset <= off:
                        out["problems"].append(f"pull {q['topic']}[{q['queue_id']}]@{off} is stuck below {hi}")
                        break
                for rec in res.records:
                    stored += 1
                    if _key(rec.topic, rec.body) not in possible:
                        foreign.append((rec.topic, rec.body[:40].hex(), rec.msg_id))
                    if rec.topic.startswith("fzctl/"):
                        seen_controls[rec.msg_id] = rec.body
                off = res.next_offset
        out["stored_records"] = stored
        if foreign:
            out["problems"].append(f"{len(foreign)} stored records were never sent, e.g. {foreign[:3]}")
        missing = [m for t, b, m in controls if seen_controls.get(m) != b]
        out["controls"] = len(controls)
        if missing:
            out["problems"].append(f"{len(missing)} acknowledged control messages missing or altered: {missing[:3]}")
        st = c.admin().stats()
        out["server_errors"] = st.get("errors")
        if st.get("corrupt_ranges"):
            out["problems"].append(f"store reports corrupt_ranges={st['corrupt_ranges']}")
    finally:
        c.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmqtt bench fuzz-store", description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", help="HOST:PORT of a running store (loopback); default: start one here")
    ap.add_argument("--frames", type=int, default=20_000, help="frames to send (full run: 1000000)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--workers", type=int, default=4, help="concurrent connections")
    ap.add_argument("--max-seconds", type=float, default=600.0, help="stop sending after this long")
    a = ap.parse_args(argv)
    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    own = None
    address = a.store
    if address is None:
        print("[fuzz-store] starting lmqtt store", file=sys.stderr, flush=True)
        own = LmqttProc("store")
        address = own.address
    else:
        host = address.rsplit(":", 1)[0].strip("[]")
        if host not in ("127.0.0.1", "localhost", "::1"):
            print(f"lmqtt bench fuzz-store: refusing a non-loopback target {host!r}", file=sys.stderr)
            return 2
    print(f"[fuzz-store] {a.frames} frames at {address}, seed {seed}, {a.workers} workers", file=sys.stderr,
          flush=True)
    last = [time.monotonic()]

    def progress(n):
        if time.monotonic() - last[0] > 5:
            last[0] = time.monotonic()
            print(f"[fuzz-store] ~{n} frames", file=sys.stderr, flush=True)

    try:
        res = run(address, a.frames, seed, a.workers, a.max_seconds, progress)
        if own is not None and own.proc.poll() is not None:
            res["problems"].append(f"lmqtt store exited with {own.proc.returncode}: {own.log_tail()}")
        if res.get("hung_workers"):
            res["problems"].append(f"{res['hung_workers']} fuzz workers did not finish (server stopped answering?)")
    finally:
        if own is not None:
            own.stop()
    res.update(case="fuzz-store", seed=seed, ok=not res["problems"])
    print(json.dumps(res), flush=True)
    if res["problems"]:
        print("lmqtt bench fuzz-store: FAILED: " + "; ".join(res["problems"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
