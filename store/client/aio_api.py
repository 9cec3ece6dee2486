"""The asyncio command API over `AsyncConnection` (aio.py): the same producer and consumers as the
sync SDK (producer.py, consumer.py), for services written with asyncio.

    from lmqtt.store.client import connect_async
    c = await connect_async("127.0.0.1:10911")
    p = c.producer()                                       # AsyncProducer
    await p.send("sensors/a/temp", b"21.5")               # returns once durable
    await p.send_batch([("sensors/a/temp", b"21.6"), ("sensors/b/temp", b"19.0")])
    dash = await c.filter_consumer("sensors/+/temp", group="dash")
    for rec in await dash.poll(): ...
    await dash.commit()

Behaviour, arguments and guarantees are those of the sync classes (their docstrings say why);
only the waiting differs. What is not I/O is shared with them: record decoding (consumer.py),
batch packing and the dedup frame (producer.py). Requests of one connection are pipelined, so
several tasks can share a connection and its producer.
"""
from __future__ import annotations

import itertools
import json
import time
import uuid

from .. import protocol as W
from .consumer import Record, _pull_result, _records, _records_raw
from .producer import SendResult, _delayed_frame, _pack_one, due_ms, pack_batch


class AsyncProducer:
    """Producer (producer.py) on an AsyncConnection: every batch carries the producer id and a
    sequence number, so a send retried after a lost connection is stored once (the store
    deduplicates)."""

    def __init__(self, conn, producer_id: str | None = None) -> None:
        self.conn = conn
        self.producer_id = producer_id or uuid.uuid4().hex
        self._seq = itertools.count(time.time_ns() // 1000)    # grows across restarts (Producer)
        self._heads: dict[tuple[str, int], bytes] = {}

    def _results(self, body: bytes) -> list[SendResult]:
        ident = self.conn.ident
        return [SendResult(f"{ident}{p:016X}", p, q) for p, q in W.decode_produced(body)]

    async def send_packed(self, count: int, packed: bytes, due: list[int] | None = None) -> list[SendResult]:
        frame, flags = _delayed_frame(W.encode_produce(self.producer_id, next(self._seq), count, packed), due)
        _op, _f, body = await self.conn.call(W.OP_PRODUCE, frame, retry=True, flags=flags)
        return self._results(body)

    async def send(self, topic: str, body: bytes, *, delay: float | None = None, deliver_at=None,
                   **kw) -> SendResult:
        d = due_ms(delay, deliver_at) if delay is not None or deliver_at is not None else 0
        return (await self.send_packed(1, _pack_one(topic, body, **kw), [d] if d else None))[0]

    async def send_batch(self, messages) -> list[SendResult]:
        """(topic, body) pairs or dicts with send()'s keywords: one frame, all stored or none."""
        n, packed, dues = pack_batch(self._heads, messages)
        return await self.send_packed(n, packed, dues)

    async def cancel_delayed(self, msg_id: str) -> bool:
        return bool((await self.conn.cmd("cancel_delayed", msg_id=msg_id))["cancelled"])


class AsyncPullConsumer:
    """PullConsumer (consumer.py): a consumer-group member on one ConsumeQueue. Create it with
    `await AsyncConnection.consumer(...)` (the group's committed offset is read first)."""

    def __init__(self, conn, topic: str, group: str, queue_id: int = 0, *, max_count: int = 256) -> None:
        self.conn, self.topic, self.group, self.queue_id = conn, topic, group, queue_id
        self.max_count = max_count
        self.position = 0

    async def _start(self, start: str) -> "AsyncPullConsumer":
        c = (await self.conn.cmd("committed", group=self.group, topic=self.topic, queue_id=self.queue_id))["offset"]
        if c is None:
            o = await self.conn.cmd("offsets", topic=self.topic, queue_id=self.queue_id)
            c = o["max_offset"] if start == "latest" else o["min_offset"]
        self.position = c
        return self

    async def poll(self) -> list[Record]:
        _op, flags, body = await self.conn.call(
            W.OP_PULL, W.encode_pull(self.topic, self.queue_id, self.position, self.max_count, 4 << 20),
            retry=True, flags=W.F_RAW_OK)
        r = _pull_result(self.conn.ident, body, flags)
        self.position = r.next_offset
        return r.records

    async def commit(self, offset: int | None = None) -> None:
        await self.conn.cmd("commit", group=self.group, topic=self.topic, queue_id=self.queue_id,
                            offset=self.position if offset is None else offset)


class AsyncFilterConsumer:
    """FilterConsumer (consumer.py): what an MQTT subscriber of `topic_filter` sees, wildcards
    included; `since` (epoch ms) first replays the stored history. Create it with `await
    AsyncConnection.filter_consumer(...)` (that registers the filter, like a SUBSCRIBE)."""

    def __init__(self, conn, topic_filter: str, group: str | None = None, *, max_count: int = 256) -> None:
        self.conn, self.filter, self.group = conn, topic_filter, group
        self.max_count = max_count
        self.position = 0
        self._history = None

    async def _start(self, start: str, since: int | None) -> "AsyncFilterConsumer":
        info = await self.conn.cmd("subscribe", filter=self.filter)
        if since is not None:
            plan = await self.conn.cmd("replay", filter=self.filter, since=int(since))
            self.position = int(plan["live_offset"])
            self._history = plan.get("cursor")
            return self
        pos = None
        if self.group:
            pos = (await self.conn.cmd("committed", group=self.group, filter=self.filter))["offset"]
        if pos is None:
            pos = info["max_offset"] if start == "latest" else info["min_offset"]
        self.position = pos
        return self

    async def poll(self) -> list[Record]:
        for _ in range(8):           # the history first (bounded: a stretch of other topics)
            if self._history is None:
                break
            args = {"cmd": "replay_read", "cursor": self._history, "max_count": self.max_count}
            _op, _f, body = await self.conn.call(W.OP_CALL, json.dumps(args).encode(), retry=True)
            header, recs = _records(self.conn.ident, body)
            self._history = None if header.get("done") else header["cursor"]
            if recs:
                return recs
        else:
            return []
        _op, _f, body = await self.conn.call(
            W.OP_PULL_FILTER, W.encode_pull(self.filter, 0, self.position, self.max_count, 4 << 20), retry=True)
        header, recs = _records(self.conn.ident, body)
        self.position = header.get("next_offset", self.position)
        return recs

    async def commit(self, offset: int | None = None) -> None:
        if not self.group:
            raise ValueError("a filter consumer without a group has nothing to commit to")
        await self.conn.cmd("commit", group=self.group, filter=self.filter,
                            offset=self.position if offset is None else offset)


class AsyncPopConsumer:
    """PopConsumer (consumer.py): stateless members of a group share a queue; popped records are
    invisible for `invisible_ms`, `ack` removes them, after `max_attempts` they go to `%DLQ%<group>`."""

    def __init__(self, conn, topic: str, group: str, queue_id: int = 0, *,
                 invisible_ms: int = 30_000, max_attempts: int = 16) -> None:
        self.conn, self.topic, self.group, self.queue_id = conn, topic, group, queue_id
        self.invisible_ms, self.max_attempts = invisible_ms, max_attempts
        self.last_attempts: dict[int, int] = {}

    async def pop(self, max_count: int = 32) -> list[Record]:
        args = {"cmd": "pop", "group": self.group, "topic": self.topic, "queue_id": self.queue_id,
                "max_count": max_count, "invisible_ms": self.invisible_ms, "max_attempts": self.max_attempts,
                "raw": True}
        _op, flags, body = await self.conn.call(W.OP_CALL, json.dumps(args).encode())   # not idempotent
        header, recs = (_records_raw if flags & W.F_RAW else _records)(self.conn.ident, body)
        self.last_attempts = dict(zip((r.queue_offset for r in recs), header.get("attempts", ())))
        return recs

    async def ack(self, records) -> int:
        offs = [r.queue_offset if isinstance(r, Record) else int(r) for r in records]
        return (await self.conn.cmd("ack", group=self.group, topic=self.topic, queue_id=self.queue_id,
                                    offsets=offs))["acked"]

    async def change_invisible_time(self, record, invisible_ms: int) -> bool:
        off = record.queue_offset if isinstance(record, Record) else int(record)
        return (await self.conn.cmd("change_invisible_time", group=self.group, topic=self.topic,
                                    queue_id=self.queue_id, offset=off, invisible_ms=invisible_ms))["ok"]


__all__ = ["AsyncProducer", "AsyncPullConsumer", "AsyncFilterConsumer", "AsyncPopConsumer"]
