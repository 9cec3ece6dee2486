"""`lmqtt bench store`: CommitLog append throughput and dispatch lag per flush mode, with a raw
baseline of this machine measured in the same run.

For every (mode, size, batch, writers) case it appends `size`-byte messages for `--duration`
seconds through the store's public API only (MessageStore.append_batch / append_batch_async /
add_dispatch_listener) and reports:

* msgs_per_s, mb_per_s   acknowledged messages (sync: after the group-commit fsync) and payload MB/s
* lag_p50_ms, lag_p99_ms append -> visible in the ConsumeQueue (the dispatch listener fires after
                         every dispatcher took the batch), one sample per appended batch
* consume_produce_ratio  (D(t_end + 50 ms) - D(w0)) / (W(t_end) - W(w0)) in CommitLog bytes:
                         D = dispatched (visible) offset, W = appended end offset, both read at
                         each dispatch delivery; w0 = the first delivery after 10 % of the run,
                         t_end = when the appenders stop, 50 ms = the lag bound. It is >= 1
                         exactly when the appended-but-not-visible backlog 50 ms after the end is
                         no larger than it was at w0: dispatch kept pace over the window and
                         cleared what was in flight at the end within the lag bound; a dispatch
                         stage that falls behind grows the backlog and gives < 1. Offsets rather
                         than acknowledged messages: in sync mode a record is visible before its
                         fsync acks it. (Stopping the count at t_end instead gives 0.998-0.999
                         for a dispatch that keeps up: the last few ms of appends are in flight.)
* drain_ms               t_end -> everything appended is visible
* cpu_us_per_msg         process CPU time (all threads) per message: steadier than wall-clock rates
                         on a machine shared with other work
* baseline_ratio         mb_per_s / the raw baseline: the same payload bytes copied into a memory map
                         without framing (async modes), or written sequentially with one fdatasync per
                         batch (sync mode)

Progress goes to stderr, one JSON object per result to stdout (baselines too, mode "baseline-*").
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import mmap
import os
import shutil
import sys
import tempfile
import threading
import time
import timeit

from lmqtt.store import ENCODER, Message, MessageStore, StoreConfig

LAG_BOUND_S = 0.050   # the dispatch lag bound of the store's target (p99 < 50 ms)


def _pct(sorted_vals: list[float], p: float) -> float:
    if not sorted_vals:
        return 0.0
    i = min(len(sorted_vals) - 1, max(0, int(round(p / 100.0 * (len(sorted_vals) - 1)))))
    return sorted_vals[i]


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- baselines
def baseline_mmap(path: str, size: int, batch: int, duration: float) -> dict:
    """Copy the same payload bytes into a memory-mapped file, one slice per batch, no framing."""
    seg = 1 << 30
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.posix_fallocate(fd, 0, seg)
        mm = mmap.mmap(fd, seg)
        chunk = os.urandom(size) * batch
        n = 0
        pos = 0
        t0 = time.perf_counter()
        end = t0 + duration
        while True:
            for _ in range(64):
                if pos + len(chunk) > seg:
                    pos = 0
                mm[pos:pos + len(chunk)] = chunk
                pos += len(chunk)
                n += batch
            if time.perf_counter() >= end:
                break
        el = time.perf_counter() - t0
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)
    return {"mode": "baseline-mmap", "size": size, "batch": batch, "writers": 1, "msgs_per_s": n / el,
            "mb_per_s": n * size / el / 1e6}


def baseline_write_fsync(path: str, size: int, batch: int, duration: float) -> dict:
    """Sequential os.write of one batch of payload bytes followed by fdatasync, repeated."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        chunk = os.urandom(size) * batch
        n = 0
        t0 = time.perf_counter()
        end = t0 + duration
        while time.perf_counter() < end:
            os.write(fd, chunk)
            os.fdatasync(fd)
            n += batch
        el = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return {"mode": "baseline-write-fsync", "size": size, "batch": batch, "writers": 1, "msgs_per_s": n / el,
            "mb_per_s": n * size / el / 1e6}


def python_speed() -> dict:
    """How fast this interpreter runs right now (shared machines vary a lot): microseconds for
    `sum(range(1000))`, best of 5. Typical idle x86 machines: 10-15 us."""
    best = min(timeit.repeat("sum(range(1000))", number=2000, repeat=5)) / 2000
    return {"mode": "baseline-python", "size": 0, "batch": 0, "writers": 1, "sum_range_1000_us": best * 1e6,
            "loadavg_1m": os.getloadavg()[0], "encoder": ENCODER}


