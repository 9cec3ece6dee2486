"""Subscription registry: which session reads which light queue, shared groups, and the gateway's
registrations of wildcard filters with the light-queue store.

Why one owner for filter registrations: a wildcard filter must be registered with the light-queue
store (so the publish path dispatches matching records to its queue) exactly while some local
subscription uses it. This registry counts local users per filter and holds ONE registration per
filter in the store, taken on the first user and dropped with the last. The store's registration
table is persistent and outlives a crash, while non-persistent sessions do not: `sync_store_filters`
makes the store's table equal to what the restored sessions use when the gateway starts. In a
fleet the store keeps the registrations per gateway id (the `FilterRegistry` facade's `registered`
answers this gateway's holds only), so each gateway reconciles its own and leaves the others' alone.

Interface (what a fleet-wide implementation, e.g. over Redis, has to provide):
  add(session, sub) -> existed      subscribe (replaces a subscription with the same filter)
  remove(session, sub, persist)     unsubscribe; drops the offsets kept for it when `persist`
  restore(session, sub, offsets)    re-create a persisted subscription at gateway start
  go_online(session) / go_offline(session)
                                    the session's connection arrived / left: start or stop reading
  remove_all(session)               the session ended
  sync_store_filters()              after restoring at start: the store registers exactly the filters in use
  hold_restored(session)            a session restored while running (a fleet's reload): its filters
                                    new here are registered now
  prepare(session, requests, ...)   a SUBSCRIBE's store answers, asked for together (`Prepared`)
  prepare_resume(subscriptions, inflight)
                                    the same for a session a fleet gateway resumes (gateway/fleet/sessions.py)
  deciding(prepared)                the context its decision runs in (add / add_since / restore take them)
  unheld(filters)                   which wildcard filters a new user would register (asked ahead)
  is_current(group)                 whether a group object is still the live one (offset flushes)
"""
from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator

from lmqtt.gateway.delivery.history import REPLAY_PREFIX, ReplayRequestError, split_replay_filter
from lmqtt.gateway.session import ClientSubscription, Cursor, MqttSession
from lmqtt.gateway.subscriptions.shared_groups import SharedGroup, group_consumer
from lmqtt.gateway.storage.facades import Answer, ReplayRefused, log_failure
from lmqtt.lightqueue import topics as T
from lmqtt.lightqueue.errors import InvalidTopicFilter

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.delivery.engine import DeliveryEngine
    from lmqtt.gateway.clients.session_persistence import SessionPersistence
    from lmqtt.gateway.storage.facades import FilterRegistry, ReplayPlan, RetainedStore, Storage

log = logging.getLogger("lmqtt.gateway.subscriptions.subscription_registry")


class Prepared:
    """The store's answers a SUBSCRIBE's decision (`SubscriptionRegistry.prepare`) or a resumed
    session (`prepare_resume`, a fleet gateway's CONNECT) reads, asked for together before it is
    decided: the holds of wildcard filters new here, the start offsets of new subscriptions and
    shared groups (and of a resumed session's queues: what it missed is known before it resumes),
    the replay plans of subscriptions from the past, the retained messages, the committed offsets
    of shared groups new here by (consumer, queue), the messages a resumed session had in flight
    by (queue, offset); each an `Answer`. `ready` is done once every one is in: at once
    in-process, after one round trip of a remote store (what is asked in one loop turn travels
    together); the packet's connection waits for it on hold. The caller never asks which store it
    has: it waits for `ready` when it is not done, then decides inside
    `SubscriptionRegistry.deciding(prepared)`. Holds nothing took are let go of (`release`)."""

    __slots__ = ("registered", "start", "replay", "retained", "offsets", "messages", "ready", "parsed", "_filters")

    def __init__(self, filters: "FilterRegistry") -> None:
        self._filters = filters
        self.registered: dict[str, Answer[int]] = {}
        self.start: dict[str, Answer[int]] = {}
        self.replay: dict[tuple[str, int], Answer["ReplayPlan"]] = {}
        self.retained: dict[str, Answer[Iterator[list]]] = {}
        self.offsets: dict[tuple[str, str], Answer[int | None]] = {}
        self.messages: dict[tuple[str, int], Answer[Any]] = {}
        self.ready: Answer[None] = Answer.of(None)
        # a SUBSCRIBE's valid filters as `prepare` parsed them: filter as sent (after a `$replay/`
        # prefix) -> (share group or None, filter); the decision does not validate them again
        self.parsed: dict[str, tuple[str | None, str]] = {}

    def _asked(self) -> list[Answer[Any]]:
        return [*self.registered.values(), *self.start.values(), *self.replay.values(), *self.retained.values(),
                *self.offsets.values(), *self.messages.values()]

    def failure(self) -> BaseException | None:
        """Why the store could not answer (any read but a replay plan failed: the whole packet is
        refused), or None. A refused replay plan refuses only its own subscription (answered where
        it is taken)."""
        for group in (self.registered, self.start, self.retained, self.offsets, self.messages):
            for a in group.values():
                e = a.exception()
                if e is not None:
                    return e
        return None

    def take_retained(self, flt: str) -> Iterator[list] | None:
        """`flt`'s retained messages as asked for (taken once), or None (not asked, or failed)."""
        a = self.retained.pop(flt, None)
        if a is None or not a.done() or a.exception() is not None:
            return None
        return a.result()

    def release(self) -> None:
        """Let go of the holds registered for this SUBSCRIBE that nothing took (refused by the ACL,
        a quota, ...; or the SUBSCRIBE was not decided at all)."""
        regs, self.registered = self.registered, {}
        for f, a in regs.items():
            if a.done() and a.exception() is None:
                log_failure(self._filters.release(f), log, "unregister_filter_failed", filter=f)


