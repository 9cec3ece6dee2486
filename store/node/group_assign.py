"""Shared groups balanced across a fleet: the store hands each message of a shared
group's light queue to ONE gateway at a time, POP-style (store/pop.py does the same for SDK
consumer groups; RocketMQ 5's POP in seed 000), and takes it back if that gateway goes away.

Why per message and not a lease of the whole group (what the fleet did before): members of
`$share/g/f` connected to different gateways must all take messages. A gateway asks for as many as
its members' QoS 1/2 windows have room for (`gw_group_pop`, at most `MAX_POP` at once); the store
answers at once with what it has (first messages handed back or taken from a lost gateway, then the
queue's new ones from `next`), or parks the request until the queue grows (long poll: the answer
is the delivery, no EVENT/pull round trip). Gateways waiting together are dealt new messages one
at a time in turn, oldest request first; while another gateway that asked within the last second
is busy (sending what it got), a waiting one takes no more than an even share of what is in flight
and available. So equal consumers get equal shares, and a gateway whose members take more
(acknowledge sooner, hold fewer) gets more. Each message handed out is in flight, owned by
that gateway, until the gateway acknowledges it (`gw_group_ack`, after the member's PUBACK /
PUBCOMP, or at once for QoS 0) or hands it back (its member left and no other member here can
take it).

Leases are per gateway, not per message: every request of a gateway renews it for `ttl_ms` (the
gateway sends `gw_group_renew` every safety poll). A gateway not heard of for that long (killed,
frozen, cut off) lapses: every message it held becomes visible again and goes to the other
gateways' members first (redelivered: MQTT 5 allows it for a member that left). So the lease time
bounds the redelivery delay after a `kill -9`. A gateway process that restarts under the same id
says so by a new `incarnation`: what the previous process held is given out again at once.

State per (group, queue), in memory: `next` (first offset never handed out), `inflight`
{offset: gateway}, `again` (offsets visible again, sorted) and the parked requests. The group's
committed offset - the lowest offset not acknowledged - is written to the light-queue metadata
(consumer `$share@store/{group}`, at most every `persist_s`) and is where a restarted store starts:
what was in flight at a store restart is delivered again (at least once). On a store group
member (`eager`, set by store/node/ha_member.py) the committed offset is written in the ack that
moved it, and the ack is answered once the in-sync replicas have it: a new primary starts the group
exactly after the messages acknowledged in order (those acknowledged above a message still in
flight come again, as after a restart). A group that every
gateway left (`gw_group_ack {leave}` when its last subscription there ends) is forgotten, so a new
one starts at the queue's end as on `lmqtt serve`.

Ordering: a gateway gets a group's messages in queue order, and hands them to its members in that
order, so each member receives its messages in publish order, except redelivered ones (after a
member or gateway left). Across members there is none (as MQTT shared subscriptions).
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import Any

log = logging.getLogger("lmqtt.store.node.group_assign")

MAX_POP = 256            # messages one pop may take
MAX_WAIT_MS = 30_000     # longest a pop is parked


def store_consumer(group: str) -> str:
    """The metadata consumer name under which the store keeps a fleet group's committed offset."""
    return f"$share@store/{group}"


class _Waiter:
    __slots__ = ("gid", "want", "got", "fut", "conn", "handle")

    def __init__(self, gid: str, want: int, fut, conn) -> None:
        self.gid = gid
        self.want = want
        self.got: list = []
        self.fut = fut
        self.conn = conn
        self.handle = None


class _Group:
    __slots__ = ("group", "queue", "next", "inflight", "again", "waiters", "gateways", "saved", "last_pop", "held")

    def __init__(self, group: str, queue: str, nxt: int) -> None:
        self.group = group
        self.queue = queue
        self.next = nxt
        self.inflight: dict[int, str] = {}      # offset -> gateway holding it
        self.again: list[int] = []              # sorted offsets visible again
        self.waiters: list[_Waiter] = []        # parked pops, oldest first
        self.gateways: set[str] = set()         # gateways that use the group (popped, not left or lapsed)
        self.saved: int | None = None           # committed offset last written
        self.last_pop: dict[str, float] = {}    # gateway -> when it last asked (monotonic)
        self.held: dict[str, int] = {}          # gateway -> messages of `inflight` it holds

    def committed(self) -> int:
        c = self.next
        if self.inflight:
            m = min(self.inflight)
            if m < c:
                c = m
        if self.again and self.again[0] < c:
            c = self.again[0]
        return c


