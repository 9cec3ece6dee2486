"""The store node's session sweep: sessions whose fleet gateway is gone for good still end.

Why the store does it: a fleet gateway restores at its start only the sessions it served last
(`SessionRecord.host`), so memory, start time and wildcard filter holds of a gateway grow with its
own clients, not with the whole fleet's. A session stays with its gateway until the client comes
back (any gateway then loads it from the store) or until it expires, and the gateway holding it
expires it. When that gateway never comes back (a scaled-down pod, a worker id retired), nobody
holds the session any more: without this sweep its record and offsets would stay for ever and a
client returning after its expiry would find it present, against MQTT's session expiry.

What a sweep does, every `interval_s` (paged on the store's loop, `PAGE` records per callback, so
the store goes on serving between pages), for each record whose host is not connected and has
been away for longer than `grace_s` (a restarting gateway is not gone):
  * a session that was connected when its gateway went away (no disconnect time): its disconnect
    time becomes the moment the gateway's last connection closed (or the store's start, for a
    gateway not seen since), so its expiry counts from when the client lost it;
  * a session offline for its whole expiry interval: deleted with its offsets.
Records without a host (the embedded server's, older gateways') and those of connected gateways
are left to their gateways, which restore and expire them as before.

A gateway cut off from the store for longer than the grace period cannot be told from one gone for
good (as with its wills): its clients may still be connected. The client ids whose records a sweep
changed are kept per gateway (`take_swept`, answered to its next `gw_hello`), and the gateway
writes again the record and offsets of each of those still connected to it.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from lmqtt.lightqueue.records import SessionRecord

log = logging.getLogger("lmqtt.store.node.session_sweep")


def _now_ms() -> int:
    return int(time.time() * 1000)


# client ids remembered per away gateway (its gw_hello answer); beyond it, a gateway that was only
# cut off re-writes no more of its connected clients' records (they are written again at their
# next change: subscribe, disconnect)
MAX_SWEPT_REMEMBERED = 100_000


class SessionSweep:
    PAGE = 1000          # records looked at per loop callback (only a gone gateway's are decoded)

    def __init__(self, meta, loop, is_connected: Callable[[str], bool], *, grace_s: float = 5.0,
                 interval_s: float = 60.0) -> None:
        """`meta`: the light-queue `MetadataStore`; `is_connected(gateway_id)`: whether that
        gateway has a connection to this store now."""
        self.meta = meta
        self.loop = loop
        self.is_connected = is_connected
        self.grace_ms = max(0.0, float(grace_s)) * 1000
        self.interval_s = max(0.05, float(interval_s))
        self.started_ms = _now_ms()
        self.away_since: dict[str, int] = {}       # gateway id -> when its last connection closed
        self.ended = 0                             # sessions deleted by sweeps (metrics, tests)
        self.marked_offline = 0                    # connected-at-loss sessions given their disconnect time
        self.sweeps = 0                            # sweeps that looked at records
        self.swept: dict[str, set[str]] = {}       # gateway id -> client ids whose records changed
        # gateways that had records at the last sweep that looked for them (None: none yet, the
        # first sweep looks at every record naming a gateway); a sweep while every one of them is
        # connected reads nothing at all
        self._hosts: set[str] | None = None
        self._looking: set[str] | None = None      # this sweep's candidates (None: any gateway)
        self._seen: set[str] = set()
        self._handle = None
        self._closed = False

    def start(self) -> None:
        self._handle = self.loop.call_later(self.interval_s, self._sweep, None)

    def gone(self, gid: str) -> None:
        """The last connection of gateway `gid` closed now."""
        self.away_since[gid] = _now_ms()

    def back(self, gid: str) -> None:
        self.away_since.pop(gid, None)

    def take_swept(self, gid: str) -> list[str]:
        """The client ids whose records sweeps changed (marked offline or ended) while gateway
        `gid` was away, once: its `gw_hello` answer."""
        return sorted(self.swept.pop(gid, ()))

    def _note(self, host: str, cid: str) -> None:
        mine = self.swept.setdefault(host, set())
        if len(mine) < MAX_SWEPT_REMEMBERED:
            mine.add(cid)

    def resume(self) -> None:
        """A store group member became the primary (store/node/ha_member.py; `close` while it was
        not): sweeps start again, the gateways' absence counted from now, as at a store's start."""
        self.close()
        self._closed = False
        self.started_ms = _now_ms()
        self.away_since.clear()
        self._hosts = None
        self.start()

    def close(self) -> None:
        self._closed = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _sweep(self, after: str | None) -> None:
        """One page of records after client id `after` (None: a new sweep starts); the next page
        is scheduled at once, the next sweep `interval_s` after the last page."""
        self._handle = None
        if self._closed:
            return
        if after is None:
            if self._hosts is None:
                self._looking = None
            else:
                self._looking = {g for g in self._hosts | set(self.away_since) if not self.is_connected(g)}
                if not self._looking:                # every gateway with sessions is connected
                    self._handle = self.loop.call_later(self.interval_s, self._sweep, None)
                    return
            self._seen = set()
            self.sweeps += 1
        try:
            now = _now_ms()
            if self._looking is None:
                # the first sweep: every record's host read from its bytes, and only the records
                # of gateways not connected now decoded (a store with a million sessions of live
                # gateways decodes none)
                hosts, nxt = self.meta.session_hosts(after, self.PAGE)
                for cid, host in hosts:
                    if host is None:
                        continue
                    self._seen.add(host)
                    if not self.is_connected(host):
                        rec = self.meta.get_session(cid, stubs=True)
                        if rec is not None:
                            self._check(rec, now)
            else:
                recs, nxt = self.meta.sessions_of_gateways(self._looking, after, self.PAGE, stubs=True)
                for rec in recs:
                    self._seen.add(rec.host)
                    self._check(rec, now)
        except Exception as e:  # noqa: BLE001 - a failing sweep must not stop the store: next one retries
            log.error("event=session_sweep_failed error=%r (retried in %gs)", e, self.interval_s)
            self._handle = self.loop.call_later(self.interval_s, self._sweep, None)
            return
        if nxt is not None:
            self._handle = self.loop.call_soon(self._sweep, nxt)
            return
        self._finished()
        self._handle = self.loop.call_later(self.interval_s, self._sweep, None)

    def _finished(self) -> None:
        """A whole sweep is done: remember which gateways still have sessions; an away gateway
        with none left is forgotten (it comes back as `gone` if it connects and leaves again)."""
        if self._looking is None:
            self._hosts = set(self._seen)
        else:
            self._hosts = (self._hosts - self._looking) | self._seen
        for g in list(self.away_since):
            if g not in self._hosts and not self.is_connected(g):
                del self.away_since[g]

    def _check(self, rec: SessionRecord, now: int) -> None:
        host = rec.host
        if not host or self.is_connected(host):
            return
        since = self.away_since.setdefault(host, self.started_ms)
        if now - since < self.grace_ms:
            return                                   # perhaps restarting: its own restore decides
        cid = rec.client_id
        if rec.last_disconnect_ms is None:
            rec.last_disconnect_ms = since
            self.meta.put_session(cid, rec)
            self.marked_offline += 1
            self._note(host, cid)
            log.info("event=session_offline_with_its_gateway client_id=%s gateway=%s", cid, host)
        if rec.expired(now):
            self.meta.delete_session(cid)
            self.ended += 1
            self._note(host, cid)
            log.info("event=session_expired client_id=%s gateway=%s (gone)", cid, host)
