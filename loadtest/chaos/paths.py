"""The clients of `lmqtt bench chaos`, one thread each, recording into a `Checker`.

MQTT (paho-mqtt, MQTT 3.1.1, persistent sessions: clean session 0, like a real device):
* `MqttSubscriber`: subscribes once (again only when the broker answers session present = 0,
  i.e. it lost the session) and records every delivery;
* `MqttPublisher`: publishes at a bounded rate with at most `window` messages unacknowledged;
  after a reconnect paho re-sends what was not acknowledged (PUBLISH with DUP, or PUBREL for a
  QoS 2 message the broker had PUBRECed), as the protocol asks of a client with a session, and
  the publisher makes new messages only once those are acknowledged. (paho 2.2.0 re-sends a
  PUBLISH in place of its PUBREL when a reconnect attempt failed first: `_paho` corrects that.)

SDK (lmqtt.store.client, against the store port):
* `SdkProducer`: one message per PRODUCE with the producer id and a sequence of its own; a send
  that fails (lost connection, timeout, the store refused it) is re-sent with the SAME sequence
  until acknowledged, so the store can store it once;
* `SdkGroupConsumer`: a consumer-group member (committed offsets in the store): poll, record,
  commit; after an error it starts again from the committed offset (at least once);
* `PopMember`: POP members of one group: pop, record, ack; what was popped and not acked comes
  back after `invisible_ms`.

Every loop is bounded: it stops on `stop()` and at its deadline; every wait has a timeout.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import TimeoutError as FutTimeout

from lmqtt.store import protocol as W
from lmqtt.store.client import connect, consumer as _consumer, producer as _producer  # noqa: F401 (see sdk_errors)
from lmqtt.store.client.connection import ConnectionLost, StoreClientError
from lmqtt.store.client.producer import make_props
from lmqtt.store.protocol import ProtocolError

from .checker import Checker, body, parse

SIZE = 64           # payload bytes
KEEPALIVE = 10


class _Worker:
    """A thread with a stop event and a hard deadline (monotonic). `errors` / `last_error`:
    what the client met (lost connections, refusals), for the report."""

    def __init__(self, name: str, deadline: float) -> None:
        self.name = name
        self.deadline = deadline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._guard, name=f"chaos-{name}", daemon=True)
        self.errors = 0
        self.last_error = ""

    def start(self):
        self._thread.start()
        return self

    def _guard(self) -> None:
        try:
            self.run()
        except Exception as e:  # noqa: BLE001 - a client thread must not die silently
            self.note(e)
            self.last_error = "thread ended: " + self.last_error
        finally:
            self.close()

    def running(self) -> bool:
        return not self._stop.is_set() and time.monotonic() < self.deadline

    def wait(self, seconds: float) -> None:
        self._stop.wait(max(0.0, min(seconds, self.deadline - time.monotonic())))

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def note(self, e: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(e).__name__}: {e}"[:300]

    def run(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {"name": self.name, "errors": self.errors, "last_error": self.last_error}


# ---------------------------------------------------------------------------------------- MQTT
def _paho(client_id: str):
    import paho.mqtt.client as mqtt  # optional: the bench and spark extras

    class Client(mqtt.Client):
        """paho-mqtt 2.2.0 with its QoS 2 resend corrected. Every reconnect attempt runs
        `_messages_reconnect_reset_out`, which turns a message awaiting PUBCOMP into "resend
        PUBREL" (right) and one already in "resend PUBREL" into "resend PUBLISH" (wrong, MQTT-4.3.3:
        no PUBLISH once its PUBREL is sent). So when the first reconnect attempt fails (a broker
        restarting refuses it), paho sends the message again as a new PUBLISH (DUP 0) with a
        packet id the broker has freed: the broker rightly stores it a second time. Keep the state."""

        def _messages_reconnect_reset_out(self) -> None:
            with self._out_message_mutex:
                owed = [m for m in self._out_messages.values() if m.state == mqtt.mqtt_ms_resend_pubrel]
            super()._messages_reconnect_reset_out()
            with self._out_message_mutex:
                for m in owed:
                    m.state = mqtt.mqtt_ms_resend_pubrel

    c = Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311,
               clean_session=False)
    c.reconnect_delay_set(0.2, 2)
    c.max_queued_messages_set(0)
    return c


class MqttSubscriber(_Worker):
    """Records every delivery of `topic_filter` at `qos` (a persistent session)."""

    def __init__(self, checker: Checker, name: str, host: str, port: int, topic_filter: str, qos: int,
                 deadline: float, path: str = "mqtt") -> None:
        super().__init__(name, deadline)
        self.checker, self.filter, self.qos = checker, topic_filter, qos
        self.host, self.port = host, port
        checker.receiver(name, path, qos)
        self.subscribed = threading.Event()
        self.connects = 0
        self.resubscribes = 0        # session present = 0 after the first connect: the broker lost it
        self.disconnects = 0
        self.c = _paho(name)
        self.c.on_connect = self._on_connect
        self.c.on_disconnect = self._on_disconnect
        self.c.on_subscribe = lambda c, u, mid, rcs, props: self.subscribed.set()
        self.c.on_message = lambda c, u, m: checker.received(name, m.payload)

    def _on_connect(self, c, u, flags, rc, props) -> None:
        if rc.is_failure:
            self.errors += 1
            self.last_error = f"CONNACK {rc}"
            return
        self.connects += 1
        if not flags.session_present:
            if self.connects > 1:
                self.resubscribes += 1
            c.subscribe(self.filter, self.qos)

    def _on_disconnect(self, c, u, flags, rc, props) -> None:
        self.disconnects += 1

    def run(self) -> None:
        self.c.connect_async(self.host, self.port, KEEPALIVE)
        self.c.loop_start()
        while self.running():
            self.wait(0.5)

    def close(self) -> None:
        try:
            self.c.disconnect()
        except Exception:  # noqa: BLE001
            pass
        self.c.loop_stop()

    def stats(self) -> dict:
        return {**super().stats(), "connects": self.connects, "disconnects": self.disconnects,
                "resubscribes": self.resubscribes}


class _Pacer:
    """At most `rate` sends per second (no catching up after a stall beyond one second's worth)."""

    def __init__(self, rate: float) -> None:
        self.step = 1.0 / rate
        self.next = time.monotonic()

    def delay(self) -> float:
        now = time.monotonic()
        self.next = max(self.next + self.step, now - 1.0)
        return max(0.0, self.next - now)


class MqttPublisher(_Worker):
    """Publishes `publisher#seq#...` to `topic` at `rate`/s, at most `window` unacknowledged."""

    def __init__(self, checker: Checker, name: str, host: str, port: int, topic: str, qos: int,
                 deadline: float, rate: float, window: int = 50, path: str = "mqtt") -> None:
        super().__init__(name, deadline)
        self.checker, self.topic, self.qos, self.path = checker, topic, qos, path
        self.host, self.port, self.rate, self.window = host, port, rate, window
        self.seq = 0
        self._acks: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, int] = {}           # paho mid -> seq
        self._producing = threading.Event()
        self._producing.set()
        self.connects = 0
        self.c = _paho(name)
        self.c.max_inflight_messages_set(window)
        # on_publish runs on paho's thread, under paho's own locks: only hand the mid over
        self.c.on_publish = lambda c, u, mid, rc, props: self._acks.put(mid)
        self.c.on_connect = self._on_connect
        self.c.on_disconnect = self._on_disconnect
        self._connected = threading.Event()
        self._resend_first = False

    def _on_connect(self, c, u, flags, rc, props) -> None:
        if not rc.is_failure:
            self.connects += 1
            self._resend_first = True
            self._connected.set()

    def _on_disconnect(self, c, u, flags, rc, props) -> None:
        self._connected.clear()

    def _take_acks(self) -> None:
        while True:
            try:
                mid = self._acks.get_nowait()
            except queue.Empty:
                return
            seq = self._pending.pop(mid, None)
            if seq is not None:
                self.checker.acked(self.name, seq)

    def finish(self) -> None:
        """Stop making new messages; keep waiting for the acks of those in flight."""
        self._producing.clear()

    def unacked(self) -> int:
        return len(self._pending)

    def run(self) -> None:
        self.c.connect_async(self.host, self.port, KEEPALIVE)
        self.c.loop_start()
        pace = _Pacer(self.rate)
        while self.running():
            self._take_acks()
            if not self._producing.is_set():
                if not self._pending:
                    break
                self.wait(0.05)
                continue
            if len(self._pending) >= self.window:
                self.wait(0.01)
                continue
            # New messages only on a connection, and after a reconnect only once what paho re-sent
            # is acknowledged: paho queues a PUBLISH made while it reconnects ahead of its re-sends
            # (it re-sends on CONNACK), which would reorder the stream on the client's side.
            if not self._connected.is_set():
                self.wait(0.01)
                continue
            if self._resend_first:
                if self._pending:
                    self.wait(0.01)
                    continue
                self._resend_first = False
            self.seq += 1
            self.checker.sent(self.name, self.seq, self.qos, self.path)
            info = self.c.publish(self.topic, body(self.name, self.seq, SIZE), qos=self.qos)
            self._pending[info.mid] = self.seq
            self.wait(pace.delay())
        self._take_acks()

    def close(self) -> None:
        try:
            self.c.disconnect()
        except Exception:  # noqa: BLE001
            pass
        self.c.loop_stop()

    def stats(self) -> dict:
        return {**super().stats(), "sent": self.seq, "unacked": len(self._pending), "connects": self.connects}


