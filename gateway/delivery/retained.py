"""Retained messages sent because of a SUBSCRIBE (MQTT §3.3.1.3, MQTT 5 §3.8.3.1 Retain Handling).

Why its own module: the broker decides *whether* a subscription gets the retained messages (Retain
Handling, shared or not); this is the mechanics of sending them — the metadata lookup, the ACL's
read rule per topic, No Local, the MQTT 5 expiry deadline kept in the retained value (expired ones
are deleted when found), the subscription identifier, and the QoS 1/2 window (what does not fit
waits in `Session.retained_backlog` until acks open it).
"""
from __future__ import annotations

import logging
import time
from operator import itemgetter
from typing import TYPE_CHECKING

from lmqtt.gateway.mqtt import encode_publish_run
from lmqtt.gateway.storage.facades import log_failure
from lmqtt.gateway.model.record_props import MetaCache, RETAINED_DEADLINE as _DEADLINE, split_retained
from lmqtt.gateway.model.session import (RUN_FLUSH_FIRST, RUN_FLUSH_MAX, ClientSubscription, HeldInFlight, OutboundMessage,
                                   Session)

Held = HeldInFlight
held = tuple.__new__


class RetainedMessage(tuple):
    """(topic, body, store_ts) of a retained message held in flight as a `HeldInFlight` (its
    `message` reads these three by name when a resend needs the message)."""

    __slots__ = ()
    topic = property(itemgetter(0))
    body = property(itemgetter(1))
    store_ts = property(itemgetter(2))


if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.storage.facades import RetainedStore

log = logging.getLogger("lmqtt.gateway")


def is_sys_filter(flt: str) -> bool:
    """A topic filter whose first level is `$SYS`: only `$SYS` topics can match it (wildcards at the
    first level never match a `$` topic), and only the broker publishes those."""
    return flt.startswith("$SYS") and (len(flt) == 4 or flt[4] == "/")


def send_retained(retained: "RetainedStore", acl, s: Session, sub: ClientSubscription, found=None,
                  batches=None) -> None:
    """Send `s` the retained messages matching `sub` (retain flag 1), window permitting.
    `retained`: the retained-message facade (storage/facades.py); `acl`: None when not configured.

    Messages whose PUBLISH needs nothing per subscriber but QoS, packet id and the retain flag
    (MQTT 3.1.1, or MQTT 5 without properties, expiry, topic alias, subscription identifier or
    Maximum Packet Size) are encoded as one run (`encode_publish_run`) and written at once; the
    others go through `Session.send_message` after the run so far is written (the order on the wire
    is the lookup's). Why: a `#` subscribe over 1,000 retained topics spent most of its time in a
    props decode, a PUBLISH template and a write per message. `found`: the messages, when already
    read (a remote store's read-ahead), or `batches` (the `RetainedStore.batches` answer's
    iterator, asked for with the SUBSCRIBE's other reads); else they are read here. A `$SYS` filter's are never in
    the store (the gateway's own values, core/sys_topics.py): `retained` answers those from memory
    and a read-ahead of the store for one is not used."""
    if found is not None and not is_sys_filter(sub.queue):
        return _send(retained, acl, s, sub, iter((found,)))
    if batches is not None and not is_sys_filter(sub.queue):
        return _send(retained, acl, s, sub, _reading(batches, sub.queue))
    try:
        found = retained.batches(sub.queue).wait()
    except Exception as e:
        log.error("event=retained_lookup_failed filter=%s error=%r", sub.queue, e)
        return
    _send(retained, acl, s, sub, _reading(found, sub.queue))


def _reading(batches, flt: str):
    """The messages of `batches`, ending early (logged) if the store fails while it is read; what
    was sent from it stays sent, and an error of the sending loop is not mistaken for the store's."""
    try:
        yield from batches
    except Exception as e:
        log.error("event=retained_lookup_failed filter=%s error=%r", flt, e)


