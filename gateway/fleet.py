"""What changes for sessions when several gateways share one store (`lmqtt gateway`, docs/fleet.md).

`FleetSessionRegistry` is the in-process `SessionRegistry` with the store as the source of truth
for persistent sessions that are not connected HERE:
  * CONNECT without clean start reloads the session record and its committed offsets from the
    store (another gateway may have served the client since: its copy here is stale or absent), so
    a session that leaves gateway A resumes on gateway B with every message after its last ack;
  * an expiry timer here deletes the store's record only if the store still holds the record this
    gateway wrote (not one written since by the gateway the client moved to).

Not fleet-wide yet (said plainly in docs/fleet.md): one live connection per client id across the
fleet (a client connected to A and B at once keeps both connections; no takeover across gateways).
"""
from __future__ import annotations

import logging
import time

from lmqtt.gateway.session_registry import SessionRegistry

log = logging.getLogger("lmqtt.gateway.fleet")


class FleetSessionRegistry(SessionRegistry):
    def open(self, client_id: str, clean_start: bool):
        if not clean_start:
            s = self.sessions.get(client_id)
            if s is None or not s.online:
                # a failure propagates (the CONNECT fails): answering "no session" from a stale or
                # missing copy would later overwrite the store's record
                self._reload(client_id)
        return super().open(client_id, clean_start)

    def _forget_local(self, client_id: str) -> None:
        """Drop this gateway's copy of a session without touching the store's record."""
        s = self.sessions.pop(client_id, None)
        if s is not None:
            self._drop_copy(s)

    def _drop_copy(self, s) -> None:
        if s.expiry_handle is not None:
            s.expiry_handle.cancel()
            s.expiry_handle = None
        self.persist.dirty_sessions.discard(s)
        self.subscriptions.remove_all(s)
        s.outbound.clear()

    def _reload(self, client_id: str) -> None:
        rec = self.metadata.get_session(client_id)
        local = self.sessions.get(client_id)
        if (local is not None and rec is not None and rec.last_disconnect_ms is not None
                and rec.last_disconnect_ms == local.disconnected_at_ms):
            # the store holds the record this gateway wrote when the client left: nobody served
            # the session since, and the local copy also knows its messages in flight (re-sent
            # with DUP and their packet ids)
            return
        if rec is None:
            self._forget_local(client_id)
            self.metrics.sessions.set(len(self.sessions))
            return
        offsets = self.metadata.get_offsets(client_id)
        last = rec.last_disconnect_ms if rec.last_disconnect_ms is not None else int(time.time() * 1000)
        # the new copy first, then the old one goes: its wildcard filters never drop to zero
        # holders in between (the last unregistration drops a filter's queue with its entries)
        old = self.sessions.pop(client_id, None)
        self._session_from(rec, offsets, last)
        if old is not None:
            self._drop_copy(old)
        self.metrics.sessions.set(len(self.sessions))
        log.info("event=session_reloaded client_id=%s subscriptions=%d", client_id, len(rec.subscriptions))

    def _expire(self, cid: str) -> None:
        s = self.sessions.get(cid)
        if s is not None and not s.online:
            try:
                rec = self.metadata.get_session(cid)
            except Exception as e:  # noqa: BLE001 - keep it: expiring later beats deleting a live one
                log.error("event=session_expiry_check_failed client_id=%s error=%r", cid, e)
                self._schedule_expiry(s)
                return
            mine = s.disconnected_at_ms or 0
            if rec is None or rec.last_disconnect_ms is None or rec.last_disconnect_ms > mine:
                # ended, live, or moved on elsewhere since: only the local copy goes
                self._forget_local(cid)
                self.metrics.sessions.set(len(self.sessions))
                return
        super()._expire(cid)
