"""Subscribing from the past (docs/gateway.md "Subscribing from the past"), gateway side.

How a client asks: an MQTT 5 SUBSCRIBE with the user property `since` (epoch milliseconds, or an
RFC 3339 time such as `2026-11-23T08:00:00Z`), applying to every filter of that SUBSCRIBE; or, for
MQTT 3.1.1 clients (which have no properties), the filter `$replay/{epoch-ms}/{filter}`. The
subscription is then the filter's own (UNSUBSCRIBE names the filter, with or without the
`$replay/{ms}/` prefix).

What the store says (`QueueStore.replay_plan`, lightqueue/replay.py): either the light queue
holds the whole period (the cursor simply starts in the past: delivery as usual), or the history is
read from the log up to a seam and the light queue continues from the seam. In the second case the
session's cursor waits at the seam (it is not a delivery reader yet) while a `HistoryRun` sends
the history, window and socket permitting; when the history is done the cursor becomes a reader
and live delivery continues from the seam: nothing between, nothing twice. The delivery engine
drives the runs through `HistoryRuns` (which sessions to pump, and the hand-over to live reading).

History messages are sent like retained ones (no queue offset; QoS 1/2 in the session's window,
acked without moving a cursor); the session's cursor is persisted at the seam, so what survives a
restart or a move to another gateway is the live part: history not yet sent is not resumed then.
"""
from __future__ import annotations

import logging
import time
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Callable

from lmqtt.gateway.mqtt import encode_publish_run
from lmqtt.gateway.session import TOO_LARGE, OutboundMessage, MqttSession, ClientSubscription

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.storage.facades import ReplayPlan

log = logging.getLogger("lmqtt.gateway.delivery.history")

REPLAY_PREFIX = "$replay/"


class ReplayRequestError(ValueError):
    """A malformed `since` or `$replay/` filter (refused in SUBACK with this message)."""


