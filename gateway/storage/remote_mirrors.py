"""How `RemoteStore`'s mirrors are kept fresh (`MirrorFeed`, a part of `RemoteStore`): the store's
PUSH / PUSH_RAW frames appended where they continue a mirror, EVENTs and Redis hints turned into
one asynchronous pull per queue (`_fetch`), the mirrors' memory bound, the safety poll over
`POLL_SLICE` queues at a time, forgetting the queues nobody here reads, watching again after a
reconnect.

Separate from gateway/storage/remote_store.py because it is the other direction of the same
mirrors: remote_store.py answers the readers (`pull`, `max_offset`, a read behind the mirror);
this fills the mirrors from what the store sends and tells the local sessions
(`on_new_data` listeners). `RemoteStore` inherits these methods; the state they use is
`RemoteStore`'s (named below, for the type check).
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterable

from lmqtt.gateway.storage.facades import Answer
from lmqtt.gateway.storage.node_client import NodeClient
from lmqtt.gateway.storage.remote_entries import RemoteMessage, decode_raw_entries
from lmqtt.gateway.storage.store_link import LoopConnection
from lmqtt.store import protocol as W
from lmqtt.store.node import protocol as P

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.storage.remote_metadata import RemoteMetadata

log = logging.getLogger("lmqtt.gateway.remote")


# Mirror.reads: a pull at or past the mirror's start / one behind it (RemoteStore.pull) since the
# last push, and PASSING: that push was passed over (_take_pushed)
READ_HEAD, READ_BEHIND, PASSING = 1, 2, 4


class Mirror:
    """The newest entries of one queue: items[i] has offset base + i; `end` = base + len(items)."""

    __slots__ = ("base", "items", "known", "min_offset", "fetching", "back_from", "back_base", "back",
                 "back_bytes", "back_next", "reading_back", "back_answer", "reads")

    def __init__(self, max_offset: int) -> None:
        self.base = max_offset
        self.items: list[RemoteMessage] = []
        self.known = max_offset        # the store's max offset as last heard
        self.min_offset = 0
        self.fetching = False
        # one chunk of older entries read for a reader behind the mirror (a lagging subscriber, a
        # resumed session's backlog), asked for from back_from: back[i] has offset back_base + i,
        # and nothing is left in [back_from, back_base) (retention)
        self.back_from = 0
        self.back_base = 0
        self.back: list[RemoteMessage] = []
        self.back_bytes = 0     # their bodies' bytes (counted once, when the chunk came)
        self.back_next = 0      # where the last pull served from `back` left its reader
        self.reads = 0          # READ_HEAD | READ_BEHIND: the pulls since the last push (_take_pushed)
        self.reading_back: int | None = None    # the offset a read behind the mirror is under way from
        self.back_answer: Answer[None] | None = None   # ... done when its chunk is in (or failed)

    @property
    def end(self) -> int:
        return self.base + len(self.items)


class MirrorFeed:
    """The mirror-filling methods of `RemoteStore` (see the module docstring)."""

    # RemoteStore's state these methods use (set in RemoteStore.__init__)
    link: LoopConnection
    node: NodeClient
    loop: asyncio.AbstractEventLoop
    remote_metadata: "RemoteMetadata"
    queues: dict[str, Mirror]
    watch: bool
    raw_push: bool
    fetch_batch: int
    mirror_entries: int
    mirror_bytes: int
    mirror_trims: int
    _bytes: int
    is_served: Callable[[str], bool] | None
    on_forget: Callable[[list], None] | None
    _listeners: list[Callable[[Iterable[str]], None]]
    safety_poll_s: float
    _poll_keys: list[str]
    _poll_at: int
    _poll_handle: asyncio.TimerHandle | None
    events: int
    polls: int
    remote_pulls: int
    pushed_batches: int
    pushed_entries: int
    push_skipped: int

    def _on_push(self, op: int, body: bytes) -> None:
        if op == W.OP_PUSH_RAW:
            self._on_raw_entries(body)
            return
        if op == W.OP_PUSH:
            self._on_entries(body)
            return
        if op == W.OP_SESSIONS_MOVED:
            self.remote_metadata.sessions.sessions_moved_frame(body)
            return
        if op == W.OP_SESSION_CLAIMS:
            self.remote_metadata.sessions.session_claims_frame(body)
            return
        if op != W.OP_EVENT:
            return
        try:
            offsets = W.decode_event(body)
        except Exception as e:  # noqa: BLE001 - a hint: the poll covers it
            log.warning("event=bad_event_frame error=%r", e)
            return
        self.events += 1
        self.heard(offsets)

    def _on_entries(self, body: bytes) -> None:
        """A PUSH: new entries of watched queues (and their max offsets). Entries that continue a
        mirror are appended and local sessions told at once, all queues of the frame in one call;
        for the rest (a gap, a queue the store sent as a hint) the mirror pulls, as after an EVENT."""
        try:
            queues = W.decode_push(body)
        except Exception as e:  # noqa: BLE001 - a hint: the poll covers it
            log.warning("event=bad_push_frame error=%r (the safety poll catches up)", e)
            return
        self._take_pushed((q, mx, len(recs), lambda m, recs=recs, dqs=dqs: self._extend(m, recs, dqs))
                          for q, mx, recs, dqs in queues)

    def _on_raw_entries(self, body: bytes) -> None:
        """An OP_PUSH_RAW: as `_on_entries`, the entries being the store's record bytes, decoded
        and CRC-checked here (a record that fails its check: the queue is treated as a hint and
        pulled, where the store reports and skips it)."""
        try:
            queues = W.decode_push_raw(body)
        except Exception as e:  # noqa: BLE001 - a hint: the poll covers it
            log.warning("event=bad_push_frame error=%r (the safety poll catches up)", e)
            return
        mv = memoryview(body)
        ident = self.link.server_info.get("ident") or ""

        def extend(m: Mirror, q: str, first: int, runs, sizes) -> int:
            msgs = decode_raw_entries(mv, runs, sizes, first, ident)
            if msgs is None:
                log.warning("event=bad_push_record queue=%s first=%d (pulled instead)", q, first)
                return 0
            return self._extend_msgs(m, first, msgs)
        self._take_pushed((q, mx, len(sizes), lambda m, a=(q, first, runs, sizes): extend(m, *a))
                          for q, mx, first, runs, sizes in queues)

    def _take_pushed(self, queues) -> None:
        """The queues of one PUSH / PUSH_RAW frame: (name, max offset, entry count, extend(mirror)
        -> entries appended to it). Local sessions are told of all queues that gained in one call."""
        self.events += 1
        added = set()
        for q, mx, count, extend in queues:
            m = self.queues.get(q)
            if m is None:
                continue
            if mx > m.known:
                m.known = mx
            if count:
                self.remote_pulls += 1
                self.pushed_batches += 1
                r = m.reads
                if not r & READ_HEAD and (r & PASSING or (r & READ_BEHIND and 2 * len(m.items) >= self.mirror_entries)) \
                        and mx > m.end:
                    # every reader since the last push was behind the mirror, which is full enough
                    # to be trimmed before they get here: the entries are passed over undecoded
                    # (and the next ones, until a reader is at the head again) and the readers
                    # read them in chunks. Measured: a fan-in subscriber 32k behind had 1.3M of
                    # 2M messages decoded twice, pushed and then read.
                    self._trim(m, len(m.items))
                    m.base = mx
                    self.push_skipped += count
                    m.reads = PASSING
                    added.add(q)        # its readers are told, as of entries taken and trimmed
                else:
                    n = extend(m)
                    self.pushed_entries += n
                    self.push_skipped += count - n
                    if n:
                        added.add(q)
                        self._bound_memory(m)
                    m.reads = 0
            if m.known > m.end:
                self._fetch(q, m)
        if added:
            self._tell(added)

    def _extend_msgs(self, m: Mirror, first: int, msgs: list) -> int:
        """Append `msgs` (queue offsets first, first + 1, ...) where they continue `m`, skipping
        those it holds already; nothing after a gap (pulled later). -> how many were appended."""
        skip = m.end - first
        if skip < 0 or skip >= len(msgs):
            return 0
        new = msgs[skip:] if skip else msgs
        m.items += new
        self._bytes += sum([len(x[1]) for x in new])
        return len(new)

    def _extend(self, m: Mirror, recs: list, dqs) -> int:
        """Append the entries of `recs` that continue `m` (offset = m.end), skipping those it
        holds already and stopping at a gap (pulled later). -> how many were appended."""
        items = m.items
        end = m.end
        n = 0
        nbytes = 0
        for t, d in zip(recs, dqs):
            off = t[0]
            if off < end:
                continue
            if off != end:
                break
            items.append(RemoteMessage(t, d))
            nbytes += len(t[8])
            end += 1
            n += 1
        self._bytes += nbytes
        return n

    def _bound_memory(self, m: Mirror) -> None:
        """Keep mirror `m` (just extended) within `mirror_entries`, and all mirrors within
        `mirror_bytes`."""
        if len(m.items) > self.mirror_entries:
            self._trim(m, len(m.items) - self.mirror_entries // 2)
        if self._bytes > self.mirror_bytes:
            # halve every mirror until at most half the budget is used (room before the next trim)
            self.mirror_trims += 1
            while self._bytes > self.mirror_bytes // 2:
                trimmed = 0
                for other in self.queues.values():
                    n = (len(other.items) + 1) // 2
                    self._trim(other, n)
                    trimmed += n + len(other.back)
                    self._drop_back(other)
                if not trimmed:
                    self._bytes = 0        # nothing left to hold: the count drifted, start over
                    break

    def _tell(self, queues: set) -> None:
        for cb in self._listeners:
            try:
                cb(queues)
            except Exception:  # noqa: BLE001
                log.exception("event=new_data_listener_failed")

    def heard(self, offsets: dict[str, int]) -> None:
        """The store says these queues reach these max offsets: fetch what is not local yet."""
        for q, mx in offsets.items():
            m = self.queues.get(q)
            if m is None:
                continue
            if mx > m.known:
                m.known = mx
            if m.known > m.end:
                self._fetch(q, m)

    def heard_names(self, names: Iterable[str]) -> None:
        """Names without offsets (Redis events): fetch from the mirror's end and see."""
        for q in names:
            m = self.queues.get(q)
            if m is not None:
                self._fetch(q, m)

    def _fetch(self, q: str, m: Mirror) -> None:
        if m.fetching or not self.link.connected:
            return
        m.fetching = True
        start = m.end
        self._ask_pull(q, start, self.fetch_batch, lambda f, q=q, m=m, start=start: self._fetched(q, m, start, f))

    def _fetched(self, q: str, m: Mirror, start: int, f) -> None:
        m.fetching = False
        if self.queues.get(q) is not m:
            return
        e = f.exception()
        if e is not None:
            log.warning("event=prefetch_failed queue=%s error=%s (the safety poll retries)", q, e)
            return
        r: P.PullReply = f.result()
        recs = r.messages
        dq: list[Any] = r.dq or [()] * len(recs)
        if r.max_offset > m.known:
            m.known = r.max_offset
        m.min_offset = r.min_offset
        if m.end != start:
            # the mirror moved meanwhile (a push): keep what continues it, fetch again if needed
            added = self._extend(m, recs, dq) > 0
            if added:
                self._bound_memory(m)
            if m.known > m.end:
                self._fetch(q, m)
            if added:
                self._tell({q})
            return
        added = False
        if recs and recs[0][0] != start:
            # entries gone below us (retention) or a gap: restart the mirror at what came back
            self._trim(m, len(m.items))
            m.base = recs[0][0]
        if recs:
            added = self._extend(m, recs, dq) > 0
        if not recs and r.next_offset > start:
            self._trim(m, len(m.items))
            m.base = r.next_offset                   # skipped entries no reader can get any more
            added = True
        self._bound_memory(m)
        if m.known > m.end and (recs or added):
            self._fetch(q, m)
        if added:
            self._tell({q})

    # queues a safety poll asks about (40,000 queues over two gateways, all polled every second:
    # 12 % of a core in each gateway and 8 % in the store while every client was idle)
    POLL_SLICE = 4096
    # With the native watch the store pushes every new entry's event on this same ordered
    # connection and is asked again after a reconnect (`_rewatch`): the poll is only a backstop,
    # so a round over the mirrored queues is spread over about this many polls (a slice of at
    # least POLL_SLICE_MIN). A fleet's polls all land on the one store: `serve --workers 6`
    # holding 100,000 idle subscribed connections spent 0.28 of a core on full-speed rounds and
    # its connect rate fell with every connection held.
    WATCHED_ROUND_POLLS = 30
    POLL_SLICE_MIN = 64

    def poll(self, queues: "list[str] | None" = None) -> None:
        """Ask the store for the max offset of `queues` (default: every mirrored queue): the safety poll."""
        if queues is None:
            queues = list(self.queues)
        if not queues or not self.link.connected:
            return
        self.polls += 1
        fut = self.node.call(P.MaxOffsets(queues), bounded=False)

        def done(f):
            if not f.cancelled() and f.exception() is None:
                self.heard(f.result().max_offsets)
        fut.add_done_callback(done)

    def _drop_back(self, m: Mirror) -> None:
        if m.back:
            self._bytes -= m.back_bytes
            m.back = []
            m.back_bytes = 0

    def _trim(self, m: Mirror, drop: int) -> None:
        if drop <= 0:
            return
        self._bytes -= sum([len(it.body) for it in m.items[:drop]])
        del m.items[:drop]
        m.base += drop

    def forget_unserved(self, queues: "Iterable[str] | None" = None) -> int:
        """Stop mirroring (and watching) queues no local session or group reads any more (of
        `queues`, default all)."""
        if self.is_served is None:
            return 0
        mirrored = self.queues
        gone = [q for q in (mirrored if queues is None else queues) if q in mirrored and not self.is_served(q)]
        for q in gone:
            m = self.queues.pop(q)
            self._trim(m, len(m.items))
            self._drop_back(m)
        if gone and self.watch and self.link.connected:
            self.node.send(P.Unwatch(gone))
        if gone and self.on_forget is not None:
            self.on_forget(gone)
        return len(gone)

    def _poll_slice(self) -> list[str]:
        """The next slice of the round over the mirrored ones (a new round: the queues mirrored
        then): POLL_SLICE queues, or with the native watch a round's 1/WATCHED_ROUND_POLLS."""
        keys = self._poll_keys
        if self._poll_at >= len(keys):
            keys = self._poll_keys = list(self.queues)
            self._poll_at = 0
        size = self.POLL_SLICE
        if self.watch:
            size = min(size, max(self.POLL_SLICE_MIN, -(-len(keys) // self.WATCHED_ROUND_POLLS)))
        part = keys[self._poll_at:self._poll_at + size]
        self._poll_at += len(part)
        return part

    def _poll_tick(self) -> None:
        try:
            part = self._poll_slice()
            self.forget_unserved(part)
            mirrored = self.queues
            self.poll([q for q in part if q in mirrored])
        finally:
            self._poll_handle = self.loop.call_later(self.safety_poll_s, self._poll_tick)

    def _rewatch(self) -> None:
        """After a reconnect: watch again (the store forgot this connection) and catch up."""
        if not self.queues:
            return
        if self.watch:
            fut = self.node.call(P.Watch(list(self.queues), push=True, raw=self.raw_push, replace=True), bounded=False)
        else:
            fut = self.node.call(P.MaxOffsets(list(self.queues)), bounded=False)

        def done(f):
            if not f.cancelled() and f.exception() is None:
                self.heard(f.result().max_offsets)
        fut.add_done_callback(done)

    def _ask_pull(self, q: str, offset: int, max_count: int, then: Callable) -> None:
        """One `gw_pull` of `q` from `offset`, not waited for (bounded as every call is): `then`
        gets the reply's future."""
        self.remote_pulls += 1
        self.node.pull(q, offset, max_count, 4 << 20).add_done_callback(then)
