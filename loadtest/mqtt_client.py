"""A minimal asyncio MQTT client built for load: pre-encoded packets, batched writes and reads.

Why not paho or amqtt's client: a load generator must not be the bottleneck, and both spend
tens of microseconds of Python per message. Here:

* outgoing control packets (CONNECT, SUBSCRIBE, DISCONNECT) are encoded by the gateway's sans-IO
  codec (``gateway.mqtt.encode``); PUBLISH packets come from ``PublishTemplate`` once per
  publisher and only the 16-byte stamp and the packet id change per message, so a batch is one
  ``struct.pack`` (or, for a few messages, a patched copy) and costs one ``transport.write``;
* incoming packets other than PUBLISH/PUBACK/PUBREC/PUBREL/PUBCOMP go to the codec's ``Decoder``.
  The full ``Decoder.feed`` costs ~7.6 µs per 64-byte QoS 1 PUBLISH (it builds a ``Publish``
  object and validates the topic's UTF-8); at fan-out rates of 10^5 msg/s that is the
  difference between measuring the broker and measuring ourselves. The five high-rate types go
  through a same-shape fast path (one precompiled ``struct`` per connection, column-wise for
  long reads: 0.7-2.3 µs per message) or a bounds-checked scanner that reads only QoS, packet id
  and the stamp (~2.5 µs). Acks owed for one read are sent in one write.

One ``Client`` is one MQTT connection. It knows nothing about scenarios: deliveries are
accounted into the (subscriber, publisher) ``Stream``s of a shared ``Sink`` and their latencies
appended to it; acks release window slots through ``on_acks``.
"""
from __future__ import annotations

import asyncio
import struct
import time
from itertools import chain as _chain_mod, repeat as _repeat
from operator import or_ as _or, sub as _sub
from typing import TYPE_CHECKING, Callable

from lmqtt.gateway.mqtt import Decoder, ProtocolError, PublishTemplate, encode, packets as P

from .stamp import STAMP, STAMP_SIZE, Stream, Tracker, make_payload

if TYPE_CHECKING:
    import ssl

_U16 = struct.Struct("!H")
_ACK = struct.Struct("!HH")
_U32 = struct.Struct("!I").pack
_chain = _chain_mod.from_iterable
_STAMP_UNPACK = STAMP.unpack_from
_STAMP_PACK = STAMP.pack_into
_monotonic_ns = time.monotonic_ns


class MqttError(Exception):
    """Connection refused, subscription rejected or protocol failure, with the reason."""


