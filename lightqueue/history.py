"""A filter's history: every stored message whose topic matches an MQTT filter, in a CommitLog
range or a time range, whether or not the filter was held when it was written (docs/sdk.md
"Reading a filter's history", docs/spark.md). One definition, read here for every client of it:
the SDK's FilterConsumer (and so `lmqtt consume --filter --from`), the Spark source's `filter`
option, and `$replay/` / `since` (lightqueue/replay.py: its log side matches with `match` below).

Where it is read from:

* **the first-level topics' ConsumeQueues**: a filter `a/+/c` can only match topics of the
  first-level topic `a`, so its history is in `a`'s ConsumeQueues (every queue id); a filter whose
  first level is a wildcard reads every first-level topic's (not `$` ones). Every entry of those
  queues in the range is looked at and the records whose topic matches are kept: `scan` below, in
  C (lightqueue/_history.c) beside its Python reference `scan_py`. An exact topic is matched by the
  entries' tag code (the CRC-32 of the full topic) before its record is read. Only matching records
  are CRC-checked and copied, as stored (the raw MESSAGES layout: no decode, no re-encode).
* **the filter's light queue**, from where it covers: a wildcard filter's light queue holds every
  matching record from its epoch's CommitLog position on (lightqueue/replay.py) while the filter
  stays registered, so a read at/after that position takes the queue's entries (no scan of other
  topics). The light queue is never the only copy: dropping it (the last unsubscribe) loses
  nothing, the ConsumeQueues still answer.

Positions: a read from the log is addressed by a **CommitLog position** `P` ("every matching
record below P was read"): stable whatever happens to light queues, the same for every filter
source, and in CommitLog order, which is the publish order of each topic. A read returns the
matching records in [P, P') in CommitLog order and P'. Spark's partitions are ConsumeQueue offset
ranges of the sources instead (`read_range`): a range of one queue is read exactly once whatever
the other queues do.

Time: a time is turned into a position through the ConsumeQueues' store times (binary search per
source queue, as the store's `offset_for_time`), never a CommitLog scan.
"""
from __future__ import annotations

import logging
import struct
import zlib
from typing import NamedTuple

from lmqtt.store import accel
from lmqtt.store.consume_queue import ENTRY, ENTRY_FIELDS, ENTRY_SIZE
from lmqtt.store.fastpath import raw_runs
from lmqtt.store.record import CRC_START, HEADER, HEADER_FIELDS, MSG_MAGIC, tags_code_of

from .topics import is_wildcard, topic_matches, validate_filter

log = logging.getLogger("lmqtt.lightqueue.history")

TS_MAX = (1 << 63) - 1
SCAN_BUDGET = 65536          # ConsumeQueue entries looked at per source and call (~3 ms in C)

# ------------------------------------------------------------------ the scan: C and reference
C_LAYOUT = {"cq_entry_format": ENTRY.format, "cq_entry_fields": ENTRY_FIELDS, "cq_entry_size": ENTRY_SIZE,
            "record_header_format": HEADER.format, "record_header_fields": HEADER_FIELDS,
            "record_magic": MSG_MAGIC, "crc_start": CRC_START}


def configure_c(mod, layout: dict = C_LAYOUT) -> None:
    """Hand the entry and record layouts to the C scan `mod`; ValueError when they are not the ones
    it reads."""
    mod.configure(layout)


_C = accel.load("lmqtt.lightqueue._history")
if _C is not None:
    configure_c(_C)

_HEAD = HEADER
_HS = HEADER.size
_PAIR = struct.Struct("=QQ")


def match_py(flt: bytes, topic: bytes) -> bool:
    """Reference of `_history.match`: lightqueue/topics.py's rule on UTF-8 bytes."""
    return topic_matches(flt.decode(), topic.decode())


