"""Producers: `Producer` (send, send_async, send_batch) and `AutoBatchProducer` (seed 003).

Every PRODUCE carries the producer id and a sequence number per batch; the store remembers the
last batches of each producer id, so a batch re-sent after a lost connection is stored once and
answered with the original offsets. A send returns when the store says the batch is durable
under its flush mode (docs/store.md).

MQTT fields (qos, retain, content_type, response_topic, correlation_data, user_properties, ...)
go into the record's props with the same encoding the MQTT gateway uses (`lmqtt.store.props`), so
an MQTT subscriber of the topic sees them as MQTT 5 properties (docs/sdk.md, mapping table).
"""
from __future__ import annotations

import itertools
import threading
import time
import uuid
from concurrent.futures import Future
from typing import NamedTuple

from lmqtt.store import protocol as W
from lmqtt.store.props import MessageProperties, encode as encode_props

from .connection import Connection, ConnectionLost


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


def _tuple(topic: str, body, keys=(), queue_id: int = 0, **props):
    if isinstance(keys, str):
        keys = (keys,)
    return (topic, bytes(body), tuple(keys), make_props(**props), queue_id, 0)


def _pack_one(topic: str, body, **kw) -> bytes:
    return W.encode_messages_for_produce([_tuple(topic, body, **kw)])


