"""Session registry: the sessions of this gateway by client id, which connection owns each one,
session expiry, restore at start, and will messages.

Why a registry of its own: these are the pieces of state that must be fleet-wide once several
gateways serve the same clients (one live connection per client id, takeover on reconnect,
sessions and wills surviving a gateway), so they sit behind one small interface that an
implementation over shared storage (e.g. Redis) can provide. This in-process implementation
keeps sessions in memory and persists persistent ones through `SessionPersistence`.

Interface:
  sessions / get(client_id)          the sessions known here, by client id
  owner(client_id)                   the connection that currently owns a client id, or None
  load_later(client_id, clean_start) what `open` must first read from the store, asked for now: a
                                     future of it to hold the CONNECT on, or None (nothing to read)
  discard(loaded)                    a load the CONNECT will not use (its client left)
  open(client_id, clean_start, loaded)
                                     the session a CONNECT continues or starts -> (session, present)
  attach(conn, session)              `conn` owns the session from now on
  detach(conn)                       the connection went away (or was taken over): the session goes
                                     offline (persistent) or ends, and the connection's will is armed
  store_will(client_id, will, version) / drop_will(client_id)
                                     keep the will of a connection in metadata / forget it (a
                                     CONNECT voids the will a previous connection left anywhere)
  restore() / publish_orphan_wills() at start: persisted sessions back, this gateway's wills of a
                                     crash sent (a fleet's store node sends those of a gateway
                                     that does not come back, docs/fleet.md)
  close()                            at shutdown: cancel expiry and will timers
"""
from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import TYPE_CHECKING, Callable

from lmqtt.gateway.storage import record_props
from lmqtt.gateway.mqtt import packets as P
from lmqtt.gateway.clients.session_persistence import (BUILD, ENDED, INFLIGHT, Dormant, dormant_from,
                                                   start_offsets)
from lmqtt.gateway.storage.record_props import safe_decode
from lmqtt.gateway.session import NEVER_EXPIRES, ClientSubscription, MqttSession
from lmqtt.gateway.storage.facades import log_failure
from lmqtt.lightqueue import topics as T
from lmqtt.lightqueue.errors import InvalidTopicName
from lmqtt.lightqueue.records import WillRecord

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.net.connection import MQTTConnection
    from lmqtt.gateway.clients.session_persistence import SessionPersistence
    from lmqtt.gateway.subscriptions.subscription_registry import SubscriptionRegistry
    from lmqtt.gateway.storage.facades import Storage

log = logging.getLogger("lmqtt.gateway.sessions")

# publish(client_id, qos, topic, payload, retain, properties): a will or orphan will to the store
WillPublisher = Callable[[str, int, str, bytes, bool, "P.Properties | None"], None]


def _now_ms() -> int:
    return int(time.time() * 1000)


