"""`RemoteReads`: what a SUBSCRIBE or a resumed session's CONNECT reads from the store before it
is decided, and this gateway's wildcard filter holds, over the store's native protocol (docs/fleet.md).
`RemoteStore` (gateway/storage/remote_store.py) composes it: its `QueueStore` methods of that kind
(`read_ahead`, `using`, `start_offset`, `message_at`, `replay_plan`) call this one's, and the
`FilterRegistry` and `OffsetStore` facades of a remote store (remote_metadata.py) answer a
registration and a committed offset from the open read-ahead (`registered_ahead`,
`offset_read_ahead`).

What each call costs (all on the gateway's one `LoopConnection`, in order with its other requests):
  * read_ahead     everything a packet will read (registrations, watches of queues not mirrored
                   yet, start offsets, committed offsets, replay plans, messages in flight,
                   retained messages) asked for in one pipeline, not waited for: a future of the
                   `ReadAhead`; only that connection waits (docs/fleet.md).
  * using          the context `read_ahead` answers: while the packet is decided in it,
                   `RemoteFilters.register`, `start_offset`, `replay_plan`, the offsets and
                   retained facades' reads and `message_at` answer from the read-ahead (answers
                   done at once); what nothing took is released after.
  * otherwise      start_offset, replay_plan, message_at: the request is sent now (with a watch
                   of the queue when it is not mirrored yet) and the `Answer` completes with the
                   store's reply, never a blocking call; what a caller asks in one loop turn
                   leaves in one send (the link's), so a SUBSCRIBE that asks for all its answers
                   and then waits for them together makes one round trip. The filter
                   registrations: an `Answer` each (`register_all`: `REGISTER_CHUNK` filters per
                   round trip, all sent at once); a replay plan's history: chunks asked for
                   without waiting (`ReplayPlan.read_later`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

from lmqtt.gateway.storage.facades import Answer, ReadAhead, ReplayPlan, ReplayRefused, StoreReads
from lmqtt.gateway.storage.remote_metadata import ask
from lmqtt.store.client.aio import LoopConnection, StoreClientError
from lmqtt.store.node import protocol as P


class RemoteReads:
    """A packet's reads ahead and the filter holds of one gateway (see the module docstring).

    Separate from `RemoteStore` because it is a second job: the store keeps the newest entries of
    the queues it serves (its mirrors); this asks ahead for what a SUBSCRIBE or CONNECT will need
    and holds the answers only while that packet is decided. It does not hold the mirror, only
    what it needs of it:
      * `mirrored(q)`        whether queue q is mirrored already;
      * `track_later(qs)`    watch queues not mirrored yet, asked for now: -> (the reply's future,
                             `take()`, which mirrors them from it once every read came in);
      * `heard(offsets)`     the store says these queues reach these max offsets;
      * `follow(q)`          mirror and watch q if it is not (`max_offset`: an Answer, done at
                             once when q is mirrored);
      * `decode(reply)`      a `gw_pull` / `gw_replay_read` reply -> its entries;
      * `ask_history(cursor, max_count)`  one `gw_replay_read`, not waited for (counted and
                             bounded as the mirror's reads are): the reply's future.
    """

    def __init__(self, link: LoopConnection, gateway_id: str, *, mirrored: Callable[[str], bool],
                 track_later: Callable[[list], tuple[Any, Callable[[], None]]],
                 heard: Callable[[dict], None], follow: Callable[[str], Answer[int]],
                 decode: Callable[[Any], list], ask_history: Callable[[dict, int], Any]) -> None:
        self.link = link
        self.node = P.NodeClient(link)
        self.loop = link.loop
        self.gateway_id = gateway_id
        self.mirrored = mirrored
        self.track_later = track_later
        self.heard = heard
        self.follow = follow
        self.decode = decode
        self.ask_history = ask_history
        self._ahead: ReadAhead | None = None   # a SUBSCRIBE's answers while it is decided (`using`)

    # ------------------------------------------------------------------ a SUBSCRIBE's reads
    def read_ahead(self, reads: StoreReads) -> Answer:
        """`QueueStore.read_ahead`: an Answer of the context (`using`) of `ask_ahead`'s `ReadAhead`;
        done at once with a context that does nothing when there is nothing to ask for."""
        fut = self.ask_ahead(reads)
        if fut is None:
            return Answer.of(contextlib.nullcontext())
        out: Answer = Answer()

        def done(f) -> None:
            if f.cancelled():
                out.set_exception(ConnectionError("the store's read-ahead was cancelled"))
            elif f.exception() is not None:
                out.set_exception(f.exception())
            else:
                out.set_result(self.using(f.result()))
        fut.add_done_callback(done)
        return out

    def ask_ahead(self, reads: StoreReads):
        """Ask for everything `reads` names in one pipeline, in the order the blocking calls would
        have gone (registrations, watches of queues not mirrored yet, start offsets, committed
        offsets, replay plans, retained messages: the retained read comes after the start offsets,
        so a retained message set in between is delivered live, never lost; a replay plan after
        its queue is watched, so live reads follow it); a future of the `ReadAhead`. A replay plan
        the store refuses refuses that subscription only; any other failure fails them all."""
        register, watch, start, retained, offsets, replay, messages = reads
        node = self.node
        track = [q for q in dict.fromkeys([*watch, *start]) if not self.mirrored(q)]
        offsets = list(dict.fromkeys(offsets))
        replay = list(dict.fromkeys((f, int(since)) for f, since in replay))
        spans: dict[str, list[int]] = {}          # queue -> [first, last] offset wanted
        for q, off in messages:
            sp = spans.setdefault(q, [off, off])
            sp[0], sp[1] = min(sp[0], off), max(sp[1], off)
        if not (register or track or start or retained or offsets or replay or spans):
            return None
        regs = [node.register(self.gateway_id, f) for f in register]
        watching, take = self.track_later(track) if track else (None, None)
        starts = node.start_offsets(list(dict.fromkeys(start))) if start else None
        offs = [node.get_offset(c, q) for c, q in offsets]
        plans = [node.replay(f, since) for f, since in replay]
        pulls = [node.pull(q, a, b - a + 1, 16 << 20) for q, (a, b) in spans.items()]
        rets = [node.retained_matching(f) for f in retained]
        futs = [*regs, *([watching] if watching else []), *([starts] if starts else []), *offs, *plans, *pulls,
                *rets]
        out = self.loop.create_future()

        def failure(f):
            e = f.exception()
            # the store refusing one replay plan (outside retention...) is that plan's answer
            return None if e is None or (f in plans and isinstance(e, StoreClientError)) else e

        def done(f1) -> None:
            if not f1.cancelled():
                f1.exception()
            if out.done() or not all(f.done() for f in futs):
                return
            bad = next((e for e in map(failure, futs) if e is not None), None)
            registered = {f: r.result().count for f, r in zip(register, regs) if r.exception() is None}
            if bad is not None:
                # what was registered is not left held: nothing will take it now
                for f in registered:
                    self._release(f)
                out.set_exception(bad)
                return
            if take is not None:
                take()                             # the new mirrors (one mirrored meanwhile is kept)
            out.set_result(ReadAhead(
                registered,
                dict(starts.result().max_offsets) if starts else {},
                {f: list(r.result().retained) for f, r in zip(retained, rets)},
                {k: r.result().offset for k, r in zip(offsets, offs)},
                {k: (r.exception() or r.result()) for k, r in zip(replay, plans)},
                {(q, m.queue_offset): m for q, r in zip(spans, pulls) for m in self.decode(r.result())}))
        for f in futs:
            f.add_done_callback(done)
        return out

    def start_offset(self, queue: str) -> Answer[int]:
        """The store's max offset once what was acknowledged before now is dispatched (read ahead,
        else asked for now, after the watch of a queue not mirrored yet: the mirror may not have
        heard of the newest entries yet, and a subscription started at its end would get them as
        new messages)."""
        followed = self.follow(queue)
        ahead = self._ahead
        off = ahead.start.pop(queue, None) if ahead is not None else None
        if off is not None and followed.done():
            self.heard({queue: off})    # fetch what the mirror lacks (its event may still be on the way)
            return Answer.of(off)
        asked = Answer.of(off) if off is not None else ask(self.link, P.StartOffsets([queue]))

        def got(both: list) -> int:
            r = both[1]
            start = r if isinstance(r, int) else r.max_offsets[queue]
            self.heard({queue: start})
            return start
        return Answer.gather([followed, asked]).then(got)

    def message_at(self, queue: str, offset: int) -> Answer[Any]:
        """The entry at `offset` of `queue`: from the open read-ahead, else one `gw_pull` of it
        (None when it is no longer stored)."""
        ahead = self._ahead
        if ahead is not None and (queue, offset) in ahead.messages:
            return Answer.of(ahead.messages.pop((queue, offset)))

        def found(r: P.PullReply) -> Any:
            return next((m for m in self.decode(r) if m.queue_offset == offset), None)
        return ask(self.link, P.Pull(queue, offset, 1, 16 << 20)).then(found)

    def offset_read_ahead(self, consumer: str, queue: str) -> tuple[bool, int | None]:
        ahead = self._ahead
        if ahead is None or (consumer, queue) not in ahead.offsets:
            return False, None
        off = ahead.offsets.pop((consumer, queue))
        return True, None if off is None else int(off)

    @contextlib.contextmanager
    def using(self, ahead: ReadAhead | None):
        if ahead is None:
            yield None
            return
        self._ahead = ahead
        try:
            yield ahead
        finally:
            self._ahead = None
            for f in ahead.registered:          # registered ahead, not taken (refused, or held already)
                self._release(f)
            ahead.registered.clear()
            if ahead.start:                     # queue ends read ahead, not taken: still news of them
                self.heard(ahead.start)
                ahead.start.clear()

    def retained_ahead(self, flt: str) -> list | None:
        """`flt`'s retained messages as the open read-ahead has them (taken), or None."""
        ahead = self._ahead
        if ahead is not None and flt in ahead.retained:
            return ahead.retained.pop(flt)
        return None

    def registered_ahead(self, flt: str) -> int | None:
        """`flt`'s hold count as the open read-ahead registered it (taken), or None."""
        ahead = self._ahead
        if ahead is not None and flt in ahead.registered:
            return ahead.registered.pop(flt)
        return None

    def _release(self, flt: str) -> None:
        self.node.send(P.Unregister(self.gateway_id, flt))

    # ------------------------------------------------------------------ subscribing from the past
    def replay_plan(self, flt: str, since_ms: int) -> Answer[ReplayPlan]:
        """`gw_replay` (read ahead with the SUBSCRIBE, else asked for now, after the watch of `flt`
        so live reads follow the plan; answered once the store's dispatch passed its log end); a
        refusal of the store is a `ReplayRefused` answer. The history is read with
        `gw_replay_read`, chunks of up to `RemoteStore.fetch_batch` messages asked for without
        waiting, the next while the gateway sends one (`ReplayPlan.read_later`)."""
        ahead = self._ahead
        key = (flt, int(since_ms))
        if ahead is not None and key in ahead.replay:
            plan = ahead.replay.pop(key)
            if isinstance(plan, StoreClientError):
                return Answer.failed(ReplayRefused(plan.reason))
            return Answer.of(ReplayPlan(plan.plan(), read_later=self._read_history))
        followed = self.follow(flt)              # mirrored and watched before the plan: live reads follow
        asked = ask(self.link, P.Replay(flt, int(since_ms)))

        def waiter(_a: Answer[ReplayPlan], timeout: float | None) -> None:
            for a in (followed, asked):
                a._wait_quietly(timeout)
        out: Answer[ReplayPlan] = Answer(waiter)

        def done(_a: Answer[Any]) -> None:
            if not (followed.done() and asked.done()) or out.done():
                return
            e = asked.exception() or followed.exception()
            if isinstance(e, StoreClientError):
                out.set_exception(ReplayRefused(e.reason))
            elif e is not None:
                out.set_exception(e)
            else:
                try:
                    out.set_result(ReplayPlan(asked.result().plan(), read_later=self._read_history))
                except Exception as bad:  # noqa: BLE001 - a reply we cannot read fails this plan only
                    out.set_exception(bad)
        followed.add_done_callback(done)
        asked.add_done_callback(done)
        return out

    def _read_history(self, cursor: dict, max_count: int):
        """One chunk of a replay plan's history, asked for now: a future of (messages, cursor, done)."""
        fut = self.ask_history(cursor, max_count)
        out = self.loop.create_future()

        def done(f) -> None:
            if f.exception() is not None:
                out.set_exception(f.exception())
                return
            try:
                r: P.ReplayReadReply = f.result()
                out.set_result((self.decode(r), r.cursor, r.done))
            except Exception as e:  # noqa: BLE001 - a reply we cannot read fails this read only
                out.set_exception(e)
        fut.add_done_callback(done)
        return out


__all__ = ["RemoteReads"]
