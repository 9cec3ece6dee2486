"""A minimal asyncio MQTT client built for load: pre-encoded packets, batched writes and reads.

Why not paho or amqtt's client: a load generator must not be the bottleneck, and both spend
tens of microseconds of Python per message. Here:

* outgoing control packets (CONNECT, SUBSCRIBE, DISCONNECT) are encoded by the gateway's sans-IO
  codec (``gateway.mqtt.encode``); PUBLISH packets come from ``PublishTemplate`` once per
  publisher and only the 16-byte stamp and the packet id are patched per message, into one
  bytearray per batch so a batch costs one ``transport.write``;
* incoming packets other than PUBLISH/PUBACK/PUBREC/PUBREL/PUBCOMP go to the codec's ``Decoder``.
  The five high-rate packet types are split out by a small frame scanner that reads only the
  fields the benchmark needs (QoS, packet id and the 16-byte stamp). Profiled on this machine, the
  full ``Decoder.feed`` costs ~7.6 µs per 64-byte QoS 1 PUBLISH (it builds a ``Publish`` object and
  validates the topic's UTF-8), the scanner ~1 µs; at fan-out rates of 10^5 msg/s that is the
  difference between measuring the broker and measuring ourselves. Acks owed for one read are
  sent in one write.

One ``Client`` is one MQTT connection. It knows nothing about scenarios: callbacks report
deliveries (``on_message(publisher, seq, sent_ns, recv_ns)`` via a shared sink) and acks.
"""
from __future__ import annotations

import asyncio
import struct
import time
from typing import Callable

from gateway.mqtt import Decoder, ProtocolError, PublishTemplate, encode
from gateway.mqtt import packets as P

from .stamp import STAMP, STAMP_SIZE, Stream, Tracker, make_payload

_U16 = struct.Struct("!H")
_STAMP_UNPACK = STAMP.unpack_from
_monotonic_ns = time.monotonic_ns


class MqttError(Exception):
    """Connection refused, subscription rejected or protocol failure, with the reason."""


class StampedPublisher:
    """Pre-encoded PUBLISH packets for one publisher; patches stamp and packet id per message."""

    __slots__ = ("pub_id", "qos", "packet", "plen", "stamp_at", "pid_at")

    def __init__(self, pub_id: int, topic: str, size: int, qos: int, version: int,
                 retain: bool = False) -> None:
        self.pub_id, self.qos = pub_id, qos
        tmpl = PublishTemplate(topic, bytes(make_payload(size)), qos, retain, None, version)
        self.packet = bytes(tmpl.for_packet_id(0xFFFF) if qos else tmpl.qos0)
        self.plen = len(self.packet)
        self.stamp_at = self.plen - size  # the payload is always the tail of a PUBLISH
        rl = 1
        while self.packet[rl] & 0x80:
            rl += 1
        self.pid_at = 1 + rl + 2 + len(topic.encode("utf-8"))

    def batch(self, first_seq: int, pids: list[int] | None, n: int) -> bytearray:
        """``n`` consecutive messages starting at ``first_seq`` as one buffer."""
        buf = bytearray(self.packet) * n
        pack = STAMP.pack_into
        now = _monotonic_ns()
        plen, sat, pid_at, pub = self.plen, self.stamp_at, self.pid_at, self.pub_id
        off = 0
        for i in range(n):
            pack(buf, off + sat, pub, (first_seq + i) & 0xFFFFFFFF, now)
            if pids is not None:
                pid = pids[i]
                buf[off + pid_at] = pid >> 8
                buf[off + pid_at + 1] = pid & 0xFF
            off += plen
        return buf


class Sink:
    """Where a worker's subscribers account what they receive (shared by all its connections).

    Each connection updates its (subscriber, publisher) ``Stream`` of ``tracker`` inline — the
    in-order case is two attribute updates — and appends the latency to ``lat``; the histogram
    is filled from ``lat`` in batches between reads (``take_latencies``).
    """

    __slots__ = ("tracker", "lat", "last_ns")

    def __init__(self, tracker: Tracker | None = None) -> None:
        self.tracker = tracker if tracker is not None else Tracker()
        self.lat: list[int] = []
        self.last_ns = 0

    def take_latencies(self) -> list[int]:
        out, self.lat = self.lat, []
        return out


