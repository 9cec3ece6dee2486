"""Delivery: notify events -> pull from light queues at each session's offset -> PUBLISH.

Why pull and not push-per-message (RocketMQ-MQTT's push-pull model): the notify bus only says
*which* queues have new entries. For every such queue with local readers we group the online sessions by their
cursor and do ONE `lq.pull` per distinct offset (sessions that keep up share an offset, so a
broadcast to N clients costs one read), decode each message once (`OutboundMessage`), encode each PUBLISH
variant once, and only patch packet ids per subscriber. Offsets advance only as far as what was
acknowledged, so anything not sent (window full, socket above its high-water mark, client offline)
simply stays in the store and is pulled later.

Reads through the `QueueStore` facade (gateway/storage/facades.py) return `Answer`s: in-process
and from a remote store's mirror they are done at once and taken as values (the hot path); one
that is not (a remote reader behind the mirror, a queue not mirrored yet) is left for this run and
its queue is examined again when the answer is in (`_later`): the engine never waits, and never
asks which implementation it holds.

Back-pressure: a session whose socket is above the high-water mark is not pulled for: its offsets
stay and it reads on when the socket drains. A QoS 0 subscription further behind its queue's end
than `max_qos0_backlog` skips the older ones and keeps that many of the newest, counted in
`lmqtt_dropped_messages{reason="qos0_backpressure"}`; QoS 1/2 keep their offset and wait.

Overlapping subscriptions of one client (e.g. `a/+` and `a/#`): the message sits in both queues; it
is delivered once, from the "owner" queue = the matching subscription with the highest QoS (ties:
smallest queue name), at that QoS. This is MQTT 3.1.1 §3.3.5 behaviour; for MQTT 5 we chose the
same single delivery (allowed by §3.3.4: the server may deliver once with the maximum QoS).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from lmqtt.gateway.delivery.recent import RecentMessages
from lmqtt.gateway.storage.record_props import MetaCache
from lmqtt.gateway.delivery.history import HistoryRun, HistoryRuns
from lmqtt.gateway.delivery.retained import is_sys_filter
from lmqtt.store.errors import StoreError
from lmqtt.gateway.session import OVER, QOS2_SENT, ClientSubscription, MqttSession, OutboundMessage

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.subscriptions.shared_groups import SharedGroup
    from lmqtt.gateway.storage.facades import QueueStore

log = logging.getLogger("lmqtt.gateway.delivery.engine")


def _itself(queue: str) -> tuple[str, ...]:
    return (queue,)


def store_side(e: BaseException) -> bool:
    """A read the store refused or could not serve (its errors, an ERROR frame's code, a lost
    link), as opposed to a fault of this process: the former is retried, the latter logged whole."""
    return isinstance(e, (StoreError, ConnectionError, OSError)) or isinstance(getattr(e, "code", None), int)

class DeliveryEngine:
    """Pulls new light-queue entries for online readers and sends them.

    It decides what goes to whom (which queues to read, one pull per distinct cursor, fan-out,
    overlapping subscriptions, shared groups) and offers each session its batch; the session
    machine (gateway/session/) decides what of it is sent - window, packet ids, per-subscriber
    encoding, cursor moves - and writes the frames to the connection handed in (`_feed_session`;
    a single reader's backlog as PUBLISH runs: `_feed_records`). It calls back through three
    narrow callables: `session_offsets_moved(session)` and `group_offsets_moved(group)` mark
    offsets for the next metadata flush, `flush_writes()` writes the connections' queued output at
    the end of a run. It composes `RecentMessages` (gateway/delivery/recent.py: the messages this
    gateway just appended, served without a pull) and `HistoryRuns` (gateway/delivery/history.py:
    subscriptions from the past sending their history).
    """

    # `qos2_sent(session)`: a batch of new QoS 2 PUBLISHes was queued to a persistent session's
    # connection (broker/broker.py: written ahead before they leave); None: nothing to do
    qos2_sent: Callable[[MqttSession], None] | None = None
    # (queue, offset) -> Answer of the message: what a session being resumed had in flight,
    # asked for with it (SubscriptionRegistry.prepare_resume); None otherwise
    at_hand: dict | None = None

    def __init__(self, store: "QueueStore", loop, metrics, cfg, *,
                 session_offsets_moved: Callable[[MqttSession], None],
                 group_offsets_moved: Callable[["SharedGroup"], None],
                 flush_writes: Callable[[], None], acl=None) -> None:
        self.store = store
        self.loop = loop
        self.metrics = metrics
        self.cfg = cfg
        # AclFile when --acl-file is configured: read rules checked per delivery and per history message
        self.acl = acl
        self._session_offsets_moved = session_offsets_moved
        self._group_offsets_moved = group_offsets_moved
        self._flush_writes = flush_writes
        self.direct: dict[str, MqttSession | set[MqttSession]] = {}   # queue -> online sessions reading it (`add_reader`)
        self.groups: dict[str, dict[str, "SharedGroup"]] = {}   # queue -> group name -> group
        # the keys of `direct` and `groups` whose first level is `$SYS`: the only queues a `$SYS`
        # value can reach (SysRetained.publish), kept here so a tick does not walk every device's
        # filter (a million of them took seconds of each 10 s `$SYS` interval)
        self.sys_queues: set[str] = set()
        # the queues a shared subscription reads: itself, or over several store groups one per
        # group for a filter whose first level is a wildcard (SubscriptionRegistry.parts)
        self.parts: Callable[[str], tuple[str, ...]] = _itself
        self.on_group_added: Callable[["SharedGroup"], None] | None = None   # fleet: group leases
        self.on_group_removed: Callable[["SharedGroup"], None] | None = None
        self._dirty: set[str] = set()
        self._scheduled = False
        self._outbound: dict[int, OutboundMessage] = {}               # phys offset -> OutboundMessage, per run
        self._budget = self.run_budget      # messages this run may still read at backlog_batch
        # props bytes -> decoded RecordMeta, each distinct value decoded once (record_props.MetaCache)
        self._metas = MetaCache()
        # the newest entries of queues with local readers, from the records the loop appended
        # itself, served without a pull (gateway/delivery/recent.py); bounded to a quarter of lq_cache_mb.
        # `record_appended` (the publish pipeline's callback) and `drop_recent` are its methods,
        # bound here: no call level added.
        self.recent = RecentMessages(store, metrics, self.direct, self._meta_of, self._outbound_message,
                                     max_bytes=(int(self.cfg.lq_cache_mb) << 20) // 4)
        self.record_appended = self.recent.record_appended
        self._ends = self.recent.ends          # the ends record_appended just read (see there)
        self.drop_recent = self.recent.drop
        # subscriptions from the past still sending their history (gateway/delivery/history.py); the session
        # reads those queues live only once their history is sent. `histories` is its dict
        # (session -> [HistoryRun], read by the subscription registry), `has_history` and
        # `drop_history` its methods, bound here.
        self._histories = HistoryRuns(loop, cfg, kick=self.kick, go_live=self._history_done)
        self.histories = self._histories.by_session
        self.has_history = self._histories.has
        self.drop_history = self._histories.drop

    # -- index maintenance -------------------------------------------------------------------
    def add_reader(self, s: MqttSession, queue: str) -> None:
        # one reader (a device on a topic of its own: most queues) is the session itself, which
        # iterates as its one reader (`Session.__iter__`), not a set (216 bytes per idle device) or
        # a 1-tuple (48); a set from the second reader on. Every reader of `direct` only
        # iterates its values or asks `q in direct`.
        d = self.direct
        ss = d.get(queue)
        if ss is None:
            d[queue] = s
            if queue.startswith("$SYS"):
                self._sys_queue_added(queue)
        elif ss.__class__ is not set:
            if ss is not s:
                d[queue] = {ss, s}
        else:
            ss.add(s)

    def remove_reader(self, s: MqttSession, queue: str) -> None:
        d = self.direct
        ss = d.get(queue)
        if ss is None:
            return
        if ss.__class__ is not set:
            if ss is not s:
                return
        else:
            ss.discard(s)
            if len(ss) == 1:
                d[queue] = next(iter(ss))
            if ss:
                return
        del d[queue]
        self.drop_recent(queue)
        if queue in self.sys_queues and queue not in self.groups:
            self.sys_queues.discard(queue)

    def add_group(self, g: "SharedGroup") -> None:
        self.groups.setdefault(g.queue, {})[g.name] = g
        self._sys_queue_added(g.queue)
        if self.on_group_added is not None:
            self.on_group_added(g)

    def remove_group(self, g: "SharedGroup") -> None:
        gs = self.groups.get(g.queue)
        if gs is not None:
            gs.pop(g.name, None)
            if not gs:
                del self.groups[g.queue]
                if g.queue not in self.direct:
                    self.sys_queues.discard(g.queue)
        if self.on_group_removed is not None:
            self.on_group_removed(g)

    def _sys_queue_added(self, queue: str) -> None:
        if is_sys_filter(queue):
            self.sys_queues.add(queue)

    # -- triggers ----------------------------------------------------------------------------
    def on_queues(self, names: set[str]) -> None:
        """Notify-bus callback (on the loop): merged names of queues with new entries."""
        self.metrics.notify_events += 1
        self.metrics.notify_queues += len(names)
        d, g = self.direct, self.groups
        hit = [q for q in names if q in d or q in g]
        if hit:
            self._dirty.update(hit)
            # run now, not one loop iteration later: the data is visible, and every iteration a
            # message waits costs latency on a busy loop (a pending scheduled _run then finds
            # less or nothing to do)
            self._run()

    def kick(self, s: MqttSession) -> None:
        """Re-examine every queue `s` reads (after connect, an ack or the socket draining)."""
        if self.histories and self._histories.mark(s):
            self._schedule()
        d = self._dirty
        d.update(s.cursors)
        # some subscriptions may be shared ($share/...): `direct` is `subs` only while every one
        # is plain (counting cursors cannot tell: over several store groups a wildcard first
        # level has a cursor per group, as many as a shared subscription beside it lacks)
        if s.direct is not s.subs:
            for sub in s.subs.values():
                if sub.group:
                    d.update(self.parts(sub.queue))
        if d and not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._run)

    def kick_queue(self, queue: str) -> None:
        self._dirty.add(queue)
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._run)

    # -- the work ------------------------------------------------------------------------------
    def _run(self) -> None:
        self._scheduled = False
        histories = self._histories
        if histories.marked:
            histories.run()
        work, self._dirty = self._dirty, set()
        self._outbound = {}
        self._budget = self.run_budget
        for q in work:
            try:
                more = False
                if q in self.direct:
                    more |= self._deliver_direct(q)
                gs = self.groups.get(q)
                if gs:
                    for g in list(gs.values()):
                        more |= self._deliver_group(g)
                if more:          # a full batch was read: continue next loop iteration (fairness)
                    self._dirty.add(q)
            except Exception as e:
                if store_side(e):
                    # the store could not answer a read (it is away, or its tier is unreachable):
                    # one line naming the cause, the queue examined again a second later
                    log.warning("event=store_read_failed queue=%s error=%s (again in 1 s)", q, e)
                    self.loop.call_later(1.0, self.kick_queue, q)
                else:
                    log.exception("event=delivery_failed queue=%s", q)
        self._outbound = {}
        if self._dirty or histories.marked:
            self._schedule()
        self._flush_writes()

    # -- history of subscriptions from the past (gateway/delivery/history.py) ----------------------------
    def start_history(self, s: MqttSession, sub: ClientSubscription, plan) -> None:
        """`s` is sent `sub`'s history first, as `plan` (a "log" ReplayPlan) reads it, with this
        engine's props cache and the ACL's read rules (a `HistoryRun`); its queue is read live
        (the session becomes a reader at the seam) when the history is done."""
        self.remove_reader(s, sub.queue)
        self._histories.start(HistoryRun(s, sub, plan, self._meta_of, self.acl))
        self._schedule()

    def _history_done(self, s: MqttSession, queue: str) -> None:
        self.add_reader(s, queue)
        self._dirty.add(queue)

    def trim_backlog(self, s: MqttSession, keep: int) -> int:
        """A session that comes back keeps at most its newest `keep` messages per subscription
        (`max_offline_backlog`): a cursor further behind its queue's end skips the older ones,
        counted as dropped (`reason="offline_backlog"`). A subscription still sending its history
        from the past is left alone. Returns how many were skipped."""
        skipped = 0
        for q, cur in s.cursors.items():
            if self.has_history(s, q):
                continue
            end = self.store.end_offset(q)
            if end.done():
                skipped += self._trim_cursor(cur, end.result() - keep)
            else:               # not known here yet (remote): trimmed when the store answers
                end.add_done_callback(lambda a, s=s, q=q, cur=cur: self._trim_later(s, q, cur, a, keep))
        if skipped:
            self._trimmed(s, skipped, keep)
        return skipped

    @staticmethod
    def _trim_cursor(cur, start: int) -> int:
        if cur.next_offset < start:
            n = start - cur.next_offset
            cur.next_offset = start
            return n
        return 0

    def _trim_later(self, s: MqttSession, q: str, cur, end, keep: int) -> None:
        if end.exception() is not None or s.cursors.get(q) is not cur or self.has_history(s, q):
            return
        n = self._trim_cursor(cur, end.result() - keep)
        if n:
            self._trimmed(s, n, keep)

    def _trimmed(self, s: MqttSession, skipped: int, keep: int) -> None:
        self.metrics.dropped_offline_backlog.inc(skipped)
        self._session_offsets_moved(s)
        log.info("event=offline_backlog_trimmed client_id=%s dropped=%d keep=%d", s.client_id, skipped, keep)

    # -- records in hand -----------------------------------------------------------------------
    def message_at(self, q: str, off: int) -> OutboundMessage | None:
        """The message at `off` in queue `q` read again (a session's exchange in flight resumed
        after a restart, `MqttSession.restore`): asked for with the session it resumes
        (`at_hand`, set while a resumed session is decided: SubscriptionRegistry.deciding), else
        asked now; None when it is no longer stored, or its answer is not in (it is then
        delivered again as a new one)."""
        hand = self.at_hand
        a = hand.pop((q, off), None) if hand else None
        if a is None:
            a = self.store.message_at(q, off)
        m = a.result() if a.done() else None
        return None if m is None else self._outbound_message(m)

    def _meta_of(self, props: bytes):
        """The RecordMeta (QoS, retain, publisher, MQTT 5 properties) of a record's props bytes."""
        return self._metas[props]

    def _outbound_message(self, m) -> OutboundMessage:
        """The OutboundMessage of pulled record `m`, one per record and queue offset in a run."""
        it = self._outbound.get(m.phys_offset)
        if it is None or it.topic != m.topic:       # another store group's record at that position
            rec = self._meta_of(m.props)
            dq = m.dispatch_queues
            it = OutboundMessage(m.topic, m.body, rec, m.queue_offset, m.phys_offset,
                      dq if type(dq) is tuple else tuple(dq or ()), m.store_ts)
            self._outbound[m.phys_offset] = it
        else:
            it = it.at_offset(m.queue_offset)     # the same record reached through another queue
        return it

    # Messages one delivery run reads for one cursor: what its readers can take (a QoS 1/2
    # window's room), at most `backlog_batch` shared by the readers at that offset (never less
    # than `pull_batch`). Why not `pull_batch` (64) always: a reader far behind - an offline
    # session's backlog on reconnect - then took one loop iteration, one pull and one socket write
    # per 64 messages, and each write (a wake-up of the peer on loopback) cost about as much as
    # encoding the 64 messages. A run stays bounded: once it has sent `run_budget` messages the
    # rest of it reads `pull_batch` again (many sessions reconnecting at once do not hold the loop
    # for seconds), and the socket's high-water mark bounds bytes (_feed_session); a fan-out (many
    # readers at one offset) reads `pull_batch` as before; shared groups always do.
    backlog_batch = 1024
    run_budget = 8192

    def _outbound_messages(self, msgs: list) -> list[OutboundMessage]:
        """`[self._outbound_message(m) for m in msgs]` in one loop: a backlog pull hands over up to
        `backlog_batch` records, and a method call per record was a noticeable part of a
        reconnecting session's delivery. (`msgs` are StoredMessages, or the remote store's
        RemoteMessages: fields read by name.)"""
        known = self._outbound
        get = known.get
        metas = self._metas
        out = []
        append = out.append
        for m in msgs:
            phys = m.phys_offset
            it = get(phys)
            # keyed by CommitLog position: a record read through several queues is one object. A
            # gateway over several store groups reads logs that each count their own positions; a
            # topic lives in one group, so a hit of another topic is another group's record
            if it is None or it.topic != m.topic:
                props = m.props
                rec = metas.get(props)
                if rec is None:
                    rec = self._meta_of(props)
                dq = m.dispatch_queues
                it = known[phys] = OutboundMessage(m.topic, m.body, rec, m.queue_offset, phys,
                                                   dq if type(dq) is tuple else tuple(dq or ()), m.store_ts)
            else:
                it = self._outbound_message(m)
            append(it)
        return out

    def _pull(self, q: str, offset: int, count: int | None = None):
        """The pull's result, or None when its answer is not in yet (`_later` wakes the queue)."""
        self.metrics.pulls += 1
        if count is None:
            count = self.cfg.pull_batch
        elif count > self.backlog_batch:
            count = self.backlog_batch
        a = self.store.pull(q, offset, max_count=count, max_bytes=self.cfg.pull_max_bytes)
        if a.done():
            return a.result()
        self._later(q, a)
        return None

    def _later(self, q: str, answer) -> None:
        """`answer` (a read of queue `q`) is not in: examine `q` again when it is; if it failed
        (the store away), a second later."""
        def ready(a) -> None:
            e = a.exception()
            if e is None:
                self.kick_queue(q)
            else:
                log.warning("event=store_read_failed queue=%s error=%s (again in 1 s)", q, e)
                self.loop.call_later(1.0, self.kick_queue, q)
        answer.add_done_callback(ready)

    def _deliver_direct(self, q: str) -> bool:
        maxo = self._ends.get(q)     # read by record_appended in this append's chain: not asked twice
        if maxo is None:
            a = self.store.max_offset(q)
            if not a.done():
                self._later(q, a)
                return False
            maxo = a.result()
        by_off: dict[int, list[MqttSession]] = {}
        want: dict[int, int] = {}
        batch = self.backlog_batch
        lo = maxo                 # the lowest cursor among the readers
        top = -1                  # the highest (RecentMessages: is a ring of q worth feeding)
        for s in self.direct.get(q, ()):
            cur = s.cursors.get(q)
            if cur is None:
                continue
            if cur.next_offset > top:
                top = cur.next_offset
            if cur.next_offset >= maxo:
                continue
            if cur.next_offset < lo:
                lo = cur.next_offset
            conn = s.conn
            if conn is None:
                continue
            if conn.write_blocked:
                # a QoS 0 subscription of a client that reads slower than its messages come waits
                # in the store (nothing is buffered for it) while it is at most max_qos0_backlog
                # behind; further behind, the older ones are skipped and it keeps the newest
                # max_qos0_backlog (MQTT lets a broker drop QoS 0; the log makes waiting free,
                # where Mosquitto holds them in memory); one whose answer waits for the store
                # (`wait_for_store`) only waits: it reads on after
                sub = s.direct.get(q)
                keep = self.cfg.max_qos0_backlog
                if conn.transport_full and sub is not None and sub.qos == 0 and not cur.busy() \
                        and maxo - cur.next_offset > keep:
                    skipped = maxo - keep - cur.next_offset
                    cur.next_offset = maxo - keep
                    self.metrics.dropped_qos0_backpressure.inc(skipped)
                    self._session_offsets_moved(s)
                continue
            sub = s.direct.get(q)
            if sub is not None and sub.qos:
                room = s.window_room()
                if room <= 0:
                    continue
            else:
                room = batch
            off = cur.next_offset
            lst = by_off.get(off)
            if lst is None:
                by_off[off] = [s]
                want[off] = room
            else:
                lst.append(s)
                if room > want[off]:
                    want[off] = room
        more = False
        rm = self.recent
        recent = rm.rings.get(q)        # [first queue offset, messages] (gateway/delivery/recent.py)
        if top >= 0:
            if top < maxo - rm.gap_max:
                if q not in rm.lagging:
                    rm.lagging_behind(q)         # no reader is near a ring: none is fed
                    recent = None
            elif q in rm.lagging:
                rm.caught_up(q)
        if recent is not None and lo > recent[0]:
            rm.drop_passed(recent, lo)  # every reader is past these
        small = self.cfg.pull_batch
        for off, sessions in by_off.items():
            # never read more than the roomiest reader at this offset can take: a QoS 1 window
            # with 10 free slots must not pull (and build messages for) 64 messages it cannot send
            cap = batch // len(sessions) if self._budget > 0 else small
            if cap < small:
                cap = small
            n = want[off] if want[off] < cap else cap
            self._budget -= n * len(sessions)
            if recent is not None and recent[0] <= off < recent[0] + len(recent[1]):
                # the records are in hand (RecentMessages.record_appended): no pull
                i = off - recent[0]
                messages = recent[1][i:i + n]
                nxt = off + len(messages)
            else:
                res = self._pull(q, off, n)
                if res is None:
                    continue            # on its way: the queue is examined again when it is in
                msgs = res.messages
                nxt = res.next_offset
                if not msgs:
                    # nothing readable at `off` (retention moved the start, or not yet visible)
                    if nxt > off:
                        for s in sessions:
                            s.cursors[q].next_offset = nxt
                            self._session_offsets_moved(s)
                    continue
                if len(sessions) == 1 and self._runnable(sessions[0], q):
                    # one reader at this offset (an offline session's backlog on reconnect)
                    if self._feed_records(sessions[0], q, msgs, nxt):
                        more = True
                    if nxt < maxo:
                        more = True
                    continue
                messages = self._outbound_messages(msgs)
            for s in sessions:
                if self._feed_session(s, q, messages, nxt):
                    more = True
            if nxt < maxo:
                more = True
        return more

    def _feed_session(self, s: MqttSession, q: str, messages: list[OutboundMessage], next_offset: int) -> bool:
        """Offer `s` one pulled batch of queue `q` (the session machine sends what its window and
        the byte budget let it: `MqttSession.offer`); True when the byte budget stopped it."""
        conn = s.conn
        if conn is None or conn.write_blocked:
            return False
        # ACL read rules: only subscriptions overlapping a denied area pay a check per message
        rc = conn.read_checks
        can_read = None
        if rc is not None and q in rc:
            ident, acl = conn.identity, self.acl
            can_read = lambda topic: acl.can_read(ident, topic)     # noqa: E731
        return self._offered(s, s.offer(q, messages, next_offset, conn.write, self.metrics,
                                        self.cfg.write_high_water, can_read))

    @staticmethod
    def _runnable(s: MqttSession, q: str) -> bool:
        """Whether `s` can take queue `q`'s records as runs: its socket takes writes, no ACL read
        check on `q`, and the session machine says so (`takes_runs`: no per-subscriber parts)."""
        conn = s.conn
        if conn is None or conn.write_blocked:
            return False
        rc = conn.read_checks
        return not (rc is not None and q in rc) and s.takes_runs(q)

    def _feed_records(self, s: MqttSession, q: str, msgs: list, next_offset: int) -> bool:
        """Offer `s`, the one reader of `q` at this cursor, pulled records `msgs` as PUBLISH runs
        (`MqttSession.offer_records`: no OutboundMessage per plain message)."""
        conn = s.conn
        return self._offered(s, s.offer_records(q, msgs, next_offset, conn.write, conn.flush, self.metrics,
                                                self.cfg.write_high_water, self._metas, self._meta_of,
                                                self._outbound_message))

    def _offered(self, s: MqttSession, flags: int) -> bool:
        """What an offer asks of the driver: a persistent session's offsets written by the next
        flush, its new QoS 2 PUBLISHes held until its record is written (`qos2_sent`); True when
        the byte budget stopped it (the rest at the next run, or after the socket drained)."""
        if s.expiry_interval:
            self._session_offsets_moved(s)
            if flags & QOS2_SENT and self.qos2_sent is not None:
                self.qos2_sent(s)     # the batch's QoS 2 PUBLISHes leave once their state is durable
        return bool(flags & OVER)

    def _deliver_group(self, g: "SharedGroup") -> bool:
        f = g.fleet
        if f is not None:          # a fleet gateway: the store hands it the group's messages (gateway/fleet/group_leases.py)
            return f.deliver(g, self._send_group)
        # 1. messages taken back from members that left
        while g.redeliver:
            pick = g.pick()
            if pick is None:
                return False
            it = g.redeliver.popleft()
            self._send_group(g, pick[0], pick[1], it)
        a = self.store.max_offset(g.queue)
        if not a.done():
            self._later(g.queue, a)
            return False
        maxo = a.result()
        cur = g.cursor
        if cur.next_offset >= maxo or not g.members:
            return False
        if not any(g.can_take(s) for s, _ in g.members):
            return False
        res = self._pull(g.queue, cur.next_offset)
        if res is None:
            return False                # on its way: the queue is examined again when it is in
        if not res.messages:
            if res.next_offset > cur.next_offset:
                cur.next_offset = res.next_offset
                self._group_offsets_moved(g)
            return False
        for m in res.messages:
            if m.queue_offset < cur.next_offset:
                continue
            pick = g.pick()
            if pick is None:
                break
            cur.next_offset = m.queue_offset + 1
            self._send_group(g, pick[0], pick[1], self._outbound_message(m))
        else:
            if cur.next_offset < res.next_offset:
                cur.next_offset = res.next_offset
        self._group_offsets_moved(g)
        return cur.next_offset < maxo and any(g.can_take(s) for s, _ in g.members)

    def _send_group(self, g: "SharedGroup", s: MqttSession, sub: ClientSubscription, it: OutboundMessage) -> None:
        conn = s.conn
        if conn is not None and conn.read_checks is not None and g.queue in conn.read_checks \
                and not self.acl.can_read(conn.identity, it.topic):
            return      # withheld by the ACL: the group's cursor has passed it
        qos = min(sub.qos, it.record.qos)
        retain = it.record.retain if sub.retain_as_published else False
        if not it.sent:
            it.sent = True
            if it.store_ts:
                self.metrics.first_sent([it.store_ts])
        pid = s.send(it, qos, retain, conn.write, self.metrics, group=g,
                     sub_ids=(sub.subscription_id,) if sub.subscription_id and s.version == 5 else None)
        off = it.queue_offset
        if pid is None or pid is False:       # QoS 0, or dropped for this client (expired / too large)
            g.cursor.release(off)
        else:
            g.cursor.hold(off, s)
