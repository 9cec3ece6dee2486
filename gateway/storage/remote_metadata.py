"""`RemoteMetadata`: the `SessionMetadata` seam (gateway/storage/store_api.py) over the store's native
protocol, for `lmqtt gateway` (docs/fleet.md): the store node's gw_* commands, typed in
store/node/protocol.py and sent with its `NodeClient`; the node side is store/node/gateway_service.py.

Writes that may be lost with a crash at no harm (offsets: re-delivery; wills, retained messages:
ordered before the PRODUCE they go with; session deletions) are sent without waiting, errors
logged. A session record is sent without waiting too, but the CONNACK / SUBACK it backs waits for
the store's answer (`put_session` returns it; `MQTTConnection.wait_for_store`), so an
acknowledged subscription survives and only that client waits. A CONNECT resuming a session
reads its record and offsets in one pipelined round trip (`load_session`). What remains blocking
(bounded by the connection's timeout) is start-up and rare paths: the session list, wills to
publish after a crash, an expiry check.

All on the gateway's one `LoopConnection` (store/client/loop_connection.py), so the store sees
its requests in order: a read sent after a write sees it.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Iterator

from lmqtt.lightqueue.records import SessionRecord, WillRecord
from lmqtt.store import protocol as W
from lmqtt.store.client.aio import LoopConnection
from lmqtt.store.node import protocol as P

log = logging.getLogger("lmqtt.gateway.remote")


class RemoteMetadata:
    """`SessionMetadata` over the store node's gw_* commands (store/node/protocol.py). Wills carry
    this gateway's id: the store node publishes them if this gateway's connection stays gone past
    its grace period."""

    def __init__(self, link: LoopConnection, gateway_id: str = "") -> None:
        self.link = link
        self.node = P.NodeClient(link)
        self.gateway_id = gateway_id
        # set by the session registry: the store published these clients' wills while this
        # gateway was away (gw_hello's answer)
        self.on_wills_published: Callable[[list], None] | None = None
        # set by the fleet's session registry: the store's session sweep took this gateway for
        # gone and changed these clients' records (store/node/session_sweep.py)
        self.on_sessions_swept: Callable[[list], None] | None = None
        # client ids whose record another gateway wrote or ended (a SESSIONS_MOVED push)
        self.on_sessions_moved: Callable[[list], None] | None = None
        # (gateway, [(client id, since ms)]): another gateway attached connections to these client
        # ids (a SESSION_CLAIMS push)
        self.on_session_claims: Callable[[str, list], None] | None = None
        # which put_will each client's stored will came from: a will put after a gw_hello was sent
        # belongs to a newer connection than any the store can name in that hello's answer
        self._will_seq = 0
        self._will_put_at: dict[str, int] = {}

    def hello(self) -> None:
        """Tell the store which gateway this connection is (at start and after every reconnect):
        it stops the grace timer of this gateway's wills and says which it published meanwhile."""
        if not self.gateway_id:
            return
        mark = self._will_seq
        fut = self.node.call(P.Hello(self.gateway_id), bounded=False)

        def done(f):
            if f.cancelled():
                return
            e = f.exception()
            if e is not None:
                log.warning("event=gw_hello_failed error=%r", e)
                return
            reply: P.HelloReply = f.result()
            swept = reply.sessions_swept
            if swept and self.on_sessions_swept is not None:
                self.on_sessions_swept(swept)
            fired = [c for c in reply.wills_published if self._will_put_at.get(c, 0) <= mark]
            if fired:
                log.warning("event=store_published_wills_of_this_gateway count=%d", len(fired))
                if self.on_wills_published is not None:
                    self.on_wills_published(fired)
        fut.add_done_callback(done)

    # sessions
    def put_session(self, client_id: str, rec: SessionRecord):
        """Sent now, not waited for here: the future is the store's answer, which the CONNACK or
        SUBACK this record backs waits for (`MQTTConnection.wait_for_store`), so only that client
        waits for the round trip, not the gateway. Requests on the link are answered in order,
        so this gateway's later reads see the record."""
        fut = self.node.put_session(client_id, rec.to_bytes().decode())
        fut.add_done_callback(_log_failed_write("gw_put_session", client_id))
        return fut

    def sessions_moved(self, body: bytes) -> None:
        """A SESSIONS_MOVED push from the store (docs/protocol.md)."""
        try:
            client_ids = W.decode_sessions_moved(body)
        except Exception as e:  # noqa: BLE001 - a hint: the copies then end at their expiry
            log.warning("event=bad_sessions_moved_frame error=%r", e)
            return
        if self.on_sessions_moved is not None:
            self.on_sessions_moved(client_ids)

    def claim_sessions(self, claims: list) -> asyncio.Future:
        """This gateway attached connections to these client ids (`[(client id, since ms)]`): the
        store relays it to the other gateways (fleet.StoreSessionDirectory)."""
        return self.node.call(P.ClaimSessions(self.gateway_id, [(c, int(t)) for c, t in claims]), bounded=False)

    def session_claims(self, body: bytes) -> None:
        """A SESSION_CLAIMS push from the store (docs/protocol.md); claims of this gateway's own id
        (another process started with the same --gateway-id) are not for it to act on."""
        try:
            gid, claims = W.decode_session_claims(body)
        except Exception as e:  # noqa: BLE001 - a hint: the old connections stay until their clients leave
            log.warning("event=bad_session_claims_frame error=%r", e)
            return
        if gid != self.gateway_id and self.on_session_claims is not None:
            self.on_session_claims(gid, claims)

    def get_session(self, client_id: str) -> SessionRecord | None:
        return _record(self.node.call_blocking(P.GetSession(client_id)))

    def get_session_later(self, client_id: str) -> asyncio.Future:
        """`get_session` sent now and not waited for: a future of the record or None (a session
        expiry check, `FleetSessionRegistry._expire`, while the gateway serves its clients)."""
        got = self.node.get_session(client_id)
        out = self.link.loop.create_future()

        def done(f) -> None:
            if f.cancelled():
                out.cancel()
            elif f.exception() is not None:
                out.set_exception(f.exception())
            else:
                try:
                    out.set_result(_record(f.result()))
                except Exception as e:  # noqa: BLE001 - a reply we cannot read: checked again later
                    out.set_exception(e)
        got.add_done_callback(done)
        return out

    def load_session(self, client_id: str) -> asyncio.Future:
        """`get_session` and `get_offsets` together, sent now and not waited for here (one round
        trip for both): a future of (record or None, offsets). A CONNECT that resumes a session
        waits for it on hold (`FleetSessionRegistry.load_later`) while the gateway serves the rest."""
        got = [self.node.get_session(client_id), self.node.get_offsets(client_id)]
        out = self.link.loop.create_future()

        def done(f1) -> None:
            if not f1.cancelled():
                f1.exception()             # retrieved: the first failure is the one reported
            if out.done() or not all(f.done() for f in got):
                return
            for f in got:
                if f.exception() is not None:
                    out.set_exception(f.exception())
                    return
            try:
                out.set_result((_record(got[0].result()), got[1].result().offsets))
            except Exception as e:  # noqa: BLE001 - a reply we cannot read fails this CONNECT only
                out.set_exception(e)
        for f in got:
            f.add_done_callback(done)
        return out

    def delete_session(self, client_id: str) -> bool:
        self.node.send(P.DeleteSession(client_id))
        return True

    def list_sessions(self) -> list:
        return [SessionRecord.from_bytes(r.encode()) for r in self.node.call_blocking(P.ListSessions()).sessions]

    RESTORE_PAGE = 5000

    def sessions_with_offsets(self, hosted_by: str | None = None) -> list:
        """Every session record with its committed offsets, a page of `RESTORE_PAGE` per round trip
        (a gateway's restore at start: one `gw_get_offsets` round trip per session made 20,000
        sessions take 4.6 s). `hosted_by`: only the sessions that gateway served last and those
        of no gateway (`SessionRecord.host`; the store filters, and so does this, for a store node
        of the previous version that sends them all)."""
        out = []
        after = None
        while True:
            r = self.node.call_blocking(P.ListSessions(after, self.RESTORE_PAGE, True, hosted_by))
            recs = [SessionRecord.from_bytes(s.encode()) for s in r.sessions]
            out += ((rec, offs) for rec, offs in zip(recs, r.offsets)
                    if hosted_by is None or rec.host in (None, hosted_by))
            after = r.next or (recs[-1].client_id if recs else None)
            if not r.more or after is None:
                return out

    # offsets
    def get_offset(self, consumer: str, queue: str) -> int | None:
        return self.node.call_blocking(P.GetOffset(consumer, queue)).offset

    def get_offsets(self, consumer: str) -> dict[str, int]:
        return self.node.call_blocking(P.GetOffsets(consumer)).offsets

    def set_offsets(self, consumer: str, offsets: dict[str, int]) -> None:
        self.node.send(P.SetOffsets(consumer, offsets))

    def delete_offsets(self, consumer: str, queues: list[str] | None = None) -> None:
        self.node.send(P.DeleteOffsets(consumer, queues))

    # retained
    def set_retained(self, topic: str, payload: bytes, props: bytes = b"") -> None:
        self.node.send(P.SetRetained(topic, payload, props))

    def clear_retained_if(self, topic: str, props: bytes) -> None:
        """Sent now, not waited for (the store compares and clears in one step)."""
        self.node.send(P.ClearRetainedIf(topic, props))

    def retained_matching(self, flt: str) -> list[tuple[str, bytes, bytes]]:
        return list(self.node.call_blocking(P.RetainedMatching(flt)).retained)

    def retained_batches(self, flt: str) -> Iterator[list[tuple[str, bytes, bytes]]]:
        return iter((self.retained_matching(flt),))     # one reply: nothing to gain by reading lazily

    # wills
    def put_will(self, client_id: str, will: WillRecord) -> None:
        self._will_seq += 1
        self._will_put_at[client_id] = self._will_seq
        self.node.send(P.PutWill(client_id, will.to_bytes(), self.gateway_id))

    def pop_will(self, client_id: str) -> Any:
        # callers only need it gone (the gateway keeps the will it publishes in memory); only
        # this gateway's: a will the client's newer connection left on another gateway stays
        self._will_put_at.pop(client_id, None)
        self.node.send(P.PopWill(client_id, self.gateway_id))
        return None

    def void_will(self, client_id: str) -> None:
        self._will_put_at.pop(client_id, None)
        self.node.send(P.PopWill(client_id))

    def take_wills(self) -> list[tuple[str, Any]]:
        return [(cid, WillRecord.from_bytes(w)) for cid, w in self.node.call_blocking(P.TakeWills(self.gateway_id)).wills]

    def list_wills(self) -> list[tuple[str, Any]]:
        return [(cid, WillRecord.from_bytes(w)) for cid, w in self.node.call_blocking(P.ListWills(self.gateway_id)).wills]

    def flush(self) -> None:
        self.node.call_blocking(P.Flush())


def _record(reply: P.SessionReply) -> SessionRecord | None:
    return SessionRecord.from_bytes(reply.rec.encode()) if reply.rec is not None else None


def _log_failed_write(cmd: str, client_id: str):
    def done(f) -> None:
        if not f.cancelled() and f.exception() is not None:
            log.error("event=store_write_failed cmd=%s client_id=%s error=%s", cmd, client_id, f.exception())
    return done


__all__ = ["RemoteMetadata"]
