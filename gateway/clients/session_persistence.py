"""Persistent-session state in the store's metadata: session records and consumer offsets.

Why a separate module: this is the only place that knows how the gateway's in-memory `Session`
maps to the light-queue metadata records (`SessionRecord`, offsets per consumer), and it owns the
write batching. Offsets change at ack rate, so they are only marked dirty on the hot path and
written every `offset_flush_ms` by this module's timer (`start_flushing`; a crash loses at most that much progress:
the messages are delivered again, never lost). Session records change at subscribe/connect rate
and are written synchronously, before SUBACK/CONNACK, so an acknowledged subscription survives
`kill -9`; a connected persistent session's record is also written ahead of its QoS 2 packets
(`write_ahead`, `journal`: QoS 2 exactly once across a crash).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from json.encoder import encode_basestring as _quote

from lmqtt.gateway.mqtt import ReasonCode
from lmqtt.gateway.session import ClientSubscription
from lmqtt.gateway.storage.facades import Answer, log_failure
from lmqtt.lightqueue.records import (HOST, NEVER_EXPIRES, SessionRecord,
                                      Subscription as SubscriptionRecord, is_stub_bytes)

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.session import MqttSession
    from lmqtt.gateway.subscriptions.shared_groups import SharedGroup
    from lmqtt.gateway.storage.facades import Storage

log = logging.getLogger("lmqtt.gateway.clients.session_persistence")


def _now_ms() -> int:
    return int(time.time() * 1000)


# The QoS 1/2 exchanges of an offline session, kept in its record (`extra["inflight"]`), so that a
# restart resumes them as MQTT asks of a session (§4.4: the same packet ids, PUBLISH again with DUP
# or PUBREL for those past PUBREC; inbound QoS 2 ids awaiting PUBREL still known): without them a
# restarted server would send its unacknowledged messages again as new ones, and a QoS 2 message
# the client had already received would reach its application twice.
#
# An offline session: nothing changes its exchanges (no delivery, no acks; its shared-group
# messages went back to their groups), so the record written when it went offline
# (`SessionRegistry.detach`, also at a graceful shutdown) stays true until it connects again.
#
# A connected session (write-ahead, QoS 2 only): QoS 2 is exactly once, so a crash must not make
# the server send a message again as new that the client may already hold or have delivered. The
# record of a connected persistent session is written with its exchanges (a snapshot in this same
# format) before a packet that depends on them leaves: a batch of new QoS 2 PUBLISHes
# (`write_ahead`, the delivery engine's batch waits for its answer), a PUBREL (the PUBREC's state
# change), a PUBREC for an inbound QoS 2 message (its id now "stored, awaiting PUBREL") and a
# PUBCOMP (the id forgotten) (`journal`: one write per session per event-loop tick, the packets
# sent when the store answered). A PUBCOMP received writes nothing: the next snapshot leaves the
# exchange out; until then a restart sends that PUBREL again, which the client answers with
# PUBCOMP (no delivery). A snapshot also says where delivery stands ("next" per queue: whatever
# below it is not in "out" was done), so the offsets may follow lazily (`offset_flush_ms`). QoS 0
# and QoS 1 sends write nothing: after a crash what they sent after the last snapshot is delivered
# again (at least once).
#
# An inbound QoS 2 PUBLISH of a persistent session: its id is written BEFORE the append as pending
# ("in2p": the message carries a unique key, broker/broker.py `_qos2_ahead`), and after it as stored
# ("in2", before the PUBREC). A crash in between leaves it pending: when the record is read back,
# the store looks the key up in its log (lightqueue/records.py `resolve_pending_qos2`): stored ->
# "stored, awaiting PUBREL" (the client's PUBLISH sent again is answered, not stored twice), not
# stored -> still pending (the client's PUBLISH sent again is stored then, with the same key: a
# remote store keeps one record per key, store/unique_keys.py).
INFLIGHT = "inflight"
# `lmqtt serve`: a resumed session that never expires has its record say "connected" once it has
# been connected this long (`SessionPersistence.save_later`)
CONNECTED_RECORD_AFTER_S = 1.0


class Dormant:
    """A persistent session restored at start and not built yet: its client has not come back.

    Why: a restart with a million sessions must not build a million `Session` objects (their
    dicts, cursors and exchanges: ~1.7 KiB each) nor decode every record into one, when most
    clients come back later or never. Before its client returns a session needs only what keeps
    its messages: its wildcard filters held with the store (the publish path indexes matching
    messages into their queues) and its shared groups' references (`SubscriptionRegistry
    .hold_dormant`), and its expiry. Everything else - its cursors at the committed offsets, its
    exchanges in flight - is read from its record when the client connects
    (`SessionRegistry._wake`), exactly as the restore used to read it at start.

    `subs`: flat (queue, share group or None, ...) of its subscriptions; `last_ms`: when it went
    offline; `handle`: its expiry timer (None: never expires)."""

    __slots__ = ("last_ms", "expiry", "subs", "handle")

    def __init__(self, last_ms: int, expiry: int, subs: tuple) -> None:
        self.last_ms = last_ms
        self.expiry = expiry
        self.subs = subs
        self.handle: asyncio.TimerHandle | None = None


ENDED = "ended"      # dormant_from: the record's session ended (no expiry, or expired)
BUILD = "build"      # dormant_from: the session cannot wait dormant, built at start as before


_decode = json.JSONDecoder().decode     # on str: json.loads(bytes) first detects the encoding (~20 % more)


def _fields(raw: bytes):
    """(client id, expiry, last disconnect ms or None, [(filter, group or None)], the queues of
    its "next" or None, host or None) of a record's bytes."""
    d = _decode(raw.decode("utf-8"))
    extra = d.get("extra") or {}
    state = extra.get(INFLIGHT)
    nxt = state.get("next") if isinstance(state, dict) else None
    return (d["client_id"], d.get("expiry_interval") or 0, d.get("last_disconnect_ms"),
            [(sub["filter"], sub.get("share_group")) for sub in d.get("subscriptions") or ()],
            nxt if isinstance(nxt, dict) else None, extra.get(HOST))


def dormant_from(raw: bytes, hosted_by: str | None, now_ms: int) -> tuple[str, "Dormant | str", bool] | None:
    """What the restore needs of one record's bytes: (client id, a `Dormant` | ENDED | BUILD,
    whether the record must be written again), or None when the record is not this gateway's
    (`hosted_by`: a fleet gateway restores its own and those of no gateway). ENDED: no expiry, or
    expired (the caller deletes it). BUILD: a subscription whose start is in neither its committed
    offset nor its record's "next" (records of older versions): the caller builds it now, as
    before. "Written again": it was online when the gateway stopped (`last_disconnect_ms` null),
    it is offline from now on (`rewrite_offline`). One JSON decode per record (most of a
    restore's time); no SessionRecord is built (a third more)."""
    cid, expiry, last, subs, nxt, host = _fields(raw)
    if hosted_by is not None and host is not None and host != hosted_by:
        return None
    if expiry <= 0 or (last is not None and expiry != NEVER_EXPIRES and now_ms - last >= expiry * 1000):
        return cid, ENDED, False
    flat: list = []
    for q, g in subs:
        if g is None and not (nxt and q in nxt):
            return cid, BUILD, False
        flat += (q, g)
    return cid, Dormant(now_ms if last is None else last, expiry, tuple(flat)), last is None


def start_offsets(rec: SessionRecord, offsets: dict[str, int]) -> dict[str, int]:
    """The committed offsets of a dormant session woken by its client, with the record's "next"
    (where delivery stood when it was written) for a queue that has none: a queue's start is
    never the queue's end at wake-up time (what was stored while it slept would be skipped)."""
    state = rec.extra.get(INFLIGHT) if rec.extra else None
    nxt = state.get("next") if isinstance(state, dict) else None
    if not nxt:
        return offsets
    missing = [q for q in nxt if q not in offsets]
    if not missing:
        return offsets
    out = dict(offsets)
    for q in missing:
        out[q] = int(nxt[q])
    return out


# the records' JSON (lightqueue/records.py `SessionRecord.to_bytes`): for what the template does not write
_json_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
# a plain subscription's options as its record writes them (`ClientSubscription`: the class's defaults)
_PLAIN_SUB_TAIL = ',"no_local":false,"retain_as_published":false,"retain_handling":0,"subscription_id":null,"share_group":null}'


def _record_bytes(s: "MqttSession", last: int | None, host: str | None) -> bytes | None:
    """The bytes `SessionRecord.to_bytes` gives for the record of `s` (`last`: its
    last_disconnect_ms), written straight from the session: a template for what almost every
    record is (ints, plain subscriptions, exchanges with nothing in flight) and the reference
    JSON encoder for the rest (a subscription with options, exchanges in flight, a state restored
    as read). None: a field of a type the template does not write (the caller encodes the
    reference record)."""
    v, e = s.version, s.expiry_interval
    if v.__class__ is not int or e.__class__ is not int or not (last is None or last.__class__ is int):
        return None
    subs = []
    for sub in s.subs.values():
        q = sub.qos
        if sub.__class__ is ClientSubscription and q.__class__ is int:
            subs.append(f'{{"filter":{_quote(sub.queue)},"qos":{q}{_PLAIN_SUB_TAIL}')
        else:
            subs.append(_json_dumps({"filter": sub.queue, "qos": sub.qos, "no_local": sub.no_local,
                                     "retain_as_published": sub.retain_as_published,
                                     "retain_handling": sub.retain_handling,
                                     "subscription_id": sub.subscription_id, "share_group": sub.group}))
    # its exchanges (`MqttSession.snapshot`): nothing in flight and where delivery stands, written here
    state = None
    pid = s.plain_snapshot_pid()
    if pid is not None:
        nxt = []
        for q, cur in s.cursors.items():
            n = cur.next_offset
            if n.__class__ is not int:
                state = True
                break
            nxt.append(f"{_quote(q)}:{n}")
        if state is None and pid.__class__ is int:
            extra = f'{{"{INFLIGHT}":{{"out":[],"next":{{{",".join(nxt)}}},"in2":[],"pid":{pid}}}' if nxt else "{"
            if host is not None:
                extra += f'{"," if nxt else ""}"{HOST}":{_quote(host)}'
            extra += "}"
        else:
            state = True
    else:
        state = True
    if state is not None:
        st = s.snapshot()
        ex = {INFLIGHT: st} if st else {}
        if host is not None:
            ex[HOST] = host
        extra = _json_dumps(ex)
    return (f'{{"client_id":{_quote(s.client_id)},"protocol_version":{v},"expiry_interval":{e},'
            f'"last_disconnect_ms":{"null" if last is None else last},"subscriptions":[{",".join(subs)}],'
            f'"extra":{extra},"v":1}}').encode("utf-8")


class WrittenRecord(SessionRecord):
    """A session's record as `SessionPersistence.record_of` made it: its bytes encoded once from the
    session, its scalar fields set; its `subscriptions` and `extra` read back from the bytes
    when asked for (the write path asks only `to_bytes()` and `host`)."""

    def __init__(self, client_id: str, protocol_version: int, expiry_interval: int,
                 last_disconnect_ms: int | None, raw: bytes, host: str | None) -> None:
        self.client_id = client_id
        self.protocol_version = protocol_version
        self.expiry_interval = expiry_interval
        self.last_disconnect_ms = last_disconnect_ms
        self._raw = raw
        self._host = host

    def __getattr__(self, name: str) -> Any:
        if name in ("subscriptions", "extra"):
            rec = SessionRecord.from_bytes(self._raw)
            self.subscriptions, self.extra = rec.subscriptions, rec.extra
            return getattr(self, name)
        raise AttributeError(name)

    @property
    def host(self) -> str | None:
        return self._host

    @property
    def is_stub(self) -> bool:
        """As `SessionRecord.is_stub`, from the bytes: the metadata asks it of every record it
        writes, and reading `extra` for it decoded the JSON just encoded (in a reconnect storm,
        ~15 % of the broker's time per persistent session went to that decode)."""
        return is_stub_bytes(self._raw)

    def to_bytes(self) -> bytes:
        return self._raw


def _mark(s: "MqttSession") -> tuple:
    """What of a session its record would show differently once changed while its connection
    closes: its exchanges in flight, its next packet id, where delivery stands, its subscriptions."""
    return (*s.change_mark(), len(s.subs), s.expiry_interval, tuple(c.next_offset for c in s.cursors.values()))


class SessionPersistence:
    def __init__(self, storage: "Storage", *, session_live: Callable[["MqttSession"], bool],
                 group_live: Callable[["SharedGroup"], bool], host: str | None = None, metrics=None) -> None:
        """`session_live(s)` / `group_live(g)`: whether a dirty session or shared group is still
        the live one when its offsets are written (`flush`); an ended or replaced session, a
        dropped group, must not write its offsets over its successor's. `host`: the fleet gateway
        id written into every record (`SessionRecord.host`), so that this gateway restores at
        start the sessions it served last, and no others; None in the embedded server."""
        self.sessions = storage.sessions          # the storage facades it uses (storage/facades.py)
        self.offsets = storage.offsets
        self.host = host
        self.metrics = metrics                    # GatewayMetrics (`session_record_writes`), None in tests
        self.dirty_sessions: set["MqttSession"] = set()
        self.dirty_groups: set["SharedGroup"] = set()
        self._session_live = session_live
        self._group_live = group_live
        self._flush_handle: asyncio.TimerHandle | None = None
        self._flush_interval: float | None = None     # set while flushing (start_flushing)
        self._loop: asyncio.AbstractEventLoop | None = None
        # sessions whose record (with its exchanges) is written at the end of this tick, and the
        # packets (encoded) each waits with until the store answered (`journal`)
        self._journal: dict["MqttSession", list[bytes]] = {}
        self._journal_scheduled = False
        # `lmqtt serve`: the sessions whose records are written together at the end of this tick
        # (`save_later`), by client id
        self._later: dict[str, "MqttSession"] = {}
        self._later_scheduled = False
        # sent DISCONNECT (`close_after_record`): (session, connection) closed once the record is in
        self._closing: list[tuple["MqttSession", Any]] = []
        # written so by `close_after_record`: client id -> (session, `_mark` then); its detach
        # writes nothing more unless the session changed since
        self._left: dict[str, tuple["MqttSession", tuple]] = {}
        # `lmqtt serve`: never-expiring sessions resumed whose record saying "connected" waits
        # CONNECTED_RECORD_AFTER_S (`save_later`), by client id, and the timer that writes them
        self._connected: dict[str, "MqttSession"] = {}
        self._connected_handle: asyncio.TimerHandle | None = None

    # -- session records ----------------------------------------------------------------------
    def record_of(self, s: "MqttSession", offline_ms: int | None = None) -> SessionRecord:
        """`offline_ms`: the record as of the session gone offline then (its client sent DISCONNECT
        and its connection is about to close). Encoded here, once (`WrittenRecord`): the bytes
        `record_reference(s, offline_ms).to_bytes()` gives, without the record's objects and its
        dict in between (a reconnect storm: a record was built, then built again as a dict, then
        encoded; tests/restart/test_record_encoding.py compares the two)."""
        online = s.online and offline_ms is None
        last = None if online else (offline_ms or s.disconnected_at_ms or _now_ms())
        raw = _record_bytes(s, last, self.host)
        if raw is None:                         # a shape the template does not write: the reference
            return self.record_reference(s, offline_ms)
        return WrittenRecord(s.client_id, s.version, s.expiry_interval, last, raw, self.host)

    def record_reference(self, s: "MqttSession", offline_ms: int | None = None) -> SessionRecord:
        """The session's record as a plain `SessionRecord` (the reference `record_of` encodes as)."""
        online = s.online and offline_ms is None
        # a connected session's too: a snapshot written by `write_ahead` / `journal` must not be
        # erased by a record written for another reason (SUBSCRIBE, UNSUBSCRIBE, CONNECT)
        state = s.snapshot()
        return SessionRecord(
            client_id=s.client_id, protocol_version=s.version, expiry_interval=s.expiry_interval,
            last_disconnect_ms=None if online else (offline_ms or s.disconnected_at_ms or _now_ms()),
            subscriptions=[SubscriptionRecord(filter=sub.queue, qos=sub.qos, no_local=sub.no_local,
                                 retain_as_published=sub.retain_as_published,
                                 retain_handling=sub.retain_handling, subscription_id=sub.subscription_id,
                                 share_group=sub.group)
                           for sub in s.subs.values()],
            extra=self._extra(state))

    def _extra(self, state: dict | None) -> dict:
        extra = {INFLIGHT: state} if state else {}
        if self.host is not None:
            extra[HOST] = self.host
        return extra

    def save_session(self, s: "MqttSession"):
        """Write the session's record: the store's answer (a CONNACK / SUBACK it backs waits for
        it); a failure is logged here."""
        if self._later:
            self._later.pop(s.client_id, None)       # this write is newer than the one waiting
        if self._left:
            self._left.pop(s.client_id, None)        # its detach writes again
        if self._connected:
            self._connected.pop(s.client_id, None)   # this write says it is connected, if it is
        try:
            rec = self.record_of(s)
        except Exception as e:
            log.error("event=save_session_failed client_id=%s error=%r", s.client_id, e)
            return None
        answer = self.sessions.put(s.client_id, rec)
        log_failure(answer, log, "save_session_failed", client_id=s.client_id)
        if self.metrics is not None:
            self.metrics.session_record_writes += 1
        return answer

    @property
    def writes_later(self) -> bool:
        """Whether `save_later` leaves records for the end of the tick (`lmqtt serve`)."""
        return self.host is None and self._loop is not None

    def save_later(self, s: "MqttSession") -> None:
        """Write the session's record at the end of this event-loop tick, with every other record
        left for it, in one metadata write: for a record no packet waits for (a
        reconnect storm's records were a write each). Two of them: a persistent session gone
        offline (its client is gone; the record says since when, and its exchanges in flight),
        and a session resumed by a CONNECT with nothing of QoS 2 to send again (the record says
        it is connected: its expiry does not run). A `kill -9` before the tick's end loses only
        that change of state: the session comes back as its last record says (each change of its
        subscriptions and exchanges was written before the packet that told the client), with
        its expiry counted from the disconnect before, or from the restart. The record is built
        when written, from the session as it then is; a newer write of it (`save_session`) or
        its end (`delete_session`) in the same tick replaces it. A fleet gateway (`host`) writes
        it now: the store orders it before another gateway's claim of the session."""
        if self.host is not None or self._loop is None:
            self.save_session(s)
            return
        if self._left:
            left = self._left.pop(s.client_id, None)
            if left is not None and left[0] is s and left[1] == _mark(s):
                return                        # its DISCONNECT's record says it all
        if s.conn is not None and s.expiry_interval == NEVER_EXPIRES:
            # resumed, and it never expires: "connected" in its record changes nothing a restart
            # does with it (no expiry to stop), only what `lmqtt admin sessions` shows; it is
            # written if the session is still connected CONNECTED_RECORD_AFTER_S from now, with the
            # others then, in one write (a client that comes and goes - a reconnect
            # storm's - had its record written twice, once to say "connected")
            self._connected[s.client_id] = s
            if self._connected_handle is None:
                self._connected_handle = self._loop.call_later(CONNECTED_RECORD_AFTER_S, self.write_connected)
            return
        self._later[s.client_id] = s
        if not self._later_scheduled:
            self._later_scheduled = True
            self._loop.call_soon(self.write_later)

    def write_connected(self) -> None:
        """Write the records `save_later` left waiting of resumed never-expiring sessions still
        connected (one write); those gone offline meanwhile had their offline record written."""
        if self._connected_handle is not None:
            self._connected_handle.cancel()
            self._connected_handle = None
        waiting, self._connected = self._connected, {}
        live = self._session_live
        for cid, s in waiting.items():
            if s.conn is not None and live(s):
                self._later[cid] = s          # built and written with this tick's others
        if self._later and not self._later_scheduled:
            self.write_later()

    def close_after_record(self, s: "MqttSession", conn) -> bool:
        """`s`'s client sent DISCONNECT on `conn`. On `lmqtt serve` (persistent session): nothing
        more of `conn` is handled, its record as of now, offline, goes with this tick's others
        (`write_later`), and `conn` is closed once it is written - a client that sees its
        connection closed may count on the record saying what it acknowledged before it left (a
        restart, even `kill -9`, then resends none of it: tests/e2e/test_e2e_inflight_restart.py);
        the detach that follows the close writes nothing more unless the session changed since.
        False: the caller closes `conn` now (its record is written at detach, at once)."""
        if not (s.persistent and self.writes_later):
            return False
        conn.hold()
        self._closing.append((s, conn))
        if not self._later_scheduled:
            self._later_scheduled = True
            self._loop.call_soon(self.write_later)
        return True

    def write_later(self) -> None:
        """Write the records `save_later` left for the end of this tick: one write."""
        self._later_scheduled = False
        if not self._later and not self._closing:
            return
        waiting, self._later = self._later, {}
        closing, self._closing = self._closing, []
        live = self._session_live
        records = []
        for cid, s in waiting.items():
            if not live(s):
                continue                      # ended or replaced: its own writes tell
            try:
                records.append((cid, self.record_of(s)))
            except Exception as e:  # noqa: BLE001 - the others are written
                log.error("event=save_session_failed client_id=%s error=%r", cid, e)
        left = []
        if closing:
            now = _now_ms()
            for s, conn in closing:
                cid = s.client_id
                if s.conn is not conn or not live(s) or cid in waiting:
                    continue                  # detached already (its record is in `waiting`), or ended
                try:
                    records.append((cid, self.record_of(s, offline_ms=now)))
                except Exception as e:  # noqa: BLE001 - its detach writes it then
                    log.error("event=save_session_failed client_id=%s error=%r", cid, e)
                    continue
                left.append((cid, s))
        try:
            if records:
                answer = self.sessions.put_many(records)
                log_failure(answer, log, "save_session_failed", client_id=records[0][0], records=len(records))
                if self.metrics is not None:
                    self.metrics.session_record_writes += len(records)
                if answer.done() and answer.exception() is None:
                    for cid, s in left:       # written: their detach need not write again
                        self._left[cid] = (s, _mark(s))
        finally:
            for _s, conn in closing:
                conn.close()

    # -- QoS 2 write-ahead of a connected session's exchanges ------------------------------------
    def write_ahead(self, s: "MqttSession"):
        """New QoS 2 PUBLISHes of a persistent session were queued to its connection (not yet on
        the wire): write its record with its exchanges now; the caller makes the connection's
        output wait for the answer (`MQTTConnection.wait_for_store`). None: nothing to write."""
        if not s.expiry_interval:
            return None
        return self.save_session(s)

    def journal(self, s: "MqttSession", packet: bytes | None) -> None:
        """A QoS 2 exchange of `s` changed (PUBREC received, inbound id stored or released): its
        record is written at the end of this event-loop tick (one write per session per tick),
        and `packet` (the PUBREL / PUBREC / PUBCOMP that depends on it) is written to the
        connection once the store answered. Not a persistent session: `packet` goes now."""
        if not s.expiry_interval:
            if packet is not None and s.conn is not None:
                s.conn.write(packet)
            return
        waiting = self._journal.get(s)
        if waiting is None:
            waiting = self._journal[s] = []
        if packet is not None:
            waiting.append(packet)
        if not self._journal_scheduled:
            self._journal_scheduled = True
            (self._loop or asyncio.get_running_loop()).call_soon(self.write_journal)

    def write_journal(self) -> None:
        """Write the records `journal` asked for this tick; each session's packets follow its
        answer. A failed write: the packets are not sent (the peer sends its packet again when it
        reconnects) and the connection is closed, naming the cause."""
        self._journal_scheduled = False
        j, self._journal = self._journal, {}
        live = self._session_live
        for s, packets in j.items():
            conn = s.conn
            if not live(s):
                continue
            answer = self.save_session(s)
            if not packets or conn is None:
                continue
            if answer is None:
                conn.close_with_error(ReasonCode.UNSPECIFIED_ERROR, "session state could not be written")
                continue

            def sent(a, s=s, conn=conn, packets=packets) -> None:
                if s.conn is not conn or conn.closing:
                    return                  # reconnected meanwhile: the new connection resends
                if a.exception() is not None:
                    conn.close_with_error(ReasonCode.UNSPECIFIED_ERROR,
                                          f"session state could not be written: {a.exception()}")
                    return
                for data in packets:
                    conn.write(data)
            answer.add_done_callback(sent)

    def delete_session(self, client_id: str) -> "Answer[None]":
        """Drop the record and the session's offsets (consumer name = client id). A failure is
        logged here; the answer is the caller's to wait for (a CONNACK that must follow it)."""
        self._later.pop(client_id, None)
        self._connected.pop(client_id, None)
        self._left.pop(client_id, None)
        answer = self.sessions.delete(client_id)
        log_failure(answer, log, "delete_session_failed", client_id=client_id)
        return answer

    def records_for_restore(self):
        """The session records' bytes to restore at start (`dormant_from` reads each): all of them in
        the embedded server; in a fleet those this gateway served last and those of no gateway."""
        return self.sessions.records_for_restore(self.host).wait()

    def rewrite_offline(self, raw: bytes, last_ms: int) -> None:
        """A session that was online when the gateway stopped is offline since `last_ms`: its record
        written again as read, with that time (and this gateway's id in a fleet), its exchanges in
        flight unchanged (they are resumed when its client connects)."""
        try:
            rec = SessionRecord.from_bytes(raw)
        except Exception as e:  # noqa: BLE001 - its expiry then counts from its next disconnect
            log.error("event=save_session_failed error=%r", e)
            return
        rec.last_disconnect_ms = last_ms
        if self.host is not None:
            rec.extra[HOST] = self.host
        log_failure(self.sessions.put(rec.client_id, rec), log, "save_session_failed", client_id=rec.client_id)

    # -- offsets ------------------------------------------------------------------------------
    def mark_session(self, s: "MqttSession") -> None:
        if s.expiry_interval:
            self.dirty_sessions.add(s)
            if self._flush_handle is None:
                self._arm()

    def mark_group(self, g: "SharedGroup") -> None:
        self.dirty_groups.add(g)
        if self._flush_handle is None:
            self._arm()

    def forget(self, s: "MqttSession") -> None:
        """The session ended or its copy here was dropped: its offsets are not written any more
        (they would write over its successor's, or recreate a deleted session's)."""
        self.dirty_sessions.discard(s)

    def drop_writes(self, s: "MqttSession") -> None:
        """The session's copy stays here, but its record is another gateway's to write now (a
        fleet gateway's copy kept after another's claim): nothing pending of it is written, not
        its journal of this tick (as a failed write: the packets waiting for it are not sent, the
        client sends its own again) nor its offsets."""
        self._journal.pop(s, None)
        self.forget(s)

    def forget_group(self, g: "SharedGroup") -> None:
        """The group was dropped (its last member unsubscribed): its offset is not written any more."""
        self.dirty_groups.discard(g)

    def save_offsets(self, s: "MqttSession") -> None:
        self.dirty_sessions.discard(s)
        if s.cursors:
            if self.metrics is not None:
                self.metrics.session_offset_writes += 1
            log_failure(self.offsets.set(s.client_id, {q: c.committed() for q, c in s.cursors.items()}),
                        log, "save_offsets_failed", client_id=s.client_id)

    def save_group_offset(self, g: "SharedGroup") -> None:
        self.dirty_groups.discard(g)
        log_failure(self.offsets.set(g.consumer, {g.queue: g.cursor.committed()}),
                    log, "save_group_offset_failed", group=g.name)

    def start_flushing(self, loop: asyncio.AbstractEventLoop, interval_s: float) -> None:
        """Write the dirty offsets now and then every `interval_s` (offset_flush_ms) (`flush`),
        the timer armed only while something is dirty (an idle broker does not wake for it)."""
        self._loop = loop
        self._flush_interval = interval_s
        self._flush_tick()

    def _flush_tick(self) -> None:
        self._flush_handle = None
        try:
            self.flush()
        finally:
            if self.dirty_sessions or self.dirty_groups:
                self._arm()

    def _arm(self) -> None:
        """Something became dirty: written within `interval_s` (not before start_flushing)."""
        if self._flush_handle is None and self._flush_interval is not None:
            self._flush_handle = self._loop.call_later(self._flush_interval, self._flush_tick)

    def stop_flushing(self) -> None:
        """At shutdown: no more timer; what is dirty is written one last time."""
        self._flush_interval = None
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        self.write_connected()
        self.write_later()
        self.flush()

    def flush(self) -> None:
        """Write every dirty offset of sessions/groups that are still the live ones."""
        ds, self.dirty_sessions = self.dirty_sessions, set()
        live = self._session_live
        for s in ds:
            if s.expiry_interval and live(s):
                self.save_offsets(s)
        dg, self.dirty_groups = self.dirty_groups, set()
        live = self._group_live
        for g in dg:
            if live(g):
                self.save_group_offset(g)
