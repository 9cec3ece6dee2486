"""The gateway <-> store node protocol: every `gw_*` command `lmqtt gateway` sends `lmqtt store`,
its request and its reply as typed values, in one module both sides import (docs/protocol.md
"Remote gateways"). The node (store/node/gateway_service.py) answers each command with the method
of the same name; the gateway sends them through `NodeClient` (gateway/storage/node_client.py).

On the wire each command is a CALL frame whose JSON body is the request's `to_wire()` plus
`"cmd"`; the reply is a RESULT frame holding the reply's `to_wire()`, or, for `gw_pull` and
`gw_replay_read`, a MESSAGES frame whose JSON header is the reply's `to_wire()` and whose entries
are the reply's `messages`. Binary fields (wills, retained payloads and props) travel as base64
strings; a session record as its JSON text.

`from_wire` checks every field against its declared type: a request missing a field, or with one
of the wrong type, is refused with `BadRequest` naming the command and the field (the node answers
ERROR `invalid` with that message); fields it does not know are ignored.

Version rule: the node says which gateway protocol it speaks in its HELLO_OK (`"gateway_protocol":
NODE_PROTOCOL_VERSION`; 0 from a store that serves no gateways, i.e. an embedded `lmqtt serve`).
A gateway talks only to a node of its own version (`peer_refusal`): bump NODE_PROTOCOL_VERSION with
any change to a command's name, fields or meaning that an older peer would misread.

Pure Python: this module imports nothing of lmqtt but wire.py (the typed messages' codec; the node
and the gateway both import it): it says what the commands are; sending them over a link and decoding the frames that answer is the
gateway's side, gateway/storage/node_client.py.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, ClassVar

# the typed messages (to_wire / from_wire, the field codecs): wire.py
from .wire import NOT_WIRE, OMIT_DEFAULT, BadRequest, Wire, message_type

NODE_PROTOCOL_VERSION = 3       # 2: shared groups assigned per message (gw_group_pop/ack/renew);
# 3: gw_watch `start`, gw_void_wills, and gw_claim_sessions voiding other gateways' wills (a
# gateway of 3 sends no void beside its claims: a store of 2 would leave those wills to fire)
# (gw_group_lease, the one-gateway lease of 1, is gone without a bump: no gateway of 2 sends it)
HELLO_KEY = "gateway_protocol"       # the HELLO_OK field that carries it


class NodeMismatch(Exception):
    """The store at the other end does not speak this gateway's protocol (`peer_refusal`)."""


_T = typing.TypeVar("_T")


# dataclass_transform: a type checker sees the decorated classes as the frozen dataclasses they are
@typing.dataclass_transform(frozen_default=True)
def reply(cls: type[_T]) -> type[_T]:
    """A reply type (`<command> reply` in error messages)."""
    return message_type(cls, f"{cls.__name__}")


COMMANDS: dict[str, tuple[type, type]] = {}      # command name -> (request type, reply type)
# the commands that change the store's replicated metadata (sessions, offsets, retained messages,
# wills, filter holds, shared groups' committed offsets): on a store group each is answered only
# once the in-sync replicas applied its change (store/node/ha_member.py), so nothing a gateway was
# told is done is lost in a failover. Every command says whether it writes (`writes` has no
# default): a new one cannot be added without deciding.
WRITES: set[str] = set()


@typing.dataclass_transform(frozen_default=True)
def command(name: str, reply_type: type, *, writes: bool) -> Callable[[type[_T]], type[_T]]:
    """A request type: the command `name`, answered with `reply_type`; `writes`: it changes the
    replicated metadata (`WRITES`). Connection state (watches), in-memory leases and reads do not."""
    def wrap(cls: Any) -> Any:
        cls = message_type(cls, name)
        cls.cmd = name
        cls.Reply = reply_type
        if name in COMMANDS:
            raise ValueError(f"command {name} defined twice")
        COMMANDS[name] = (cls, reply_type)
        if writes:
            WRITES.add(name)
        return cls
    return wrap


