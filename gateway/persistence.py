"""Persistent-session state in the store's metadata: session records and consumer offsets.

Why a separate module: this is the only place that knows how the gateway's in-memory `Session`
maps to the light-queue metadata records (`SessionRecord`, offsets per consumer), and it owns the
write batching. Offsets change at ack rate, so they are only marked dirty on the hot path and
written every `offset_flush_ms` by the broker's timer (a crash loses at most that much progress:
the messages are delivered again, never lost). Session records change at subscribe/connect rate
and are written synchronously, before SUBACK/CONNACK, so an acknowledged subscription survives
`kill -9`.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from lmqtt.lightqueue.records import SessionRecord, Subscription as SubscriptionRecord

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.session import Session
    from lmqtt.gateway.shared import SharedGroup

log = logging.getLogger("lmqtt.gateway.persistence")


def _now_ms() -> int:
    return int(time.time() * 1000)


class SessionPersistence:
    def __init__(self, meta) -> None:
        self.metadata = meta
        self.dirty_sessions: set["Session"] = set()
        self.dirty_groups: set["SharedGroup"] = set()

    # -- session records ----------------------------------------------------------------------
    def record_of(self, s: "Session") -> SessionRecord:
        return SessionRecord(
            client_id=s.client_id, protocol_version=s.version, expiry_interval=s.expiry_interval,
            last_disconnect_ms=None if s.online else (s.disconnected_at_ms or _now_ms()),
            subscriptions=[SubscriptionRecord(filter=sub.queue, qos=sub.qos, no_local=sub.no_local,
                                 retain_as_published=sub.retain_as_published,
                                 retain_handling=sub.retain_handling, subscription_id=sub.subscription_id,
                                 share_group=sub.group)
                           for sub in s.subs.values()])

    def save_session(self, s: "Session"):
        """Write the session's record; returns the store's pending answer when the store is remote
        (None once written, or when the write failed: logged here)."""
        try:
            return self.metadata.put_session(s.client_id, self.record_of(s))
        except Exception as e:
            log.error("event=save_session_failed client_id=%s error=%r", s.client_id, e)
            return None

    def delete_session(self, client_id: str) -> None:
        """Drop the record and the session's offsets (consumer name = client id)."""
        try:
            self.metadata.delete_session(client_id)
        except Exception as e:
            log.error("event=delete_session_failed client_id=%s error=%r", client_id, e)

    def load_sessions(self) -> list[tuple[SessionRecord, dict[str, int]]]:
        return [(rec, self.metadata.get_offsets(rec.client_id)) for rec in self.metadata.list_sessions()]

    # -- offsets ------------------------------------------------------------------------------
    def mark_session(self, s: "Session") -> None:
        if s.expiry_interval:
            self.dirty_sessions.add(s)

    def mark_group(self, g: "SharedGroup") -> None:
        self.dirty_groups.add(g)

    def save_offsets(self, s: "Session") -> None:
        self.dirty_sessions.discard(s)
        if s.cursors:
            try:
                self.metadata.set_offsets(s.client_id, {q: c.committed() for q, c in s.cursors.items()})
            except Exception as e:
                log.error("event=save_offsets_failed client_id=%s error=%r", s.client_id, e)

    def save_group_offset(self, g: "SharedGroup") -> None:
        self.dirty_groups.discard(g)
        try:
            self.metadata.set_offsets(g.consumer, {g.queue: g.cursor.committed()})
        except Exception as e:
            log.error("event=save_group_offset_failed group=%s error=%r", g.name, e)

    def flush(self, session_live: Callable[["Session"], bool], group_live: Callable[["SharedGroup"], bool]) -> None:
        """Write every dirty offset of sessions/groups that still exist."""
        ds, self.dirty_sessions = self.dirty_sessions, set()
        for s in ds:
            if s.expiry_interval and session_live(s):
                self.save_offsets(s)
        dg, self.dirty_groups = self.dirty_groups, set()
        for g in dg:
            if group_live(g):
                self.save_group_offset(g)
