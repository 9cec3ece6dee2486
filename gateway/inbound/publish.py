"""Inbound publish path: PUBLISH -> one store record (multi-dispatch) -> PUBACK/PUBREC when durable.

Why a per-tick batch: every PUBLISH decoded during one event-loop iteration (from any number of
connections) is appended with ONE `store.append_batch` call (one lock, one buffer copy). Under the
`sync` flush mode one group-commit fsync then acknowledges the whole batch, which is what makes QoS 1
fast there. Acks are sent only after the store's durable future resolves - never before - and in
arrival order per connection, so a publisher that sees PUBACK(n) knows 1..n are durable. When the
append is durable at once (in-process, `async`), the acks are written before the batch is dispatched
into the light queues and delivered (same loop callback: nothing else runs in between).
"""
from __future__ import annotations

import gc
import logging
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, Protocol

from lmqtt.gateway.storage import record_props
from lmqtt.gateway.mqtt import SUCCESS_ACK_HEAD, ProtocolError, ReasonCode, encode_success_acks, packets as P
from lmqtt.lightqueue import topics as T
from lmqtt.lightqueue.errors import InvalidTopicName
from lmqtt.store.errors import DiskFull, MessageTooLarge
from lmqtt.store.message import Message

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.net.connection import MQTTConnection
    from lmqtt.gateway.storage.facades import QueueStore

log = logging.getLogger("lmqtt.gateway.inbound.publish")

# ------------------------------------------------------------------------- delayed publishes
# Two ways for an MQTT client to ask for later delivery (docs/store.md "Delayed messages over MQTT"):
#   * PUBLISH to `$delayed/{seconds}/{topic}` (EMQX's convention): delivered on {topic} after
#     {seconds} whole seconds; the broker checks ACLs against {topic};
#   * MQTT 5: an ordinary PUBLISH with the user property `deliver-at` = epoch milliseconds or an
#     RFC 3339 time (no zone = UTC).
# The message is parked in the store's timer wheel (store/delayed.py) in the same append as the
# other publishes of the tick; the PUBACK/PUBREC means "the timer is durable". A due time not in
# the future publishes at once.
DELAYED_PREFIX = "$delayed/"
DELIVER_AT = "deliver-at"
MAX_DELAY_MS = 40 * 24 * 3600 * 1000      # the store's default (StoreConfig.timer_max_delay_ms)


class DelayRefused(Exception):
    """A delayed publish the broker refuses: `reason_code` for MQTT 5's PUBACK/PUBREC."""

    def __init__(self, reason_code: int, message: str) -> None:
        super().__init__(message)
        self.reason_code = reason_code


def parse_delayed_topic(topic: str, now_ms: int | None = None) -> tuple[str, int]:
    """`$delayed/{seconds}/{topic}` -> (topic, due epoch ms); DelayRefused (0x90) for a bad form."""
    rest = topic[len(DELAYED_PREFIX):]
    secs, sep, real = rest.partition("/")
    bad = ReasonCode.TOPIC_NAME_INVALID
    if not (secs.isascii() and secs.isdigit()) or len(secs) > 12:
        raise DelayRefused(bad, f"{topic!r}: the delay must be whole seconds, as in $delayed/30/a/b "
                                f"(got {secs!r})")
    if not sep or not real:
        raise DelayRefused(bad, f"{topic!r}: no topic after the delay ($delayed/{{seconds}}/{{topic}})")
    delay_ms = int(secs) * 1000
    if delay_ms > MAX_DELAY_MS:
        raise DelayRefused(bad, f"{topic!r}: a delay of {secs} s exceeds the maximum of {MAX_DELAY_MS // 1000} s")
    if "+" in real or "#" in real:
        raise DelayRefused(bad, f"{topic!r}: the topic after the delay must not contain wildcards")
    if real.startswith("$"):
        raise DelayRefused(bad, f"{topic!r}: a delayed message cannot go to a $-topic")
    try:
        T.validate_topic(real)
    except InvalidTopicName as e:
        raise DelayRefused(bad, f"{topic!r}: {e}") from None
    if now_ms is None:
        now_ms = int(time.time() * 1000)
    return real, now_ms + delay_ms