# ---------------------------------------------------------------------------------------- SDK
_SDK_ERRORS: tuple = ()


def sdk_errors() -> tuple:
    """The errors an SDK client meets under faults. (The SDK's modules are imported with this one, on
    one thread: two threads importing lmqtt.store.client at once could see a partially initialised
    module.)"""
    global _SDK_ERRORS
    if not _SDK_ERRORS:
        _SDK_ERRORS = (ConnectionLost, StoreClientError, ProtocolError, OSError, FutTimeout, TimeoutError)
    return _SDK_ERRORS


def sdk_connect(address: str):
    # short timeouts: a stopped (SIGSTOP) store must not hold a client for the default 30 s;
    # the token of a store off loopback (the network bed's) from the environment, as lmqtt's own tools
    return connect(address, timeout=5.0, connect_timeout=2.0, reconnect_attempts=2, backoff_max=0.5,
                   client_name="lmqtt-chaos", token=os.environ.get("LMQTT_STORE_TOKEN") or None)


def read_queue(conn, level: str, offset: int = 0, max_pulls: int = 100_000) -> tuple[list, int]:
    """Every record of first-level topic `level` (its ConsumeQueue 0) from queue offset `offset`,
    in pulls of 1,000 (at most `max_pulls`): -> ([(CommitLog offset, (publisher, seq) or None)],
    the queue offset after the last one)."""
    out = []
    for _ in range(max_pulls):
        r = conn.pull(level, 0, offset, 1000)
        if not r.records:
            break
        out.extend((rec.offset, parse(rec.body)) for rec in r.records)
        offset = r.next_offset
    return out, offset


