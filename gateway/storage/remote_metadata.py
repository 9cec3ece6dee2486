"""The metadata facades (gateway/storage/facades.py: sessions, offsets, retained messages, wills,
filter registrations) over the store node's gw_* commands, for `lmqtt gateway` (docs/fleet.md): typed
in store/node/protocol.py, sent with its `NodeClient`; the node side is store/node/gateway_service.py.

Every method sends its request now, on the gateway's one `LoopConnection` (so the store sees this
gateway's requests in order: a read sent after a write sees it), and returns an `Answer`: a write
nobody waits for costs the gateway nothing; a CONNACK / SUBACK backed by a session record waits for
the store's answer (`MQTTConnection.wait_for_store`), so only that client waits; start-up and rare
paths (the restore's session list, orphan wills, the shutdown flush) `wait()`, bounded by the
link's timeout. Reads are bounded too (a store silent past the bound drops the link); writes are not (they are
answered in order with whatever follows them).

`RemoteMetadata` builds the five and says hello for them: at start and after every reconnect it
tells the store which gateway this link is (`gw_hello`), whose answer names the wills the store
published and the sessions its sweep changed while this gateway was away (the facades' events)."""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Iterator

from lmqtt.gateway.storage.facades import Answer, QueueStore, Retained, Storage, WrittenAgain
from lmqtt.gateway.storage.node_client import decode_reply
from lmqtt.gateway.storage.store_link import ConnectionLost, LoopConnection
from lmqtt.lightqueue.records import SessionRecord, WillRecord
from lmqtt.store import protocol as W
from lmqtt.store.node import protocol as P

log = logging.getLogger("lmqtt.gateway.remote")


def ask(link: LoopConnection, req: P.Request, *, bounded: bool = True) -> Answer[Any]:
    """Send `req` now: an `Answer` of its typed reply. `wait()` drives the link right here."""
    reply_type = req.Reply
    return ask_raw(link, req.cmd, req.to_wire(), lambda op, body: decode_reply(reply_type, op, body),
                   bounded=bounded)


def ask_raw(link: LoopConnection, cmd: str, wire: dict, decode: Callable[[int, bytes], Any], *,
            bounded: bool = True) -> Answer[Any]:
    """Send command `cmd` with `wire`'s fields now: an `Answer` of `decode(opcode, body)` of its
    reply (a command without a typed request, e.g. the topic table's claim). `wait()` drives the
    link right here; a link still without the reply then fails it with the reason."""
    raw = link.cmd_within(cmd, **wire) if bounded else link.cmd(cmd, **wire)

    def settle(out: Answer[Any]) -> None:
        if out.done():
            return
        if raw.cancelled():
            out.set_exception(ConnectionLost(f"store at {link.address}: request cancelled"))
            return
        e = raw.exception()
        if e is not None:
            out.set_exception(e)
            return
        op, _flags, body = raw.result()
        try:
            got = decode(op, body)
        except Exception as bad:  # noqa: BLE001 - a reply that does not match its type is the answer
            out.set_exception(bad)
            return
        out.set_result(got)

    def waiter(out: Answer[Any], timeout: float | None) -> None:
        if not raw.done():
            link.wait_reply(raw, timeout)
        if raw.done():
            settle(out)
        else:
            out.set_exception(ConnectionLost(down_reason(link)))

    out: Answer[Any] = Answer(waiter)
    if raw.done():
        settle(out)
    else:
        raw.add_done_callback(lambda _f: settle(out))
    return out


def down_reason(link: LoopConnection) -> str:
    """Why the store cannot answer now, in words that hold during a group's failover too (the link
    may already be dialling the member another one named as the primary)."""
    return link.unavailable_reason()


