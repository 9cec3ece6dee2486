"""Parquet compaction of the tier (`ParquetCompaction`, a part of `TierService`): each partition's
(first-level topic, day) small Parquet files merged into files of up to `parquet_file_bytes`.

Separate from store/tier/service.py because it is a job of its own over what the upload wrote:
it runs only with a columnar hook that can merge (store/spark/cold.py), reads and rewrites
Parquet objects, never CommitLog segments, and keeps its own counters. Crash-safe the way an
upload is (one atomic put, then the manifest, then the deletes). `TierService` inherits these
methods; the state they use (`objects`, `segments`, `columnar`, the locks, `_write_manifest`) is
the service's.
"""
from __future__ import annotations

import logging
import time

from .objects import TierUnavailable, pause_point

log = logging.getLogger("lmqtt.store")


class ParquetCompaction:
    """The Parquet-merging methods of `TierService` (see the module docstring)."""

    def _parquet_size(self, key: str) -> int:
        n = self.parquet_sizes.get(key)
        if n is None:
            try:
                n = self.objects.size(key)
            except FileNotFoundError:
                log.error("tier: %s is listed by the manifest but missing; not merged", self.objects.where(key))
                n = 1 << 62              # never small: left as it is
            self.parquet_sizes[key] = n
        return n

    def _merge_runs(self, segs: list[dict], now_ms: int) -> list[tuple[list[str], int]]:
        """The merges due: ([keys in offset order], start of the last one's segment). Only over
        the tier's Parquet prefix (segments from the first, contiguous, each with its files: what
        read_history reads as Parquet; a merge never reaches past a segment without Parquet, whose
        rows read_history reads through the source)."""
        cfg = self.cfg
        small = cfg.parquet_file_bytes // 2
        parts: dict[str, list] = {}          # partition dir -> [(key, start of its last segment, uploaded_ms)]
        where: dict[str, tuple] = {}
        end = None
        for s in segs:
            if "parquet" not in s or (end is not None and s["start"] != end):
                break
            end = s["end"]
            for k in s["parquet"]:
                if k in where:               # a merged file: listed by each of its segments
                    d, i = where[k]
                    key, _st, _up = parts[d][i]
                    parts[d][i] = (key, s["start"], s.get("uploaded_ms", 0))
                    continue
                d = k.rsplit("/", 1)[0]
                lst = parts.setdefault(d, [])
                where[k] = (d, len(lst))
                lst.append((k, s["start"], s.get("uploaded_ms", 0)))
        out = []
        waiting = 0
        for files in parts.values():
            run: list = []
            runs = []
            for f in files:
                size = self._parquet_size(f[0])
                if size >= small:
                    runs.append(run)
                    run = []
                    continue
                if run and sum(x[3] for x in run) + size > cfg.parquet_file_bytes:
                    runs.append(run)
                    run = []
                run.append((*f, size))
            runs.append(run)
            for run in runs:
                if len(run) < 2:
                    continue
                if (len(run) >= cfg.parquet_merge_files or sum(x[3] for x in run) >= small
                        or now_ms - max(x[2] for x in run) >= cfg.parquet_merge_after_ms):
                    out.append(([x[0] for x in run], run[-1][1]))
                else:
                    waiting += 1
        self.parquet_waiting = waiting + len(out)      # each due merge counts until it is done
        return out

    def compact_parquet(self, now_ms: int | None = None) -> int:
        """Merge each partition's (first-level topic, day) small Parquet files into files of up to
        `parquet_file_bytes` (Spark reads few row-group-sized files faster than many small ones).
        Crash-safe as an upload: the merged file is one atomic put; then the manifest lists it in
        place of the small files (each segment whose rows it holds names it); only then are the
        small files deleted. A kill -9 before the manifest leaves a file no manifest names, after
        it small files no manifest names: either is removed at the next start. Returns the number
        of merges."""
        merge = getattr(self.columnar, "merge", None)
        if merge is None or not self.synced:
            return 0
        if now_ms is None:
            now_ms = int(time.time() * 1000)
        n = 0
        with self._hk_lock:
            with self._lock:
                segs = list(self.segments)
            upto = segs[-1]["end"] if segs else None
            for keys, last_start in self._merge_runs(segs, now_ms):
                if self._stop.is_set():
                    break
                new_key = self.columnar.merged_key(keys[0], last_start)
                t0 = time.monotonic()
                try:
                    data, rows = merge(self.objects.get(k) for k in keys)
                except (OSError, ValueError) as e:     # missing, or unreadable as Parquet
                    log.error("tier: cannot merge %s ... (%s: %s); those files are left as they are",
                              self.objects.where(keys[0]), type(e).__name__, e)
                    for k in keys:
                        self.parquet_sizes[k] = 1 << 62
                    self.parquet_waiting = max(0, self.parquet_waiting - 1)
                    continue
                self.objects.put(new_key, data)
                self.parquet_sizes[new_key] = len(data)
                self._file_topics(new_key, data)        # the union of the merged files' lists
                pause_point("parquet-merge")
                gone = set(keys)
                with self._lock:
                    segs = [dict(s, parquet=list(dict.fromkeys(new_key if k in gone else k for k in s["parquet"])))
                            if "parquet" in s and gone.intersection(s["parquet"]) else s for s in self.segments]
                self._write_manifest(segs)
                pause_point("parquet-merged")
                for k in keys:
                    try:
                        self.objects.delete(k)
                    except TierUnavailable as e:  # left behind; the next start's sync removes it
                        log.warning("tier: %s", e)
                    self.parquet_sizes.pop(k, None)
                self.parquet_merges += 1
                self.parquet_merged_files += len(keys)
                self.parquet_waiting = max(0, self.parquet_waiting - 1)
                n += 1
                log.info("tier: merged %d Parquet files (%d rows) into %s (%d bytes) in %.2f s", len(keys), rows,
                         self.objects.where(new_key), len(data), time.monotonic() - t0)
            self._compacted_upto = upto
        return n

    def _merges_waiting(self, segs: list[dict]) -> int:
        """Partitions whose small files wait for a merge, as of the last compaction pass; 1 more
        when segments came since that pass (it has not looked at their files yet)."""
        if getattr(self.columnar, "merge", None) is None:
            return 0
        end = segs[-1]["end"] if segs else None
        return self.parquet_waiting + (1 if end != self._compacted_upto and any("parquet" in s for s in segs) else 0)
