"""The connection's side of parking: an idle `MQTTConnection` gives its socket to the Parker
(gateway/net/parking.py, the broker's side: one epoll that answers PINGREQs off the loop) and gets
a new transport back when the client sends something or the broker has something to send.

Separate from gateway/net/connection.py because it is a second life of the connection, not its
packet handling: dropping and re-making the transport, the decoder and the output list, the
`last_rx` the Parker keeps. `MQTTConnection` inherits these methods (`ConnectionParking`, no
state of its own: the slots are `MQTTConnection`'s); nothing here runs per packet.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket

from lmqtt.gateway.session import fold
from lmqtt.gateway.mqtt import Decoder

log = logging.getLogger("lmqtt.gateway.conn")

NO_OUT: tuple = ()        # the output list of a parked connection (a list is 56 bytes): `write` makes one
_PARKED_RX = [0.0]        # the `last_rx` parked connections share (`_parked_rx_time`)


def _parked_rx_time(t: float) -> float:
    """A parked connection's `last_rx`: `t`, or up to 0.1 s after it, one float object (24 bytes)
    for the connections parked or pinging within a tenth of a second of each other (a burst's
    park wave: one float, not one each). Later, never earlier: a keep alive ends late, never
    before its 1.5 x (the wheel is a second late at most anyway)."""
    last = _PARKED_RX[0]
    if 0.0 <= last - t < 0.1:
        return last
    t += 0.1
    _PARKED_RX[0] = t
    return t


# the loop transports of plain TCP sockets: the only ones parked (TLS and WebSocket keep their transport)
PARKABLE_TRANSPORTS = frozenset({"TCPTransport", "_SelectorSocketTransport"})


class _Dropped(asyncio.Protocol):
    """The protocol of a transport given up by a parked connection: its close reports to nobody."""


_DROPPED = _Dropped()


class ConnectionParking:
    """The parking methods of `MQTTConnection` (its only subclass): see the module docstring."""

    __slots__ = ()

    # -- parking (gateway/net/parking.py) ----------------------------------------------------------
    @property
    def parked(self) -> bool:
        """Its socket is watched by the Parker (not by the loop)."""
        return self._park.__class__ is int

    def _parking(self):
        sweep = getattr(self.handler, "sweep", None)
        return sweep.parking if sweep is not None else None

    def park_if_idle(self, now: float, after_s: float) -> bool:
        """Park this connection if nothing happened on it for `after_s` (no packet in, nothing
        written since the last check) and nothing is in flight, held or queued. True: parked, or
        never parkable (closed, TLS, WebSocket): no more checks; False: ask again later."""
        if self.closing or self._park is not None:
            return True
        t = self.transport
        if t is None or not self.connected:
            return False
        if type(t).__name__ not in PARKABLE_TRANSPORTS:
            return True
        if self._wrote:
            self._wrote = False
            return False
        if now - self.last_rx < after_s:
            return False
        if (self._out or self._flush_scheduled or self._held is not None or self._store_waits
                or self.write_blocked or self.reading_paused or self._rate_paused or self._rate_timer is not None
                or self._auth_login is not None or self.pending_publishes or self.decoder.buffered):
            return False
        s = self.session
        if s is None or s.conn is not self or not s.quiet():     # something in flight either way
            return False
        if t.get_write_buffer_size() or t.is_closing():
            return False
        parking = self._parking()
        sock = t.get_extra_info("socket")
        if parking is None or sock is None:
            return True
        try:
            fd = os.dup(sock.fileno())
        except OSError as e:      # out of descriptors: stay on the loop, try again later
            log.warning("event=park_failed client_id=%s error=%r", self.client_id, e)
            return False
        try:
            parking.parker.add(fd, self)
        except (OSError, ValueError) as e:
            os.close(fd)
            log.warning("event=park_failed client_id=%s error=%r", self.client_id, e)
            return False
        # the transport goes (its fd closes; the dup keeps the TCP connection: no FIN, no RST)
        if self.write_high:
            self.handler.write_buffers.release(self)     # a parked socket's marks are the base again
        t.set_protocol(_DROPPED)
        t.close()
        self.transport = None
        self.decoder = None
        self._out = NO_OUT
        self._transport_paused = False
        self.last_rx = _parked_rx_time(self.last_rx)
        self._park = fd
        fold(s)          # its session's tables too, made again at first use (gateway/session/parked.py)
        parking.parked_total += 1
        return True

    def parked_rx(self, now: float) -> bool:
        """While parked: `last_rx` from the Parker (it reads the PINGREQs)."""
        parking = self._parking()
        if parking is not None:
            try:
                rx = now - parking.parker.idle(self._park)
            except KeyError:
                return False
            if rx > self.last_rx:
                self.last_rx = _parked_rx_time(rx)
        s = self.session
        if s is not None and s.conn is self:
            fold(s)      # again, if a reader (the console, a save of its offsets) unfolded it
        return True

    def wake(self) -> None:
        """Back on the loop (the broker has something to send): a new transport over the fd."""
        fd = self._park
        if fd.__class__ is not int:
            return
        parking = self._parking()
        r = parking.parker.remove(fd) if parking is not None else None
        self._reattach(fd, r[1] if r is not None else b"")

    def unpark(self, fd: int, data: bytes, eof: bool) -> None:
        """The Parker handed the socket back: `data` (other than its answered PINGREQs) read from
        it first, or its end (`eof`: EOF or an error)."""
        if self._park != fd:
            return
        self.last_rx = self.loop.time()
        if eof and not data:
            self._park = None
            os.close(fd)
            self._end_parked()
            return
        self._reattach(fd, data)     # an EOF after data: the new transport reads it again

    def _reattach(self, fd: int, data: bytes) -> None:
        self._park = data             # bytes: the transport is on its way (`connection_made`)
        parking = self._parking()
        if parking is not None:
            parking.unparked_total += 1
        try:
            sock = socket.socket(fileno=fd)
        except OSError as e:
            os.close(fd)
            self._park = None
            self._end_parked(e)
            return
        self.loop.create_task(self._attach(sock))

    async def _attach(self, sock: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(lambda: self, sock=sock)
        except Exception as e:
            if self._park is not None and self._park.__class__ is not int:   # connection_made never came
                sock.close()
                self._park = None
                log.warning("event=unpark_failed client_id=%s error=%r", self.client_id, e)
                self._end_parked(e)

    def _reattached(self, transport) -> None:
        """connection_made of the transport `unpark`/`wake` asked for."""
        data = self._park
        self._park = None
        self.transport = transport
        transport.set_write_buffer_limits(high=self.cfg.write_high_water, low=self.cfg.write_low_water)
        d = Decoder(max_packet_size=self.cfg.max_packet_size, share_empty_properties=True)
        d.version = self.version
        d._connected = True
        d._update_table()
        self.decoder = d
        if self._out is NO_OUT:
            self._out = []
        if self.closing:              # closed while the transport was on its way: what was queued, then close
            self.flush(force=True)
            transport.close()
            return
        parking = self._parking()
        if parking is not None:
            parking.rewatch(self, data)
        if self._out and not self._flush_scheduled:
            self._flush_scheduled = True
            self.writes.want_flush(self)
        if data:
            self.data_received(data)

    def _close_parked(self) -> None:
        """close() of a parked connection: what is queued (a DISCONNECT) written to the socket as
        is (a few bytes to an idle socket), then closed; connection_lost follows, as for a transport.
        Closed while its transport is on its way: `_reattached` closes it."""
        pk = self._park
        self.closing = True
        if pk.__class__ is not int:
            return
        self._park = None
        parking = self._parking()
        if parking is not None:
            parking.parker.remove(pk)
        out = self._out
        if out:
            data = b"".join(out)
            out.clear()
            try:
                os.write(pk, data)
                self.metrics.bytes_out += len(data)
            except OSError:
                pass
        os.close(pk)
        self.loop.call_soon(self.connection_lost, None)

    def _end_parked(self, exc: BaseException | None = None) -> None:
        """The parked socket ended (EOF, reset, a failed unpark): as a transport's connection_lost."""
        self.closing = True
        self.loop.call_soon(self.connection_lost, exc)