def scan_py(piece, first_qoff: int, segs: list, seg_size: int, flt: bytes, tag: int, phys_lo: int, phys_hi: int,
            ts_lo: int, ts_hi: int, max_count: int, max_bytes: int, out: bytearray, idx: bytearray):
    """Reference of `_history.scan` (the contract is in lightqueue/_history.c's module doc):
    -> (count, next queue offset, bad, status)."""
    count = nbytes = bad = 0
    status = 0
    first_start = segs[0][0] if segs else 0
    n = len(piece) // ENTRY_SIZE
    i = 0
    matched: dict[bytes, bool] = {}
    while i < n:
        phys, size, tags = ENTRY.unpack_from(piece, i * ENTRY_SIZE)
        if size == 0 or phys < phys_lo:
            i += 1
            continue
        if phys >= phys_hi:
            status = 1
            break
        if tag >= 0 and tags != tag:
            i += 1
            continue
        k = (phys - first_start) // seg_size if seg_size > 0 and phys >= first_start else -1
        if k < 0 or k >= len(segs):
            status = 2
            break
        start, buf = segs[k]
        rel = phys - start
        try:
            mv = memoryview(buf)
        except ValueError:          # a map closed meanwhile
            status = 2
            break
        if rel < 0 or rel + size > len(mv) or size < _HS:
            status = 2
            break
        total, magic, crc, _q, _f, _qo, _p, _b, sts, _t, _bl, _pl, tl, _kl, _dl = _HEAD.unpack_from(mv, rel)
        if total != size or magic != MSG_MAGIC or _HS + tl > size:
            bad += 1
            i += 1
            continue
        if not ts_lo <= sts < ts_hi:
            i += 1
            continue
        tb = bytes(mv[rel + _HS:rel + _HS + tl])
        ok = matched.get(tb)
        if ok is None:
            ok = matched[tb] = match_py(flt, tb)
        if not ok:
            i += 1
            continue
        if (max_count > 0 and count >= max_count) or (max_bytes > 0 and count and nbytes + size > max_bytes):
            status = 1
            break
        if zlib.crc32(mv[rel + CRC_START:rel + size]) != crc:
            bad += 1
            i += 1
            continue
        out += mv[rel:rel + size]
        idx += _PAIR.pack(phys, size)
        count += 1
        nbytes += size
        i += 1
    return count, first_qoff + i, bad, status


scan = _C.scan if _C is not None else scan_py
match = _C.match if _C is not None else match_py


def exact_tag(flt: str) -> int:
    """The tag code every record of an exact topic carries in its ConsumeQueue entry; -1 for a
    wildcard filter."""
    return -1 if is_wildcard(flt) else tags_code_of(flt.encode())


