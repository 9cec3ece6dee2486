"""The light queues of a gateway over several store groups (docs/groups.md "The gateway"): one
`RemoteStore` per group, each message appended to the group owning its topic's first level, each
queue read from the group owning its filter's first level. A filter whose first level is a
wildcard is one queue per group (`parts`: "#" is "#" in the first group and "#", NUL, i in
group i; topic_owners.py `part_name`): the reads of a part go to its group under the filter's own
name, and what a group says of its queues (their events, the dispatch queues of its records) comes
back under the part names of that group.

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
from lmqtt.gateway.storage.grouped_metadata import chain
from lmqtt.gateway.storage.remote_entries import RemoteMessage
from lmqtt.gateway.storage.remote_produce import AppendResult
from lmqtt.gateway.storage.topic_owners import (
    TopicOwners, filter_first_level, first_level, part_name, spanning, split_part)


def _parts_named(msgs: list, i: int) -> list:
    """Pulled records of group `i` (> 0) with the spanning queues among their dispatch queues under
    group `i`'s part names (the engine resolves overlapping subscriptions by those names). A
    RemoteMessage is renamed in place (its group's mirror holds it: the same names every time), a
    StoredMessage (immutable) replaced. Every record of every read of such a group passes here:
    the test is a queue name's first character (a spanning filter starts with a wildcard level,
    a topic never has one), a part already renamed has the NUL."""
    out = msgs
    for k, m in enumerate(msgs):
        dq = m.dispatch_queues
        if not dq:
            continue
        for q in dq:
            if q[:1] in _WILD and spanning(q):
                break
        else:
            continue
        named = tuple(part_name(q, i) if spanning(q) else q for q in dq)
        if isinstance(m, RemoteMessage):
            m.dispatch_queues = named
        else:
            if out is msgs:
                out = list(msgs)
            out[k] = m._replace(dispatch_queues=named)
    return out


_WILD = "+#"
_MAX_ROUTES = 200_000       # GroupedQueues._routes kept at most


def _pulled_named(r: Any, i: int) -> Any:
    """A pull's result with its records named as group `i`'s parts (`_parts_named`); the result
    itself when nothing was renamed, or only in place."""
    msgs = _parts_named(r.messages, i)
    return r if msgs is r.messages else r._replace(messages=msgs)


class GroupedQueues:
    """`QueueStore` over `stores` (each a `RemoteStore`, in `--store` order)."""

    def __init__(self, owners: TopicOwners, stores: list[Any], loop: asyncio.AbstractEventLoop) -> None:
        self.owners = owners
        self.stores = stores
        self.loop = loop
        self._last: asyncio.Future | None = None      # the previous batch's durable future
        # batches waiting for claims: (messages, due times, durable future, the claims or None)
        self._behind: list[tuple[list, list | None, asyncio.Future, Answer[None] | None]] = []
        # queue name as the gateway knows it -> (its group, the group's name of it), for each queue
        # whose group is known (a first level's owner never changes): every delivery pulls its
        # queue, and working the route out each time cost as much as the read from the mirror
        self._routes: dict[str, tuple[int, str]] = {}

    # ------------------------------------------------------------------ lifecycle, state
    def start(self) -> None:
        for s in self.stores:
            s.start()

    def close(self) -> None:
        for s in self.stores:
            s.close()

    def unavailable(self) -> str | None:
        """The first group's (the topic table lives there): while another group is away its
        topics' publishes fail, its subscriptions wait and its sessions' loads fail (a CONNECT
        resuming one is refused as the store being away), the others go on."""
        return self.stores[0].unavailable()

    def disk_state(self) -> dict | None:
        return None

    @property
    def is_served(self) -> Callable[[str], bool] | None:
        return self.stores[0].is_served

    @is_served.setter
    def is_served(self, fn: Callable[[str], bool] | None) -> None:
        for i, s in enumerate(self.stores):
            s.is_served = fn if fn is None or i == 0 else self._named(fn, i)

    @staticmethod
    def _named(fn: Callable[[str], Any], i: int) -> Callable[[str], Any]:
        """`fn` of a queue name as the gateway knows it, for group `i`'s own names."""
        return lambda q: fn(part_name(q, i) if spanning(q) else q)

    @property
    def queues(self) -> dict:
        """Every group's mirrors, by the gateway's names of their queues."""
        return {(part_name(q, i) if i and spanning(q) else q): m
                for i, s in enumerate(self.stores) for q, m in s.queues.items()}

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

    def parts(self, flt: str) -> tuple[str, ...]:
        """The queues a subscription of `flt` reads: one per group for a filter whose first level
        is a wildcard (direct, shared or from the past: each part in its group), else `flt`
        itself (its first level's group)."""
        if filter_first_level(flt) is not None:
            return (flt,)
        return tuple(part_name(flt, i) for i in range(len(self.stores)))

    # ------------------------------------------------------------------ the publish path
    def queues_for_topic(self, topic: str) -> tuple[str, ...]:
        return ()

    def enable_delayed(self, loop) -> None:
        pass

    def all_visible(self) -> bool:
        return False

    def append(self, message):
        return self.append_batch([message])[0]

    def append_batch(self, messages, dispatch: bool = True) -> list:
        return self._append(list(messages), None)

    def dispatch_appended(self) -> None:
        pass                      # each group's store node dispatches what it appends

    def append_batch_delayed(self, messages, due_ms) -> list:
        return self._append(list(messages), list(due_ms))

    def _append(self, messages: list, dues: list | None) -> list:
        # a message no group can take is refused before anything is sent: the smallest limit
        min(self.stores, key=lambda s: s.producer.max_message_size).producer.check(messages)
        fut = self.loop.create_future()
        if not self._behind:
            # one pass: each message's group from the first levels known (every one, nearly always)
            owned = self.owners.owned()
            parts: dict[int, tuple[list, list]] = {}
            for k, m in enumerate(messages):
                t = m.topic
                j = t.find("/")
                at = owned.get(t if j < 0 else t[:j])
                if at is None:
                    break
                p = parts.get(at)
                if p is None:
                    p = parts[at] = ([], [])
                p[0].append(m)
                if dues is not None:
                    p[1].append(dues[k])
            else:
                self._send_parts(parts, dues is not None, fut)
                return [AppendResult(fut)]
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
        self._send_parts(parts, dues is not None, fut)

    def _send_parts(self, parts: dict[int, tuple[list, list]], delayed: bool, fut: asyncio.Future) -> None:
        """One PRODUCE per group of `parts` ({group: (messages, due times)}); `fut` once every one
        is durable and the batch before."""
        durables = []
        for at, (ms, ds) in parts.items():
            st = self.stores[at]
            res = st.append_batch_delayed(ms, ds) if delayed else st.append_batch(ms)
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
    def _route(self, queue: str) -> tuple[int, str] | None:
        """(group index, the group's name) of the gateway's `queue`; None while the owner of its
        first level is not known yet."""
        r = self._routes.get(queue)
        if r is not None:
            return r
        part = split_part(queue)
        if part is not None:
            r = (part[1], part[0])
        else:
            first = filter_first_level(queue)
            at = 0 if first is None else self.owners.known(first)   # None: the first group's part
            if at is None:
                return None
            r = (at, queue)
        routes = self._routes
        if len(routes) >= _MAX_ROUTES:     # queues come and go with their devices: start again
            routes.clear()
        routes[queue] = r
        return r

    def _at(self, queue: str, call: Callable[[Any, str], Answer[Any]]) -> Answer[Any]:
        """`call(store, name)` with the group and the store's own name of the gateway's `queue`."""
        r = self._route(queue)
        if r is not None:                  # known: no chained answer per read
            return call(self.stores[r[0]], r[1])
        return chain(self.owners.owner(filter_first_level(queue) or ""), lambda i: call(self.stores[i], queue))

    def max_offset(self, queue: str) -> Answer[int]:
        return self._at(queue, lambda s, q: s.max_offset(q))

    def end_offset(self, queue: str) -> Answer[int]:
        return self._at(queue, lambda s, q: s.end_offset(q))

    def start_offset(self, queue: str) -> Answer[int]:
        return self._at(queue, lambda s, q: s.start_offset(q))

    def _read(self, queue: str, call: Callable[[Any, str], Answer[Any]], named: Callable[[Any, int], Any]) -> Answer[Any]:
        """A read of `queue` whose records a group after the first names by its own queue names:
        `named(answer, i)` renames them (every read of such a group: a record of `b/x` in group 1
        is also in that group's `#`, which this gateway knows as "#", NUL, 1)."""
        r = self._route(queue)
        if r is None:
            def go(i: int) -> Answer[Any]:
                got = call(self.stores[i], queue)
                return got if i == 0 else got.then(lambda v: named(v, i))
            return chain(self.owners.owner(filter_first_level(queue) or ""), go)
        i, name = r
        got = call(self.stores[i], name)
        if i == 0:
            return got
        if got.done() and got.exception() is None:
            # read from the group's mirror, the usual case: renamed now, no chained answer (a
            # RemoteMessage is renamed in place, so the answer itself is the renamed one)
            v = got.result()
            try:
                w = named(v, i)
            except Exception as e:  # noqa: BLE001 - as `then`: a record we cannot name fails this read
                return Answer.failed(e)
            return got if w is v else Answer.of(w)
        return got.then(lambda v: named(v, i))

    def pull(self, queue: str, offset: int, max_count: int = 32, max_bytes: int = 1 << 20) -> Answer[Any]:
        return self._read(queue, lambda s, q: s.pull(q, offset, max_count, max_bytes), _pulled_named)

    def message_at(self, queue: str, offset: int) -> Answer[Any]:
        return self._read(queue, lambda s, q: s.message_at(q, offset),
                          lambda m, i: None if m is None else _parts_named([m], i)[0])

    def replay_plan(self, flt: str, since_ms: int) -> Answer[Any]:
        """The plan of `flt` in its group; a part of a filter whose first level is a wildcard: in
        the part's group (the subscription registry asks one per part)."""
        return self._at(flt, lambda s, q: s.replay_plan(q, since_ms))

    def on_new_data(self, callback: Callable[[Iterable[str]], None]) -> None:
        for i, s in enumerate(self.stores):
            if i == 0:
                s.on_new_data(callback)
            else:
                s.on_new_data(lambda names, i=i: callback(
                    [part_name(q, i) if q[:1] in _WILD and spanning(q) else q for q in names]))