class SubscriptionRegistry:
    def __init__(self, storage: "Storage", delivery: "DeliveryEngine", persist: "SessionPersistence", *,
                 before_register: Callable[[], None] | None = None) -> None:
        """`before_register()`: called before a wildcard filter is registered with the store (the
        broker: append the publishes already routed without it, so that every record appended
        after the registration carries the filter: the seam of subscribing from the past,
        replay.py)."""
        self.store = storage.queues                # start offsets, reads ahead
        self.filters = storage.filters             # the storage facades it uses (storage/facades.py)
        self.offsets = storage.offsets
        self.delivery = delivery
        self.persist = persist
        self.groups: dict[tuple[str, str], SharedGroup] = {}    # (group name, queue) -> group
        self._filter_users: dict[str, int] = {}                  # wildcard filter -> local users
        self.before_register = before_register
        self._prepared: Prepared | None = None                   # the SUBSCRIBE being decided
        self._outer: list[Prepared | None] = []                  # those it is decided inside (`deciding`)
        # over several store groups (gateway/storage/grouped_queues.py): the queues a subscription
        # reads (one per group for a filter whose first level is a wildcard, direct or shared: a
        # shared group per part); None: one store
        self._parts_of: Callable[[str], tuple[str, ...]] | None = getattr(self.store, "parts", None)
        if self._parts_of is not None:
            delivery.parts = self.parts     # a shared subscription's queues, kicked by `kick`

    def parts(self, queue: str) -> tuple[str, ...]:
        """The queues a subscription of `queue` reads: itself, or over several store groups one per
        group for a filter whose first level is a wildcard (the first is `queue`); a shared
        subscription of such a filter is a shared group per part, each with its own offset in
        its store group."""
        parts_of = self._parts_of
        return (queue,) if parts_of is None else parts_of(queue)

    # ------------------------------------------------------------------ subscribe / unsubscribe
    def prepare(self, s: MqttSession, requests, since_all: int | None = None,
                retained: "RetainedStore | None" = None) -> Prepared:
        """Ask the store now for every answer deciding these SUBSCRIBE requests reads, in the order
        the decision would read them: the holds of wildcard filters new here (with
        `before_register` first), the start offsets of new subscriptions and shared groups, the
        replay plans of subscriptions from the past (`since_all`: the SUBSCRIBE's own since time,
        else a `$replay/` prefix gives one), then the retained messages from `retained` (after
        the start offsets: a retained message set in between is delivered live, never lost).
        Filters that will be refused may be asked for too; holds nothing takes are let go of
        (`Prepared.release`, called by `deciding`)."""
        filters: list[str] = []
        start: list[str] = []
        kept: list[str] = []
        replay: list[tuple[str, int]] = []
        parsed: dict[str, tuple[str | None, str]] = {}
        for req in requests:
            tf = req.topic_filter
            since = since_all
            if tf.startswith(REPLAY_PREFIX):
                try:
                    split = split_replay_filter(tf)
                except ReplayRequestError:
                    continue
                if split is None:
                    continue
                since, tf = split
            try:
                group, flt = T.parse_shared(tf)
                T.validate_filter(flt)
            except InvalidTopicFilter:
                continue
            parsed[tf] = (group, flt)
            filters.append(flt)
            if since is not None:
                if group is None:                 # (a shared one is refused)
                    replay.append((flt, int(since)))
                continue
            if group is None:
                if tf not in s.subs:
                    start += self.parts(flt)
                if req.retain_handling == 0 or (req.retain_handling == 1 and tf not in s.subs):
                    kept.append(flt)
            else:                                 # a group new here starts at the queue's end
                start += [q for q in self.parts(flt) if (group, q) not in self.groups]
        p = Prepared(self.filters)
        p.parsed = parsed
        register = self.unheld(filters)
        if register and self.before_register is not None:
            self.before_register()
        for f in register:
            p.registered[f] = self.filters.register(f)
        for q in dict.fromkeys(start):
            p.start[q] = self.store.start_offset(q)
        for flt, since in dict.fromkeys(replay):
            for q in self.parts(flt):            # over several store groups: a plan per group
                p.replay[(q, since)] = self.store.replay_plan(q, since)
        if retained is not None:
            for f in dict.fromkeys(kept):
                p.retained[f] = retained.batches(f)
        p.ready = Answer.all_in(p._asked())
        return p

    def prepare_resume(self, subscriptions, inflight: list[tuple[str, int]]) -> Prepared:
        """What resuming a session here reads (a fleet gateway's CONNECT of a session another
        gateway served, gateway/fleet/sessions.py), asked for now: its wildcard filters new here
        held, the start offsets of its queues (a remote store mirrors them, and knows what the
        session missed before it resumes: max_offline_backlog counts from there), for each shared
        group not here yet the group's committed offset and the queue's start, and the messages
        it had in flight (`inflight`: (queue, offset); resumed with their packet ids).
        `subscriptions`: the record's (`.filter`, `.share_group`)."""
        subs = list(subscriptions)
        p = Prepared(self.filters)
        for f in self.unheld(rs.filter for rs in subs):
            p.registered[f] = self.filters.register(f)
        new_groups = [(rs.share_group, q) for rs in subs if rs.share_group for q in self.parts(rs.filter)
                      if (rs.share_group, q) not in self.groups]
        for q in dict.fromkeys([*(part for rs in subs if not rs.share_group for part in self.parts(rs.filter)),
                                *(q for _, q in new_groups)]):
            p.start[q] = self.store.start_offset(q)
        for g, q in dict.fromkeys(new_groups):
            consumer = group_consumer(g, q)
            p.offsets[(consumer, q)] = self.offsets.get(consumer, q)
        for q, off in dict.fromkeys(inflight):
            p.messages[(q, off)] = self.store.message_at(q, off)
        p.ready = Answer.all_in(p._asked())
        return p

    def deciding(self, prepared: Prepared) -> "SubscriptionRegistry":
        """`with registry.deciding(prepared):` decide a SUBSCRIBE inside: `add`, `add_since` and
        the groups take the prepared answers (a read not prepared is waited for: start-up and rare
        paths); on exit the holds nothing took are let go of. The registry is its own context
        manager, not a `contextlib` generator: every SUBSCRIBE runs it, and the generator's
        helper, frames and `next` calls cost each handshake six Python calls for nothing."""
        self._outer.append(self._prepared)      # a decision inside another: its own answers, then the outer's
        self._prepared = prepared
        if prepared.messages:
            self.delivery.at_hand = prepared.messages      # DeliveryEngine.message_at takes them
        return self

    def __enter__(self) -> Prepared:
        p = self._prepared
        assert p is not None, "use `with registry.deciding(prepared):`"
        return p

    def __exit__(self, *exc) -> None:
        prepared = self._prepared
        assert prepared is not None, "use `with registry.deciding(prepared):`"
        self._prepared = outer = self._outer.pop()
        if prepared.messages:
            self.delivery.at_hand = outer.messages if outer is not None and outer.messages else None
        prepared.release()

    def _answer(self, table: str, key: Any, ask: Callable[[], Answer[Any]]) -> Any:
        """The prepared answer of `key` (start offsets: shared by a subscription and a group of
        one filter; the others taken), else `ask()` waited for."""
        p = self._prepared
        if p is not None:
            d = getattr(p, table)
            a = d.get(key) if table == "start" else d.pop(key, None)
            if a is not None:
                return a.wait()
        return ask().wait()

    def add(self, s: MqttSession, sub: ClientSubscription) -> bool:
        """Add or replace a subscription; returns True if one with the same filter existed."""
        if not (sub.group is None and sub.filter == sub.queue):
            s.split_direct()           # `direct` is `subs` only while every subscription is plain
        old = s.subs.get(sub.filter)
        s.subs[sub.filter] = sub
        parts = self.parts(sub.queue)
        if len(parts) > 1 and sub.group is None:
            s.split_direct()           # one subscription, a queue per store group
        if old is not None:
            if sub.group is None:
                for q in parts:
                    s.direct[q] = _part(sub, q)
            elif s.online:
                for q in parts:
                    self.groups[(sub.group, q)].add_member(s, _part(sub, q))
            return True
        self._use_filter(sub.queue)
        if sub.group is None:
            for q in parts:
                s.direct[q] = _part(sub, q)
                s.cursors[q] = Cursor(self._answer("start", q, functools.partial(self.store.start_offset, q)))
                if s.online:
                    self.delivery.add_reader(s, q)
        else:
            for q in parts:
                g = self._group(sub.group, q)
                g.refs += 1
                if s.online:
                    g.add_member(s, _part(sub, q))
        return False

    def add_since(self, s: MqttSession, sub: ClientSubscription, since_ms: int) -> bool:
        """Subscribe from the past (gateway/delivery/history.py): the stored messages matching the filter
        since `since_ms`, then live from the seam. A subscription with the same filter is replaced
        (its cursor restarts in the past). Raises ReplayRefused (nothing subscribed then)."""
        if sub.group is not None:
            raise ReplayRefused("subscribing from the past is not available for shared subscriptions")
        s.split_direct()          # in `direct` only once its plans are in (below)
        old = s.subs.get(sub.filter)
        if old is not None:
            self.remove(s, old, persist=False)
        s.subs[sub.filter] = sub
        self._use_filter(sub.queue)
        # over several store groups a filter whose first level is a wildcard has a part per group:
        # each part's history is read in its group and goes live at its own seam (a topic lives in
        # one group, so its order holds; the groups' histories interleave as live messages do)
        parts = self.parts(sub.queue)
        try:
            plans = [self._answer("replay", (q, int(since_ms)), functools.partial(self.store.replay_plan, q, since_ms))
                     for q in parts]
        except Exception as e:
            s.subs.pop(sub.filter, None)
            self._release_filter(sub.queue)
            if isinstance(e, ReplayRefused):
                raise
            log.error("event=replay_plan_failed client_id=%s filter=%s error=%r", s.client_id, sub.queue, e)
            s.join_direct()
            raise ReplayRefused(f"the store could not plan the replay: {e}") from e
        for i, (q, plan) in enumerate(zip(parts, plans)):
            part = _part(sub, q)
            s.direct[q] = part
            s.cursors[q] = Cursor(plan.live_offset)
            log.info("event=replay_subscribe client_id=%s filter=%s%s since_ms=%d source=%s live_offset=%d",
                     s.client_id, sub.queue, f" store_group={i}" if len(parts) > 1 else "", since_ms,
                     plan.source, plan.live_offset)
            if plan.source == "log" and not plan.done:
                self.delivery.start_history(s, part, plan)
            elif s.online:
                self.delivery.add_reader(s, q)
        return old is not None

    def _remove(self, s: MqttSession, sub: ClientSubscription, persist: bool) -> None:
        s.subs.pop(sub.filter, None)
        if sub.group is None:
            parts = self.parts(sub.queue)
            if self.delivery.histories:
                for q in parts:
                    self.delivery.drop_history(s, q)
            for q in parts:
                s.direct.pop(q, None)
                s.cursors.pop(q, None)
                self.delivery.remove_reader(s, q)
            if persist and s.persistent:
                log_failure(self.offsets.delete(s.client_id, list(parts)), log, "delete_offsets_failed",
                            consumer=s.client_id)
        else:
            for q in self.parts(sub.queue):
                g = self.groups.get((sub.group, q))
                if g is not None:
                    g.remove_member(s)
                    self._unref(g)
        self._release_filter(sub.queue)

    def _unref(self, g: SharedGroup) -> None:
        """One reference of shared group `g` gone; the last one drops the group and its offset."""
        g.refs -= 1
        if g.refs <= 0:
            del self.groups[(g.name, g.queue)]
            self.delivery.remove_group(g)
            self.persist.forget_group(g)
            log_failure(self.offsets.delete(g.consumer, [g.queue]), log, "delete_offsets_failed",
                        consumer=g.consumer)

    def remove(self, s: MqttSession, sub: ClientSubscription, persist: bool = True) -> None:
        self._remove(s, sub, persist)
        if s.direct is not s.subs:
            s.join_direct()

    def remove_all(self, s: MqttSession) -> None:
        for sub in list(s.subs.values()):
            self.remove(s, sub, persist=False)

    def restore(self, s: MqttSession, sub: ClientSubscription, offsets: dict[str, int]) -> None:
        """A persisted subscription at gateway start (`offsets`: the session's committed ones,
        by queue; a queue without one starts at its end)."""
        parts = self.parts(sub.queue) if sub.group is None else ()
        if not (sub.group is None and sub.filter == sub.queue) or len(parts) > 1:
            s.split_direct()
        s.subs[sub.filter] = sub
        if T.is_wildcard(sub.queue):
            self._filter_users[sub.queue] = self._filter_users.get(sub.queue, 0) + 1
        if sub.group is None:
            for q in parts:
                offset = offsets.get(q)
                s.direct[q] = _part(sub, q)
                s.cursors[q] = Cursor(self.store.max_offset(q).wait() if offset is None else offset)
        else:
            for q in self.parts(sub.queue):
                self._group(sub.group, q, restoring=True).refs += 1

    def hold_dormant(self, subs: tuple) -> None:
        """A session restored at start without being built (clients/session_persistence.py `Dormant`,
        `subs` flat (queue, group or None, ...)): what `restore` takes for it, minus the session:
        its wildcard filters counted as used here (`sync_store_filters` keeps them registered) and
        its shared groups' references."""
        users = self._filter_users
        for i in range(0, len(subs), 2):
            q, g = subs[i], subs[i + 1]
            if g is not None:
                for part in self.parts(q):
                    self._group(g, part, restoring=True).refs += 1
            if T.is_wildcard(q):
                users[q] = users.get(q, 0) + 1

    def release_dormant(self, subs: tuple) -> None:
        """Let go of what `hold_dormant` took (the dormant session was built, ended or moved away),
        as `remove` does for a built session's subscriptions."""
        for i in range(0, len(subs), 2):
            q, g = subs[i], subs[i + 1]
            if g is not None:
                for part in self.parts(q):
                    grp = self.groups.get((g, part))
                    if grp is not None:
                        self._unref(grp)
            self._release_filter(q)

    # ------------------------------------------------------------------ online / offline
    def go_online(self, s: MqttSession) -> None:
        hist = self.delivery.histories.get(s)
        for sub in s.subs.values():
            if sub.group is None:
                for q in self.parts(sub.queue):
                    if hist and self.delivery.has_history(s, q):
                        continue    # read live once its history is sent (replay.py)
                    self.delivery.add_reader(s, q)
            else:
                for q in self.parts(sub.queue):
                    g = self.groups.get((sub.group, q))
                    if g is not None:
                        g.add_member(s, _part(sub, q))

    def go_offline(self, s: MqttSession) -> None:
        """Stop reading for `s`; its shared-group messages in flight go back to their group (the
        session machine hands them over, `went_offline`), its retained messages waiting are dropped."""
        for sub in s.subs.values():
            if sub.group is None:
                for q in self.parts(sub.queue):
                    self.delivery.remove_reader(s, q)
            else:
                for q in self.parts(sub.queue):
                    g = self.groups.get((sub.group, q))
                    if g is not None:
                        g.remove_member(s)
        for inf in s.went_offline():
            group = inf.group
            group.take_back(inf.message)
            self.delivery.kick_queue(group.queue)

    def is_current(self, g: SharedGroup) -> bool:
        return self.groups.get((g.name, g.queue)) is g

    # ------------------------------------------------------------------ store registrations
    def sync_store_filters(self) -> None:
        """Make the store's filter registrations exactly the filters restored sessions use (one
        registration each); non-persistent sessions alive at a crash left registrations behind."""
        registered = self.filters.registered().wait()
        for f, n in registered.items():
            want = 1 if f in self._filter_users else 0
            while n > want:
                n = self.filters.unregister(f).wait()
        missing = [f for f in self._filter_users if registered.get(f, 0) == 0]
        if missing:
            self.filters.register_all(missing).wait()

    def unheld(self, filters) -> list[str]:
        """The wildcard filters among `filters` that no subscription here holds (in order, each
        once): those a new user would register with the store, so a reader ahead (a fleet
        gateway loading a session) registers them before the session is restored."""
        users = self._filter_users
        return list(dict.fromkeys(f for f in filters if T.is_wildcard(f) and not users.get(f)))

    def hold_restored(self, s: MqttSession) -> None:
        """`s` was just restored while the gateway runs (a fleet gateway reloading a session from
        the store): register with the store the wildcard filters nobody else here uses. `restore`
        only counts users (at start `sync_store_filters` registers them all at once); here a
        filter new to this gateway must be held NOW, before anything else lets go of it (the
        gateway the client left drops its holds, and the last unregistration drops the filter's
        queue). Counted per filter: a session with a direct and a shared subscription on one
        filter is still its only user."""
        mine: dict[str, int] = {}
        for sub in s.subs.values():
            if T.is_wildcard(sub.queue):
                mine[sub.queue] = mine.get(sub.queue, 0) + 1
        done: list[str] = []
        try:
            for q, n in mine.items():
                if self._filter_users.get(q) == n:
                    self._answer("registered", q, functools.partial(self.filters.register, q))
                    done.append(q)
        except BaseException:
            # the session is not kept (the caller takes it back, `unrestore`): nor its holds
            for q in done:
                log_failure(self.filters.release(q), log, "unregister_filter_failed", filter=q)
            raise

    def unrestore(self, s: MqttSession) -> None:
        """Take back what `restore` counted for the subscriptions of `s`, a copy that is not kept
        (the store refused its filters' holds, `hold_restored`): its filter users and shared
        group references. Unlike `remove_all`, nothing is deleted at the store (the session's
        offsets, a shared group's offset) and no hold is let go: none was taken for it."""
        users = self._filter_users
        for sub in s.subs.values():
            if T.is_wildcard(sub.queue):
                n = users.get(sub.queue, 0) - 1
                if n > 0:
                    users[sub.queue] = n
                else:
                    users.pop(sub.queue, None)
            if sub.group is None:
                continue
            for q in self.parts(sub.queue):
                g = self.groups.get((sub.group, q))
                if g is not None:
                    g.refs -= 1
                    if g.refs <= 0:
                        del self.groups[(g.name, g.queue)]
                        self.delivery.remove_group(g)
                        self.persist.forget_group(g)

    def _use_filter(self, q: str) -> None:
        if not T.is_wildcard(q):
            return
        n = self._filter_users.get(q, 0)
        if n == 0:
            p = self._prepared
            held = p.registered.pop(q, None) if p is not None else None
            if held is not None:
                held.wait()                 # registered ahead (its failure refused the SUBSCRIBE)
            else:
                if self.before_register is not None:
                    self.before_register()
                self.filters.register(q).wait()
        self._filter_users[q] = n + 1

    def _release_filter(self, q: str) -> None:
        if not T.is_wildcard(q):
            return
        n = self._filter_users.get(q, 0) - 1
        if n > 0:
            self._filter_users[q] = n
            return
        self._filter_users.pop(q, None)
        log_failure(self.filters.release(q), log, "unregister_filter_failed", filter=q)

    def _group(self, name: str, queue: str, restoring: bool = False) -> SharedGroup:
        key = (name, queue)
        g = self.groups.get(key)
        if g is None:
            off = None
            if restoring:
                consumer = group_consumer(name, queue)
                off = self._answer("offsets", (consumer, queue), lambda: self.offsets.get(consumer, queue))
            if off is None:
                off = self._answer("start", queue, lambda: self.store.start_offset(queue))
            g = SharedGroup(name, queue, off)
            self.groups[key] = g
            self.delivery.add_group(g)
            if not restoring:
                log_failure(self.offsets.set(g.consumer, {queue: off}), log, "save_group_offset_failed",
                            group=name)
        return g


def _part(sub: ClientSubscription, queue: str) -> ClientSubscription:
    """`sub` as the reader of `queue`, one of its parts (its own queue: `sub` itself; a shared
    one stays in its share group)."""
    if queue == sub.queue:
        return sub
    return ClientSubscription(sub.filter, queue, sub.qos, sub.group, sub.no_local, sub.retain_as_published,
                              sub.retain_handling, sub.subscription_id)