class _SdkWorker(_Worker):
    """A worker over one SDK connection (`self.conn`), dropped after an error and at close (a
    failing close of a connection to a killed store is expected, not reported)."""

    conn = None

    def _drop(self) -> None:
        c, self.conn = self.conn, None
        if c is not None:
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        self._drop()


class SdkProducer(_SdkWorker):
    """One message per PRODUCE; a failed send is re-sent with the same producer sequence."""

    def __init__(self, checker: Checker, name: str, address: str, topic: str, deadline: float,
                 rate: float, path: str = "sdk") -> None:
        super().__init__(name, deadline)
        self.checker, self.address, self.topic, self.rate, self.path = checker, address, topic, rate, path
        self.seq = 0
        self.retries = 0
        self.unacked_left = 0
        self._producing = threading.Event()
        self._producing.set()
        self.conn = None

    def finish(self) -> None:
        self._producing.clear()

    def unacked(self) -> int:
        return self.unacked_left

    def run(self) -> None:
        errors = sdk_errors()
        props = make_props(qos=1)
        producer = None
        pace = _Pacer(self.rate)
        while self.running() and self._producing.is_set():
            self.seq += 1
            self.checker.sent(self.name, self.seq, 1, self.path)
            packed = W.encode_messages_for_produce([(self.topic, body(self.name, self.seq, SIZE), (), props, 0, 0)])
            pseq = None
            self.unacked_left = 1
            while self.running():        # until acknowledged: the same PRODUCE sequence every time
                try:
                    if producer is None:
                        self.conn = sdk_connect(self.address)
                        producer = self.conn.producer(f"chaos-{self.name}")
                    if pseq is None:
                        pseq = producer.next_sequence()
                    results = producer.send_packed(1, packed, seq=pseq)
                    self.on_ack(self.seq, results)
                    self.unacked_left = 0
                    break
                except errors as e:
                    # a fresh connection for the retry (one cut by a stopped store may hang on)
                    self.note(e)
                    self.retries += 1
                    self._drop()
                    producer = None
                    self.wait(0.2)
            self.wait(pace.delay())

    def on_ack(self, seq: int, results: list) -> None:
        """Message `seq` is acknowledged (`results`: the SendResults of its PRODUCE)."""
        self.checker.acked(self.name, seq)

    def stats(self) -> dict:
        return {**super().stats(), "sent": self.seq, "retries": self.retries, "unacked": self.unacked_left}


