"""The light-queue index's take loop: dispatched records into the queues' in-memory tails.

`LightQueueIndex.dispatch` (lightqueue/index.py) holds the index's lock, then hands the batch to
`take_batch` here, then decides when to write RocksDB. What lives here is the per-record part,
as store/encoding.py holds the CommitLog's: the Python reference loops, the C loop's selection
and the layout the C loop is handed.

* `take_requests`: a list of DispatchRequests (parsed from the CommitLog, a replay, or the runs
  of a columnar chunk whose every record is its own run). In C (lightqueue/_take.c) when it was
  built and LMQTT_PURE_PYTHON is not set; the Python loop is the reference
  (tests/lightqueue/test_lightqueue_speedups.py compares them).
* `take_runs`: a columnar chunk (store.message) whose runs hold several records (records of one
  topic appended together): the loop over runs is Python; the entries of a run are one call of
  `run_entries` (lightqueue/_take.c when built, else `run_entries_py`, its reference).

Per record the work is one pack and one bytearray append: the index's `resolved` maps a
dispatch tuple (the same tuple object for every publish of a topic) to a *resolved list* (RES_*
slots below): its first queue's tail bytearray, the bytearrays of the others (the wildcard
filters), interned so that every tuple with the same filters shares one object, and the names
to report as touched. Consecutive records with the same filters have their entries joined and
appended to those tails once (`_spread`, when the filter set changes, before the next resolve
and at the end of the batch), so a record costs one append however many filters match it. A
tuple not yet resolved calls `index.resolve(qs, phys)`, which may write RocksDB first and
replace `index.resolved` (the loops, C included, re-read it after the call): that is why the
loops take the index.
"""
from __future__ import annotations

import struct

from lmqtt.store import accel
from lmqtt.store.message import (
    CHUNK_RUNS,
    CHUNK_SIZES,
    CHUNK_STARTS,
    DR_DISPATCH_QUEUES,
    DR_PHYS,
    DR_SIZE,
    DR_STORE_TS,
    DispatchRequest,
)

ENTRY = struct.Struct(">QIQ")      # phys_offset, size, store_ts
ENTRY_SIZE = ENTRY.size            # 20
# the filter tails of a dispatch tuple with one queue: `LightQueueIndex.resolve` puts this object
# in the RES_FILTER_TAILS slot and the loops below start from it (`cur`), so it is one shared name
NO_TAILS: tuple = ()
_DR_ONLY = {DispatchRequest}

# Slots of a resolved list (`index.resolved[dispatch_queues]`, built by `LightQueueIndex.resolve`):
# the first queue's tail, the other queues' tails (a tuple), the first queue's name, the mark of
# the last batch that touched it, the other queues' names. A list, not an object: it is read per
# record. The loops below bind these names to locals before they start (a global name there
# would be a lookup per record); the C loop receives the positions at import (configure below).
RES_TAIL, RES_FILTER_TAILS, RES_FIRST_NAME, RES_MARK, RES_OTHER_NAMES = range(5)
RES_LEN = RES_OTHER_NAMES + 1

# What the C loop reads and writes, handed to it at import (it refuses another entry format).
TAKE_LAYOUT = {
    "entry_format": ENTRY.format,
    "dr_phys": DR_PHYS, "dr_size": DR_SIZE, "dr_store_ts": DR_STORE_TS,
    "dr_dispatch_queues": DR_DISPATCH_QUEUES, "dr_len": len(DispatchRequest._fields),
    "res_tail": RES_TAIL, "res_filter_tails": RES_FILTER_TAILS, "res_first_name": RES_FIRST_NAME,
    "res_mark": RES_MARK, "res_other_names": RES_OTHER_NAMES, "res_len": RES_LEN,
}
# `take_requests` in C, or None: then its Python loop runs. A module global so tests can switch
# it (monkeypatch `_ctake` to None).
_ctake = accel.load("lmqtt.lightqueue._take")
if _ctake is not None:
    _ctake.configure(TAKE_LAYOUT)


def _as_request(r) -> DispatchRequest:
    return DispatchRequest(r.phys_offset, r.size, r.topic, r.queue_id, r.queue_offset, r.flags,
                           r.born_ts, r.store_ts, r.tags_code, r.keys, r.dispatch_queues)


def _known_chunks(chunks) -> bool:
    """True when `chunks` has the columnar layout `take_runs` reads (store.message CHUNK_*: per
    append call the record sizes, the index of each run's first record, and that record's
    DispatchRequest); else the batch is taken as DispatchRequests, which is always correct, only
    slower."""
    at_sizes, at_starts, at_runs = CHUNK_SIZES, CHUNK_STARTS, CHUNK_RUNS
    n = max(at_sizes, at_starts, at_runs) + 1
    for c in chunks:
        if type(c) is not tuple or len(c) < n:
            return False
        sizes, starts, runs = c[at_sizes], c[at_starts], c[at_runs]
        if (type(sizes) is not list or type(starts) is not list or type(runs) is not list
                or len(starts) != len(runs) or len(runs) > len(sizes)):
            return False
        if runs and (type(runs[0]) is not DispatchRequest or starts[0] != 0):
            return False
    return True


def _spread(entries: list, tails) -> None:
    """Append the joined `entries` to every filter tail of one filter set (called when the set
    changes, not per record: consecutive records of one set accumulate in `entries`)."""
    v = b"".join(entries)
    for ba in tails:
        ba += v