class StampedPublisher:
    """Pre-encoded PUBLISH packets for one publisher; patches stamp and packet id per message.

    A batch of ``n`` >= 16 messages is one ``struct.pack`` of a format that repeats the packet
    ``n`` times (constant prefix, [packet id], stamp, constant padding), fed by C-level
    iterators: no Python loop per message (formats cached per batch size). Smaller batches
    patch stamp and packet id into a copy of the packet, which costs less at that size.
    """

    __slots__ = ("pub_id", "qos", "packet", "plen", "stamp_at", "pid_at", "_pre", "_mid",
                 "_tail", "_one", "_fmts")

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
        pkt = self.packet
        if qos:
            self._pre = pkt[:self.pid_at]
            self._mid = pkt[self.pid_at + 2:self.stamp_at]  # MQTT 5 properties, if any
            self._one = f"{len(self._pre)}sH{len(self._mid)}sIIQ{size - STAMP_SIZE}s"
        else:
            self._pre = pkt[:self.stamp_at]
            self._mid = b""
            self._one = f"{len(self._pre)}sIIQ{size - STAMP_SIZE}s"
        self._tail = pkt[self.stamp_at + STAMP_SIZE:]
        self._fmts: dict[int, struct.Struct] = {}

    def batch(self, first_seq: int, pids: list[int] | None, n: int) -> bytes | bytearray:
        """``n`` consecutive messages starting at ``first_seq`` as one buffer."""
        now = _monotonic_ns()
        if n < 16:  # QoS 1 refills (5-10) and fixed-rate ticks: patching a copy is cheaper
            buf = bytearray(self.packet) * n
            pack = _STAMP_PACK
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
        st = self._fmts.get(n)
        if st is None:
            st = self._fmts[n] = struct.Struct("!" + self._one * n)
        seqs = range(first_seq, first_seq + n)
        if first_seq + n > 0xFFFFFFFF:
            seqs = [q & 0xFFFFFFFF for q in seqs]
        if self.qos:
            fields = zip(_repeat(self._pre, n), pids, _repeat(self._mid, n), _repeat(self.pub_id, n),
                         seqs, _repeat(now, n), _repeat(self._tail, n))
        else:
            fields = zip(_repeat(self._pre, n), _repeat(self.pub_id, n), seqs, _repeat(now, n),
                         _repeat(self._tail, n))
        return st.pack(*_chain(fields))


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
        self.buf = b""
        self.shape = None  # learned PUBLISH shape for the fast path; False = do not try
        self.shape_misses = 0
        self.decoder = Decoder(version=version, server_side=False)
        self.waiters: dict[str, asyncio.Future] = {}
        self.closed = asyncio.get_event_loop().create_future()
        self.paused = False
        self.on_resume: Callable[[], None] | None = None
        # publisher side: acks release window slots
        self.on_acks: Callable[[int], None] | None = None
        self.inflight: set[int] = set()
        self.received = 0
        self.reads = 0  # data_received calls: messages per read shows how well reads batch
        # receive time of the data being fed (ns, CLOCK_MONOTONIC) when the caller knows it (the
        # paced worker: the kernel's arrival time); 0 = read the clock while parsing
        self.rx_ns = 0
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
        # Reads of a flat-out run hold many packets of one shape (every PUBLISH on a subscriber
        # connection has the same header, topic length and payload size; every packet on a
        # QoS 1 publisher connection is a 4-byte PUBACK). Those take a fast path that unpacks
        # only the stamp (and packet id) with one precompiled ``struct`` per connection, and
        # for long reads works column-wise with C-level list operations instead of a Python
        # loop per message; anything else goes through the general scanner ``_scan``.
        self.reads += 1
        buf = self.buf + data if self.buf else data
        n = len(buf)
        shape = self.shape
        if shape:
            k = n // shape[1]
            if k >= 16:
                pos = self._fast_publish(buf, k, shape)
            elif k:  # short reads: a row at a time (column set-up costs more than it saves)
                pos = self._fast_rows(buf, k, shape)
            else:
                pos = 0
            if pos < n:
                self._scan(buf, pos)
            else:
                self.buf = b""
            return
        if self.sink is None and n >= 4 and not n & 3 and buf[0] == 0x40 and buf[1] == 2:
            if self._fast_acks(buf, n >> 2):
                self.buf = b""
                return
        self._scan(buf, 0)

    def _learn(self, buf, pos: int, hdr: int, body: int, qos: int, payload: int) -> None:
        """Remember this PUBLISH's shape: header bytes up to the topic, topic length, payload."""
        tlen = (buf[body] << 8) | buf[body + 1]
        head = hdr + 2  # fixed header + the topic length field
        fmt = f"!{head}s{tlen}x{'H' if qos else ''}IIQ{payload - STAMP_SIZE}x"
        st = struct.Struct(fmt)
        self.shape = (st, st.size, bytes(buf[pos:pos + head]), qos)
        self.shape_misses = 0

    def _fast_publish(self, buf, k: int, shape) -> int:
        """Account the ``k`` (>= 16) PUBLISH packets of the learned shape at the start of ``buf``,
        column-wise.

        Returns the offset of the first byte not consumed (a partial packet, or a packet of
        another kind or shape, which the caller hands to ``_scan``). Exact, not heuristic:
        ``buf`` starts on a packet boundary, and a packet whose first bytes (type, flags,
        remaining length, topic length) equal the learned header has exactly the learned
        length, so the next one starts on a boundary too.
        """
        st, size, head, qos = shape
        cols = tuple(zip(*st.iter_unpack(memoryview(buf)[:k * size])))
        off = k * size
        if cols[0].count(head) != k:
            k = cols[0].index(next(h for h in cols[0] if h != head))
            if not k:
                return self._miss()
            cols = tuple(c[:k] for c in cols)
            off = k * size
        self.shape_misses = 0
        if qos:
            _, pids, pubs, seqs, sents = cols
            if self.transport is not None:
                word = 0x40020000 if qos == 1 else 0x50020000
                self.transport.write(struct.pack(f"!{k}I", *map(_or, pids, _repeat(word, k))))
        else:
            _, pubs, seqs, sents = cols
        self.received += k
        sink = self.sink
        if sink is None:
            return off
        streams = self.streams
        p0 = pubs[0]
        if pubs.count(p0) == k:  # one publisher (fan-out, pairs): check the run in one go
            stream = streams.get(p0)
            if stream is None:
                stream = self._stream(p0)
            hi = stream.hi
            if seqs[0] == hi + 1 and seqs[-1] == hi + k and (k < 3 or seqs == tuple(range(hi + 1, hi + k + 1))):
                stream.hi = hi + k
                stream.unique += k
            else:
                see = stream.see
                for seq in seqs:
                    see(seq)
        else:
            get = streams.get
            for pub, seq in zip(pubs, seqs):
                stream = get(pub)
                if stream is None:
                    stream = self._stream(pub)
                if seq == stream.hi + 1:
                    stream.hi = seq
                    stream.unique += 1
                else:
                    stream.see(seq)
        now = self.rx_ns or _monotonic_ns()
        sink.lat.extend(map(_sub, _repeat(now, k), sents))
        sink.last_ns = now
        return off

    def _fast_rows(self, buf, k: int, shape) -> int:
        """Like ``_fast_publish`` for short reads: one ``unpack_from`` and inline accounting each."""
        st, size, head, qos = shape
        unpack = st.unpack_from
        sink = self.sink
        streams = self.streams
        lat = sink.lat if sink is not None else None
        acks = None
        now = self.rx_ns or _monotonic_ns()
        off = 0
        got = 0
        for off in range(0, k * size, size):
            r = unpack(buf, off)
            if r[0] != head:
                break
            got += 1
            if qos:
                _, pid, pub, seq, sent = r
                if acks is None:
                    acks = bytearray()
                acks += _U32(pid | (0x40020000 if qos == 1 else 0x50020000))
            else:
                _, pub, seq, sent = r
            if lat is not None:
                stream = streams.get(pub)
                if stream is None:
                    stream = self._stream(pub)
                if seq == stream.hi + 1:
                    stream.hi = seq
                    stream.unique += 1
                else:
                    stream.see(seq)
                lat.append(now - sent)
        else:
            off = k * size
        if not got:
            return self._miss()
        self.shape_misses = 0
        self.received += got
        if lat is not None:
            sink.last_ns = now
        if acks is not None and self.transport is not None:
            self.transport.write(acks)
        return off

    def _miss(self) -> int:
        self.shape_misses += 1
        if self.shape_misses > 3:  # several reads in a row missed: the shapes vary, stop trying
            self.shape = False
        return 0

    def _fast_acks(self, buf, k: int) -> bool:
        """``k`` PUBACKs filling ``buf`` (a QoS 1 publisher's usual read); False if not all are."""
        kinds, pids = zip(*_ACK.iter_unpack(buf))
        if kinds.count(0x4002) != k:
            return False
        inflight = self.inflight
        before = len(inflight)
        inflight.difference_update(pids)
        released = before - len(inflight)
        if released and self.on_acks is not None:
            self.on_acks(released)
        return True

    def _scan(self, buf: bytes, pos: int) -> None:
        """The general packet scanner: any packet type, any shape, bounds-checked.

        Used for reads the fast paths do not cover (mixed packet types, a PUBLISH of another
        shape, MQTT 5 properties, QoS 2 handshakes); it also learns the connection's PUBLISH
        shape from the first stamped PUBLISH it parses, so the next reads can take the fast path.
        """
        n = len(buf)
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
                if self.shape is None and self.version == 4 and end - p >= STAMP_SIZE:
                    self._learn(buf, pos, hdr, body, qos, end - p)
                if lat is not None and end - p >= STAMP_SIZE:
                    if not now:
                        now = self.rx_ns or _monotonic_ns()
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
        self.buf = bytes(buf[pos:]) if pos < n else b""
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

    def expect(self, name: str) -> asyncio.Future:
        f = asyncio.get_event_loop().create_future()
        self.waiters[name] = f
        return f

    async def handshake(self, *, clean: bool = True, keepalive: int = 300,
                        session_expiry: int | None = None, timeout: float = 30.0,
                        username: str | None = None, password: bytes | None = None) -> P.ConnAck:
        props = P.Properties()
        if self.version == 5 and session_expiry is not None:
            props.session_expiry_interval = session_expiry
        fut = self.expect("ConnAck")
        self.transport.write(encode(P.Connect(self.client_id, self.version, clean, keepalive, username, password,
                                              properties=props), self.version))
        ack = await asyncio.wait_for(fut, timeout)
        if ack.reason_code != 0:
            raise MqttError(f"{self.client_id}: CONNACK refused with code {ack.reason_code:#x}")
        return ack

    async def subscribe(self, topic_filter: str, qos: int, packet_id: int = 1,
                        timeout: float = 30.0) -> None:
        fut = self.expect("SubAck")
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


