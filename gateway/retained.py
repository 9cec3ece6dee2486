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

from lmqtt.gateway.record_props import safe_decode, split_retained
from lmqtt.gateway.session import ClientSubscription, OutboundMessage, Session

log = logging.getLogger("lmqtt.gateway")


def send_retained(metadata, acl, s: Session, sub: ClientSubscription) -> None:
    """Send `s` the retained messages matching `sub` (retain flag 1), window permitting.
    `metadata`: the store's `SessionMetadata` (store_api.py); `acl`: None when not configured."""
    try:
        found = metadata.retained_matching(sub.queue)
    except Exception as e:
        log.error("event=retained_lookup_failed filter=%s error=%r", sub.queue, e)
        return
    ids = (sub.subscription_id,) if sub.subscription_id and s.version == 5 else None
    now_ms = time.time() * 1000.0
    for topic, payload, value in found:
        if s.conn is None:
            return
        if acl is not None and not acl.can_read(s.conn.identity, topic):
            continue
        props, deadline = split_retained(value)
        record = safe_decode(props)
        if sub.no_local and record.client_id == s.client_id:
            continue
        qos = min(sub.qos, record.qos)
        store_ts = 0
        if deadline is not None and record.message_expiry_interval is not None:
            if now_ms >= deadline:
                clear_expired(metadata, topic, value)
                continue
            store_ts = deadline - record.message_expiry_interval * 1000   # expiry_left counts from it
        it = OutboundMessage(topic, payload, record, store_ts=store_ts)
        if qos and (s.retained_backlog or not s.window_open()):
            s.retained_backlog.append((it, qos, ids))   # sent as acks open the window
        else:
            s.send_item(it, qos, True, sub_ids=ids)


def drain_retained(s: Session) -> None:
    """Send retained messages that waited for the QoS 1/2 window, as far as it is open now."""
    bl = s.retained_backlog
    while bl and s.conn is not None and s.window_open():
        it, qos, ids = bl.popleft()
        s.send_item(it, qos, True, sub_ids=ids)


def clear_expired(metadata, topic: str, value: bytes) -> None:
    """A retained message whose Message Expiry Interval passed is deleted (§3.3.2.3.3), unless a
    newer one replaced it meanwhile."""
    try:
        cur = metadata.retained_matching(topic)     # an exact topic: one point lookup
        if not cur or cur[0][2] == value:
            metadata.set_retained(topic, b"")
    except Exception as e:
        log.error("event=retained_clear_failed topic=%s error=%r", topic, e)