# ---------------------------------------------------------------------------------- store cases
class LagProbe:
    """Dispatch listener: turns 'dispatched up to offset N' into per-batch append->visible lags."""

    def __init__(self) -> None:
        self.ends: list[int] = []      # end offset of each appended batch, increasing
        self.times: list[float] = []   # perf_counter at append
        self.counts: list[int] = []    # cumulative messages at that batch
        self.next = 0
        self.lags: list[float] = []
        self.visible = 0               # cumulative messages visible
        # (time, dispatched offset, appended end offset at that moment), one per dispatch delivery
        self.visible_log: list[tuple[float, int, int]] = []
        self.appended = None   # () -> appended end offset (set by run_case)
        self.lock = threading.Lock()

    def add(self, end: int, t: float, count: int) -> None:
        """A batch ending at `end` was appended at `t` (its lag is taken at the next delivery, so
        a batch already visible when recorded - sync writers see the ack after dispatch - counts
        up to one delivery interval too much: lags err high, never low)."""
        with self.lock:
            self.ends.append(end)
            self.times.append(t)
            self.counts.append(count)

    def __call__(self, dispatched: int) -> None:
        now = time.perf_counter()
        appended = self.appended() if self.appended else 0
        with self.lock:
            self.visible_log.append((now, dispatched, appended))
            j = bisect.bisect_right(self.ends, dispatched)
            i = self.next
            if j > i:
                times = self.times
                self.lags.extend(now - times[k] for k in range(i, j))
                self.next = j
                self.visible = self.counts[j - 1]


def run_case(base_dir: str, mode: str, size: int, batch: int, writers: int, duration: float,
             segment_size: int, dispatch: str = "memory") -> dict:
    data_dir = tempfile.mkdtemp(prefix=f"bench-{mode.replace('+', '_')}-", dir=base_dir)
    st = MessageStore(StoreConfig(data_dir=data_dir, segment_size=segment_size, flush_mode=mode,
                                  dispatch_from_memory=(dispatch == "memory")))
    probe = LagProbe()
    probe.appended = lambda: st.max_offset
    st.add_dispatch_listener(probe)
    st.start()
    payload = os.urandom(size)
    msgs = [Message(topic="bench/t", body=payload) for _ in range(batch)]
    acked = 0
    label = f"{mode} size={size} batch={batch} writers={writers}"
    try:
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        end = t0 + duration
        if writers == 1:
            next_report = t0 + 1
            n = 0
            while True:
                for _ in range(16):
                    rs = st.append_batch(msgs)
                    n += batch
                    r = rs[-1]
                    t = time.perf_counter()
                    probe.add(r.phys_offset + r.size, t, n)
                    if mode == "sync":
                        r.durable.result()
                now = time.perf_counter()
                if now >= end:
                    break
                if now >= next_report:
                    next_report = now + 1
                    _progress(f"  {label}: {n / (now - t0):,.0f} msg/s, visible {probe.visible:,}")
            if mode != "sync":
                rs[-1].durable.result()
            acked = n
            t_end = time.perf_counter()
            w_end = st.max_offset
        else:
            acked, t_end = asyncio.run(_async_writers(st, probe, msgs, writers, end, label, t0))
            w_end = st.max_offset
        el = t_end - t0
        last_end = st.max_offset
        st.wait_dispatched(last_end, 60)
        cpu = time.process_time() - cpu0  # whole process: appender + dispatch + flush threads
    finally:
        st.shutdown()
        shutil.rmtree(data_dir, ignore_errors=True)
    lags = sorted(probe.lags)
    # consume/produce (see the module docstring): D and W read together at each dispatch delivery
    vlog = probe.visible_log
    start = next((e for e in vlog if e[0] >= t0 + 0.1 * el), None)
    d_end = max((d for t, d, _ in vlog if t <= t_end + LAG_BOUND_S), default=0)
    ratio = ((d_end - start[1]) / (w_end - start[2])) if start and w_end > start[2] else 0.0
    drained_at = next((t for t, d, _ in vlog if d >= w_end), None)
    return {"mode": mode, "size": size, "batch": batch, "writers": writers, "msgs_per_s": acked / el,
            "mb_per_s": acked * size / el / 1e6, "lag_p50_ms": _pct(lags, 50) * 1000,
            "lag_p99_ms": _pct(lags, 99) * 1000,
            "consume_produce_ratio": ratio,
            "drain_ms": (max(0.0, drained_at - t_end) * 1000) if drained_at is not None else None,
            "cpu_us_per_msg": cpu / acked * 1e6 if acked else None, "dispatch": dispatch,
            "messages": acked, "duration_s": el}


