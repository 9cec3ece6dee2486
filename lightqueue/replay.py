"""Subscribing from the past, store side: where the history of an MQTT filter since a time is,
and reading it (docs/gateway.md "Subscribing from the past").

A filter's messages since `since_ms` come from one of two places, joined at one seam:

* **its light queue**, when the queue held the filter the whole time. An exact topic's queue always
  does (every publish lands in its topic's queue). A wildcard filter's queue holds what was
  published while the filter was registered: `LightQueueStore` records the *epoch* of a wildcard
  filter when its reference count goes 0 -> 1 (the CommitLog end and the wall clock at that
  moment, persisted with the count, dropped with it). Since the publish path routes and appends in
  one step with respect to registrations (the store server's loop; the embedded gateway flushes
  its pending publishes before it registers), every matching record at or after the epoch's log
  position carries the filter in its dispatch queues. So when `since_ms` is after the epoch, the
  history is the queue itself from its first entry stored at/after `since_ms` (binary search over
  the queue's index entries, which carry the store time) and no seam is needed: the subscription
  is an ordinary cursor that starts in the past.
* **the log**, when the epoch is later than `since_ms` (typically: the filter was never subscribed
  before and was registered just now). The history is read from the ConsumeQueue(s) of the
  filter's first-level topic (all queue ids; every first-level topic for a filter starting with a
  wildcard), each entered at its first entry stored at/after `since_ms` (binary search over the
  ConsumeQueue: the same as the store's `offset_for_time`), merged in CommitLog order, each record
  checked with the compiled matcher, **up to the epoch's log position `seam`**. The sources, the
  time lookup and the matcher are lightqueue/history.py's: the one definition of a filter's
  history, which the SDK's FilterConsumer and the Spark source read too. Live delivery starts at
  the light queue's first entry at/after `seam`. Nothing falls between (every matching record
  below `seam` is read from the log, every one at/after it is in the queue) and nothing is
  delivered twice (each record is on one side of `seam`).

Safety net: a record routed before the registration by an appender that would route outside the
append step lands after the seam without the filter; records between the seam and the log's end
at planning time that match but do not carry the filter are read from the log as well.

Before answering, the plan waits until dispatch has passed the log end (so every record below the
seam is in the ConsumeQueues and the light queue's entries below it are final).

Outside retention: when retention has deleted the start of the log and `since_ms` is before the
oldest record left, some messages of the period are gone: refused (`ReplayRefused`). A log that
was never trimmed holds everything ever stored, so any `since_ms` is answered in full.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone

from . import history
from .history import lq_offset
from .topics import is_wildcard, validate_filter


class ReplayRefused(Exception):
    """The history asked for cannot be served (the message says why, for the client and the log)."""


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000.0, tz=timezone.utc).isoformat(timespec="milliseconds")


def oldest_kept_ts(store) -> int | None:
    """Store time of the oldest record still in the log, or None when the log was never trimmed
    (it then holds everything ever stored)."""
    lo = store.min_offset
    if lo <= 0:
        return None
    try:
        return int(store.read(lo).store_ts)
    except Exception:            # noqa: BLE001 - unreadable start: treat the whole log as uncertain
        return int(time.time() * 1000)


def check_retention(store, since_ms: int) -> None:
    oldest = oldest_kept_ts(store)
    if oldest is not None and since_ms < oldest:
        raise ReplayRefused(f"since {_iso(since_ms)} is outside retention: the oldest stored message is "
                            f"from {_iso(oldest)} (older ones were deleted)")


# the ConsumeQueues a filter's history is in, and time -> queue offset: lightqueue/history.py's (one
# definition of a filter's history for $replay/, since, the SDK and Spark)
cq_sources = history.sources
cq_offset_for_time = history.cq_offset_for_time


def plan(store, lq, flt: str, since_ms: int) -> dict:
    """Where the history of `flt` since `since_ms` is (see the module docstring). The caller has
    registered `flt` (a wildcard filter) before calling, and dispatch has passed the log end.

    Returns a JSON-able dict:
      {"source": "queue", "live_offset": n}     the light queue holds it all: start the cursor at n
      {"source": "log", "live_offset": n, "cursor": {...}}
                                                read the history with `read_history(cursor)` until
                                                it is done, then the light queue from n
    Raises ReplayRefused outside retention."""
    validate_filter(flt)
    since_ms = int(since_ms)
    check_retention(store, since_ms)
    if not is_wildcard(flt):
        return {"source": "queue", "live_offset": lq_offset(lq, flt, 0, since_ms)}
    epoch = lq.filter_epoch(flt)
    if epoch is None:
        # registered before epochs were recorded (or not registered): the log up to its end now
        seam, epoch_ms = store.dispatched_offset, None
    else:
        seam, epoch_ms = epoch
    if epoch_ms is not None and since_ms > epoch_ms:
        return {"source": "queue", "live_offset": lq_offset(lq, flt, seam, since_ms)}
    sources = [[fl, qid, cq_offset_for_time(store, fl, qid, since_ms)] for fl, qid in cq_sources(store, flt)]
    # stragglers: a record routed before the registration by an appender that routes outside the
    # store's append step (not the gateway or the store server, which route and append at once) is
    # appended after the seam without the filter; it is read from the log too, up to `end`
    end = max(seam, store.dispatched_offset)
    return {"source": "log", "live_offset": lq_offset(lq, flt, seam, 0),
            "cursor": {"filter": flt, "seam": seam, "end": end, "sources": sources}}


def read_history(store, cursor: dict, max_count: int = 1024, max_bytes: int = 4 << 20) -> tuple[list, dict, bool]:
    """The next history messages (StoredMessages matching the filter, in CommitLog order, below
    the seam, and stragglers between the seam and `end` that do not carry the filter) from
    `cursor`. Returns (messages, next cursor, done). Stateless: the cursor says it
    all, so a remote gateway can carry it between calls."""
    flt = cursor["filter"]
    seam = int(cursor["seam"])
    end = int(cursor.get("end", seam))
    sources = [list(s) for s in cursor["sources"]]
    if not sources:
        return [], {"filter": flt, "seam": seam, "end": end, "sources": []}, True
    per = max(16, max_count // len(sources))
    batches = []
    horizon = None               # CommitLog position up to which every source has been read
    for s in sources:
        fl, qid, off = s[0], int(s[1]), int(s[2])
        cq = store.consume_queues.get(fl, qid)
        entries = [] if cq is None else cq.range(off, per)
        entries = [e for e in entries if e[1] < end]
        exhausted = len(entries) < per
        batches.append(entries)
        if not exhausted:
            last = entries[-1][1]
            horizon = last if horizon is None or last < horizon else horizon
    if len(batches) == 1:        # one ConsumeQueue: already in CommitLog order
        picked = [(phys, size, 0, qoff) for qoff, phys, size, _tags in batches[0]
                  if horizon is None or phys <= horizon]
    else:
        picked = []              # (phys, size, source index, queue offset)
        for i, entries in enumerate(batches):
            for qoff, phys, size, _tags in entries:
                if horizon is not None and phys > horizon:
                    break
                picked.append((phys, size, i, qoff))
        picked.sort()
    out = []
    nbytes = 0
    new_off = [int(s[2]) for s in sources]
    # every picked record in one call (one decode per segment's run, store.read_many); a record
    # that cannot be read (deleted by retention meanwhile) comes back as its exception: skipped,
    # never an error. Records past a max_bytes cut are decoded for nothing: max_bytes (4 MiB) is a
    # bound for large payloads, rarely reached.
    msgs = store.read_many([(p[0], p[1]) for p in picked])
    append = out.append
    matches: dict[str, bool] = {}       # topic -> matches the filter (topics repeat)
    fb = flt.encode()
    match = history.match               # the compiled matcher (lightqueue/_history.c)
    for (phys, size, i, qoff), m in zip(picked, msgs):
        if out and nbytes + size > max_bytes:
            break
        new_off[i] = qoff + 1
        if isinstance(m, Exception):
            continue
        topic = m[0]
        ok = matches.get(topic)
        if ok is None:
            ok = matches[topic] = match(fb, topic.encode())
        if ok and (phys < seam or flt not in m[12]):      # [12]: dispatch_queues, a tuple
            append(m)
            nbytes += size
    for s, o in zip(sources, new_off):
        s[2] = o
    done = horizon is None and all(
        (not batches[i]) or new_off[i] > batches[i][-1][0] for i in range(len(sources)))
    return out, {"filter": flt, "seam": seam, "end": end, "sources": sources}, done
