"""The light queues of a gateway over several store groups (docs/groups.md "The gateway"): one
`RemoteStore` per group, each message appended to the group owning its topic's first level, each
queue read from the group owning its filter's first level.

Appends keep two orders the one-group store kept by itself. A tick's batch is split per group
(one PRODUCE each, sent together) and its durable future completes once every part is durable
**and** the previous batch's future completed: PUBACKs leave in the order the PUBLISHes came
(MQTT-4.6.0-2), though two groups answer independently. A batch with a first level whose owner
is being claimed waits for the claim, and every batch after it waits behind it, so a topic's
messages reach their group in order.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Iterable

from lmqtt.gateway.storage.facades import Answer
from lmqtt.gateway.storage.grouped_metadata import SpansGroups, chain
from lmqtt.gateway.storage.remote_produce import AppendResult
from lmqtt.gateway.storage.topic_owners import TopicOwners, filter_first_level, first_level


class GroupedQueues:
    """`QueueStore` over `stores` (each a `RemoteStore`, in `--store` order)."""

    def __init__(self, owners: TopicOwners, stores: list[Any], loop: asyncio.AbstractEventLoop) -> None:
        self.owners = owners
        self.stores = stores
        self.loop = loop
        self._last: asyncio.Future | None = None      # the previous batch's durable future
        # batches waiting for claims: (messages, due times, durable future, the claims or None)
        self._behind: list[tuple[list, list | None, asyncio.Future, Answer[None] | None]] = []

    # ------------------------------------------------------------------ lifecycle, state
    def start(self) -> None:
        for s in self.stores:
            s.start()

    def close(self) -> None:
        for s in self.stores:
            s.close()

    def unavailable(self) -> str | None:
        """The first group's (sessions and the topic table live there): while another group is
        away its topics' publishes fail and its subscriptions wait, the others go on."""
        return self.stores[0].unavailable()

    def disk_state(self) -> dict | None:
        return None

    @property
    def is_served(self) -> Callable[[str], bool] | None:
        return self.stores[0].is_served

    @is_served.setter
    def is_served(self, fn: Callable[[str], bool] | None) -> None:
        for s in self.stores:
            s.is_served = fn

    @property
    def queues(self) -> dict:
        """Every group's mirrors (a queue lives in one group)."""
        return {q: m for s in self.stores for q, m in s.queues.items()}

    def __getattr__(self, name: str) -> Any:
        # counters for /metrics (remote_pulls, events, polls, ...) summed over the groups; anything
        # else a caller reads of a RemoteStore (gateway_id, link, ...) is the first group's
        stores = self.__dict__.get("stores")
        if not stores:
            raise AttributeError(name)
        values = [getattr(s, name) for s in stores]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            return sum(values)
        return values[0]

    @staticmethod
    def spans_groups(flt: str) -> bool:
        """A filter whose first level is a wildcard matches topics of every group: not served
        in this version (the subscribe is refused, SUBACK 0xA2)."""
        return filter_first_level(flt) is None

    # ------------------------------------------------------------------ the publish path
    def queues_for_topic(self, topic: str) -> tuple[str, ...]:
        return ()

    def enable_delayed(self, loop) -> None:
        pass

    def all_visible(self) -> bool:
        return False

    def append(self, message):
        return self.append_batch([message])[0]

    def append_batch(self, messages) -> list:
        return self._append(list(messages), None)

    def append_batch_delayed(self, messages, due_ms) -> list:
        return self._append(list(messages), list(due_ms))

    def _append(self, messages: list, dues: list | None) -> list:
        for s in self.stores:       # a message no group can take: refused before anything is sent
            s.producer.check(messages)
        fut = self.loop.create_future()
        firsts = {first_level(m.topic) for m in messages}
        unknown = [f for f in firsts if self.owners.known(f) is None]
        if unknown or self._behind:
            claims = None
            if unknown:
                claims = Answer.all_in([self.owners.owner(f) for f in unknown])
                claims.add_done_callback(lambda _a: self._send_behind())
            self._behind.append((messages, dues, fut, claims))
        else:
            self._send(messages, dues, fut)
        return [AppendResult(fut)]

    def _send_behind(self) -> None:
        """Send the batches that waited, in order, up to one whose claims are not answered yet
        (their answer calls this again). A batch whose claim failed (the directory away) fails
        with the reason, in its turn: its publishers get the error, the next batches go on."""
        while self._behind:
            messages, dues, fut, claims = self._behind[0]
            if claims is not None and not claims.done():
                return
            self._behind.pop(0)
            unknown = sorted({first_level(m.topic) for m in messages} - set(self.owners.owned()))
            if unknown:
                prev = self._last
                self._last = fut
                self._after(prev, [], fut, ConnectionError(
                    f"the owner of topic {unknown[0]!r} could not be learnt from the first store group "
                    f"({self.owners.directory.address}): not stored"))
                continue
            self._send(messages, dues, fut)

    def _send(self, messages: list, dues: list | None, fut: asyncio.Future) -> None:
        parts: dict[int, tuple[list, list]] = {}
        for k, m in enumerate(messages):
            at = self.owners.known(first_level(m.topic))
            assert at is not None
            p = parts.setdefault(at, ([], []))
            p[0].append(m)
            if dues is not None:
                p[1].append(dues[k])
        durables = []
        for at, (ms, ds) in parts.items():
            st = self.stores[at]
            res = st.append_batch(ms) if dues is None else st.append_batch_delayed(ms, ds)
            durables.append(res[-1].durable)
        prev = self._last
        self._last = fut
        self._after(prev, durables, fut, None)

    def _after(self, prev: asyncio.Future | None, durables: list, fut: asyncio.Future,
               error: BaseException | None) -> None:
        """`fut` completes once `prev` and every one of `durables` did: with the first error."""
        waits = [f for f in ([prev] if prev is not None else []) + durables if not f.done()]
        left = [len(waits)]

        def settle() -> None:
            if fut.done():
                return
            err = error
            for f in durables:
                if err is None and f.done() and not f.cancelled() and f.exception() is not None:
                    err = f.exception()
            if err is not None:
                fut.set_exception(err)
            else:
                fut.set_result(None)

        def one(_f) -> None:
            left[0] -= 1
            if not left[0]:
                settle()
        if not waits:
            settle()
            return
        for f in waits:
            f.add_done_callback(one)

    # ------------------------------------------------------------------ reads
    def _at(self, queue: str, call: Callable[[Any], Answer[Any]]) -> Answer[Any]:
        first = filter_first_level(queue)
        if first is None:
            return Answer.failed(SpansGroups(f"queue {queue!r} spans every store group"))
        return chain(self.owners.owner(first), lambda i: call(self.stores[i]))

    def max_offset(self, queue: str) -> Answer[int]:
        return self._at(queue, lambda s: s.max_offset(queue))

    def end_offset(self, queue: str) -> Answer[int]:
        return self._at(queue, lambda s: s.end_offset(queue))

    def start_offset(self, queue: str) -> Answer[int]:
        return self._at(queue, lambda s: s.start_offset(queue))

    def pull(self, queue: str, offset: int, max_count: int = 32, max_bytes: int = 1 << 20) -> Answer[Any]:
        return self._at(queue, lambda s: s.pull(queue, offset, max_count, max_bytes))

    def message_at(self, queue: str, offset: int) -> Answer[Any]:
        return self._at(queue, lambda s: s.message_at(queue, offset))

    def replay_plan(self, flt: str, since_ms: int) -> Answer[Any]:
        return self._at(flt, lambda s: s.replay_plan(flt, since_ms))

    def on_new_data(self, callback: Callable[[Iterable[str]], None]) -> None:
        for s in self.stores:
            s.on_new_data(callback)
