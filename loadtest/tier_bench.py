"""`lmqtt bench tier`: tiered storage (store/tier) through the store's public API, one JSON object
per result on stdout.

Cases (each against every tier of `--tiers`: `file` = a local directory through file://, `s3` =
moto's S3 server started by the bench on a loopback port, or `--tier URL` [--tier-endpoint]):
* upload   100-byte messages appended in async flush mode for `--duration` s with the tier on
           (local retention 0: a segment goes as soon as the tier has it): the append rate
           (msgs/s, CommitLog MB/s), the uploader's rate (raw MB/s while it worked), their ratio
           (>= 1: the tier keeps up), and the segments still waiting at the end
* backlog  `--backlog` messages of 100 B (default 100,000): read back in pulls of 512 through
           MessageStore.read_many (the read a persistent session's light-queue backlog makes)
           from the local disk, then from the tier with a cold cache and again warm
* filter-sdk  a wildcard filter's history read back from the tier over the SDK (what `lmqtt consume
           --filter 'plant7/+/temp' --from earliest` does): a real `lmqtt store` with a file://
           tier and no local retention, `--filter-rows` matching messages of 100 B among as many
           others of the same first-level topic, every sealed segment offloaded; then a
           FilterConsumer from earliest reads the matching ones (msgs/s), and the first-level
           topic's consumer reads all of them (the reference)
* history-plan  read_history's driver planning over a tier of many Parquet files (`--plan-segments`
           segments of 256 KiB, 3 first-level topics: 3 files per segment, no merge): the tier's
           manifest read and the filter (`+/+/temp`) matched against every file's topic list,
           with the lists in the manifest (no request per file) and with the same manifest
           without them (a tier an older version wrote: one footer read per file). Spark itself
           is not started (its own file listing is the same either way).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from lmqtt.store import Message, MessageStore, StoreConfig
from lmqtt.store.client import connect
from lmqtt.store.spark.cold import ColdTier
from lmqtt.store.tier.config import TierConfig
from lmqtt.store.tier.objects import ObjectStore
from lmqtt.store.tier.parquet import ColumnarWriter, available


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class _Moto:
    def __init__(self) -> None:
        self.port = _free_port()
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
               "AWS_DEFAULT_REGION": "us-east-1"}
        os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")})
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        t_end = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                break
            except OSError:
                if time.monotonic() > t_end or self.proc.poll() is not None:
                    raise SystemExit("lmqtt bench tier: moto's S3 server did not start (pip install 'moto[server]')")
                time.sleep(0.1)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.n = 0

    def bucket(self) -> str:
        import boto3  # optional: the bench and test extras (moto's S3)
        self.n += 1
        name = f"bench{self.n}"
        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1").create_bucket(Bucket=name)
        return f"s3://{name}/lmqtt"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def _store(base: str, url: str, endpoint: str | None, seg_mb: int, **kw) -> MessageStore:
    st = MessageStore(StoreConfig(data_dir=os.path.join(base, "store"), flush_mode="async",
                                  segment_size=seg_mb << 20))
    tk = {"local_retention_ms": 0, "upload_interval_ms": 100}
    tk.update(kw)
    st.enable_tier(TierConfig(url=url, endpoint=endpoint, **tk))
    st.start()
    return st


def bench_upload(base: str, tier: str, url: str, endpoint: str | None, duration: float, seg_mb: int,
                 batch: int) -> dict:
    st = _store(base, url, endpoint, seg_mb)
    body = os.urandom(100)
    msgs = [Message(f"bench/{i % 16}/t", body) for i in range(batch)]
    n = 0
    t0 = time.monotonic()
    t_end = t0 + duration
    while time.monotonic() < t_end:
        st.append_batch(msgs)
        n += batch
    secs = time.monotonic() - t0
    log_bytes = st.max_offset
    st.clog.flush()
    waiting_at_end = len(st.tier.pending())
    # let the uploader finish what was sealed (bounded), to report its rate over real work
    t_wait = time.monotonic() + 120
    while st.tier.pending() and time.monotonic() < t_wait:
        time.sleep(0.1)
    s = st.tier_stats()
    st.shutdown()
    append_mb_s = log_bytes / secs / 1e6
    up_mb_s = s["uploaded_raw_bytes"] / st.tier.upload_seconds / 1e6 if st.tier.upload_seconds else None
    return {"case": "upload", "tier": tier, "msg_bytes": 100, "segment_mb": seg_mb, "seconds": round(secs, 2),
            "append_msgs_per_s": round(n / secs), "append_mb_per_s": round(append_mb_s, 1),
            "segments_uploaded": s["uploaded"], "upload_mb_per_s": round(up_mb_s, 1) if up_mb_s else None,
            "upload_vs_append": round(up_mb_s / append_mb_s, 2) if up_mb_s else None,
            "segments_waiting_at_end": waiting_at_end, "codec": s["codec"],
            "compression_ratio": round(s["tier_raw_bytes"] / s["tier_stored_bytes"], 1) if s["tier_stored_bytes"] else None}


def _pull_all(st, entries, chunk: int) -> tuple[int, float]:
    t0 = time.monotonic()
    n = 0
    for i in range(0, len(entries), chunk):
        got = st.read_many(entries[i:i + chunk])
        for g in got:
            if isinstance(g, BaseException):
                raise g
        n += len(got)
    return n, time.monotonic() - t0


def bench_backlog(base: str, tier: str, url: str, endpoint: str | None, count: int, seg_mb: int, chunk: int) -> dict:
    st = _store(base, url, endpoint, seg_mb, local_retention_ms=3600_000)
    body = os.urandom(100)
    for i in range(0, count, 1000):
        st.append_batch([Message("session/backlog", body) for _ in range(min(1000, count - i))])
    st.append_batch([Message("filler/x", os.urandom(4096)) for _ in range((seg_mb << 20) // 4096 + 16)])
    st.clog.flush()
    st.wait_dispatched(st.max_offset, 60)
    cq = st.consume_queues.get("session", 0)
    entries = [(e[1], e[2]) for e in cq.range(0, count)]
    assert len(entries) == count, (len(entries), count)
    n, local_s = _pull_all(st, entries, chunk)
    t_end = time.monotonic() + 300
    while st.tier.pending() and time.monotonic() < t_end:
        time.sleep(0.1)
    # now drop the local copies (the tier has them): local retention 0
    st.tier.cfg.local_retention_ms = 0
    t_end = time.monotonic() + 60
    while st.clog.mfq.min_offset <= entries[-1][0] and time.monotonic() < t_end:
        st.delete_expired_segments()
        time.sleep(0.2)
    assert st.clog.mfq.min_offset > entries[-1][0], "the backlog's segments did not leave the local disk"
    st.tier.cache.clear()
    st.tier.cache_bytes = 0
    _, cold_s = _pull_all(st, entries, chunk)
    _, warm_s = _pull_all(st, entries, chunk)
    s = st.tier_stats()
    st.shutdown()
    return {"case": "backlog", "tier": tier, "messages": n, "msg_bytes": 100, "pull": chunk,
            "local_msgs_per_s": round(n / local_s), "tier_cold_msgs_per_s": round(n / cold_s),
            "tier_warm_msgs_per_s": round(n / warm_s), "tier_cold_vs_local": round(local_s / cold_s, 2),
            "tier_warm_vs_local": round(local_s / warm_s, 2), "segments_fetched": s["cache_misses"]}


def bench_history_plan(base: str, tier: str, url: str, endpoint: str | None, segments: int, repeat: int) -> dict:
    seg = 256 << 10
    st = MessageStore(StoreConfig(data_dir=os.path.join(base, "store"), flush_mode="async", segment_size=seg,
                                  max_message_size=64 << 10))
    st.enable_tier(TierConfig(url=url, endpoint=endpoint, local_retention_ms=0, upload_interval_ms=100,
                              parquet_merge_after_ms=3600_000, parquet_merge_files=1 << 20))
    if available() is not None:
        raise SystemExit(f"lmqtt bench tier: history-plan: {available()}")
    st.tier.columnar = ColumnarWriter(st)          # what --tier-parquet on attaches
    st.start()
    try:
        body = os.urandom(100)
        batch = [Message(f"{fl}/{i}/{kind}", body) for fl in ("a", "b", "c") for i in range(40)
                 for kind in ("temp", "hum")]
        t_end = time.monotonic() + 120
        while len(st.clog.mfq.files) <= segments and time.monotonic() < t_end:
            st.append_batch(batch)
        st.clog.flush()
        t_end = time.monotonic() + 120
        while (st.tier.pending() or len(st.tier.segments) < segments) and time.monotonic() < t_end:
            time.sleep(0.2)
        nseg = len(st.tier.segments)
    finally:
        st.shutdown()
    flt = "+/+/temp"
    doc = json.loads(ObjectStore(url, endpoint).get("manifest.json"))

    def plan(old: bool):
        t0 = time.perf_counter()
        if old:   # the same tier as an older version wrote it: no lists in its manifest
            d = json.loads(ObjectStore(url, endpoint).get("manifest.json"))
            d.pop("parquet_topics", None)
            ct = ColdTier(url, d)
        else:
            ct = ColdTier.open(url, endpoint, missing_ok=False)
        keys = ct.file_keys(None)
        names, _every = ct.matching_topics(keys, flt, endpoint)
        return time.perf_counter() - t0, len(keys), len(names)

    out: dict = {"case": "history-plan", "tier": tier, "segments": nseg, "filter": flt,
                 "manifest_bytes": len(json.dumps(doc)), "listed_files": len(doc.get("parquet_topics", {}).get("files", {}))}
    for name, old in (("footers", True), ("manifest", False)):
        runs = [plan(old) for _ in range(max(1, repeat))]
        out["files"], out["topics_matched"] = runs[0][1], runs[0][2]
        out[f"{name}_s"] = round(min(r[0] for r in runs), 4)
        out[f"{name}_median_s"] = round(statistics.median(r[0] for r in runs), 4)
    out["speedup"] = round(out["footers_s"] / out["manifest_s"], 1)
    return out


def bench_filter_sdk(base: str, rows: int, seg_mb: int, repeat: int) -> dict:
    """See the module docstring (`filter-sdk`); a file:// tier only (the store runs as its own process)."""
    port = _free_port()
    log_path = os.path.join(base, "store.log")
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "lmqtt.gateway.cli", "store", "--host", "127.0.0.1",
                             "--port", str(port), "--data-dir", os.path.join(base, "data"), "--segment-mb",
                             str(seg_mb), "--tier", f"file://{os.path.join(base, 'tier')}", "--tier-parquet", "off",
                             "--local-retention", "0", "--metrics-port", "0"], stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        t_end = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"lmqtt bench tier: lmqtt store exited with {proc.returncode} (log: {log_path})")
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > t_end:
                    raise SystemExit(f"lmqtt bench tier: lmqtt store did not listen in 60 s (log: {log_path})")
                time.sleep(0.1)
        body = os.urandom(100)
        with connect(address) as c:
            p = c.producer()
            batch = []
            for i in range(rows):
                d = i % 200
                batch += [(f"plant7/d{d}/temp", body), (f"plant7/d{d}/hum", body)]
                if len(batch) >= 1000:
                    p.send_batch(batch)
                    batch = []
            if batch:
                p.send_batch(batch)
            # filler in another first-level topic seals the last segment of plant7's records
            filler = [("filler/x", os.urandom(4096))] * 64
            for _ in range(((seg_mb << 20) // (4096 * 64)) + 2):
                p.send_batch(filler)
            t_end = time.monotonic() + 300
            while True:
                s = c.cmd("tier")["tier"]
                if s["local_segments"] <= 1 and s["uploading_segments"] == 0 and s["tier_segments"]:
                    break
                if time.monotonic() > t_end:
                    raise SystemExit(f"lmqtt bench tier: segments not offloaded in 300 s: {s}")
                time.sleep(0.3)
            tier_segments = s["tier_segments"]
        runs, topic_runs = [], []
        for _ in range(max(1, repeat)):
            with connect(address) as c:
                fc = c.filter_consumer("plant7/+/temp", start="earliest", max_count=1024)
                n = 0
                t0 = time.perf_counter()
                while n < rows and time.perf_counter() - t0 < 600:
                    got = fc.poll()
                    n += len(got)
                runs.append((n, time.perf_counter() - t0))
                cons = c.consumer("plant7", f"bench-{time.time_ns()}", max_count=1024)
                m = 0
                t0 = time.perf_counter()
                while m < 2 * rows and time.perf_counter() - t0 < 600:
                    recs = cons.poll()
                    if not recs:
                        break
                    m += len(recs)
                topic_runs.append((m, time.perf_counter() - t0))
        rates = [n / t for n, t in runs]
        trates = [m / t for m, t in topic_runs]
        return {"case": "filter-sdk", "tier": "file", "filter": "plant7/+/temp", "matching": rows,
                "of_first_level": 2 * rows, "tier_segments": tier_segments, "read": runs[0][0],
                "filter_msgs_per_s": round(statistics.median(rates)), "filter_best_msgs_per_s": round(max(rates)),
                "filter_seconds": round(statistics.median(t for _n, t in runs), 3),
                "topic_msgs_per_s": round(statistics.median(trates)), "topic_read": topic_runs[0][0],
                "repeat": len(runs)}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmqtt bench tier", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="upload,backlog")
    ap.add_argument("--tiers", default="file,s3", help="file, s3 (moto's server, started here), comma-separated")
    ap.add_argument("--tier", help="a tier URL of your own instead of --tiers (e.g. s3://bucket/prefix)")
    ap.add_argument("--tier-endpoint", help="S3 endpoint for --tier")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of appends in the upload case (default 10)")
    ap.add_argument("--batch", type=int, default=64, help="messages per append_batch (default 64)")
    ap.add_argument("--segment-mb", type=int, default=32, help="CommitLog segment size (default 32)")
    ap.add_argument("--backlog", type=int, default=100_000, help="messages in the backlog case (default 100,000)")
    ap.add_argument("--pull", type=int, default=512, help="messages per read in the backlog case (default 512)")
    ap.add_argument("--plan-segments", type=int, default=40, help="segments in the history-plan case (default 40)")
    ap.add_argument("--repeat", type=int, default=5, help="runs of the history-plan case; best and median (default 5)")
    ap.add_argument("--filter-rows", type=int, default=120_000,
                    help="matching messages in the filter-sdk case (as many others beside them; default 120,000)")
    ap.add_argument("--data-dir", default=None)
    a = ap.parse_args(argv)
    base = a.data_dir or tempfile.mkdtemp(prefix="lmqtt-tier-bench-")
    os.makedirs(base, exist_ok=True)
    moto = None
    try:
        tiers = [("custom", None)] if a.tier else [(t, None) for t in a.tiers.split(",") if t]
        for c in [c for c in a.cases.split(",") if c]:
            for tier, _ in tiers:
                sub = tempfile.mkdtemp(dir=base)
                if tier == "custom":
                    url, ep = a.tier, a.tier_endpoint
                elif tier == "file":
                    url, ep = f"file://{os.path.join(sub, 'tier')}", None
                elif tier == "s3":
                    if moto is None:
                        moto = _Moto()
                    url, ep = moto.bucket(), moto.endpoint
                else:
                    print(f"lmqtt bench tier: unknown tier {tier!r} (file, s3)", file=sys.stderr)
                    return 2
                print(f"[tier] {c} on {tier} ...", file=sys.stderr, flush=True)
                if c == "upload":
                    r = bench_upload(sub, tier, url, ep, a.duration, a.segment_mb, a.batch)
                elif c == "backlog":
                    r = bench_backlog(sub, tier, url, ep, a.backlog, a.segment_mb, a.pull)
                elif c == "history-plan":
                    r = bench_history_plan(sub, tier, url, ep, a.plan_segments, a.repeat)
                elif c == "filter-sdk":
                    if tier != "file":
                        continue
                    r = bench_filter_sdk(sub, a.filter_rows, min(a.segment_mb, 8), a.repeat)
                else:
                    print(f"lmqtt bench tier: unknown case {c!r} (upload, backlog, history-plan, filter-sdk)",
                          file=sys.stderr)
                    return 2
                print(json.dumps(r), flush=True)
                shutil.rmtree(sub, ignore_errors=True)
    finally:
        if moto is not None:
            moto.stop()
        if not a.data_dir:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