class Request(Wire):
    __slots__ = ()
    cmd: ClassVar[str]
    Reply: ClassVar[type[Wire]]


# ---------------------------------------------------------------- replies
@reply
class Ok(Wire):
    """`{ok: true}`: the command was done."""
    ok: bool = True


@reply
class MaxOffsetsReply(Wire):
    max_offsets: dict[str, int]


@reply
class WatchReply(Wire):
    """`push` / `raw`: the node pushes the entries (PUSH / PUSH_RAW frames), as asked."""
    max_offsets: dict[str, int]
    push: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)
    raw: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)


@reply
class GroupPopReply(Wire):
    """MESSAGES: the messages of a shared group handed to this gateway (store/node/group_assign.py),
    in queue order, those visible again first; `dq`: each one's dispatch queues."""
    dq: list[list[str]] = dataclasses.field(default_factory=list)
    messages: list = dataclasses.field(default_factory=list, metadata=NOT_WIRE)


@reply
class CountReply(Wire):
    count: int


@reply
class ReplayReply(Wire):
    """lightqueue/replay.py `plan`: `source` "queue" or "log" (then read `cursor` with
    gw_replay_read), and the light-queue offset live reads start at."""
    source: str
    live_offset: int
    cursor: dict | None = dataclasses.field(default=None, metadata=OMIT_DEFAULT)

    def plan(self) -> dict:
        """As `replay.plan` returns it (what the facades' `ReplayPlan` takes, gateway/storage/facades.py)."""
        return self.to_wire()


@reply
class ReplayReadReply(Wire):
    """MESSAGES: the next history entries, the cursor to read on from, and whether that was all."""
    cursor: dict
    done: bool
    messages: list = dataclasses.field(default_factory=list, metadata=NOT_WIRE)


@reply
class PullReply(Wire):
    """MESSAGES: a light queue's entries from the offset asked for; `dq`: each one's dispatch
    queues (the gateway delivers a message once to a session whose subscriptions overlap)."""
    next_offset: int
    min_offset: int
    max_offset: int
    dq: list[list[str]] = dataclasses.field(default_factory=list)
    messages: list = dataclasses.field(default_factory=list, metadata=NOT_WIRE)


@reply
class RegisterReply(Wire):
    """`count` (one filter) or `counts` (`filters`: many): this gateway's holds on each."""
    count: int | None = dataclasses.field(default=None, metadata=OMIT_DEFAULT)
    counts: dict[str, int] | None = dataclasses.field(default=None, metadata=OMIT_DEFAULT)


@reply
class FiltersReply(Wire):
    filters: dict[str, int]


@reply
class HolderInfo(Wire):
    filters: int
    connected: bool


@reply
class HoldersReply(Wire):
    gateways: dict[str, HolderInfo]


@reply
class ReleaseGatewayReply(Wire):
    released: list[str]
    kept: list[str]


@reply
class SessionReply(Wire):
    """`rec`: the SessionRecord's JSON text, None if there is none."""
    rec: str | None


@reply
class DeletedReply(Wire):
    deleted: bool


@reply
class ListSessionsReply(Wire):
    """A page of session records (JSON text) in client id order; `more`: another page follows,
    after `next`; `offsets`: each one's committed offsets, when asked for."""
    sessions: list[str]
    more: bool
    next: str | None
    offsets: list[dict[str, int]] | None = dataclasses.field(default=None, metadata=OMIT_DEFAULT)


@reply
class OffsetReply(Wire):
    offset: int | None


@reply
class OffsetsReply(Wire):
    offsets: dict[str, int]


@reply
class RetainedReply(Wire):
    """(topic, payload, props) of every retained message the filter matches, in topic order."""
    retained: list[tuple[str, bytes, bytes]]


@reply
class ClearedReply(Wire):
    cleared: bool


@reply
class HelloReply(Wire):
    """The client ids whose wills the node published while this gateway was away, and those whose
    session records its sweep changed meanwhile."""
    wills_published: list[str]
    sessions_swept: list[str]


@reply
class WillReply(Wire):
    """The WillRecord bytes removed, None if there was none."""
    will: bytes | None