class GroupAssignments:
    """The store node's side of fleet shared groups (answers gw_group_pop / ack / renew)."""

    def __init__(self, lq, loop, persist_s: float = 0.2, tick_s: float = 0.25) -> None:
        self.lq = lq
        self.meta = lq.metadata
        self.loop = loop
        self.persist_s = persist_s
        self.tick_s = tick_s
        self.groups: dict[tuple[str, str], _Group] = {}
        self.by_queue: dict[str, list[_Group]] = {}
        self.leases: dict[str, float] = {}          # gateway -> lease end (monotonic)
        self.incarnations: dict[str, str] = {}      # gateway -> its process's incarnation
        self._dirty: set[_Group] = set()
        self._persist_handle = None
        # write the committed offset in the call that moved it, not `persist_s` later (a group member)
        self.eager = False
        self._tick_handle = loop.call_later(tick_s, self._tick)
        # counters (/metrics, tests)
        self.handed_out = 0
        self.redelivered = 0
        self.lapsed = 0

    def close(self) -> None:
        if self._tick_handle is not None:
            self._tick_handle.cancel()
            self._tick_handle = None
        if self._persist_handle is not None:
            self._persist_handle.cancel()
            self._persist_handle = None
        self._persist()
        for g in self.groups.values():
            for w in g.waiters:
                self._answer(w)
            g.waiters.clear()

    # ------------------------------------------------------------------ requests
    def renew(self, gid: str, incarnation: str, ttl_ms: int) -> None:
        prev = self.incarnations.get(gid)
        if prev is not None and prev != incarnation:
            # the gateway restarted: what its previous process held goes to the others now
            log.info("event=group_gateway_restarted gateway=%s", gid)
            self._lapse(gid)
        self.incarnations[gid] = incarnation
        self.leases[gid] = time.monotonic() + max(0.2, ttl_ms / 1000.0)

    def pop(self, gid: str, incarnation: str, group: str, queue: str, max_count: int, start: int | None,
            ttl_ms: int, wait_ms: int, conn) -> Any:
        """-> the messages handed to `gid` now (a list), or a future of them (parked until the
        queue grows, or `wait_ms`: then an empty list)."""
        self.renew(gid, incarnation, ttl_ms)
        g = self._group(group, queue, start)
        g.gateways.add(gid)
        g.last_pop[gid] = time.monotonic()
        for old in [w for w in g.waiters if w.gid == gid]:     # one pop per gateway and group: the
            g.waiters.remove(old)                             # newer replaces it (answered empty)
            self._answer(old)
        fut = self.loop.create_future()
        w = _Waiter(gid, max(1, min(int(max_count), MAX_POP)), fut, conn)
        g.waiters.append(w)
        self._serve(g)
        if fut.done():
            return fut.result()
        wait_ms = min(int(wait_ms), MAX_WAIT_MS)
        if wait_ms <= 0:
            g.waiters.remove(w)
            return []
        w.handle = self.loop.call_later(wait_ms / 1000.0, self._expire_waiter, g, w)
        return fut

    def ack(self, gid: str, incarnation: str, group: str, queue: str, offsets: list[int], back: list[int],
            leave: bool, ttl_ms: int) -> int:
        """`offsets` are done (acknowledged by a member, or sent at QoS 0); `back` are handed back
        (visible again at once); `leave`: the gateway has no subscription to the group any more."""
        self.renew(gid, incarnation, ttl_ms)
        g = self.groups.get((group, queue))
        if g is None:
            g = self._load(group, queue)
            if g is None:
                return 0
        n = 0
        inflight = g.inflight
        held = g.held
        for off in offsets:
            owner = inflight.pop(off, None)
            if owner is not None:
                n += 1
                held[owner] = held.get(owner, 1) - 1
            else:
                n += self._drop_again(g, off)   # acked late, after it was given out again: done
        woke = False
        for off in back:
            if inflight.get(off) == gid:
                del inflight[off]
                held[gid] = held.get(gid, 1) - 1
                bisect.insort(g.again, off)
                woke = True
        if n or woke:
            self._mark(g)
        if leave:
            g.gateways.discard(gid)
            g.last_pop.pop(gid, None)
            for w in [w for w in g.waiters if w.gid == gid]:
                g.waiters.remove(w)
                self._answer(w)
            if not g.gateways:
                self._forget(g)
                return n
        if woke and g.waiters:
            self._serve(g)
        return n

    def on_names(self, names) -> None:
        """The notify bus: these queues have new entries. Parked pops of their groups are served."""
        bq = self.by_queue
        if not bq:
            return
        for q in names:
            gs = bq.get(q)
            if gs:
                for g in gs:
                    if g.waiters:
                        self._serve(g)

    def lost(self, conn) -> None:
        """A connection closed: its parked pops go (its gateway's messages stay its own until its
        lease lapses: a gateway that reconnects in time keeps them)."""
        for g in self.groups.values():
            if g.waiters:
                keep = []
                for w in g.waiters:
                    if w.conn is conn:
                        if w.handle is not None:
                            w.handle.cancel()
                        if not w.fut.done():
                            w.fut.cancel()
                    else:
                        keep.append(w)
                g.waiters = keep

    def info(self) -> list[dict]:
        return [{"group": g.group, "queue": g.queue, "next": g.next, "inflight": len(g.inflight),
                 "again": len(g.again), "waiting": len(g.waiters), "gateways": sorted(g.gateways),
                 "committed": g.committed()} for g in self.groups.values()]

    # ------------------------------------------------------------------ the work
    def _group(self, group: str, queue: str, start: int | None) -> _Group:
        g = self.groups.get((group, queue))
        if g is None:
            g = self._load(group, queue)
        if g is None:
            nxt = start if start is not None else self.lq.max_offset(queue)
            g = self._add(group, queue, int(nxt))
            self._mark(g)
            log.info("event=group_assignment_started group=%s queue=%s offset=%d", group, queue, g.next)
        return g

    def _load(self, group: str, queue: str) -> _Group | None:
        off = self.meta.get_offset(store_consumer(group), queue)
        if off is None:
            return None
        g = self._add(group, queue, int(off))
        g.saved = g.next
        return g

    def _add(self, group: str, queue: str, nxt: int) -> _Group:
        g = _Group(group, queue, nxt)
        self.groups[(group, queue)] = g
        self.by_queue.setdefault(queue, []).append(g)
        return g

    def _forget(self, g: _Group) -> None:
        self.groups.pop((g.group, g.queue), None)
        gs = self.by_queue.get(g.queue)
        if gs is not None:
            if g in gs:
                gs.remove(g)
            if not gs:
                del self.by_queue[g.queue]
        self._dirty.discard(g)
        self.meta.delete_offsets(store_consumer(g.group), [g.queue])
        log.info("event=group_assignment_ended group=%s queue=%s", g.group, g.queue)

    @staticmethod
    def _drop_again(g: _Group, off: int) -> int:
        a = g.again
        i = bisect.bisect_left(a, off)
        if i < len(a) and a[i] == off:
            del a[i]
            return 1
        return 0

    def _take(self, g: _Group, n: int) -> list:
        """Up to `n` messages nobody holds: first those visible again, then new ones from `next`."""
        out: list = []
        lq, q = self.lq, g.queue
        again = g.again
        while again and len(out) < n:
            off = again.pop(0)
            r = lq.pull(q, off, 1)
            if r.messages and r.messages[0].queue_offset == off:
                out.append(r.messages[0])
                self.redelivered += 1
            # else: gone (retention): nothing to deliver
        if len(out) < n:
            r = lq.pull(q, g.next, n - len(out), 4 << 20)
            if r.messages:
                out.extend(r.messages)
                g.next = r.messages[-1].queue_offset + 1
            elif r.next_offset > g.next:
                g.next = r.next_offset          # retention moved the start past it
                self._mark(g)
        return out

    def _serve(self, g: _Group) -> None:
        """Deal what is available to the parked pops of `g`, one message each in turn."""
        leases, now = self.leases, time.monotonic()
        live = []
        for w in g.waiters:
            if w.fut.done():
                continue
            if leases.get(w.gid, 0.0) < now:      # a lapsed gateway's request (frozen): not served
                self._answer(w)
                continue
            live.append(w)
        g.waiters = live
        if not live:
            return
        # a pop takes at most what it asked for; and while gateways that asked within the last
        # second are busy (sending what they got, not waiting now), those waiting take no more
        # than brings them to an even share of what is in flight and available: a burst would
        # otherwise go to whoever happens to be waiting, and a gateway whose members take more
        # (acknowledge sooner, so hold fewer) still gets more
        held = g.held
        limit = {w.gid: w.want for w in live}
        active = sum(1 for t in g.last_pop.values() if now - t < 1.0)
        if active > len(limit):
            avail = len(g.again) + max(0, self.lq.max_offset(g.queue) - g.next)
            fair = -(-(len(g.inflight) + avail) // active)
            for gid in limit:
                limit[gid] = min(limit[gid], max(0, fair - held.get(gid, 0)))
            if not any(limit.values()):
                least = min(limit, key=lambda gid: held.get(gid, 0))
                limit[least] = 1
        want = sum(limit.values())
        msgs = self._take(g, want)
        if not msgs:
            return
        inflight = g.inflight
        k, n = 0, len(live)
        for m in msgs:
            for _ in range(n):
                w = live[k]
                k = (k + 1) % n
                if len(w.got) < limit[w.gid]:
                    w.got.append(m)
                    inflight[m.queue_offset] = w.gid
                    held[w.gid] = held.get(w.gid, 0) + 1
                    break
        self.handed_out += len(msgs)
        self._mark(g)
        rest = []
        for w in live:
            if w.got:
                self._answer(w)
            else:
                rest.append(w)
        g.waiters = rest

    def _answer(self, w: _Waiter) -> None:
        if w.handle is not None:
            w.handle.cancel()
            w.handle = None
        if not w.fut.done():
            w.fut.set_result(w.got)

    def _expire_waiter(self, g: _Group, w: _Waiter) -> None:
        w.handle = None
        if w in g.waiters:
            g.waiters.remove(w)
        self._answer(w)

    def _lapse(self, gid: str) -> None:
        """Everything `gid` holds is visible again; its parked pops go."""
        self.leases.pop(gid, None)
        n = 0
        for g in list(self.groups.values()):
            mine = [off for off, owner in g.inflight.items() if owner == gid]
            for off in mine:
                del g.inflight[off]
                bisect.insort(g.again, off)
            n += len(mine)
            g.gateways.discard(gid)
            g.last_pop.pop(gid, None)
            g.held.pop(gid, None)
            if g.waiters:
                for w in [w for w in g.waiters if w.gid == gid]:
                    g.waiters.remove(w)
                    self._answer(w)
            if mine:
                self._mark(g)
                if g.waiters:
                    self._serve(g)
        if n:
            self.lapsed += n
        log.info("event=group_gateway_lapsed gateway=%s messages_given_out_again=%d", gid, n)

    def _tick(self) -> None:
        try:
            now = time.monotonic()
            for gid, until in list(self.leases.items()):
                if until < now:
                    self._lapse(gid)
        finally:
            self._tick_handle = self.loop.call_later(self.tick_s, self._tick)

    # ------------------------------------------------------------------ the committed offset
    def _mark(self, g: _Group) -> None:
        if self.eager:
            self._dirty.discard(g)
            self._write(g)
            return
        self._dirty.add(g)
        if self._persist_handle is None:
            self._persist_handle = self.loop.call_later(self.persist_s, self._persist_later)

    def reset(self) -> None:
        """Forget every group's in-memory state (a store group member changing role): a new
        primary starts each group from its replicated committed offset, and a deposed one keeps no
        assignments of its own for a later term. Parked pops are answered with nothing."""
        for g in self.groups.values():
            for w in g.waiters:
                self._answer(w)
            g.waiters.clear()
        self.groups.clear()
        self.by_queue.clear()
        self._dirty.clear()
        self.leases.clear()
        self.incarnations.clear()

    def _persist_later(self) -> None:
        self._persist_handle = None
        self._persist()

    def _persist(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for g in dirty:
            self._write(g)

    def _write(self, g: _Group) -> None:
        c = g.committed()
        if c != g.saved:
            try:
                self.meta.set_offsets(store_consumer(g.group), {g.queue: c})
                g.saved = c
            except Exception as e:  # noqa: BLE001 - written again at its next change
                # (a deposed primary refuses writes: its successor starts from the last
                # replicated offset, so at worst messages come again, none is lost)
                log.warning("event=group_offset_write_failed group=%s queue=%s error=%s", g.group, g.queue, e)