def parse_deliver_at(value: str, now_ms: int | None = None) -> int:
    """The `deliver-at` user property (epoch ms, or RFC 3339 / ISO 8601; no zone = UTC) -> due
    epoch ms; DelayRefused (0x99) when unreadable or beyond the maximum delay."""
    v = value.strip()
    try:
        if v.isascii() and v.isdigit():
            due = int(v)
        else:
            dt = datetime.fromisoformat(v)
            if dt.tzinfo is None:
                dt = dt.replace(tzinfo=timezone.utc)
            due = int(dt.timestamp() * 1000)
    except (ValueError, OverflowError):
        raise DelayRefused(ReasonCode.PAYLOAD_FORMAT_INVALID,
                           f"user property {DELIVER_AT}={value!r} is neither epoch milliseconds nor an "
                           "RFC 3339 time") from None
    if now_ms is None:
        now_ms = int(time.time() * 1000)
    if due - now_ms > MAX_DELAY_MS:
        raise DelayRefused(ReasonCode.PAYLOAD_FORMAT_INVALID,
                           f"user property {DELIVER_AT}={value!r} is {(due - now_ms) // 1000} s ahead, beyond "
                           f"the maximum delay of {MAX_DELAY_MS // 1000} s")
    return due


class _Pending(Message):
    """One publish waiting for its batch's append: the store's `Message` itself (appended as it
    is: no second object per publish) with what the acknowledgement needs. `born_ts` is the
    batch's first arrival, set by `_enqueue`; `dispatch_queues` are the light queues it lands in."""

    __slots__ = ("conn", "session", "qos", "pid", "retain", "due")

    def __init__(self, conn, qos, pid, topic, payload, retain, props, queues, due=0, keys=()) -> None:
        self.conn = conn
        # the session, not the connection, owns the packet id: after a takeover/reconnect the ack
        # goes to the session's current connection (where the client re-sent the PUBLISH)
        self.session = conn.session if conn is not None else None
        self.qos = qos
        self.pid = pid
        self.topic = topic
        self.body = payload
        self.queue_id = 0
        self.flags = 0
        self.retain = retain
        self.props = props
        self.dispatch_queues = queues     # a tuple (queues_for_topic's)
        self.due = due            # epoch ms of a delayed publish (0 = now)
        self.keys = keys          # the record's keys (a tuple): an inbound QoS 2 id written ahead (broker/broker.py)


class AppendListener(Protocol):
    """Told after each append (notify/bus.py InProcessBus, an embedded store's notify bus):
    `drain()` delivers the queue names the append raised on the loop thread; `drain_follows` is
    set while an append runs whose drain comes right after it."""
    drain_follows: bool

    def drain(self) -> None: ...


class BatchedWrites(Protocol):
    """The connections' queued output (net/write_batcher.py WriteBatcher): `flush()` writes it now;
    `hold()` defers the loop's flush while a batch runs (returns whether it was held already),
    `release(was)` ends that."""

    def flush(self) -> None: ...

    def hold(self) -> bool: ...

    def release(self, was: bool) -> None: ...