def written_again(link: LoopConnection, answer: Answer[Any]) -> Answer[Any]:
    """A store group's write that `RemoteMetadata.reestablish` writes again on the new primary: its
    failure for a lost link becomes `WrittenAgain` (log_failure logs it as deferred, not an error)."""
    if not getattr(link, "group", False):
        return answer
    out: Answer[Any] = Answer(lambda _o, timeout: answer.wait_quietly(timeout))

    def done(a: Answer[Any]) -> None:
        e = a.exception()
        if isinstance(e, ConnectionLost):
            out.set_exception(WrittenAgain(f"{e}; written again on the group's new primary"))
        elif e is not None:
            out.set_exception(e)
        else:
            out.set_result(a.result())
    answer.add_done_callback(done)
    return out


def _record(reply: P.SessionReply) -> SessionRecord | None:
    return SessionRecord.from_bytes(reply.rec.encode()) if reply.rec is not None else None


def _none(_reply: Any) -> None:
    return None


def _both(a: Answer[Any], b: Answer[Any], fn: Callable[[Any, Any], Any]) -> Answer[Any]:
    """An answer of fn(a's value, b's value), once both are in (the first failure fails it)."""
    def waiter(_out: Answer[Any], timeout: float | None) -> None:
        for x in (a, b):
            if not x.done():
                x.wait_quietly(timeout)

    out: Answer[Any] = Answer(waiter)

    def done(_x: Answer[Any]) -> None:
        if out.done() or not (a.done() and b.done()):
            return
        for x in (a, b):
            if x.exception() is not None:
                out.set_exception(x.exception())        # type: ignore[arg-type]
                return
        try:
            out.set_result(fn(a.result(), b.result()))
        except Exception as e:  # noqa: BLE001 - a reply we cannot read fails this request only
            out.set_exception(e)
    a.add_done_callback(done)
    b.add_done_callback(done)
    return out


