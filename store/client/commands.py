"""The SDK's command layer: every request the SDK sends, typed (as the node's gw_* messages are,
store/node/protocol.py), with the reply it reads. A command says what it sends (`encode`: opcode,
body, frame flags), whether a lost connection may send it again (`retry`), and how its reply reads
(`decode`: a typed value). The drivers only carry bytes: `Connection.execute(cmd)` (sync,
connection.py) returns the value, `AsyncConnection.execute(cmd)` (aio.py) a coroutine of it; so a
method written as `return self.conn.execute(SomeCommand(...))` serves both (redis-py's shape: the
command API written once over a sync and an asyncio connection). `Admin` and `PopConsumer` are
written that way (admin.py, consumer.py).

A command whose reply also moves its caller's state (a consumer's position, a POP's attempts)
carries `then`, called with the decoded reply before the value is returned.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from lmqtt.store import protocol as W

from .errors import NOT_IDEMPOTENT
from .records import PullResult, Record, decode_messages, pull_result, records_raw


def _local(default: Any = None) -> Any:
    """A field of the command that is not sent (a callback, a decode option)."""
    return field(default=default, compare=False, repr=False, metadata={"wire": False})


@dataclass(frozen=True)
class Command:
    """One request: `encode()` -> (opcode, body, flags); `decode(op, flags, body, ident)` -> value."""
    retry: ClassVar[bool] = True

    def encode(self) -> tuple[int, bytes, int]:
        raise NotImplementedError

    def decode(self, op: int, flags: int, body: bytes, ident: str | None) -> Any:
        return body


@dataclass(frozen=True)
class Call(Command):
    """A CALL: JSON arguments (the dataclass's fields), a RESULT (JSON) or MESSAGES reply. `read`
    turns the reply into the command's value; `then` (not sent) sees it first."""
    name: ClassVar[str] = ""

    def args(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("wire", True)}

    def encode(self) -> tuple[int, bytes, int]:
        return W.OP_CALL, json.dumps({"cmd": self.name, **self.args()}).encode(), 0

    def decode(self, op: int, flags: int, body: bytes, ident: str | None) -> Any:
        result = json.loads(body) if op == W.OP_RESULT else W.decode_messages(body)
        value = self.read(result, ident)
        then = getattr(self, "then", None)
        if then is not None:
            then(value)
        return value

    def read(self, result: Any, ident: str | None) -> Any:
        return result


@dataclass(frozen=True)
class AnyCall(Call):
    """`conn.cmd(name, **args)`: a CALL by name, its RESULT as a dict (MESSAGES: header, entries)."""
    cmd: str = ""
    arguments: dict = _local(None)

    @property
    def retry(self) -> bool:  # type: ignore[override]
        return self.cmd not in NOT_IDEMPOTENT

    def encode(self) -> tuple[int, bytes, int]:
        return W.OP_CALL, json.dumps({**(self.arguments or {}), "cmd": self.cmd}).encode(), 0


def records_in(result, ident: str | None) -> list[Record]:
    """The Records of a MESSAGES reply in the plain layout (admin queries)."""
    _header, raw = result
    ident = ident or ""
    return [Record(t, b, k, p, qid, qo, po, born, st, f"{ident}{po:016X}")
            for qo, po, born, st, qid, t, k, p, b in raw]


def _raw_or_plain(flags: int, body: bytes, ident: str | None) -> tuple[dict, list[Record]]:
    return (records_raw if flags & W.F_RAW else decode_messages)(ident, body)


# -- reads ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pull(Command):
    """PULL of one ConsumeQueue from `offset` -> PullResult (the raw reply layout welcome)."""
    topic: str
    queue_id: int = 0
    offset: int = 0
    max_count: int = 256
    max_bytes: int = 4 << 20

    def encode(self) -> tuple[int, bytes, int]:
        return W.OP_PULL, W.encode_pull(self.topic, self.queue_id, self.offset, self.max_count, self.max_bytes), \
            W.F_RAW_OK

    def decode(self, op: int, flags: int, body: bytes, ident: str | None) -> PullResult:
        return pull_result(ident, body, flags)


# -- admin ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Topics(Call):
    """[{topic (first level), queue_id, max_offset}] of every ConsumeQueue."""
    name: ClassVar[str] = "topics"

    def read(self, result, ident):
        return result["queues"]


@dataclass(frozen=True)
class Offsets(Call):
    """(min offset, max offset) of a ConsumeQueue."""
    name: ClassVar[str] = "offsets"
    topic: str
    queue_id: int = 0

    def read(self, result, ident):
        return result["min_offset"], result["max_offset"]


@dataclass(frozen=True)
class Committed(Call):
    """A group's committed offset in a ConsumeQueue, or None."""
    name: ClassVar[str] = "committed"
    group: str
    topic: str
    queue_id: int = 0

    def read(self, result, ident):
        return result["offset"]


@dataclass(frozen=True)
class Commit(Call):
    name: ClassVar[str] = "commit"
    group: str
    topic: str
    queue_id: int
    offset: int

    def read(self, result, ident):
        return None


@dataclass(frozen=True)
class Lag(Call):
    """[{topic, queue_id, committed, max_offset, lag}] of a group."""
    name: ClassVar[str] = "lag"
    group: str

    def read(self, result, ident):
        return result["queues"]


@dataclass(frozen=True)
class Stats(Call):
    name: ClassVar[str] = "stats"


@dataclass(frozen=True)
class GetByMsgId(Call):
    """The message of a msg id, or None."""
    name: ClassVar[str] = "get_by_msg_id"
    msg_id: str

    def read(self, result, ident):
        recs = records_in(result, ident)
        return recs[0] if recs else None


@dataclass(frozen=True)
class QueryByKey(Call):
    """Messages of `topic` with `key` stored in [begin_ms, end_ms) (the key index)."""
    name: ClassVar[str] = "query_by_key"
    topic: str
    key: str
    begin_ms: int = 0
    end_ms: int = field(default_factory=lambda: int(time.time() * 1000) + 1000)
    max_count: int = 32

    def read(self, result, ident):
        return records_in(result, ident)


@dataclass(frozen=True)
class OffsetForTime(Call):
    """The first offset of a ConsumeQueue stored at or after `ts` (epoch ms)."""
    name: ClassVar[str] = "offset_for_time"
    topic: str
    queue_id: int
    ts: int

    def read(self, result, ident):
        return result["offset"]


@dataclass(frozen=True)
class PopInfo(Call):
    name: ClassVar[str] = "pop_info"
    group: str
    topic: str
    queue_id: int = 0


# -- POP --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pop(Call):
    """Records nobody else of the group holds, invisible for `invisible_ms`: -> list[Record]; `then`
    gets (records, attempts per queue offset). Not repeated on a lost connection: a pop is not
    idempotent."""
    name: ClassVar[str] = "pop"
    retry: ClassVar[bool] = False
    group: str
    topic: str
    queue_id: int
    max_count: int
    invisible_ms: int
    max_attempts: int
    raw: bool = True                 # the raw reply layout is welcome (docs/protocol.md)
    then: Callable | None = _local()

    def decode(self, op: int, flags: int, body: bytes, ident: str | None) -> list[Record]:
        header, recs = _raw_or_plain(flags, body, ident)
        if self.then is not None:
            self.then((recs, dict(zip((r.queue_offset for r in recs), header.get("attempts", ())))))
        return recs


@dataclass(frozen=True)
class Ack(Call):
    """-> how many of `offsets` were acknowledged."""
    name: ClassVar[str] = "ack"
    group: str
    topic: str
    queue_id: int
    offsets: list

    def read(self, result, ident):
        return result["acked"]


@dataclass(frozen=True)
class ChangeInvisibleTime(Call):
    name: ClassVar[str] = "change_invisible_time"
    group: str
    topic: str
    queue_id: int
    offset: int
    invisible_ms: int

    def read(self, result, ident):
        return result["ok"]


# -- a filter's history and live tail ---------------------------------------------------------------
@dataclass(frozen=True)
class Subscribe(Call):
    """Register `filter` with the store (persisted), like an MQTT SUBSCRIBE."""
    name: ClassVar[str] = "subscribe"
    retry: ClassVar[bool] = False
    filter: str


@dataclass(frozen=True)
class FilterPosition(Call):
    """Where a filter consumer starts: {position, lq_offset}; `then` gets it."""
    name: ClassVar[str] = "filter_position"
    filter: str
    group: str | None = None
    start: str | None = None
    since: int | None = None
    then: Callable | None = _local()

    def args(self) -> dict:
        return {k: v for k, v in super().args().items() if v is not None or k in ("filter",)}


@dataclass(frozen=True)
class FilterRead(Call):
    """The next records matching `filter` from CommitLog position `position` -> list[Record];
    `then` gets (header, records)."""
    name: ClassVar[str] = "filter_read"
    filter: str
    position: int
    max_count: int = 256
    hint: int | None = None
    then: Callable | None = _local()

    def decode(self, op: int, flags: int, body: bytes, ident: str | None) -> list[Record]:
        header, recs = _raw_or_plain(flags, body, ident)
        if self.then is not None:
            self.then((header, recs))
        return recs


@dataclass(frozen=True)
class FilterCommit(Call):
    name: ClassVar[str] = "filter_commit"
    group: str
    filter: str
    position: int | None = None
    last: Any = None
    lq_offset: int | None = None

    def args(self) -> dict:
        a: dict[str, Any] = {"group": self.group, "filter": self.filter}
        if self.lq_offset is not None:
            a["lq_offset"] = self.lq_offset
        else:
            a.update(position=self.position, last=self.last)
        return a

    def read(self, result, ident):
        return None


# -- delayed messages -------------------------------------------------------------------------------
@dataclass(frozen=True)
class CancelDelayed(Call):
    """-> True when the delayed message was pending and will not fire."""
    name: ClassVar[str] = "cancel_delayed"
    msg_id: str

    def read(self, result, ident):
        return bool(result["cancelled"])
