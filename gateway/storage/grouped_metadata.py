"""The metadata facades of a gateway over several store groups (docs/groups.md "The gateway"):
each call goes to the group that owns what it is about, so a failover or a restore of one group
never mixes another's state into it.

* sessions (records, claims, sweeps): by client id (`home_group`, rendezvous hashing; a record
  stays in the group it was written to); loading a session reads every group at once: its record
  where it is, its offsets from every group (`GroupedSessions`);
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

import json
from json.decoder import scanstring  # type: ignore[attr-defined]
from itertools import islice
from typing import Any, Callable, Iterable, TypeVar
from zlib import crc32

from lmqtt.gateway.storage.facades import Answer, Storage
from lmqtt.gateway.storage.session_stubs import SessionStubs
from lmqtt.gateway.storage.topic_owners import (
    TopicOwners, filter_first_level, first_level, part_name, spanning, split_part)

T = TypeVar("T")
U = TypeVar("U")


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
    settle = out.take_outcome_of

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
    def __init__(self, owners: TopicOwners, groups: list[Storage], stubs: SessionStubs | None = None) -> None:
        super().__init__(owners, groups)
        self.stubs = stubs

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
        def write(parts: dict[int, list[tuple[str, str]]]) -> Answer[None]:
            if self.stubs is not None:
                self.stubs.offsets_set(consumer, parts)      # the session's stub first, where needed
            return Answer.all_in([self.groups[i].offsets.set(consumer, {own: offsets[q] for q, own in qs})
                                  for i, qs in parts.items()])
        return chain(self._split(offsets), write)

    def delete(self, consumer: str, queues: list[str] | None = None) -> Answer[None]:
        if queues is None:
            return self._everywhere(lambda: Answer.all_in([g.offsets.delete(consumer) for g in self.groups]))
        return chain(self._split(queues), lambda parts: Answer.all_in(
            [self.groups[i].offsets.delete(consumer, [own for _q, own in qs]) for i, qs in parts.items()]))


def home_group(client_id: str, n: int) -> int:
    """The group a new session record of `client_id` is written in, of `n`: rendezvous hashing
    (the highest of each group's hash of the client id), so adding a group moves the home of
    only the clients whose new group scores highest - about 1/n of them - and never from one old
    group to another. A record stays where it was written (`GroupedSessions` finds it there)."""
    if n == 1:
        return 0
    h = crc32(client_id.encode("utf-8", "surrogatepass"))
    return max(range(n), key=lambda i: _mix64(h + (i + 1) * 0x9E3779B97F4A7C15))


def _mix64(x: int) -> int:
    """A 64-bit finalizer (MurmurHash3's fmix64): each group's score of one hash, unrelated."""
    x &= 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 33)) * 0xFF51AFD7ED558CCD) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 33)) * 0xC4CEB9FE1A85EC53) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 33)


def client_id_of(raw: bytes) -> str:
    """The client id of a session record's bytes (its JSON's first field, as
    `SessionRecord.to_bytes` and the gateway's record template write it) without decoding the rest."""
    head = b'{"client_id":"'
    if raw.startswith(head):
        text = raw.decode("utf-8", "surrogatepass")
        return scanstring(text, len(head))[0]
    return str(json.loads(raw)["client_id"])


class GroupedSessions:
    """Session records spread over the groups by client id (`home_group`), each session's
    offsets in its queues' groups (a queue's offset lives in the queue's group: a group that
    recovers from a cut log resets the offsets beyond its queues' ends, and a queue it does not
    have ends at 0, so a foreign queue's offset kept there would be reset to 0).

    A record is written where it is: its home, or - written before a group was added moved the
    home - the group a read found it in (`_at`, the few such records). A load asks every group
    at once (the record from the group that has it, the offsets from all: one round trip, as
    one group's load), so a record is found wherever it was written; a delete ends it in every
    group. The claims of a client go to its record's group, which tells the other gateways
    (every gateway hears every group), and each group's node sweeps the records it holds."""

    claims_void_wills = False      # a will lives in its topic's group, which the claim may not reach

    def __init__(self, owners: TopicOwners, groups: list[Storage]) -> None:
        self.owners = owners
        self.groups = groups
        self._at: dict[str, int] = {}       # client id -> its record's group, where not its home
        # the session's marks in the groups that hold its offsets but not its record (session_stubs.py)
        self.stubs = SessionStubs(groups, self._where)

    def _where(self, client_id: str) -> int:
        at = self._at.get(client_id)
        return home_group(client_id, len(self.groups)) if at is None else at

    def _found(self, client_id: str, i: int) -> None:
        if i == home_group(client_id, len(self.groups)):
            self._at.pop(client_id, None)
        else:
            self._at[client_id] = i

    def _pick(self, client_id: str, recs: list[Any]) -> Any:
        """The record among each group's answer (None: none there - a stub is never answered):
        the one in the group it is written to, else any, whose group is then remembered."""
        i = self._where(client_id)
        if recs[i] is not None:
            return recs[i]
        for j, rec in enumerate(recs):
            if rec is not None:
                self._found(client_id, j)
                return rec
        return None

    # -- writes ------------------------------------------------------------------------------
    def put(self, client_id: str, rec: Any) -> Answer[None]:
        answer = self.groups[self._where(client_id)].sessions.put(client_id, rec)
        self.stubs.record_put(client_id, rec)
        return answer

    def put_many(self, records: list[tuple[str, Any]]) -> Answer[None]:
        by: dict[int, list[tuple[str, Any]]] = {}
        for cid, rec in records:
            by.setdefault(self._where(cid), []).append((cid, rec))
        answer = Answer.all_in([self.groups[i].sessions.put_many(rs) for i, rs in by.items()])
        for cid, rec in records:
            self.stubs.record_put(cid, rec)
        return answer

    def delete(self, client_id: str) -> Answer[bool]:
        """The record and the session's offsets in every group, its stubs too (a later session
        of that client id must not resume from them); True if a record was there."""
        self._at.pop(client_id, None)
        self.stubs.forget(client_id)
        return Answer.gather([g.sessions.delete(client_id) for g in self.groups]).then(any)

    def claim(self, claims: list[tuple[str, int]]) -> Answer[None]:
        by: dict[int, list[tuple[str, int]]] = {}
        for c in claims:
            by.setdefault(self._where(c[0]), []).append(c)
        return Answer.all_in([self.groups[i].sessions.claim(cs) for i, cs in by.items()])

    def flush(self) -> Answer[None]:
        return Answer.all_in([g.sessions.flush() for g in self.groups])

    # -- reads -------------------------------------------------------------------------------
    def get(self, client_id: str) -> Answer[Any]:
        return Answer.gather([g.sessions.get(client_id) for g in self.groups]).then(
            lambda recs: self._pick(client_id, recs))

    def load(self, client_id: str) -> Answer[tuple[Any, dict[str, int]]]:
        return chain(self.owners.settled(), lambda _n: self._load(client_id))

    def _load(self, client_id: str) -> Answer[tuple[Any, dict[str, int]]]:
        def join(got: list[Any]) -> tuple[Any, dict[str, int]]:
            offs: dict[str, int] = {}
            for i, (_rec, more) in enumerate(got):
                offs.update(as_parts(more, i))
            rec = self._pick(client_id, [rec for rec, _o in got])
            if rec is not None:
                self.stubs.loaded(client_id, [i for i, (_r, more) in enumerate(got) if more])
            return rec, offs
        return Answer.gather([g.sessions.load(client_id) for g in self.groups]).then(join)

    def all(self) -> Answer[list[Any]]:
        def join(per: list[list[Any]]) -> list[Any]:
            for i, recs in enumerate(per):
                for rec in recs:
                    self._found(rec.client_id, i)
            return [rec for recs in per for rec in recs]
        return Answer.gather([g.sessions.all() for g in self.groups]).then(join)

    def list_for_restore(self, hosted_by: str | None = None) -> Answer[list[tuple[Any, dict[str, int]]]]:
        """Each group's records with the session's offsets from every group."""
        def more(per: list[list[tuple[Any, dict[str, int]]]]) -> Answer[list[tuple[Any, dict[str, int]]]]:
            rows = []
            for i, got in enumerate(per):
                for rec, offs in got:
                    self._found(rec.client_id, i)
                    rows.append((i, rec, offs))
            # each row's offsets in the other groups: (group, answer), the rows' in row order
            asks = [(j, g.offsets.get_all(rec.client_id)) for i, rec, _o in rows
                    for j, g in enumerate(self.groups) if j != i]

            def join(got: list[Any]) -> list[tuple[Any, dict[str, int]]]:
                answered = iter(zip((j for j, _a in asks), got))
                out = []
                for i, rec, offs in rows:
                    offs = as_parts(dict(offs), i)
                    held = []
                    for j, d in islice(answered, len(self.groups) - 1):
                        offs.update(as_parts(d, j))
                        if d:
                            held.append(j)
                    if held:
                        self.stubs.loaded(rec.client_id, held)
                    out.append((rec, offs))
                return out
            return Answer.gather([a for _j, a in asks]).then(join)
        return chain(self.owners.settled(), lambda _n: chain(
            Answer.gather([g.sessions.list_for_restore(hosted_by) for g in self.groups]), more))

    def records_for_restore(self, hosted_by: str | None = None) -> Answer[Iterable[bytes]]:
        """Every group's records' bytes, one group after another; each record's group noted as
        it is read (the restore writes some again: where they are)."""
        def each(per: list[Iterable[bytes]]) -> Iterable[bytes]:
            for i, raws in enumerate(per):
                for raw in raws:
                    try:
                        self._found(client_id_of(raw), i)
                    except (ValueError, KeyError, TypeError):
                        pass            # the restore reports the record that does not decode
                    yield raw
        return Answer.gather([g.sessions.records_for_restore(hosted_by) for g in self.groups]).then(each)

    # -- events: each group tells of the records it holds --------------------------------------
    def on_sessions_swept(self, fn: Callable[[list[str]], None]) -> None:
        def swept(cids: list[str]) -> None:
            self.stubs.swept(cids)          # before `fn` writes their records again
            fn(cids)
        for g in self.groups:
            g.sessions.on_sessions_swept(swept)

    def on_sessions_moved(self, fn: Callable[[list[str]], None]) -> None:
        def moved(cids: list[str]) -> None:
            for cid in cids:
                self.stubs.forget(cid)
            fn(cids)
        for g in self.groups:
            g.sessions.on_sessions_moved(moved)

    def on_session_claims(self, fn: Callable[[str, list], None]) -> None:
        for g in self.groups:
            g.sessions.on_session_claims(fn)


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
    sessions = GroupedSessions(owners, groups)
    return Storage(sessions, GroupedOffsets(owners, groups, sessions.stubs),  # type: ignore[arg-type]
                   GroupedRetained(owners, groups), GroupedWills(owners, groups),  # type: ignore[arg-type]
                   GroupedFilters(owners, groups), queues)  # type: ignore[arg-type]
