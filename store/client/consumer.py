"""Consumers: by topic/queue/offset (`pull`, `PullConsumer` with committed group offsets), by MQTT
topic filter (`FilterConsumer`: a filter's history and live tail), and POP (`PopConsumer`).

Records are `Record` named tuples; `.mqtt` decodes the MQTT metadata (QoS, retain, MQTT 5
properties) of records written by the gateway or by an SDK producer (docs/sdk.md).
"""
from __future__ import annotations

import json
import struct
from typing import TYPE_CHECKING, NamedTuple

from lmqtt.store import accel, protocol as W
from lmqtt.store.client.props import MessageProperties, decode as decode_props
from lmqtt.store.record import HEADER as _CLOG_HEAD, HEADER_FIELDS as _CLOG_FIELDS, HEADER_SIZE as _CLOG_HEAD_SIZE

from .errors import ConnectionLost, StoreClientError

if TYPE_CHECKING:
    from .connection import Connection


class Record(NamedTuple):
    topic: str
    body: bytes
    keys: tuple
    props: bytes
    queue_id: int
    queue_offset: int     # ConsumeQueue offset (of the first-level topic's queue)
    offset: int           # physical CommitLog offset
    born_ts: int
    store_ts: int
    msg_id: str

    @property
    def mqtt(self) -> MessageProperties:
        """QoS, retain, MQTT 5 properties; foreign props decode as plain QoS 0."""
        try:
            return decode_props(self.props)
        except ValueError:
            return MessageProperties()


class PullResult(NamedTuple):
    records: list
    next_offset: int
    header: dict


def decode_messages(ident: str | None, body: bytes) -> tuple[dict, list[Record]]:
    header, raw = W.decode_messages(body)
    ident = ident or ""
    return header, [Record(t, b, k, p, qid, qo, po, born, st, f"{ident}{po:016X}")
                    for qo, po, born, st, qid, t, k, p, b in raw]


_U32 = struct.Struct(">I").unpack_from
_NEW = tuple.__new__

# What the C twin of the loop in records_raw reads and builds, handed over at import: the record
# head from store/record.py and (as configure's first argument) `Record`, whose `_fields` it
# checks against the order it fills. store/client/_records.c refuses a layout whose field offsets
# differ from the ones it reads (ValueError naming the field: rebuild the extension) and decodes
# nothing until configured.
C_LAYOUT = {"header_format": _CLOG_HEAD.format, "header_fields": _CLOG_FIELDS, "header_size": _CLOG_HEAD_SIZE}


def configure_c(mod, record_type=Record, layout: dict = C_LAYOUT) -> None:
    """Hand `Record` and the record head layout to the C decoder `mod`; ValueError when either is
    not what its loop reads and fills."""
    mod.configure(record_type, layout)


_C_RECORDS = accel.load("lmqtt.store.client._records")    # C twin of the loop in records_raw
if _C_RECORDS is not None:
    configure_c(_C_RECORDS)


def records_raw(ident: str | None, body: bytes) -> tuple[dict, list[Record]]:
    """Decode a MESSAGES body in the raw layout (flag F_RAW): the CommitLog's own records
    (docs/store.md: the little-endian head of store/record.py's HEADER, then topic, keys, dispatch
    queues, props, body). The store checked each record's CRC before sending it. Topic strings and
    props are decoded once per distinct value in the reply and shared by the records that carry
    them."""
    try:
        (hl,) = _U32(body, 0)
        header = json.loads(body[4:4 + hl]) if hl else {}
        pos = 4 + hl
        (count,) = _U32(body, pos)
        pos += 4
        ident = ident or ""
        if _C_RECORDS is not None:
            return header, _C_RECORDS.decode(body, pos, count, ident)
        unpack = _CLOG_HEAD.unpack_from
        hs = _CLOG_HEAD.size
        topics: dict[bytes, str] = {}
        props_seen: dict[bytes, bytes] = {}
        out = []
        append = out.append
        n = len(body)
        for _ in range(count):
            total, _magic, _crc, qid, _fl, qo, po, born, st, _tags, bl, pl, tl, kl, dl = unpack(body, pos)
            end = pos + total
            if end > n or total != hs + tl + kl + dl + pl + bl:
                raise ValueError(f"record at {pos} of {total} bytes does not fit its fields")
            p = pos + hs
            tb = body[p:p + tl]
            topic = topics.get(tb)
            if topic is None:
                topic = topics[tb] = tb.decode()
            p += tl
            keys = tuple(body[p:p + kl].decode().split("\x00")) if kl else ()
            p += kl + dl
            props = body[p:p + pl]
            props = props_seen.setdefault(props, props)
            append(_NEW(Record, (topic, body[p + pl:end], keys, props, qid, qo, po, born, st,
                                 f"{ident}{po:016X}")))            # in Record._fields order
            pos = end
        return header, out
    except (struct.error, ValueError) as e:
        raise W.ProtocolError(W.E_BAD_FRAME, f"raw MESSAGES body malformed: {e}") from None