class _SdkReader(_SdkWorker):
    """A reader over the SDK (``_open`` it on a connection, ``_read`` a batch, ``_settle`` it):
    records each body as ``self.receiver``, settles a batch once recorded, idles 50 ms when there
    was none. After an error it reconnects and opens its reader again (it resumes from what the
    store kept: the committed offset, the un-acked messages)."""

    receiver = ""
    restarts = 0

    def _open(self, conn):
        raise NotImplementedError

    def _read(self, reader) -> list:
        raise NotImplementedError

    def _settle(self, reader, recs: list) -> None:
        raise NotImplementedError

    def run(self) -> None:
        errors = sdk_errors()
        reader = None
        while self.running():
            try:
                if reader is None:
                    self.conn = sdk_connect(self.address)
                    reader = self._open(self.conn)
                recs = self._read(reader)
                for r in recs:
                    self.checker.received(self.receiver, r.body)
                if recs:
                    self._settle(reader, recs)
                else:
                    self.wait(0.05)
            except errors as e:
                self.note(e)
                self.restarts += 1
                self._drop()
                reader = None
                self.wait(0.2)


class SdkGroupConsumer(_SdkReader):
    """A consumer-group member of `topic` (a first level: its ConsumeQueue 0): poll, record, commit.
    After an error it reconnects and resumes from the group's committed offset."""

    def __init__(self, checker: Checker, name: str, address: str, topic: str, group: str, deadline: float,
                 path: str = "sdk") -> None:
        super().__init__(name, deadline)
        self.address, self.topic, self.group = address, topic, group
        self.checker, self.receiver = checker, name
        checker.receiver(name, path, 1)
        self.conn = None
        self.restarts = 0

    def _open(self, conn):
        return conn.consumer(self.topic, self.group, start="earliest", max_count=256, prefetch=False)

    def _read(self, cons) -> list:
        return cons.poll()

    def _settle(self, cons, recs: list) -> None:
        cons.commit()

    def stats(self) -> dict:
        return {**super().stats(), "restarts": self.restarts}


class PopMember(_SdkReader):
    """One POP member of `group` on `topic` (ConsumeQueue 0): pop, record, ack. Records as
    `receiver` (shared by the group's members; unordered: un-acked messages come back later)."""

    def __init__(self, checker: Checker, name: str, receiver: str, address: str, topic: str, group: str,
                 deadline: float, invisible_ms: int = 3000, path: str = "pop") -> None:
        super().__init__(name, deadline)
        self.checker, self.receiver, self.address, self.topic, self.group = checker, receiver, address, topic, group
        self.invisible_ms = invisible_ms
        checker.receiver(receiver, path, 1, ordered=False)
        self.conn = None
        self.popped = 0

    def _open(self, conn):
        # max_attempts: far above what the faults cause, so nothing goes to the DLQ
        return conn.pop_consumer(self.topic, self.group, invisible_ms=self.invisible_ms, max_attempts=1000)

    def _read(self, pc) -> list:
        recs = pc.pop(32)
        self.popped += len(recs)
        return recs

    def _settle(self, pc, recs: list) -> None:
        pc.ack(recs)

    def stats(self) -> dict:
        return {**super().stats(), "popped": self.popped}
