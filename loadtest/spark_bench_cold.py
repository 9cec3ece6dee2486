"""`lmqtt bench spark`'s cold-tier cases (cold-parquet, filter-history-cold; spark_bench.py's docstring
says what each measures): an `lmqtt store` with a file:// tier writing Parquet and keeping nothing
local, loaded, waited for until every sealed segment is offloaded and merged, then read by Spark.

Why a module of its own: spark_bench.py runs Spark over a live embedded `lmqtt serve` (the hot
cases, stream latency) and the command line; these cases run their own store process and its
tier, and compare Spark's readers of the tier's Parquet. They share the timed job and the load
helpers of spark_bench.py; its `main` imports this module for these cases only.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time

from lmqtt.store.client import connect
from lmqtt.store.spark import cold as cold_mod, read_history
from lmqtt.store.spark.source import SCHEMA

from .spark_bench_support import TOPIC, load, load_mixed, proc_cpu, spark_cpu, timed, touch_all


def _cold_store(base: str, segment_mb: int, name: str = "cold", extra: tuple = ()):
    """`lmqtt store` writing Parquet to a file:// tier under `base`: (Popen, address, tier dir, log)."""
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    tier = os.path.join(base, "tier" if name == "cold" else f"{name}-tier")
    log_path = os.path.join(base, f"{name}-store.log")
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "lmqtt.gateway.cli", "store", "--host", "127.0.0.1",
                             "--port", str(port), "--data-dir", os.path.join(base, f"{name}-data"),
                             "--segment-mb", str(segment_mb), "--tier", f"file://{tier}", "--tier-parquet", "on",
                             "--local-retention", "0", *extra], stdout=log, stderr=subprocess.STDOUT)
    t_end = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"lmqtt store exited with {proc.returncode} (log: {log_path})")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if time.monotonic() > t_end:
                proc.kill()
                raise RuntimeError(f"lmqtt store did not listen in 60 s (log: {log_path})")
            time.sleep(0.2)
    print(f"[spark] cold store pid {proc.pid}, tier {tier}", file=sys.stderr, flush=True)
    return proc, f"127.0.0.1:{port}", tier, log


def _stop_store(proc, log) -> None:
    """End a `_cold_store` (SIGTERM, SIGKILL after 30 s) and close its log."""
    proc.terminate()
    try:
        proc.wait(30)
    except Exception:  # noqa: BLE001
        proc.kill()
    log.close()


def _wait_offloaded(address: str, timeout: float) -> dict:
    """The tier's stats once every sealed segment is in the tier (with Parquet), off the disk, and
    no partition's small Parquet files wait for a merge (the compaction's quiet delay)."""
    t_end = time.monotonic() + timeout
    with connect(address) as c:
        while True:
            s = c.cmd("tier")["tier"]
            if (s["local_segments"] == 1 and s["uploading_segments"] == 0 and s["tier_segments"]
                    and s["parquet_segments"] == s["tier_segments"] and not s.get("parquet_waiting_merges")):
                return s
            if s.get("parquet_error"):
                raise RuntimeError(f"the store wrote no Parquet: {s['parquet_error']}")
            if time.monotonic() > t_end:
                raise RuntimeError(f"segments not offloaded in {timeout:.0f} s: {s}")
            time.sleep(0.5)