class RemoteSessions:
    """`SessionStore` over gw_put_session, gw_get_session, gw_list_sessions, gw_claim_sessions..."""

    RESTORE_PAGE = 5000
    claims_void_wills = True       # gw_claim_sessions voids other gateways' wills of those clients

    def __init__(self, link: LoopConnection, gateway_id: str) -> None:
        self.link = link
        self.gateway_id = gateway_id
        self.swept: list[Callable[[list[str]], None]] = []
        self.moved: list[Callable[[list[str]], None]] = []
        self.claims: list[Callable[[str, list], None]] = []
        # a store group: the last record put per client id, written again on a new primary, and
        # the records deleted since the last failover (deleted again there: a delete the old
        # primary never answered may not have reached the group)
        self.kept: dict[str, str] | None = {} if getattr(link, "group", False) else None
        self.deleted: set[str] = set()

    def put(self, client_id: str, rec: SessionRecord) -> Answer[None]:
        text = rec.to_bytes().decode()
        if self.kept is not None:
            self.kept[client_id] = text
            self.deleted.discard(client_id)
        return written_again(self.link, ask(self.link, P.PutSession(client_id, text)).then(_none))

    def put_many(self, records: list[tuple[str, SessionRecord]]) -> Answer[None]:
        return Answer.gather([self.put(cid, rec) for cid, rec in records]).then(_none)

    def get(self, client_id: str) -> Answer[SessionRecord | None]:
        return ask(self.link, P.GetSession(client_id)).then(_record)

    def load(self, client_id: str) -> Answer[tuple[SessionRecord | None, dict[str, int]]]:
        """gw_get_session and gw_get_offsets sent together: one round trip for both."""
        return _both(ask(self.link, P.GetSession(client_id)), ask(self.link, P.GetOffsets(client_id)),
                     lambda r, o: (_record(r), o.offsets))

    def delete(self, client_id: str) -> Answer[bool]:
        if self.kept is not None:
            self.kept.pop(client_id, None)
            self.deleted.add(client_id)
        return written_again(self.link, ask(self.link, P.DeleteSession(client_id), bounded=False)
                             .then(lambda r: r.deleted))

    def all(self) -> Answer[list[SessionRecord]]:
        return ask(self.link, P.ListSessions()).then(
            lambda r: [SessionRecord.from_bytes(s.encode()) for s in r.sessions])

    def list_for_restore(self, hosted_by: str | None = None) -> Answer[list[tuple[SessionRecord, dict[str, int]]]]:
        """A page of `RESTORE_PAGE` records with their offsets per round trip (one `gw_get_offsets`
        per session made 20,000 sessions take 4.6 s); each page asked for when the one before is
        in. `hosted_by`: the store filters, and so does this (a node of the previous version sends
        them all)."""
        def took(r: P.ListSessionsReply) -> tuple[list, str | None]:
            recs = [SessionRecord.from_bytes(s.encode()) for s in r.sessions]
            return ([(rec, offs) for rec, offs in zip(recs, r.offsets or [{} for _ in recs])
                     if hosted_by is None or rec.host in (None, hosted_by)],
                    recs[-1].client_id if recs else None)
        return self._pages(hosted_by, True, took)

    def records_for_restore(self, hosted_by: str | None = None) -> Answer[Iterable[bytes]]:
        """`list_for_restore` without offsets and without decoding: the records' bytes as the store
        sent them (the gateway's restore checks the host)."""
        def took(r: P.ListSessionsReply) -> tuple[list, str | None]:
            raws = [s.encode() for s in r.sessions]
            return raws, (SessionRecord.from_bytes(raws[-1]).client_id if raws and not r.next else None)
        return self._pages(hosted_by, False, took)

    def _pages(self, hosted_by: str | None, offsets: bool,
               took: Callable[[P.ListSessionsReply], tuple[list, str | None]]) -> Answer[Any]:
        """Every page of gw_list_sessions (`RESTORE_PAGE` records each, asked for when the one
        before is in), each turned by `took` into (its items, the client id of its last record)."""
        got: list[Any] = []
        page: list[Answer[Any]] = []

        def waiter(out: Answer[Any], timeout: float | None) -> None:
            while not out.done() and page:
                this = page[-1]
                this.wait_quietly(timeout)
                if not this.done():
                    return              # no answer in time: `wait` says so

        out: Answer[list[Any]] = Answer(waiter)

        def ask_page(after: str | None) -> None:
            a = ask(self.link, P.ListSessions(after, self.RESTORE_PAGE, offsets, hosted_by))
            page.append(a)
            a.add_done_callback(answered)

        def answered(a: Answer[Any]) -> None:
            if a.exception() is not None:
                out.set_exception(a.exception())        # type: ignore[arg-type]
                return
            r: P.ListSessionsReply = a.result()
            try:
                items, last = took(r)
            except Exception as e:  # noqa: BLE001 - a record that does not decode fails the list
                out.set_exception(e)
                return
            got.extend(items)
            after = r.next or last
            if not r.more or after is None:
                out.set_result(got)
            else:
                ask_page(after)
        ask_page(None)
        return out

    def claim(self, claims: list[tuple[str, int]]) -> Answer[None]:
        return ask(self.link, P.ClaimSessions(self.gateway_id, [(c, int(t)) for c, t in claims]),
                   bounded=False).then(_none)

    def flush(self) -> Answer[None]:
        return ask(self.link, P.Flush()).then(_none)

    def on_sessions_swept(self, fn: Callable[[list[str]], None]) -> None:
        self.swept.append(fn)

    def on_sessions_moved(self, fn: Callable[[list[str]], None]) -> None:
        self.moved.append(fn)

    def on_session_claims(self, fn: Callable[[str, list], None]) -> None:
        self.claims.append(fn)

    # pushes from the store (RemoteStore routes them here)
    def sessions_moved_frame(self, body: bytes) -> None:
        """A SESSIONS_MOVED push (docs/protocol.md)."""
        try:
            client_ids = W.decode_sessions_moved(body)
        except Exception as e:  # noqa: BLE001 - a hint: the copies then end at their expiry
            log.warning("event=bad_sessions_moved_frame error=%r", e)
            return
        if self.kept is not None:            # another gateway holds them now: not ours to write again
            for cid in client_ids:
                self.kept.pop(cid, None)
        for fn in self.moved:
            fn(client_ids)

    def session_claims_frame(self, body: bytes) -> None:
        """A SESSION_CLAIMS push; claims of this gateway's own id (another process started with the
        same --gateway-id) are not for it to act on."""
        try:
            gid, claims = W.decode_session_claims(body)
        except Exception as e:  # noqa: BLE001 - a hint: the old connections stay until their clients leave
            log.warning("event=bad_session_claims_frame error=%r", e)
            return
        if gid != self.gateway_id:
            for fn in self.claims:
                fn(gid, claims)


