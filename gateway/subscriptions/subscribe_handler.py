"""SUBSCRIBE and UNSUBSCRIBE: deciding each filter of the packet and answering SUBACK/UNSUBACK.

For every requested filter, in this order: a subscription from the past (the SUBSCRIBE's MQTT 5
`since` user property or a `$replay/` prefix, gateway/delivery/history.py) is parsed or refused; the filter
(and its `$share/` group) is validated; the broker's topic limits, the ACL and the per-session
`max_subscriptions` quota may refuse it; then it is subscribed (history instead of retained
messages for one from the past). The SUBACK carries one code per filter in request order (MQTT 5:
the reason strings of refused replays), and the retained messages follow it.

Why a class of its own and not part of the Broker: this is a second job beside the protocol's
decision table (broker.py), with its own rules. It gets only what it uses as narrow callables and
objects (the subscription registry, the ACL, the session save, ...), never the Broker, which keeps
the `on_subscribe`/`on_unsubscribe` entry points of its dispatch table and delegates here.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Callable

from lmqtt.gateway.mqtt import SUBACK_FAILURE_V311, ProtocolError, ReasonCode as RC, packets as P
from lmqtt.gateway.delivery.history import (REPLAY_PREFIX, ReplayRequestError, plain_filter, since_property,
                                  split_replay_filter)
from lmqtt.gateway.delivery.retained import send_retained
from lmqtt.gateway.session import ClientSubscription, MqttSession
from lmqtt.lightqueue import topics as T
from lmqtt.lightqueue.errors import InvalidTopicFilter, MetadataError
from lmqtt.gateway.storage.facades import ReplayRefused

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.security.acl import AclFile
    from lmqtt.gateway.broker.limits import ConnectionGate
    from lmqtt.gateway.subscriptions.subscription_registry import SubscriptionRegistry

_PLAIN = ClientSubscription       # a subscription with every option at its default (gateway/session/subscriptions.py)

# the broker's logger: the log lines are the ones the broker always wrote
log = logging.getLogger("lmqtt.gateway")


class SubscribeHandler:
    """The SUBSCRIBE/UNSUBSCRIBE path, given at construction:

    * `subscriptions`: the SubscriptionRegistry (prepare, deciding, add, add_since, remove);
    * `retained`: where the retained messages are (a `RetainedStore`, storage/facades.py; the
      broker's has `$SYS` filters answered from memory, broker/sys_topics.py);
    * `acl`: the AclFile, None when not configured (then a subscribe pays one `is None` test);
    * `gate`: the connection/rate limits (gateway/broker/limits.py `ConnectionGate`) with their counters,
      None for none;
    * `max_subscriptions`: the per-session quota, 0 = unlimited;
    * `save_session(s)`: write a persistent session's record (on a remote store the answer being
      written next waits for the store's acknowledgement);
    * `save_offsets(s)`: write its committed offsets now;
    * `kick(s)`: a delivery run for the session (its new subscriptions may have messages);
    * `resume(conn, fn, *args)`: run a packet's handling that waited for the store, failing as the
      connection's dispatch would (the broker's, shared with CONNECT);
    * `one_write()`: `Storage.one_write`, a context in which the SUBSCRIBE's filter references,
      session record and offsets go in one metadata write, made before its SUBACK leaves
      (in-process; a reconnect storm: a new persistent session's were three; remote: a no-op).
    """

    def __init__(self, *, subscriptions: "SubscriptionRegistry", retained,
                 acl: "AclFile | None", gate: "ConnectionGate | None", max_subscriptions: int,
                 save_session: Callable[[MqttSession], None], save_offsets: Callable[[MqttSession], None],
                 kick: Callable[[MqttSession], None], resume: Callable[..., None],
                 one_write: Callable[[], Any] = nullcontext) -> None:
        self.subscriptions = subscriptions
        self.retained = retained
        self.acl = acl
        self.gate = gate
        self.max_subscriptions = max_subscriptions
        self._save_session = save_session
        self._save_offsets = save_offsets
        self._kick = kick
        self._resume = resume
        self._one_write = one_write
        self.events = None        # the broker's Events (gateway/integrations/events.py), None for none

    # ======================================================================= SUBSCRIBE
    def on_subscribe(self, conn, pkt: P.Subscribe) -> None:
        try:
            with self._one_write():
                self._on_subscribe(conn, pkt)
        except MetadataError as e:
            # its filter references, record or offsets are not written: its SUBACK (queued, not
            # sent yet) must not leave; the client subscribes again on its next connection
            log.error("event=subscribe_write_failed client_id=%s error=%r (connection dropped before its SUBACK)",
                      conn.client_id, e)
            if conn.transport is not None:
                conn.transport.abort()

    def _on_subscribe(self, conn, pkt: P.Subscribe) -> None:
        # MQTT 5: the SUBSCRIBE's own `since` (every filter from the past), or why it is refused
        since = (None, None)
        if conn.version == 5 and pkt.properties.user_property:
            try:
                since = (since_property(pkt.properties), None)
            except ReplayRequestError as e:
                since = (None, str(e))
        # every answer deciding it reads, asked for now and waited for together: in-process (and
        # when a remote store's mirror holds them) they are in at once and it is decided here
        prepared = self.subscriptions.prepare(conn.session, pkt.subscriptions, since[0], self.retained)
        if prepared.ready.done():
            return self._decide(conn, pkt, since, prepared)
        # not in yet (a remote store): this connection waits for the answers on hold, the others go on
        conn.hold()

        def ready(_a, conn=conn) -> None:
            if conn.closing:
                prepared.release()          # what was registered for it
                return
            self._resume(conn, self._decide, conn, pkt, since, prepared)
            conn.release()
        prepared.ready.add_done_callback(ready)

    def _decide(self, conn, pkt: P.Subscribe, since: tuple, prepared) -> None:
        """The SUBSCRIBE with its answers in: refused whole if the store failed one, else decided."""
        with self.subscriptions.deciding(prepared):
            err = prepared.failure()
            if err is not None:
                return self._subscribe_failed(conn, pkt, err)
            self._subscribe(conn, pkt, since, prepared)

    def _subscribe_failed(self, conn, pkt: P.Subscribe, err: BaseException) -> None:
        """The store did not answer a SUBSCRIBE's reads: every filter is refused (0x80, MQTT 5
        with the reason), nothing is subscribed, the connection stays."""
        log.error("event=subscribe_failed client_id=%s error=%r", conn.client_id, err)
        v5 = conn.version == 5
        ack = P.SubAck(pkt.packet_id, [RC.UNSPECIFIED_ERROR if v5 else SUBACK_FAILURE_V311] * len(pkt.subscriptions))
        if v5 and conn.problem_info:
            ack.properties.reason_string = f"store unavailable: {err}"[:500]
        conn.send_fitting(ack)

    def _subscribe(self, conn, pkt: P.Subscribe, since: tuple, prepared) -> None:
        """Decide every filter, answer SUBACK, then send the retained messages (`since`: the
        SUBSCRIBE's own since time, or why it is refused). Runs inside `deciding(prepared)`: what
        it reads of the store was asked for ahead and is in."""
        s = conn.session
        v5 = conn.version == 5
        codes: list[int] = []
        retained: list[ClientSubscription] = []
        changed = False        # the session record changes (a new or different subscription)
        sub_id = None
        if v5 and pkt.properties.subscription_identifier:
            ids = pkt.properties.subscription_identifier
            if len(ids) > 1:
                raise ProtocolError("SUBSCRIBE carries more than one subscription identifier", RC.PROTOCOL_ERROR)
            sub_id = ids[0]
        since_all, replay_refused = since
        reasons: list[str] = []
        acl = self.acl
        gate = self.gate
        max_subs = self.max_subscriptions
        parsed = prepared.parsed
        for req in pkt.subscriptions:
            since = since_all
            tf = req.topic_filter
            try:
                if replay_refused is not None:
                    raise ReplayRefused(replay_refused)
                if tf.startswith(REPLAY_PREFIX):
                    since, tf = split_replay_filter(tf)
                    req.topic_filter = tf          # the subscription is the filter's own
            except (ReplayRequestError, ReplayRefused) as e:
                self._replay_refused(s, req.topic_filter, str(e), codes, reasons, v5)
                continue
            try:
                pf = parsed.get(req.topic_filter)       # valid: `prepare` parsed it
                if pf is None:
                    group, flt = T.parse_shared(req.topic_filter)
                    T.validate_filter(flt)
                else:
                    group, flt = pf
            except InvalidTopicFilter as e:
                log.info("event=subscribe_refused client_id=%s filter=%r error=%s", s.client_id, req.topic_filter, e)
                codes.append(RC.TOPIC_FILTER_INVALID if v5 else SUBACK_FAILURE_V311)
                continue
            over = gate.limits.topic_violation(flt) if gate is not None and gate.limits.topic_limited else None
            if over is not None:
                gate.hits[over[0]] += 1
                log.info("event=subscribe_refused client_id=%s filter=%r reason_code=0x%02X cause=%s reason=%r",
                         s.client_id, req.topic_filter, RC.TOPIC_FILTER_INVALID if v5 else SUBACK_FAILURE_V311,
                         over[0], over[1])
                codes.append(RC.TOPIC_FILTER_INVALID if v5 else SUBACK_FAILURE_V311)
                continue
            if group is not None and req.no_local and v5:
                raise ProtocolError("No Local must not be set on a shared subscription", RC.PROTOCOL_ERROR)
            ok = acl.can_subscribe(conn.identity, flt) if acl is not None else True
            if not ok:        # False, or a refusal naming its code (security/acl_chain.py)
                log.info("event=subscribe_denied client_id=%s filter=%r", s.client_id, req.topic_filter)
                codes.append(getattr(ok, "reason_code", RC.NOT_AUTHORIZED) if v5 else SUBACK_FAILURE_V311)
                continue
            if max_subs and req.topic_filter not in s.subs and len(s.subs) >= max_subs:
                log.info("event=subscribe_refused client_id=%s filter=%r reason_code=0x%02X cause=max_subscriptions "
                         "limit=%d", s.client_id, req.topic_filter, RC.QUOTA_EXCEEDED if v5 else SUBACK_FAILURE_V311,
                         max_subs)
                if gate is not None:
                    gate.hits["max_subscriptions"] += 1
                codes.append(RC.QUOTA_EXCEEDED if v5 else SUBACK_FAILURE_V311)      # refused by policy: quota exceeded
                continue
            qos = min(req.qos, 2)
            sub = ClientSubscription(req.topic_filter, flt, qos, group, req.no_local, req.retain_as_published,
                                     req.retain_handling, sub_id)
            if acl is not None and acl.needs_read_check(conn.identity, flt):
                rc_set = conn.read_checks
                if rc_set is None:
                    rc_set = conn.read_checks = set()
                rc_set.add(flt)
            if since is not None:
                changed = True         # its cursor restarts in the past
                try:
                    self.subscriptions.add_since(s, sub, since)
                except ReplayRefused as e:
                    self._replay_refused(s, req.topic_filter, str(e), codes, reasons, v5)
                    continue
                codes.append(qos)          # history instead of the retained messages
                continue
            if not changed:
                old = s.subs.get(sub.filter)
                # plain ones (their options the class's): equal by their three fields, without
                # `__eq__`'s two tuples of nine (a resumed client's SUBSCRIBE again, a reconnect storm)
                if old is None or (old.queue != sub.queue or old.qos != sub.qos
                                   if old.__class__ is _PLAIN and sub.__class__ is _PLAIN else old != sub):
                    changed = True
            existed = self.subscriptions.add(s, sub)
            codes.append(qos)
            if group is None and (req.retain_handling == 0 or (req.retain_handling == 1 and not existed)):
                retained.append(sub)
        s.update_custom()
        if s.persistent and changed:
            # a SUBSCRIBE repeating subscriptions the session has, with the same options (a client
            # resuming its session subscribes again, as most do), writes nothing: its record and
            # offsets already hold them (each was written before its first SUBACK)
            self._save_session(s)
            self._save_offsets(s)
        ack = P.SubAck(pkt.packet_id, codes)
        if reasons and v5 and conn.problem_info:
            ack.properties.reason_string = "; ".join(reasons)[:500]
        if reasons:
            conn.send_fitting(ack)         # a reason string that does not fit goes, the codes stay
        else:
            conn.send(ack)
        if self.events is not None:
            self.events.subscribed(conn, pkt.subscriptions, codes)
        for sub in retained:
            batches = prepared.take_retained(sub.queue)
            if batches is None or batches:      # falsy: the store has none (metadata `retained_batches`)
                send_retained(self.retained, acl, s, sub, batches=batches)
        self._kick(s)

    def _replay_refused(self, s: MqttSession, tf: str, why: str, codes: list, reasons: list, v5: bool) -> None:
        """A subscription from the past that cannot be served: SUBACK 0x80 (MQTT 5: with the reason)."""
        log.info("event=replay_refused client_id=%s filter=%r reason=%r", s.client_id, tf, why)
        codes.append(RC.UNSPECIFIED_ERROR if v5 else SUBACK_FAILURE_V311)
        reasons.append(f"{tf}: {why}")

    # ======================================================================= UNSUBSCRIBE
    def on_unsubscribe(self, conn, pkt: P.Unsubscribe) -> None:
        """UNSUBACK: MQTT 5 with one code per filter; a `$replay/` filter names its plain one."""
        s = conn.session
        codes = []
        for flt in pkt.topic_filters:
            sub = s.subs.get(flt)
            if sub is None and flt.startswith(REPLAY_PREFIX):
                sub = s.subs.get(plain_filter(flt))
            if sub is None:
                codes.append(RC.NO_SUBSCRIPTION_EXISTED)
                continue
            self.subscriptions.remove(s, sub)
            codes.append(RC.SUCCESS)
        s.update_custom()
        if s.persistent:
            self._save_session(s)
        conn.send(P.UnsubAck(pkt.packet_id, codes if conn.version == 5 else []))
        if self.events is not None:
            self.events.unsubscribed(conn, pkt.topic_filters, codes)