def parse_since(value: str) -> int:
    """Epoch milliseconds (digits) or an RFC 3339 / ISO 8601 time with an offset -> epoch ms."""
    v = value.strip()
    if v.isdigit():
        return int(v)
    try:
        dt = datetime.fromisoformat(v.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ReplayRequestError(f"since {value!r} is neither epoch milliseconds nor an RFC 3339 time") from None
    if dt.tzinfo is None:
        raise ReplayRequestError(f"since {value!r} has no time zone offset (RFC 3339 needs one, e.g. Z)")
    return int(dt.timestamp() * 1000)


def since_property(props) -> int | None:
    """The `since` user property of an MQTT 5 SUBSCRIBE, in epoch ms (None when absent)."""
    ups = getattr(props, "user_property", None) if props is not None else None
    if not ups:
        return None
    for k, v in ups:
        if k == "since":
            return parse_since(v)
    return None


def split_replay_filter(topic_filter: str) -> tuple[int, str] | None:
    """`$replay/{epoch-ms}/{filter}` -> (ms, filter); None for any other filter."""
    if not topic_filter.startswith(REPLAY_PREFIX):
        return None
    ms, sep, flt = topic_filter[len(REPLAY_PREFIX):].partition("/")
    if not sep or not ms.isdigit() or not flt:
        raise ReplayRequestError(f"{topic_filter!r}: the form is $replay/{{epoch-ms}}/{{filter}}")
    return int(ms), flt


def plain_filter(topic_filter: str) -> str:
    """The subscription key of a filter as an UNSUBSCRIBE may name it (`$replay/{ms}/` stripped)."""
    try:
        r = split_replay_filter(topic_filter)
    except ReplayRequestError:
        return topic_filter
    return topic_filter if r is None else r[1]


class HistoryRuns:
    """The subscriptions from the past still sending their history: session -> [HistoryRun].

    The delivery engine owns one and drives it: `start` a run (its session is then not a reader of
    the queue: the cursor waits at the seam), `mark` a session to examine (the engine's `kick`:
    after an ack, the socket draining, a reconnect), `run` the marked ones in each delivery run.
    A finished history hands its queue to live delivery through `go_live(session, queue)`, when the
    session is online and still subscribed. `kick(session)` is the engine's: it is called when a
    chunk of a remote history comes in, and a second after a history failed to read.
    """

    def __init__(self, loop, cfg, *, kick: Callable[[MqttSession], None],
                 go_live: Callable[[MqttSession, str], None]) -> None:
        self.loop = loop
        self.cfg = cfg
        self._kick = kick
        self._go_live = go_live
        self.by_session: dict[MqttSession, list[HistoryRun]] = {}
        self.marked: set[MqttSession] = set()        # sessions to examine at the next `run`

    def start(self, run: "HistoryRun") -> None:
        """Send `run`'s history from the next `run` on (the caller schedules one)."""
        s = run.session
        run.plan.on_ready = partial(self._kick, s)     # a chunk of a remote history came in
        self.by_session.setdefault(s, []).append(run)
        self.marked.add(s)

    def mark(self, s: MqttSession) -> bool:
        """Examine `s` at the next `run` if it has a history under way; whether it has."""
        if s in self.by_session:
            self.marked.add(s)
            return True
        return False

    def has(self, s: MqttSession, queue: str) -> bool:
        runs = self.by_session.get(s)
        return runs is not None and any(r.queue == queue for r in runs)

    def drop(self, s: MqttSession, queue: str | None = None) -> None:
        """The subscription went (unsubscribe; every one of `s` when `queue` is None, the session
        ended): its unsent history with it."""
        runs = self.by_session.get(s)
        if runs is None:
            return
        runs[:] = [r for r in runs if queue is not None and r.queue != queue]
        if not runs:
            del self.by_session[s]
            self.marked.discard(s)

    def run(self) -> None:
        """Pump the histories of the marked sessions; a session whose history could send more at
        once stays marked (the caller schedules another delivery run while `marked` is not empty)."""
        work, self.marked = self.marked, set()
        for s in work:
            runs = self.by_session.get(s)
            if not runs:
                continue
            for run in list(runs):
                try:
                    more = run.pump(self.cfg.write_high_water)
                except Exception as e:
                    # the store failed mid-history (e.g. the remote store is away): try again in a
                    # second, from where it stopped (the cursor waits at the seam meanwhile)
                    log.error("event=replay_history_failed client_id=%s filter=%s sent=%d error=%r "
                              "(retried in 1 s)", s.client_id, run.queue, run.sent, e)
                    self.loop.call_later(1.0, self._kick, s)
                    continue
                if run.finished():
                    runs.remove(run)
                    log.info("event=replay_history_done client_id=%s filter=%s sent=%d", s.client_id,
                             run.queue, run.sent)
                    if s.online and s.cursors.get(run.queue) is not None:
                        self._go_live(s, run.queue)
                elif more:
                    self.marked.add(s)
            if not runs:
                self.by_session.pop(s, None)


class HistoryRun:
    """Sends one subscription's history (a "log" plan) to its session; `HistoryRuns` then hands
    its queue over to live delivery. Pumped in each delivery run that examines the session."""

    read_batch = 1024          # messages per history read from the store
    send_batch = 1024          # messages sent per delivery run (fairness with other sessions)
    reads_per_run = 4          # store reads per delivery run

    def __init__(self, session: MqttSession, sub: ClientSubscription, plan: "ReplayPlan",
                 meta_of: Callable[[bytes], object], acl=None, metrics=None) -> None:
        """`meta_of(props)`: a message's decoded props (the delivery engine's cache)."""
        self.session = session
        self.meta_of = meta_of
        self.sub = sub
        self.plan = plan
        self.acl = acl
        self.metrics = metrics
        self.pending: list = []     # history messages read, not sent yet
        self.pos = 0
        self.sent = 0
        self.started = time.monotonic()

    @property
    def queue(self) -> str:
        return self.sub.queue

    def finished(self) -> bool:
        return self.plan.done and self.pos >= len(self.pending)

    def pump(self, budget_bytes: int) -> bool:
        """Send what the session can take now. Returns True when more could be sent at once (the
        caller schedules another run), False when done or waiting (window, socket, offline).

        Plain QoS 0 messages (no MQTT 5 properties, expiry, alias or subscription identifier to
        add) are collected and encoded as one run (`encode_publish_run`); anything else goes
        through the session machine (`MqttSession.send`) after the run so far is written, so the order on the wire is
        the history's order. Why: a history is thousands of distinct messages each sent once, and
        an OutboundMessage + PUBLISH template per message was a third of the pump's time."""
        s = self.session
        sub = self.sub
        n = reads = 0
        conn = s.conn
        if conn is None:
            return False
        v5 = s.version == 5
        ids = (sub.subscription_id,) if sub.subscription_id and v5 else None
        # whether a QoS 0 message of this subscription can skip per-subscriber parts
        plain = s.takes_plain(ids)
        no_local = sub.no_local
        cid = s.client_id
        sub_qos = sub.qos
        rap = sub.retain_as_published
        meta_of = self.meta_of
        run: list = []                  # (topic, payload, retain) of plain QoS 0 messages, in order
        try:
            while True:
                if conn.write_blocked or s.conn is not conn:
                    return False
                pending = self.pending
                if self.pos >= len(pending):
                    if self.plan.done:
                        return False
                    if reads >= self.reads_per_run:
                        return True         # a long stretch of other topics: let the loop breathe
                    chunk = self.plan.read(self.read_batch)
                    if chunk is None:
                        return False        # on its way from the store: `plan.on_ready` kicks the session
                    self.pending = chunk
                    self.pos = 0
                    reads += 1
                    continue                # (nothing matched in that chunk: read on, or done)
                rc = conn.read_checks
                acl = rc is not None and sub.queue in rc
                pos = self.pos
                stop = len(pending)
                while pos < stop:
                    m = pending[pos]
                    rec = meta_of(m.props)
                    if no_local and rec.client_id == cid:
                        pos += 1
                        continue
                    if acl and not self.acl.can_read(conn.identity, m.topic):
                        pos += 1
                        continue
                    qos = sub_qos if sub_qos < rec.qos else rec.qos
                    if qos and not s.window_open():
                        self.pos = pos
                        return False        # an ack kicks the session again
                    if n >= self.send_batch or budget_bytes <= 0:
                        self.pos = pos
                        return True
                    retain = rec.retain if rap else False
                    if not qos and plain and rec.message_expiry_interval is None and (
                            not v5 or not rec.has_app_properties()):
                        run.append((m.topic, m.body, 0, retain, None))
                    else:
                        if run:
                            self._write_run(run)
                        it = OutboundMessage(m.topic, m.body, rec, None, m.phys_offset, (), m.store_ts)
                        s.send(it, qos, retain, conn.write, conn.metrics, sub_ids=ids)
                    pos += 1
                    self.sent += 1
                    n += 1
                    budget_bytes -= len(m.body)
                self.pos = pos
        finally:
            if run:
                self._write_run(run)

    def _write_run(self, run: list) -> None:
        """Write the collected plain QoS 0 PUBLISHes (see pump) and empty `run`."""
        s = self.session
        conn = s.conn
        data, dropped = encode_publish_run(run, s.version, s.max_packet_size)
        if conn is not None:
            for _ in range(dropped):
                s.count_drop(TOO_LARGE, conn.metrics)
            if data:
                conn.write(data)
            conn.metrics.msg_out[0] += len(run) - dropped
        run.clear()