_TLS_CONTEXTS: dict[str, "ssl.SSLContext"] = {}


def tls_context(cafile: str):
    """A client TLS context trusting `cafile`, one per file (loading a CA per connection would be
    the generator's cost, not the broker's)."""
    import ssl  # only TLS, when configured
    ctx = _TLS_CONTEXTS.get(cafile)
    if ctx is None:
        ctx = _TLS_CONTEXTS[cafile] = ssl.create_default_context(cafile=cafile)
    return ctx


async def connect(host: str, port: int, client_id: str, version: int = 4, *, sub_id: int = -1,
                  sink: Sink | None = None, clean: bool = True, session_expiry: int | None = None,
                  timeout: float = 30.0, tls_ca: str | None = None, username: str | None = None,
                  password: str | None = None) -> Client:
    """Open a TCP (or, with `tls_ca`, TLS) connection and complete the MQTT handshake."""
    loop = asyncio.get_running_loop()
    tls = {"ssl": tls_context(tls_ca), "server_hostname": host} if tls_ca else {}
    _, client = await asyncio.wait_for(
        loop.create_connection(lambda: Client(client_id, version, sub_id=sub_id, sink=sink), host, port, **tls),
        timeout)
    try:
        client.connack = await client.handshake(clean=clean, session_expiry=session_expiry,
                                                timeout=timeout, username=username,
                                                password=password.encode() if password is not None else None)
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
        if n == 1:
            inflight = self.inflight
            pid = self.next % 0xFFFF + 1
            while pid in inflight:
                pid = pid % 0xFFFF + 1
            inflight.add(pid)
            self.next = pid
            return [pid]
        first = self.next + 1
        if first + n <= 0x10000:  # usual case: the next n ids are free (set ops in C)
            ids = range(first, first + n)
            if self.inflight.isdisjoint(ids):
                self.inflight.update(ids)
                self.next = first + n - 1
                return list(ids)
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
