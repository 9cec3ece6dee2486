"""Producers: `Producer` (send, send_async, send_batch) and `AutoBatchProducer`.

Every PRODUCE carries the producer id and a sequence number per batch; the store remembers the
last batches of each producer id, so a batch re-sent after a lost connection is stored once and
answered with the original offsets. A send returns when the store says the batch is durable
under its flush mode (docs/store.md).

MQTT fields (qos, retain, content_type, response_topic, correlation_data, user_properties, ...)
go into the record's props with the same encoding the MQTT gateway uses (`lmqtt.store.client.props`), so
an MQTT subscriber of the topic sees them as MQTT 5 properties (docs/sdk.md, mapping table).
"""
from __future__ import annotations

import itertools
import struct
import threading
import time
import uuid
from concurrent.futures import Future
from typing import TYPE_CHECKING, NamedTuple

from lmqtt.store import protocol as W
from lmqtt.store.client.props import MessageProperties, encode as encode_props

from .commands import CancelDelayed
from .errors import ConnectionLost, StoreClientError, is_not_primary

if TYPE_CHECKING:
    from .connection import Connection


class SendResult(NamedTuple):
    msg_id: str          # store identity + physical offset (query with Admin.get_by_msg_id)
    offset: int          # physical CommitLog offset
    queue_offset: int    # offset in the ConsumeQueue of the topic's first level


_PLAIN_QOS1 = encode_props(MessageProperties(qos=1))


_HEAD_PACK = W.MSG_HEAD.pack
_PLAIN_LEN = len(_PLAIN_QOS1)


def make_props(qos: int = 1, retain: bool = False, content_type: str | None = None,
               response_topic: str | None = None, correlation_data: bytes | None = None,
               user_properties=None, payload_format_indicator: int | None = None,
               message_expiry_interval: int | None = None, client_id: str = "") -> bytes:
    if (qos == 1 and not retain and content_type is None and response_topic is None and correlation_data is None
            and not user_properties and payload_format_indicator is None and message_expiry_interval is None
            and not client_id):
        return _PLAIN_QOS1
    up = list(user_properties.items()) if isinstance(user_properties, dict) else list(user_properties or ())
    return encode_props(MessageProperties(qos, retain, client_id, payload_format_indicator,
                                          message_expiry_interval, content_type, response_topic,
                                          correlation_data, up))


def message_tuple(topic: str, body, keys=(), queue_id: int = 0, **props):
    if isinstance(keys, str):
        keys = (keys,)
    return (topic, bytes(body), tuple(keys), make_props(**props), queue_id, 0)


def pack_one(topic: str, body, **kw) -> bytes:
    return W.encode_messages_for_produce([message_tuple(topic, body, **kw)])


def due_ms(delay: float | None = None, deliver_at=None) -> int:
    """The due time (epoch ms) of a send with `delay` (seconds from now) or `deliver_at` (epoch
    ms, or an aware `datetime`); 0 = not delayed."""
    if delay is not None and deliver_at is not None:
        raise ValueError("give delay or deliver_at, not both")
    if delay is not None:
        if delay < 0:
            raise ValueError(f"delay must be >= 0 seconds, got {delay}")
        return int(time.time() * 1000 + delay * 1000)
    if deliver_at is not None:
        ts = getattr(deliver_at, "timestamp", None)
        due = int(ts() * 1000) if ts is not None else int(deliver_at)
        if due <= 0:
            raise ValueError(f"deliver_at must be a positive epoch ms, got {deliver_at!r}")
        return due
    return 0


def delayed_frame(frame: bytes, dues) -> tuple[bytes, int]:
    """(frame body, frame flags) of a PRODUCE whose messages have these due times (0 = now)."""
    if dues is None or not any(dues):
        return frame, 0
    return frame + W.encode_due_trailer(dues), W.F_DELAYED