@reply
class WillsReply(Wire):
    """(client id, WillRecord bytes) pairs."""
    wills: list[tuple[str, bytes]]


# ---------------------------------------------------------------- requests
# the delivery path: watches, offsets, pulls, shared-group leases, history
@command("gw_watch", WatchReply, writes=False)
class Watch(Request):
    """Push EVENT (or with `push` PUSH, with `raw` too PUSH_RAW) frames for these queues to this
    connection; `replace`: instead of the queues watched so far. `start`: watched and answered once
    every message appended before the request is dispatched, so the answer's offsets are also where
    a new subscription starts (a SUBSCRIBE's `gw_watch` and `gw_start_offsets` in one request)."""
    queues: list[str]
    push: bool = False
    raw: bool = False
    replace: bool = False
    start: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)


@command("gw_unwatch", Ok, writes=False)
class Unwatch(Request):
    queues: list[str]


@command("gw_max_offsets", MaxOffsetsReply, writes=False)
class MaxOffsets(Request):
    queues: list[str]


@command("gw_start_offsets", MaxOffsetsReply, writes=False)
class StartOffsets(Request):
    """Max offsets once every message appended before the request is dispatched."""
    queues: list[str]


@command("gw_group_pop", GroupPopReply, writes=False)
class GroupPop(Request):
    """Shared groups across the fleet (store/node/group_assign.py): up to `max_count` messages of
    (group, queue) for this gateway's members, parked up to `wait_ms` until there are some;
    `start`: where the group starts if the store has no state for it; every request renews the
    gateway's lease for `ttl_ms` (`incarnation`: its process; a new one releases the old one's)."""
    gateway: str
    incarnation: str
    group: str
    queue: str
    max_count: int = 64
    start: int | None = None
    ttl_ms: int = 3000
    wait_ms: int = 0


@command("gw_group_ack", CountReply, writes=True)
class GroupAck(Request):
    """`offsets` done (a member acknowledged them, or took them at QoS 0), `back` handed back
    (visible to the other gateways at once), `leave`: no subscription to the group here any more.
    Answers how many were still in flight."""
    gateway: str
    incarnation: str
    group: str
    queue: str
    offsets: list[int]
    back: list[int]
    leave: bool = False
    ttl_ms: int = 3000


@command("gw_group_renew", Ok, writes=False)
class GroupRenew(Request):
    """This gateway is alive: what it holds of shared groups stays its own for `ttl_ms` more."""
    gateway: str
    incarnation: str
    ttl_ms: int = 3000


@command("gw_replay", ReplayReply, writes=False)
class Replay(Request):
    filter: str
    since: int


@command("gw_replay_read", ReplayReadReply, writes=False)
class ReplayRead(Request):
    cursor: dict
    max_count: int = 1024


@command("gw_pull", PullReply, writes=False)
class Pull(Request):
    """`raw`: the entries as a PUSH_RAW frame of this one queue (the CommitLog's own record bytes,
    checked and decoded by the gateway) when the store can serve them so; otherwise the MESSAGES
    reply (PullReply), which is also what a store that does not know the field answers."""
    queue: str
    offset: int = 0
    max_count: int = 64
    max_bytes: int = 1 << 20
    raw: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)


# filter holds per gateway id
@command("gw_register", RegisterReply, writes=True)
class Register(Request):
    """Hold one `filter`, or many (`filters`): exactly one of the two."""
    gateway: str
    filter: str | None = None
    filters: list[str] | None = None

    def __post_init__(self) -> None:
        if (self.filter is None) == (self.filters is None):
            raise BadRequest("gw_register: give field 'filter' or field 'filters' (one of them)")


@command("gw_unregister", CountReply, writes=True)
class Unregister(Request):
    gateway: str
    filter: str


@command("gw_filters", FiltersReply, writes=False)
class Filters(Request):
    gateway: str


@command("gw_holders", HoldersReply, writes=False)
class Holders(Request):
    pass


@command("gw_release_gateway", ReleaseGatewayReply, writes=True)
class ReleaseGateway(Request):
    gateway: str


