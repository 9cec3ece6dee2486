"""What changes for sessions when several gateways share one store (`lmqtt gateway`, docs/fleet.md).

`FleetSessionRegistry` is the in-process `SessionRegistry` with the store as the source of truth
for persistent sessions that are not connected HERE:
  * CONNECT without clean start reloads the session record and its committed offsets from the
    store (another gateway may have served the client since: its copy here is stale or absent), so
    a session that leaves gateway A resumes on gateway B with every message after its last ack;
  * an expiry timer here deletes the store's record only if the store still holds the record this
    gateway wrote (not one written since by the gateway the client moved to);
  * every record names the gateway that served the session last (`SessionRecord.host`), and a
    gateway restores at start only its own (and those of no gateway): its memory, start time and
    wildcard filter holds grow with its own clients, not with the fleet's. The sessions of a
    gateway gone for good are ended at their expiry by the store node
    (store/node/session_sweep.py); a record found expired when a client comes back is deleted and
    the client starts a new session.

One live connection per client id across the fleet: a gateway that attaches a connection to a
client id announces it, and the gateway that held the previous connection closes it with MQTT 5
reason 0x8E (session taken over), as a takeover within one gateway does. The announcement goes
over Redis pub/sub with `lmqtt gateway --redis` (`SessionDirectory`), else through the store,
which relays it to the other gateways (`StoreSessionDirectory`); docs/fleet.md.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, NamedTuple

from lmqtt.gateway.mqtt import ReasonCode as RC
from lmqtt.gateway.clients.session_persistence import INFLIGHT, Dormant, start_offsets
from lmqtt.gateway.clients.session_registry import SessionRegistry

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.subscriptions.subscription_registry import Prepared
    from lmqtt.gateway.storage.facades import SessionStore, Storage

log = logging.getLogger("lmqtt.gateway.fleet.sessions")

CLAIMS_CHANNEL = "lmqtt:sessions:claims"
# how often a copy let go of for another gateway's claim asks the store again whether that gateway
# wrote the session's record (the SESSIONS_MOVED push normally says so first; this is for a push
# missed while the link to the store was down)
CLAIMED_RECHECK_S = 30.0


def _now_ms() -> int:
    return int(time.time() * 1000)


def outlives_claim(ours_ms: int, ours_gateway: str, since_ms: int, claimant: str) -> bool:
    """Whether a connection attached at `ours_ms` on gateway `ours_gateway` stays when gateway
    `claimant` claims its client id for a connection attached at `since_ms`: the newer one stays.
    Two attached in the same millisecond: the one on the gateway with the greater id, so that both
    gateways, each deciding alone, close exactly one of them."""
    if ours_ms != since_ms:
        return ours_ms > since_ms
    return bool(claimant) and ours_gateway > claimant


class SessionDirectory:
    """Redis pub/sub of "gateway G owns client id C since time T" (message `G\nC\nT`, T in ms of
    the wall clock). A connection attached after T is newer than the claim and stays (a claim that
    arrives late must not close the connection that replaced it). A lost message (Redis down)
    leaves the old connection open until its client goes away: two live connections, never a lost
    message (both read from the stored offsets)."""

    voids_wills = False            # the store does not see these claims: each CONNECT voids its own

    def __init__(self, url: str, gateway_id: str, on_claimed_elsewhere, reconnect_max_s: float = 2.0) -> None:
        self.url = url
        self.gateway_id = gateway_id
        self.on_claimed_elsewhere = on_claimed_elsewhere
        self.reconnect_max_s = reconnect_max_s
        self._redis = None
        self._task: asyncio.Task | None = None
        self.connected = asyncio.Event()
        self._pending: list[str] = []          # claims not sent yet (`claim`)
        self._sender: asyncio.Task | None = None
        self.claims_sent = 0
        self.claims_heard = 0
        self.errors = 0

    async def start(self) -> None:
        import redis.asyncio as aioredis  # only with --redis: lmqtt serve never loads it
        self._redis = aioredis.Redis.from_url(self.url, socket_connect_timeout=2.0)
        self._task = asyncio.get_running_loop().create_task(self._run())

    def claim(self, client_id: str, since_ms: int) -> None:
        """Announce that this gateway now holds `client_id` (sent by one task, in order, claims
        made meanwhile in one pipeline: with a publish per claim, a reconnect storm of 1,000
        clients would start 1,000 publishes at once, each wanting its own Redis connection; most
        would fail with the connection pool's MaxConnectionsError, and the old connections
        elsewhere would stay open)."""
        if self._redis is None:
            return
        self.claims_sent += 1
        self._pending.append(f"{self.gateway_id}\n{client_id}\n{since_ms}")
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send())

    async def _send(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for m in batch:
                        pipe.publish(CLAIMS_CHANNEL, m)
                    await pipe.execute()
            except Exception as e:  # noqa: BLE001 - a hint: the old connection stays until its client leaves
                self.errors += len(batch)
                log.warning("event=session_claim_failed claims=%d first_client_id=%s error=%r", len(batch),
                            batch[0].split("\n")[1], e)

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(CLAIMS_CHANNEL)
                self.connected.set()
                backoff = 0.05
                while True:
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg is None or msg.get("type") != "message":
                        continue
                    gid, _, rest = msg["data"].decode().partition("\n")
                    cid, _, ts = rest.partition("\n")
                    if gid != self.gateway_id and cid:
                        self.claims_heard += 1
                        try:
                            self.on_claimed_elsewhere(cid, int(ts or 0), gid)
                        except Exception:  # noqa: BLE001
                            log.exception("event=session_release_failed client_id=%s", cid)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - reconnect with backoff
                if self.connected.is_set():
                    log.warning("event=session_directory_disconnected error=%r", e)
                self.connected.clear()
                await asyncio.sleep(backoff)
                backoff = min(self.reconnect_max_s, backoff * 2)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:  # noqa: BLE001
                    pass

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._redis is not None:
            await self._redis.aclose()


class StoreSessionDirectory:
    """The claims of `SessionDirectory` without Redis: sent to the store (`gw_claim_sessions`, the
    claims of one loop iteration in one call), which relays them to every other gateway connected
    to it (a SESSION_CLAIMS push, docs/protocol.md). Every gateway of a fleet already holds a
    connection to the one store, so one live connection per client id needs nothing more. The
    same rules as over Redis: a claim carries the wall-clock time its connection attached, an
    older connection of that client id elsewhere is closed, a newer one stays; a claim lost (the
    store unreachable at that moment) leaves the old connection open until its client leaves."""

    def __init__(self, loop, sessions: "SessionStore", on_claimed_elsewhere) -> None:
        self.loop = loop
        self.store_sessions = sessions
        # the store voids the wills other gateways hold for the clients claimed (one store; over
        # several groups a will may live where the claim does not go)
        self.voids_wills = bool(getattr(sessions, "claims_void_wills", False))
        self.on_claimed_elsewhere = on_claimed_elsewhere
        sessions.on_session_claims(self._heard)
        self._pending: list[tuple[str, int]] = []
        self._scheduled = False
        self.claims_sent = 0
        self.claims_heard = 0
        self.errors = 0

    async def start(self) -> None:
        pass

    def claim(self, client_id: str, since_ms: int) -> None:
        """Announce that this gateway holds `client_id` since `since_ms` (sent at the end of this
        loop iteration, with the other claims made in it: a reconnect storm is a few calls)."""
        self.claims_sent += 1
        self._pending.append((client_id, since_ms))
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._send)

    def _send(self) -> None:
        self._scheduled = False
        batch, self._pending = self._pending, []
        if not batch:
            return

        def done(f) -> None:
            e = asyncio.CancelledError("claim cancelled") if f.cancelled() else f.exception()
            if e is not None:        # a hint: the old connection stays until its client leaves
                self.errors += len(batch)
                log.warning("event=session_claim_failed claims=%d first_client_id=%s error=%r",
                            len(batch), batch[0][0], e)
        self.store_sessions.claim(batch).add_done_callback(done)

    def _heard(self, gateway: str, claims) -> None:
        for cid, since_ms in claims:
            self.claims_heard += 1
            try:
                self.on_claimed_elsewhere(cid, since_ms, gateway)
            except Exception:  # noqa: BLE001 - the others' claims still count
                log.exception("event=session_release_failed client_id=%s", cid)

    async def close(self) -> None:
        self._pending.clear()


class Loaded(NamedTuple):
    """What `FleetSessionRegistry.load_later` read for a CONNECT: the local copy's state when it
    was asked (`mark`: used only if unchanged), the store's record and offsets, and the answers
    resuming it needs (`prepared`: SubscriptionRegistry.prepare_resume's, all in; None when there
    is nothing to resume)."""
    mark: tuple
    rec: object
    offsets: dict
    prepared: "Prepared | None"


class FleetSessionRegistry(SessionRegistry):
    # set by the composition: SessionDirectory (Redis) or StoreSessionDirectory
    directory: "SessionDirectory | StoreSessionDirectory | None" = None

    def __init__(self, loop, metrics, storage: "Storage", persist, subscriptions, publish) -> None:
        """`persist.host` is this gateway's id: the records it writes name it (module docstring)."""
        super().__init__(loop, metrics, storage, persist, subscriptions, publish)
        self.store_sessions = storage.sessions
        self.offsets = storage.offsets
        storage.sessions.on_sessions_swept(self.sessions_swept)
        storage.sessions.on_sessions_moved(self.sessions_moved)
        # client ids whose copy here was let go of for another gateway's claim and is kept, with
        # its wildcard filter holds, until the store's record names that gateway (`_keep_until_moved`)
        self._claimed_away: set[str] = set()
        self._recheck_handle: asyncio.TimerHandle | None = None

    def void_will(self, client_id: str, delayed_here: bool) -> None:
        """Claims sent to a store that voids the other gateways' wills of the clients claimed
        (`StoreSessionDirectory.voids_wills`): the claim `attach` makes does it, and only a
        delayed will this gateway was holding is voided here; else as in `SessionRegistry`."""
        if delayed_here or self.directory is None or not self.directory.voids_wills:
            super().void_will(client_id, delayed_here)

    def attach(self, conn, s) -> None:
        super().attach(conn, s)
        if self.directory is not None:
            now = int(time.time() * 1000)
            conn.fleet_attached_ms = now
            self.directory.claim(s.client_id, now)

    taken_over_elsewhere = 0     # live connections closed for a newer one on another gateway

    def release_to_other_gateway(self, client_id: str, since_ms: int = 0, claimant: str = "") -> None:
        """Gateway `claimant` attached a connection to `client_id` at `since_ms`: close ours with
        0x8E and let the session go without writing its record (the new owner writes the newer
        one); offsets are saved (progress, never a loss), and the copy stays offline here until
        the record names the new owner (`_keep_until_moved`). A will without delay is published,
        as on a local takeover; a delayed one is dropped (the client is back, MQTT 5 §3.1.3.2.2)."""
        conn = self.owner(client_id)
        if conn is not None and outlives_claim(getattr(conn, "fleet_attached_ms", 0), self.persist.host or "",
                                               since_ms, claimant):
            return          # ours came after that claim (a late message): ours is the live one
        if conn is None:
            s = self.sessions.get(client_id)
            d = self.dormant.get(client_id)
            if ((s is not None and not s.online and (s.disconnected_at_ms or 0) <= since_ms)
                    or (d is not None and d.last_ms <= since_ms)):
                self._keep_until_moved(client_id)      # stale copy once the other gateway's record is written
            return
        s = conn.session
        self.taken_over_elsewhere += 1
        log.info("event=takeover_by_other_gateway client_id=%s peer=%s gateway=%s", client_id, conn.peer,
                 claimant or "?")
        conn.close_with_error(RC.SESSION_TAKEN_OVER, "session taken over (by another gateway)")
        # detach without the session record; the broker's connection-lost handling then finds no
        # session on the connection
        del self._owners[client_id]
        conn.session = None
        will, conn.will = conn.will, None
        if s is not None:
            s.conn = None
            if s.persistent:
                self.persist.save_offsets(s)
            self.subscriptions.go_offline(s)
            if self.sessions.get(client_id) is s:
                if s.persistent:
                    # offline here, its record left as it is: the other gateway writes the next one
                    self.persist.drop_writes(s)
                    s.disconnected_at_ms = _now_ms()
                    self._schedule_expiry(s)
                    self._keep_until_moved(client_id)
                else:
                    self._forget_local(client_id)
        if will is not None:
            delay = (will.properties.will_delay_interval or 0) if conn.version == 5 else 0
            if delay == 0:
                self._publish(client_id, will.qos, will.topic, will.payload, will.retain, will.properties)

    def _keep_until_moved(self, client_id: str) -> None:
        """Another gateway claimed `client_id`: keep the offline copy here, and with it its
        wildcard filter holds, until the store's record of the session names that gateway (or the
        session ended), then drop it. The claim comes before the claimant's first write of the
        record, and that write may fail (a full disk at the store) or never happen (the claimant
        killed first): dropped at the claim, the copy's holds went with it while the record still
        named this gateway, and once the claimant let go of the filter too (its restart restores
        only the records naming it) nobody held it: the filter's queue was dropped and what was
        published meanwhile never reached the session. The store says when the record moves
        (SESSIONS_MOVED, `sessions_moved`); it is asked now, as that push may have come before
        the claim, and every CLAIMED_RECHECK_S while the copy is kept."""
        self._claimed_away.add(client_id)
        self._check_claimed(client_id)
        if self._recheck_handle is None:
            self._recheck_handle = self.loop.call_later(CLAIMED_RECHECK_S, self._recheck_claimed)

    def _recheck_claimed(self) -> None:
        self._recheck_handle = None
        for cid in list(self._claimed_away):
            self._check_claimed(cid)
        if self._claimed_away:
            self._recheck_handle = self.loop.call_later(CLAIMED_RECHECK_S, self._recheck_claimed)

    def _check_claimed(self, cid: str) -> None:
        """Drop the copy kept for `_keep_until_moved` if the store's record no longer names this
        gateway; keep it if it does or the store cannot say now (asked again later)."""
        s = self.sessions.get(cid) or self.dormant.get(cid)
        if s is None or getattr(s, "online", False):
            self._claimed_away.discard(cid)        # resumed or reloaded here since: not kept for a claim
            return

        def checked(rec) -> None:
            if rec is None or rec.host not in (None, self.persist.host):
                self._claimed_away.discard(cid)
                self._forget_local(cid)
                log.info("event=claimed_copy_dropped client_id=%s gateway=%s", cid, rec.host if rec else None)
        self._ask_record(cid, s, checked, lambda _e: None, lambda: self._claimed_away.discard(cid))

    def close(self) -> None:
        if self._recheck_handle is not None:
            self._recheck_handle.cancel()
            self._recheck_handle = None
        super().close()

    def sessions_swept(self, client_ids) -> None:
        """The store took this gateway for gone while it was cut off and marked offline, or ended,
        these sessions' records: write again the record and offsets of each still connected here
        (the others are not this gateway's to write: their clients may be on another gateway)."""
        n = 0
        for cid in client_ids:
            s = self.sessions.get(cid)
            if s is not None and s.online and s.persistent:
                self.persist.save_session(s)
                self.persist.save_offsets(s)
                n += 1
        log.warning("event=sessions_swept_by_store count=%d rewritten=%d (this gateway was away from "
                    "the store longer than its grace period)", len(client_ids), n)

    def sessions_moved(self, client_ids) -> None:
        """The store says another gateway wrote or ended these sessions' records (SESSIONS_MOVED):
        drop the offline copies kept here once the store's record confirms they are stale (as an
        expiry check does), and with them their wildcard filter holds, which would otherwise keep
        those filters indexed until the copy's expiry (never, for a 3.1.1 session). A copy whose
        client is connected here is left alone: one live connection per client id across
        gateways is the session directory's to settle (its claims carry the attach times)."""
        for cid in client_ids:
            s = self.sessions.get(cid) or self.dormant.get(cid)
            if s is not None and not getattr(s, "online", False):
                self._unless_still_ours(cid, s, lambda: None, lambda e, cid=cid: log.warning(
                    "event=session_moved_check_failed client_id=%s error=%r (the copy ends at its expiry)", cid, e))

    def _needs_reload(self, client_id: str, clean_start: bool) -> bool:
        if clean_start:
            return False
        s = self.sessions.get(client_id)
        return s is None or not s.online

    def _local_mark(self, client_id: str) -> tuple:
        """What the local copy of a session looked like: a load is used only if this is unchanged
        when it arrives (else this gateway wrote the record since it was asked for)."""
        s = self.sessions.get(client_id)
        return (None,) if s is None else (id(s), s.online, s.disconnected_at_ms)

    def load_later(self, client_id: str, clean_start: bool):
        """A CONNECT resuming a session not connected here: ask the store for its record and
        offsets now, then for every answer resuming it reads (SubscriptionRegistry.prepare_resume:
        its wildcard filters new here held, its queues' ends, its new groups' offsets, its
        messages in flight), without waiting: the broker holds the CONNECT until the future of a
        `Loaded` is done, and the gateway serves every other connection meanwhile."""
        if not self._needs_reload(client_id, clean_start):
            return None
        mark = self._local_mark(client_id)
        out = self.loop.create_future()

        def got_session(f) -> None:
            if f.exception() is not None:
                return out.set_exception(f.exception())
            rec, offsets = f.result()
            if rec is None or rec.expired(_now_ms()):
                return out.set_result(Loaded(mark, rec, offsets, None))
            state = rec.extra.get(INFLIGHT) if rec.extra else None
            inflight = [(q, off) for _pid, q, off, *_rest in state.get("out", ())] if state else []
            prepared = self.subscriptions.prepare_resume(rec.subscriptions, inflight)

            def got_reads(_a) -> None:
                e = prepared.failure()
                if e is not None:
                    prepared.release()          # what was registered for it: nothing takes it now
                    out.set_exception(e)
                else:
                    out.set_result(Loaded(mark, rec, offsets, prepared))
            prepared.ready.add_done_callback(got_reads)
        self.store_sessions.load(client_id).add_done_callback(got_session)
        return out

    def discard(self, loaded: "Loaded") -> None:
        """A load nobody will use (the client left while it was read): drop its registrations."""
        if loaded.prepared is not None:
            loaded.prepared.release()

    def open(self, client_id: str, clean_start: bool, loaded: "Loaded | None" = None):
        if self._needs_reload(client_id, clean_start):
            # a failure propagates (the CONNECT fails): answering "no session" from a stale or
            # missing copy would later overwrite the store's record
            if loaded is not None and loaded.mark == self._local_mark(client_id):
                if loaded.prepared is None:
                    self._reload(client_id, loaded.rec, loaded.offsets)
                else:
                    with self.subscriptions.deciding(loaded.prepared):
                        self._reload(client_id, loaded.rec, loaded.offsets)
                loaded = None
            else:
                self._reload(client_id)
        if loaded is not None:
            self.discard(loaded)
        return super().open(client_id, clean_start)

    def _forget_local(self, client_id: str) -> None:
        """Drop this gateway's copy of a session without touching the store's record."""
        s = self.sessions.pop(client_id, None)
        if s is not None:
            self._drop_copy(s)
        d = self.dormant.get(client_id)
        if d is not None:
            self._drop_dormant(client_id, d)

    def _drop_copy(self, s) -> None:
        if s.expiry_handle is not None:
            s.expiry_handle.cancel()
            s.expiry_handle = None
        self.persist.forget(s)
        self.subscriptions.remove_all(s)
        s.ended()

    _UNREAD = object()

    def _reload(self, client_id: str, rec=_UNREAD, offsets=None) -> None:
        """Replace the local copy with the store's record (`rec`, `offsets`: as `load_later` read
        them; else read now, blocking)."""
        if rec is self._UNREAD:
            rec = self.store_sessions.get(client_id).wait()
        local = self.sessions.get(client_id)
        if (local is not None and rec is not None and rec.last_disconnect_ms is not None
                and rec.last_disconnect_ms == local.disconnected_at_ms and not local.has_saved()):
            # the store holds the record this gateway wrote when the client left: nobody served
            # the session since, and the local copy also knows its messages in flight (re-sent
            # with DUP and their packet ids; unless it was restored at start without their
            # messages, `keep_saved`: reloaded here, where they are read ahead)
            return
        if rec is not None and rec.expired(_now_ms()):
            # its gateway is gone and the store's sweep has not ended it yet: it ends now
            log.info("event=session_expired client_id=%s gateway=%s (found expired at connect)", client_id, rec.host)
            self._expired(client_id)
            self.persist.delete_session(client_id)
            rec = None
        if rec is None:
            self._forget_local(client_id)
            return
        if offsets is None:
            offsets = self.offsets.get_all(client_id).wait()
        last = rec.last_disconnect_ms if rec.last_disconnect_ms is not None else _now_ms()
        # the new copy first, then the old one goes: its wildcard filters never drop to zero
        # holders in between (the last unregistration drops a filter's queue with its entries)
        old = self.sessions.pop(client_id, None)
        new = self._session_from(rec, start_offsets(rec, offsets), last)
        try:
            self.subscriptions.hold_restored(new)
        except BaseException:
            # the store could not take a hold (a full disk there): the new copy goes, the old one
            # stays. Kept, the new copy would count as a user here of a filter the store does not
            # know this gateway holds, and the store would drop the filter, queue and all, when
            # the other gateways let go of it
            self.sessions.pop(client_id, None)
            self.subscriptions.unrestore(new)
            if old is not None:
                self.sessions[client_id] = old
            raise
        if old is not None:
            self._drop_copy(old)
        d = self.dormant.get(client_id)
        if d is not None:                 # restored dormant at start: the new copy holds its filters now
            self._drop_dormant(client_id, d)
        log.info("event=session_reloaded client_id=%s subscriptions=%d", client_id, len(rec.subscriptions))

    def _expire(self, cid: str) -> None:
        """The local copy's expiry is due: ask the store whether the session is still the one this
        gateway saw leave (without waiting: the gateway serves its clients meanwhile), then end it,
        or only drop the local copy if it ended, went live or moved on elsewhere since."""
        s = self.sessions.get(cid)
        if s is None or s.online:
            return

        def failed(e) -> None:               # keep it: expiring later beats deleting a live one
            log.error("event=session_expiry_check_failed client_id=%s error=%r", cid, e)
            self._schedule_expiry(s)
        self._unless_still_ours(cid, s, lambda: SessionRegistry._expire(self, cid), failed)

    def _expire_dormant(self, cid: str) -> None:
        """A dormant copy's expiry is due: as `_expire`, the store asked first."""
        d = self.dormant.get(cid)
        if d is None:
            return
        d.handle = None

        def failed(e) -> None:               # asked again one expiry interval later, as `_expire`
            log.error("event=session_expiry_check_failed client_id=%s error=%r", cid, e)
            d.handle = self.loop.call_later(float(d.expiry), self._expire_dormant, cid)
        self._unless_still_ours(cid, d, lambda: SessionRegistry._expire_dormant(self, cid), failed)

    def _unless_still_ours(self, cid: str, s, then, failed) -> None:
        """Ask the store (without waiting) whether the session is still the one this gateway saw
        leave: `then()` if so; drop the local copy if the session ended, went live or moved on
        elsewhere since (its record gone, connected, left later, or written by another gateway);
        `failed(error)` if the store could not say. Nothing if the copy changed meanwhile. `s`: a
        built offline copy, or a `Dormant` one."""
        mine = s.last_ms if isinstance(s, Dormant) else (s.disconnected_at_ms or 0)
        host = self.persist.host

        def checked(rec) -> None:
            if (rec is None or rec.last_disconnect_ms is None or rec.last_disconnect_ms > mine
                    or rec.host not in (None, host)):
                self._forget_local(cid)
                return
            then()
        self._ask_record(cid, s, checked, failed)

    def _ask_record(self, cid: str, s, got, failed, changed=lambda: None) -> None:
        """Read the store's record of `cid` (without waiting) for a decision about the offline
        copy `s` (built, or `Dormant`): `got(record or None)`, `failed(error)` if the store could
        not say, or `changed()` if the copy was resumed or replaced while the store was asked."""
        dormant = isinstance(s, Dormant)

        def answered(f) -> None:
            if (self.dormant.get(cid) is not s) if dormant else (self.sessions.get(cid) is not s or s.online):
                changed()
                return
            e = asyncio.CancelledError("session check cancelled") if f.cancelled() else f.exception()
            if e is not None:
                failed(e)
                return
            got(f.result())
        self.store_sessions.get(cid).add_done_callback(answered)