class RemoteOffsets:
    """`OffsetStore` over gw_get_offset(s) / gw_set_offsets / gw_delete_offsets."""

    def __init__(self, link: LoopConnection) -> None:
        self.link = link
        # a store group: the offsets set per consumer, written again on a new primary
        self.kept: dict[str, dict[str, int]] | None = {} if getattr(link, "group", False) else None

    def get(self, consumer: str, queue: str) -> Answer[int | None]:
        return ask(self.link, P.GetOffset(consumer, queue)).then(lambda r: r.offset)

    def get_all(self, consumer: str) -> Answer[dict[str, int]]:
        return ask(self.link, P.GetOffsets(consumer)).then(lambda r: r.offsets)

    def set(self, consumer: str, offsets: dict[str, int]) -> Answer[None]:
        if self.kept is not None:
            self.kept.setdefault(consumer, {}).update(offsets)
        return written_again(self.link, ask(self.link, P.SetOffsets(consumer, offsets), bounded=False).then(_none))

    def delete(self, consumer: str, queues: list[str] | None = None) -> Answer[None]:
        if self.kept is not None:
            if queues is None:
                self.kept.pop(consumer, None)
            else:
                held = self.kept.get(consumer, {})
                for q in queues:
                    held.pop(q, None)
        return ask(self.link, P.DeleteOffsets(consumer, queues), bounded=False).then(_none)


class RemoteRetained:
    """`RetainedStore` over gw_set_retained / gw_retained_matching / gw_clear_retained_if."""

    def __init__(self, link: LoopConnection) -> None:
        self.link = link

    def set(self, topic: str, payload: bytes, props: bytes = b"") -> Answer[None]:
        return ask(self.link, P.SetRetained(topic, payload, props), bounded=False).then(_none)

    def matching(self, flt: str) -> Answer[list[Retained]]:
        return ask(self.link, P.RetainedMatching(flt)).then(lambda r: list(r.retained))

    def batches(self, flt: str) -> Answer[Iterator[list[Retained]]]:
        return self.matching(flt).then(lambda found: iter((found,)))   # one reply: nothing to read lazily

    def clear_if(self, topic: str, props: bytes) -> Answer[bool]:
        """The store compares and clears in one step."""
        return ask(self.link, P.ClearRetainedIf(topic, props), bounded=False).then(lambda r: r.cleared)