# sessions, offsets, retained messages
@command("gw_put_session", Ok, writes=True)
class PutSession(Request):
    client_id: str
    rec: str


@command("gw_get_session", SessionReply, writes=False)
class GetSession(Request):
    client_id: str


@command("gw_delete_session", DeletedReply, writes=True)
class DeleteSession(Request):
    client_id: str


@command("gw_list_sessions", ListSessionsReply, writes=False)
class ListSessions(Request):
    """A page of `limit` records after client id `after`; `offsets`: with their offsets;
    `hosted_by`: only those that gateway served last and those of no gateway."""
    after: str | None = None
    limit: int | None = None
    offsets: bool = False
    hosted_by: str | None = None


@command("gw_get_offset", OffsetReply, writes=False)
class GetOffset(Request):
    consumer: str
    queue: str


@command("gw_get_offsets", OffsetsReply, writes=False)
class GetOffsets(Request):
    consumer: str


@command("gw_set_offsets", Ok, writes=True)
class SetOffsets(Request):
    consumer: str
    offsets: dict[str, int]


@command("gw_delete_offsets", Ok, writes=True)
class DeleteOffsets(Request):
    """`queues` None: all of the consumer's."""
    consumer: str
    queues: list[str] | None = None


@command("gw_set_retained", Ok, writes=True)
class SetRetained(Request):
    topic: str
    payload: bytes
    props: bytes = b""


@command("gw_retained_matching", RetainedReply, writes=False)
class RetainedMatching(Request):
    filter: str


@command("gw_clear_retained_if", ClearedReply, writes=True)
class ClearRetainedIf(Request):
    topic: str
    props: bytes = b""


@command("gw_flush", Ok, writes=False)
class Flush(Request):
    pass


# which connection is which gateway; wills
@command("gw_hello", HelloReply, writes=True)
class Hello(Request):
    gateway: str


@command("gw_claim_sessions", Ok, writes=True)
class ClaimSessions(Request):
    """This gateway attached connections to these client ids at these wall-clock ms."""
    gateway: str
    claims: list[tuple[str, int]]


@command("gw_put_will", Ok, writes=True)
class PutWill(Request):
    client_id: str
    will: bytes
    gateway: str | None = None


@command("gw_pop_will", WillReply, writes=True)
class PopWill(Request):
    """With `gateway`: only a will that gateway holds."""
    client_id: str
    gateway: str | None = None


@command("gw_void_wills", Ok, writes=True)
class VoidWills(Request):
    """New connections of these client ids: the wills their earlier connections left, on any
    gateway, are dropped unpublished (`gw_pop_will` without a gateway, for many at once)."""
    client_ids: list[str]


@command("gw_take_wills", WillsReply, writes=True)
class TakeWills(Request):
    gateway: str


@command("gw_list_wills", WillsReply, writes=False)
class ListWills(Request):
    gateway: str | None = None


# ---------------------------------------------------------------- the version rule
def peer_refusal(info: dict, address: str) -> str | None:
    """Why a gateway must not use the store whose HELLO_OK said `info` (None: it may)."""
    theirs = info.get(HELLO_KEY)
    ours = NODE_PROTOCOL_VERSION
    if theirs == ours:
        return None
    if theirs == 0:
        return f"{address} is an embedded `lmqtt serve`; gateways need `lmqtt store` (docs/fleet.md)"
    if theirs is None:
        return (f"the store at {address} speaks no versioned gateway protocol (an lmqtt older than this "
                f"gateway, which speaks gateway protocol {ours}): run the same lmqtt version on both")
    return (f"store node {address} speaks gateway protocol {theirs}, this gateway speaks {ours}: "
            f"run the same lmqtt version on both")


def call_sync(conn, req: Request):
    """`req` over the SDK's blocking `Connection` (lmqtt admin): its typed reply."""
    got = conn.cmd(req.cmd, **req.to_wire())
    if isinstance(got, tuple):              # a MESSAGES reply: (header, entries)
        return req.Reply.from_wire(got[0], got[1])
    return req.Reply.from_wire(got)