def bench_cold(spark, rows: int, size: int, base: str, per_partition: int, repeat: int, segment_mb: int) -> list:
    import pyarrow.parquet as pq  # optional: the spark extra

    cols = [c.split()[0] for c in SCHEMA.split(", ")]
    proc, address, tier, log = _cold_store(base, segment_mb)
    out = []
    try:
        print(f"[spark] cold: loading {rows:,} messages of {size} B ...", file=sys.stderr, flush=True)
        el = load(address, rows, size)
        t0 = time.perf_counter()
        st = _wait_offloaded(address, 1800)
        up = time.perf_counter() - t0
        with open(os.path.join(tier, "manifest.json")) as f:
            man = json.load(f)
        # a merged file is listed by every segment whose rows it holds: each once
        files = [os.path.join(tier, k) for k in dict.fromkeys(k for e in man["segments"] for k in e["parquet"])]
        cold_rows = sum(pq.ParquetFile(p).metadata.num_rows for p in files)
        pq_bytes = sum(os.path.getsize(p) for p in files)
        print(f"[spark] cold: loaded in {el:.1f} s; {cold_rows:,} rows in {len(files)} Parquet files "
              f"({pq_bytes / 1e6:.0f} MB) {up:.1f} s after the load", file=sys.stderr, flush=True)
        common = {"rows": cold_rows, "size": size, "segments": st["tier_segments"], "segment_mb": segment_mb,
                  "parquet_files": len(files), "parquet_merges": st.get("parquet_merges"),
                  "plain_parquet_files": None}
        cdf = spark.read.parquet(f"file://{tier}/parquet").select(*cols)
        plain = os.path.join(base, "plain-parquet")
        cdf.write.mode("overwrite").parquet(plain)         # also the session's first (warm-up) job
        pdf = spark.read.schema(cdf.schema).parquet(plain)
        common["plain_parquet_files"] = len([n for n in os.listdir(plain) if n.endswith(".parquet")])
        common.update(_layout(files, "cold"), **_layout(
            [os.path.join(plain, n) for n in sorted(os.listdir(plain)) if n.endswith(".parquet")], "plain"))
        # alternated, run by run, the order swapped every round (cold-plain, plain-cold, ...): the
        # machine's load changes under both the same way, and neither always runs right after the
        # other's reads warmed the caches. The ratio is the median of the rounds' ratios (each
        # round's pair ran back to back), not best against best
        c_runs, p_runs, c_cpu, p_cpu = [], [], [], []
        for i in range(max(1, repeat)):
            pair = [("c", cdf), ("p", pdf)] if i % 2 == 0 else [("p", pdf), ("c", cdf)]
            for which, d in pair:
                j0 = spark_cpu(spark)[0]
                t = timed(d, cold_rows, 1, "cold-parquet" if which == "c" else "plain parquet")[0]
                (c_runs if which == "c" else p_runs).append(t)
                (c_cpu if which == "c" else p_cpu).append(spark_cpu(spark)[0] - j0)
        el_c, el_p = min(c_runs), min(p_runs)
        per_round = [p / c for c, p in zip(c_runs, p_runs)]
        out.append({"case": "cold-parquet", **common, "seconds": round(el_c, 3),
                    "runs_s": [round(t, 3) for t in c_runs],
                    "rows_per_s": round(cold_rows / el_c), "bytes_on_disk": pq_bytes,
                    "segments_raw_bytes": st["tier_raw_bytes"], "segments_stored_bytes": st["tier_stored_bytes"],
                    "upload_s_after_load": round(up, 1), "partitions": cdf.rdd.getNumPartitions()})
        out.append({"case": "cold-parquet:plain-parquet", **common, "seconds": round(el_p, 3),
                    "runs_s": [round(t, 3) for t in p_runs],
                    "rows_per_s": round(cold_rows / el_p), "partitions": pdf.rdd.getNumPartitions()})
        out[0]["vs_plain_parquet_per_run"] = [round(r, 2) for r in per_round]
        out[0]["vs_plain_parquet"] = round(statistics.median(per_round), 2)
        out[0]["vs_plain_parquet_best"] = round(el_p / el_c, 2)
        # the JVM's CPU seconds a run (Spark's Parquet reader and the job): what each copy costs to
        # read, which the load of other processes changes far less than the elapsed time
        out[0]["jvm_cpu_s_runs"] = [round(c, 2) for c in c_cpu]
        out[1]["jvm_cpu_s_runs"] = [round(c, 2) for c in p_cpu]
        if c_cpu and min(c_cpu) > 0:
            out[0]["cpu_vs_plain_parquet"] = round(statistics.median(p_cpu) / statistics.median(c_cpu), 2)
        out[0]["spark_conf"] = {k: spark.conf.get(k) for k in ("spark.sql.files.maxPartitionBytes",
                                                               "spark.sql.files.openCostInBytes",
                                                               "spark.sql.parquet.enableVectorizedReader")}
        sdf = (spark.read.format("lmqtt").option("store", address).option("topic", TOPIC)
               .option("recordsPerPartition", str(per_partition)).load())
        el_s, runs = timed(sdf, rows, repeat, "lmqtt source")
        out.append({"case": "cold-parquet:lmqtt-source", "rows": rows, "size": size, "seconds": round(el_s, 3),
                    "runs_s": runs, "rows_per_s": round(rows / el_s), "partitions": sdf.rdd.getNumPartitions(),
                    "note": "every row of the topic through the store (offloaded ones read back from the tier)"})
        hdf = read_history(spark, store=address, tier=f"file://{tier}", topic=TOPIC,
                           recordsPerPartition=per_partition)
        el_h, runs = timed(hdf, rows, repeat, "read_history")
        out.append({"case": "cold-parquet:read-history", "rows": rows, "size": size, "seconds": round(el_h, 3),
                    "runs_s": runs, "rows_per_s": round(rows / el_h), "cold_rows": cold_rows,
                    "hot_rows": rows - cold_rows})
        for r in out[1:]:
            r["vs_cold_parquet"] = round((r["rows_per_s"]) / out[0]["rows_per_s"], 2)
    finally:
        _stop_store(proc, log)
    return out