def _segs(store, pieces: list | None = None) -> tuple[list, int]:
    """The CommitLog segments the entries of `pieces` point into (None: every segment), mapped (a
    run of consecutive segments, as `scan` wants them): only those, since mapping every segment of
    a long retention for one read would cost a descriptor and a map each (store/file_budget.py)."""
    mfq = store.clog.mfq
    files = mfq.files
    size = mfq.file_size
    if pieces is None:
        return [(mf.start_offset, mf.mm) for mf in files], size
    lo = hi = None
    for _, piece in pieces:
        for i in range(0, len(piece), ENTRY_SIZE):
            phys, n, _ = ENTRY.unpack_from(piece, i)
            if n:
                lo = phys if lo is None else min(lo, phys)
                break
        for i in range(len(piece) - ENTRY_SIZE, -1, -ENTRY_SIZE):
            phys, n, _ = ENTRY.unpack_from(piece, i)
            if n:
                hi = phys if hi is None else max(hi, phys)
                break
    if not files or lo is None or hi is None:
        return [], size
    base = files[0].start_offset
    i0 = max(0, (lo - base) // size)
    i1 = min(len(files), (hi - base) // size + 1)
    return [(mf.start_offset, mf.mm) for mf in files[i0:i1]], size


# ------------------------------------------------------------------ sources and positions
def sources(store, flt: str) -> list[tuple[str, int]]:
    """The ConsumeQueues that can hold messages matching `flt`: its first-level topic's (every queue
    id); every first-level topic's for a filter starting with a wildcard (except `$` ones)."""
    first = flt.split("/", 1)[0]
    cqs = store.consume_queues
    if first in ("+", "#"):
        return sorted(k for k in cqs.max_offsets() if not k[0].startswith("$"))
    return [(first, qid) for qid in cqs.queue_ids(first)]


def cq_offset_for_time(store, fl: str, qid: int, ts: int) -> int:
    """First ConsumeQueue offset stored at/after `ts` (binary search over the queue's entries)."""
    cq = store.consume_queues.get(fl, qid)
    if cq is None:
        return 0
    lo, hi = cq.min_offset, cq.max_offset
    while lo < hi:
        mid = (lo + hi) // 2
        m = store.read_consume_queue(fl, qid, mid, 1)
        if not m or m[0].store_ts >= ts:
            hi = mid
        else:
            lo = mid + 1
    return lo


def position_for_time(store, flt: str, ts: int) -> int:
    """The CommitLog position of the first record matching `flt`'s sources stored at/after `ts` (the
    dispatched end when there is none): reading from it reads the filter's history since `ts`."""
    end = store.dispatched_offset
    best = end
    for fl, qid in sources(store, flt):
        cq = store.consume_queues.get(fl, qid)
        q = cq_offset_for_time(store, fl, qid, ts)
        if q < cq.max_offset:
            e = cq.entry(q)
            if e is not None and e[1]:
                best = min(best, e[0])
    return best


def lq_covers_from(lq, flt: str) -> int | None:
    """The CommitLog position from which `flt`'s light queue holds every matching record, or None
    (not a registered wildcard filter with a known epoch: read the ConsumeQueues)."""
    if lq is None or not is_wildcard(flt):
        return None
    ep = lq.filter_epoch(flt)
    return None if ep is None else int(ep[0])


# ------------------------------------------------------------------ reads
class Got(NamedTuple):
    """What a read found: matching records either as stored (`chunks`, `count` of them: the raw
    MESSAGES layout) or decoded (`msgs`, when a record was not readable by the raw scan: a segment
    not mapped here), never both; `bad`: records that failed their check (skipped, logged)."""
    count: int
    chunks: list
    msgs: list | None
    bad: int


def _scan_queue(store, fl: str, qid: int, q0: int, q_end: int, flt: str, tag: int, phys_lo: int, phys_hi: int,
                ts_lo: int, ts_hi: int, max_count: int, max_bytes: int, budget: int = SCAN_BUDGET):
    """Scan queue (fl, qid) from offset q0 (below q_end) -> (out, idx, next qoff, bad, status) with
    status 0 (scanned to q_end or the budget), 1 (stopped: phys_hi or a limit), 2 (a record the raw
    scan cannot read: use `_decoded_queue`)."""
    cq = store.consume_queues.get(fl, qid)
    out, idx = bytearray(), bytearray()
    if cq is None:
        return out, idx, q0, 0, 0
    q0 = max(q0, cq.min_offset)
    n = min(max(0, min(q_end, cq.max_offset) - q0), budget)
    fb = flt.encode()
    count = bad = 0
    nq = q0
    status = 0
    try:
        pieces = cq.pieces(q0, n)
    except ValueError:              # a file deleted by retention meanwhile
        return out, idx, q0, 0, 2
    segs, seg_size = _segs(store, pieces)
    tier = getattr(store, "tier", None)
    for first, piece in pieces:
        # the piece is scanned against the local segments; records in an offloaded range against
        # the tier's segment holding them (its cached bytes are laid out as the local file was):
        # the same raw scan, not a decoding read per record
        at, where, where_size, tried = 0, segs, seg_size, None
        while True:
            left_b = max_bytes - len(out) if max_bytes else 0
            if (max_count and count >= max_count) or (max_bytes and count and left_b <= 0):
                status = 1
                break
            c, nq, b, status = scan(memoryview(piece)[at * ENTRY_SIZE:], first + at, where, where_size, fb, tag,
                                    phys_lo, phys_hi, ts_lo, ts_hi, max_count - count if max_count else 0, left_b,
                                    out, idx)
            count += c
            bad += b
            if status != 2 or tier is None or (nq, where is segs) == tried:
                break
            tried = (nq, where is segs)
            at = nq - first
            seg = tier.segment_at(ENTRY.unpack_from(piece, at * ENTRY_SIZE)[0])
            if seg is None:
                where, where_size = segs, seg_size      # not the tier's: the local segments again
            else:
                where, where_size = [(seg[0], seg[2])], seg[1] - seg[0]
        if status:
            break
    return out, idx, nq, bad, status


def _decoded_queue(store, fl: str, qid: int, q0: int, q_end: int, flt: str, tag: int, phys_lo: int,
                   phys_hi: int, ts_lo: int, ts_hi: int, max_count: int, max_bytes: int,
                   budget: int = SCAN_BUDGET):
    """`_scan_queue` through the store's decoding reads (`read_many`: records the raw scan cannot
    reach, such as segments another layer serves) -> (StoredMessages, next qoff, bad, status 0|1)."""
    cq = store.consume_queues.get(fl, qid)
    if cq is None:
        return [], q0, 0, 0
    q0 = max(q0, cq.min_offset)
    n = min(max(0, min(q_end, cq.max_offset) - q0), budget)
    try:
        entries = cq.range(q0, n)
    except ValueError:
        entries = cq.range(max(q0, cq.min_offset), n)
    out, nbytes, bad = [], 0, 0
    nq = q0 + n
    status = 0
    todo = []
    for qoff, phys, size, tags in entries:
        if phys < phys_lo:
            continue
        if phys >= phys_hi:
            nq, status = qoff, 1
            break
        if tag >= 0 and tags != tag:
            continue
        todo.append((qoff, phys, size))
    # read in chunks, stopping at the limits: a read of max_count matches decodes about that many
    # records, not the whole budget (it decoded up to 65,536 records for 256 matches)
    chunk = max(512, 2 * max_count) if max_count else len(todo)
    for c0 in range(0, len(todo), chunk or 1):
        part = todo[c0:c0 + chunk]
        msgs = store.read_many([(p, s) for _q, p, s in part])
        for (qoff, phys, size), m in zip(part, msgs):
            if isinstance(m, Exception):
                if type(m).__name__ == "TierReadError":    # store/tier unreachable: fail, skip nothing
                    raise m
                if not type(m).__name__ == "NotVisible":
                    bad += 1
                continue
            if not ts_lo <= m.store_ts < ts_hi or not topic_matches(flt, m.topic):
                continue
            if (max_count and len(out) >= max_count) or (max_bytes and out and nbytes + size > max_bytes):
                nq, status = qoff, 1
                break
            out.append(m)
            nbytes += size
        if status:
            break
    return out, nq, bad, status


def read_range(store, flt: str, fl: str, qid: int, start: int, end: int, max_count: int = 65536,
               max_bytes: int = 4 << 20, ts_lo: int = 0, ts_hi: int = TS_MAX) -> tuple[Got, int]:
    """The records of queue (fl, qid) with start <= queue offset < end whose topic matches `flt`
    (and stored in [ts_lo, ts_hi)), up to the limits -> (Got, next queue offset). Entries at/after
    the dispatched end are not read (the next offset stops there)."""
    flt = validate_filter(flt)
    tag = exact_tag(flt)
    visible = store.dispatched_offset
    out, idx, nq, bad, status = _scan_queue(store, fl, qid, start, end, flt, tag, 0, visible, ts_lo, ts_hi,
                                            max_count, max_bytes)
    if status == 2:
        msgs, nq, bad, _s = _decoded_queue(store, fl, qid, start, end, flt, tag, 0, visible, ts_lo, ts_hi,
                                           max_count, max_bytes)
        _report(bad, flt)
        return Got(len(msgs), [], msgs, bad), nq
    _report(bad, flt)
    return Got(len(idx) // _PAIR.size, [out] if out else [], None, bad), nq


def _report(bad: int, flt: str) -> None:
    if bad:
        log.error("event=history_bad_records filter=%r count=%d: records failing their check were skipped",
                  flt, bad)


def read_from(store, lq, flt: str, position: int, max_count: int = 1024, max_bytes: int = 4 << 20,
              end: int | None = None, lq_hint: int | None = None) -> tuple[Got, int, int | None]:
    """The records matching `flt` at CommitLog positions [position, P') in CommitLog order, up to the
    limits, with P' -> (Got, P', light-queue offset of P' or None). P' == position only when the
    log has nothing readable beyond it yet (below `end`, default the dispatched end).

    From the filter's light queue when it covers `position` (`lq_covers_from`), else from the
    ConsumeQueues, stopping at the light queue's start (the next read goes on from there)."""
    flt = validate_filter(flt)
    limit = store.dispatched_offset if end is None else min(int(end), store.dispatched_offset)
    if position >= limit:                   # nothing new: the light-queue offset stays what it was
        return Got(0, [], None, 0), position, lq_hint
    cover = lq_covers_from(lq, flt)
    if cover is not None and position >= cover:
        got = _read_lq(store, lq, flt, position, limit, max_count, max_bytes, lq_hint)
        if got is not None:
            return got
    hi = limit if cover is None or cover <= position else min(limit, cover)
    return _read_queues(store, flt, position, hi, max_count, max_bytes) + (None,)


def _lq_offset(lq, flt: str, position: int, hint: int | None) -> int:
    index = lq.index
    if hint is not None:
        h = int(hint)
        lo, hi = index.min_offset(flt), index.max_offset(flt)
        if lo <= h <= hi:
            prev = index.read(flt, h - 1, 1) if h > lo else []
            cur = index.read(flt, h, 1) if h < hi else []
            if ((not prev or prev[0].phys_offset < position) and
                    (not cur or cur[0].phys_offset >= position)):
                return h
    return lq_offset(lq, flt, position, 0)


def first_at_or_after(lo: int, hi: int, ok) -> int:
    """Smallest offset in [lo, hi] for which `ok(offset)` holds (ok monotone; ok(hi) assumed)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def lq_offset(lq, queue: str, min_phys: int = 0, since_ms: int = 0) -> int:
    """First light-queue offset whose entry lies at/after CommitLog position `min_phys` and was
    stored at/after `since_ms` (binary search over the queue's index entries; holes skipped)."""
    index = lq.index
    lo, hi = index.min_offset(queue), index.max_offset(queue)

    def ok(off: int) -> bool:
        e = index.read(queue, off, 1)
        if not e:
            return True
        e = e[0]
        return e.phys_offset >= min_phys and e.store_ts >= since_ms
    return first_at_or_after(lo, hi, ok)


def _read_lq(store, lq, flt, position, limit, max_count, max_bytes, hint):
    off = _lq_offset(lq, flt, position, hint)
    lo = lq.index.min_offset(flt)
    if off <= lo and lo > 0:
        first = lq.index.read(flt, lo, 1)
        if first and first[0].phys_offset > position:
            return None             # its head was trimmed: the ConsumeQueues answer
    entries = lq.index.read(flt, off, max_count)
    keep, nbytes = [], 0
    for e in entries:
        if e.phys_offset < position:
            continue
        if e.phys_offset >= limit:
            nxt = limit
            break
        if keep and nbytes + e.size > max_bytes:
            nxt = e.phys_offset
            break
        keep.append(e)
        nbytes += e.size
    else:
        if len(entries) < max_count:        # every entry of the queue below `limit` is read
            nxt = limit
        else:
            last = entries[-1]
            nxt = max(position, last.phys_offset + last.size)
    next_off = (keep[-1].queue_offset + 1) if keep else off
    runs = raw_runs(store, [(e.phys_offset, e.size) for e in keep]) if keep else []
    if runs is None:
        msgs = [m for m in store.read_many([(e.phys_offset, e.size) for e in keep]) if not isinstance(m, Exception)]
        return Got(len(msgs), [], msgs, 0), nxt, next_off
    return Got(sum(r[1] for r in runs), [r[2] for r in runs], None, 0), nxt, next_off


def _read_queues(store, flt: str, position: int, hi: int, max_count: int, max_bytes: int) -> tuple[Got, int]:
    """The ConsumeQueue side of `read_from`: every source queue from its first entry at/after
    `position`, merged in CommitLog order below a horizon every source has been read to."""
    tag = exact_tag(flt)
    srcs = []
    for fl, qid in sources(store, flt):
        cq = store.consume_queues.get(fl, qid)
        q0 = cq.first_at_or_after(position)
        if q0 < cq.max_offset:
            srcs.append((fl, qid, cq, q0))
    if not srcs:
        return Got(0, [], None, 0), hi
    budget = max(1024, SCAN_BUDGET // len(srcs))
    results = []
    decoded = False
    bad = 0
    for fl, qid, cq, q0 in srcs:
        out, idx, nq, b, status = _scan_queue(store, fl, qid, q0, cq.max_offset, flt, tag, position, hi, 0, TS_MAX,
                                              max_count, max_bytes, budget)
        if status == 2:
            decoded = True
            break
        bad += b
        results.append((cq, out, idx, nq, status))
        if nq < cq.max_offset:       # stopped before the queue's end: nothing read from here on
            e = cq.entry(nq)
            if e is not None and e[1]:
                hi = min(hi, e[0])
    if decoded:
        return _read_queues_decoded(store, flt, srcs, position, hi, max_count, max_bytes, budget)
    _report(bad, flt)
    recs = []                        # (phys, size, out, start in out)
    for _cq, out, idx, _nq, _st in results:
        a = 0
        for phys, size in _PAIR.iter_unpack(idx):
            if phys >= hi:
                break
            recs.append((phys, size, out, a))
            a += size
    if len(results) > 1:
        recs.sort(key=lambda r: r[0])
    if max_count and len(recs) > max_count:
        hi = recs[max_count][0]
        del recs[max_count:]
    if max_bytes:
        n = 0
        for i, r in enumerate(recs):
            if i and n + r[1] > max_bytes:
                hi = r[0]
                del recs[i:]
                break
            n += r[1]
    chunks = []
    for _p, size, out, a in recs:      # adjacent pieces of one buffer go out as one slice
        if chunks and chunks[-1][0] is out and chunks[-1][2] == a:
            chunks[-1][2] = a + size
        else:
            chunks.append([out, a, a + size])
    return Got(len(recs), [memoryview(o)[a:b] for o, a, b in chunks], None, bad), hi


def _read_queues_decoded(store, flt, srcs, position, hi, max_count, max_bytes, budget):
    tag = exact_tag(flt)
    allm, bad = [], 0
    for fl, qid, cq, q0 in srcs:
        msgs, nq, b, _status = _decoded_queue(store, fl, qid, q0, cq.max_offset, flt, tag, position, hi, 0, TS_MAX,
                                              max_count, max_bytes, budget)
        bad += b
        allm += msgs
        if nq < cq.max_offset:
            e = cq.entry(nq)
            if e is not None and e[1]:
                hi = min(hi, e[0])
    _report(bad, flt)
    allm = sorted((m for m in allm if m.phys_offset < hi), key=lambda m: m.phys_offset)
    if max_count and len(allm) > max_count:
        hi = allm[max_count].phys_offset
        del allm[max_count:]
    return Got(len(allm), [], allm, bad), hi


def pairs(idx: bytes) -> list[tuple[int, int]]:
    """(phys, size) per record of a scan's `idx`."""
    return list(_PAIR.iter_unpack(idx))


__all__ = ["read_range", "read_from", "position_for_time", "sources", "scan", "scan_py", "match", "match_py",
           "Got"]
