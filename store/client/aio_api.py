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

import asyncio
import itertools
import time
import uuid

from .. import protocol as W
from .admin import Admin
from .commands import Committed, Offsets, Pull, Subscribe
from .consumer import FilterConsumer, PopConsumer, PullConsumer, Record, check_start
from .producer import PRODUCED_AT, SendResult, delayed_frame, due_ms, pack_batch, pack_one, queued_parts


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
        frame, flags = delayed_frame(W.encode_produce(self.producer_id, next(self._seq), count, packed), due)
        _op, _f, body = await self.conn.call(W.OP_PRODUCE, frame, retry=True, flags=flags)
        return self._results(body)

    async def send(self, topic: str, body: bytes, *, delay: float | None = None, deliver_at=None,
                   **kw) -> SendResult:
        d = due_ms(delay, deliver_at) if delay is not None or deliver_at is not None else 0
        return (await self.send_packed(1, pack_one(topic, body, **kw), [d] if d else None))[0]

    async def send_batch(self, messages) -> list[SendResult]:
        """(topic, body) pairs or dicts with send()'s keywords: one frame, all stored or none."""
        n, packed, dues = pack_batch(self._heads, messages)
        return await self.send_packed(n, packed, dues)

    async def cancel_delayed(self, msg_id: str) -> bool:
        return bool((await self.conn.cmd("cancel_delayed", msg_id=msg_id))["cancelled"])


class _AsyncBatch:
    """Messages packed for one PRODUCE frame; `future` resolves to the PRODUCED body (or the error)."""

    __slots__ = ("parts", "count", "nbytes", "future", "ident", "count_in_reply", "dues")

    def __init__(self, loop) -> None:
        self.parts: list[bytes] = []
        self.count = 0
        self.nbytes = 0
        self.dues: list[int] | None = None
        self.future: asyncio.Future = loop.create_future()
        self.ident = ""
        self.count_in_reply = 0


class AsyncSendHandle:
    """What `AsyncAutoBatchProducer.send()` returns: `await handle` gives the message's
    SendResult once its batch is acknowledged (None for a batch the store recognised as a
    duplicate older than its dedup window), or raises the batch's error. One asyncio future per
    batch, not per message (producer.py `SendFuture` says why); nothing is decoded for messages
    nobody awaits."""

    __slots__ = ("_batch", "_index")

    def __init__(self, batch: _AsyncBatch, index: int) -> None:
        self._batch = batch
        self._index = index

    def __await__(self):
        return self._result().__await__()

    async def _result(self) -> SendResult | None:
        b = self._batch
        body = await asyncio.shield(b.future)
        if b.count_in_reply != b.count:
            return None
        phys, qoff = PRODUCED_AT(body, 4 + 16 * self._index)
        return SendResult(f"{b.ident}{phys:016X}", phys, qoff)

    def done(self) -> bool:
        return self._batch.future.done()


