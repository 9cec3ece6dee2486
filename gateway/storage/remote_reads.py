"""`RemoteReads`: the `QueueStore` reads a SUBSCRIBE or a resumed session's CONNECT makes before
it is decided (start offsets, messages in flight, replay plans), over the store's native protocol
(docs/fleet.md). `RemoteStore` (gateway/storage/remote_store.py) composes it: its methods of that
kind call this one's.

Each returns an `Answer` at once: the request is sent now (after a watch of the queue when it is
not mirrored yet: live reads follow from where the answer stands) and the answer completes with
the store's reply, never a blocking call on the loop. What a caller asks in one loop turn leaves
in one send (the link's), so a SUBSCRIBE that asks for all its answers (the registry's
`prepare`: filter holds, start offsets, replay plans, retained messages) and then waits for them
together makes one round trip, and only its connection waits. A replay plan's history is read in
chunks asked for without waiting (`ReplayPlan.read_later`).
"""
from __future__ import annotations

from typing import Any, Callable

from lmqtt.gateway.storage.facades import Answer, ReplayPlan, ReplayRefused
from lmqtt.gateway.storage.remote_metadata import ask
from lmqtt.gateway.storage.store_link import LoopConnection, StoreClientError
from lmqtt.store.node import protocol as P


class RemoteReads:
    """A SUBSCRIBE's and a resumed session's reads (see the module docstring). It does not hold
    the mirror, only what it needs of it:
      * `heard(offsets)`     the store says these queues reach these max offsets;
      * `follow(q)`          mirror and watch q if it is not (`max_offset`: an Answer, done at
                             once when q is mirrored);
      * `follow_from_start(q)`  the same in one request with q's start offset when q is neither
                             mirrored nor being watched (`watch_from_start`: an Answer, else None);
      * `decode(reply)`      a `gw_pull` / `gw_replay_read` reply -> its entries;
      * `ask_history(cursor, max_count)`  one `gw_replay_read`, not waited for (counted and
                             bounded as the mirror's reads are): the reply's future.
    """

    def __init__(self, link: LoopConnection, *, heard: Callable[[dict], None],
                 follow: Callable[[str], Answer[int]], decode: Callable[[Any], list],
                 ask_history: Callable[[dict, int], Any],
                 follow_from_start: Callable[[str], "Answer[int] | None"] = lambda _q: None) -> None:
        self.link = link
        self.loop = link.loop
        self.heard = heard
        self.follow = follow
        self.follow_from_start = follow_from_start
        self.decode = decode
        self.ask_history = ask_history

    def start_offset(self, queue: str) -> Answer[int]:
        """The store's max offset once what was acknowledged before now is dispatched, asked for
        after the watch of a queue not mirrored yet (the mirror may not have heard of the newest
        entries yet, and a subscription started at its end would get them as new messages). A
        queue not watched yet is watched and answered in one request (`follow_from_start`)."""
        merged = self.follow_from_start(queue)
        if merged is not None:
            return merged
        followed = self.follow(queue)
        asked = ask(self.link, P.StartOffsets([queue]))

        def got(both: list) -> int:
            start = both[1].max_offsets[queue]
            self.heard({queue: start})  # fetch what the mirror lacks (its event may still be on the way)
            return start
        return Answer.gather([followed, asked]).then(got)

    def message_at(self, queue: str, offset: int) -> Answer[Any]:
        """The entry at `offset` of `queue`: one `gw_pull` of it (None when it is no longer stored)."""
        def found(r: P.PullReply) -> Any:
            return next((m for m in self.decode(r) if m.queue_offset == offset), None)
        return ask(self.link, P.Pull(queue, offset, 1, 16 << 20)).then(found)

    # ------------------------------------------------------------------ subscribing from the past
    def replay_plan(self, flt: str, since_ms: int) -> Answer[ReplayPlan]:
        """`gw_replay`, asked for after the watch of `flt` so live reads follow the plan (answered
        once the store's dispatch passed its log end); a refusal of the store is a `ReplayRefused`
        answer. The history is read with `gw_replay_read`, chunks of up to
        `RemoteStore.fetch_batch` messages asked for without waiting, the next while the gateway
        sends one (`ReplayPlan.read_later`)."""
        followed = self.follow(flt)
        asked = ask(self.link, P.Replay(flt, int(since_ms)))

        def waiter(_a: Answer[ReplayPlan], timeout: float | None) -> None:
            for a in (followed, asked):
                a.wait_quietly(timeout)
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
