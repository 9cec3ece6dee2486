"""Reads of the CommitLog ranges that live in the tier (`TierReads`, a part of `TierService`): a
read by offset below the first local segment (CommitLog.read / read_many) comes here; the
segment's object is fetched once, its sha256 checked (a mismatch is reported and nothing of it is
served), decompressed, and kept in a bounded in-memory cache (`cache_bytes`, LRU); records are
decoded and CRC-checked as from a local segment.

Separate from store/tier/service.py because it serves the readers (consumers, light queues,
history reads, on their threads), while the service's own job is moving sealed segments out
(upload, manifest, retention) on its thread. `TierService` inherits these methods; the state
they use (`segments`, `_starts`, `_first`, the cache and its lock) is the service's.
"""
from __future__ import annotations

import bisect
import hashlib
import logging
import threading
import time

from ..errors import CorruptRecord, NotVisible, StoreError
from ..record import HEADER_SIZE, PREFIX, c_decode, c_decode_many, decode, decode_many
from . import codec as codecs
from .objects import TierUnavailable

log = logging.getLogger("lmqtt.store")

_decode = c_decode or decode
_decode_many = c_decode_many or decode_many


class TierReadError(StoreError):
    """A read of an offloaded range could not reach the tier (nothing is skipped: retry later)."""


class TierReads:
    """The read methods of `TierService` (see the module docstring)."""

    def min_offset(self) -> int:
        """The first readable CommitLog offset: the tier's first segment, else the first local one
        (no lock: every read's visibility check asks)."""
        first = self._first
        local = self.clog.mfq.min_offset
        return local if first is None or local < first else first

    def _find(self, phys: int) -> dict | None:
        with self._lock:
            i = bisect.bisect_right(self._starts, phys) - 1
            if i >= 0 and phys < self.segments[i]["end"]:
                return self.segments[i]
        return None

    def _not_here(self, phys: int) -> NotVisible:
        with self._lock:
            rng = f"[{self.segments[0]['start']}, {self.segments[-1]['end']})" if self.segments else "nothing"
        return NotVisible(f"offset {phys} is neither on the local disk (from {self.clog.mfq.min_offset}) nor "
                          f"in the tier (it holds {rng})")

    def _segment(self, s: dict) -> bytes:
        """The decompressed bytes of tier segment `s` (cache, else one fetch checked by sha256)."""
        start = s["start"]
        with self._lock:
            b = self.cache.get(start)
            if b is not None:
                self.cache.move_to_end(start)
                self.cache_hits += 1
                return b
            flock = self._fetching.setdefault(start, threading.Lock())
        with flock:
            try:
                return self._fetch(s)
            finally:
                with self._lock:
                    self._fetching.pop(start, None)

    def _fetch(self, s: dict) -> bytes:
        start = s["start"]
        with self._lock:
            b = self.cache.get(start)
            if b is not None:
                self.cache_hits += 1
                return b
            self.cache_misses += 1
        t0 = time.monotonic()
        where = self.objects.where(s["key"])
        try:
            blob = self.objects.get(s["key"])
        except FileNotFoundError:
            raise TierReadError(f"tier object {where} (CommitLog [{start}, {s['end']})) is missing") from None
        except TierUnavailable as e:
            raise TierReadError(f"{e} (reading CommitLog [{start}, {s['end']}); nothing skipped, retry "
                                f"later)") from None
        digest = hashlib.sha256(blob).hexdigest()
        if digest != s["sha256"]:
            self._corrupt(where, f"sha256 {digest} is not the manifest's {s['sha256']}")
        try:
            b = codecs.decompress(s["codec"], blob, s["raw"])
        except Exception as e:  # noqa: BLE001 - the checksum matched: a codec problem
            self._corrupt(where, f"cannot decompress ({s['codec']}): {e}")
        if len(b) != s["raw"]:
            self._corrupt(where, f"decompressed to {len(b)} bytes, the manifest says {s['raw']}")
        self.fetch_seconds += time.monotonic() - t0
        with self._lock:
            cur = self._find_locked(start)
            if cur is None or cur["sha256"] != s["sha256"]:
                return b          # dropped by retention meanwhile: serve this read, cache nothing
            self.cache[start] = b
            self.cache_bytes += len(b)
            while self.cache_bytes > self.cfg.cache_bytes and len(self.cache) > 1:
                _, old = self.cache.popitem(last=False)
                self.cache_bytes -= len(old)
        return b

    def _find_locked(self, start: int):
        i = bisect.bisect_left(self._starts, start)
        return self.segments[i] if i < len(self._starts) and self._starts[i] == start else None

    def _corrupt(self, where: str, why: str):
        key = (where, why)
        if key not in self._corrupt_seen:
            self._corrupt_seen.add(key)
            self.corrupt_objects += 1
            log.error("tier: object %s is corrupt: %s; not served", where, why)
        raise CorruptRecord(f"tier object {where} is corrupt ({why}); not served")

    def read(self, phys: int, size: int | None = None):
        s = self._find(phys)
        if s is None:
            raise self._not_here(phys)
        buf = self._segment(s)
        rel = phys - s["start"]
        if size is None:
            size = PREFIX.unpack_from(buf, rel)[0]
        if size < HEADER_SIZE or rel + size > len(buf):
            raise CorruptRecord(f"no valid record at offset {phys} (size field {size})")
        return _decode(buf, rel, phys, self.store.ident, True, rel + size)

    def segment_at(self, phys: int) -> tuple[int, int, bytes] | None:
        """(start, end, decompressed bytes) of the tier segment holding offset `phys`, None when the
        tier holds none there: for scans that read records as stored (a filter's history,
        lightqueue/history.py), through the cache and checks `read` uses; raises as `read` does."""
        s = self._find(phys)
        if s is None:
            return None
        return s["start"], s["end"], self._segment(s)

    def read_many(self, wanted: list, i: int, out: list) -> int:
        """CommitLog.read_many's items from `i` on that lie in one tier segment: appended to `out`
        (a StoredMessage or the exception of that item); returns the index of the next item.
        Raises TierReadError when the tier cannot be read (not returned per item: retry later)."""
        phys = wanted[i][0]
        s = self._find(phys)
        if s is None:
            out.append(self._not_here(phys))
            return i + 1
        try:
            buf = self._segment(s)
        except TierReadError:
            # the tier away: the whole read fails, so no caller mistakes these records for ones
            # deleted by retention and skips them (a light queue's pull, $replay/, a history read)
            raise
        except CorruptRecord as e:
            j = i
            while j < len(wanted) and s["start"] <= wanted[j][0] < s["end"]:
                out.append(e)
                j += 1
            return j
        j = _decode_many(buf, s["start"], wanted, i, self.store.ident, out)
        return j if j > i else i + 1
