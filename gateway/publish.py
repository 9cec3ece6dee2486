"""Inbound publish path: PUBLISH -> one store record (multi-dispatch) -> PUBACK/PUBREC when durable.

Why a per-tick batch: every PUBLISH decoded during one event-loop iteration (from any number of
connections) is appended with ONE `store.append_batch` call (one lock, one buffer copy). Under the
`sync` flush mode one group-commit fsync then acknowledges the whole batch, which is what makes QoS 1
fast there. Acks are sent only after the store's durable future resolves - never before - and in
arrival order per connection, so a publisher that sees PUBACK(n) knows 1..n are durable.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from lmqtt.gateway import record_props
from lmqtt.gateway.mqtt import SUCCESS_ACK_HEAD, ReasonCode, encode_success_acks, packets as P
from lmqtt.store import Message, MessageTooLarge

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.connection import MQTTConnection
    from lmqtt.gateway.store_api import GatewayStore

log = logging.getLogger("lmqtt.gateway.publish")


class _Pending:
    __slots__ = ("conn", "session", "qos", "pid", "topic", "payload", "retain", "props", "queues")

    def __init__(self, conn, qos, pid, topic, payload, retain, props, queues) -> None:
        self.conn = conn
        # the session, not the connection, owns the packet id: after a takeover/reconnect the ack
        # goes to the session's current connection (where the client re-sent the PUBLISH)
        self.session = conn.session if conn is not None else None
        self.qos = qos
        self.pid = pid
        self.topic = topic
        self.payload = payload
        self.retain = retain
        self.props = props
        self.queues = queues


class PublishPipeline:
    """Batches publishes per loop iteration into the store and acknowledges them when durable.

    It calls back through three narrow callables: `set_retained(topic, payload, props)` stores a
    retained message, `record_appended(batch, now_ms)` hands freshly visible records to delivery,
    `flush_writes()` writes the connections' queued output (the acks) right away.
    """

    def __init__(self, store: "GatewayStore", loop, metrics, max_pending_publish: int, *,
                 set_retained: Callable[[str, bytes, bytes], None],
                 record_appended: Callable[[list, int], None],
                 flush_writes: Callable[[], None]) -> None:
        self.store = store
        self.loop = loop
        self.metrics = metrics
        self.max_pending_publish = max_pending_publish
        self._set_retained = set_retained
        self._record_appended = record_appended
        self._flush_writes = flush_writes
        self._pending: list[_Pending] = []
        self._scheduled = False
        self.inflight_batches = 0
        # called once the batch is appended (Gateway: the notify bus's drain): with the store's
        # inline dispatch the new entries are already visible, so subscribers get them in this
        # same loop callback, before the PUBACKs are written
        self.after_append = None

    def submit(self, conn: "MQTTConnection | None", pkt_qos: int, pid: int | None, topic: str,
               payload: bytes, retain: bool, client_id: str, props: P.Properties | None) -> None:
        """Queue one publish for the next batch append (topic already validated)."""
        queues = self.store.queues_for_topic(topic)
        rp = record_props.encode_cached(pkt_qos, bool(retain), client_id, props)
        self._pending.append(_Pending(conn, pkt_qos, pid, topic, payload, retain, rp, queues))
        if conn is not None and pkt_qos:
            conn.pending_publishes += 1
            if conn.pending_publishes >= self.max_pending_publish:
                conn.pause_reading_for_store()
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        batch, self._pending = self._pending, []
        if not batch:
            return
        now_ms = int(time.time() * 1000)
        msgs = [Message(p.topic, p.payload, 0, 0, p.props, (), now_ms, p.queues) for p in batch]
        store = self.store
        whole = True              # append_batch took every record (all or none)
        t0 = time.perf_counter()
        try:
            results = store.append_batch(msgs)
        except Exception as e:  # one bad record must not fail the others: retry one by one
            whole = False
            log.warning("event=append_batch_failed error=%r count=%d; retrying one by one", e, len(batch))
            results = []
            for p, m in zip(batch, msgs):
                try:
                    results.append(self.store.append(m))
                except Exception as e1:
                    results.append(e1)
        t1 = time.perf_counter()
        self.metrics.append_latency.observe(t1 - t0)
        self.metrics.append_batch_size.observe(len(batch))
        ok_batch = []
        last = None               # result of the last appended QoS 1/2 record
        if whole:
            # append_batch appends all or none: no per-record result to look at (the store's
            # columnar results would build one tuple per record just to be iterated)
            for p in batch:
                if p.retain:
                    self._retain(p)
                if p.qos:
                    ok_batch.append(p)
            if ok_batch:
                last = results[-1]
        else:
            for p, r in zip(batch, results):
                if isinstance(r, Exception):
                    self.metrics.dropped_store_error.inc()
                    log.error("event=append_failed topic=%s error=%r", p.topic, r)
                    if p.conn is not None and p.qos:
                        p.conn.pending_publishes -= 1
                    self._fail(p, r)
                    continue
                if p.retain:
                    self._retain(p)
                if p.qos:
                    ok_batch.append(p)
                    last = r
        if whole and store.all_visible():
            # everything appended is visible (inline dispatch): the batch's records are the newest
            # entries of their queues, in order (DeliveryEngine.record_appended)
            self._record_appended(batch, now_ms)
        if self.after_append is not None:
            self.after_append()
        if not ok_batch:
            return
        # The durable future of the last record covers all earlier ones (store contract).
        fut = last.durable
        if fut.done():
            self._acked(ok_batch, fut, t0)
        else:
            self.inflight_batches += 1
            loop = self.loop

            def _done(f, ok_batch=ok_batch, t0=t0):
                try:
                    loop.call_soon_threadsafe(self._acked_later, ok_batch, f, t0)
                except RuntimeError:  # loop closed at shutdown
                    pass
            fut.add_done_callback(_done)

    def _acked_later(self, ok_batch: list, fut: Any, t0: float) -> None:
        self.inflight_batches -= 1
        self._acked(ok_batch, fut, t0)

    def _acked(self, ok_batch: list, fut: Any, t0: float) -> None:
        self.metrics.flush_latency.observe(time.perf_counter() - t0)
        err = fut.exception()
        if err is not None:
            for p in ok_batch:
                conn = p.conn
                if conn is None:
                    continue
                conn.pending_publishes -= 1
                conn.maybe_resume_reading()
                self._fail(p, err)
            return
        # Acks of one batch are joined per target connection: one write() each (the connection
        # joins again per loop tick); order per connection is arrival order.
        acks: dict = {}
        heads = SUCCESS_ACK_HEAD
        for p in ok_batch:
            conn = p.conn
            if conn is None:
                continue
            conn.pending_publishes -= 1
            if conn._reading_paused:
                conn.maybe_resume_reading()
            s = p.session
            pid = p.pid
            if s is not None:
                s.inbound_pending.discard(pid)
                if p.qos == 2:
                    s.inbound_qos2.add(pid)
                target = s.conn
            else:
                target = conn
            if target is None or target.closing:
                continue  # offline: the client re-sends (DUP) on its next connection
            lst = acks.get(target)
            if lst is None:
                acks[target] = [heads[p.qos], pid]
            else:
                lst.append(heads[p.qos])
                lst.append(pid)
        for target, lst in acks.items():
            target.write(encode_success_acks(lst))
        if acks:
            self._flush_writes()

    def _retain(self, p: _Pending) -> None:
        try:
            self._set_retained(p.topic, p.payload, record_props.retained_props(p.props, int(time.time() * 1000)))
        except Exception as e:
            log.error("event=retained_store_failed topic=%s error=%r", p.topic, e)

    def _fail(self, p: _Pending, err: BaseException) -> None:
        """The store refused or lost the write: tell an MQTT 5 client; close a 3.1.1 one (it resends)."""
        conn = p.conn
        if p.qos and p.session is not None:
            p.session.inbound_pending.discard(p.pid)
        if conn is None or conn.closing or p.qos == 0:
            return
        if conn.version == 5:
            # PUBACK/PUBREC allow no "packet too large": a store limit is implementation-specific
            rc = (ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR if isinstance(err, MessageTooLarge)
                  else ReasonCode.UNSPECIFIED_ERROR)
            pkt = P.PubAck(p.pid, rc) if p.qos == 1 else P.PubRec(p.pid, rc)
            if conn.problem_info:      # the client may have said: no reason strings (§3.1.2.11.7)
                pkt.properties.reason_string = f"store error: {err}"[:200]
            conn.send_fitting(pkt)
        else:
            conn.close_with_error(ReasonCode.UNSPECIFIED_ERROR, f"store error: {err}")