class PublishPipeline:
    """Batches publishes per loop iteration into the store and acknowledges them when durable.

    It calls back through narrow parts it is handed, never probing what it holds:
    `set_retained(topic, payload, props)` stores a retained message, `record_appended(batch,
    now_ms)` hands freshly visible records to delivery (which fills `recent_ends`, the queue ends it
    read, valid until this append's delivery run is over), `writes` writes the connections' queued
    output (the acks: net/write_batcher.py's WriteBatcher), `append_listener` is told after each
    append (an embedded store's notify bus; None over a remote store).
    """

    # `qos2_stored(session, packet id)`: an inbound QoS 2 message of a persistent session is stored;
    # it sends the PUBREC once the id is durable (broker/broker.py); None: the PUBREC goes with the acks
    qos2_stored: Callable[[Any, int], None] | None = None
    # Publishes from clients a batch takes before it is appended there and then, inside the read
    # that brought the last of them; the turn's later reads start the next batch. Why: a loop turn
    # under load reads up to ~100,000 publishes (100 publishers, 256 KiB a read), and a batch that
    # size kept them all alive at once: tens of MiB of objects made and freed per turn (~40,000 page
    # faults a second as the allocator's arenas came and went) and no cache locality. Fan-in at
    # 20,000 per publisher, alternated with the unbounded batch: 8.00 -> 6.12 us of broker CPU per
    # message. Internal publishes (wills, $SYS, events: no connection) never append inline: they
    # may come from a loop over sessions that a delivery must not run inside.
    max_batch = 4096

    def __init__(self, store: "QueueStore", loop, metrics, max_pending_publish: int, *,
                 set_retained: Callable[[str, bytes, bytes], None],
                 record_appended: Callable[[list, int], None],
                 recent_ends: dict[str, int] | None = None,
                 writes: "BatchedWrites",
                 append_listener: "AppendListener | None" = None) -> None:
        self.store = store
        self.loop = loop
        self.metrics = metrics
        self.max_pending_publish = max_pending_publish
        self._set_retained = set_retained
        self._record_appended = record_appended
        # the queue ends record_appended read (RecentMessages.ends), valid until the delivery run
        # of this append's chain is over: cleared after the append listener's drain
        self._ends = recent_ends
        self._flush_writes = writes.flush
        # held for a batch (net/write_batcher.py WriteBatcher.hold: no loop callback per batch to
        # write what the batch wrote itself)
        self._writes = writes
        self._pending: list[_Pending] = []
        self._born_ms = 0         # epoch ms of the pending batch's first publish: its records' born_ts
        self._delayed = 0         # delayed publishes in _pending
        self._scheduled = False
        self._gc_paused = False   # this batch turned the cyclic GC off (`_enqueue`, `flush`)
        self.inflight_batches = 0
        # publishes refused because the store's disk is full (/metrics, see _DiskFullMetrics)
        self.refused_disk_full = 0
        registry = getattr(metrics, "registry", None)
        if registry is not None:
            registry.register(_DiskFullMetrics(self))
        # drained once the batch is appended (an embedded store's notify bus): with the store's
        # inline dispatch the new entries are already visible, so subscribers get them in this
        # same loop callback, before the PUBACKs are written; told that a drain follows each
        # append (`drain_follows`: no safety-net loop callback per batch)
        self._drain_owner = append_listener
        self._drain = append_listener.drain if append_listener is not None else None   # bound once
        # delayed publishes: the store's timer wheel fires on this loop (an embedded store; a
        # remote one fires on its own)
        try:
            store.enable_delayed(loop)
        except Exception as e:  # noqa: BLE001 - ordinary publishes still work
            log.error("event=delayed_unavailable error=%r", e)

    def submit(self, conn: "MQTTConnection | None", pkt_qos: int, pid: int | None, topic: str,
               payload: bytes, retain: bool, client_id: str, props: P.Properties | None,
               due_ms: int = 0, keys: tuple[str, ...] = ()) -> None:
        """Queue one publish for the next batch append (topic already validated). `due_ms`: epoch
        ms of a `$delayed/` publish (the broker parsed the topic); an MQTT 5 `deliver-at` user
        property is read here. `keys`: the record's keys (indexed by the store)."""
        if props is not None and props.user_property and not due_ms:
            for k, v in props.user_property:
                if k == DELIVER_AT:
                    try:
                        due_ms = parse_deliver_at(v)
                    except DelayRefused as e:
                        return self.refuse(conn, pkt_qos, pid, topic, e)
                    break
        if due_ms:
            if due_ms > time.time() * 1000:
                return self._submit_delayed(conn, pkt_qos, pid, topic, payload, retain, client_id, props, due_ms)
        queues = self.store.queues_for_topic(topic)
        rp = record_props.encode_cached(pkt_qos, bool(retain), client_id, props)
        self._enqueue(_Pending(conn, pkt_qos, pid, topic, payload, retain, rp, queues, 0, keys), conn, pkt_qos)

    def _enqueue(self, p: "_Pending", conn, pkt_qos: int) -> None:
        """Queue for this tick's batch append; a QoS 1/2 publisher with too many waiting for the
        store is not read meanwhile."""
        pending = self._pending
        if not pending:
            self._born_ms = int(time.time() * 1000)
        p.born_ts = self._born_ms
        pending.append(p)
        if conn is not None and pkt_qos:
            conn.pending_publishes += 1
            if conn.pending_publishes >= self.max_pending_publish:
                conn.pause_reading_for_store()
        if len(pending) >= self.max_batch and conn is not None:
            self.flush()
            return
        if not self._scheduled:
            self._scheduled = True
            # No cyclic GC pass until the batch is appended and gone: under load one loop turn
            # reads tens of thousands of publishes, and each young collection meanwhile scanned
            # them all (they are alive) and moved them on, until they filled the oldest generation
            # and made full collections come every few seconds (0.1-0.4 s each). Freed by reference
            # count right after the append, they need no scan at all; the collector runs again at
            # the first allocation after the flush.
            if gc.isenabled():
                gc.disable()
                self._gc_paused = True
            self.loop.call_soon(self.flush)

    def _submit_delayed(self, conn, pkt_qos, pid, topic, payload, retain, client_id, props, due_ms) -> None:
        """A delayed publish: parked by the store in the next batch append, no light queues now
        (they are computed when it fires) and no retained-message update (RETAIN is carried on
        the record only)."""
        rp = record_props.encode_cached(pkt_qos, bool(retain), client_id, props)
        self._delayed += 1
        self._enqueue(_Pending(conn, pkt_qos, pid, topic, payload, retain, rp, (), due_ms), conn, pkt_qos)

    def refuse(self, conn, qos: int, pid: int | None, topic: str, err: DelayRefused) -> None:
        """A delayed publish with a bad form: nothing is stored. MQTT 5: PUBACK/PUBREC with the
        reason code and string (QoS 0: dropped); 3.1.1 has no negative ack: the connection is
        closed, as for any invalid topic name. Logged with the cause either way."""
        s = conn.session if conn is not None else None
        log.info("event=delayed_publish_refused client_id=%s topic=%r reason_code=0x%02X cause=%r",
                 s.client_id if s is not None else "", topic, err.reason_code, str(err))
        if conn is None:
            return
        if qos and s is not None:
            s.publish_failed(pid)
        if conn.version != 5:
            raise ProtocolError(str(err), err.reason_code)
        if qos == 0:
            return
        pkt = P.PubAck(pid, err.reason_code) if qos == 1 else P.PubRec(pid, err.reason_code)
        if conn.problem_info:
            pkt.properties.reason_string = str(err)[:200]
        conn.send_fitting(pkt)

    def flush(self) -> None:
        try:
            self._flush_pending()
        finally:
            if self._gc_paused:
                self._gc_paused = False
                gc.enable()

    def _flush_pending(self) -> None:
        self._scheduled = False
        batch, self._pending = self._pending, []
        if not batch:
            return
        owner = self._drain_owner
        wb = self._writes
        was = wb.hold()
        try:
            if owner is None:
                self._flush(batch)
                return
            owner.drain_follows = True
            try:
                self._flush(batch)
            finally:
                if owner.drain_follows:   # _flush did not reach its drain (it raised): drain now
                    owner.drain_follows = False
                    self._drain()
        finally:
            if not was:
                wb.release(was)           # whatever the batch queued and did not write yet

    def _flush(self, batch: list) -> None:
        now_ms = int(time.time() * 1000)
        msgs = batch              # each _Pending is its record's Message
        store = self.store
        dues = None
        if self._delayed:         # parked by the store in the same append (store/delayed.py)
            self._delayed = 0
            dues = [p.due for p in batch]
        whole = True              # append_batch took every record (all or none)
        t0 = time.perf_counter()
        try:
            # not dispatched yet: the acks go out first (below)
            results = store.append_batch(msgs, False) if dues is None else store.append_batch_delayed(msgs, dues)
        except DiskFull as e:     # the store is out of space for all of them: no retry one by one,
            whole = False         # and no log line each (the store logs the episode once)
            results = [e] * len(batch)
        except Exception as e:  # one bad record must not fail the others: retry one by one
            whole = False
            log.warning("event=append_batch_failed error=%r count=%d; retrying one by one", e, len(batch))
            results = []
            for p, m in zip(batch, msgs):
                try:
                    results.append(self.store.append(m) if not p.due
                                   else self.store.append_batch_delayed([m], [p.due])[0])
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
                if p.retain and not p.due:
                    self._retain(p)
                if p.qos:
                    ok_batch.append(p)
            if ok_batch:
                last = results[-1]
        else:
            for p, r in zip(batch, results):
                if isinstance(r, Exception):
                    if isinstance(r, DiskFull):
                        self.refused_disk_full += 1
                    else:
                        self.metrics.dropped_store_error.inc()
                        log.error("event=append_failed topic=%s error=%r", p.topic, r)
                    if p.conn is not None and p.qos:
                        p.conn.pending_publishes -= 1
                    self._fail(p, r)
                    continue
                if p.retain and not p.due:
                    self._retain(p)
                if p.qos:
                    ok_batch.append(p)
                    last = r
        # The durable future of the last record covers all earlier ones (store contract).
        fut = last.durable if ok_batch else None
        durable = fut is not None and fut.done()
        try:
            if durable:
                # the publishers' acks before the batch is dispatched and delivered: a PUBACK
                # waits for the append only, not for the light queues' index writes nor for the
                # deliveries it causes (a device with one message in flight sends its next sooner)
                self._acked(ok_batch, fut, t0)
        finally:
            if dues is None:
                store.dispatch_appended()
        if whole and store.all_visible():
            # everything appended is visible (inline dispatch): the batch's records are the newest
            # entries of their queues, in order (DeliveryEngine.record_appended)
            self._record_appended(batch, now_ms)
        try:
            owner = self._drain_owner
            if owner is not None:
                owner.drain_follows = False
                self._drain()
        finally:
            ends = self._ends
            if ends:
                ends.clear()
        if fut is None or durable:
            return
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
            if isinstance(err, DiskFull):     # a remote store (lmqtt gateway) refused the batch
                self.refused_disk_full += len(ok_batch)
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
            if conn.reading_paused:
                conn.maybe_resume_reading()
            s = p.session
            pid = p.pid
            if s is not None:
                # the session machine: the id stored (QoS 2: awaiting PUBREL); True: a persistent
                # session's PUBREC waits for its record
                if s.publish_stored(p.qos, pid) and self.qos2_stored is not None:
                    self.qos2_stored(s, pid)    # PUBREC once the id is durable
                    continue
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
            self._set_retained(p.topic, p.body, record_props.retained_props(p.props, int(time.time() * 1000)))
        except Exception as e:
            log.error("event=retained_store_failed topic=%s error=%r", p.topic, e)

    def _fail(self, p: _Pending, err: BaseException) -> None:
        """The store refused or lost the write: tell an MQTT 5 client; close a 3.1.1 one (it resends).

        A full disk (DiskFull, from the embedded store or a remote one) is 0x97 Quota exceeded
        with the store's reason ("disk full: ... <data dir> (<free> free) ..."): the client may
        publish again later, the store accepts again once space is freed. MQTT 3.1.1 has no
        negative PUBACK: the connection is closed without acknowledging the message, and the
        client re-sends it (DUP) when it reconnects. A QoS 0 publish is dropped (counted)."""
        conn = p.conn
        if p.qos and p.session is not None:
            p.session.publish_failed(p.pid)           # not known as stored (its key is kept)
        if conn is None or conn.closing or p.qos == 0:
            return
        full = isinstance(err, DiskFull)
        if conn.version == 5:
            # PUBACK/PUBREC allow no "packet too large": a store limit is implementation-specific
            rc = (ReasonCode.QUOTA_EXCEEDED if full
                  else ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR if isinstance(err, MessageTooLarge)
                  else ReasonCode.UNSPECIFIED_ERROR)
            pkt = P.PubAck(p.pid, rc) if p.qos == 1 else P.PubRec(p.pid, rc)
            if conn.problem_info:      # the client may have said: no reason strings (§3.1.2.11.7)
                pkt.properties.reason_string = (_disk_full_text(err) if full else f"store error: {err}")[:200]
            conn.send_fitting(pkt)
        elif full:
            conn.close_with_error(ReasonCode.QUOTA_EXCEEDED, _disk_full_text(err))
        else:
            conn.close_with_error(ReasonCode.UNSPECIFIED_ERROR, f"store error: {err}")