def pack_batch(heads: dict, messages) -> tuple[int, bytes, list[int] | None]:
    """(count, packed messages, due times or None) of a `send_batch` argument: (topic, body) pairs
    (their record heads cached in `heads` per topic and length) or dicts with send()'s keywords."""
    parts = []
    n = 0
    dues = None
    for m in messages:
        n += 1
        if isinstance(m, dict):
            if "delay" in m or "deliver_at" in m:
                m = dict(m)
                due = due_ms(m.pop("delay", None), m.pop("deliver_at", None))
                if dues is None:
                    dues = [0] * (n - 1)
                dues.append(due)
            elif dues is not None:
                dues.append(0)
            parts.append(W.encode_messages_for_produce([message_tuple(**m)]))
            continue
        if dues is not None:
            dues.append(0)
        topic, body = m[0], m[1]
        if body.__class__ is not bytes:
            body = _as_bytes(body)
        head = heads.get((topic, len(body)))
        if head is None:
            head = _plain_head(heads, topic, len(body))
        parts.append(head)
        parts.append(body)
    return n, b"".join(parts), dues


class Producer:
    """send(topic, body, keys=(), queue_id=0, qos=1, retain=False, content_type=None,
    response_topic=None, correlation_data=None, user_properties=None, delay=None,
    deliver_at=None) -> SendResult

    `delay` (seconds) or `deliver_at` (epoch ms or an aware datetime): the store parks the message
    in its timer wheel and it appears under `topic` at that time; the SendResult (returned once
    the timer is durable) names the parked message: `cancel_delayed(result.msg_id)` cancels it.

    A store out of disk space refuses the send with `DiskFull` (lmqtt.store.client; a
    StoreClientError): nothing of it was stored, the message names the store's data directory and
    free space. It is not retried here (space returns when an operator frees it, without a restart
    of the store); send again later. The same error reaches the futures of `send_async` and of
    AutoBatchProducer."""

    def __init__(self, conn: Connection, producer_id: str | None = None, *, retries: int = 5) -> None:
        self.conn = conn
        self.producer_id = producer_id or uuid.uuid4().hex
        # sequences must grow across restarts of a producer that keeps its id: start from the
        # clock in microseconds (a restarted process starts above anything it sent before)
        self._seq = itertools.count(time.time_ns() // 1000)
        self._seq_lock = threading.Lock()
        self.retries = retries
        self._heads: dict[tuple[str, int], bytes] = {}    # see _plain_head

    def next_sequence(self) -> int:
        with self._seq_lock:
            return next(self._seq)

    def _results(self, body: bytes) -> list[SendResult]:
        ident = self.conn.ident
        new = tuple.__new__
        return [new(SendResult, (f"{ident}{p:016X}", p, q)) for p, q in W.decode_produced(body)]

    def send_packed(self, count: int, packed: bytes, seq: int | None = None,
                    due_ms: list[int] | None = None) -> list[SendResult]:
        """Send pre-packed messages (protocol.encode_messages_for_produce) as one batch with a
        sequence number; retried on a lost connection (the store deduplicates). `due_ms`: one
        epoch-ms due time per message (0 = not delayed)."""
        seq = self.next_sequence() if seq is None else seq
        frame, flags = delayed_frame(W.encode_produce(self.producer_id, seq, count, packed), due_ms)
        _op, _f, body = self.conn.call(W.OP_PRODUCE, frame, retry=True, flags=flags)
        return self._results(body)

    def send(self, topic: str, body: bytes, *, delay: float | None = None, deliver_at=None, **kw) -> SendResult:
        due = due_ms(delay, deliver_at) if delay is not None or deliver_at is not None else 0
        return self.send_packed(1, pack_one(topic, body, **kw), due_ms=[due] if due else None)[0]

    def cancel_delayed(self, msg_id: str) -> bool:
        """Cancel a delayed message by the msg id its send returned: True when it was pending
        (it will not be delivered), False when it already fired or is not a delayed message."""
        return self.conn.execute(CancelDelayed(msg_id))

    def send_batch(self, messages) -> list[SendResult]:
        """messages: iterable of (topic, body) or dicts with send()'s keywords. One frame, one
        append (all stored or none)."""
        n, packed, dues = pack_batch(self._heads, messages)
        return self.send_packed(n, packed, due_ms=dues)

    def send_async(self, topic: str, body: bytes, *, delay: float | None = None, deliver_at=None,
                   **kw) -> Future:
        """Send without waiting; the Future resolves to a SendResult (or the error). A lost
        connection fails the future with ConnectionLost: re-send with `send_packed(..., seq=)`
        from `future.sequence` to get exactly-once storage."""
        seq = self.next_sequence()
        out: Future = Future()
        out.sequence = seq
        due = due_ms(delay, deliver_at) if delay is not None or deliver_at is not None else 0
        frame, flags = delayed_frame(W.encode_produce(self.producer_id, seq, 1, pack_one(topic, body, **kw)),
                                      [due] if due else None)
        inner = self.conn.request(W.OP_PRODUCE, frame, flags)

        def done(f: Future) -> None:
            try:
                op, _fl, b = f.result()
                if op == W.OP_ERROR:
                    out.set_exception(StoreClientError(*W.parse_error(b)))
                else:
                    out.set_result(self._results(b)[0])
            except BaseException as e:  # noqa: BLE001
                out.set_exception(e)
        inner.add_done_callback(done)
        return out


class SendFuture:
    """What `AutoBatchProducer.send()` returns: the future of one message of a batch.

    Why not a `concurrent.futures.Future` per message: its constructor allocates a lock and a
    condition, and resolving one takes the lock and notifies; at 100-byte messages that was most of
    the client's CPU (16 us per message). Here a batch has ONE future; this handle only keeps the
    batch and the message's index in it, and `result()` decodes this message's offsets from the
    batch's PRODUCED reply when asked (nothing is built for messages nobody asks about).

    Duck-compatible with the reading side of `concurrent.futures.Future`: result(), exception(),
    done(), add_done_callback(), cancelled() (a queued message cannot be cancelled). `result()` is
    None for a batch the store recognised as a duplicate older than its dedup window (stored long
    ago, offsets forgotten)."""

    __slots__ = ("_batch", "_index")

    def __init__(self, batch: "_Batch", index: int) -> None:
        self._batch = batch
        self._index = index

    def result(self, timeout: float | None = None) -> SendResult | None:
        b = self._batch
        body = b.future.result(timeout)
        if b.count_in_reply != b.count:
            return None
        phys, qoff = PRODUCED_AT(body, 4 + 16 * self._index)
        return SendResult(f"{b.ident}{phys:016X}", phys, qoff)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._batch.future.exception(timeout)

    def done(self) -> bool:
        return self._batch.future.done()

    def running(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        return False

    def add_done_callback(self, fn) -> None:
        self._batch.future.add_done_callback(lambda _f: fn(self))


PRODUCED_AT = W.PRODUCED_ENTRY.unpack_from


def _plain_head(heads: dict, topic: str, body_len: int) -> bytes:
    """Message head + topic + plain QoS 1 props for (topic, body length), packed once and kept in
    `heads` (bounded): a plain message is then packed as two list appends, head and body."""
    if len(heads) > 4096:
        heads.clear()
    if not isinstance(topic, str):
        raise TypeError(f"topic must be a str, got {type(topic).__name__}")
    tb = topic.encode()
    head = heads[(topic, body_len)] = _HEAD_PACK(len(tb), 0, _PLAIN_LEN, body_len, 0, 0) + tb + _PLAIN_QOS1
    return head


def queued_parts(heads: dict, topic: str, body, kw: dict) -> tuple[bytes, bytes, int]:
    """(packed head, body, due ms or 0) of one message queued by an AutoBatch producer (sync or
    asyncio). The common case, a plain QoS 1 message, costs a dict lookup: its head is the same
    for every body of that size on that topic (`heads` caches them); with keywords the whole
    message is packed into the head and the body part is empty."""
    if kw:
        due = 0
        if "delay" in kw or "deliver_at" in kw:
            kw = dict(kw)
            due = due_ms(kw.pop("delay", None), kw.pop("deliver_at", None))
        return pack_one(topic, body, **kw), b"", due
    if body.__class__ is not bytes:
        body = _as_bytes(body)
    head = heads.get((topic, len(body)))
    if head is None:
        head = _plain_head(heads, topic, len(body))
    return head, body, 0


def _as_bytes(body) -> bytes:
    if isinstance(body, (bytearray, memoryview)):
        return bytes(body)
    raise TypeError(f"message body must be bytes-like, got {type(body).__name__}")


class _Batch:
    """Messages packed for one PRODUCE frame; `future` resolves to the PRODUCED body (or the error)."""

    __slots__ = ("parts", "count", "nbytes", "future", "ident", "count_in_reply", "dues", "first_try")

    def __init__(self) -> None:
        self.dues: list[int] | None = None      # due time per message once one is delayed
        self.parts: list[bytes] = []
        self.count = 0
        self.nbytes = 0
        self.future: Future = Future()
        self.ident = ""
        self.count_in_reply = 0
        self.first_try = 0.0


class AutoBatchProducer:
    """AutoBatch (as RocketMQ 5's producer AutoBatch): `send()` only queues; messages are flushed
    as ONE PRODUCE frame when `batch_bytes` are queued or `linger_ms` passed since the first, by a
    background thread.
    `max_memory` bounds queued + in-flight bytes: `send()` blocks when it is reached
    (back-pressure instead of unbounded memory). `send()` returns a `SendFuture` of the
    SendResult; code that does not need each offset just calls `send()` and then `flush()` (waits
    for every message sent so far and raises the first failure) or `close()`. `acknowledged`
    counts the messages the store has acknowledged.

    A batch whose connection was lost is re-sent with the same sequence (stored once)."""

    def __init__(self, conn: Connection, producer_id: str | None = None, *, batch_bytes: int = 256 << 10,
                 linger_ms: float = 5.0, max_memory: int = 32 << 20, max_in_flight: int = 4) -> None:
        self.p = Producer(conn, producer_id)
        self.conn = conn
        self.batch_bytes = batch_bytes
        self.linger = linger_ms / 1000.0
        self.max_memory = max_memory
        # a plain Lock under the condition: send() takes it once per message, and an RLock costs more
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._batch = _Batch()
        self._mem = 0
        self._first = 0.0
        self._closed = False
        self._inflight = threading.Semaphore(max_in_flight)
        self._outstanding = 0
        self._error: BaseException | None = None
        self.acknowledged = 0
        # per (topic, body length): message head + topic + plain QoS 1 props, packed once
        self._heads: dict[tuple[str, int], bytes] = {}
        self._thread = threading.Thread(target=self._run, name="lmqtt-autobatch", daemon=True)
        self._thread.start()

    def send(self, topic: str, body: bytes, **kw) -> SendFuture:
        """Queue one message (send()'s keywords of Producer, `delay`/`deliver_at` included)."""
        head, body, due = queued_parts(self._heads, topic, body, kw)
        n = len(head) + len(body)
        with self._lock:            # the condition's lock, taken directly: Condition.__enter__ is Python code
            if self._closed:
                raise RuntimeError("AutoBatchProducer is closed")
            if self._mem + n > self.max_memory and self._mem:
                while self._mem + n > self.max_memory and self._mem:
                    self._cond.wait()
            b = self._batch
            parts = b.parts
            if not parts:
                self._first = time.monotonic()
            parts.append(head)
            if body:
                parts.append(body)
            i = b.count
            if due or b.dues is not None:
                if b.dues is None:
                    b.dues = [0] * i
                b.dues.append(due)
            b.count = i + 1
            nb = b.nbytes = b.nbytes + n
            self._mem += n
            if nb >= self.batch_bytes and nb - n < self.batch_bytes:    # the message that fills it
                self._cond.notify()
        return SendFuture(b, i)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    b = self._batch
                    if b.count and (b.nbytes >= self.batch_bytes or self._closed
                                    or time.monotonic() - self._first >= self.linger):
                        break
                    if self._closed and not b.count:
                        return
                    timeout = None if not b.count else max(0.0, self._first + self.linger - time.monotonic())
                    self._cond.wait(timeout)
                self._batch = _Batch()
                self._outstanding += 1
            self._inflight.acquire()
            self._send(b, self.p.next_sequence(), 0)

    def _send(self, b: _Batch, seq: int, attempt: int) -> None:
        if not attempt:
            b.first_try = time.monotonic()
        frame, flags = delayed_frame(W.encode_produce(self.p.producer_id, seq, b.count, b"".join(b.parts)),
                                      b.dues)
        try:
            inner = self.conn.request(W.OP_PRODUCE, frame, flags)
        except ConnectionLost as e:
            inner = Future()
            inner.set_exception(e)
        except BaseException as e:  # noqa: BLE001 - e.g. the batch is above the store's frame limit
            inner = Future()
            inner.set_exception(e)

        def done(f: Future) -> None:
            try:
                op, _fl, body = f.result()
                if op == W.OP_ERROR:
                    raise StoreClientError(*W.parse_error(body))
                b.ident = self.conn.ident or ""
                b.count_in_reply = _COUNT(body)[0] if len(body) >= 4 else 0
                b.parts = None
                b.future.set_result(body)
                ok = b.count
            except (ConnectionLost, StoreClientError) as e:
                # lost, or refused by a store group member that is not the primary (nothing done):
                # re-sent with the same sequence, stored once; in a group for up to failover_timeout
                conn = self.conn
                moved = is_not_primary(e)
                if not moved and not isinstance(e, ConnectionLost):
                    self._fail(b, e)
                    ok = 0
                elif (attempt + 1 < conn.reconnect_attempts
                      or ((moved or len(getattr(conn, "addresses", ())) > 1)
                          and time.monotonic() - b.first_try < getattr(conn, "failover_timeout", 0))):
                    if moved:
                        conn.not_primary(e)
                    time.sleep(min(conn.backoff_initial * (2 ** min(attempt, 6)),
                                   0.25 if moved or len(getattr(conn, "addresses", ())) > 1 else conn.backoff_max))
                    threading.Thread(target=self._send, args=(b, seq, attempt + 1), daemon=True).start()
                    return
                else:
                    self._fail(b, e)
                    ok = 0
            except BaseException as e:  # noqa: BLE001
                self._fail(b, e)
                ok = 0
            self._inflight.release()
            with self._cond:
                self.acknowledged += ok
                self._mem -= b.nbytes
                self._outstanding -= 1
                self._cond.notify_all()
        inner.add_done_callback(done)

    def _fail(self, b: _Batch, e: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = e
        b.parts = None
        if not b.future.done():
            b.future.set_exception(e)

    def flush(self, timeout: float | None = None) -> int:
        """Send what is queued and wait until every batch sent so far is answered. Raises the first
        send error since the previous flush (the other batches are still sent and answered: see
        `acknowledged`); returns `acknowledged`, the messages the store has acknowledged so far.

        This is the one way to wait for everything: no loop over the futures is needed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._batch.count:
                self._first = -1e9          # linger over: the flusher takes it now
                self._cond.notify_all()
            while self._batch.count or self._outstanding:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"AutoBatchProducer.flush timed out after {timeout} s with "
                                       f"{self._batch.count} messages queued and {self._outstanding} "
                                       "batches awaiting the store's answer")
                self._cond.wait(0.05 if left is None else min(0.05, left))
            e, self._error = self._error, None
        if e is not None:
            raise e
        return self.acknowledged

    wait_all = flush

    @property
    def failed(self) -> BaseException | None:
        """The first send error not yet raised by flush() (None while all is well): lets a long
        sending loop stop early instead of finding out at the end."""
        return self._error

    def close(self) -> None:
        try:
            self.flush()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join()

    def __enter__(self) -> "AutoBatchProducer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_COUNT = struct.Struct(">I").unpack_from