class SessionRegistry:
    def __init__(self, loop: asyncio.AbstractEventLoop, metrics, storage: "Storage", persist: "SessionPersistence",
                 subscriptions: "SubscriptionRegistry", publish: WillPublisher) -> None:
        self.loop = loop
        self.metrics = metrics
        self.wills = storage.wills            # the storage facades it uses (storage/facades.py)
        self.persist = persist
        self.subscriptions = subscriptions
        self._publish = publish
        self.sessions: dict[str, MqttSession] = {}
        self.on_expired: Callable[[str], None] | None = None   # a session ended by its expiry (events)
        # persistent sessions restored at start and not built yet (clients/session_persistence.py
        # `Dormant`): built by `_wake` when their client connects
        self.dormant: dict[str, Dormant] = {}
        # both gauges are read when scraped: a CONNECT and a session's end set none (a Gauge.set
        # takes a lock and four calls, twice per connection in a connect storm)
        gauge = getattr(metrics, "sessions_dormant", None)
        if gauge is not None:
            gauge.set_function(lambda: len(self.dormant))
        gauge = getattr(metrics, "sessions", None)
        if gauge is not None:
            gauge.set_function(self.count)
        self._owners: dict[str, "MQTTConnection"] = {}
        self._will_timers: dict[str, tuple[asyncio.TimerHandle, P.Will]] = {}
        # while the orphan wills of a crash are not taken (`publish_orphan_wills` failed): the
        # clients that connected since, whose crash wills their CONNECT voided
        self._connected_since: set[str] | None = None
        # a fleet's store node publishes the wills of a gateway away past its grace period
        storage.wills.on_wills_published(self.wills_published_elsewhere)

    # ------------------------------------------------------------------ lookups
    def get(self, client_id: str) -> MqttSession | None:
        return self.sessions.get(client_id)

    def owner(self, client_id: str) -> "MQTTConnection | None":
        return self._owners.get(client_id)

    def count(self) -> int:
        """Sessions known here: built (online, or offline persistent) and dormant."""
        return len(self.sessions) + len(self.dormant)

    # ------------------------------------------------------------------ connect / disconnect
    def load_later(self, client_id: str, clean_start: bool):
        """In-process, sessions live here: nothing to read before `open`."""
        return None

    def void_will(self, client_id: str, delayed_here: bool) -> None:
        """A CONNECT of `client_id`: the will a previous connection left is void, also one another
        gateway of a fleet holds (that gateway died: the store node would publish it after its
        grace period). `delayed_here`: this registry was holding a delayed will of it."""
        log_failure(self.wills.void(client_id), log, "void_will_failed", client_id=client_id)

    def discard(self, loaded) -> None:
        """A `load_later` result nobody will `open` with (the client left meanwhile)."""

    def open(self, client_id: str, clean_start: bool, loaded=None) -> tuple[MqttSession, bool]:
        """The session a CONNECT continues (present=True) or a new one; a pending delayed will of
        the client is cancelled (it reconnected within the will delay, MQTT 5 §3.1.3.2.2)."""
        wt = self._will_timers.pop(client_id, None)
        if wt is not None:
            wt[0].cancel()
        if self._connected_since is not None:      # orphan wills not taken yet: not this one's
            self._connected_since.add(client_id)
        self.void_will(client_id, wt is not None)
        d = self.dormant.pop(client_id, None)
        if d is not None:
            if clean_start:
                self._end_dormant(client_id, d)
            else:
                self._wake(client_id, d)
        s = self.sessions.get(client_id)
        if s is not None and clean_start:
            self._end(s)
            s = None
        present = s is not None
        if s is not None and s.has_saved():
            # kept from the restore at start and not reloaded with its messages read ahead: what
            # cannot be read now is delivered again as new (at least once, never lost)
            self._resume_inflight(s, None)
        if s is None:
            s = MqttSession(client_id)
            self.sessions[client_id] = s
        if s.expiry_handle is not None:
            s.expiry_handle.cancel()
            s.expiry_handle = None
        return s, present

    def attach(self, conn: "MQTTConnection", s: MqttSession) -> None:
        s.disconnected_at_ms = None
        s.conn = conn
        conn.session = s
        conn.client_id = s.client_id
        self._owners[s.client_id] = conn

    def detach(self, conn: "MQTTConnection") -> None:
        s = conn.session
        conn.session = None
        if s is None:
            return
        cid = s.client_id
        if self._owners.get(cid) is conn:
            del self._owners[cid]
        if s.conn is conn:
            s.conn = None
        self.subscriptions.go_offline(s)     # shared-group messages in flight go back to the group
        if conn.will is not None:
            self._arm_will(cid, conn.will, s, conn.version)
            conn.will = None
        if not s.persistent:
            self._end(s)
        else:
            s.disconnected_at_ms = _now_ms()
            self.persist.save_later(s)        # nothing waits for it: with the others of this tick
            if s in self.persist.dirty_sessions:
                # its offsets moved since they were last written (a cursor moves only forward and
                # marks the session dirty: SUBSCRIBE writes a new one's start; the flush timer, the rest)
                self.persist.save_offsets(s)
            self._schedule_expiry(s)

    # ------------------------------------------------------------------ wills
    def store_will(self, client_id: str, will: P.Will, version: int) -> None:
        """Keep the will in metadata while the connection lives: a crash still sends it."""
        try:
            delay = (will.properties.will_delay_interval or 0) if version == 5 else 0
            rec = WillRecord(will.topic, will.payload, will.qos, will.retain,
                             record_props.encode(will.qos, will.retain, client_id, will.properties), delay, _now_ms())
        except Exception as e:
            log.error("event=put_will_failed client_id=%s error=%r", client_id, e)
            return
        log_failure(self.wills.put(client_id, rec), log, "put_will_failed", client_id=client_id)

    def drop_will(self, client_id: str) -> None:
        log_failure(self.wills.pop(client_id), log, "pop_will_failed", client_id=client_id)

    def _arm_will(self, cid: str, will: P.Will, s: MqttSession, version: int) -> None:
        delay = (will.properties.will_delay_interval or 0) if version == 5 else 0
        delay = min(delay, s.expiry_interval) if s.persistent else 0
        if delay <= 0:
            self._send_will(cid, will)
        else:
            self._will_timers[cid] = (self.loop.call_later(delay, self._send_will, cid, will), will)

    def _send_will(self, cid: str, will: P.Will) -> None:
        self._will_timers.pop(cid, None)
        self.drop_will(cid)
        try:
            T.validate_topic(will.topic)
        except InvalidTopicName as e:
            log.warning("event=will_dropped client_id=%s error=%s", cid, e)
            return
        log.info("event=will_published client_id=%s topic=%s", cid, will.topic)
        self._publish(cid, will.qos, will.topic, will.payload, will.retain, will.properties)

    # ------------------------------------------------------------------ expiry / end
    def _end(self, s: MqttSession) -> None:
        self.subscriptions.remove_all(s)
        s.ended()
        if s.expiry_handle is not None:
            s.expiry_handle.cancel()
            s.expiry_handle = None
        self.persist.forget(s)
        if self.sessions.get(s.client_id) is s:
            del self.sessions[s.client_id]
        if s.persistent:
            # expired, or discarded by a clean start. A session without expiry has no record: the
            # CONNECT that began it deleted any earlier one (a persistent copy here ended, a
            # persistent session resumed without expiry, a fleet's clean start), and a DISCONNECT
            # setting its expiry to 0 deleted its own; each clean client's end was a metadata
            # write (a fleet's: a store request) for nothing
            self.persist.delete_session(s.client_id)

    def _expired(self, cid: str) -> None:
        if self.on_expired is not None:
            self.on_expired(cid)

    def _schedule_expiry(self, s: MqttSession, remaining_ms: int | None = None) -> None:
        if s.expiry_handle is not None:
            s.expiry_handle.cancel()
            s.expiry_handle = None
        if s.expiry_interval == NEVER_EXPIRES:
            return
        delay = s.expiry_interval if remaining_ms is None else max(0.0, remaining_ms / 1000.0)
        s.expiry_handle = self.loop.call_later(delay, self._expire, s.client_id)

    def _expire(self, cid: str) -> None:
        s = self.sessions.get(cid)
        if s is not None and not s.online:
            log.info("event=session_expired client_id=%s", cid)
            self._expired(cid)
            self._end(s)
            wt = self._will_timers.pop(cid, None)   # session end publishes a delayed will now
            if wt is not None:
                wt[0].cancel()
                self._send_will(cid, wt[1])

    # ------------------------------------------------------------------ start / stop
    def restore(self) -> int:
        """Persistent sessions back from metadata (expired ones deleted); returns how many. Each
        stays dormant (`Dormant`: its filters held, its expiry timed, nothing else) until its
        client connects; only a record of an older version is built at once (`dormant_from`)."""
        # a million records make millions of objects that all live on (acyclic: freed by their
        # reference counts when a session wakes or ends): the collector's passes over them while
        # they are made are wasted, and so would be every later full collection (the one before
        # serve's gc.freeze took 1-3 s after the port opened, before the first CONNACK): they
        # are frozen as they are made, with what the start made before them
        gc_was = gc.isenabled()
        gc.disable()
        try:
            return self._restore()
        finally:
            gc.freeze()
            if gc_was:
                gc.enable()

    def _restore(self) -> int:
        now = _now_ms()
        host = self.persist.host
        hold = self.subscriptions.hold_dormant
        dormant = self.dormant
        build: list[str] = []
        n = 0
        for raw in self.persist.records_for_restore():
            try:
                got = dormant_from(raw, host, now)
            except Exception as e:  # noqa: BLE001 - one record that does not decode: the others still come back
                log.error("event=session_restore_failed error=%r record=%r", e, bytes(raw[:200]))
                continue
            if got is None:
                continue                    # another gateway's (a node of the previous version sent it)
            cid, d, rewrite = got
            if d is ENDED:
                self.persist.delete_session(cid)
            elif d is BUILD:
                build.append(cid)
            else:
                hold(d.subs)
                dormant[cid] = d
                if rewrite:
                    self.persist.rewrite_offline(raw, d.last_ms)
                if d.expiry != NEVER_EXPIRES:
                    d.handle = self.loop.call_later(max(0.0, (d.expiry * 1000 - (now - d.last_ms)) / 1000.0),
                                                    self._expire_dormant, cid)
                n += 1
        # records of older versions: built now, as the restore always did (their reads sent together)
        for cid, answer in [(cid, self.persist.sessions.load(cid)) for cid in build]:
            try:
                rec, offsets = answer.wait()
            except Exception as e:  # noqa: BLE001
                log.error("event=session_restore_failed client_id=%s error=%r", cid, e)
                continue
            if rec is None:
                continue
            last = rec.last_disconnect_ms if rec.last_disconnect_ms is not None else now
            exp = rec.expiry_interval
            # over a remote store the messages of its exchanges in flight cannot be read here (they
            # are read ahead with the CONNECT that resumes it): the state waits, unchanged
            s = self._session_from(rec, offsets, last, read_inflight=host is None)
            if rec.last_disconnect_ms is None:   # was online when the server stopped/crashed
                self.persist.save_session(s)
            self._schedule_expiry(s, remaining_ms=(exp * 1000 - (now - last)) if exp != NEVER_EXPIRES else None)
            n += 1
        return n

    def _wake(self, cid: str, d: Dormant) -> MqttSession | None:
        """Build a dormant session (its client connects): its record and offsets read now, as the
        restore at start used to; then the dormant's holds let go (the built one holds them
        now). None if its record is gone or expired meanwhile."""
        if d.handle is not None:
            d.handle.cancel()
            d.handle = None
        try:
            rec, offsets = self.persist.sessions.load(cid).wait()
        except BaseException:
            self.dormant[cid] = d               # still dormant: the CONNECT fails, the session stays
            if d.expiry != NEVER_EXPIRES:
                self._expire_dormant_later(cid, d)
            raise
        s = None
        if rec is not None and not rec.expired(_now_ms()):
            s = self._session_from(rec, start_offsets(rec, offsets), d.last_ms,
                                   read_inflight=self.persist.host is None)
        elif rec is not None:               # expired before its timer fired: it ends (offsets too)
            log.info("event=session_expired client_id=%s", cid)
            self._expired(cid)
            self.persist.delete_session(cid)
        self.subscriptions.release_dormant(d.subs)
        return s

    def _end_dormant(self, cid: str, d: Dormant) -> None:
        """A dormant session ends (expired, or its client connected with clean start): its holds
        let go, its record and offsets deleted."""
        self._drop_dormant(cid, d)
        self.persist.delete_session(cid)

    def _drop_dormant(self, cid: str, d: Dormant) -> None:
        """Forget a dormant session here (its holds let go), its record untouched."""
        if self.dormant.get(cid) is d:
            del self.dormant[cid]
        if d.handle is not None:
            d.handle.cancel()
            d.handle = None
        self.subscriptions.release_dormant(d.subs)

    def _expire_dormant_later(self, cid: str, d: Dormant) -> None:
        left_ms = d.expiry * 1000 - (_now_ms() - d.last_ms)
        d.handle = self.loop.call_later(max(0.0, left_ms / 1000.0), self._expire_dormant, cid)

    def _expire_dormant(self, cid: str) -> None:
        d = self.dormant.get(cid)
        if d is not None:
            d.handle = None
            log.info("event=session_expired client_id=%s", cid)
            self._expired(cid)
            self._end_dormant(cid, d)

    def _session_from(self, rec, offsets: dict[str, int], last_ms: int, read_inflight: bool = True) -> MqttSession:
        """A persisted session record (and its committed offsets) back as a live Session here.
        `read_inflight=False`: its exchanges in flight are kept as read (`MqttSession.keep_saved`,
        written back unchanged) and resumed when a CONNECT reloads it with their messages."""
        s = MqttSession(rec.client_id)
        s.version = rec.protocol_version
        s.expiry_interval = rec.expiry_interval
        s.disconnected_at_ms = last_ms
        for rs in rec.subscriptions:
            flt = rs.filter if not rs.share_group else f"$share/{rs.share_group}/{rs.filter}"
            sub = ClientSubscription(flt, rs.filter, rs.qos, rs.share_group, rs.no_local,
                                     rs.retain_as_published, rs.retain_handling, rs.subscription_id)
            self.subscriptions.restore(s, sub, offsets if sub.group is None else {})
        state = rec.extra.get(INFLIGHT) if rec.extra else None
        if state:
            if read_inflight:
                self._resume_inflight(s, state)
            else:
                s.keep_saved(state)
                log.info("event=inflight_kept client_id=%s outbound=%d inbound_qos2=%d (resumed at its "
                         "connect)", s.client_id, *s.saved_counts())
        self.sessions[s.client_id] = s
        return s

    def _resume_inflight(self, s: MqttSession, state: dict | None) -> None:
        """Put a record's exchanges in flight back into `s` (`state`; None: those it kept as read,
        `keep_saved`): the messages are read again (in-process: here and now; a fleet gateway:
        read ahead with a resumed session's record, else they are delivered again as new ones)."""
        message_at = self.subscriptions.delivery.message_at
        try:
            requeued: list = []
            n = s.resume_saved(message_at, requeued) if state is None else s.restore(state, message_at, requeued)
            log.info("event=inflight_restored client_id=%s outbound=%d inbound_qos2=%d %s",
                     s.client_id, n, len(s.inbound_ids()[1]), s.exchanges_text())
            for q, off, why in requeued:
                log.warning("event=inflight_requeued client_id=%s queue=%s offset=%d reason=%r (its queue is "
                            "delivered again from the committed offset)", s.client_id, q, off, why)
        except Exception as e:  # noqa: BLE001 - a record we cannot use: delivered again as new
            log.error("event=inflight_restore_failed client_id=%s error=%r", s.client_id, e)

    ORPHAN_WILLS_RETRY_S = 5.0

    def publish_orphan_wills(self) -> int:
        """Wills this gateway held for connections alive at its crash: send them now. Only its own
        (`take_wills`): in a fleet, the wills of clients on other gateways are theirs, and those of
        a gateway that does not come back are published by the store node (docs/fleet.md). A take
        that fails (the store away, its disk full) is tried again later (`_retry_orphan_wills`)."""
        try:
            wills = self.wills.take().wait()
        except Exception as e:
            log.error("event=take_wills_failed error=%r (orphan wills published once the store takes them: tried "
                      "again every %.0f s)", e, self.ORPHAN_WILLS_RETRY_S)
            self._connected_since = set()
            self.loop.call_later(self.ORPHAN_WILLS_RETRY_S, self._retry_orphan_wills)
            return 0
        return self._publish_orphans(wills)

    def _retry_orphan_wills(self) -> None:
        """The wills held now, less those of clients that connected since the failed take (their
        CONNECT voided the crash's will; what is held for them now is their live connection's):
        each is let go of and published. Decided in the turn the answer arrives, so a CONNECT that
        comes after is ordered after these pops on the store's link."""
        def got(a) -> None:
            e = a.exception()
            if e is not None:
                log.error("event=take_wills_failed error=%r (tried again in %.0f s)", e, self.ORPHAN_WILLS_RETRY_S)
                self.loop.call_later(self.ORPHAN_WILLS_RETRY_S, self._retry_orphan_wills)
                return
            connected, self._connected_since = self._connected_since or set(), None
            orphans = [(cid, w) for cid, w in a.result() if cid not in connected]
            for cid, _w in orphans:
                self.drop_will(cid)
            n = self._publish_orphans(orphans)
            log.info("event=orphan_wills_published wills=%d skipped_reconnected=%d", n, len(a.result()) - len(orphans))
        self.wills.held().add_done_callback(got)

    def _publish_orphans(self, wills) -> int:
        n = 0
        for cid, w in wills:
            try:
                T.validate_topic(w.topic)
            except InvalidTopicName as e:
                log.warning("event=will_dropped client_id=%s error=%s", cid, e)
                continue
            rec = safe_decode(w.props)
            log.info("event=orphan_will_published client_id=%s topic=%s", cid, w.topic)
            self._publish(cid, w.qos, w.topic, w.payload, w.retain,
                          rec.to_properties() if rec.has_app_properties() else None)
            n += 1
        return n

    def wills_published_elsewhere(self, client_ids) -> None:
        """The store node published these clients' wills while this gateway was cut off from it
        longer than the grace period: a connection still here must not publish its will again."""
        n = 0
        for cid in client_ids:
            conn = self._owners.get(cid)
            if conn is not None and conn.will is not None:
                conn.will = None
                n += 1
            wt = self._will_timers.pop(cid, None)
            if wt is not None:
                wt[0].cancel()
                n += 1
        if n:
            log.warning("event=wills_published_by_store count=%d (this gateway was away from the store "
                        "longer than its will grace period)", n)

    def close(self) -> None:
        for t, _w in self._will_timers.values():
            t.cancel()
        for d in self.dormant.values():
            if d.handle is not None:
                d.handle.cancel()
        for s in self.sessions.values():
            if s.expiry_handle is not None:
                s.expiry_handle.cancel()