class Producer:
    """send(topic, body, keys=(), queue_id=0, qos=1, retain=False, content_type=None,
    response_topic=None, correlation_data=None, user_properties=None) -> SendResult"""

    def __init__(self, conn: Connection, producer_id: str | None = None, *, retries: int = 5) -> None:
        self.conn = conn
        self.producer_id = producer_id or uuid.uuid4().hex
        # sequences must grow across restarts of a producer that keeps its id: start from the
        # clock in microseconds (a restarted process starts above anything it sent before)
        self._seq = itertools.count(time.time_ns() // 1000)
        self._seq_lock = threading.Lock()
        self.retries = retries

    def next_sequence(self) -> int:
        with self._seq_lock:
            return next(self._seq)

    def _results(self, body: bytes) -> list[SendResult]:
        ident = self.conn.ident
        return [SendResult(f"{ident}{p:016X}", p, q) for p, q in W.decode_produced(body)]

    def send_packed(self, count: int, packed: bytes, seq: int | None = None) -> list[SendResult]:
        """Send pre-packed messages (protocol.encode_messages_for_produce) as one batch with a
        sequence number; retried on a lost connection (the store deduplicates)."""
        seq = self.next_sequence() if seq is None else seq
        frame = W.encode_produce(self.producer_id, seq, count, packed)
        _op, _f, body = self.conn.call(W.OP_PRODUCE, frame, retry=True)
        return self._results(body)

    def send(self, topic: str, body: bytes, **kw) -> SendResult:
        return self.send_packed(1, _pack_one(topic, body, **kw))[0]

    def send_batch(self, messages) -> list[SendResult]:
        """messages: iterable of (topic, body) or dicts with send()'s keywords. One frame, one
        append (all stored or none)."""
        tuples = [_tuple(**m) if isinstance(m, dict) else _tuple(m[0], m[1]) for m in messages]
        return self.send_packed(len(tuples), W.encode_messages_for_produce(tuples))

    def send_async(self, topic: str, body: bytes, **kw) -> Future:
        """Send without waiting; the Future resolves to a SendResult (or the error). A lost
        connection fails the future with ConnectionLost: re-send with `send_packed(..., seq=)`
        from `future.sequence` to get exactly-once storage."""
        seq = self.next_sequence()
        out: Future = Future()
        out.sequence = seq
        frame = W.encode_produce(self.producer_id, seq, 1, _pack_one(topic, body, **kw))
        inner = self.conn.request(W.OP_PRODUCE, frame)

        def done(f: Future) -> None:
            try:
                op, _fl, b = f.result()
                if op == W.OP_ERROR:
                    from .connection import StoreClientError
                    out.set_exception(StoreClientError(*W.parse_error(b)))
                else:
                    out.set_result(self._results(b)[0])
            except BaseException as e:  # noqa: BLE001
                out.set_exception(e)
        inner.add_done_callback(done)
        return out


class AutoBatchProducer:
    """AutoBatch (seed 003): `send()` only queues; messages are flushed as ONE PRODUCE frame when
    `batch_bytes` are queued or `linger_ms` passed since the first, by a background thread.
    `max_memory` bounds queued + in-flight bytes: `send()` blocks when it is reached
    (back-pressure instead of unbounded memory). `send()` returns a Future of the SendResult;
    user code that ignores it just calls `send()` and `flush()`/`close()` at the end.

    A batch whose connection was lost is re-sent with the same sequence (stored once)."""

    def __init__(self, conn: Connection, producer_id: str | None = None, *, batch_bytes: int = 256 << 10,
                 linger_ms: float = 5.0, max_memory: int = 32 << 20, max_in_flight: int = 4) -> None:
        self.p = Producer(conn, producer_id)
        self.conn = conn
        self.batch_bytes = batch_bytes
        self.linger = linger_ms / 1000.0
        self.max_memory = max_memory
        self._cond = threading.Condition()
        self._parts: list[bytes] = []
        self._futs: list[Future] = []
        self._bytes = 0
        self._mem = 0
        self._first = 0.0
        self._closed = False
        self._inflight = threading.Semaphore(max_in_flight)
        self._outstanding = 0
        self._error: BaseException | None = None
        self._topics: dict[str, tuple[bytes]] = {}
        self._thread = threading.Thread(target=self._run, name="lmqtt-autobatch", daemon=True)
        self._thread.start()

    def send(self, topic: str, body: bytes, **kw) -> Future:
        if kw:
            packed = _pack_one(topic, body, **kw)
        else:   # the common case: plain QoS 1 message, topic encoded once per producer
            t = self._topics.get(topic)
            if t is None:
                if len(self._topics) > 4096:
                    self._topics.clear()
                t = self._topics[topic] = (topic.encode(), )
            tb = t[0]
            packed = b"".join((_HEAD_PACK(len(tb), 0, _PLAIN_LEN, len(body), 0, 0), tb, _PLAIN_QOS1, body))
        fut: Future = Future()
        n = len(packed)
        with self._cond:
            if self._closed:
                raise RuntimeError("AutoBatchProducer is closed")
            while self._mem + n > self.max_memory and self._mem:
                self._cond.wait()
            if not self._parts:
                self._first = time.monotonic()
            self._parts.append(packed)
            self._futs.append(fut)
            self._bytes += n
            self._mem += n
            if self._bytes >= self.batch_bytes:
                self._cond.notify_all()
        return fut

    def _take(self):
        parts, futs, nbytes = self._parts, self._futs, self._bytes
        self._parts, self._futs, self._bytes = [], [], 0
        self._outstanding += 1
        return parts, futs, nbytes

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._parts and (self._bytes >= self.batch_bytes or self._closed
                                        or time.monotonic() - self._first >= self.linger):
                        break
                    if self._closed and not self._parts:
                        return
                    timeout = None if not self._parts else max(0.0, self._first + self.linger - time.monotonic())
                    self._cond.wait(timeout)
                parts, futs, nbytes = self._take()
            self._inflight.acquire()
            self._send(parts, futs, nbytes, self.p.next_sequence(), 0)

    def _send(self, parts, futs, nbytes, seq, attempt) -> None:
        frame = W.encode_produce(self.p.producer_id, seq, len(parts), b"".join(parts))
        try:
            inner = self.conn.request(W.OP_PRODUCE, frame)
        except ConnectionLost as e:
            inner = Future()
            inner.set_exception(e)

        def done(f: Future) -> None:
            try:
                op, _fl, b = f.result()
                if op == W.OP_ERROR:
                    from .connection import StoreClientError
                    raise StoreClientError(*W.parse_error(b))
                res = self.p._results(b)
                if len(res) != len(futs):     # a duplicate older than the store's window: stored
                    res = [None] * len(futs)  # long ago, offsets forgotten
                for fu, r in zip(futs, res):
                    fu.set_result(r)
            except ConnectionLost as e:
                if attempt + 1 < self.conn.reconnect_attempts:
                    time.sleep(min(self.conn.backoff_initial * (2 ** attempt), self.conn.backoff_max))
                    threading.Thread(target=self._send, args=(parts, futs, nbytes, seq, attempt + 1),
                                     daemon=True).start()
                    return
                self._fail(futs, e)
            except BaseException as e:  # noqa: BLE001
                self._fail(futs, e)
            self._inflight.release()
            with self._cond:
                self._mem -= nbytes
                self._outstanding -= 1
                self._cond.notify_all()
        inner.add_done_callback(done)

    def _fail(self, futs, e) -> None:
        self._error = e
        for fu in futs:
            if not fu.done():
                fu.set_exception(e)

    def flush(self, timeout: float | None = None) -> None:
        """Send what is queued and wait until every batch sent so far is acknowledged; raises the
        last send error, if any."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._parts:
                self._first = -1e9          # linger over: the flusher takes it now
                self._cond.notify_all()
            while self._parts or self._outstanding:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("AutoBatchProducer.flush timed out")
                self._cond.wait(0.05 if left is None else min(0.05, left))
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def close(self) -> None:
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def __enter__(self) -> "AutoBatchProducer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
