"""The gateway's client of the store node: the typed gw_* requests of store/node/protocol.py sent
over one `LoopConnection` (gateway/storage/store_link.py), the RESULT or MESSAGES frames that
answer them decoded into their typed replies (`NodeClient`, `decode_reply`). (`lmqtt admin` sends
them over the SDK's blocking `Connection`: store/node/protocol.py `call_sync`.)

Why a module of its own: store/node/protocol.py says what the commands are (their names, fields,
wire form and the version rule) and is imported by both sides, the node that answers them
(store/node/gateway_service.py) and the gateway that sends them; this module is the sending side
only, with the link, its futures and timeouts, which the node never uses. Imported by the
gateway's storage (gateway/storage/remote_*.py).
"""
from __future__ import annotations

import asyncio
import logging

from lmqtt.gateway.storage.remote_entries import BadPushedRecord, RawPullReply, decode_raw_entries
from lmqtt.store import protocol as W
from lmqtt.store.node.protocol import (
    BadRequest,
    ClaimSessions,
    ClearedReply,
    ClearRetainedIf,
    CountReply,
    DeletedReply,
    DeleteOffsets,
    DeleteSession,
    Filters,
    FiltersReply,
    Flush,
    GetOffset,
    GetOffsets,
    GetSession,
    GroupAck,
    GroupPop,
    GroupPopReply,
    GroupRenew,
    Hello,
    HelloReply,
    Holders,
    HoldersReply,
    ListSessions,
    ListSessionsReply,
    ListWills,
    MaxOffsets,
    MaxOffsetsReply,
    NodeMismatch,
    OffsetReply,
    OffsetsReply,
    Ok,
    PopWill,
    Pull,
    PullReply,
    PutSession,
    PutWill,
    Register,
    RegisterReply,
    ReleaseGateway,
    ReleaseGatewayReply,
    Replay,
    ReplayRead,
    ReplayReadReply,
    ReplayReply,
    Request,
    RetainedMatching,
    RetainedReply,
    SessionReply,
    SetOffsets,
    SetRetained,
    StartOffsets,
    TakeWills,
    VoidWills,
    Unregister,
    Unwatch,
    Watch,
    WatchReply,
    WillReply,
    WillsReply,
    Wire,
    peer_refusal,
)

# the logger's name is the one these events have always had (before this module was split out)
log = logging.getLogger("lmqtt.store.node.protocol")


def decode_reply(reply_type: type[Wire], op: int, body: bytes):
    """A RESULT or MESSAGES frame answering a command -> its typed reply."""
    if op == W.OP_MESSAGES:
        header, entries = W.decode_messages(body)
        return reply_type.from_wire(header, entries)
    if op == W.OP_RESULT:
        return reply_type.from_wire(W.parse_json(body))
    raise BadRequest(f"{reply_type.__name__}: unexpected opcode {op:#x} in the answer")


def pull_reply(op: int, body: bytes, ident: str) -> PullReply | RawPullReply:
    """The answer of a `gw_pull` asked with `raw`: a PUSH_RAW frame of the queue's records (decoded
    here, in C when built: gateway/storage/remote_entries.py), or the MESSAGES reply the store
    gives when it cannot serve them raw. BadPushedRecord when a record fails its check."""
    if op != W.OP_PUSH_RAW:
        return decode_reply(PullReply, op, body)
    [(_name, _mx, first, runs, sizes)] = W.decode_push_raw(body)
    msgs = decode_raw_entries(memoryview(body), runs, sizes, first, ident)
    if msgs is None:
        raise BadPushedRecord(f"a record of the raw pull from offset {first} failed its check")
    return RawPullReply(msgs, first + len(msgs))