class RemoteWills:
    """Wills carry this gateway's id: the store node publishes them if this gateway's connection
    stays gone past its grace period (and says so in the next gw_hello's answer)."""

    def __init__(self, link: LoopConnection, gateway_id: str) -> None:
        self.link = link
        self.gateway_id = gateway_id
        self.published: list[Callable[[list[str]], None]] = []
        # voids asked for in this loop turn, sent at its end in one gw_void_wills; a will put for
        # the same client meanwhile replaces the old one in the store and takes its void's place
        self._voids: dict[str, Answer[None]] = {}
        # which put each client's stored will came from: a will put after a gw_hello was sent
        # belongs to a newer connection than any the store can name in that hello's answer
        self.seq = 0
        self.put_at: dict[str, int] = {}
        # a store group: the wills put and not popped, written again on a new primary
        self.kept: dict[str, bytes] | None = {} if getattr(link, "group", False) else None

    def put(self, client_id: str, will: WillRecord) -> Answer[None]:
        void = self._voids.pop(client_id, None)
        self.seq += 1
        self.put_at[client_id] = self.seq
        if self.kept is not None:
            self.kept[client_id] = will.to_bytes()
        out = ask(self.link, P.PutWill(client_id, will.to_bytes(), self.gateway_id), bounded=False).then(_none)
        if void is not None:
            void.follow(out)
        return out

    def pop(self, client_id: str) -> Answer[None]:
        self._send_voids()
        # only this gateway's: a will the client's newer connection left on another gateway stays
        self.put_at.pop(client_id, None)
        if self.kept is not None:
            self.kept.pop(client_id, None)
        return ask(self.link, P.PopWill(client_id, self.gateway_id), bounded=False).then(_none)

    def void(self, client_id: str) -> Answer[None]:
        """Sent at the end of this loop turn with the turn's other voids (a connect storm's are
        one request), unless a will for `client_id` is put before then: the store keeps one will
        per client id, so that put drops the old one itself (a device that sets a will on every
        CONNECT costs the store one request for it, not two)."""
        self.put_at.pop(client_id, None)
        if self.kept is not None:
            self.kept.pop(client_id, None)
        out = self._voids.get(client_id)
        if out is None:
            if not self._voids:
                self.link.loop.call_soon(self._send_voids)

            def waiter(a: Answer[None], timeout: float | None) -> None:
                if client_id in self._voids:
                    self._send_voids()      # waited for before the turn ends: sent now, and
                    a.wait_quietly(timeout)  # waited for as the request it went in
            out = self._voids[client_id] = Answer(waiter)
        return out

    def _send_voids(self) -> None:
        voids, self._voids = self._voids, {}
        if voids:
            sent = ask(self.link, P.VoidWills(list(voids)), bounded=False).then(_none)
            for a in voids.values():
                a.follow(sent)

    def take(self) -> Answer[list[tuple[str, WillRecord]]]:
        self._send_voids()                  # what was asked before is done before (one socket)
        if self.kept is not None:
            self.kept.clear()
        return ask(self.link, P.TakeWills(self.gateway_id)).then(
            lambda r: [(cid, WillRecord.from_bytes(w)) for cid, w in r.wills])

    def held(self) -> Answer[list[tuple[str, WillRecord]]]:
        self._send_voids()
        return ask(self.link, P.ListWills(self.gateway_id)).then(
            lambda r: [(cid, WillRecord.from_bytes(w)) for cid, w in r.wills])

    def on_wills_published(self, fn: Callable[[list[str]], None]) -> None:
        self.published.append(fn)


class RemoteFilters:
    """`FilterRegistry` over gw_register / gw_unregister / gw_filters."""

    REGISTER_CHUNK = 2000        # filters per `gw_register` round trip (`register_all`)

    def __init__(self, link: LoopConnection, gateway_id: str) -> None:
        self.link = link
        self.gateway_id = gateway_id

    def register(self, flt: str) -> Answer[int]:
        return ask(self.link, P.Register(self.gateway_id, flt)).then(lambda r: r.count)

    def register_all(self, flts: list[str]) -> Answer[dict[str, int]]:
        """`REGISTER_CHUNK` filters per round trip, every chunk sent now (a gateway's start: one
        blocking round trip per filter made 20,000 sessions with a wildcard filter each take ~9 s)."""
        chunk = self.REGISTER_CHUNK
        parts = [ask(self.link, P.Register(self.gateway_id, filters=flts[i:i + chunk]))
                 for i in range(0, len(flts), chunk)]
        if not parts:
            return Answer.of({})

        def waiter(_out: Answer[Any], timeout: float | None) -> None:
            for a in parts:
                a.wait_quietly(timeout)

        out: Answer[dict[str, int]] = Answer(waiter)

        def done(_a: Answer[Any]) -> None:
            if out.done() or not all(a.done() for a in parts):
                return
            counts: dict[str, int] = {}
            for a in parts:
                e = a.exception()
                if e is not None:
                    out.set_exception(e)
                    return
                counts.update(a.result().counts)
            out.set_result(counts)
        for a in parts:
            a.add_done_callback(done)
        return out

    def unregister(self, flt: str) -> Answer[int]:
        return ask(self.link, P.Unregister(self.gateway_id, flt)).then(lambda r: r.count)

    def release(self, flt: str) -> Answer[None]:
        return ask(self.link, P.Unregister(self.gateway_id, flt), bounded=False).then(_none)

    def registered(self) -> Answer[dict[str, int]]:
        return ask(self.link, P.Filters(self.gateway_id)).then(lambda r: dict(r.filters))


