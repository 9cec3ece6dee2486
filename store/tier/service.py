"""`TierService`: moves sealed CommitLog segments to object storage and reads them back.

Layout in the tier (under the `--tier` URL):

    manifest.json                         what the tier holds: one entry per segment, written last
    commitlog/<20-digit start offset>.zst one sealed segment, compressed (.zz zlib, .seg none)
    parquet/first_level=<t>/date=<day>/<20-digit start offset>.parquet
                                          with a columnar hook (the node's --tier-parquet): the
                                          segment's records for Spark, written after the segment's
                                          object and before the manifest entry that names them

Upload (one background thread, oldest segment first): a segment is *sealed* when a later one
exists and all its bytes are flushed. Its bytes are compressed, hashed (sha256 of the object),
written as one object (atomic: see objects.py), then the manifest listing it is written (one
atomic object), then a local copy of the manifest (`<store data dir>/tier/manifest.json`). Only a
segment in a committed manifest counts as being in the tier; a process killed before the
manifest write leaves an object no manifest names: it is removed (or overwritten by the same
key) when the upload resumes at the next start, so nothing is listed twice and nothing half
written is ever read. Local files are deleted only when the manifest holds them, every
dispatcher is past them and the local retention (time or size) says so.

Reads (store/tier/reads.py, `TierReads`): the ConsumeQueues, key index and light queues stay
on the node (20 B per message); only the CommitLog bytes move. A read by offset below the first
local segment (CommitLog.read / read_many) comes here: the segment's object is fetched once, its sha256 checked (a mismatch is
reported and nothing of it is served), decompressed, and kept in a bounded in-memory cache
(`cache_bytes`, LRU); records are decoded and CRC-checked as from a local segment.

Parquet compaction (with a columnar hook that merges): store/tier/compaction.py
(`ParquetCompaction`).

Tier retention drops whole segments from the front (manifest first, then the objects), and only
then are the dispatchers told the log starts later (their files below it go).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict

from ..atomic_file import write_atomic
from ..errors import StoreError
from ..mapped_file import file_name
from ..record import HEADER_SIZE, PREFIX, decode
from . import codec as codecs, topics as topic_lists
from .compaction import ParquetCompaction
from .config import TierConfig
from .objects import ObjectStore, TierUnavailable, pause_point
from .reads import TierReads

log = logging.getLogger("lmqtt.store")

MANIFEST = "manifest.json"
SEG_DIR = "commitlog"
PARQUET_DIR = "parquet"


class TierMismatch(StoreError):
    """The tier URL holds another store's segments."""


def _now_ms() -> int:
    return int(time.time() * 1000)


