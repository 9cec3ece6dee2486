"""`lmqtt bench timer`: delayed messages on the store's timer wheel, through the store's public
API (MessageStore + store.delayed.DelayedMessages), one JSON object per result on stdout.

Cases:
* enqueue   park 100-byte messages with delays spread over 1 h .. 30 days, in batches
            (`schedule_batch`: one CommitLog append + one TimerLog record each): msgs_per_s
* fire      timers due at a fixed rate (`--rate`, default 10,000 per second) starting 2 s ahead;
            the wheel fires them with the real clock; firing error = when the released message
            was appended minus its due time: p50/p99/max in ms, against precision + 50 ms
* pending   1,000,000 timers pending at once: process RSS and anonymous memory before/after,
            TimerLog bytes, reopen (recovery) time
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time

from lmqtt.store import Message, MessageStore, StoreConfig
from lmqtt.store.delayed import DelayedMessages
from lmqtt.store.timer import TimerWheel


def _mem_kib() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "RssAnon:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0])
    return out


def _store(base: str, flush: str) -> MessageStore:
    st = MessageStore(StoreConfig(data_dir=os.path.join(base, "store"), flush_mode=flush,
                                  segment_size=256 << 20))
    st.start()
    return st


def _pct(v: list[float], p: float) -> float:
    if not v:
        return 0.0
    v = sorted(v)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]


def bench_enqueue(base: str, duration: float, batch: int, flush: str) -> dict:
    st = _store(base, flush)
    d = DelayedMessages(st, os.path.join(base, "timer"))
    body = os.urandom(100)
    rng = random.Random(1)
    now = int(time.time() * 1000)
    n = 0
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    end = t0 + duration
    while time.perf_counter() < end and n < 50_000_000:
        msgs = [Message(f"devices/{rng.randrange(10_000)}/cmd", body) for _ in range(batch)]
        dues = [now + rng.randrange(3_600_000, 30 * 86_400_000) for _ in range(batch)]
        rs = d.schedule_batch(msgs, dues)
        if flush == "sync":
            rs[-1].durable.result(30)
        n += batch
    el = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    out = {"case": "enqueue", "size": 100, "batch": batch, "flush_mode": flush, "msgs_per_s": n / el,
           "messages": n, "cpu_us_per_msg": cpu / n * 1e6, "pending": d.wheel.pending}
    d.close()
    st.shutdown()
    return out


def bench_fire(base: str, rate: int, seconds: float, precision_ms: int) -> dict:
    st = _store(base, "async")
    errors: list[float] = []
    lock = threading.Lock()

    def route(m):
        due = int.from_bytes(m.body[:8], "little")
        with lock:
            errors.append(time.time() * 1000 - due)
        return m

    d = DelayedMessages(st, os.path.join(base, "timer-fire"), route=route, precision_ms=precision_ms,
                        scan_interval_s=0.01)
    total = int(rate * seconds)
    start = int(time.time() * 1000) + 2000
    step = 1000.0 / rate
    pad = os.urandom(92)
    msgs, dues = [], []
    for i in range(total):
        due = start + int(i * step)
        msgs.append(Message("devices/x/cmd", due.to_bytes(8, "little") + pad))
        dues.append(due)
    for i in range(0, total, 1000):
        d.schedule_batch(msgs[i:i + 1000], dues[i:i + 1000])
    d.start()
    deadline = time.monotonic() + seconds + 2 + precision_ms / 1000 + 10
    while time.monotonic() < deadline:
        with lock:
            if len(errors) >= total:
                break
        time.sleep(0.05)
    d.close()
    st.shutdown()
    return {"case": "fire", "size": 100, "rate": rate, "precision_ms": precision_ms, "fired": len(errors),
            "scheduled": total, "error_p50_ms": _pct(errors, 50), "error_p99_ms": _pct(errors, 99),
            "error_max_ms": max(errors) if errors else None,
            "error_min_ms": min(errors) if errors else None,
            "bound_ms": precision_ms + 50, "msgs_per_s": rate}


def bench_pending(base: str, count: int) -> dict:
    before = _mem_kib()
    w = TimerWheel(os.path.join(base, "timer-pending"), lambda ts: None)
    now = int(time.time() * 1000)
    rng = random.Random(2)
    t0 = time.perf_counter()
    for ref in range(count):
        w.schedule(now + rng.randrange(60_000, 30 * 86_400_000), ref * 128, 128)
    el = time.perf_counter() - t0
    after = _mem_kib()
    stats = w.stats()
    w.close()
    t1 = time.perf_counter()
    w2 = TimerWheel(os.path.join(base, "timer-pending"), lambda ts: None)
    reopen = time.perf_counter() - t1
    pending = w2.pending
    w2.close()
    return {"case": "pending", "timers": count, "schedule_per_s": count / el,
            "rss_mib_before": before.get("VmRSS", 0) / 1024, "rss_mib_after": after.get("VmRSS", 0) / 1024,
            "anon_mib_growth": (after.get("RssAnon", 0) - before.get("RssAnon", 0)) / 1024,
            "timerlog_mib": stats["timerlog_bytes"] / 2**20, "reopen_s": reopen,
            "pending_after_reopen": pending, "msgs_per_s": count / el}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmqtt bench timer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=5.0, help="seconds for the enqueue case (default 5)")
    ap.add_argument("--cases", default="enqueue,fire,pending")
    ap.add_argument("--batch", type=int, default=64, help="messages per schedule_batch (default 64)")
    ap.add_argument("--flush-mode", default="async", choices=("sync", "async", "async+buffer"))
    ap.add_argument("--rate", type=int, default=10_000, help="firings per second in the fire case")
    ap.add_argument("--fire-seconds", type=float, default=5.0, help="length of the firing run")
    ap.add_argument("--precision-ms", default="1000,100", help="wheel precisions for the fire case")
    ap.add_argument("--pending", type=int, default=1_000_000, help="timers in the pending case")
    ap.add_argument("--data-dir", default=None)
    a = ap.parse_args(argv)
    base = a.data_dir or tempfile.mkdtemp(prefix="lmqtt-timer-bench-")
    os.makedirs(base, exist_ok=True)
    cases = [c for c in a.cases.split(",") if c]
    try:
        for c in cases:
            sub = tempfile.mkdtemp(dir=base)
            print(f"[timer] {c} ...", file=sys.stderr, flush=True)
            if c == "enqueue":
                r = bench_enqueue(sub, a.duration, a.batch, a.flush_mode)
                print(json.dumps(r), flush=True)
            elif c == "fire":
                for p in (int(x) for x in a.precision_ms.split(",") if x):
                    r = bench_fire(tempfile.mkdtemp(dir=base), a.rate, a.fire_seconds, p)
                    print(json.dumps(r), flush=True)
            elif c == "pending":
                print(json.dumps(bench_pending(sub, a.pending)), flush=True)
            else:
                print(f"lmqtt bench timer: unknown case {c!r}", file=sys.stderr)
                return 2
            shutil.rmtree(sub, ignore_errors=True)
    finally:
        if a.data_dir is None:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
