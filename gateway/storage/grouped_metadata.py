"""The metadata facades of a gateway over several store groups (docs/groups.md "The gateway"):
each call goes to the group that owns what it is about, so a failover or a restore of one group
never mixes another's state into it.

* sessions (records, claims, sweeps): the first group, as the topic table; loading a session
  gathers its offsets from every group (a queue's offset lives in the queue's group: a group that
  recovers from a cut log resets the offsets beyond its queues' ends, and a queue it does not have
  ends at 0, so a foreign queue's offset kept there would be reset to 0);
* offsets: by the queue's first level (a queue is named by its filter); the parts of a filter
  whose first level is a wildcard (topic_owners.py `part_name`) each in its own group, under the
  filter's name there;
* filters: by the filter's first level; a filter whose first level is a wildcard in every group
  (each indexes its own topics into it); retained messages: by the topic's first level, those
  matching a wildcard first level gathered from every group;
* wills: in the group of the will's topic (the store node that publishes a gone gateway's wills
  is then the one its topic lives in); a client's will is popped or voided in every group.

Every answer is an `Answer` as the one-group facades give; a call whose owner is not known yet
waits for the claim first (`chain`).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, TypeVar

from lmqtt.gateway.storage.facades import Answer, Storage
from lmqtt.gateway.storage.topic_owners import (
    TopicOwners, filter_first_level, first_level, part_name, spanning, split_part)

T = TypeVar("T")
U = TypeVar("U")


class SpansGroups(Exception):
    """What is not served over several store groups for a filter whose first level is a wildcard
    (a replay of it)."""


def as_parts(offsets: dict[str, int], i: int) -> dict[str, int]:
    """Group `i`'s offsets of a consumer by the gateway's names (its spanning queues' parts)."""
    if i == 0 or not any(spanning(q) for q in offsets):
        return offsets
    return {(part_name(q, i) if spanning(q) else q): o for q, o in offsets.items()}


def chain(first: Answer[T], fn: Callable[[T], Answer[U]]) -> Answer[U]:
    """The answer of `fn(first's value)`, once `first` is in (its failure fails it); `wait()`
    waits for both."""
    if first.done():
        e = first.exception()
        return Answer.failed(e) if e is not None else fn(first.result())
    inner: list[Answer[U]] = []

    def waiter(_out: Answer[U], timeout: float | None) -> None:
        first.wait_quietly(timeout)
        if inner:
            inner[0].wait_quietly(timeout)

    out: Answer[U] = Answer(waiter)

    def settle(a: Answer[U]) -> None:
        e = a.exception()
        if e is not None:
            out.set_exception(e)
        else:
            out.set_result(a.result())

    def went(f: Answer[T]) -> None:
        e = f.exception()
        if e is not None:
            out.set_exception(e)
            return
        try:
            a = fn(f.result())
        except Exception as bad:  # noqa: BLE001 - the call's failure is the answer
            out.set_exception(bad)
            return
        inner.append(a)
        if a.done():
            settle(a)
        else:
            a.add_done_callback(settle)
    first.add_done_callback(went)
    return out


def merged(dicts: Answer[list[Any]]) -> Answer[dict]:
    return dicts.then(lambda ds: {k: v for d in ds for k, v in d.items()})


class _Routed:
    def __init__(self, owners: TopicOwners, groups: list[Storage]) -> None:
        self.owners = owners
        self.groups = groups

    def _everywhere(self, call: Callable[[], Answer[T]]) -> Answer[T]:
        """`call()` (which asks every group) once the claims asked before are answered."""
        return chain(self.owners.settled(), lambda _n: call())

    def _by_filter(self, flt: str, call: Callable[[Storage], Answer[T]]) -> Answer[T]:
        """`call` in the group of `flt`'s first level; a filter whose first level is a wildcard:
        in every group, answered with the first group's answer."""
        first = filter_first_level(flt)
        if first is None:
            return self._everywhere(lambda: Answer.gather([call(g) for g in self.groups]).then(lambda got: got[0]))
        return chain(self.owners.owner(first), lambda i: call(self.groups[i]))

    def _by_topic(self, topic: str, call: Callable[[Storage], Answer[T]]) -> Answer[T]:
        return chain(self.owners.owner(first_level(topic)), lambda i: call(self.groups[i]))

    def _split(self, keys: Iterable[str], every: bool = False) -> Answer[dict[int, list[tuple[str, str]]]]:
        """`keys` (queue names / filters) by the index of the group they live in, each as (the
        gateway's name, the group's name): a part name in its group under its filter's name; a
        spanning filter in the first group (`every`: in every group)."""
        keys = list(keys)
        out: dict[int, list[tuple[str, str]]] = {}
        routed: list[str] = []
        for k in keys:
            part = split_part(k)
            if part is not None:
                out.setdefault(part[1], []).append((k, part[0]))
            elif filter_first_level(k) is None:
                for i in (range(len(self.groups)) if every else (0,)):
                    out.setdefault(i, []).append((k, k))
            else:
                routed.append(k)
        if not routed:
            return Answer.of(out)
        firsts = sorted({first_level(k) for k in routed})

        def by(idx: list[int]) -> dict[int, list[tuple[str, str]]]:
            at = dict(zip(firsts, idx))
            for k in routed:
                out.setdefault(at[first_level(k)], []).append((k, k))
            return out
        return Answer.gather([self.owners.owner(f) for f in firsts]).then(by)


class GroupedOffsets(_Routed):
    def get(self, consumer: str, queue: str) -> Answer[int | None]:
        part = split_part(queue)
        if part is not None:
            return self.groups[part[1]].offsets.get(consumer, part[0])
        if filter_first_level(queue) is None:
            return self.groups[0].offsets.get(consumer, queue)
        return self._by_filter(queue, lambda g: g.offsets.get(consumer, queue))

    def get_all(self, consumer: str) -> Answer[dict[str, int]]:
        def named(i: int) -> Callable[[dict[str, int]], dict[str, int]]:
            return lambda d: as_parts(d, i)
        return self._everywhere(lambda: merged(Answer.gather(
            [g.offsets.get_all(consumer).then(named(i)) for i, g in enumerate(self.groups)])))

    def set(self, consumer: str, offsets: dict[str, int]) -> Answer[None]:
        return chain(self._split(offsets), lambda parts: Answer.all_in(
            [self.groups[i].offsets.set(consumer, {own: offsets[q] for q, own in qs}) for i, qs in parts.items()]))

    def delete(self, consumer: str, queues: list[str] | None = None) -> Answer[None]:
        if queues is None:
            return self._everywhere(lambda: Answer.all_in([g.offsets.delete(consumer) for g in self.groups]))
        return chain(self._split(queues), lambda parts: Answer.all_in(
            [self.groups[i].offsets.delete(consumer, [own for _q, own in qs]) for i, qs in parts.items()]))


class GroupedSessions:
    """The first group's sessions; a load gathers the session's offsets from every group."""

    def __init__(self, owners: TopicOwners, groups: list[Storage]) -> None:
        self.owners = owners
        self.groups = groups
        self.first = groups[0].sessions

    def __getattr__(self, name: str) -> Any:       # put, get, claims, sweeps, callbacks
        return getattr(self.first, name)

    def delete(self, client_id: str) -> Answer[bool]:
        """The record and its offsets in the first group; its offsets in every other group (a
        later session of that client id must not resume from them)."""
        gone = self.first.delete(client_id)
        return Answer.gather([gone] + [g.offsets.delete(client_id) for g in self.groups[1:]]).then(
            lambda got: got[0])

    def load(self, client_id: str) -> Answer[tuple[Any, dict[str, int]]]:
        return chain(self.owners.settled(), lambda _n: self._load(client_id))

    def _load(self, client_id: str) -> Answer[tuple[Any, dict[str, int]]]:
        answers = [self.first.load(client_id)] + [g.offsets.get_all(client_id) for g in self.groups[1:]]

        def join(got: list[Any]) -> tuple[Any, dict[str, int]]:
            rec, offs = got[0]
            offs = dict(offs)
            for i, more in enumerate(got[1:], 1):
                offs.update(as_parts(more, i))
            return rec, offs
        return Answer.gather(answers).then(join)

    def list_for_restore(self, hosted_by: str | None = None) -> Answer[list[tuple[Any, dict[str, int]]]]:
        def more(rows: list[tuple[Any, dict[str, int]]]) -> Answer[list[tuple[Any, dict[str, int]]]]:
            asks = [[g.offsets.get_all(rec.client_id) for g in self.groups[1:]] for rec, _o in rows]

            def join(got: list[Any]) -> list[tuple[Any, dict[str, int]]]:
                out, k, n = [], 0, len(self.groups) - 1
                for rec, offs in rows:
                    offs = dict(offs)
                    for i, d in enumerate(got[k:k + n], 1):
                        offs.update(as_parts(d, i))
                    k += n
                    out.append((rec, offs))
                return out
            return Answer.gather([a for per in asks for a in per]).then(join)
        return chain(self.owners.settled(), lambda _n: chain(self.first.list_for_restore(hosted_by), more))


class GroupedRetained(_Routed):
    def set(self, topic: str, payload: bytes, props: bytes = b"") -> Answer[None]:
        return self._by_topic(topic, lambda g: g.retained.set(topic, payload, props))

    def matching(self, flt: str) -> Answer[list]:
        if filter_first_level(flt) is None:
            return self._everywhere(lambda: Answer.gather([g.retained.matching(flt) for g in self.groups]).then(
                lambda ls: [x for one in ls for x in one]))
        return self._by_filter(flt, lambda g: g.retained.matching(flt))

    def batches(self, flt: str) -> Answer[Any]:
        if filter_first_level(flt) is None:
            return self._everywhere(lambda: Answer.gather([g.retained.batches(flt) for g in self.groups]).then(
                lambda its: iter([batch for it in its for batch in it])))
        return self._by_filter(flt, lambda g: g.retained.batches(flt))

    def clear_if(self, topic: str, props: bytes) -> Answer[bool]:
        return self._by_topic(topic, lambda g: g.retained.clear_if(topic, props))


class GroupedWills(_Routed):
    def put(self, client_id: str, will: Any) -> Answer[None]:
        return self._by_topic(will.topic, lambda g: g.wills.put(client_id, will))

    def pop(self, client_id: str) -> Answer[None]:
        return self._everywhere(lambda: Answer.all_in([g.wills.pop(client_id) for g in self.groups]))

    def void(self, client_id: str) -> Answer[None]:
        return self._everywhere(lambda: Answer.all_in([g.wills.void(client_id) for g in self.groups]))

    def take(self) -> Answer[list]:
        return self._everywhere(lambda: Answer.gather([g.wills.take() for g in self.groups]).then(
            lambda ls: [x for one in ls for x in one]))

    def held(self) -> Answer[list]:
        return self._everywhere(lambda: Answer.gather([g.wills.held() for g in self.groups]).then(
            lambda ls: [x for one in ls for x in one]))

    def on_wills_published(self, fn: Callable[[list[str]], None]) -> None:
        for g in self.groups:
            g.wills.on_wills_published(fn)


class GroupedFilters(_Routed):
    def register(self, flt: str) -> Answer[int]:
        return self._by_filter(flt, lambda g: g.filters.register(flt))

    def register_all(self, flts: list[str]) -> Answer[dict[str, int]]:
        # a spanning filter's count is the first group's (sorted: group 0's dict merged last)
        return chain(self._split(flts, every=True), lambda parts: merged(Answer.gather(
            [self.groups[i].filters.register_all([f for f, _own in parts[i]]) for i in sorted(parts, reverse=True)])))

    def unregister(self, flt: str) -> Answer[int]:
        return self._by_filter(flt, lambda g: g.filters.unregister(flt))

    def release(self, flt: str) -> Answer[None]:
        return self._by_filter(flt, lambda g: g.filters.release(flt))

    def registered(self) -> Answer[dict[str, int]]:
        """This gateway's registrations; a filter whose first level is a wildcard counts as
        registered as much as its least registered group (a group added since it was registered
        lacks it: 0, so the gateway's start registers it everywhere)."""
        def join(ds: list[dict[str, int]]) -> dict[str, int]:
            out = {k: v for d in ds for k, v in d.items()}
            for f in out:
                if spanning(f):
                    out[f] = min(d.get(f, 0) for d in ds)
            return out
        return self._everywhere(lambda: Answer.gather([g.filters.registered() for g in self.groups]).then(join))


def grouped_storage(owners: TopicOwners, groups: list[Storage], queues: Any) -> Storage:
    """One `Storage` over the groups' own (each a one-group bundle, in `--store` order)."""
    return Storage(GroupedSessions(owners, groups), GroupedOffsets(owners, groups),  # type: ignore[arg-type]
                   GroupedRetained(owners, groups), GroupedWills(owners, groups),  # type: ignore[arg-type]
                   GroupedFilters(owners, groups), queues)  # type: ignore[arg-type]