class TierService(ParquetCompaction, TierReads):
    def __init__(self, store, cfg: TierConfig) -> None:
        cfg.validate()
        self.store = store
        self.clog = store.clog
        self.cfg = cfg
        self.codec = codecs.choose(cfg.codec)
        self.objects = ObjectStore(cfg.url, cfg.endpoint, cfg.storage_options, cfg.timeout_s)
        self.local_dir = os.path.join(store.cfg.data_dir, "tier")
        self.segments: list[dict] = []      # committed manifest entries, by start offset
        self._starts: list[int] = []
        self._first: int | None = None       # the tier's first offset (None: it holds nothing)
        self._lock = threading.Lock()        # segments / cache bookkeeping
        self._hk_lock = threading.Lock()     # housekeeping (uploader thread, background service)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.synced = False                  # the tier's manifest was read since start
        self.uploading: int | None = None    # start offset of the segment being uploaded
        self.error: str | None = None        # the last failure talking to the tier (None: fine)
        self.error_since: float | None = None
        self.uploaded = 0                    # segments uploaded by this process
        self.uploaded_raw = 0
        self.uploaded_stored = 0
        self.upload_seconds = 0.0
        self.local_deleted = 0
        self.tier_deleted = 0
        self.corrupt_objects = 0
        self._corrupt_seen: set = set()
        self.cache: OrderedDict = OrderedDict()   # start -> decompressed segment bytes
        self.cache_bytes = 0
        self.cache_hits = 0
        self.cache_misses = 0
        self.fetch_seconds = 0.0
        self._fetching: dict[int, threading.Lock] = {}
        self._gap_logged = False
        # columnar hook (set by the node before start: store/spark/cold.py ColumnarWriter):
        # (segment bytes, start offset) -> [(key under the tier root, bytes)]; None: no Parquet
        self.columnar = None
        self.columnar_error: str | None = None
        self.parquet_sizes: dict[str, int] = {}   # Parquet key -> bytes (asked of the tier once after a start)
        # Parquet key -> its distinct topics (sorted list, or "many"): the manifest's parquet_topics
        # (store/tier/topics.py), from the hook's `topics` when a file is written or merged
        self.parquet_topics: dict[str, list | str] = {}
        self.parquet_merges = 0                   # merges (compaction) done by this process
        self.parquet_merged_files = 0             # files they replaced
        self.parquet_waiting = 0                  # merges not done yet (due or waiting) as of the last pass
        self._compacted_upto = None               # the tier's end offset at the last compaction pass

    # ------------------------------------------------------------------ manifest
    def _manifest_doc(self, segments: list[dict]) -> bytes:
        doc = {"version": 1, "store": self.store.ident, "segment_size": self.clog.seg_size,
               "written_ms": _now_ms(), "segments": segments}
        named = dict.fromkeys(k for s in segments for k in s.get("parquet", ()))
        pt = topic_lists.encode(self.parquet_topics, named)
        if pt is not None:
            doc["parquet_topics"] = pt
        return json.dumps(doc, indent=0).encode()

    def _file_topics(self, key: str, data: bytes) -> None:
        """Record the distinct topics of the Parquet file `key` (its bytes in hand) for the manifest."""
        fn = getattr(self.columnar, "topics", None)
        if fn is None:
            return
        try:
            self.parquet_topics[key] = fn(data)
        except Exception as e:  # noqa: BLE001 - no list: read_history reads that file's footer
            log.warning("tier: no topic list for %s in the manifest (%s: %s)", self.objects.where(key),
                        type(e).__name__, e)

    def _set_segments(self, segments: list[dict]) -> None:
        with self._lock:
            self.segments = segments
            self._starts = [s["start"] for s in segments]
            self._first = segments[0]["start"] if segments else None   # read without the lock

    def _check_doc(self, doc: dict, where: str) -> list[dict]:
        if doc.get("version") != 1:
            raise TierMismatch(f"{where}: unknown manifest version {doc.get('version')!r}")
        if doc.get("store") != self.store.ident:
            raise TierMismatch(f"{where} holds the segments of store {doc.get('store')}, not of this data dir's "
                               f"store {self.store.ident}: give each store its own --tier prefix")
        if doc.get("segment_size") != self.clog.seg_size:
            raise TierMismatch(f"{where}: segments of {doc.get('segment_size')} bytes, this store's are "
                               f"{self.clog.seg_size}")
        return sorted(doc.get("segments", []), key=lambda s: s["start"])

    def _load_local(self) -> None:
        path = os.path.join(self.local_dir, MANIFEST)
        try:
            with open(path, "rb") as f:
                doc = json.loads(f.read())
        except FileNotFoundError:
            return
        except ValueError as e:
            log.error("tier: the local manifest copy %s is unreadable (%s); reading the tier's", path, e)
            return
        self._set_segments(self._check_doc(doc, path))
        self.parquet_topics = topic_lists.decode(doc)

    def _write_manifest(self, segments: list[dict]) -> None:
        """Commit `segments` as what the tier holds: the tier's manifest (atomic), then the local copy."""
        data = self._manifest_doc(segments)
        self.objects.put(MANIFEST, data)
        os.makedirs(self.local_dir, exist_ok=True)
        path = os.path.join(self.local_dir, MANIFEST)
        write_atomic(path, data)
        self._set_segments(segments)
        named = {k for s in segments for k in s.get("parquet", ())}
        for k in [k for k in self.parquet_topics if k not in named]:
            self.parquet_topics.pop(k, None)

    def _sync(self) -> None:
        """Read the tier's manifest (the authority) and remove what no manifest names."""
        self.objects.ensure()
        try:
            raw = self.objects.get(MANIFEST)
        except FileNotFoundError:
            raw = None
        if raw is None:
            tier_segs: list[dict] = []
            if self.segments:
                log.error("tier: %s has no manifest, but this node's copy lists %d uploaded segment(s) "
                          "[%d, %d): they are not readable from the tier any more", self.objects.where(MANIFEST),
                          len(self.segments), self.segments[0]["start"], self.segments[-1]["end"])
        else:
            try:
                doc = json.loads(raw)
            except ValueError as e:
                raise TierMismatch(f"{self.objects.where(MANIFEST)} is not a readable manifest: {e}") from None
            tier_segs = self._check_doc(doc, self.objects.where(MANIFEST))
            self.parquet_topics = topic_lists.decode(doc)
        named = {s["key"] for s in tier_segs} | {k for s in tier_segs for k in s.get("parquet", ())}
        for key in self.objects.list(SEG_DIR) + self.objects.find(PARQUET_DIR):
            if key not in named:
                # a kill -9 before its manifest write, or after a retention's manifest write
                log.info("tier: removing %s, which no manifest names (an upload cut short, or retention)",
                         self.objects.where(key))
                self.objects.delete(key)
        if raw is None and self.segments:
            self._write_manifest(tier_segs)
        else:
            self._set_segments(tier_segs)
            if raw is not None:
                os.makedirs(self.local_dir, exist_ok=True)
                write_atomic(os.path.join(self.local_dir, MANIFEST), raw)
        self.synced = True

    # ------------------------------------------------------------------ lifecycle
    def load(self) -> None:
        """Called by MessageStore.start() before recovery and the dispatchers' checks: the local
        manifest copy tells which offloaded ranges exist (the store's min_offset) before the tier
        answers. A copy that does not fit this store is reported and ignored (the tier's manifest
        decides when the tier answers)."""
        try:
            self._load_local()
        except TierMismatch as e:
            log.error("tier: %s; ignored", e)

    def start(self) -> None:
        """Called by MessageStore.start() after recovery: the uploader thread does the rest."""
        self._thread = threading.Thread(target=self._run, name="lmqtt-tier", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        t = self._thread
        if t is not None:
            # an upload in flight finishes or times out; a shutdown does not wait for an outage
            # (what is not in a committed manifest stays local and is uploaded at the next start)
            t.join(min(self.cfg.timeout_s, 10.0))

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        backoff = self.cfg.upload_interval_ms / 1000
        while not self._stop.is_set():
            try:
                if not self.synced:
                    self._sync()
                self.upload_pending()
                self.compact_parquet()
                self.housekeep()
            except (TierUnavailable, OSError) as e:
                self._failed(e)
                backoff = min(max(backoff * 2, 1.0), 30.0)
            except TierMismatch as e:
                self._failed(e)
                backoff = 30.0
            except Exception as e:  # noqa: BLE001 - the uploader keeps going; the node keeps serving
                log.exception("tier: uploader step failed")
                self._failed(e)
                backoff = min(max(backoff * 2, 1.0), 30.0)
            else:
                if self.error is not None:
                    log.warning("tier: %s reachable again after %.0f s; uploads caught up", self.cfg.url,
                                time.monotonic() - (self.error_since or time.monotonic()))
                    self.error = None
                    self.error_since = None
                backoff = self.cfg.upload_interval_ms / 1000
            self._wake.wait(backoff)
            self._wake.clear()

    def _failed(self, e: BaseException) -> None:
        msg = str(e) if isinstance(e, (TierUnavailable, TierMismatch)) else f"{type(e).__name__}: {e}"
        if self.error is None:
            self.error_since = time.monotonic()
            log.error("tier: %s; sealed segments stay on the local disk until the tier takes them (retrying)", msg)
        elif msg != self.error:
            log.error("tier: %s (still retrying)", msg)
        self.error = msg

    # ------------------------------------------------------------------ upload
    def pending(self) -> list:
        """Sealed, flushed local segments the tier does not hold yet."""
        files = self.clog.mfq.files
        flushed = self.clog.flushed
        with self._lock:
            have = set(self._starts)
            end = self.segments[-1]["end"] if self.segments else None
        out = []
        for mf in files[:-1]:
            if mf.end_offset > flushed:
                break
            if mf.start_offset in have or (end is not None and mf.start_offset < end):
                continue
            out.append(mf)
        return out

    # objects uploaded before one manifest write (catching up after an outage, a fast appender)
    BATCH = 8

    def upload_pending(self) -> int:
        """Upload the pending segments, oldest first: up to BATCH objects, then one manifest write
        naming them, and again. Returns how many were uploaded."""
        n = 0
        pend = self.pending()
        while pend and not self._stop.is_set():
            batch, pend = pend[:self.BATCH], pend[self.BATCH:]
            entries = []
            t0 = time.monotonic()
            try:
                for mf in batch:
                    if self._stop.is_set():
                        break
                    e = self._upload(mf)
                    if e is not None:
                        entries.append(e)
                if entries:
                    pause_point("manifest")
                    with self._hk_lock:          # retention and compaction write the manifest too
                        with self._lock:
                            segs = list(self.segments)
                        if segs and entries[0]["start"] != segs[-1]["end"] and not self._gap_logged:
                            self._gap_logged = True
                            log.warning("tier: segment %d does not follow the tier's last one (ends at %d): "
                                        "offsets in between are in neither place", entries[0]["start"],
                                        segs[-1]["end"])
                        self._write_manifest(segs + entries)
            finally:
                self.uploading = None
            self.upload_seconds += time.monotonic() - t0
            for e in entries:
                self.uploaded += 1
                self.uploaded_raw += e["raw"]
                self.uploaded_stored += e["stored"]
                log.info("tier: segment %d in the tier (%d bytes, %d stored, %s): %s", e["start"], e["raw"],
                         e["stored"], e["codec"], self.objects.where(e["key"]))
            n += len(entries)
        return n

    def _upload(self, mf) -> dict | None:
        """Write one segment's object; its manifest entry (not committed yet)."""
        start = mf.start_offset
        self.uploading = start
        try:
            raw = bytes(mf.mm)
        except ValueError:       # deleted meanwhile (cannot happen: only this thread deletes)
            return None
        first_ts = _first_ts(raw, start, self.store.ident)
        try:
            last_ts = int(os.stat(mf.path).st_mtime * 1000)
        except OSError:
            last_ts = _now_ms()
        blob = codecs.compress(self.codec, raw)
        digest = hashlib.sha256(blob).hexdigest()
        key = f"{SEG_DIR}/{file_name(start)}{codecs.EXT[self.codec]}"
        self.objects.put(key, blob)
        entry = {"start": start, "end": mf.end_offset, "key": key, "codec": self.codec, "raw": len(raw),
                 "stored": len(blob), "sha256": digest, "first_ts": first_ts or last_ts, "last_ts": last_ts,
                 "uploaded_ms": _now_ms()}
        if self.columnar is not None:
            pause_point("parquet")
            files = self._columnar(raw, start)
            if files is not None:
                for k, data in files:        # each atomic; a kill -9 before the manifest: removed at start
                    self.objects.put(k, data)
                    self.parquet_sizes[k] = len(data)
                    self._file_topics(k, data)
                entry["parquet"] = [k for k, _ in files]
        return entry

    def _columnar(self, raw: bytes, start: int):
        """The columnar hook's files of a segment; None (logged) when the hook fails: the segment
        goes to the tier without them (offset reads and local retention do not wait for Spark's
        copy; read_history reads from that segment on through the lmqtt source)."""
        try:
            files = self.columnar(raw, start)
        except Exception as e:  # noqa: BLE001 - a writer bug or missing library: one line, go on
            msg = f"{type(e).__name__}: {e}"
            if msg != self.columnar_error:
                log.error("tier: no Parquet files for segment %d (%s); the segment is uploaded without them",
                          start, msg)
            self.columnar_error = msg
            return None
        self.columnar_error = None
        return files

    # ------------------------------------------------------------------ retention
    def housekeep(self, now_ms: int | None = None) -> int:
        """Local retention (only of segments the tier holds), then tier retention. Returns the
        number of local segment files deleted."""
        if now_ms is None:
            now_ms = _now_ms()
        with self._hk_lock:
            n = self._local_retention(now_ms)
            if self.synced:
                self._tier_retention(now_ms)
            return n

    def _safe_offset(self) -> int:
        st = self.store
        return min([st.dispatch.dispatched] + [d.checkpoint() for d in st._dispatchers])

    def _local_retention(self, now_ms: int) -> int:
        cfg = self.cfg
        ms, limit = cfg.local_retention_ms, cfg.local_retention_bytes
        if ms is None and limit is None:
            ms = self.store.cfg.retention_ms
        files = self.clog.mfq.files
        safe = self._safe_offset()
        with self._lock:
            have = set(self._starts)
        seg = self.clog.seg_size
        total = len(files) * seg
        n = 0
        for mf in files[:-1]:
            if mf.start_offset not in have or mf.end_offset > safe:
                break
            over = limit is not None and total - n * seg > limit
            old = False
            if ms is not None:
                try:
                    old = now_ms - os.stat(mf.path).st_mtime * 1000 >= ms
                except FileNotFoundError:
                    old = True
            if not (over or old):
                break
            n += 1
        if not n:
            return 0
        for mf in files[:n]:
            log.info("tier: deleting local segment %s (in the tier since the manifest lists it)", mf.path)
        self.clog.mfq.delete_before(files[n].start_offset)
        self.local_deleted += n
        return n

    def _tier_retention(self, now_ms: int) -> None:
        cfg = self.cfg
        ms, limit = cfg.tier_retention_ms, cfg.tier_retention_bytes
        if ms is None and limit is None:
            return
        with self._lock:
            segs = list(self.segments)
        if not segs:
            return
        safe = self._safe_offset()
        stored = sum(s["stored"] for s in segs)
        n = 0
        for s in segs:
            if s["end"] > safe:
                break
            over = limit is not None and stored > limit
            old = ms is not None and now_ms - s["last_ts"] >= ms
            if not (over or old):
                break
            stored -= s["stored"]
            n += 1
        if not n:
            return
        gone, keep = segs[:n], segs[n:]
        self._write_manifest(keep)                 # first: from now on nothing reads them
        # a merged Parquet file holds the rows of several segments: it goes with the last of them
        kept_parquet = {k for s in keep for k in s.get("parquet", ())}
        for s in gone:
            log.info("tier: retention: deleting segment %d from the tier (%s)", s["start"],
                     self.objects.where(s["key"]))
            with self._lock:
                b = self.cache.pop(s["start"], None)
                if b is not None:
                    self.cache_bytes -= len(b)
            for k in [s["key"], *(k for k in s.get("parquet", ()) if k not in kept_parquet)]:
                self.parquet_sizes.pop(k, None)
                try:
                    self.objects.delete(k)
                except TierUnavailable as e:      # left behind; the next start's sync removes it
                    log.warning("tier: %s", e)
        self.tier_deleted += n
        new_min = gone[-1]["end"]
        if self.clog.mfq.min_offset < new_min:
            self.clog.mfq.delete_before(new_min)
        lo = self.min_offset()
        for d in self.store._dispatchers:
            try:
                d.on_segments_deleted(lo)
            except Exception:  # noqa: BLE001
                log.exception("tier retention: dispatcher %s failed on_segments_deleted(%d)", d.name, lo)

    # ------------------------------------------------------------------ stats (lmqtt admin --tier)
    def stats(self) -> dict:
        files = self.clog.mfq.files
        with self._lock:
            segs = list(self.segments)
        pend = self.pending()
        local_first_ts = None
        if files:
            try:
                local_first_ts = _first_ts(files[0].mm, files[0].start_offset, self.store.ident)
            except ValueError:
                pass
        oldest = segs[0]["first_ts"] if segs else local_first_ts
        up = self.upload_seconds
        return {
            "url": self.cfg.url, "codec": self.codec, "reachable": self.error is None and self.synced,
            "error": self.error,
            "local_segments": len(files), "local_bytes": len(files) * self.clog.seg_size,
            "local_min_offset": self.clog.mfq.min_offset, "local_oldest_ms": local_first_ts,
            "uploading_segments": len(pend), "uploading_bytes": len(pend) * self.clog.seg_size,
            "uploading_now": self.uploading,
            "tier_segments": len(segs), "tier_raw_bytes": sum(s["raw"] for s in segs),
            "parquet_segments": sum(1 for s in segs if "parquet" in s), "parquet_error": self.columnar_error,
            "parquet_files": len({k for s in segs for k in s.get("parquet", ())}),
            "parquet_merges": self.parquet_merges, "parquet_merged_files": self.parquet_merged_files,
            "parquet_waiting_merges": self._merges_waiting(segs),
            "tier_stored_bytes": sum(s["stored"] for s in segs),
            "tier_min_offset": segs[0]["start"] if segs else None, "tier_end_offset": segs[-1]["end"] if segs else None,
            "oldest_readable_ms": oldest, "min_readable_offset": self.min_offset(),
            "uploaded": self.uploaded, "uploaded_raw_bytes": self.uploaded_raw,
            "upload_mb_per_s": round(self.uploaded_raw / up / 1e6, 1) if up else None,
            "local_deleted": self.local_deleted, "tier_deleted": self.tier_deleted,
            "corrupt_objects": self.corrupt_objects,
            "cache_bytes": self.cache_bytes, "cache_limit_bytes": self.cfg.cache_bytes,
            "cache_hits": self.cache_hits, "cache_misses": self.cache_misses,
            "local_retention_ms": self.cfg.local_retention_ms, "local_retention_bytes": self.cfg.local_retention_bytes,
            "tier_retention_ms": self.cfg.tier_retention_ms, "tier_retention_bytes": self.cfg.tier_retention_bytes,
        }


def _first_ts(buf, start: int, ident: str) -> int | None:
    """store_ts of the first record of a segment (None when it does not start with one)."""
    try:
        size = PREFIX.unpack_from(buf, 0)[0]
        if size < HEADER_SIZE or size > len(buf):
            return None
        return decode(buf, 0, start, ident, False, size).store_ts
    except ValueError:
        raise
    except Exception:  # noqa: BLE001 - a filler or garbage: no time from it
        return None
