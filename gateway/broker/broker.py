"""The MQTT broker logic of one gateway: what happens on each packet (CONNECT, PUBLISH, the acks,
SUBSCRIBE, UNSUBSCRIBE, DISCONNECT, AUTH), start and shutdown.

Why one class here and the mechanics elsewhere: this file is the protocol's decision table, readable
top to bottom. Every byte on the wire is built in `gateway/mqtt/`; one session's MQTT flow state -
packet ids, the in-flight window, inbound QoS 2, topic aliases, the client's limits, what a
persistent session saves - is the session machine's (`gateway/session/`: the broker hands it the
packets and does what its answers ask); the socket, write batching and the connections' deadlines
(keep alive, connect timeout) are in `gateway/net/` (`connection.py`, `write_batcher.py`,
`keepalive.py`); the store write in `gateway/inbound/publish.py`; the pull/fan-out in
`gateway/delivery/engine.py`; which sessions exist, who owns them, expiry and wills in
`gateway/clients/session_registry.py`, their records, offsets and flush timer in
`gateway/clients/session_persistence.py`; subscriptions, shared groups and filter registrations
in `gateway/subscriptions/subscription_registry.py`, deciding a SUBSCRIBE/UNSUBSCRIBE filter by
filter (validation, ACL, limits, replay, retained) in `gateway/subscriptions/subscribe_handler.py`;
the AUTH exchanges in `gateway/security/enhanced_auth.py`. Those modules never import this one:
they get the few callbacks they need as plain callables. Everything runs on the event loop thread;
nothing here blocks except short RocksDB metadata writes (sessions/offsets change at subscribe/ack
rate and are batched per 100 ms).
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import TYPE_CHECKING

from lmqtt.gateway.security.auth import AuthRunner, Credentials, Denied, Identity
from lmqtt.gateway.security.enhanced_auth import EnhancedAuth, peer_certificate_subject
from lmqtt.gateway.net.connection import NO_TOPICS
from lmqtt.gateway.net.keepalive import ConnectionSweep
from lmqtt.gateway.net.write_batcher import WriteBatcher
from lmqtt.gateway.net.write_buffers import WriteBufferMetrics, WriteBuffers
from lmqtt.gateway.mqtt import ProtocolError, ReasonCode as RC, encode_connack_refusal, packets as P
from lmqtt.gateway.session import DUPLICATE, NEVER_EXPIRES, InFlight, MqttSession
from lmqtt.gateway.delivery.history import plain_filter
from lmqtt.gateway.clients.session_registry import SessionRegistry
from lmqtt.gateway.subscriptions.subscribe_handler import SubscribeHandler
from lmqtt.gateway.subscriptions.subscription_registry import SubscriptionRegistry
from lmqtt.gateway.broker.sys_topics import SysRetained
from lmqtt.gateway.delivery.engine import DeliveryEngine, store_side
from lmqtt.gateway.clients.session_persistence import SessionPersistence
from lmqtt.gateway.inbound.publish import DELAYED_PREFIX, DelayRefused, PublishPipeline, parse_delayed_topic
from lmqtt.gateway.storage.facades import log_failure
from lmqtt.lightqueue import topics as T
from lmqtt.lightqueue.errors import InvalidTopicName
from lmqtt.lightqueue.records import QOS2_KEY_PREFIX

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.app.config import GatewayConfig
    from lmqtt.gateway.net.connection import MQTTConnection
    from lmqtt.gateway.app.metrics import GatewayMetrics
    from lmqtt.gateway.storage.facades import Storage

log = logging.getLogger("lmqtt.gateway")


class Broker:
    def __init__(self, cfg: "GatewayConfig", storage: "Storage", loop: asyncio.AbstractEventLoop,
                 metrics: "GatewayMetrics", auth=None, acl=None,
                 session_registry_cls=SessionRegistry, gate=None, append_listener=None,
                 gateway_id: str | None = None) -> None:
        """`storage`: the storage facades (gateway/storage/facades.py `Storage`), in-process
        (`lmqtt serve`: store/node/inprocess.py `storage(store, lq)`) or remote (`lmqtt gateway`:
        the RemoteStore's); the broker hands each collaborator the facades it uses and never asks
        which implementation it holds. `session_registry_cls`: the fleet's variant reloads a
        session from the store on CONNECT (gateway/fleet/sessions.py). `gate`: the connection and rate
        limits with their counters (gateway/broker/limits.py `ConnectionGate`), None for none.
        `append_listener`: drained once each publish batch is appended (the embedded store's
        notify bus, inbound/publish.py `AppendListener`, so subscribers get the batch before its
        PUBACKs go out); None over a remote store. `gateway_id`:
        a fleet gateway's id (`lmqtt gateway`), named in the session records it writes; None in
        the embedded server."""
        self.cfg = cfg
        # security (gateway/security/auth.py, gateway/security/acl.py): None = not configured, and then CONNECT,
        # PUBLISH, SUBSCRIBE and delivery pay one `is None` test for it
        self.auth = auth
        self.auth_runner = AuthRunner(auth, loop) if auth is not None else None
        self.acl = acl
        self.enhanced_auth = EnhancedAuth(auth, loop, refuse=self._refuse, accept=self._connect_checked,
                                          timeout_s=cfg.connect_timeout_s)
        self.gate = gate
        # everything below uses the store through these facades
        self.storage = storage
        self.loop = loop
        self.metrics = metrics
        self.connections: set["MQTTConnection"] = set()
        self.sweep = ConnectionSweep(loop, self.connections, cfg.connect_timeout_s, self.enhanced_auth.timed_out)
        # the live checks are looked up when called: the registries are built below
        self.persist = SessionPersistence(storage,
                                          session_live=lambda s: self.sessions.get(s.client_id) is s,
                                          group_live=lambda g: self.subscriptions.is_current(g),
                                          host=gateway_id, metrics=metrics)
        self.writes = WriteBatcher(loop)
        # connections whose clients drain fast may queue more (gateway/net/write_buffers.py)
        self.write_buffers = (WriteBuffers(cfg.write_high_water, cfg.write_low_water, cfg.write_high_water_max,
                                           cfg.write_buffers_max)
                              if cfg.write_high_water_max > cfg.write_high_water else None)
        registry = getattr(metrics, "registry", None)
        if self.write_buffers is not None and registry is not None:
            registry.register(WriteBufferMetrics(self.write_buffers))
        self.delivery = DeliveryEngine(storage.queues, loop, metrics, cfg,
                                       session_offsets_moved=self.persist.mark_session,
                                       group_offsets_moved=self.persist.mark_group,
                                       flush_writes=self.writes.flush, acl=acl)
        self.publisher = PublishPipeline(storage.queues, loop, metrics, cfg.max_pending_publish,
                                         set_retained=self._set_retained,
                                         record_appended=self.delivery.record_appended,
                                         recent_ends=self.delivery.recent.ends,
                                         writes=self.writes, append_listener=append_listener)
        # QoS 2 exactly once across a crash (clients/session_persistence.py `write_ahead`, `journal`)
        self.delivery.qos2_sent = self._qos2_sent
        self.publisher.qos2_stored = lambda s, pid: self.persist.journal(s, s.pubrec(pid))
        # subscribing from the past (gateway/delivery/history.py): publishes routed before a filter's
        # registration are appended before it
        self.subscriptions = SubscriptionRegistry(storage, self.delivery, self.persist,
                                                  before_register=self.publisher.flush)
        self.session_registry = session_registry_cls(loop, metrics, storage, self.persist, self.subscriptions,
                                                self._publish_will)
        self.sessions = self.session_registry.sessions      # client id -> MqttSession (read-only view)
        # the gateway's `$SYS` values, served from memory (broker/sys_topics.py): published into by
        # app/gateway.py's timer, looked up by a SUBSCRIBE's retained messages; never stored
        self.sys_retained = SysRetained(self.delivery, acl, metrics.dropped_qos0_backpressure)
        self.subscribing = SubscribeHandler(subscriptions=self.subscriptions,
                                            retained=self.sys_retained.over(storage.retained), acl=acl, gate=gate,
                                            max_subscriptions=cfg.max_subscriptions,
                                            save_session=self._save_session, save_offsets=self.persist.save_offsets,
                                            kick=self.delivery.kick, resume=self._continue,
                                            one_write=storage.one_write)
        # client/session/message events (gateway/integrations/events.py `Events`), None for none
        self.events = None
        self.accepting = True
        self._handlers = {
            P.Connect: self.on_connect, P.Publish: self.on_publish, P.PubAck: self.on_puback,
            P.PubRec: self.on_pubrec, P.PubRel: self.on_pubrel, P.PubComp: self.on_pubcomp,
            P.Subscribe: self.on_subscribe, P.Unsubscribe: self.on_unsubscribe,
            P.PingReq: self.on_pingreq, P.Disconnect: self.on_disconnect, P.Auth: self.enhanced_auth.on_auth,
        }

    # ======================================================================= lifecycle
    def start(self) -> None:
        """Restore persistent sessions and shared groups from metadata; publish wills of a crash."""
        n = self.session_registry.restore()
        self.subscriptions.sync_store_filters()
        wills = self.session_registry.publish_orphan_wills()
        self.sweep.start()
        self.persist.start_flushing(self.loop, self.cfg.offset_flush_ms / 1000.0)
        log.info("event=broker_started restored_sessions=%d orphan_wills=%d groups=%d", n, wills, len(self.subscriptions.groups))

    def _set_retained(self, topic: str, payload: bytes, props: bytes) -> None:
        """Store a retained message (the publish pipeline's callback): nobody waits for it, a
        failure is logged (a failure already in raises, and the pipeline logs it)."""
        answer = self.storage.retained.set(topic, payload, props)
        if answer.done():
            answer.result()
        else:
            log_failure(answer, log, "retained_store_failed", topic=topic)

    def _publish_will(self, client_id: str, qos: int, topic: str, payload: bytes, retain: bool,
                      props: P.Properties | None) -> None:
        self.publisher.submit(None, qos, None, topic, payload, retain, client_id, props)

    async def shutdown(self, timeout: float = 3.0) -> None:
        """Stop accepting, close every connection (MQTT 5: DISCONNECT 0x8B), persist state."""
        self.accepting = False
        for c in list(self.connections):
            if c.connected:
                c.close_with_error(RC.SERVER_SHUTTING_DOWN, "server shutting down")
            else:
                c.close()
        deadline = self.loop.time() + timeout
        while self.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.02)
        for c in list(self.connections):   # did not go away: abort
            if c.transport is not None:
                c.transport.abort()
        await asyncio.sleep(0)
        self.publisher.flush()      # wills of closed connections
        deadline = self.loop.time() + timeout
        while self.publisher.inflight_batches and self.loop.time() < deadline:
            await asyncio.sleep(0.01)
        self.sweep.stop()
        if self.auth_runner is not None:
            self.auth_runner.close()
        self.session_registry.close()
        self.persist.stop_flushing()
        try:
            self.storage.sessions.flush().wait()
        except Exception as e:
            log.error("event=metadata_flush_failed error=%r", e)

    # ======================================================================= connections
    def on_accept(self, conn: "MQTTConnection") -> None:
        if not self.accepting:
            conn.close()
            return
        self.connections.add(conn)

    def on_connection_lost(self, conn: "MQTTConnection", exc) -> None:
        self.connections.discard(conn)
        if conn.connected:
            self.metrics.connections -= 1
            conn.connected = False
            if self.events is not None:
                self.events.disconnected(conn, exc)
            self.session_registry.detach(conn)

    def on_writable(self, conn: "MQTTConnection") -> None:
        """The socket drained below its low-water mark: deliver what was held back."""
        s = conn.session
        if s is not None and s.conn is conn:
            self.delivery.kick(s)

    # ======================================================================= packets
    def handle_packet(self, conn: "MQTTConnection", pkt) -> None:
        h = self._handlers.get(type(pkt))
        if h is None:
            raise ProtocolError(f"unexpected packet {type(pkt).__name__} from a client", RC.PROTOCOL_ERROR)
        if not conn.connected and h != self.on_connect:
            if conn.auth_login is None:
                raise ProtocolError("the first packet must be CONNECT", RC.PROTOCOL_ERROR)
            if h == self.on_disconnect:         # gave up during enhanced authentication
                log.info("event=connect_abandoned peer=%s cause='DISCONNECT during enhanced authentication'",
                         conn.peer)
                return conn.close()
            if h != self.enhanced_auth.on_auth:   # MQTT-3.1.2-30
                raise ProtocolError(f"{type(pkt).__name__.upper()} before CONNACK during enhanced "
                                    f"authentication (only AUTH or DISCONNECT may follow CONNECT)",
                                    RC.PROTOCOL_ERROR)
        h(conn, pkt)

    def _continue(self, conn, fn, *args) -> None:
        """Run a packet's handling that waited for the store, failing as `_handle_packets` would:
        a protocol error or a bug costs this connection only."""
        try:
            fn(*args)
        except ProtocolError as e:
            conn.protocol_error(e.reason_code, str(e))
        except Exception as e:  # noqa: BLE001
            log.exception("event=packet_handler_failed client_id=%s", conn.client_id)
            conn.close_with_error(RC.IMPLEMENTATION_SPECIFIC_ERROR, f"internal error: {type(e).__name__}")

    # ======================================================================= CONNECT
    def _refuse(self, conn: "MQTTConnection", rc: int, reason: str, cause: str | None = None) -> None:
        """CONNACK with a failure code; `reason` goes to the client, `cause` (which part of the
        credentials was wrong) only to the log."""
        self.metrics.connect_refused.labels(reason=f"0x{rc:02X}").inc()
        log.info("event=connect_refused peer=%s reason_code=0x%02X reason=%r%s", conn.peer, rc, reason,
                 f" cause={cause!r}" if cause else "")
        conn.write(encode_connack_refusal(rc, reason, conn.version))
        conn.close()

    def on_connect(self, conn: "MQTTConnection", pkt: P.Connect) -> None:
        if conn.connected:
            raise ProtocolError("second CONNECT on one connection", RC.PROTOCOL_ERROR)
        v = pkt.protocol_level
        conn.version = v
        props = pkt.properties
        if not self.accepting:
            return self._refuse(conn, RC.SERVER_UNAVAILABLE, "server shutting down")
        down = self.storage.queues.unavailable()         # remote store unreachable: no session to offer
        if down:
            return self._refuse(conn, RC.SERVER_UNAVAILABLE, down)
        cid = pkt.client_id
        assigned = None
        if not cid:
            if v != 5 and not pkt.clean_start:
                return self._refuse(conn, RC.CLIENT_IDENTIFIER_NOT_VALID, "an empty client id needs clean session = 1")
            cid = "lmqtt-" + secrets.token_hex(8)
            if v == 5:
                assigned = cid
        if conn.internal is not None:       # a bridge's local side (gateway/integrations/bridge.py)
            return self._connect_checked(conn, pkt, cid, assigned, conn.internal)
        if v == 5 and props.authentication_method:
            return self.enhanced_auth.begin(conn, pkt, cid, assigned)
        ident = None
        if self.auth is not None:
            creds = Credentials(cid, pkt.username, pkt.password, peer_certificate_subject(conn), conn.peer, v)

            def checked(result, conn=conn, pkt=pkt, cid=cid, assigned=assigned) -> None:
                if conn.closing:             # the client left while its password was checked
                    return
                try:
                    self._connect_checked(conn, pkt, cid, assigned, result)
                except ProtocolError as e:
                    conn.protocol_error(e.reason_code, str(e))
                    return
                conn.release()               # the packets that came after CONNECT, in order
            if self.auth_runner.check_later(creds, checked):
                conn.hold()                  # a password hash to compute: off the event loop
                return
            return self._connect_checked(conn, pkt, cid, assigned, self.auth.check(creds))
        elif self.acl is not None:
            ident = Identity(None, cid, "anonymous")
        self._connect_checked(conn, pkt, cid, assigned, ident)

    def _connect_checked(self, conn: "MQTTConnection", pkt: P.Connect, cid: str, assigned, ident,
                         auth_reply: tuple[str, bytes] | None = None) -> None:
        """The rest of CONNECT once the credentials are checked (`ident`: Identity, Denied, or None
        when no authentication is configured; `auth_reply`: enhanced authentication's method and
        final data for CONNACK)."""
        if isinstance(ident, Denied):
            if ident.method == AuthRunner.BUSY:
                return self._refuse(conn, RC.SERVER_BUSY, "server busy", ident.reason)
            if ident.code == RC.SERVER_UNAVAILABLE:     # the HTTP auth service away: refused, never allowed
                return self._refuse(conn, RC.SERVER_UNAVAILABLE, "server unavailable", ident.reason)
            if pkt.username is not None or pkt.password is not None:
                return self._refuse(conn, RC.BAD_USER_NAME_OR_PASSWORD, "bad user name or password",
                                    ident.reason)
            return self._refuse(conn, RC.NOT_AUTHORIZED, "not authorized", ident.reason)
        cfg = self.cfg
        v = pkt.protocol_level
        props = pkt.properties
        conn.identity = ident
        will = pkt.will
        if will is not None and self.acl is not None and not self.acl.can_publish(ident, will.topic):
            # as Mosquitto: the connection is accepted, the will is not kept (never published)
            log.info("event=will_denied client_id=%s topic=%r", cid, will.topic)
            will = None
        if pkt.will is not None:
            try:
                T.validate_topic(pkt.will.topic)
            except InvalidTopicName as e:
                if v == 5:
                    return self._refuse(conn, RC.TOPIC_NAME_INVALID, f"will topic: {e}")
                raise ProtocolError(f"will topic: {e}", RC.TOPIC_NAME_INVALID) from None   # 3.1.1: close
        if v == 5:
            expiry = props.session_expiry_interval or 0
        else:
            expiry = 0 if pkt.clean_start else NEVER_EXPIRES
        expiry = min(expiry, cfg.max_session_expiry_s)
        loading = self.session_registry.load_later(cid, pkt.clean_start)
        if loading is None:
            return self._connect_open(conn, pkt, cid, assigned, auth_reply, will, expiry)
        # the session is on the store (a fleet): this connection waits for it, the others go on
        conn.hold()

        def loaded(f, conn=conn) -> None:
            if conn.closing:                 # the client left meanwhile
                if f.exception() is None:
                    self.session_registry.discard(f.result())
                return
            if f.exception() is not None:
                return self._refuse(conn, RC.SERVER_UNAVAILABLE, "session store unavailable", repr(f.exception()))
            self._continue(conn, self._connect_open, conn, pkt, cid, assigned, auth_reply, will, expiry, f.result())
            conn.release()
        loading.add_done_callback(loaded)

    def _connect_open(self, conn: "MQTTConnection", pkt: P.Connect, cid: str, assigned, auth_reply, will,
                      expiry: int, loaded=None) -> None:
        """CONNECT accepted: take the session over (`loaded`: what the registry read for it)."""
        cfg = self.cfg
        v = pkt.protocol_level
        props = pkt.properties
        registry = self.session_registry
        old = registry.owner(cid)
        if old is not None and old is not conn:
            log.info("event=takeover client_id=%s old_peer=%s new_peer=%s", cid, old.peer, conn.peer)
            old.close_with_error(RC.SESSION_TAKEN_OVER, "session taken over")
            if self.events is not None:
                self.events.disconnected(old, None)
            registry.detach(old)
            old.connected = False
            self.metrics.connections -= 1
        try:
            s, present = registry.open(cid, pkt.clean_start, loaded)
        except Exception as e:
            if not store_side(e):
                raise
            # a fleet gateway taking the session over could not hold its filters (a full disk
            # on the store): nothing was taken over, the client may try again
            return self._refuse(conn, RC.SERVER_UNAVAILABLE, "session store unavailable", repr(e))
        was_persistent = s.persistent
        s.expiry_interval = expiry
        if v == 5:
            s.connect(v, props.receive_maximum, props.maximum_packet_size, props.topic_alias_maximum,
                      cfg.topic_alias_maximum, cfg.max_inflight)
            conn.problem_info = props.request_problem_information != 0
        else:
            s.connect(v, None, None, None, 0, cfg.max_inflight)
        registry.attach(conn, s)
        conn.connected = True
        keepalive = pkt.keepalive
        server_keepalive = None
        if keepalive > cfg.max_keepalive:
            keepalive = server_keepalive = cfg.max_keepalive
        conn.keepalive = keepalive
        conn.will = will
        if will is not None:
            registry.store_will(cid, will, v)
        if s.persistent:
            if present or pkt.clean_start or self.persist.host is not None:
                # its QoS 2 exchanges go out again below (PUBLISH with DUP, PUBREL) in the state held
                # here, which may be newer than its record (a PUBREC taken whose write then failed): they
                # leave only once this write is done, and a write that fails drops the connection
                qos2 = present and any(inf.qos == 2 for inf in s.inflight())
                if present and not qos2 and self.persist.writes_later:
                    # `lmqtt serve`, nothing of QoS 2 to send again: the record saying it is connected
                    # is written at the end of this tick with the others (a reconnect storm), not before CONNACK
                    self.persist.save_later(s)
                else:
                    self._save_session(s, qos2_resumed=qos2)
            # else a new session (no record: CONNACK says none is present) with nothing in it yet, on
            # the embedded server: its record is first written by what puts something in it (its
            # SUBSCRIBE, before SUBACK; a QoS 2 exchange) or by its disconnect. A crash before that
            # loses nothing the client was told exists (one record write less per session)
        elif was_persistent:
            self.persist.delete_session(cid)
        elif pkt.clean_start and self.persist.host is not None:
            # a fleet gateway: the session this clean start discards (MQTT-3.1.2-4) may live only
            # in the store's record (another gateway served it). It goes now, and CONNACK after
            # the store's answer: the session that lasts as long as this connection writes no
            # record, and a gateway killed before this connection's end left the old one to be
            # resumed later. Its gateway drops its copy when told (SESSIONS_MOVED)
            conn.wait_for_store(self.persist.delete_session(cid))

        ack = P.ConnAck(present, 0)
        if v == 5:
            ap = ack.properties
            ap.assigned_client_identifier = assigned
            if cfg.topic_alias_maximum:
                ap.topic_alias_maximum = cfg.topic_alias_maximum
            if cfg.receive_maximum < 65535:
                ap.receive_maximum = cfg.receive_maximum
            if props.request_response_information and cfg.response_information:
                ap.response_information = cfg.response_information
            ap.maximum_packet_size = cfg.max_packet_size
            if server_keepalive is not None:
                ap.server_keep_alive = server_keepalive
            if expiry != (props.session_expiry_interval or 0):
                ap.session_expiry_interval = expiry
            if auth_reply is not None:
                ap.authentication_method, ap.authentication_data = auth_reply
        conn.send(ack)
        self.metrics.connects += 1
        self.metrics.connections += 1
        log.debug("event=connect client_id=%s peer=%s version=%d clean_start=%s expiry=%d present=%s",
                  cid, conn.peer, v, pkt.clean_start, expiry, present)
        if self.events is not None:         # webhook and $events (gateway/integrations/events.py)
            self.events.connected(conn, keepalive, pkt.clean_start, present, pkt.username)
        if self.acl is not None:
            self._set_read_checks(conn, s)
        if present and cfg.max_offline_backlog:
            self.delivery.trim_backlog(s, cfg.max_offline_backlog)
        self.subscriptions.go_online(s)
        for inf in s.resume(conn.write, self.metrics):   # no longer fits the client's Maximum Packet Size
            self._released(s, inf)
        self.delivery.kick(s)

    # ======================================================================= PUBLISH in
    def on_publish(self, conn: "MQTTConnection", pkt: P.Publish) -> None:
        s = conn.session
        qos = pkt.qos
        self.metrics.msg_in[qos] += 1
        v5 = conn.version == 5
        topic = pkt.topic
        if v5 and pkt.properties.topic_alias is not None:
            topic = s.resolve_alias(topic, pkt.properties.topic_alias, self.cfg.topic_alias_maximum)
        if topic not in conn.valid_topics:
            # the codec already refuses wildcards, NUL, bad UTF-8 and (without an alias) an empty
            # topic; this is the light-queue rule set, checked once per topic per connection
            try:
                T.validate_topic(topic)
            except InvalidTopicName as e:
                raise ProtocolError(str(e), RC.TOPIC_NAME_INVALID) from None
            # the broker's own (gateway/broker/sys_topics.py): as Mosquitto; `$timer` is the store's
            # queue of parked delayed messages (store/delayed.py PARK_TOPIC), `$events/` the
            # client and session events (gateway/integrations/events.py): never a client's
            if topic.startswith("$SYS") or topic == "$timer" or topic.startswith("$events/"):
                return self._publish_denied(conn, s, qos, pkt.packet_id, topic, v5)
            gate = self.gate
            if gate is not None and gate.limits.topic_limited:     # max_topic_length / _levels
                over = gate.limits.topic_violation(topic)
                if over is not None:
                    gate.hits[over[0]] += 1
                    raise ProtocolError(f"{over[1]} ({over[0]})", RC.TOPIC_NAME_INVALID)
            vt = conn.valid_topics
            if vt is NO_TOPICS or len(vt) >= 1024:
                conn.valid_topics = vt = set()
            vt.add(topic)
        pid = pkt.packet_id
        due = 0
        if topic[0] == "$" and topic.startswith(DELAYED_PREFIX):   # $delayed/{seconds}/{topic}: ACL on {topic}
            try:
                topic, due = parse_delayed_topic(topic)
            except DelayRefused as e:
                return self.publisher.refuse(conn, qos, pid, topic, e)
        if self.acl is not None and topic not in conn.acl_publish_ok:
            # the identity is fixed per connection: an allowed topic is remembered until the rules
            # change (SIGHUP, live rules), unless an HTTP service's decisions (with a TTL) are used
            ok = self.acl.can_publish(conn.identity, topic)
            if not ok:
                if ok is None:       # to ask the HTTP service first: this packet is handled again then
                    self.metrics.msg_in[qos] -= 1
                    return self._after_acl(conn, self.acl.ask(conn.identity, "publish", (topic,), conn.peer),
                                           self.on_publish, pkt)
                return self._publish_denied(conn, s, qos, pid, topic, v5, getattr(ok, "reason_code", RC.NOT_AUTHORIZED))
            if self.acl.memo_ok:
                ok = conn.acl_publish_ok
                if ok is NO_TOPICS or len(ok) >= 1024:
                    conn.acl_publish_ok = ok = set()
                ok.add(topic)
        if qos:
            seen = s.publish_received(qos, pid, self.cfg.receive_maximum)
            if seen:
                if seen == DUPLICATE:       # a QoS 2 message stored already: PUBREC again
                    self._send_after(s, conn, s.pubrec(pid), s.after_record())
                return                      # PENDING: its ack follows the store's answer
            if qos == 2 and s.expiry_interval and not due:
                return self._qos2_ahead(conn, s, pid, topic, pkt.payload, pkt.retain, pkt.properties if v5 else None)
        self.publisher.submit(conn, qos, pid, topic, pkt.payload, pkt.retain, s.client_id,
                              pkt.properties if v5 else None, due)

    def _qos2_ahead(self, conn, s: MqttSession, pid: int, topic: str, payload: bytes, retain: bool, props) -> None:
        """A new inbound QoS 2 PUBLISH of a persistent session: its id is written to the session
        record as pending (with the unique key the message will carry) before the message is
        appended, so that a crash after the append and before the id is written as stored leaves
        a trace the store settles against its log when the record is read back (lightqueue/
        records.py `resolve_pending_qos2`): the client's PUBLISH sent again is then answered, not
        stored twice. In-process the write is done at once; over a remote store the connection
        waits one round trip (its later packets too, so its publishes stay in order).

        An id restored pending (written ahead by a gateway that may still append it late, its
        message not found in the log) keeps its key: the store keeps one record per key
        (store/unique_keys.py), so the two appends store the message once."""
        ahead = s.written_ahead(pid)
        if ahead is not None and ahead[0] == topic:
            key, ms = ahead[1], ahead[2]
        else:
            key, ms = f"{QOS2_KEY_PREFIX}{secrets.token_hex(8)}", int(time.time() * 1000)
        s.write_ahead(pid, topic, key, ms)
        answer = self.persist.save_session(s)

        def go(a) -> None:
            if a is not None and a.exception() is not None:
                # not written: not appended either; the client sends the PUBLISH again on its next
                # connection (the id is forgotten here)
                s.publish_failed(pid)
                if not conn.closing:
                    conn.close_with_error(RC.UNSPECIFIED_ERROR, f"session state could not be written: {a.exception()}")
                return
            self.publisher.submit(conn, 2, pid, topic, payload, retain, s.client_id, props, 0, (key,))
        if answer is None or answer.done():
            go(answer)
            return
        answer.add_done_callback(go)
        conn.wait_for_store(answer)

    def _after_acl(self, conn, asked: list, handler, pkt) -> None:
        """The packet waits for the authorization service's answers (gateway/security/acl_chain.py);
        the connection's later packets wait behind it, in order; then it is handled again."""
        from lmqtt.gateway.security.http_auth import ask_all  # only when configured
        conn.hold()

        def answered() -> None:
            if not conn.closing:
                self._continue(conn, handler, conn, pkt)
            conn.release()
        ask_all(asked, answered)

    def acl_changed(self) -> None:
        """The ACL rules changed (SIGHUP, live rules): what each connection remembered of the old
        ones is asked again at its next PUBLISH, and its subscriptions' delivery checks redone."""
        for c in list(self.connections):
            c.acl_publish_ok = NO_TOPICS
            if c.connected and c.session is not None:
                self._set_read_checks(c, c.session)

    def _publish_denied(self, conn, s: MqttSession, qos: int, pid, topic: str, v5: bool,
                        rc5: int = RC.NOT_AUTHORIZED) -> None:
        """ACL said no: MQTT 5 gets PUBACK/PUBREC 0x87 (0x80 when the authorization service could
        not be asked); 3.1.1 has no negative ack, so the message is acknowledged and dropped (as
        Mosquitto does). Nothing is stored."""
        log.info("event=publish_denied client_id=%s topic=%r reason_code=0x%02X", s.client_id, topic, rc5)
        if qos == 0:
            return
        rc = rc5 if v5 else 0
        if qos == 1:
            conn.send(P.PubAck(pid, rc))
        else:
            if not v5:
                s.publish_refused_stored(pid)   # the PUBREL that follows gets its PUBCOMP
            conn.send(P.PubRec(pid, rc))

    def reload_security(self) -> None:
        """SIGHUP: re-read password/keys files and the ACL (a file that fails keeps its old rules);
        with new ACL rules, what each connection remembered of the old ones is asked again."""
        if self.auth is not None:
            self.auth.reload_files()
        if self.acl is not None and self.acl.reload_or_keep():
            self.acl_changed()

    def _set_read_checks(self, conn: "MQTTConnection", s: MqttSession) -> None:
        """The queues of `s`'s subscriptions whose messages need the ACL's read rule for this
        connection's identity (`AclFile.read_checks`); only called with an ACL configured."""
        checks = self.acl.read_checks(conn.identity, [sub.queue for sub in s.subs.values()])
        if checks and any(len(self.subscriptions.parts(q)) > 1 for q in checks):
            # over several store groups a wildcard-first-level subscription reads one queue per group
            checks = {p for q in checks for p in self.subscriptions.parts(q)}
        conn.read_checks = checks

    # ======================================================================= acks from the client
    # what the session machine answers (gateway/session/outbound.py, inbound.py): the message
    # released and the frame to send; the broker does what that asks of the others
    def _released(self, s: MqttSession, inf: InFlight) -> None:
        """`inf` left `s`'s window (acknowledged, refused by the client, or dropped at a resend):
        its shared group's offset is released, its queue's offset written with the next flush,
        retained messages waiting for the window sent, delivery run again for `s` where it may
        have held back for the window."""
        g = inf.group
        waiting = s.retained_waiting()
        if g is None and inf.queue is not None and not waiting:
            # the QoS 1 hot path (a direct subscription's message)
            if s.expiry_interval:       # only a persistent session's offsets are written
                self.persist.mark_session(s)
            # Delivery only ever holds messages back for this session because its window was
            # full (a blocked socket kicks on resume_writing; a partial read re-schedules itself),
            # so only the ack that opens a full window needs a delivery run.
            if s.window_room() == 1:
                self.delivery.kick(s)
            return
        if g is not None:
            g.acked(inf.offset)
            self.persist.mark_group(g)
        elif inf.queue is not None:
            self.persist.mark_session(s)
        if waiting and s.conn is not None:
            s.drain_retained(s.conn.write, self.metrics)
        self.delivery.kick(s)

    def _send_after(self, s: MqttSession, conn, frame: bytes, after_record: bool) -> None:
        """A QoS 2 packet that depends on a state change: once the session's record holds the
        change when the machine says so (`after_record`: a persistent session, `persist.journal`),
        else now."""
        if after_record:
            self.persist.journal(s, frame)
        else:
            conn.write(frame)

    def on_puback(self, conn, pkt: P.PubAck) -> None:
        s = conn.session
        inf = s.puback_received(pkt.packet_id)
        if inf is not None:      # None: an id not in flight (a late ack after a reconnect): ignored
            self._released(s, inf)

    def on_pubrec(self, conn, pkt: P.PubRec) -> None:
        s = conn.session
        frame, inf, after_record = s.pubrec_received(pkt.packet_id, pkt.reason_code)
        if inf is not None:      # an error code: the message is dropped
            self._released(s, inf)
        else:                    # a persistent session's PUBREL once its new state is durable (exactly once across a crash)
            self._send_after(s, conn, frame, after_record)

    def on_pubcomp(self, conn, pkt: P.PubComp) -> None:
        s = conn.session
        inf = s.pubcomp_received(pkt.packet_id)
        if inf is not None:
            self._released(s, inf)

    def on_pubrel(self, conn, pkt: P.PubRel) -> None:
        s = conn.session
        frame, after_record = s.pubrel_received(pkt.packet_id)
        self._send_after(s, conn, frame, after_record)   # the id forgotten durably before PUBCOMP frees it

    # ======================================================================= SUBSCRIBE
    # validation, ACL, limits, shared groups, replay, retained and the SUBACK: gateway/subscriptions/subscribe_handler.py
    def on_subscribe(self, conn, pkt: P.Subscribe) -> None:
        if self.acl is not None and self.acl.asks:     # decisions of the HTTP service not cached yet
            asked = self.acl.ask(conn.identity, "subscribe", _acl_filters(pkt), conn.peer)
            if asked:
                return self._after_acl(conn, asked, self.on_subscribe, pkt)
        self.subscribing.on_subscribe(conn, pkt)

    def on_unsubscribe(self, conn, pkt: P.Unsubscribe) -> None:
        self.subscribing.on_unsubscribe(conn, pkt)

    # ======================================================================= misc packets
    def on_pingreq(self, conn, pkt) -> None:
        conn.send(P.PingResp())

    def on_disconnect(self, conn, pkt: P.Disconnect) -> None:
        s = conn.session
        if conn.version == 5 and s.disconnect_received(pkt.properties.session_expiry_interval,
                                                       self.cfg.max_session_expiry_s):
            self.persist.delete_session(s.client_id)
        with_will = conn.version == 5 and pkt.reason_code == RC.DISCONNECT_WITH_WILL_MESSAGE
        conn.left_because = "normal_with_will" if with_will else "normal"
        if not with_will:
            if conn.will is not None:
                conn.will = None
                self.session_registry.drop_will(s.client_id)
        if not self.persist.close_after_record(s, conn):   # lmqtt serve: closed once its record is in
            conn.close()

    # ======================================================================= persistence
    def _qos2_sent(self, s: MqttSession) -> None:
        """A delivery batch queued new QoS 2 PUBLISHes to persistent `s`: they leave once its
        exchanges are durable (a remote store: one round trip; in-process: done at once)."""
        conn = s.conn
        pending = self.persist.write_ahead(s)
        if conn is None or pending is None:
            return

        def failed(a) -> None:
            # not written: the PUBLISHes queued must not leave (a crash would send them again as
            # new); the connection is dropped with them, the client resumes on its next one
            if a.exception() is not None and conn.transport is not None:
                log.warning("event=qos2_write_ahead_failed client_id=%s error=%r (connection dropped)",
                            s.client_id, a.exception())
                conn.transport.abort()
        pending.add_done_callback(failed)      # before wait_for_store's: runs first
        conn.wait_for_store(pending)

    def _save_session(self, s: MqttSession, qos2_resumed: bool = False) -> None:
        """Save the record; on a remote store the answer being written next (CONNACK, SUBACK,
        UNSUBACK) and what follows it wait for the store's acknowledgement, as they would have
        after a blocking write, without stopping the other connections meanwhile.
        `qos2_resumed`: a CONNECT resuming QoS 2 exchanges: a failed write drops the connection
        before anything leaves (a PUBREL sent from a state never written would let a crash send
        that message again as PUBLISH: delivered twice)."""
        pending = self.persist.save_session(s)
        conn = s.conn
        if conn is None:
            return
        if pending is None:
            if qos2_resumed and conn.transport is not None:
                conn.transport.abort()
            return
        if qos2_resumed:
            def failed(a) -> None:
                if a.exception() is not None and conn.transport is not None:
                    log.warning("event=qos2_resume_write_failed client_id=%s error=%r (connection dropped: "
                                "its QoS 2 exchanges are resumed once its session record is written)",
                                s.client_id, a.exception())
                    conn.transport.abort()
            pending.add_done_callback(failed)   # before wait_for_store's (runs at once if done)
        conn.wait_for_store(pending)


def _acl_filters(pkt: P.Subscribe) -> list[str]:
    """The filters a SUBSCRIBE's ACL decides (a `$replay/` or `$share/` one's plain filter), as
    the subscribe handler computes them; one it will refuse as invalid is left out."""
    out = []
    for req in pkt.subscriptions:
        try:
            out.append(T.parse_shared(plain_filter(req.topic_filter))[1])
        except Exception:  # noqa: BLE001 - invalid: refused by the handler, nothing to ask
            continue
    return out