async def _async_writers(st, probe, msgs, writers, end, label, t0):
    """`writers` asyncio tasks, each appending and awaiting durability (the gateway's pattern)."""
    count = [0]
    batch = len(msgs)

    async def writer():
        while time.perf_counter() < end:
            rs = await st.append_batch_async(msgs)
            count[0] += batch
            probe.add(rs[-1].phys_offset + rs[-1].size, time.perf_counter(), count[0])

    async def reporter():
        while time.perf_counter() < end:
            await asyncio.sleep(1)
            now = time.perf_counter()
            _progress(f"  {label}: {count[0] / (now - t0):,.0f} acked msg/s")

    rep = asyncio.ensure_future(reporter())
    await asyncio.gather(*[writer() for _ in range(writers)])
    rep.cancel()
    return count[0], time.perf_counter()


# ---------------------------------------------------------------------------------- main
def parse_args(argv):
    ap = argparse.ArgumentParser(prog="lmqtt bench store", description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per case (default 5)")
    ap.add_argument("--data-dir", default=None, help="directory for the benchmark stores (default: a temp dir)")
    ap.add_argument("--sizes", default="100,1024", help="message sizes in bytes, comma separated")
    ap.add_argument("--modes", default="sync,async,async+buffer", help="flush modes, comma separated")
    ap.add_argument("--batch", default="1,64", help="messages per append call, comma separated")
    ap.add_argument("--writers", default="64",
                    help="extra concurrent-writer counts run for sync mode with batch 1 (asyncio tasks)")
    ap.add_argument("--segment-size", type=int, default=256 << 20, help="CommitLog segment size")
    ap.add_argument("--dispatch", default="memory",
                    help="dispatch source(s): memory (live hand-off, default), log (always parse the "
                         "CommitLog), or both: memory,log")
    ap.add_argument("--no-baseline", action="store_true", help="skip the raw baseline measurements")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    sizes = [int(x) for x in a.sizes.split(",") if x]
    modes = [x for x in a.modes.split(",") if x]
    batches = [int(x) for x in a.batch.split(",") if x]
    writers = [int(x) for x in a.writers.split(",") if x]
    for m in modes:
        if m not in ("sync", "async", "async+buffer"):
            print(f"lmqtt bench store: unknown mode {m!r}", file=sys.stderr)
            return 2
    own = a.data_dir is None
    base = tempfile.mkdtemp(prefix="lmqtt-store-bench-") if own else a.data_dir
    os.makedirs(base, exist_ok=True)
    try:
        baselines: dict[tuple[str, int, int], float] = {}
        print(json.dumps(_round(python_speed())), flush=True)
        if not a.no_baseline:
            for size in sizes:
                for b in batches:
                    for fn in (baseline_mmap, baseline_write_fsync):
                        _progress(f"baseline {fn.__name__} size={size} batch={b} ...")
                        r = fn(os.path.join(base, "baseline.bin"), size, b, min(a.duration, 3.0))
                        baselines[(r["mode"], size, b)] = r["mb_per_s"]
                        r["baseline_ratio"] = 1.0
                        print(json.dumps(_round(r)), flush=True)
        cases = []
        dispatches = [x for x in a.dispatch.split(",") if x in ("memory", "log")] or ["memory"]
        for mode in modes:
            for size in sizes:
                for b in batches:
                    for dsp in dispatches:
                        cases.append((mode, size, b, 1, dsp))
                if mode == "sync":
                    for w in writers:
                        if w > 1:
                            for dsp in dispatches:
                                cases.append((mode, size, 1, w, dsp))
        for i, (mode, size, b, w, dsp) in enumerate(cases, 1):
            _progress(f"[{i}/{len(cases)}] {mode} size={size} batch={b} writers={w} dispatch={dsp} "
                      f"for {a.duration:g}s")
            r = run_case(base, mode, size, b, w, a.duration, a.segment_size, dsp)
            key = ("baseline-write-fsync" if mode == "sync" else "baseline-mmap", size, b)
            ref = baselines.get(key)
            r["baseline"] = key[0]
            r["baseline_ratio"] = (r["mb_per_s"] / ref) if ref else None
            print(json.dumps(_round(r)), flush=True)
    finally:
        if own:
            shutil.rmtree(base, ignore_errors=True)
    return 0


def _round(r: dict) -> dict:
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}


if __name__ == "__main__":
    sys.exit(main())
