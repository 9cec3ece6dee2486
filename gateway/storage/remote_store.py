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

Everything uses one `LoopConnection` (gateway/storage/store_link.py), so the store sees this
gateway's requests in order; the gw_* commands are typed in store/node/protocol.py and sent with
its `NodeClient`. A store that does not speak this gateway's protocol version (or an embedded
`lmqtt serve`) is refused from its HELLO_OK, at start (NodeMismatch) and after every reconnect
(the link is dropped with the reason), before anything is sent to it. Events are hints: every `safety_poll_s` the gateway asks for the max
offsets of the queues it mirrors and fetches what an event missed (a lost event delays, never
loses): at most `POLL_SLICE` queues a poll, the next ones at the next poll, so a gateway whose
clients each read a queue of their own (10^5-10^6 devices, each on its own topic) spends the
same bounded work a second on it, and a missed event is found within ceil(queues / POLL_SLICE)
polls; with the native watch, where the poll is only a backstop, within about
`WATCHED_ROUND_POLLS` polls of a smaller slice. Pushed entries are taken only where they continue
a mirror (offset = its end); anything else is pulled. That side - pushes, events, prefetch, the memory bound, the safety poll - is
gateway/storage/remote_mirrors.py (`MirrorFeed`, inherited); this file answers the readers.
"""
from __future__ import annotations

import asyncio
import logging
from bisect import bisect_right
from itertools import accumulate
from operator import attrgetter
from typing import Any, Callable, Iterable

from lmqtt.gateway.storage.facades import Answer, ReplayPlan
from lmqtt.gateway.storage.node_client import NodeClient, pull_reply
from lmqtt.gateway.storage.remote_entries import BadPushedRecord, RemotePull, entries
from lmqtt.gateway.storage.remote_metadata import RemoteMetadata, ask, ask_raw, down_reason
from lmqtt.gateway.storage.remote_mirrors import READ_BEHIND, READ_HEAD, Mirror, MirrorFeed
from lmqtt.gateway.storage.remote_produce import RemoteProducer
from lmqtt.gateway.storage.remote_reads import RemoteReads
from lmqtt.gateway.storage.store_link import ConnectionLost, LoopConnection, StoreClientError
from lmqtt.store.node import protocol as P
from lmqtt.store.node.protocol import NodeMismatch

log = logging.getLogger("lmqtt.gateway.remote")
_BODY = attrgetter("body")


def _within(out: list, max_bytes: int) -> list:
    """The first entries of `out` whose bodies fit `max_bytes` (at least one; 0 = no limit).
    The sizes are summed by C-level calls: a reader behind the mirror pulls up to `fetch_batch`
    entries at a time, and a Python loop over them was ~20 % of a fleet gateway's loop in a fan-in
    whose subscriber fell behind (py-spy, `bench external --brokers lmqtt-workers`)."""
    if max_bytes and len(out) > 1:
        sizes = list(map(len, map(_BODY, out)))
        if sum(sizes) > max_bytes:
            return out[:max(bisect_right(list(accumulate(sizes)), max_bytes), 1)]
    return out


class RemoteStore(MirrorFeed):
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
        self.node = NodeClient(link)
        if link.connected:
            self.node.check()
        self.loop = link.loop
        self.gateway_id = gateway_id
        self.metrics = metrics
        self.safety_poll_s = safety_poll_s
        self.watch = watch                 # False: events come from elsewhere (Redis) or the poll
        self.raw_push = raw_push
        self._raw_refused = False          # a raw pull's record failed its check: decoded pulls from then on
        self.fetch_batch = fetch_batch
        self.queues: dict[str, Mirror] = {}
        self._tracking: dict[str, Answer[Mirror]] = {}    # queues being watched, not mirrored yet
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
                                 ask_history=self._ask_history, follow_from_start=self.watch_from_start)
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
        self.push_skipped = 0          # pushed entries not taken (already held, after a gap, readers behind)
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
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # only with the metrics port open
        st = self

        class _Collector:
            def collect(self):
                yield CounterMetricFamily("lmqtt_remote_pushed_batches",
                                          "Queues' new entries pushed by the store with an event",
                                          value=st.pushed_batches)
                yield CounterMetricFamily("lmqtt_remote_pushed_entries",
                                          "Pushed entries taken into the mirrors", value=st.pushed_entries)
                yield CounterMetricFamily("lmqtt_remote_push_skipped_entries",
                                          "Pushed entries not taken (already held; after a gap: pulled; every "
                                          "reader behind the mirror: read in chunks)",
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
        return down_reason(self.link)

    def disk_state(self) -> dict | None:
        return None               # the store node exports its own (its /metrics)

    # ------------------------------------------------------------------ the publish path (remote_produce.py)
    def queues_for_topic(self, topic: str) -> tuple[str, ...]:
        return ()                 # the store's router computes them from the topic

    def append_batch(self, messages, dispatch: bool = True) -> list:
        return self.producer.append_batch(messages)

    def dispatch_appended(self) -> None:
        pass                      # the store node dispatches what it appends

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

    def _tracked(self, q: str) -> "Answer[Mirror]":
        """The mirror of `q`: done at once when there is one, else `q` is watched now (one request,
        shared by everyone asking meanwhile) and the answer completes with the store's reply."""
        m = self.queues.get(q)
        if m is not None:
            return Answer.of(m)
        pending = self._tracking.get(q)
        if pending is not None:
            return pending
        both = self._watch(q, False)
        return self._tracking.get(q) or both.then(lambda got: got[0])

    def watch_from_start(self, q: str) -> "Answer[int] | None":
        """A new subscription's start offset in `q` (RemoteReads.start_offset) with the watch of
        `q` in the same request (`gw_watch {start: true}`): a SUBSCRIBE asks the store one thing
        less. None when `q` is mirrored or its watch is under way (the start is asked on its own)."""
        if not self.watch or q in self.queues or q in self._tracking:
            return None

        def start(got: tuple[Mirror, int]) -> int:
            self.heard({q: got[1]})   # a mirror made meanwhile (a read-ahead) fetches what it lacks
            return got[1]
        return self._watch(q, True).then(start)

    def _watch(self, q: str, start: bool) -> "Answer[tuple[Mirror, int]]":
        """Watch `q` (or without watches, read its max offset): -> its mirror and the offset the
        store answered; the mirror's answer is shared with everyone asking meanwhile."""
        watch = self.watch
        req = P.Watch([q], push=True, raw=self.raw_push, start=start) if watch else P.MaxOffsets([q])

        def take(r: Any) -> tuple[Mirror, int]:
            self._tracking.pop(q, None)
            if watch and isinstance(r, P.WatchReply):
                self.push = r.push
            at = r.max_offsets[q]
            have = self.queues.get(q)               # mirrored meanwhile (a read-ahead): keep that one
            return (have if have is not None else self._new_mirror(q, at)), at
        both = ask(self.link, req).then(take)
        out = self._tracking[q] = both.then(lambda got: got[0])
        if out.done():                              # failed at once (the store away): not shared
            self._tracking.pop(q, None)
        else:
            def untrack(_a: Answer[Mirror]) -> None:
                self._tracking.pop(q, None)
            out.add_done_callback(untrack)
        return both

    def _new_mirror(self, q: str, max_offset: int) -> Mirror:
        m = self.queues[q] = Mirror(max_offset)
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
            out: Answer[RemotePull] = Answer(lambda _a, timeout: tracked.wait_quietly(timeout))
            tracked = self._tracked(queue)

            def mirrored(t: Answer[Mirror]) -> None:
                e = t.exception()
                if e is not None:
                    out.set_exception(e)
                    return
                out.follow(self.pull(queue, offset, max_count, max_bytes))
            tracked.add_done_callback(mirrored)
            return out
        m.reads |= READ_HEAD if offset >= m.base else READ_BEHIND
        got = self._held(m, offset, max_count, max_bytes)
        if got is not None:
            if offset < m.base and m.back:
                self._read_ahead(queue, m, got.next_offset)
            return Answer.of(got)
        # behind the mirror and not read yet: the chunk is asked for, the answer is its arrival
        other = m.reading_back is not None and m.reading_back != offset
        read = self._read_back(queue, m, offset)
        if not other:
            return read.then(
                lambda _none: self._held(m, offset, max_count, max_bytes) or RemotePull([], offset, m.min_offset, m.end))
        # the read under way is another reader's (or a read ahead): when it is in and does not
        # hold this offset, this reader asks for its own (an empty answer would leave it waiting
        # for news of the queue, which may never come: a quiet queue)
        own: Answer[RemotePull] = Answer(lambda _a, timeout: read.wait_quietly(timeout))

        def then(a: Answer[None]) -> None:
            e = a.exception()
            if e is not None:
                own.set_exception(e)
                return
            got = self._held(m, offset, max_count, max_bytes)
            if got is not None or self.queues.get(queue) is not m:
                own.set_result(got or RemotePull([], offset, m.min_offset, m.end))
                return
            own.follow(self.pull(queue, offset, max_count, max_bytes))
        read.add_done_callback(then)
        return own

    @staticmethod
    def _held(m: Mirror, offset: int, max_count: int, max_bytes: int) -> RemotePull | None:
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
                out = m.back[i:i + max_count]
                if m.back_bytes > max_bytes:            # the whole chunk fits: nothing to count
                    out = _within(out, max_bytes)
                return RemotePull(out, out[-1].queue_offset + 1, m.min_offset, m.end)
            return RemotePull([], min(m.back_base, m.end), m.min_offset, m.end)   # nothing there: go on
        return None

    def _read_back(self, queue: str, m: Mirror, offset: int) -> Answer[None]:
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
            return Answer.failed(ConnectionLost(down_reason(self.link)))
        m.reading_back = offset
        self.remote_misses += 1
        self.remote_pulls += 1
        raw = self.raw_push and not self._raw_refused
        req = P.Pull(queue, offset, min(self.fetch_batch, m.base - offset), 4 << 20, raw)
        if raw:
            # as the store's record bytes, decoded here as pushes are (the store neither decodes
            # nor re-encodes them); a record failing its check: the decoded reply from then on
            ident = self.link.server_info.get("ident") or ""
            read = ask_raw(self.link, req.cmd, req.to_wire(), lambda op, body: pull_reply(op, body, ident))
        else:
            read = ask(self.link, req)
        out: Answer[None] = Answer(lambda _a, timeout: read.wait_quietly(timeout))
        m.back_answer = out

        def done(f: Answer[Any]) -> None:
            self._read_back_done(queue, m, offset, f, out)
        read.add_done_callback(done)
        return out

    def _read_ahead(self, queue: str, m: Mirror, next_offset: int) -> None:
        """A reader in the chunk behind the mirror (`next_offset`: where it goes on) past the
        chunk's middle: the next chunk is asked for now, so it is in when the reader gets there.
        Without it a reader behind waited a round trip per chunk and, slower than the queue grew,
        never left the chunks: in a fan-in whose subscriber fell 32k entries behind, 1.3M of 2M
        messages were read this way, at ~80 % of the rate of the runs that stayed in the mirror."""
        m.back_next = next_offset
        end = m.back_base + len(m.back)
        if m.reading_back is None and end < m.base and 2 * (next_offset - m.back_base) >= len(m.back):
            self._read_back(queue, m, end)

    def _ask_history(self, cursor: dict, max_count: int):
        """One `gw_replay_read` (a replay plan's history, RemoteReads), not waited for: a read like
        a pull (counted in `remote_pulls`, at most `fetch_batch` entries). The reply's future."""
        self.remote_pulls += 1
        return self.node.replay_read(cursor, min(max_count, self.fetch_batch))

    def _read_back_done(self, queue: str, m: Mirror, offset: int, f: Answer[Any], out: Answer[None]) -> None:
        m.reading_back = None
        m.back_answer = None
        if self.queues.get(queue) is not m:
            out.set_result(None)                    # no longer mirrored: the reader asks again
            return
        e = f.exception()
        if e is not None:
            if isinstance(e, BadPushedRecord):
                self._raw_refused = True
            log.warning("event=read_behind_mirror_failed queue=%s offset=%d error=%s (asked again later)",
                        queue, offset, e)
            out.set_exception(e)
            return
        r = f.result()
        if r.min_offset is not None:
            m.min_offset = r.min_offset
        msgs = entries(r)
        if msgs and msgs[-1].queue_offset >= m.base:     # (offsets ascend: most chunks end below it)
            msgs = [it for it in msgs if it.queue_offset < m.base]
        back = m.back
        if back and msgs and offset == m.back_base + len(back) == msgs[0].queue_offset:
            # read ahead (_read_ahead): the chunk continues the one a reader is in, which keeps
            # the entries from that reader on
            k = max(0, min(len(back), m.back_next - m.back_base))
            offset = m.back_base + k
            msgs = back[k:] + msgs
        self._drop_back(m)
        m.back_from = offset
        if not msgs:
            m.back_base = max(offset, r.next_offset)
        else:
            first = msgs[0].queue_offset
            if msgs[-1].queue_offset - first + 1 != len(msgs):       # not contiguous: keep the head only
                k = next(k for k in range(1, len(msgs)) if msgs[k].queue_offset != first + k)
                msgs = msgs[:k]
            nbytes = sum([len(it.body) for it in msgs])
            self._bytes += nbytes
            m.back_base = first
            if first + len(msgs) == m.base:                        # reaches the mirror: join them
                m.items[0:0] = msgs
                m.base = first
            else:
                m.back = msgs
                m.back_bytes = nbytes
        out.set_result(None)                        # every reader that asked holds this answer


def _end(m: Mirror) -> int:
    return m.end


def _known_end(m: Mirror) -> int:
    return max(m.known, m.end)


__all__ = ["RemoteStore", "RemoteMetadata", "ConnectionLost", "StoreClientError", "NodeMismatch"]