def take_batch(index, batch, ckpt: int) -> int:
    """Take a dispatch batch into `index`'s tails, skipping records below `ckpt` (already
    indexed: a replay is idempotent). A DispatchBatch is taken as its columns (no DispatchRequest
    built); anything else as the DispatchRequests it holds. The caller holds the index's lock.
    Returns the number of records in the batch."""
    chunks = getattr(batch, "chunks", None)
    if chunks is not None and _known_chunks(chunks):
        at_sizes, at_starts, at_runs = CHUNK_SIZES, CHUNK_STARTS, CHUNK_RUNS
        for c in chunks:
            sizes, starts, runs = c[at_sizes], c[at_starts], c[at_runs]
            if len(runs) == len(sizes):     # one record per run: runs are the requests
                take_requests(index, runs, ckpt)
            else:
                take_runs(index, sizes, starts, runs, ckpt)
    else:
        if type(batch) is not list:
            batch = list(batch)
        if set(map(type, batch)) <= _DR_ONLY:
            take_requests(index, batch, ckpt)
        else:   # objects with the DispatchRequest attributes
            take_requests(index, [_as_request(r) for r in batch], ckpt)
    return len(batch)


# The two loops below share one shape (kept inline: a call per record would cost more than the
# work): c = index.resolved[tuple], a resolved list (RES_* slots); `cur`/`acc`: the filter tails
# being accumulated and their pending entries.
def take_requests(index, batch: list, ckpt: int) -> None:
    """A list of DispatchRequests. Unpacked in the for target: the cheapest way to reach four
    fields of a named tuple (measured 390 vs 630 ns/record for attribute access)."""
    if _ctake is not None:
        _ctake.take_requests(index, batch, ckpt, index.touched, index.touched_f, object())
        return
    rget = index.resolved.get
    touched = index.touched
    touched_f = index.touched_f
    mark = object()
    pack = ENTRY.pack
    cur = NO_TAILS
    acc: list[bytes] = []
    res_tail, res_filters, res_first, res_mark, res_others = (RES_TAIL, RES_FILTER_TAILS, RES_FIRST_NAME,
                                                              RES_MARK, RES_OTHER_NAMES)
    for phys, size, _t, _q, _o, _f, _b, sts, _g, _k, qs in batch:
        if not qs or phys < ckpt:
            continue   # no light queue, or already indexed (idempotent replay)
        c = rget(qs)
        if c is None:
            if acc:
                _spread(acc, cur)
                acc = []
            c = index.resolve(qs, phys)
            rget = index.resolved.get
        if c[res_mark] is not mark:
            c[res_mark] = mark
            touched.append(c[res_first])
        e = pack(phys, size, sts)   # one entry, shared by all its queues
        f = c[res_filters]
        if f is not cur:
            if acc:
                _spread(acc, cur)
            cur = f
            acc = [e]
            touched_f.append(c[res_others])
        else:
            acc.append(e)
        ba = c[res_tail]
        ba += e
    if acc:
        _spread(acc, cur)


def run_entries_py(phys: int, sizes: list, i0: int, i1: int, sts: int, ckpt: int) -> tuple[bytes, int]:
    """The entries of one run of `take_runs`: records sizes[i0:i1] back to back from `phys`, each
    at or past `ckpt` (else already indexed: an idempotent replay) packed as ENTRY with the run's
    store timestamp, joined; and the phys of the first one taken (-1: none, entries b"").
    The reference of lightqueue/_take.c `run_entries`, which runs instead when built: py-spy --gil
    of `lmqtt bench ha --cases append-replicated` put this loop at ~37 of 317 GIL samples on a
    replica and ~45 of 536 on the primary (tests/lightqueue/test_run_entries_accel.py compares them)."""
    pack = ENTRY.pack
    es = []
    p0 = -1
    for i in range(i0, i1):
        sz = sizes[i]
        if phys >= ckpt:
            if p0 < 0:
                p0 = phys
            es.append(pack(phys, sz, sts))
        phys += sz
    return b"".join(es), p0


def take_runs(index, sizes: list, starts: list, runs: list, ckpt: int) -> None:
    """A columnar chunk (store.message): `runs[k]` is the first record of records
    starts[k]..starts[k+1]-1 that share every field but phys/size/queue offset. Their entries
    are packed, joined and appended once per queue."""
    rget = index.resolved.get
    touched = index.touched
    touched_f = index.touched_f
    mark = object()
    entries = _ctake.run_entries if _ctake is not None else run_entries_py
    cur = NO_TAILS
    acc: list[bytes] = []
    nr = len(runs)
    ns = len(sizes)
    res_tail, res_filters, res_first, res_mark, res_others = (RES_TAIL, RES_FILTER_TAILS, RES_FIRST_NAME,
                                                              RES_MARK, RES_OTHER_NAMES)
    for k in range(nr):
        r = runs[k]
        qs = r.dispatch_queues
        if not qs:
            continue
        e, p0 = entries(r.phys_offset, sizes, starts[k], starts[k + 1] if k + 1 < nr else ns, r.store_ts, ckpt)
        if not e:
            continue
        c = rget(qs)
        if c is None:
            if acc:
                _spread(acc, cur)
                acc = []
            c = index.resolve(qs, p0)
            rget = index.resolved.get
        if c[res_mark] is not mark:
            c[res_mark] = mark
            touched.append(c[res_first])
        f = c[res_filters]
        if f is not cur:
            if acc:
                _spread(acc, cur)
            cur = f
            acc = [e]
            touched_f.append(c[res_others])
        else:
            acc.append(e)
        ba = c[res_tail]
        ba += e
    if acc:
        _spread(acc, cur)
