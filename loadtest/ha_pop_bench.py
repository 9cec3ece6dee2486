"""POP on a store group vs a single store: `--consumers` (default 1) POP consumers'
`pop(32)` + `ack` loops over `--messages` stored messages, first on a single `lmqtt store`, then on a group of 3 (where each
pop and ack answers once the in-sync replicas have the POP state, docs/ha.md "POP on a group"),
in the same run. One JSON object per shape on stdout: messages/s, p50/p99 of pop and ack.

    lmqtt bench ha-pop --messages 20000 [--consumers 4]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from lmqtt.loadtest.brokers import free_ports
from lmqtt.loadtest.ha_bench import StoreGroup, wait_port
from lmqtt.store.client import connect

TOPIC = "popbench"


def _ms(times: list[float], q: float) -> float:
    """The q-quantile of `times` (nearest rank) in milliseconds."""
    t = sorted(times)
    return round(t[min(len(t) - 1, int(len(t) * q))] * 1000, 3) if t else 0.0


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes `pids` used so far."""
    tck = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / tck


def _loop(address: str, n: int, size: int, max_seconds: float, consumers: int = 1, pids=()) -> dict:
    """Store `n` messages, then `consumers` POP consumers of one group (one connection and thread
    each) `pop(32)` + `ack` until all `n` are acked or `max_seconds` passed."""
    c = connect(address, timeout=60)
    try:
        p = c.producer()
        for i in range(0, n, 100):
            p.send_batch([(TOPIC, b"x" * size) for _ in range(min(100, n - i))])
    finally:
        c.close()
    pops: list[float] = []
    acks: list[float] = []
    got = [0]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def one() -> None:
        cc = connect(address, timeout=60)
        try:
            pc = cc.pop_consumer(TOPIC, "bench", invisible_ms=600_000)
            while time.perf_counter() - t0 < max_seconds:
                with lock:
                    if got[0] >= n:
                        return
                t1 = time.perf_counter()
                recs = pc.pop(32)
                t2 = time.perf_counter()
                if not recs:
                    continue
                pc.ack(recs)
                t3 = time.perf_counter()
                with lock:
                    acks.append(t3 - t2)
                    pops.append(t2 - t1)
                    got[0] += len(recs)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)
        finally:
            cc.close()

    cpu0 = _cpu_s(list(pids))
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, daemon=True) for _ in range(consumers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max_seconds + 60)
    dt = time.perf_counter() - t0
    cpu = _cpu_s(list(pids)) - cpu0
    if errors:
        raise errors[0]
    return {"messages": got[0], "consumers": consumers, "msgs_per_s": round(got[0] / dt),
            "pop_p50_ms": _ms(pops, 0.5), "pop_p99_ms": _ms(pops, 0.99), "ack_p50_ms": _ms(acks, 0.5),
            "ack_p99_ms": _ms(acks, 0.99),
            # the store processes' CPU per acked message: what the shape costs beside its latency
            "store_cpu_us_per_msg": round(cpu / max(1, got[0]) * 1e6, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmqtt bench ha-pop", description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--consumers", type=int, default=1,
                    help="POP consumers of the group at once, one connection and thread each (default 1)")
    ap.add_argument("--max-seconds", type=float, default=60.0, help="bound of each loop (default 60)")
    a = ap.parse_args(argv)
    base = tempfile.mkdtemp(prefix="lmqtt-ha-pop-bench-")
    out = lambda obj: print(json.dumps(obj), flush=True)      # noqa: E731
    try:
        d = os.path.join(base, "single")
        os.makedirs(d)
        port = free_ports(1)
        with open(os.path.join(base, "single.log"), "ab") as f:
            proc = subprocess.Popen([sys.executable, "-m", "lmqtt.gateway.cli", "store", "--port", str(port),
                                     "--data-dir", d, "--flush-mode", "sync", "--segment-mb", "64"],
                                    stdout=f, stderr=subprocess.STDOUT)
        try:
            wait_port(port)
            single = _loop(f"127.0.0.1:{port}", a.messages, a.size, a.max_seconds, a.consumers, [proc.pid])
        finally:
            proc.terminate()
            proc.wait(30)
        out({"case": "pop-ack", "shape": "single", **single})
        gd = os.path.join(base, "group")
        os.makedirs(gd)
        g = StoreGroup(gd, "sync", None, 2.5).start()
        try:
            g.primary(in_sync=3)
            group = _loop(g.peers, a.messages, a.size, a.max_seconds, a.consumers,
                          [m.proc.pid for m in g.members if m.proc is not None])
        finally:
            g.stop()
        out({"case": "pop-ack", "shape": "group of 3", **group,
             "vs_single": round(group["msgs_per_s"] / max(1, single["msgs_per_s"]), 2)})
    except KeyboardInterrupt:
        return 130
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