class NodeClient:
    """The gateway's client of the store node: typed requests over one `LoopConnection`
    (gateway/storage/store_link.py), typed replies back.

    `call(req)` sends now and returns an asyncio future of the reply, bounded by the link's timeout
    (the store silent that long, or this request unanswered for `failover_timeout`: the link is
    dropped and the future fails), or unbounded with
    `bounded=False`; `call_blocking(req)` waits for the reply right here (bounded); `send(req)`
    does not wait and only logs a failure. One method per command (`watch`, `pull`, ...) is `call`
    of that request. Failures: StoreClientError (the node refused: ERROR frame), ConnectionLost,
    BadRequest (a reply that does not match its type)."""

    def __init__(self, link) -> None:
        self.link = link

    # ------------------------------------------------------------ the version rule
    def refusal(self) -> str | None:
        """Why the node this link is connected to must not be used (None: it may)."""
        return peer_refusal(self.link.server_info, self.link.address)

    def check(self) -> None:
        """At start: NodeMismatch unless the node speaks this gateway's protocol."""
        why = self.refusal()
        if why is not None:
            raise NodeMismatch(why)

    def refuse_mismatched_node(self) -> bool:
        """After a reconnect (run before anything is sent): a node of another version (an upgrade
        of one side only) gets nothing; the link is dropped with the reason, which requests, the
        store's `unavailable()` and /readyz then report, and redials until the versions match."""
        why = self.refusal()
        if why is None:
            return False
        log.error("event=store_node_refused reason=%s", why)
        self.link.drop(why)
        return True

    # ------------------------------------------------------------ generic
    def call(self, req: Request, *, bounded: bool = True, decode=None) -> asyncio.Future:
        """`req` sent now: a future of its typed reply (`decode(op, body)` when given)."""
        wire = req.to_wire()
        fut = self.link.cmd_within(req.cmd, **wire) if bounded else self.link.cmd(req.cmd, **wire)
        out = self.link.loop.create_future()
        reply_type = req.Reply
        as_reply = decode or (lambda op, body: decode_reply(reply_type, op, body))

        def done(f) -> None:
            if out.done():
                return
            if f.cancelled():
                out.cancel()
                return
            e = f.exception()
            if e is None:
                op, _flags, body = f.result()
                try:
                    out.set_result(as_reply(op, body))
                    return
                except Exception as bad:  # noqa: BLE001 - the caller gets it as the answer
                    e = bad
            out.set_exception(e)
            out.exception()       # retrieved, as the link does: a caller that ignores it is not warned
        fut.add_done_callback(done)
        return out

    def call_blocking(self, req: Request, timeout: float | None = None):
        op, _flags, body = self.link.call_blocking(W.OP_CALL, W.compact_json({"cmd": req.cmd, **req.to_wire()}).encode(),
                                                   timeout)
        return decode_reply(req.Reply, op, body)

    def send(self, req: Request) -> None:
        self.link.cmd_nowait(req.cmd, **req.to_wire())

    # ------------------------------------------------------------ one method per command
    def watch(self, queues: list[str], push: bool = False, raw: bool = False,
              replace: bool = False, start: bool = False) -> "asyncio.Future[WatchReply]":
        return self.call(Watch(queues, push, raw, replace, start))

    def unwatch(self, queues: list[str]) -> "asyncio.Future[Ok]":
        return self.call(Unwatch(queues))

    def max_offsets(self, queues: list[str]) -> "asyncio.Future[MaxOffsetsReply]":
        return self.call(MaxOffsets(queues))

    def start_offsets(self, queues: list[str]) -> "asyncio.Future[MaxOffsetsReply]":
        return self.call(StartOffsets(queues))

    def group_pop(self, gateway: str, incarnation: str, group: str, queue: str, max_count: int = 64,
                  start: int | None = None, ttl_ms: int = 3000, wait_ms: int = 0) -> "asyncio.Future[GroupPopReply]":
        return self.call(GroupPop(gateway, incarnation, group, queue, max_count, start, ttl_ms, wait_ms),
                         bounded=wait_ms <= 0)

    def group_ack(self, gateway: str, incarnation: str, group: str, queue: str, offsets: list[int],
                  back: list[int], leave: bool = False, ttl_ms: int = 3000) -> "asyncio.Future[CountReply]":
        return self.call(GroupAck(gateway, incarnation, group, queue, offsets, back, leave, ttl_ms))

    def group_renew(self, gateway: str, incarnation: str, ttl_ms: int = 3000) -> "asyncio.Future[Ok]":
        return self.call(GroupRenew(gateway, incarnation, ttl_ms))

    def replay(self, filter: str, since: int) -> "asyncio.Future[ReplayReply]":  # noqa: A002 - the field's name
        return self.call(Replay(filter, since))

    def replay_read(self, cursor: dict, max_count: int = 1024) -> "asyncio.Future[ReplayReadReply]":
        return self.call(ReplayRead(cursor, max_count))

    def pull(self, queue: str, offset: int = 0, max_count: int = 64, max_bytes: int = 1 << 20,
             raw: bool = False) -> "asyncio.Future[PullReply | RawPullReply]":
        """With `raw`: a RawPullReply of the records as the store wrote them (decoded here), or
        the PullReply the store answers with when it cannot serve them so."""
        req = Pull(queue, offset, max_count, max_bytes, raw)
        if not raw:
            return self.call(req)
        ident = self.link.server_info.get("ident") or ""
        return self.call(req, decode=lambda op, body: pull_reply(op, body, ident))

    def register(self, gateway: str, filter: str | None = None,  # noqa: A002
                 filters: list[str] | None = None) -> "asyncio.Future[RegisterReply]":
        return self.call(Register(gateway, filter, filters))

    def unregister(self, gateway: str, filter: str) -> "asyncio.Future[CountReply]":  # noqa: A002
        return self.call(Unregister(gateway, filter))

    def filters(self, gateway: str) -> "asyncio.Future[FiltersReply]":
        return self.call(Filters(gateway))

    def holders(self) -> "asyncio.Future[HoldersReply]":
        return self.call(Holders())

    def release_gateway(self, gateway: str) -> "asyncio.Future[ReleaseGatewayReply]":
        return self.call(ReleaseGateway(gateway))

    def put_session(self, client_id: str, rec: str) -> "asyncio.Future[Ok]":
        return self.call(PutSession(client_id, rec))

    def get_session(self, client_id: str) -> "asyncio.Future[SessionReply]":
        return self.call(GetSession(client_id))

    def delete_session(self, client_id: str) -> "asyncio.Future[DeletedReply]":
        return self.call(DeleteSession(client_id))

    def list_sessions(self, after: str | None = None, limit: int | None = None, offsets: bool = False,
                      hosted_by: str | None = None) -> "asyncio.Future[ListSessionsReply]":
        return self.call(ListSessions(after, limit, offsets, hosted_by))

    def get_offset(self, consumer: str, queue: str) -> "asyncio.Future[OffsetReply]":
        return self.call(GetOffset(consumer, queue))

    def get_offsets(self, consumer: str) -> "asyncio.Future[OffsetsReply]":
        return self.call(GetOffsets(consumer))

    def set_offsets(self, consumer: str, offsets: dict[str, int]) -> "asyncio.Future[Ok]":
        return self.call(SetOffsets(consumer, offsets))

    def delete_offsets(self, consumer: str, queues: list[str] | None = None) -> "asyncio.Future[Ok]":
        return self.call(DeleteOffsets(consumer, queues))

    def set_retained(self, topic: str, payload: bytes, props: bytes = b"") -> "asyncio.Future[Ok]":
        return self.call(SetRetained(topic, payload, props))

    def retained_matching(self, filter: str) -> "asyncio.Future[RetainedReply]":  # noqa: A002
        return self.call(RetainedMatching(filter))

    def clear_retained_if(self, topic: str, props: bytes = b"") -> "asyncio.Future[ClearedReply]":
        return self.call(ClearRetainedIf(topic, props))

    def flush(self) -> "asyncio.Future[Ok]":
        return self.call(Flush())

    def hello(self, gateway: str) -> "asyncio.Future[HelloReply]":
        return self.call(Hello(gateway))

    def claim_sessions(self, gateway: str, claims: list[tuple[str, int]]) -> "asyncio.Future[Ok]":
        return self.call(ClaimSessions(gateway, claims))

    def put_will(self, client_id: str, will: bytes, gateway: str | None = None) -> "asyncio.Future[Ok]":
        return self.call(PutWill(client_id, will, gateway))

    def pop_will(self, client_id: str, gateway: str | None = None) -> "asyncio.Future[WillReply]":
        return self.call(PopWill(client_id, gateway))

    def void_wills(self, client_ids: list[str]) -> "asyncio.Future[Ok]":
        return self.call(VoidWills(client_ids))

    def take_wills(self, gateway: str) -> "asyncio.Future[WillsReply]":
        return self.call(TakeWills(gateway))

    def list_wills(self, gateway: str | None = None) -> "asyncio.Future[WillsReply]":
        return self.call(ListWills(gateway))