def decode_reply(ident: str | None, body: bytes, flags: int = 0) -> tuple[dict, list[Record]]:
    """(header, Records) of a MESSAGES body in either layout (`flags`: the frame's, F_RAW = raw)."""
    return (records_raw if flags & W.F_RAW else decode_messages)(ident, body)


def pull_result(ident, body: bytes, flags: int = 0) -> PullResult:
    header, recs = (records_raw if flags & W.F_RAW else decode_messages)(ident, body)
    return PullResult(recs, header.get("next_offset", 0), header)


def pull(conn: Connection, topic: str, queue_id: int = 0, offset: int = 0, max_count: int = 256,
         max_bytes: int = 4 << 20) -> PullResult:
    """Read the ConsumeQueue of `topic`'s first level from `offset` (clamped to the queue's min)."""
    _op, flags, body = conn.call(W.OP_PULL, W.encode_pull(topic, queue_id, offset, max_count, max_bytes),
                                 retry=True, flags=W.F_RAW_OK)
    return pull_result(conn.ident, body, flags)


class PendingPull:
    """A PULL already sent (`Connection.pull_request`); `result()` waits for it and decodes it.

    Why: a consumer that asks for the next records before working on the current ones keeps the
    store busy while it decodes and processes (store and client run in parallel instead of taking
    turns). The reply is decoded in the thread that calls `result()`, not in the reader thread. A
    connection lost meanwhile is retried once by `result()` with a plain, waiting pull."""

    __slots__ = ("conn", "args", "fut")

    def __init__(self, conn: Connection, topic: str, queue_id: int, offset: int, max_count: int,
                 max_bytes: int) -> None:
        self.conn = conn
        self.args = (topic, queue_id, offset, max_count, max_bytes)
        try:
            self.fut = conn.request(W.OP_PULL, W.encode_pull(topic, queue_id, offset, max_count, max_bytes),
                                    W.F_RAW_OK)
        except ConnectionLost:
            self.fut = None

    def result(self, timeout: float | None = None) -> PullResult:
        if self.fut is None:
            return pull(self.conn, *self.args)
        try:
            op, flags, body = self.fut.result(self.conn.timeout if timeout is None else timeout)
        except ConnectionLost:
            return pull(self.conn, *self.args)
        if op == W.OP_ERROR:
            raise StoreClientError(*W.parse_error(body))
        return pull_result(self.conn.ident, body, flags)


def check_start(start: str) -> str:
    """A consumer group's `start`: "earliest" or "latest"; anything else (a typo) is refused, never
    read as "earliest"."""
    if start not in ("earliest", "latest"):
        raise ValueError(f"start must be 'earliest' or 'latest', got {start!r}")
    return start


class PullConsumer:
    """A consumer-group member reading one ConsumeQueue; offsets are kept by the store.

    `poll()` returns the next records after the group's committed offset (or `start`: "earliest" /
    "latest" when the group has none) and remembers where it got to; `commit()` stores that
    position (survives a store restart). At-least-once: commit after processing.

    `prefetch` (default on): when a poll returned records, the pull for the next ones is sent at
    once, so the store reads them while the application works on these (the next poll then
    usually finds them there). Setting `position` by hand drops a prefetched reply that does not
    start there."""

    def __init__(self, conn: Connection, topic: str, group: str, queue_id: int = 0, *, start: str = "earliest",
                 max_count: int = 256, prefetch: bool = True) -> None:
        check_start(start)
        self.conn, self.topic, self.group, self.queue_id = conn, topic, group, queue_id
        self.max_count = max_count
        self.prefetch = prefetch
        self._ahead: PendingPull | None = None
        c = conn.cmd("committed", group=group, topic=topic, queue_id=queue_id)["offset"]
        if c is None:
            o = conn.cmd("offsets", topic=topic, queue_id=queue_id)
            c = o["max_offset"] if start == "latest" else o["min_offset"]
        self.position = c

    def poll(self) -> list[Record]:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.args[2] == self.position and ahead.args[3] == self.max_count:
            r = ahead.result()
        else:
            r = pull(self.conn, self.topic, self.queue_id, self.position, self.max_count)
        self.position = r.next_offset
        if self.prefetch and r.records:
            self._ahead = PendingPull(self.conn, self.topic, self.queue_id, self.position, self.max_count, 4 << 20)
        return r.records

    def commit(self, offset: int | None = None) -> None:
        self.conn.cmd("commit", group=self.group, topic=self.topic, queue_id=self.queue_id,
                      offset=self.position if offset is None else offset)


