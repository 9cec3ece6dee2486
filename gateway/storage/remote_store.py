"""`RemoteStore`: the `QueueStore` facade (gateway/storage/facades.py) over the store's native
protocol, for `lmqtt gateway` (docs/fleet.md). The store side is store/node/gateway_service.py.

Every read returns an `Answer` (gateway/storage/facades.py): done at once when the gateway holds
what is asked, else completed by the store's reply; nothing here waits on the event loop. What
each costs:
  * append_batch   one PRODUCE frame written, returns at once: gateway/storage/remote_produce.py.
  * pull, max_offset  answered at once from a per-queue mirror: the newest entries of every queue this
                   gateway serves. With the native watch the store pushes the new entries with
                   its event (PUSH frames, `gw_watch {push: true}`): no round trip before local
                   delivery. Otherwise, and for whatever a push did not carry (a gap, a queue over
                   the frame's budget, a store that only sends EVENT), ONE asynchronous pull per
                   queue when the store says the queue grew (an EVENT on the watch, a Redis event,
                   or the safety poll). Local sessions at that offset all read the one copy;
                   `on_new_data` listeners are called only once the entries are local. A reader
                   behind the mirror (a resumed session's backlog) gets an answer that completes
                   when its chunk (asked for then, one per queue at a time) is in. A queue not
                   mirrored yet is watched when first read: its answers complete with the reply.
  * a SUBSCRIBE    asks for what it reads (registrations, watches, start offsets, replay plans,
                   retained messages) and waits for the answers together: they leave in one send
                   (the link sends what one loop turn queued at once), one round trip; only that
                   connection waits; a resumed session's CONNECT likewise (its filters, queue
                   ends, group offsets, messages in flight): gateway/storage/remote_reads.py.
  * metadata       gateway/storage/remote_metadata.py.

Everything uses one `LoopConnection` (store/client/loop_connection.py), so the store sees this
gateway's requests in order; the gw_* commands are typed in store/node/protocol.py and sent with
its `NodeClient`. A store that does not speak this gateway's protocol version (or an embedded
`lmqtt serve`) is refused from its HELLO_OK, at start (NodeMismatch) and after every reconnect
(the link is dropped with the reason), before anything is sent to it. Events are hints: every `safety_poll_s` the gateway asks for the max
offsets of the queues it mirrors and fetches what an event missed (a lost event delays, never
loses): at most `POLL_SLICE` queues a poll, the next ones at the next poll, so a gateway whose
clients each read a queue of their own (10^5-10^6 devices, each on its own topic) spends the
same bounded work a second on it, and a missed event is found within ceil(queues / POLL_SLICE)
polls. Pushed entries are taken only where they continue a mirror (offset = its end); anything
else is pulled.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Iterable

from lmqtt.gateway.storage.facades import Answer, ReplayPlan
from lmqtt.gateway.storage.remote_entries import RemoteMessage, RemotePull, decode_raw_entries, entries
from lmqtt.gateway.storage.remote_metadata import RemoteMetadata, ask
from lmqtt.gateway.storage.remote_produce import RemoteProducer
from lmqtt.gateway.storage.remote_reads import RemoteReads
from lmqtt.store import protocol as W
from lmqtt.store.client.aio import ConnectionLost, LoopConnection, StoreClientError
from lmqtt.store.node import protocol as P
from lmqtt.store.node.protocol import NodeMismatch

log = logging.getLogger("lmqtt.gateway.remote")


class _Mirror:
    """The newest entries of one queue: items[i] has offset base + i; `end` = base + len(items)."""

    __slots__ = ("base", "items", "known", "min_offset", "fetching", "back_from", "back_base", "back",
                 "reading_back", "back_answer")

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
        self.reading_back: int | None = None    # the offset a read behind the mirror is under way from
        self.back_answer: Answer[None] | None = None   # ... done when its chunk is in (or failed)

    @property
    def end(self) -> int:
        return self.base + len(self.items)


def _within(out: list, max_bytes: int) -> list:
    """The first entries of `out` whose bodies fit `max_bytes` (at least one; 0 = no limit)."""
    if max_bytes:
        total = 0
        for k, it in enumerate(out):
            total += len(it.body)
            if total > max_bytes and k:
                return out[:k]
    return out


class RemoteStore:
    """`QueueStore` over one store connection (see the module docstring); `metadata`: the bundle
    of every remote facade of this link, this as its queues."""

    # entries kept per queue (the byte budget `mirror_bytes` bounds them all); older ones are
    # pulled on demand, a chunk at a time (_read_back)
    mirror_entries = 65536

    def __init__(self, link: LoopConnection, gateway_id: str, metrics=None, *, safety_poll_s: float = 1.0,
                 watch: bool = True, fetch_batch: int = 1024, mirror_bytes: int = 16 << 20,
                 raw_push: bool = True) -> None:
        """`raw_push`: ask the store to push new entries as its own record bytes (OP_PUSH_RAW,
        decoded here in C) rather than re-encoded messages; a store without it pushes OP_PUSH.
        Raises NodeMismatch when `link` is connected to a store that does not speak this
        gateway's protocol (another version, or an embedded `lmqtt serve`), before anything is sent."""
        self.link = link
        self.node = P.NodeClient(link)
        if link.connected:
            self.node.check()
        self.loop = link.loop
        self.gateway_id = gateway_id
        self.metrics = metrics
        self.safety_poll_s = safety_poll_s
        self.watch = watch                 # False: events come from elsewhere (Redis) or the poll
        self.raw_push = raw_push
        self.fetch_batch = fetch_batch
        self.queues: dict[str, _Mirror] = {}
        self._tracking: dict[str, Answer[_Mirror]] = {}    # queues being watched, not mirrored yet
        self._poll_keys: list[str] = []    # the safety poll's round over the queues (`_poll_slice`)
        self._poll_at = 0
        # memory bound of all mirrors (payload bytes): over it, every mirror keeps only its newer
        # half; readers behind pull from the store (the composition passes a quarter of lq_cache_mb)
        self.mirror_bytes = mirror_bytes
        self._bytes = 0
        # q -> True while a local session or shared group reads q (set by the composition); the
        # safety poll stops mirroring queues nobody here reads any more
        self.is_served: Callable[[str], bool] | None = None
        self.mirror_trims = 0
        self._listeners: list[Callable[[Iterable[str]], None]] = []
        self._poll_handle: asyncio.TimerHandle | None = None
        # start offsets, messages in flight, replay plans: gateway/storage/remote_reads.py
        self.reads = RemoteReads(link, heard=self.heard, follow=self.max_offset, decode=entries,
                                 ask_history=self._ask_history)
        # the metadata facades (sessions, offsets, retained, wills, leases) and the filter holds
        # over the same link; this is the bundle's queues
        self.remote_metadata = RemoteMetadata(link, gateway_id)
        self.metadata = self.remote_metadata.storage(queues=self)
        # the publish path (PRODUCE frames): gateway/storage/remote_produce.py
        self.producer = RemoteProducer(link, self.loop, gateway_id)
        self.on_track: Callable[[str], None] | None = None    # new queue mirrored (Redis precise watch)
        self.on_forget: Callable[[list], None] | None = None  # queues no longer mirrored (unwatch)
        # counters (exported as gateway metrics by the composition)
        self.remote_pulls = 0          # light-queue reads the store made for us: pulls + pushed batches
        self.remote_misses = 0         # of which: reads behind the mirror
        self.pushed_batches = 0        # of which: a queue's entries pushed with an event
        self.pushed_entries = 0        # entries taken from pushes
        self.push_skipped = 0          # pushed entries not taken (already held, or after a gap)
        self.events = 0                # EVENT and PUSH frames heard
        self.polls = 0
        self.push = False              # the store pushes entries (it answered gw_watch with push)
        if metrics is not None and getattr(metrics, "registry", None) is not None:
            self._export_push_metrics(metrics.registry)
        self._member = link.address        # the store (group member) the metadata was written to
        link.on_push(self._on_push)
        link.on_reconnect(self._reconnected)
        if link.connected:
            self.remote_metadata.hello()

    def _export_push_metrics(self, registry) -> None:
        """The push path's counters on /metrics (lmqtt_remote_pulls counts every light-queue read
        the store made for this gateway: pulls sent plus batches pushed)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        st = self

        class _Collector:
            def collect(self):
                yield CounterMetricFamily("lmqtt_remote_pushed_batches",
                                          "Queues' new entries pushed by the store with an event",
                                          value=st.pushed_batches)
                yield CounterMetricFamily("lmqtt_remote_pushed_entries",
                                          "Pushed entries taken into the mirrors", value=st.pushed_entries)
                yield CounterMetricFamily("lmqtt_remote_push_skipped_entries",
                                          "Pushed entries not taken (already held, or after a gap: pulled)",
                                          value=st.push_skipped)
                yield GaugeMetricFamily("lmqtt_remote_store_pushes", "1 when the store pushes new entries",
                                        value=1 if st.push else 0)
        registry.register(_Collector())

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.safety_poll_s > 0:
            self._poll_handle = self.loop.call_later(self.safety_poll_s, self._poll_tick)

    def close(self) -> None:
        if self._poll_handle is not None:
            self._poll_handle.cancel()
            self._poll_handle = None

    @property
    def mirrored_bytes(self) -> int:
        """Payload bytes the mirrors hold now (bounded by `mirror_bytes`; /metrics)."""
        return self._bytes

    def unavailable(self) -> str | None:
        if self.link.connected:
            return None
        return f"store {self.link.address} unavailable: {self.link.last_error}"

    def disk_state(self) -> dict | None:
        return None               # the store node exports its own (its /metrics)

    # ------------------------------------------------------------------ the publish path (remote_produce.py)
    def queues_for_topic(self, topic: str) -> tuple[str, ...]:
        return ()                 # the store's router computes them from the topic

    def append_batch(self, messages) -> list:
        return self.producer.append_batch(messages)

    def append(self, message):
        return self.producer.append_batch([message])[0]

    def append_batch_delayed(self, messages, due_ms) -> list:
        return self.producer.append_batch(messages, due_ms)

    def enable_delayed(self, loop) -> None:
        pass                      # the store node's timer wheel fires them

    def all_visible(self) -> bool:
        return False              # other gateways append too

    # ------------------------------------------------------------------ a packet's reads (remote_reads.py)
    def start_offset(self, queue: str) -> Answer[int]:
        return self.reads.start_offset(queue)

    def message_at(self, queue: str, offset: int) -> Answer[Any]:
        return self.reads.message_at(queue, offset)

    def replay_plan(self, flt: str, since_ms: int) -> Answer[ReplayPlan]:
        return self.reads.replay_plan(flt, since_ms)

    def _reconnected(self) -> None:
        """The link is back (maybe to another store process): a node of another version gets
        nothing (the link is dropped again with the reason, and redials); else the store learns
        first who this is, then what it watches."""
        if self.node.refuse_mismatched_node():
            return
        self.remote_metadata.hello()
        if getattr(self.link, "group", False) and self.link.address != self._member:
            # a store group's new primary: what this gateway wrote to the old one, again
            self._member = self.link.address
            self.remote_metadata.reestablish()
        self._rewatch()

    # ------------------------------------------------------------------ delivery path
    def on_new_data(self, callback: Callable[[Iterable[str]], None]) -> None:
        self._listeners.append(callback)

    def _tracked(self, q: str) -> "Answer[_Mirror]":
        """The mirror of `q`: done at once when there is one, else `q` is watched now (one request,
        shared by everyone asking meanwhile) and the answer completes with the store's reply."""
        m = self.queues.get(q)
        if m is not None:
            return Answer.of(m)
        pending = self._tracking.get(q)
        if pending is not None:
            return pending
        watch = self.watch
        req = P.Watch([q], push=True, raw=self.raw_push) if watch else P.MaxOffsets([q])

        def take(r: Any) -> _Mirror:
            self._tracking.pop(q, None)
            if watch and isinstance(r, P.WatchReply):
                self.push = r.push
            have = self.queues.get(q)               # mirrored meanwhile (a read-ahead): keep that one
            return have if have is not None else self._new_mirror(q, r.max_offsets[q])
        out = self._tracking[q] = ask(self.link, req).then(take)
        if out.done():                              # failed at once (the store away): not shared
            self._tracking.pop(q, None)
        else:
            def untrack(_a: Answer[_Mirror]) -> None:
                self._tracking.pop(q, None)
            out.add_done_callback(untrack)
        return out

    def _new_mirror(self, q: str, max_offset: int) -> _Mirror:
        m = self.queues[q] = _Mirror(max_offset)
        if self.on_track is not None:
            self.on_track(q)
        return m

    def max_offset(self, queue: str) -> Answer[int]:
        m = self.queues.get(queue)
        if m is not None:
            return Answer.of(m.end)
        return self._tracked(queue).then(_end)

    def end_offset(self, queue: str) -> Answer[int]:
        """The queue's end as the store last told it (the mirror may not hold those entries yet)."""
        m = self.queues.get(queue)
        if m is not None:
            return Answer.of(max(m.known, m.end))
        return self._tracked(queue).then(_known_end)

    def pull(self, queue: str, offset: int, max_count: int = 32, max_bytes: int = 1 << 20) -> Answer[RemotePull]:
        m = self.queues.get(queue)
        if m is None:
            # watched now; then read as from a mirror (behind it: the chunk, asked for then)
            out: Answer[RemotePull] = Answer(lambda _a, timeout: tracked._wait_quietly(timeout))
            tracked = self._tracked(queue)

            def mirrored(t: Answer[_Mirror]) -> None:
                e = t.exception()
                if e is not None:
                    out.set_exception(e)
                    return
                then = self.pull(queue, offset, max_count, max_bytes)
                out._waiter = lambda _a, timeout: then._wait_quietly(timeout)

                def answered(a: Answer[RemotePull]) -> None:
                    e = a.exception()
                    if e is not None:
                        out.set_exception(e)
                    else:
                        out.set_result(a.result())
                then.add_done_callback(answered)
            tracked.add_done_callback(mirrored)
            return out
        got = self._held(m, offset, max_count, max_bytes)
        if got is not None:
            return Answer.of(got)
        # behind the mirror and not read yet: the chunk is asked for, the answer is its arrival
        return self._read_back(queue, m, offset).then(
            lambda _none: self._held(m, offset, max_count, max_bytes) or RemotePull([], offset, m.min_offset, m.end))

    @staticmethod
    def _held(m: _Mirror, offset: int, max_count: int, max_bytes: int) -> RemotePull | None:
        """A pull answered from what mirror `m` holds, or None (behind it, not read yet)."""
        if offset >= m.end:
            return RemotePull([], offset, m.min_offset, m.end)
        if offset >= m.base:
            i = offset - m.base
            out = _within(m.items[i:i + max_count], max_bytes)
            return RemotePull(out, offset + len(out), m.min_offset, m.end)
        # behind the mirror (a lagging reader, a resumed session's backlog): the chunk read last
        if m.back_from <= offset < m.back_base + len(m.back):
            if m.back:
                i = max(0, offset - m.back_base)        # entries below back_base are gone (retention)
                out = _within(m.back[i:i + max_count], max_bytes)
                return RemotePull(out, out[-1].queue_offset + 1, m.min_offset, m.end)
            return RemotePull([], min(m.back_base, m.end), m.min_offset, m.end)   # nothing there: go on
        return None

    def _read_back(self, queue: str, m: _Mirror, offset: int) -> Answer[None]:
        """Ask for up to `fetch_batch` entries from `offset` on, not waited for: the answer is done
        when the chunk is in (it replaces the older chunk; one that reaches the mirror's start is
        joined to it), and the queue's readers are told then too. One read per queue at a time:
        a reader asking meanwhile gets the answer of the read under way. Readers behind the mirror
        read in big chunks, not a small round trip per delivery (at 20,000 msg/s into one queue a
        subscriber a few thousand messages behind would otherwise make a round trip of 32
        entries per delivery: measured, fan-in), and never stop the loop: a blocking read would
        cost every other client of the gateway a round trip per chunk of a resumed session's
        backlog. A failed answer (the store away, a read that failed): the reader asks again
        later."""
        if m.reading_back is not None and m.back_answer is not None:
            return m.back_answer                    # the read under way answers this reader too
        if not self.link.connected:
            return Answer.failed(ConnectionLost(f"store {self.link.address} unavailable: {self.link.last_error}"))
        m.reading_back = offset
        self.remote_misses += 1
        self.remote_pulls += 1
        read = ask(self.link, P.Pull(queue, offset, min(self.fetch_batch, m.base - offset), 4 << 20))
        out: Answer[None] = Answer(lambda _a, timeout: read._wait_quietly(timeout))
        m.back_answer = out

        def done(f: Answer[Any]) -> None:
            self._read_back_done(queue, m, offset, f, out)
        read.add_done_callback(done)
        return out

    def _ask_pull(self, q: str, offset: int, max_count: int, then: Callable) -> None:
        """One `gw_pull` of `q` from `offset`, not waited for (bounded as every call is): `then`
        gets the reply's future."""
        self.remote_pulls += 1
        self.node.pull(q, offset, max_count, 4 << 20).add_done_callback(then)

    def _ask_history(self, cursor: dict, max_count: int):
        """One `gw_replay_read` (a replay plan's history, RemoteReads), not waited for: a read like
        a pull (counted in `remote_pulls`, at most `fetch_batch` entries). The reply's future."""
        self.remote_pulls += 1
        return self.node.replay_read(cursor, min(max_count, self.fetch_batch))

    def _read_back_done(self, queue: str, m: _Mirror, offset: int, f: Answer[Any], out: Answer[None]) -> None:
        m.reading_back = None
        m.back_answer = None
        if self.queues.get(queue) is not m:
            out.set_result(None)                    # no longer mirrored: the reader asks again
            return
        e = f.exception()
        if e is not None:
            log.warning("event=read_behind_mirror_failed queue=%s offset=%d error=%s (asked again later)",
                        queue, offset, e)
            out.set_exception(e)
            return
        r: P.PullReply = f.result()
        m.min_offset = r.min_offset
        msgs = [it for it in entries(r) if it.queue_offset < m.base]
        self._drop_back(m)
        m.back_from = offset
        if not msgs:
            m.back_base = max(offset, r.next_offset)
        else:
            first = msgs[0].queue_offset
            if msgs[-1].queue_offset - first + 1 != len(msgs):       # not contiguous: keep the head only
                k = next(k for k in range(1, len(msgs)) if msgs[k].queue_offset != first + k)
                msgs = msgs[:k]
            self._bytes += sum([len(it.body) for it in msgs])
            m.back_base = first
            if first + len(msgs) == m.base:                        # reaches the mirror: join them
                m.items[0:0] = msgs
                m.base = first
            else:
                m.back = msgs
        out.set_result(None)                        # every reader that asked holds this answer

    # ------------------------------------------------------------------ events -> prefetch
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

        def extend(m: _Mirror, q: str, first: int, runs, sizes) -> int:
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
                n = extend(m)
                self.pushed_entries += n
                self.push_skipped += count - n
                if n:
                    added.add(q)
                    self._bound_memory(m)
            if m.known > m.end:
                self._fetch(q, m)
        if added:
            self._tell(added)

    def _extend_msgs(self, m: _Mirror, first: int, msgs: list) -> int:
        """Append `msgs` (queue offsets first, first + 1, ...) where they continue `m`, skipping
        those it holds already; nothing after a gap (pulled later). -> how many were appended."""
        skip = m.end - first
        if skip < 0 or skip >= len(msgs):
            return 0
        new = msgs[skip:] if skip else msgs
        m.items += new
        self._bytes += sum([len(x[1]) for x in new])
        return len(new)

    def _extend(self, m: _Mirror, recs: list, dqs) -> int:
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

    def _bound_memory(self, m: _Mirror) -> None:
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

    def _fetch(self, q: str, m: _Mirror) -> None:
        if m.fetching or not self.link.connected:
            return
        m.fetching = True
        start = m.end
        self._ask_pull(q, start, self.fetch_batch, lambda f, q=q, m=m, start=start: self._fetched(q, m, start, f))

    def _fetched(self, q: str, m: _Mirror, start: int, f) -> None:
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

    def _drop_back(self, m: _Mirror) -> None:
        if m.back:
            self._bytes -= sum([len(it.body) for it in m.back])
            m.back = []

    def _trim(self, m: _Mirror, drop: int) -> None:
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
        """The next POLL_SLICE queues of the round over the mirrored ones (a new round: the
        queues mirrored then)."""
        keys = self._poll_keys
        if self._poll_at >= len(keys):
            keys = self._poll_keys = list(self.queues)
            self._poll_at = 0
        part = keys[self._poll_at:self._poll_at + self.POLL_SLICE]
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


def _end(m: _Mirror) -> int:
    return m.end


def _known_end(m: _Mirror) -> int:
    return max(m.known, m.end)


__all__ = ["RemoteStore", "RemoteMetadata", "ConnectionLost", "StoreClientError", "NodeMismatch"]
