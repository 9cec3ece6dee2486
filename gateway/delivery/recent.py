"""`RecentMessages`: per queue, the newest entries this gateway appended itself, kept as ready
`OutboundMessage`s so that delivery can send them without reading the store.

Why: a pull (index read, cache lookup, on a miss the record rebuilt from the store) was the largest
cost per delivered message, and for messages this process just appended the records are in hand.
When the store dispatched an append inline (nothing appended before it left undispatched), the
batch's entries of queue q are exactly the last k entries of q in record order (the gateway is the
store's only appender), so their queue offsets are known without reading the index.

Why it is separate from `delivery.py`: the delivery engine decides what goes to whom (which queues
to read, one read per distinct cursor, fan-out, windows, overlapping subscriptions, shared groups).
This module is a cache with a job of its own: which entries to keep, bridging the gap left by an
append the store's thread dispatched, and a memory budget. The engine composes it and talks to it
through these: `record_appended` (the publish pipeline's callback, bound straight to this
object's method), `rings` (read by the engine: a cursor inside a queue's ring is served from it,
anyone behind pulls), `drop_passed` (every online reader is past the ring's start), `drop`
(a queue lost its last reader) and `lagging_behind` / `caught_up` (below).

What it costs: memory, at most `max_bytes` (a quarter of `lq_cache_mb`, counting payload +
`ENTRY_COST` per entry; all rings are dropped when over it) and at most `per_queue` entries per
queue (the older half dropped when over it); one `OutboundMessage` per entry and queue (the PUBLISH
encodings shared between the queues of one record); a store read of up to `gap_max` entries to
bridge a gap (beyond, the ring starts over). Its store reads are `Answer`s (storage/facades.py):
taken when done, as they are where this runs (the store dispatched the append inline: it is this
process); one not in yet is treated as unknown (the ring starts over, readers pull). The engine reads the ring layout (`[first queue
offset, messages]`) directly in `_deliver_direct` rather than through a method, so that serving a
cursor costs no call: a change of that layout is made in both.

A queue whose every reader is more than `gap_max` behind its end is `lagging`: it keeps no ring
until one of them comes that close (the engine tells it, `_deliver_direct`). Why: a reader behind a
ring's start pulls from the store anyway, and under a sustained overload (100 publishers into one
wildcard subscriber) the ring of its queue grew to the budget, was dropped, started again at the
newest entries, never reached by the reader: building its entries was ~17 % of the broker's CPU
for nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from lmqtt.gateway.session import OutboundMessage

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.storage.facades import QueueStore


class RecentMessages:
    """The rings of the queues with local readers: queue -> [first queue offset, messages].

    `readers` is the delivery engine's `direct` (queue -> online sessions reading it; the same dict
    object, read only), `meta_of(props)` its props cache, `outbound(stored message)` its
    OutboundMessage of an entry read from the store. Entries every online reader of a
    queue has passed are dropped at its next delivery run (`drop_passed`); a queue whose readers
    fall further behind than `per_queue` drops its older half; the whole cache is dropped when
    over its budget. Readers behind what is kept pull as before.
    """

    per_queue = 1 << 16
    gap_max = 1 << 13      # entries a ring reads to bridge a gap (else it starts over)
    ENTRY_COST = 256

    def __init__(self, store: "QueueStore", metrics, readers: dict, meta_of: Callable[[bytes], object],
                 outbound: Callable[[object], OutboundMessage], max_bytes: int) -> None:
        self.store = store
        self.metrics = metrics
        self._readers = readers
        self._meta_of = meta_of
        self._outbound = outbound   # the engine's: a stored message -> OutboundMessage
        self.max_bytes = max_bytes
        self.rings: dict[str, list] = {}
        # queue -> its end as `record_appended` read it, kept only until the append's own delivery
        # run is over (PublishPipeline clears it when its after-append chain returns): that run's
        # `_deliver_direct` takes the end from here instead of asking the store a second time for
        # the same message. Valid meanwhile: everything was visible and nothing else appends on
        # the loop within that chain. Always this dict (the engine holds it): cleared, never rebound.
        self.ends: dict[str, int] = {}
        # queues whose every reader is more than gap_max behind their end: no ring is fed for them
        # (`lagging_behind`, `caught_up`: the engine's delivery run decides)
        self.lagging: set[str] = set()
        self.entries = 0        # entries in all rings
        self.nbytes = 0         # their payload bytes

    def record_appended(self, batch: list, store_ts: int) -> None:
        """The loop appended `batch` (PublishPipeline `_Pending`s, in record order) and the store
        dispatched it inline, with nothing appended before it left undispatched.

        Each queue with local readers keeps its newest entries as ready messages (see the module
        docstring for why their offsets are known). A ring whose end does not meet the new entries
        (an append dispatched by the store's thread came in between, or a reader subscribed later)
        is bridged by one read (`_fill_gap`), or starts over at the new entries."""
        direct = self._readers
        lagging = self.lagging
        per_q: dict[str, list[int]] | None = None
        for i, p in enumerate(batch):
            for q in p.dispatch_queues:
                if q in direct and q not in lagging:
                    if per_q is None:
                        per_q = {q: [i]}
                    else:
                        lst = per_q.get(q)
                        if lst is None:
                            per_q[q] = [i]
                        else:
                            lst.append(i)
        if per_q is None:
            return
        base: dict[int, OutboundMessage] = {}
        recent = self.rings
        max_offset = self.store.max_offset
        ends = self.ends
        cap = self.per_queue
        added = nbytes = 0
        for q, idx in per_q.items():
            end = max_offset(q)
            if not end.done():
                self.drop(q)            # where the batch sits is not known here: readers pull
                continue
            e = ends[q] = end.result()
            start = e - len(idx)
            r = recent.get(q)
            if r is not None and r[0] + len(r[1]) != start and not self._fill_gap(q, r, start):
                self.drop(q)
                r = None
            if r is None:
                r = recent[q] = [start, []]
            messages = r[1]
            off = start
            for i in idx:
                it = base.get(i)
                p = batch[i]
                if it is None:
                    # phys_offset left unknown (-1): nothing reads it, and indexing the store's
                    # columnar results would build every AppendResult tuple
                    it = base[i] = OutboundMessage(p.topic, p.body, self._meta_of(p.props), off, -1, p.dispatch_queues,
                                        store_ts)
                else:
                    it = it.at_offset(off)      # the same record in another queue
                nbytes += len(p.body)
                messages.append(it)
                off += 1
            added += len(idx)
            if len(messages) > cap:
                drop = len(messages) - cap // 2
                nbytes -= sum([len(it.payload) for it in messages[:drop]])
                del messages[:drop]
                r[0] += drop
                added -= drop
        self.entries += added
        self.nbytes += nbytes
        if self.nbytes + self.entries * self.ENTRY_COST > self.max_bytes:
            self.drop()

    def _fill_gap(self, q: str, r: list, start: int) -> bool:
        """Entries appended while the ring was not fed (an append the store's thread dispatched):
        read them once so the ring stays one range; a reader behind the ring would otherwise pull
        all the way up to the new entries. False: not filled (the caller starts over)."""
        off = r[0] + len(r[1])
        if not 0 < start - off <= self.gap_max:
            return False
        messages = r[1]
        n0 = len(messages)
        nbytes = 0
        ok = True
        while ok and off < start:
            self.metrics.pulls += 1
            a = self.store.pull(q, off, max_count=start - off, max_bytes=1 << 30)
            if not a.done() or a.exception() is not None:
                ok = False
                break
            res = a.result()
            if not res.messages:
                ok = False
            for m in res.messages:
                if m.queue_offset != off or off >= start:
                    ok = False
                    break
                messages.append(self._outbound(m))
                nbytes += len(m.body)
                off += 1
        # counted either way: on failure drop subtracts the whole ring
        self.entries += len(messages) - n0
        self.nbytes += nbytes
        return ok

    def drop_passed(self, r: list, lo: int) -> None:
        """Every online reader of ring `r`'s queue is at `lo` or past it (`lo` > `r[0]`): drop the
        entries before it (those in flight are held by their InFlight)."""
        drop = lo - r[0]
        ri = r[1]
        if drop >= len(ri):
            drop = len(ri)
        self.nbytes -= sum([len(it.payload) for it in ri[:drop]])
        del ri[:drop]
        r[0] += drop
        self.entries -= drop

    def lagging_behind(self, q: str) -> None:
        """Every reader of `q` is more than `gap_max` behind its end: drop its ring and feed none
        until one comes closer (`caught_up`); they pull meanwhile, as they would from behind a ring."""
        if q in self.rings:
            self.drop(q)
        self.lagging.add(q)

    def caught_up(self, q: str) -> None:
        """A reader of `q` is within `gap_max` of its end again: its next append starts a ring."""
        self.lagging.discard(q)

    def drop(self, queue: str | None = None) -> None:
        """Forget `queue`'s ring (its last local reader went), or every ring."""
        if queue is None:
            self.rings.clear()
            self.entries = self.nbytes = 0
        else:
            self.lagging.discard(queue)
            r = self.rings.pop(queue, None)
            if r is not None:
                self.entries -= len(r[1])
                self.nbytes -= sum([len(it.payload) for it in r[1]])