class FilterConsumer:
    """Every stored message whose topic matches the MQTT filter `topic_filter` (wildcards
    included), whether or not the filter was held when it was written, then the new ones as they
    come: the filter's history and its live tail are one read (lightqueue/history.py, docs/sdk.md
    "Reading a filter's history"), served from the filter's light queue where it covers and from
    its first-level topic's ConsumeQueues before that. Creating it registers the filter with the
    store (persisted), like an MQTT SUBSCRIBE, so the light queue serves the live part.

    Where it starts: `since` (epoch ms; outside retention: StoreClientError `invalid`), else a
    group's committed position, else `start`: "earliest" (the oldest stored message) or "latest"
    (only what comes next). `seek(...)` moves it later the same ways.

    Position: `log_position` is a CommitLog position: every matching message stored below it has
    been returned. It is what a group commits (`commit()`, or `commit(record)`: through that
    record), so a group resumes exactly after what it committed whether or not the filter's light
    queue still exists. `position` is the light-queue offset of the same point when the light
    queue covers it (None while reading the history before it). Records come in CommitLog order
    (the publish order of each topic); `Record.queue_offset` is the ConsumeQueue offset and
    `Record.offset` the CommitLog offset."""

    def __init__(self, conn: Connection, topic_filter: str, group: str | None = None, *,
                 start: str = "latest", max_count: int = 256, since: int | None = None) -> None:
        self.conn, self.filter, self.group = conn, topic_filter, group
        self.max_count = max_count
        self._hint = None
        self._last = None
        conn.cmd("subscribe", filter=topic_filter)
        self._place(conn.cmd("filter_position", filter=topic_filter, group=group, start=start,
                             since=None if since is None else int(since)))

    def _place(self, r: dict) -> None:
        self.log_position = int(r["position"])
        self.position = r.get("lq_offset")
        self._hint = self.position
        self._last = None

    def seek(self, start: str | int) -> None:
        """Go on from "earliest", "latest" or a time (epoch ms)."""
        if isinstance(start, str):
            r = self.conn.cmd("filter_position", filter=self.filter, start=start)
        else:
            r = self.conn.cmd("filter_position", filter=self.filter, since=int(start))
        self._place(r)

    def _args(self) -> bytes:
        return json.dumps({"cmd": "filter_read", "filter": self.filter, "position": self.log_position,
                           "max_count": self.max_count, "hint": self._hint}).encode()

    def _took(self, flags: int, body: bytes) -> list[Record]:
        header, recs = (records_raw if flags & W.F_RAW else decode_messages)(self.conn.ident, body)
        self.log_position = int(header["position"])
        self._hint = header.get("hint")
        self.position = self._hint
        if recs:
            self._last = (recs[-1].offset, recs[-1].store_ts)
        return recs

    def poll(self) -> list[Record]:
        """The next matching records (possibly none: the history may be a stretch of other topics)."""
        for _ in range(8):
            before = self.log_position
            _op, flags, body = self.conn.call(W.OP_CALL, self._args(), retry=True)
            recs = self._took(flags, body)
            if recs or self.log_position == before:
                return recs
        return []

    def commit(self, offset=None) -> None:
        """Commit the group's position: after the last poll (None), through `offset` when it is a
        Record, or a light-queue offset (an int, as before CommitLog positions)."""
        if not self.group:
            raise ValueError("FilterConsumer without a group has nothing to commit to")
        self.conn.cmd("filter_commit", **commit_args(self, offset))


def commit_args(fc, offset) -> dict:
    a = {"group": fc.group, "filter": fc.filter}
    if offset is None:
        a.update(position=fc.log_position, last=fc._last)
    elif isinstance(offset, Record):
        a.update(position=offset.offset + 1, last=(offset.offset, offset.store_ts))
    else:
        a.update(lq_offset=int(offset))
    return a


class PopConsumer:
    """POP consumption (as RocketMQ's POP consumption does): many stateless members of `group`
    share a queue without rebalancing. `pop()` returns records nobody else holds, invisible for
    `invisible_ms`; `ack()` removes them; un-acked ones come back after the invisible time; after
    `max_attempts` deliveries a record goes to the dead-letter topic `%DLQ%<group>`.
    `record.queue_offset` is the receipt to ack."""

    def __init__(self, conn: Connection, topic: str, group: str, queue_id: int = 0, *,
                 invisible_ms: int = 30_000, max_attempts: int = 16) -> None:
        self.conn, self.topic, self.group, self.queue_id = conn, topic, group, queue_id
        self.invisible_ms, self.max_attempts = invisible_ms, max_attempts
        self.last_attempts: dict[int, int] = {}

    def pop(self, max_count: int = 32) -> list[Record]:
        args = {"cmd": "pop", "group": self.group, "topic": self.topic, "queue_id": self.queue_id,
                "max_count": max_count, "invisible_ms": self.invisible_ms, "max_attempts": self.max_attempts,
                "raw": True}         # the raw reply layout is welcome (docs/protocol.md); not retried: pop
        _op, flags, body = self.conn.call(W.OP_CALL, json.dumps(args).encode())    # is not idempotent
        header, recs = (records_raw if flags & W.F_RAW else decode_messages)(self.conn.ident, body)
        self.last_attempts = dict(zip((r.queue_offset for r in recs), header.get("attempts", ())))
        return recs

    def ack(self, records) -> int:
        offs = [r.queue_offset if isinstance(r, Record) else int(r) for r in records]
        return self.conn.cmd("ack", group=self.group, topic=self.topic, queue_id=self.queue_id, offsets=offs)["acked"]

    def change_invisible_time(self, record, invisible_ms: int) -> bool:
        off = record.queue_offset if isinstance(record, Record) else int(record)
        return self.conn.cmd("change_invisible_time", group=self.group, topic=self.topic, queue_id=self.queue_id,
                             offset=off, invisible_ms=invisible_ms)["ok"]