def _send(retained: "RetainedStore", acl, s: Session, sub: ClientSubscription, found) -> None:
    conn = s.conn
    if conn is None:
        return
    v5 = s.version == 5
    ids = (sub.subscription_id,) if sub.subscription_id and v5 else None
    plain = not s.max_packet and (not v5 or (ids is None and not s.alias_max))
    now_ms = time.time() * 1000.0
    run: list = []       # (topic, payload, qos, retain, packet id) of plain messages not written yet
    append = run.append
    chunk = RUN_FLUSH_FIRST
    client_id = s.client_id
    identity = conn.identity
    outbound = s.outbound
    sub_qos = sub.qos
    no_local = sub.no_local
    room = s.receive_max - len(outbound)     # the QoS 1/2 window; what does not fit waits
    backlog = s.retained_backlog
    # retained value -> (record, QoS granted) when a message with it goes into the run as it is,
    # None when it takes the general path: most retained messages share a few values (one per
    # publisher and QoS), so the checks run once per value, not per message
    kinds: dict = {}
    pid = s.next_pid             # allocated here as Session.alloc_pid does, without a call each
    try:
        for batch in found:
            for topic, payload, value in batch:
                if acl is not None and not acl.can_read(identity, topic):
                    continue
                kind = kinds.get(value, False)
                if kind is False:
                    kind = kinds[value] = _run_kind(value, plain, v5, sub_qos, no_local, client_id)
                if kind is not None and not backlog:
                    record, qos = kind
                    if qos:
                        if room <= 0:
                            backlog = s.wait_retained((OutboundMessage(topic, payload, record), qos, ids))
                            continue
                        while pid in outbound:
                            pid = pid % 65535 + 1
                        # one HeldInFlight, no OutboundMessage: built only for a resend (as a backlog run does)
                        outbound[pid] = held(Held, (pid, True, None, None, held(RetainedMessage, (topic, payload, 0)),
                                                    record))
                        append((topic, payload, 1, True, pid))
                        pid = pid % 65535 + 1
                        room -= 1
                    else:
                        append((topic, payload, 0, True, None))
                    if len(run) >= chunk:
                        _write_run(s, run, True)
                        if s.conn is None:
                            return
                        chunk = min(chunk * 2, RUN_FLUSH_MAX)
                    continue
                # the general path: expiry, MQTT 5 properties, QoS 2, No Local, a full window
                s.next_pid = pid
                _send_one(retained, s, topic, payload, value, sub_qos, no_local, client_id, ids, now_ms,
                          run, room <= 0)
                pid = s.next_pid
                room = s.receive_max - len(outbound)
    finally:
        s.next_pid = pid
        if run:
            _write_run(s, run)


def _run_kind(value: bytes, plain: bool, v5: bool, sub_qos: int, no_local: bool, client_id: str):
    """(record, QoS granted) if a retained message with `value` goes into a run as it is (see
    `_send`): QoS 0 or 1, no expiry, no MQTT 5 properties to forward, not held back by No Local."""
    if not plain or (value and value[0] == _DEADLINE):
        return None
    record = _meta_of(value)
    if record.message_expiry_interval is not None or (v5 and record.has_app_properties()):
        return None
    if no_local and record.client_id == client_id:
        return None
    qos = min(sub_qos, record.qos)
    return None if qos == 2 else (record, qos)


def _send_one(retained: "RetainedStore", s: Session, topic: str, payload: bytes, value: bytes, sub_qos: int, no_local: bool,
              client_id: str, ids, now_ms: float, run: list, window_full: bool) -> None:
    """One retained message the general way (after writing what `run` holds, to keep the order)."""
    props, deadline = split_retained(value)
    record = _meta_of(props)
    if no_local and record.client_id == client_id:
        return
    qos = min(sub_qos, record.qos)
    store_ts = 0
    if deadline is not None and record.message_expiry_interval is not None:
        if now_ms >= deadline:
            clear_expired(retained, topic, value)
            return
        store_ts = deadline - record.message_expiry_interval * 1000   # expiry_left counts from it
    message = OutboundMessage(topic, payload, record, store_ts=store_ts)
    if qos and (s.retained_backlog or window_full):
        s.wait_retained((message, qos, ids))                # sent as acks open the window
        return
    if run:
        _write_run(s, run)
    s.send_message(message, qos, True, sub_ids=ids)


def _write_run(s: Session, run: list, now: bool = False) -> None:
    """Write the collected plain retained PUBLISHes (see send_retained) and empty `run`; `now`:
    to the socket at once rather than at the end of the loop iteration."""
    conn = s.conn
    if conn is not None:
        conn.write(encode_publish_run(run, s.version)[0])
        mo = conn.metrics.msg_out
        for _topic, _payload, qos, _retain, _pid in run:
            mo[qos] += 1
        if now:
            conn.flush()
    run.clear()


# props bytes -> decoded RecordMeta: retained messages from one publisher carry identical props,
# each distinct value decoded once (record_props.MetaCache)
_meta_of = MetaCache().__getitem__


def drain_retained(s: Session) -> None:
    """Send retained messages that waited for the QoS 1/2 window, as far as it is open now."""
    bl = s.retained_backlog
    while bl and s.conn is not None and s.window_open():
        it, qos, ids = bl.popleft()
        s.send_message(it, qos, True, sub_ids=ids)


def clear_expired(retained: "RetainedStore", topic: str, value: bytes) -> None:
    """A retained message whose Message Expiry Interval passed is deleted (§3.3.2.3.3), unless a
    newer one replaced it meanwhile (a failure is logged; nobody waits for it)."""
    log_failure(retained.clear_if(topic, value), log, "retained_clear_failed", topic=topic)