class RemoteMetadata:
    """The remote metadata facades and filter registrations of one gateway's link, and its gw_hello."""

    def __init__(self, link: LoopConnection, gateway_id: str = "") -> None:
        self.link = link
        self.gateway_id = gateway_id
        self.sessions = RemoteSessions(link, gateway_id)
        self.offsets = RemoteOffsets(link)
        self.filters = RemoteFilters(link, gateway_id)
        self.retained = RemoteRetained(link)
        self.wills = RemoteWills(link, gateway_id)

    def storage(self, queues: "QueueStore") -> Storage:
        return Storage(self.sessions, self.offsets, self.retained, self.wills, self.filters, queues)

    def hello(self) -> None:
        """Tell the store which gateway this connection is (at start and after every reconnect):
        it stops the grace timer of this gateway's wills and says which it published meanwhile."""
        if not self.gateway_id:
            return
        wills = self.wills
        mark = wills.seq

        def done(a: Answer[Any]) -> None:
            e = a.exception()
            if e is not None:
                log.warning("event=gw_hello_failed error=%r", e)
                return
            reply: P.HelloReply = a.result()
            if reply.sessions_swept:
                if self.sessions.kept is not None:
                    for cid in reply.sessions_swept:
                        self.sessions.kept.pop(cid, None)
                for fn in self.sessions.swept:
                    fn(reply.sessions_swept)
            fired = [c for c in reply.wills_published if wills.put_at.get(c, 0) <= mark]
            if fired:
                log.warning("event=store_published_wills_of_this_gateway count=%d", len(fired))
                for fn2 in wills.published:
                    fn2(fired)
        ask(self.link, P.Hello(self.gateway_id), bounded=False).add_done_callback(done)

    def reestablish(self) -> int:
        """A store group's new primary (docs/fleet.md): the gateway's metadata is not replicated
        (docs/ha.md), so what this gateway wrote and still holds is written there again - the
        last record of every persistent session it put (and did not delete), the offsets it set,
        the wills it put and did not pop. Sent in order on the link, before anything the gateway
        writes after the reconnect. -> the number of writes."""
        n = 0
        link = self.link
        deleted, self.sessions.deleted = self.sessions.deleted, set()
        for cid in sorted(deleted):
            ask(link, P.DeleteSession(cid), bounded=False)
            n += 1
        for cid, text in list((self.sessions.kept or {}).items()):
            ask(link, P.PutSession(cid, text), bounded=False)
            n += 1
        for consumer, offs in list((self.offsets.kept or {}).items()):
            if offs:
                ask(link, P.SetOffsets(consumer, dict(offs)), bounded=False)
                n += 1
        for cid, will in list((self.wills.kept or {}).items()):
            ask(link, P.PutWill(cid, will, self.gateway_id), bounded=False)
            n += 1
        if n:
            log.warning("event=metadata_rewritten_on_new_primary store=%s sessions=%d offsets=%d wills=%d "
                        "deleted_sessions=%d", link.address, len(self.sessions.kept or {}),
                        len(self.offsets.kept or {}), len(self.wills.kept or {}), len(deleted))
        return n


__all__ = ["RemoteMetadata", "RemoteSessions", "RemoteOffsets", "RemoteRetained", "RemoteWills", "RemoteFilters",
           "ask"]
