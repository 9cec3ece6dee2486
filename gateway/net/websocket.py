"""MQTT over WebSocket: an asyncio protocol that speaks WebSocket on the socket and hands the MQTT
connection inside it an ordinary byte stream, so the MQTT protocol above runs unchanged.

The WebSocket protocol itself (HTTP upgrade handshake, framing, masking, ping/pong, close
handshake) is wsproto's, a sans-IO library like our own MQTT codec; this module only moves bytes
between the socket, wsproto and the inner protocol. As MQTT 5.0 §6 requires: binary frames only
(a text frame closes the connection with 1003), the `mqtt` subprotocol is selected when the client
offers it (clients that offer none, like some browsers' defaults, are still accepted), MQTT packets
may span frames and frames may hold several packets. Only `path` is served (default `/mqtt`);
other paths get HTTP 404 before any upgrade.

The inner protocol sees a transport with the calls asyncio's TCP transports offer and the MQTT
connection uses (`write`, `close`, `is_closing`, `get_extra_info`, `pause_reading`,
`resume_reading`, `set_write_buffer_limits`, `get_write_buffer_size`, `abort`), and receives
`pause_writing`/`resume_writing` from the real socket's back-pressure.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from wsproto import ConnectionType, WSConnection
from wsproto.events import (AcceptConnection, BytesMessage, CloseConnection, Ping, RejectConnection, Request,
                            TextMessage)
from wsproto.utilities import RemoteProtocolError

SUBPROTOCOL = "mqtt"


class _InnerTransport(asyncio.Transport):
    """What the inner (MQTT) protocol writes to: each write becomes one binary WebSocket message."""

    def __init__(self, outer: "WebSocketProtocol") -> None:
        super().__init__()
        self._outer = outer

    def write(self, data) -> None:
        self._outer._send_binary(bytes(data))

    def writelines(self, chunks) -> None:
        self.write(b"".join(chunks))

    def close(self) -> None:
        self._outer._close(1000, "")

    def abort(self) -> None:
        t = self._outer.transport
        if t is not None:
            t.abort()

    def is_closing(self) -> bool:
        t = self._outer.transport
        return self._outer._closing or t is None or t.is_closing()

    def get_extra_info(self, name, default=None):
        if name == "websocket_path":
            return self._outer.path
        if name == "websocket_subprotocol":
            return self._outer.subprotocol
        t = self._outer.transport
        return t.get_extra_info(name, default) if t is not None else default

    def pause_reading(self) -> None:
        t = self._outer.transport
        if t is not None:
            t.pause_reading()

    def resume_reading(self) -> None:
        t = self._outer.transport
        if t is not None:
            t.resume_reading()

    def is_reading(self) -> bool:
        t = self._outer.transport
        return t is not None and t.is_reading()

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        t = self._outer.transport
        if t is not None:
            t.set_write_buffer_limits(high=high, low=low)

    def get_write_buffer_size(self) -> int:
        t = self._outer.transport
        return t.get_write_buffer_size() if t is not None else 0

    def can_write_eof(self) -> bool:
        return False


class WebSocketProtocol(asyncio.Protocol):
    """One WebSocket connection carrying one inner protocol (`inner_factory()`, e.g. the MQTT
    connection), started once the upgrade is accepted."""

    def __init__(self, inner_factory: Callable[[], asyncio.Protocol], path: str = "/mqtt",
                 max_message_bytes: int = 1 << 20) -> None:
        self._factory = inner_factory
        self.path = path
        self._max = max_message_bytes
        self.ws = WSConnection(ConnectionType.SERVER)
        self.transport: asyncio.Transport | None = None
        self.inner: asyncio.Protocol | None = None
        self.subprotocol: str | None = None
        self._closing = False
        self._partial = 0

    # -------------------------------------------------------------------- socket side
    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.ws.receive_data(data)
            self._handle_events()
        except RemoteProtocolError as e:
            # a malformed handshake or frame: answer what wsproto prepared (400 / close 1002)
            self._flush_ws(getattr(e, "event_hint", None))
            self._drop()

    def eof_received(self):
        try:
            self.ws.receive_data(None)
            self._handle_events()
        except RemoteProtocolError:
            pass
        return False

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc) -> None:
        self.transport = None
        inner, self.inner = self.inner, None
        if inner is not None:
            inner.connection_lost(exc)

    # ------------------------------------------------------------------ WebSocket events
    def _handle_events(self) -> None:
        for ev in self.ws.events():
            if isinstance(ev, Request):
                self._on_request(ev)
            elif isinstance(ev, BytesMessage):
                self._partial += len(ev.data)
                if self._partial > self._max:
                    self._close(1009, "message too big")
                    return
                if ev.message_finished:
                    self._partial = 0
                if self.inner is not None and ev.data:
                    self.inner.data_received(bytes(ev.data))
            elif isinstance(ev, TextMessage):
                self._close(1003, "MQTT over WebSocket uses binary frames")   # MQTT 5.0 §6
                return
            elif isinstance(ev, Ping):
                self._write(self.ws.send(ev.response()))
            elif isinstance(ev, CloseConnection):
                if self.ws.state.name not in ("CLOSED", "LOCAL_CLOSING"):
                    try:
                        self._write(self.ws.send(ev.response()))
                    except Exception:
                        pass
                self._drop()
                return

    def _on_request(self, req: Request) -> None:
        if req.target.split("?", 1)[0] != self.path:
            self._write(self.ws.send(RejectConnection(status_code=404, headers=[(b"content-length", b"0")])))
            self._drop()
            return
        self.subprotocol = SUBPROTOCOL if SUBPROTOCOL in req.subprotocols else None
        self._write(self.ws.send(AcceptConnection(subprotocol=self.subprotocol)))
        self.inner = self._factory()
        self.inner.connection_made(_InnerTransport(self))

    # ---------------------------------------------------------------------------- writing
    def _send_binary(self, data: bytes) -> None:
        if self._closing or self.transport is None or self.ws.state.name != "OPEN":
            return
        self._write(self.ws.send(BytesMessage(data=data)))

    def _write(self, data: bytes) -> None:
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _flush_ws(self, hint) -> None:
        if hint is not None:
            try:
                self._write(self.ws.send(hint))
            except Exception:
                pass

    def _close(self, code: int, reason: str) -> None:
        if self._closing:
            return
        self._closing = True
        if self.ws.state.name == "OPEN":
            self._write(self.ws.send(CloseConnection(code=code, reason=reason)))
        self._drop()

    def _drop(self) -> None:
        t = self.transport
        if t is not None and not t.is_closing():
            t.close()