class Client(asyncio.Protocol):
    """One MQTT connection. ``sub_id`` tags deliveries; publishing uses ``StampedPublisher``."""

    def __init__(self, client_id: str, version: int = 4, *, sub_id: int = -1,
                 sink: Sink | None = None) -> None:
        self.client_id, self.version, self.sub_id, self.sink = client_id, version, sub_id, sink
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.decoder = Decoder(version=version, server_side=False)
        self.waiters: dict[str, asyncio.Future] = {}
        self.closed = asyncio.get_event_loop().create_future()
        self.paused = False
        self.on_resume: Callable[[], None] | None = None
        # publisher side: acks release window slots
        self.on_acks: Callable[[int], None] | None = None
        self.inflight: set[int] = set()
        self.received = 0
        self.streams: dict[int, Stream] = {}  # publisher id -> this subscriber's stream of it
        self.error: str | None = None
        self.connack: P.ConnAck | None = None

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)
        for f in self.waiters.values():
            if not f.done():
                f.set_exception(MqttError(f"{self.client_id}: connection lost ({exc or 'closed by broker'})"))

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.on_resume is not None:
            self.on_resume()

    def _stream(self, pub: int) -> Stream:
        st = self.sink.tracker.streams.setdefault((self.sub_id, pub), Stream())
        self.streams[pub] = st
        return st

    def data_received(self, data: bytes) -> None:
        # Most reads hold whole packets: parse ``data`` in place and keep only a partial tail.
        if self.buf:
            self.buf += data
            buf = self.buf
        else:
            buf = data
        n = len(buf)
        pos = 0
        sink = self.sink
        streams = self.streams
        lat = sink.lat if sink is not None else None
        acks = None
        released = 0
        now = 0
        while pos + 2 <= n:
            b0 = buf[pos]
            # remaining length (varint)
            rl = buf[pos + 1]
            hdr = 2
            if rl & 0x80:
                rl &= 0x7F
                shift = 7
                while True:
                    if pos + hdr >= n:
                        rl = -1
                        break
                    b = buf[pos + hdr]
                    hdr += 1
                    rl |= (b & 0x7F) << shift
                    if not b & 0x80:
                        break
                    shift += 7
                    if hdr > 5:
                        self._fail("malformed remaining length from broker")
                        return
                if rl < 0:
                    break
            end = pos + hdr + rl
            if end > n:
                break
            t = b0 >> 4
            body = pos + hdr
            if t == 3:  # PUBLISH
                qos = (b0 >> 1) & 3
                p = body + 2 + ((buf[body] << 8) | buf[body + 1])
                if qos:
                    pid = (buf[p] << 8) | buf[p + 1]
                    p += 2
                    if acks is None:
                        acks = bytearray()
                    acks += (b"\x40\x02" if qos == 1 else b"\x50\x02")
                    acks.append(pid >> 8)
                    acks.append(pid & 0xFF)
                if self.version == 5:  # skip properties (varint length)
                    plen = 0
                    shift = 0
                    while p < end:
                        b = buf[p]
                        p += 1
                        plen |= (b & 0x7F) << shift
                        if not b & 0x80:
                            break
                        shift += 7
                    p += plen
                if p > end:  # topic / packet id / properties run past the packet
                    self._fail("malformed PUBLISH from broker (fields run past its length)")
                    return
                self.received += 1
                if lat is not None and end - p >= STAMP_SIZE:
                    if not now:
                        now = _monotonic_ns()
                    pub, seq, sent = _STAMP_UNPACK(buf, p)
                    st = streams.get(pub)
                    if st is None:
                        st = self._stream(pub)
                    if seq == st.hi + 1:  # the common case, inline
                        st.hi = seq
                        st.unique += 1
                    else:
                        st.see(seq)
                    lat.append(now - sent)
            elif 4 <= t <= 7 and rl < 2:
                self._fail(f"malformed packet type {t} from broker (remaining length {rl})")
                return
            elif t == 4 or t == 7:  # PUBACK / PUBCOMP: a publisher's window slot is free
                pid = (buf[body] << 8) | buf[body + 1]
                if pid in self.inflight:
                    self.inflight.discard(pid)
                    released += 1
            elif t == 5:  # PUBREC -> PUBREL
                pid = (buf[body] << 8) | buf[body + 1]
                if acks is None:
                    acks = bytearray()
                acks += b"\x62\x02"
                acks.append(pid >> 8)
                acks.append(pid & 0xFF)
            elif t == 6:  # PUBREL -> PUBCOMP (we are the QoS 2 receiver)
                pid = (buf[body] << 8) | buf[body + 1]
                if acks is None:
                    acks = bytearray()
                acks += b"\x70\x02"
                acks.append(pid >> 8)
                acks.append(pid & 0xFF)
            else:
                try:
                    for pkt in self.decoder.feed(bytes(buf[pos:end])):
                        self._control(pkt)
                except ProtocolError as e:
                    self._fail(f"protocol error from broker: {e}")
                    return
            pos = end
        if pos < n:
            self.buf = bytearray(buf[pos:]) if pos else (buf if isinstance(buf, bytearray) else bytearray(buf))
        elif self.buf:
            self.buf = bytearray()
        if sink is not None and now:
            sink.last_ns = now
        if acks is not None and self.transport is not None:
            self.transport.write(acks)
        if released and self.on_acks is not None:
            self.on_acks(released)

    # -- control packets ---------------------------------------------------------------------
    def _control(self, pkt) -> None:
        name = type(pkt).__name__
        f = self.waiters.pop(name, None)
        if f is not None and not f.done():
            f.set_result(pkt)
        elif isinstance(pkt, P.Disconnect):
            self.error = f"broker sent DISCONNECT reason {pkt.reason_code:#x}"

    def _fail(self, why: str) -> None:
        self.error = why
        if self.transport is not None:
            self.transport.close()

    def _expect(self, name: str) -> asyncio.Future:
        f = asyncio.get_event_loop().create_future()
        self.waiters[name] = f
        return f

    async def handshake(self, *, clean: bool = True, keepalive: int = 300,
                        session_expiry: int | None = None, timeout: float = 30.0) -> P.ConnAck:
        props = P.Properties()
        if self.version == 5 and session_expiry is not None:
            props.session_expiry_interval = session_expiry
        fut = self._expect("ConnAck")
        self.transport.write(encode(P.Connect(self.client_id, self.version, clean, keepalive,
                                              properties=props), self.version))
        ack = await asyncio.wait_for(fut, timeout)
        if ack.reason_code != 0:
            raise MqttError(f"{self.client_id}: CONNACK refused with code {ack.reason_code:#x}")
        return ack

    async def subscribe(self, topic_filter: str, qos: int, packet_id: int = 1,
                        timeout: float = 30.0) -> None:
        fut = self._expect("SubAck")
        self.transport.write(encode(P.Subscribe(packet_id, [P.SubscriptionRequest(topic_filter, qos)]),
                                    self.version))
        ack = await asyncio.wait_for(fut, timeout)
        if not ack.reason_codes or ack.reason_codes[0] >= 0x80:
            raise MqttError(f"{self.client_id}: SUBACK rejected {topic_filter!r}: {ack.reason_codes}")

    def disconnect(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            try:
                self.transport.write(encode(P.Disconnect(), self.version))
            finally:
                self.transport.close()


async def connect(host: str, port: int, client_id: str, version: int = 4, *, sub_id: int = -1,
                  sink: Sink | None = None, clean: bool = True, session_expiry: int | None = None,
                  timeout: float = 30.0) -> Client:
    """Open a TCP connection and complete the MQTT handshake."""
    loop = asyncio.get_running_loop()
    _, client = await asyncio.wait_for(
        loop.create_connection(lambda: Client(client_id, version, sub_id=sub_id, sink=sink), host, port),
        timeout)
    try:
        client.connack = await client.handshake(clean=clean, session_expiry=session_expiry,
                                                timeout=timeout)
    except BaseException:
        client.transport.close()
        raise
    return client


class PidAllocator:
    """Packet ids 1..65535 for one connection, skipping ids still in flight."""

    __slots__ = ("next", "inflight")

    def __init__(self, inflight: set[int]) -> None:
        self.next = 0
        self.inflight = inflight

    def take(self, n: int) -> list[int]:
        out = []
        inflight = self.inflight
        pid = self.next
        while len(out) < n:
            pid = pid % 0xFFFF + 1
            if pid not in inflight:
                inflight.add(pid)
                out.append(pid)
        self.next = pid
        return out
