"""Retained messages sent because of a SUBSCRIBE (MQTT §3.3.1.3, MQTT 5 §3.8.3.1 Retain Handling).

Why its own module: the broker decides *whether* a subscription gets the retained messages (Retain
Handling, shared or not); this is the mechanics of sending them — the metadata lookup, the ACL's
read rule per topic, No Local, the MQTT 5 expiry deadline kept in the retained value (expired ones
are deleted when found) and the subscription identifier. What is sent of them - the runs, the
QoS 1/2 window (what does not fit waits until acks open it), the packet ids - is the session
machine's (`MqttSession.offer_retained`).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from lmqtt.gateway.storage.facades import log_failure
from lmqtt.gateway.storage.record_props import MetaCache, split_retained
from lmqtt.gateway.session import RUN_FLUSH_FIRST, ClientSubscription, MqttSession

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.storage.facades import RetainedStore

log = logging.getLogger("lmqtt.gateway")


def is_sys_filter(flt: str) -> bool:
    """A topic filter whose first level is `$SYS`: only `$SYS` topics can match it (wildcards at the
    first level never match a `$` topic), and only the broker publishes those."""
    return flt.startswith("$SYS") and (len(flt) == 4 or flt[4] == "/")


def send_retained(retained: "RetainedStore", acl, s: MqttSession, sub: ClientSubscription, found=None,
                  batches=None) -> None:
    """Send `s` the retained messages matching `sub` (retain flag 1), window permitting.
    `retained`: the retained-message facade (storage/facades.py); `acl`: None when not configured.

    Messages whose PUBLISH needs nothing per subscriber but QoS, packet id and the retain flag
    (MQTT 3.1.1, or MQTT 5 without properties, expiry, topic alias, subscription identifier or
    Maximum Packet Size) are encoded as one run and written at once; the others one by one after
    the run so far (the order on the wire is the lookup's): `MqttSession.offer_retained`. Why: a
    `#` subscribe over 1,000 retained topics spent most of its time in a props decode, a PUBLISH
    template and a write per message. `found`: the messages, when already
    read (a remote store's read-ahead), or `batches` (the `RetainedStore.batches` answer's
    iterator, asked for with the SUBSCRIBE's other reads); else they are read here. A `$SYS` filter's are never in
    the store (the gateway's own values, broker/sys_topics.py): `retained` answers those from memory
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


def _send(retained: "RetainedStore", acl, s: MqttSession, sub: ClientSubscription, found) -> None:
    """What the session machine is offered of `found` (`MqttSession.offer_retained`), batch by
    batch: the messages the ACL lets this client read and No Local does not hold back, each with
    its decoded record, what its remaining expiry counts from and whether it is plain (no expiry,
    and for MQTT 5 no properties to forward); an expired one is deleted instead (§3.3.2.3.3)."""
    conn = s.conn
    if conn is None:
        return
    v5 = s.version == 5
    ids = (sub.subscription_id,) if sub.subscription_id and v5 else None
    now_ms = time.time() * 1000.0
    client_id = s.client_id
    identity = conn.identity
    sub_qos = sub.qos
    no_local = sub.no_local
    # retained value -> (record, store time, plain), or None when held back (No Local, expired):
    # most retained messages share a few values (one per publisher and QoS), so the checks run
    # once per value, not per message
    kinds: dict = {}
    chunk = RUN_FLUSH_FIRST
    for batch in found:
        items = []
        append = items.append
        for topic, payload, value in batch:
            if acl is not None and not acl.can_read(identity, topic):
                continue
            kind = kinds.get(value, False)
            if kind is False:
                kind = kinds[value] = _kind(value, v5, no_local, client_id, now_ms)
            if kind is None:
                continue
            if kind is _EXPIRED:
                clear_expired(retained, topic, value)
                continue
            append((topic, payload, kind))
        if s.conn is not conn:
            return
        if items:
            chunk = s.offer_retained(items, sub_qos, ids, conn.write, conn.flush, conn.metrics, chunk)


_EXPIRED = ("expired",)


def _kind(value: bytes, v5: bool, no_local: bool, client_id: str, now_ms: float):
    """(record, store time, plain) of a retained message with `value`, None when No Local holds it
    back, `_EXPIRED` when its Message Expiry Interval has passed (the value keeps its deadline)."""
    props, deadline = split_retained(value)
    record = _meta_of(props)
    if no_local and record.client_id == client_id:
        return None
    mei = record.message_expiry_interval
    store_ts = 0
    if deadline is not None and mei is not None:
        if now_ms >= deadline:
            return _EXPIRED
        store_ts = deadline - mei * 1000   # expiry_left counts from it
    plain = mei is None and deadline is None and not (v5 and record.has_app_properties())
    return record, store_ts, plain


# props bytes -> decoded RecordMeta: retained messages from one publisher carry identical props,
# each distinct value decoded once (record_props.MetaCache)
_meta_of = MetaCache().__getitem__


def clear_expired(retained: "RetainedStore", topic: str, value: bytes) -> None:
    """A retained message whose Message Expiry Interval passed is deleted (§3.3.2.3.3), unless a
    newer one replaced it meanwhile (a failure is logged; nobody waits for it)."""
    log_failure(retained.clear_if(topic, value), log, "retained_clear_failed", topic=topic)