def _disk_full_text(err: BaseException) -> str:
    """The store's own words ("disk full: ..."), without the SDK's error-name prefix."""
    text = getattr(err, "reason", None) or str(err)
    return text if text.startswith("disk full") else f"disk full: {text}"


class _DiskFullMetrics:
    """/metrics: lmqtt_publish_refused_disk_full_total (PUBLISHes this gateway refused because the
    store's disk is full: QoS 1/2 answered 0x97 or their 3.1.1 connection closed, QoS 0 dropped);
    with the embedded store also lmqtt_store_disk_full (1 while it refuses appends for lack of
    space), lmqtt_store_disk_full_refused_total (messages it refused: MQTT and SDK) and
    lmqtt_store_disk_free_bytes (store/disk_space.py)."""

    def __init__(self, pipeline: "PublishPipeline") -> None:
        self.pipeline = pipeline

    def describe(self):
        return []

    def collect(self):
        # only with the metrics port open (a scrape calls this)
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        yield CounterMetricFamily("lmqtt_publish_refused_disk_full",
                                  "PUBLISHes refused because the store's disk is full",
                                  value=self.pipeline.refused_disk_full)
        s = self.pipeline.store.disk_state()        # None: the store is another process
        if s is None:
            return
        yield GaugeMetricFamily("lmqtt_store_disk_full", "1 while the store refuses appends for lack of disk space",
                                value=1 if s["disk_full"] else 0)
        yield CounterMetricFamily("lmqtt_store_disk_full_refused",
                                  "Messages the store refused for lack of disk space (MQTT and SDK)",
                                  value=s["disk_full_refused"])
        if s["disk_free_bytes"] is not None:
            yield GaugeMetricFamily("lmqtt_store_disk_free_bytes", "Free bytes on the store's filesystem",
                                    value=s["disk_free_bytes"])
