"""Consumers: by topic/queue/offset (`pull`, `PullConsumer` with committed group offsets), by MQTT
topic filter (`FilterConsumer`: a filter's history and live tail), and POP (`PopConsumer`).

Each request is a command of the command layer (commands.py) sent with `conn.execute`: a method
that only sends one (`commit`, `seek`, `pop`, `ack`, ...) is written once and serves the sync
`Connection` (its value) and the `AsyncConnection` (a coroutine of it); the asyncio consumers
(aio_api.py) add only what awaits more than one request (`start`, `poll`).

Records are `Record` named tuples (records.py); `.mqtt` decodes the MQTT metadata (QoS, retain,
MQTT 5 properties) of records written by the gateway or by an SDK producer (docs/sdk.md).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from lmqtt.store import protocol as W

from .commands import (
    Ack,
    ChangeInvisibleTime,
    Commit,
    Committed,
    FilterCommit,
    FilterPosition,
    FilterRead,
    Offsets,
    Pop,
    Pull,
    Subscribe,
)
from .errors import ConnectionLost, StoreClientError

# the records and their decoders (records.py), importable from here as before
from .records import PullResult, Record, decode_messages, decode_reply, pull_result, records_raw

if TYPE_CHECKING:
    from .connection import Connection

__all__ = ["FilterConsumer", "PendingPull", "PopConsumer", "PullConsumer", "PullResult", "Record", "check_start",
           "decode_messages", "decode_reply", "pull", "pull_result", "records_raw"]


def pull(conn: Connection, topic: str, queue_id: int = 0, offset: int = 0, max_count: int = 256,
         max_bytes: int = 4 << 20) -> PullResult:
    """Read the ConsumeQueue of `topic`'s first level from `offset` (clamped to the queue's min)."""
    return conn.execute(Pull(topic, queue_id, offset, max_count, max_bytes))


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

    opens_now = True                 # the constructor reads the group's committed offset

    def __init__(self, conn: Connection, topic: str, group: str, queue_id: int = 0, *, start: str = "earliest",
                 max_count: int = 256, prefetch: bool = True) -> None:
        check_start(start)
        self.conn, self.topic, self.group, self.queue_id = conn, topic, group, queue_id
        self.max_count = max_count
        self.prefetch = prefetch
        self._ahead: PendingPull | None = None
        self.position = 0
        if self.opens_now:           # the asyncio consumer (aio_api.py) reads it in `start`
            c = conn.execute(Committed(group, topic, queue_id))
            if c is None:
                lo, hi = conn.execute(Offsets(topic, queue_id))
                c = hi if start == "latest" else lo
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

    def commit(self, offset: int | None = None):
        """Store the group's position: after the last poll, or `offset`."""
        return self.conn.execute(Commit(self.group, self.topic, self.queue_id,
                                        self.position if offset is None else offset))


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

    opens_now = True                 # the constructor registers the filter and finds where to start

    def __init__(self, conn: Connection, topic_filter: str, group: str | None = None, *,
                 start: str = "latest", max_count: int = 256, since: int | None = None) -> None:
        self.conn, self.filter, self.group = conn, topic_filter, group
        self.max_count = max_count
        self.position = None
        self.log_position = 0
        self._hint = None
        self._last = None
        if self.opens_now:           # the asyncio consumer (aio_api.py) does this in `start`
            conn.execute(Subscribe(topic_filter))
            conn.execute(self._where(start, since, group))

    def _where(self, start: str | None, since: int | None, group: str | None = None) -> FilterPosition:
        return FilterPosition(self.filter, group, start if since is None else None,
                              None if since is None else int(since), then=self._place)

    def _place(self, r: dict) -> None:
        self.log_position = int(r["position"])
        self.position = r.get("lq_offset")
        self._hint = self.position
        self._last = None

    def seek(self, start: str | int):
        """Go on from "earliest", "latest" or a time (epoch ms)."""
        if isinstance(start, str):
            return self.conn.execute(self._where(start, None))
        return self.conn.execute(self._where(None, int(start)))

    def _read(self) -> FilterRead:
        return FilterRead(self.filter, self.log_position, self.max_count, self._hint, then=self._took)

    def _took(self, reply: tuple[dict, list[Record]]) -> None:
        header, recs = reply
        self.log_position = int(header["position"])
        self._hint = header.get("hint")
        self.position = self._hint
        if recs:
            self._last = (recs[-1].offset, recs[-1].store_ts)

    def poll(self) -> list[Record]:
        """The next matching records (possibly none: the history may be a stretch of other topics)."""
        for _ in range(8):
            before = self.log_position
            recs = self.conn.execute(self._read())
            if recs or self.log_position == before:
                return recs
        return []

    def commit(self, offset=None):
        """Commit the group's position: after the last poll (None), through `offset` when it is a
        Record, or a light-queue offset (an int, as before CommitLog positions)."""
        if not self.group:
            raise ValueError("FilterConsumer without a group has nothing to commit to")
        if offset is None:
            return self.conn.execute(FilterCommit(self.group, self.filter, self.log_position, self._last))
        if isinstance(offset, Record):
            return self.conn.execute(FilterCommit(self.group, self.filter, offset.offset + 1,
                                                  (offset.offset, offset.store_ts)))
        return self.conn.execute(FilterCommit(self.group, self.filter, lq_offset=int(offset)))


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

    def pop(self, max_count: int = 32):
        """Records nobody else of the group holds, invisible for `invisible_ms`; `last_attempts`:
        how often each (by queue offset) was delivered."""
        return self.conn.execute(Pop(self.group, self.topic, self.queue_id, max_count, self.invisible_ms,
                                     self.max_attempts, then=self._popped))

    def _popped(self, reply: tuple[list[Record], dict[int, int]]) -> None:
        self.last_attempts = reply[1]

    def ack(self, records):
        """-> how many of `records` (Records or queue offsets) were acknowledged."""
        offs = [r.queue_offset if isinstance(r, Record) else int(r) for r in records]
        return self.conn.execute(Ack(self.group, self.topic, self.queue_id, offs))

    def change_invisible_time(self, record, invisible_ms: int):
        off = record.queue_offset if isinstance(record, Record) else int(record)
        return self.conn.execute(ChangeInvisibleTime(self.group, self.topic, self.queue_id, off, invisible_ms))