class AsyncAutoBatchProducer:
    """AutoBatchProducer (producer.py) for asyncio services: `await send()` only queues (it waits
    only while `max_memory` bytes are queued or in flight: back-pressure, never unbounded memory)
    and returns an `AsyncSendHandle`; a task flushes the queue as ONE PRODUCE frame when
    `batch_bytes` are queued or `linger_ms` passed since the first message, with up to
    `max_in_flight` frames awaiting the store at once. `await flush()` waits for everything sent so
    far and raises the first failure since the previous flush; `acknowledged` counts the messages
    the store has acknowledged. Every frame carries the producer id and its own sequence, and a
    frame whose connection was lost is re-sent as is (AsyncConnection.call with retry), so it is
    stored once.

        async with conn.auto_batch_producer() as p:
            for reading in readings:
                await p.send("sensors/a/temp", reading)
        # leaving the block flushed and stopped it; failures were raised
    """

    def __init__(self, conn, producer_id: str | None = None, *, batch_bytes: int = 256 << 10,
                 linger_ms: float = 5.0, max_memory: int = 32 << 20, max_in_flight: int = 4) -> None:
        self.p = AsyncProducer(conn, producer_id)
        self.conn = conn
        self.batch_bytes = batch_bytes
        self.linger = linger_ms / 1000.0
        self.max_memory = max_memory
        self.acknowledged = 0
        self._loop = asyncio.get_running_loop()
        self._batch = _AsyncBatch(self._loop)
        self._first = 0.0
        self._mem = 0
        self._closed = False
        self._error: BaseException | None = None
        self._inflight = asyncio.Semaphore(max_in_flight)
        self._sending: set[asyncio.Task] = set()
        self._wake = asyncio.Event()          # a batch is full, or flush/close asked for it now
        self._room = asyncio.Condition()      # memory was released
        self._heads: dict[tuple[str, int], bytes] = {}
        self._task = self._loop.create_task(self._run(), name="lmqtt-aio-autobatch")

    async def send(self, topic: str, body: bytes, **kw) -> AsyncSendHandle:
        """Queue one message (AsyncProducer.send()'s keywords, `delay`/`deliver_at` included)."""
        head, body, due = queued_parts(self._heads, topic, body, kw)
        n = len(head) + len(body)
        if self._closed:
            raise RuntimeError("AsyncAutoBatchProducer is closed")
        if self._mem + n > self.max_memory and self._mem:
            async with self._room:
                await self._room.wait_for(lambda: not (self._mem + n > self.max_memory and self._mem))
        b = self._batch
        if not b.count:
            self._first = time.monotonic()
        b.parts.append(head)
        if body:
            b.parts.append(body)
        i = b.count
        if due or b.dues is not None:
            if b.dues is None:
                b.dues = [0] * i
            b.dues.append(due)
        b.count = i + 1
        b.nbytes += n
        self._mem += n
        if b.nbytes >= self.batch_bytes:
            self._wake.set()
        return AsyncSendHandle(b, i)

    async def _run(self) -> None:
        while True:
            b = self._batch
            if not b.count:
                if self._closed:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            left = self._first + self.linger - time.monotonic()
            if b.nbytes < self.batch_bytes and not self._closed and left > 0 and not self._wake.is_set():
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except asyncio.TimeoutError:
                    pass
                continue
            self._wake.clear()
            self._batch = _AsyncBatch(self._loop)
            await self._inflight.acquire()
            t = self._loop.create_task(self._send(b))
            self._sending.add(t)
            t.add_done_callback(self._sending.discard)

    async def _send(self, b: _AsyncBatch) -> None:
        ok = 0
        try:
            frame, flags = delayed_frame(W.encode_produce(self.p.producer_id, next(self.p._seq), b.count,
                                                           b"".join(b.parts)), b.dues)
            b.parts = None
            _op, _f, body = await self.conn.call(W.OP_PRODUCE, frame, retry=True, flags=flags)
            b.ident = self.conn.ident or ""
            b.count_in_reply = int.from_bytes(body[:4], "big") if len(body) >= 4 else 0
            b.future.set_result(body)
            ok = b.count
        except BaseException as e:  # noqa: BLE001 - handed to the handles and to flush()
            if self._error is None:
                self._error = e
            if not b.future.done():
                b.future.set_exception(e)
                b.future.exception()           # retrieved: flush() raises it, not the loop's logger
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            self._inflight.release()
            self.acknowledged += ok
            self._mem -= b.nbytes
            async with self._room:
                self._room.notify_all()

    async def flush(self) -> int:
        """Send what is queued now and wait until every frame sent so far is answered; raises the
        first send error since the previous flush; returns `acknowledged`."""
        if self._batch.count:
            self._wake.set()
        while self._batch.count or self._sending:
            if self._task.done():
                self._task.result()            # the flusher died: say why
            if self._sending:
                await asyncio.wait(set(self._sending))
            else:
                await asyncio.sleep(0)
        e, self._error = self._error, None
        if e is not None:
            raise e
        return self.acknowledged

    async def close(self) -> None:
        try:
            await self.flush()
        finally:
            self._closed = True
            self._wake.set()
            await self._task

    async def __aenter__(self) -> "AsyncAutoBatchProducer":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class AsyncPullConsumer(PullConsumer):
    """PullConsumer (consumer.py) for asyncio: a consumer-group member on one ConsumeQueue. Create it
    with `await AsyncConnection.consumer(...)` (the group's committed offset is read first); `commit`
    is PullConsumer's (awaited)."""
    opens_now = False

    def __init__(self, conn, topic: str, group: str, queue_id: int = 0, *, max_count: int = 256) -> None:
        super().__init__(conn, topic, group, queue_id, max_count=max_count, prefetch=False)

    async def start(self, start: str) -> "AsyncPullConsumer":
        check_start(start)
        c = await self.conn.execute(Committed(self.group, self.topic, self.queue_id))
        if c is None:
            lo, hi = await self.conn.execute(Offsets(self.topic, self.queue_id))
            c = hi if start == "latest" else lo
        self.position = c
        return self

    async def poll(self) -> list[Record]:
        r = await self.conn.execute(Pull(self.topic, self.queue_id, self.position, self.max_count))
        self.position = r.next_offset
        return r.records


class AsyncFilterConsumer(FilterConsumer):
    """FilterConsumer (consumer.py) for asyncio: every stored message matching `topic_filter`,
    wildcards included, whether or not the filter was held when it was written, then the live ones;
    starts at `since` (epoch ms), else the group's committed position, else `start`. Create it with
    `await AsyncConnection.filter_consumer(...)` (that registers the filter, like a SUBSCRIBE).
    `seek` and `commit` are FilterConsumer's (awaited)."""
    opens_now = False

    def __init__(self, conn, topic_filter: str, group: str | None = None, *, max_count: int = 256) -> None:
        super().__init__(conn, topic_filter, group, max_count=max_count)

    async def start(self, start: str, since: int | None) -> "AsyncFilterConsumer":
        await self.conn.execute(Subscribe(self.filter))
        await self.conn.execute(self._where(start, since, self.group))
        return self

    async def poll(self) -> list[Record]:
        for _ in range(8):           # a stretch of other topics in the history may give nothing
            before = self.log_position
            recs = await self.conn.execute(self._read())
            if recs or self.log_position == before:
                return recs
        return []


class AsyncPopConsumer(PopConsumer):
    """PopConsumer (consumer.py), the same methods awaited: stateless members of a group share a
    queue; popped records are invisible for `invisible_ms`, `ack` removes them, after
    `max_attempts` they go to `%DLQ%<group>`."""


class AsyncAdmin(Admin):
    """Admin (admin.py), the same queries awaited: `c.admin()` of an AsyncConnection."""


__all__ = ["AsyncProducer", "AsyncAutoBatchProducer", "AsyncSendHandle", "AsyncPullConsumer",
           "AsyncFilterConsumer", "AsyncPopConsumer", "AsyncAdmin"]
