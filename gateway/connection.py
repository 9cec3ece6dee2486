"""One MQTT network connection: bytes <-> packets, coalesced writes, flow control flags.

Why `asyncio.Protocol` and not streams: no task per connection and no coroutine per packet. Bytes
arrive in `data_received`, the sans-IO decoder turns them into packets, the broker handles each
synchronously. Everything a connection sends during one loop iteration is joined and written with
one `transport.write` at the end of that iteration (one syscall per tick, not per packet): the
broker keeps one list of connections with pending output and flushes it with ONE loop callback, or
right away at the end of a delivery run / an ack batch (`Broker.flush_writes`), so a PUBLISH or
PUBACK does not wait one more loop iteration before its `send`.
The transport's write-buffer limits drive back-pressure: `pause_writing` marks the connection
`write_blocked`, which stops delivery pulling for it until `resume_writing`.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from lmqtt.gateway.mqtt import Decoder, ProtocolError, encode, packets as P

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.broker import Broker
    from lmqtt.gateway.session import Session

log = logging.getLogger("lmqtt.gateway.conn")

_CONNACK_V5_CODES = frozenset({0x80, 0x81, 0x82, 0x83, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C, 0x90,
                               0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F})


class MQTTConnection(asyncio.Protocol):
    def __init__(self, broker: "Broker") -> None:
        self.b = broker
        self.metrics = broker.metrics
        self.loop = broker.loop
        self.transport: asyncio.Transport | None = None
        # decoded packets are only read by the broker, never mutated: share the empty Properties
        self.decoder = Decoder(max_packet_size=broker.cfg.max_packet_size, share_empty_properties=True)
        self.version = 4
        self.session: Session | None = None
        self.client_id: str | None = None
        self.connected = False        # CONNECT accepted
        self.closing = False          # close() called: no more writes
        self.closed = False           # connection_lost seen
        self.write_blocked = False
        self.will: P.Will | None = None
        self.keepalive = 0
        self.last_rx = self.loop.time()
        self.accepted_at = self.last_rx
        self.pending_publishes = 0
        self.valid_topics: set[str] = set()   # PUBLISH topics already validated on this connection
        self._reading_paused = False
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self.peer = "?"

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport
        cfg = self.b.cfg
        transport.set_write_buffer_limits(high=cfg.write_high_water, low=cfg.write_low_water)
        pn = transport.get_extra_info("peername")
        self.peer = f"{pn[0]}:{pn[1]}" if pn else "?"
        self.b.on_accept(self)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        self.last_rx = self.loop.time()
        self.metrics.bytes_in += len(data)
        try:
            packets = self.decoder.feed(data)
        except ProtocolError as e:
            self.protocol_error(e.reason_code, str(e))
            return
        b = self.b
        handle = b.handle_packet
        for pkt in packets:
            if self.closing:
                return
            try:
                # the two QoS 1 hot-path packets skip the generic dispatch table (CONNECT accepted:
                # the decoder lets nothing but CONNECT through before it, `connected` after it)
                t = type(pkt)
                if t is P.Publish and self.connected:
                    b._on_publish(self, pkt)
                elif t is P.PubAck and self.connected:
                    b._on_puback(self, pkt)
                else:
                    handle(self, pkt)
            except ProtocolError as e:
                self.protocol_error(e.reason_code, str(e))
                return
            except Exception as e:  # a bug must cost one connection, never the server
                log.exception("event=packet_handler_failed client_id=%s packet=%s", self.client_id,
                              type(pkt).__name__)
                self.close_with_error(0x83, f"internal error: {type(e).__name__}")
                return

    def eof_received(self):
        return False  # close the transport

    def pause_writing(self) -> None:
        if not self.write_blocked:
            self.write_blocked = True
            self.metrics.paused_sessions.inc()

    def resume_writing(self) -> None:
        if self.write_blocked:
            self.write_blocked = False
            self.metrics.paused_sessions.dec()
            if self.session is not None and self.session.conn is self:
                self.b.delivery.kick(self.session)

    def connection_lost(self, exc) -> None:
        if self.write_blocked:
            self.write_blocked = False
            self.metrics.paused_sessions.dec()
        self.closing = True
        self.closed = True
        self._out.clear()
        self.b.on_connection_lost(self, exc)

    # -- output ------------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.closing:
            return
        self._out.append(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.b.want_flush(self)

    def send(self, pkt) -> None:
        self.write(encode(pkt, self.version))

    def _flush(self) -> None:
        self._flush_scheduled = False
        out = self._out
        if not out or self.transport is None or self.transport.is_closing():
            out.clear()
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        self.metrics.bytes_out += len(data)
        self.transport.write(data)

    @property
    def buffered(self) -> int:
        t = self.transport
        return t.get_write_buffer_size() if t is not None else 0

    # -- closing -----------------------------------------------------------------------------
    def close(self) -> None:
        """Flush what is queued, then close the socket (connection_lost follows)."""
        if self.closing:
            return
        self._flush()
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def close_with_error(self, reason_code: int, reason: str = "") -> None:
        """Server-initiated close: MQTT 5 DISCONNECT with the reason (after CONNECT), then close.

        The will message stays armed: a close for any reason but the client's DISCONNECT 0x00 sends it.
        """
        if self.closing:
            return
        if self.connected and self.version == 5:
            d = P.Disconnect(reason_code)
            if reason:
                d.properties.reason_string = reason[:200]
            self.send(d)
        log.info("event=close client_id=%s peer=%s reason_code=0x%02X reason=%r", self.client_id, self.peer,
                 reason_code, reason)
        self.close()

    def protocol_error(self, reason_code: int, reason: str) -> None:
        self.metrics.protocol_errors.inc()
        log.warning("event=protocol_error client_id=%s peer=%s reason_code=0x%02X error=%r",
                    self.client_id, self.peer, reason_code, reason)
        if not self.connected:
            if self.decoder.version == 5:
                # a malformed MQTT 5 CONNECT is answered with CONNACK + reason code (§4.13.1)
                rc = reason_code if reason_code in _CONNACK_V5_CODES else 0x81
                ack = P.ConnAck(False, rc)
                ack.properties.reason_string = reason[:200]
                self.write(encode(ack, 5))
            elif reason_code == 0x84:  # unsupported protocol level: 3.1.1 CONNACK 0x01
                self.write(b"\x20\x02\x00\x01")
            self.close()
            return
        self.close_with_error(reason_code, reason)

    # -- inbound flow control ----------------------------------------------------------------
    def pause_reading_for_store(self) -> None:
        if not self._reading_paused and self.transport is not None and not self.closing:
            self._reading_paused = True
            self.transport.pause_reading()

    def maybe_resume_reading(self) -> None:
        if self._reading_paused and self.pending_publishes < self.b.cfg.max_pending_publish // 2:
            self._reading_paused = False
            if self.transport is not None and not self.closing:
                self.transport.resume_reading()
