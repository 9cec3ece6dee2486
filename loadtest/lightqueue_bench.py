"""`lmqtt bench lightqueue`: light-queue fan-out indexing, filter matching, million-queue scale.

One JSON line per result on stdout, progress on stderr. Cases:

* publish (fan-out 1, 4, 16): append through `MessageStore.append_batch` with the dispatch list
  from `LightQueueStore.queues_for_topic`, until the last record is visible in every light
  queue (end to end). Fields: fanout, records_per_s, entries_per_s, plus the checked entry count.
* index (fan-out 1, 4, 16): the light-queue dispatcher alone, fed pre-built DispatchRequest
  batches of ~4 MB of CommitLog (what the store's dispatch thread hands it). Separates the
  index's own cost from the store's append cost.
* match (10 / 10,000 / 1,000,000 registered filters): topics/s through the filter trie, result
  cache bypassed (every topic is a miss), so the figure is the trie walk itself; plus
  `cached_topics_per_s`, the gateway's real call (`queues_for_topic`) over 50,000 repeating topics.
* scale (`--scale N`, run alone): N distinct light queues with one entry each; RocksDB size on
  disk, process RSS, pull latency p50/p99 from random queues.

Every loop is bounded by `--duration` seconds and a record cap.
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

from lmqtt.lightqueue import LightQueueIndex, LightQueueStore, MetadataStore
from lmqtt.lightqueue.registry import FilterRegistry
from lmqtt.store import ENCODER, DispatchRequest, Message, MessageStore, StoreConfig

MAX_RECORDS = 20_000_000


def progress(msg: str) -> None:
    print(f"[lightqueue-bench] {msg}", file=sys.stderr, flush=True)


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def fanout_filters(n: int) -> list[str]:
    """n distinct filters that all match every topic `site/{s}/dev{d}/temp`."""
    out = ["#", "site/#", "+/#", "site/+/#", "+/+/#"]
    for a in ("site", "+"):
        for c in ("+",):
            for d in ("temp", "+"):
                out.append(f"{a}/+/{c}/{d}")
                out.append(f"{a}/+/{c}/{d}/#")
                out.append(f"{a}/+/#")
    seen, res = set(), []
    for f in out + [f"{a}/+/+/#" for a in ("site", "+")]:
        if f not in seen:
            seen.add(f)
            res.append(f)
    if n > len(res):
        raise SystemExit(f"at most {len(res)} fan-out filters available")
    return res[:n]


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def dir_size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for fn in files:
            try:
                total += os.path.getsize(os.path.join(root, fn))
            except OSError:
                pass
    return total


def thread_cpu_s(native_id: int) -> float:
    """CPU seconds (user + system) of one thread of this process, from /proc."""
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def dispatch_thread_id() -> int | None:
    for t in threading.enumerate():
        if t.name == "lmqtt-store-dispatch":
            return t.native_id
    return None


def open_store(d: str, **kw) -> tuple[MessageStore, LightQueueStore]:
    st = MessageStore(StoreConfig(data_dir=os.path.join(d, "store"), segment_size=1 << 28,
                                  preallocate=False, **kw))
    lq = LightQueueStore(st, os.path.join(d, "lq"))
    return st, lq


def case_publish(fanout: int, duration: float, body_size: int, devices: int, batch: int, base: str) -> None:
    d = tempfile.mkdtemp(prefix=f"lqbench-pub{fanout}-", dir=base)
    try:
        st, lq = open_store(d)
        for f in fanout_filters(fanout - 1):
            lq.register_filter(f)
        st.start()
        topics = [f"site/{i % 10}/dev{i}/temp" for i in range(devices)]
        assert all(len(lq.queues_for_topic(t)) == fanout for t in topics[:10])
        body = b"x" * body_size
        qft = lq.queues_for_topic
        n = 0
        k = 0
        dtid = dispatch_thread_id()
        d_cpu0 = thread_cpu_s(dtid) if dtid else 0.0
        m_cpu0 = time.thread_time()
        thread_time = time.thread_time
        a_cpu = 0.0
        p_cpu0 = time.process_time()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duration and n < MAX_RECORDS:
            msgs = []
            for _ in range(batch):
                t = topics[k]
                k = k + 1 if k + 1 < devices else 0
                # positional: a keyword call of Message costs ~1.0 vs ~0.57 µs (load generator's
                # own overhead, not the store's); same fields as Message(topic=t, body=body,
                # dispatch_queues=...)
                msgs.append(Message(t, body, 0, 0, b"", (), 0, qft(t)))
            a0 = thread_time()
            st.append_batch(msgs)
            a_cpu += thread_time() - a0
            n += batch
        t_append = time.perf_counter() - t0
        if not st.wait_dispatched(st.max_offset, 300):
            raise SystemExit("dispatch did not catch up within 300 s")
        elapsed = time.perf_counter() - t0
        m_cpu = time.thread_time() - m_cpu0   # the final wait blocks on a condition: ~no CPU
        d_cpu = (thread_cpu_s(dtid) - d_cpu0) if dtid else 0.0
        p_cpu = time.process_time() - p_cpu0
        entries = sum(lq.max_offset(q) for q in set(topics) | set(fanout_filters(fanout - 1)))
        if entries != n * fanout:
            raise SystemExit(f"index holds {entries} entries, expected {n * fanout}")
        emit(case="publish", fanout=fanout, records=n, entries=entries, body_bytes=body_size, encoder=ENCODER,
             records_per_s=round(n / elapsed), entries_per_s=round(entries / elapsed),
             append_only_records_per_s=round(n / t_append), seconds=round(elapsed, 3),
             cpu_us_per_record={"appending_thread": round(m_cpu / n * 1e6, 2),
                                "of_which_append_batch": round(a_cpu / n * 1e6, 2),
                                "dispatch_thread": round(d_cpu / n * 1e6, 2),
                                "process": round(p_cpu / n * 1e6, 2)},
             note="appending thread: Message + queues_for_topic + append_batch (its own CPU "
                  "under of_which_append_batch); dispatch "
                  "thread: store parse/hand-off + light-queue index; process adds RocksDB's threads")
        st.shutdown()
        lq.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def case_index(fanout: int, duration: float, devices: int, base: str) -> None:
    d = tempfile.mkdtemp(prefix=f"lqbench-idx{fanout}-", dir=base)
    try:
        idx = LightQueueIndex(os.path.join(d, "index"))
        filters = tuple(fanout_filters(fanout - 1))
        rec_size = 200   # a ~100-byte MQTT payload record
        per_batch = (4 << 20) // rec_size
        topics = [f"site/{i % 10}/dev{i}/temp" for i in range(devices)]
        proto = [(t,) + filters for t in topics]
        n = 0
        phys = 0
        busy = 0.0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duration and n < MAX_RECORDS:
            reqs = []
            for i in range(per_batch):
                qs = proto[(n + i) % devices]
                reqs.append(DispatchRequest(phys, rec_size, qs[0], 0, 0, 0, 0, 0, 0, (), qs))
                phys += rec_size
            s = time.perf_counter()
            idx.dispatch(reqs, phys)
            busy += time.perf_counter() - s
            n += per_batch
        s = time.perf_counter()
        idx.flush()
        busy += time.perf_counter() - s
        emit(case="index", fanout=fanout, records=n, entries=n * fanout,
             records_per_s=round(n / busy), entries_per_s=round(n * fanout / busy),
             seconds=round(busy, 3), note="dispatcher alone, incl. final memtable flush")
        idx.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def make_filter(i: int) -> str:
    s = i % 100
    k = i % 4
    if k == 0:
        return f"site/{s}/dev{i}/+"
    if k == 1:
        return f"site/{s}/+/m{i}"
    if k == 2:
        return f"site/{s}/dev{i}/#"
    return f"+/{s}/dev{i}/temp"


def case_match(nfilters: int, duration: float, base: str) -> None:
    d = tempfile.mkdtemp(prefix=f"lqbench-match{nfilters}-", dir=base)
    try:
        md = MetadataStore(os.path.join(d, "meta"))
        reg = FilterRegistry(md)
        t = time.perf_counter()
        for s in range(0, nfilters, 100_000):
            reg.register_many(make_filter(i) for i in range(s, min(nfilters, s + 100_000)))
        progress(f"registered {nfilters} filters in {time.perf_counter() - t:.1f}s")
        rnd = random.Random(1)
        span = max(nfilters, 4)
        topics = []
        for _ in range(100_000):
            dv = rnd.randrange(span)
            topics.append(f"site/{dv % 100}/dev{dv}/{rnd.choice(('temp', 'hum', f'm{dv}'))}")
        match = reg.match_uncached
        n = 0
        matched = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duration and n < MAX_RECORDS:
            for tp in topics:
                matched += len(match(tp)) - 1
            n += len(topics)
        el = time.perf_counter() - t0
        # The publish path as the gateway runs it: queues_for_topic (validation + result LRU)
        # over a working set of 50,000 device topics that fits the 65,536-entry cache.
        hot = topics[:50_000]
        qft = reg.queues_for_topic
        for tp in hot:
            qft(tp)
        nc = 0
        t1 = time.perf_counter()
        while time.perf_counter() - t1 < duration / 2 and nc < MAX_RECORDS:
            for tp in hot:
                qft(tp)
            nc += len(hot)
        elc = time.perf_counter() - t1
        emit(case="match", filters=nfilters, topics=n, topics_per_s=round(n / el),
             cached_topics_per_s=round(nc / elc),
             avg_filters_matched=round(matched / n, 3), rss_mb=round(rss_bytes() / 2**20),
             note="topics_per_s: result cache bypassed, each topic walks the trie; "
                  "cached_topics_per_s: queues_for_topic over 50,000 repeating topics")
        md.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def case_scale(nqueues: int, duration: float, base: str, pulls: int) -> None:
    d = tempfile.mkdtemp(prefix=f"lqbench-scale{nqueues}-", dir=base)
    try:
        rss0 = rss_bytes()
        st, lq = open_store(d)
        st.start()
        t0 = time.perf_counter()
        batch = 1000
        body = b"v" * 64
        for s in range(0, nqueues, batch):
            st.append_batch([Message(topic=f"dev/{i}", body=body, dispatch_queues=(f"dev/{i}",))
                             for i in range(s, min(nqueues, s + batch))])
            if s % 100_000 == 0:
                progress(f"scale: appended {s}/{nqueues} ({time.perf_counter() - t0:.0f}s)")
        if not st.wait_dispatched(st.max_offset, 600):
            raise SystemExit("dispatch did not catch up within 600 s")
        load_s = time.perf_counter() - t0
        lq.index.flush()   # so the size on disk counts SST files, not a memtable
        queues = lq.index.queue_count()
        if queues != nqueues:
            raise SystemExit(f"{queues} queues indexed, expected {nqueues}")
        rnd = random.Random(7)
        lat = []
        deadline = time.perf_counter() + max(duration, 10)
        lq.cache.clear()
        for _ in range(pulls):
            i = rnd.randrange(nqueues)
            s = time.perf_counter_ns()
            res = lq.pull(f"dev/{i}", 0)
            lat.append(time.perf_counter_ns() - s)
            if len(res.messages) != 1:
                raise SystemExit(f"dev/{i}: {len(res.messages)} messages, expected 1")
            if time.perf_counter() > deadline:
                break
        lat.sort()
        rss_loaded = rss_bytes()
        st.shutdown()
        lq.close()
        idx_bytes = dir_size(os.path.join(d, "lq", "index"))
        # restart: reopen store + light queues (names preloaded), then check random queues again
        t = time.perf_counter()
        st, lq = open_store(d)
        st.start()
        reopen_s = time.perf_counter() - t
        for _ in range(1000):
            i = rnd.randrange(nqueues)
            if len(lq.pull(f"dev/{i}", 0).messages) != 1:
                raise SystemExit(f"after reopen dev/{i} lost its entry")
        progress(f"scale: reopened in {reopen_s:.1f}s, 1000 random queues verified")
        emit(case="scale", queues=queues, load_records_per_s=round(nqueues / load_s),
             rocksdb_index_bytes=idx_bytes, rocksdb_index_mb=round(idx_bytes / 2**20, 1),
             metadata_bytes=dir_size(os.path.join(d, "lq", "meta")),
             commitlog_bytes=st.max_offset, rss_mb=round(rss_loaded / 2**20),
             rss_growth_mb=round((rss_loaded - rss0) / 2**20), reopen_s=round(reopen_s, 2),
             pulls=len(lat),
             pull_p50_us=round(lat[len(lat) // 2] / 1000, 1),
             pull_p99_us=round(lat[int(len(lat) * 0.99)] / 1000, 1),
             note="random queue per pull, cold message cache")
        st.shutdown()
        lq.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmqtt bench lightqueue", description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per case (default 5)")
    ap.add_argument("--cases", default="publish,index,match",
                    help="comma list of publish,index,match (default all three)")
    ap.add_argument("--fanouts", default="1,4,16")
    ap.add_argument("--filters", default="10,10000,1000000", help="filter counts for the match case")
    ap.add_argument("--scale", type=int, default=0,
                    help="run only the scale case with this many distinct queues (e.g. 1000000)")
    ap.add_argument("--pulls", type=int, default=10_000, help="random pulls in the scale case")
    ap.add_argument("--body-size", type=int, default=100)
    ap.add_argument("--devices", type=int, default=1000, help="distinct topics in publish cases")
    ap.add_argument("--batch", type=int, default=256, help="messages per append_batch")
    ap.add_argument("--data-dir", default=None, help="parent of the temp data dirs (default: system tmp)")
    a = ap.parse_args(argv)
    if a.data_dir:
        os.makedirs(a.data_dir, exist_ok=True)
    if a.scale:
        progress(f"scale case: {a.scale} queues")
        case_scale(a.scale, a.duration, a.data_dir, a.pulls)
        return 0
    cases = {c.strip() for c in a.cases.split(",") if c.strip()}
    fanouts = [int(x) for x in a.fanouts.split(",")]
    if "publish" in cases:
        for f in fanouts:
            progress(f"publish fan-out {f} for {a.duration}s")
            case_publish(f, a.duration, a.body_size, a.devices, a.batch, a.data_dir)
    if "index" in cases:
        for f in fanouts:
            progress(f"index-only fan-out {f} for {a.duration}s")
            case_index(f, a.duration, a.devices, a.data_dir)
    if "match" in cases:
        for n in (int(x) for x in a.filters.split(",")):
            progress(f"match with {n} filters for {a.duration}s")
            case_match(n, a.duration, a.data_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