def _layout(paths: list, name: str) -> dict:
    """Files, row groups, rows per row group and codecs of a set of Parquet files (the cold copy and
    the yardstick side by side, so a reader can check they compare like with like)."""
    import pyarrow.parquet as pq  # optional: the spark extra
    groups, rows, codecs = 0, 0, set()
    for p in paths:
        md = pq.ParquetFile(p).metadata
        groups += md.num_row_groups
        rows += md.num_rows
        for g in range(md.num_row_groups):
            codecs.update(md.row_group(g).column(c).compression for c in range(md.num_columns))
    return {f"{name}_files": len(paths), f"{name}_row_groups": groups,
            f"{name}_rows_per_row_group": round(rows / max(1, groups)), f"{name}_codecs": sorted(codecs),
            f"{name}_bytes": sum(os.path.getsize(p) for p in paths)}


def bench_filter_history_cold(spark, rows: int, size: int, every: int, base: str, per_partition: int,
                              repeat: int, segment_mb: int, store_args: tuple = ()) -> list:
    """filter-history-cold: the filter-history load (1 in `every` of `rows` to fhist/dK/temp) written
    to a store with a file:// tier, Parquet on and no local retention; once offloaded (and the
    Parquet compacted), `read_history(filter="fhist/+/temp")` with the all-columns job, timed
    from the call (the driver's manifest and footer reads included) to the job's end, rows
    checked exact; then the same with the cold side filtered row by row (no topic list, no
    pushdown: what the read cost before the sorted, topic-listed files)."""
    import pyarrow.compute as pc  # optional: the spark extra
    import pyarrow.parquet as pq  # optional: the spark extra

    proc, address, tier, log = _cold_store(base, segment_mb, "fhist", store_args)
    out = []
    try:
        print(f"[spark] filter-history-cold: loading {rows:,} messages of {size} B, 1 in {every} matching ...",
              file=sys.stderr, flush=True)
        load_s = load_mixed(address, rows, size, every)
        t0 = time.perf_counter()
        st = _wait_offloaded(address, 1800)
        up = time.perf_counter() - t0
        want = len(range(0, rows, every))
        ct = cold_mod.ColdTier.open(f"file://{tier}")
        keys = ct.file_keys({"fhist"})
        cold_rows = groups = 0
        for k in keys:
            f = pq.ParquetFile(os.path.join(tier, k))
            groups += f.metadata.num_row_groups
            cold_rows += pc.sum(pc.match_substring(f.read(columns=["topic"]).column("topic"), "/temp")).as_py() or 0
        common = {"rows": want, "among": rows, "size": size, "cold_rows": cold_rows, "hot_rows": want - cold_rows,
                  "parquet_files": len(keys), "row_groups": groups, "segments": st["tier_segments"],
                  "load_s": round(load_s, 1), "upload_s_after_load": round(up, 1)}
        print(f"[spark] filter-history-cold: {cold_rows:,} of {want:,} rows cold in {len(keys)} files, "
              f"{up:.1f} s after the load", file=sys.stderr, flush=True)

        def runs(case: str) -> dict:
            times, jvm, store = [], [], []
            for _ in range(max(1, repeat)):
                j0, s0 = spark_cpu(spark)[0], proc_cpu(proc)
                t = time.perf_counter()
                df = read_history(spark, store=address, tier=f"file://{tier}", filter="fhist/+/temp",
                                  recordsPerPartition=per_partition)
                r = touch_all(df)
                times.append(time.perf_counter() - t)
                jvm.append(round(spark_cpu(spark)[0] - j0, 2))
                store.append(round(proc_cpu(proc) - s0, 2))
                if r["n"] != want:
                    raise RuntimeError(f"{case}: read_history returned {r['n']} rows, {want} were written")
            el = min(times)
            return {"case": case, **common, "seconds": round(el, 3), "runs_s": [round(x, 3) for x in times],
                    "rows_per_s": round(want / el), "scanned_per_s": round(rows / el),
                    "jvm_cpu_s_runs": jvm, "store_cpu_s_runs": store}

        out.append(runs("filter-history-cold"))
        keep = cold_mod.ColdTier.matching_topics
        cold_mod.ColdTier.matching_topics = lambda *a, **k: None        # the row-by-row regex instead
        try:
            out.append(runs("filter-history-cold:regex-no-pushdown"))
        finally:
            cold_mod.ColdTier.matching_topics = keep
        out[1]["vs_pushdown"] = round(out[1]["rows_per_s"] / out[0]["rows_per_s"], 2)
    finally:
        _stop_store(proc, log)
    return out
