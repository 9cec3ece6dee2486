"""One MQTT network connection: bytes <-> packets, coalesced writes, flow control flags.

Why `asyncio.Protocol` and not streams: no task per connection and no coroutine per packet. Bytes
arrive in `data_received`, the sans-IO decoder turns them into packets, the packet handler (the
broker) handles each synchronously. Everything a connection sends during one loop iteration is
joined and written with one `transport.write` at the end of that iteration (one syscall per tick,
not per packet): `WriteBatcher` (gateway/net/write_batcher.py) keeps one list of connections with pending output and flushes it
with ONE loop callback, or right away at the end of a delivery run / an ack batch
(`WriteBatcher.flush`), so a PUBLISH or PUBACK does not wait one more loop iteration.
The transport's write-buffer limits drive back-pressure: `pause_writing` marks the connection
`write_blocked`, which stops delivery pulling for it until `resume_writing`.
`ConnectionSweep` (gateway/net/keepalive.py) keeps the connections' deadlines (connect timeout, a stalled enhanced
authentication or re-authentication, keep alive): twice a second it checks the few connections
still logging in and the keep-alive deadlines that have come, not every connection.
An idle connected client is parked after `park_idle_after_s` (gateway/net/parking.py): its
socket leaves the loop's transports for one epoll that answers its PINGREQs; the connection's
side of it (`park_if_idle`, `wake`, `unpark`) is gateway/net/connection_parking.py.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Protocol

from lmqtt.gateway.session.rare import RareField, rare_defaults
from lmqtt.gateway.mqtt import (Decoder, ProtocolError, ReasonCode, encode, encode_connack_refusal,
                                encode_malformed_connect_reply, packets as P)
from lmqtt.gateway.net.connection_parking import NO_OUT, ConnectionParking
from lmqtt.gateway.net.write_batcher import WriteBatcher

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.session import MqttSession

log = logging.getLogger("lmqtt.gateway.conn")


NO_TOPICS: frozenset = frozenset()
_KEEPALIVES: dict[int, int] = {}   # keep alive seconds -> the one int object kept for it (`keepalive`)
_ACCEPTED = [0.0]         # the accept time the sockets accepted within one tenth of a second share (`_accept_time`)


def _accept_time(t: float) -> float:
    """`t`, or the accept time of a socket accepted less than 0.1 s before: one float object (24
    bytes) for all the connections of a burst's tenth of a second (the console shows a tenth)."""
    last = _ACCEPTED[0]
    if 0.0 <= t - last < 0.1:
        return last
    _ACCEPTED[0] = t
    return t


class PacketHandler(Protocol):
    """What a connection needs from the broker (`Broker` implements it)."""

    cfg: Any
    metrics: Any
    loop: asyncio.AbstractEventLoop
    writes: WriteBatcher
    gate: Any      # the connection and rate limits (gateway/broker/limits.py ConnectionGate), None for none

    def on_accept(self, conn: "MQTTConnection") -> None: ...
    def on_connection_lost(self, conn: "MQTTConnection", exc: BaseException | None) -> None: ...
    def handle_packet(self, conn: "MQTTConnection", pkt: Any) -> None: ...
    def on_publish(self, conn: "MQTTConnection", pkt: P.Publish) -> None: ...
    def on_puback(self, conn: "MQTTConnection", pkt: P.PubAck) -> None: ...
    def on_writable(self, conn: "MQTTConnection") -> None: ...


class _ConnRare:
    """The fields of an `MQTTConnection` most connections keep at their defaults (a limit's
    refusal, the per-address gate key, the publish-rate pause, `hold`s, enhanced authentication's
    login and method, a paused or full transport and its grown write-buffer mark, a client that wants
    no reason strings): made at the first other value and dropped when all are back at their
    defaults, so an idle connection pays one slot for them, not sixteen."""

    __slots__ = ("_gate_addr", "refusal", "_refusal_logged", "_rate_logged", "_rate_timer", "_holds",
                 "auth_method", "_auth_login", "_rate_paused", "_transport_paused",
                 "transport_full", "write_high", "write_paused_at", "problem_info", "internal", "left_because")

    def __init__(self) -> None:
        rare_defaults(self, MQTTConnection._RARE_FIELDS)




class MQTTConnection(ConnectionParking, asyncio.Protocol):
    # no per-connection __dict__: idle connections are most of a broker's memory. An attribute
    # another module sets must be named here (fleet_attached_ms: gateway/fleet/sessions.py, set on
    # every connection of a fleet gateway, so a slot) or be one of the `RareField`s below.
    # `cfg`, `metrics`, `loop`, `writes` are the handler's (properties below: four slots fewer per
    # idle connection), `peer` is kept packed in `_peer` (an IPv4 address and port in one int)
    __slots__ = ("handler", "transport", "decoder", "version",
                 "session", "client_id", "connected", "closing", "write_blocked",
                 "_store_waits", "will", "identity",
                 "read_checks", "_keepalive", "_ka_slot", "last_rx", "accepted_at", "pending_publishes",
                 "valid_topics", "acl_publish_ok", "reading_paused",
                 "_gate", "pub_bucket",
                 "_held", "_out", "_flush_scheduled", "_peer", "_park", "_wrote", "_rare",
                 "fleet_attached_ms")

    # the rare fields (`_ConnRare`), with their defaults
    _RARE_CLASS = _ConnRare
    _gate_addr = RareField(None)      # the address the gate counts this socket under (per-address limits)
    refusal = RareField(None)         # (reason code, cause) of the limit that refused this socket
    _refusal_logged = RareField(False)
    _rate_logged = RareField(False)
    _rate_timer = RareField(None)     # asyncio.TimerHandle of a publish-rate pause
    _holds = RareField(0)             # `hold` calls not yet released
    auth_method = RareField(None)     # the Authentication Method the connection logged in with
    _auth_login = RareField(None)     # MQTT 5 enhanced authentication in progress (`auth_login`)
    _rate_paused = RareField(False)   # over publish_rate_per_client: not read until the budget is back
    _transport_paused = RareField(False)   # what we last told the transport (any of the reasons)
    transport_full = RareField(False)  # the transport's buffer is over its high-water mark (pause_writing)
    write_high = RareField(0)          # the high-water mark it grew to (gateway/net/write_buffers.py), 0: the base
    write_paused_at = RareField(None)  # loop time of the pause_writing not yet resumed
    problem_info = RareField(True)     # MQTT 5 Request Problem Information: reason strings on acks allowed
    # an in-process client of the gateway's own (a bridge's local side, gateway/integrations/bridge.py):
    # the Identity it connects as, without authentication
    internal = RareField(None)
    left_because = RareField(None)     # why the connection ended, for the events (gateway/integrations/events.py)

    cfg = property(attrgetter("handler.cfg"))
    metrics = property(attrgetter("handler.metrics"))
    loop = property(attrgetter("handler.loop"))
    writes = property(attrgetter("handler.writes"))

    @property
    def peer(self) -> str:
        """The client's address "host:port" ("?" when unknown), for logs and the console."""
        p = self._peer
        if p.__class__ is int:
            return f"{socket.inet_ntoa((p >> 16).to_bytes(4, 'big'))}:{p & 0xFFFF}"
        return p

    @peer.setter
    def peer(self, v: str) -> None:
        self._peer = v

    def _set_peer(self, pn) -> None:
        """From the transport's peername: an IPv4 (address, port) as one int (32 bytes, not a
        64-byte string per connection), anything else as its string."""
        if not pn:
            self._peer = "?"
            return
        try:
            self._peer = int.from_bytes(socket.inet_aton(pn[0]), "big") << 16 | pn[1]
        except (OSError, TypeError, ValueError, IndexError):
            self._peer = f"{pn[0]}:{pn[1]}"

    def __init__(self, handler: PacketHandler) -> None:
        self.handler = handler
        self.transport: asyncio.Transport | None = None
        # decoded packets are only read by the handler, never mutated: share the empty Properties
        self.decoder = Decoder(max_packet_size=self.cfg.max_packet_size, share_empty_properties=True)
        self.version = 4
        self.session: MqttSession | None = None
        self.client_id: str | None = None
        self.connected = False        # CONNECT accepted
        self.closing = False          # close() called: no more writes
        self.write_blocked = False     # delivery stops writing: the transport is full or a store write is awaited
        self._store_waits = 0          # store writes the next answer waits for (`wait_for_store`)
        self.will: P.Will | None = None
        self.identity = None          # auth.Identity once CONNECT is accepted (None: no auth/ACL configured)
        self.read_checks: set[str] | None = None   # queues whose messages need the ACL's can_read
        self._keepalive = 0           # seconds (`keepalive`: set, it arms the sweep's deadline)
        self._ka_slot = None          # the sweep's wheel slot (its table) this connection is in
        self.last_rx = self.loop.time()
        self.accepted_at = _accept_time(self.last_rx)
        self.pending_publishes = 0
        # PUBLISH topics already validated on this connection / the ACL let it publish (cleared on
        # reload): the shared empty NO_TOPICS until the first one (an empty set is 216 bytes)
        self.valid_topics: frozenset | set = NO_TOPICS
        self.acl_publish_ok: frozenset | set = NO_TOPICS
        self.reading_paused = False   # too many publishes awaiting the store
        # limits (gateway/broker/limits.py): the gate that admitted this socket (released on close), the
        # limit that refused it (answered at its CONNECT), the publish budget (None: unlimited)
        self._rare: _ConnRare | None = None    # the `RareField`s, once one is not at its default
        self._gate = None
        self.pub_bucket = None
        self._held: list | None = None   # packets read while on hold (a password check, a store reply)
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._peer = "?"
        # parking (gateway/net/parking.py): None; the fd (int) while parked; the bytes to feed
        # first (bytes) while its new transport is on its way (`unpark`)
        self._park: int | bytes | None = None
        self._wrote = False            # output flushed since the last idle check (`park_if_idle`)

    # -- deadlines (ConnectionSweep) ---------------------------------------------------------------
    @property
    def keepalive(self) -> int:
        return self._keepalive

    @keepalive.setter
    def keepalive(self, seconds: int) -> None:
        """The keep alive CONNECT agreed on: its deadline goes into the sweep's wheel."""
        # one int object per distinct value: a keep alive above 256 (most devices: 60-1200 s) is
        # not one of Python's cached small ints, and each CONNECT decodes its own (32 bytes each)
        self._keepalive = _KEEPALIVES.setdefault(seconds, seconds) if len(_KEEPALIVES) < 4096 else seconds
        sweep = getattr(self.handler, "sweep", None)
        if sweep is not None:
            if self.connected:
                sweep.pending.discard(self)     # CONNECT accepted: no connect deadline any more
                sweep.watch_idle(self)
            sweep.arm(self)

    @property
    def auth_login(self):
        """MQTT 5 enhanced authentication in progress (auth.ScramLogin), or None."""
        return self._auth_login

    @auth_login.setter
    def auth_login(self, login) -> None:
        self._auth_login = login
        if login is not None:
            sweep = getattr(self.handler, "sweep", None)
            if sweep is not None:
                sweep.logins.add(self)
                if sweep._handle is None:
                    sweep.resume()

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport) -> None:  # type: ignore[override]
        if self._park is not None:
            self._reattached(transport)
            return
        self.transport = transport
        sweep = getattr(self.handler, "sweep", None)
        if sweep is not None:
            sweep.pending.add(self)         # until its CONNECT is accepted (connect_timeout_s)
            if sweep._handle is None:
                sweep.resume()
        cfg = self.cfg
        transport.set_write_buffer_limits(high=cfg.write_high_water, low=cfg.write_low_water)
        pn = transport.get_extra_info("peername")
        self._set_peer(pn)
        gate = self.handler.gate
        if gate is not None and not self._admit(gate, pn[0] if pn else "?"):
            return
        self.handler.on_accept(self)

    def _admit(self, gate, addr: str) -> bool:
        """The connection limits, asked once per socket. Admitted: counted until the socket closes.
        Refused: kept open until its CONNECT arrives, to answer it with the reason code (the
        client then knows why and does not retry blindly); more than MAX_REFUSED_PENDING such
        sockets waiting, or no CONNECT within connect_timeout_s: closed without an answer."""
        rc, cause = gate.admit(addr)
        if not rc:
            # the address is kept for `release` only when the gate counts per address (a string per connection)
            self._gate, self._gate_addr = gate, (addr if gate.counts_addresses else None)
            self.pub_bucket = gate.publish_limiter()
            return True
        if gate.refused_pending >= gate.MAX_REFUSED_PENDING:
            self._log_refusal(gate, rc, cause, "closed at accept (too many refused sockets waiting)")
            self.metrics.connect_refused.labels(reason=f"0x{rc:02X}").inc()
            self.closing = True
            self.transport.abort()
            return False
        gate.refused_pending += 1
        self.refusal = (rc, cause)
        self.decoder.max_packet_size = min(self.decoder.max_packet_size, 64 << 10)   # a CONNECT, no more
        return True

    def _log_refusal(self, gate, rc: int, cause: str, reason: str) -> None:
        left_out = gate.log_allowed()
        if left_out is None:
            return
        lim = gate.limits
        limit = {"max_connections": lim.max_connections,
                 "max_connections_per_address": lim.max_connections_per_address,
                 "open_files": gate.socket_cap,
                 "connect_rate_per_address": lim.connect_rate_per_address}.get(cause)
        log.warning("event=connect_refused peer=%s reason_code=0x%02X cause=%s limit=%s reason=%r%s", self.peer,
                    rc, cause, limit, reason, f" suppressed={left_out}" if left_out else "")

    _REFUSAL_REASONS = {"max_connections": "server full: too many connections (max_connections)",
                        "open_files": "server busy: the connections the broker's open-files limit allows are "
                                      "all in use (ulimit -n, --max-open-files)",
                        "max_connections_per_address": "too many connections from your address "
                                                       "(max_connections_per_address)",
                        "connect_rate_per_address": "connection rate exceeded (connect_rate_per_address)"}

    def _refuse_by_limit(self, pkt) -> None:
        """The first packet of a socket the limits refused: CONNACK with the reason code (3.1.1:
        return code 3, server unavailable), then close."""
        rc, cause = self.refusal
        gate = self.handler.gate
        reason = self._REFUSAL_REASONS.get(cause, cause)
        self.metrics.connect_refused.labels(reason=f"0x{rc:02X}").inc()
        self._refusal_logged = True
        self._log_refusal(gate, rc, cause, reason)
        if isinstance(pkt, P.Connect):
            self.write(encode_connack_refusal(rc, reason, pkt.protocol_level))
        self.close()

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
        if self._held is not None:
            self._held.extend(packets)
            return
        self._handle_packets(packets)

    def _handle_packets(self, packets) -> None:
        h = self.handler
        handle = h.handle_packet
        for i, pkt in enumerate(packets):
            if self.closing:
                return
            if self._held is not None:       # the handler put CONNECT on hold: keep the rest
                self._held.extend(packets[i:])
                return
            try:
                # the two QoS 1 hot-path packets skip the generic dispatch table (CONNECT accepted:
                # the decoder lets nothing but CONNECT through before it, `connected` after it)
                t = type(pkt)
                if t is P.Publish and self.connected:
                    if self.pub_bucket is not None and not self.pub_bucket.take():   # publish_rate_per_client
                        self._rate_hold(packets[i:])
                        return
                    h.on_publish(self, pkt)
                elif t is P.PubAck and self.connected:
                    h.on_puback(self, pkt)
                elif self.refusal is not None:
                    self._refuse_by_limit(pkt)
                    return
                else:
                    handle(self, pkt)
            except ProtocolError as e:
                self.protocol_error(e.reason_code, str(e))
                return
            except Exception as e:  # a bug must cost one connection, never the server
                log.exception("event=packet_handler_failed client_id=%s packet=%s", self.client_id,
                              type(pkt).__name__)
                self.close_with_error(ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR, f"internal error: {type(e).__name__}")
                return

    def eof_received(self):
        return False  # close the transport

    def hold(self) -> None:
        """Stop handling packets (CONNECT waits for a password check off the loop, or for the
        store's answer): what arrives meanwhile is kept in order, and reading pauses so a client
        cannot pile up more. Each `hold` is ended by one `release`."""
        self._holds += 1
        if self._held is None:
            self._held = []
            self._sync_reading()

    def release(self) -> None:
        """End one `hold`; after the last, handle the packets kept meanwhile, in order, then read again."""
        if self._holds > 0:
            self._holds -= 1
            if self._holds:
                return
        held, self._held = self._held, None
        if held is None or self.closing:
            return
        self._sync_reading()
        if held:
            self._handle_packets(held)

    def wait_for_store(self, fut) -> None:
        """The answer being written depends on a store write still in flight (a session record
        on a remote store): what this connection writes from now on waits for `fut`, and so do
        the packets it reads. Only this connection waits; a blocking call would have stopped the
        whole gateway for the round trip. `fut`'s failure is the writer's to report (the answer
        then goes as it would have after a failed blocking write)."""
        if fut.done():
            return
        self._store_waits += 1
        self.write_blocked = True
        self.hold()
        fut.add_done_callback(self._store_answered)

    def _store_answered(self, _fut) -> None:
        self._store_waits -= 1
        if self._store_waits or self.closing:
            return
        self.write_blocked = self.transport_full
        if self._out and not self._flush_scheduled:
            self._flush_scheduled = True
            self.writes.want_flush(self)
        self.release()
        if not self.write_blocked and not self.closing:
            self.handler.on_writable(self)

    def _sync_reading(self) -> None:
        """Pause or resume reading the socket: paused while any reason holds (a CONNECT awaiting
        its password check, publishes awaiting the store, over the publish rate)."""
        t = self.transport
        if t is None or self.closing:
            return
        want = self._held is not None or self.reading_paused or self._rate_paused
        if want != self._transport_paused:
            self._transport_paused = want
            if want:
                t.pause_reading()
            else:
                t.resume_reading()

    # -- publish rate per client (gateway/broker/limits.py) --------------------------------------------
    def _rate_hold(self, rest) -> None:
        """Over publish_rate_per_client: this PUBLISH and everything after it (already read) wait
        in order, and the socket is not read, until the budget has a token again; TCP then slows
        the client down. Back-pressure, as for a slow store: nothing is refused, dropped or
        disconnected (the alternative, DISCONNECT 0x96, would make a well-behaved client with a
        backlog reconnect and resend in a loop)."""
        self._held = list(rest)
        self._holds += 1
        self._rate_paused = True
        gate = self._gate
        gate.hits["publish_rate_per_client"] += 1
        if not self._rate_logged:     # once per connection; the counter counts every pause
            self._rate_logged = True
            log.info("event=publish_throttled client_id=%s peer=%s cause=publish_rate_per_client limit=%s "
                     "burst=%s action=pause_reading", self.client_id, self.peer,
                     gate.limits.publish_rate_per_client, gate.limits.publish_burst_per_client)
        self._sync_reading()
        self._rate_timer = self.loop.call_later(min(self.pub_bucket.wait_time(), 1.0), self._rate_release)

    def _rate_release(self) -> None:
        self._rate_timer = None
        if self.closing:
            return
        # a client we chose not to read is not idle: keepalive counts from now
        self.last_rx = self.loop.time()
        wait = self.pub_bucket.wait_time()
        if wait > 0:
            self._rate_timer = self.loop.call_later(min(wait, 1.0), self._rate_release)
            return
        self._rate_paused = False
        self.release()

    def pause_writing(self) -> None:
        if not self.transport_full:
            self.transport_full = True
            self.write_blocked = True
            self.metrics.paused_sessions.inc()
            wb = getattr(self.handler, "write_buffers", None)
            if wb is not None:
                wb.paused(self, self.loop.time())

    def resume_writing(self) -> None:
        if self.transport_full:
            self.transport_full = False
            self.metrics.paused_sessions.dec()
            wb = getattr(self.handler, "write_buffers", None)
            if wb is not None:
                wb.resumed(self, self.loop.time())
            if not self._store_waits:
                self.write_blocked = False
                self.handler.on_writable(self)

    def connection_lost(self, exc) -> None:
        if self._gate is not None:
            self._gate.release(self._gate_addr)
            self._gate = None
        elif self.refusal is not None:
            gate = self.handler.gate
            gate.refused_pending -= 1
            if not self._refusal_logged:         # closed before its CONNECT came: still say why
                rc, cause = self.refusal
                self.metrics.connect_refused.labels(reason=f"0x{rc:02X}").inc()
                self._log_refusal(gate, rc, cause, "closed before CONNECT")
            self.refusal = None
        if self._rate_timer is not None:
            self._rate_timer.cancel()
            self._rate_timer = None
        if self.transport_full:
            self.transport_full = False
            self.metrics.paused_sessions.dec()
        if self.write_high:
            self.handler.write_buffers.release(self)
        self.write_blocked = False
        self.closing = True
        if self._out:
            self._out.clear()
        sweep = getattr(self.handler, "sweep", None)
        if sweep is not None:
            sweep.forget(self)
        self.handler.on_connection_lost(self, exc)

    # -- output ------------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.closing:
            return
        out = self._out
        if out is NO_OUT:
            out = self._out = []
        out.append(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.writes.want_flush(self)

    def send(self, pkt) -> None:
        self.write(encode(pkt, self.version))

    def send_fitting(self, pkt) -> None:
        """Send an ack/DISCONNECT that may carry a reason string: without it (and without user
        properties) when the packet would exceed the client's MQTT 5 Maximum Packet Size (§3.1.2.11.4)."""
        data = encode(pkt, self.version)
        s = self.session
        if s is not None and s.max_packet_size and len(data) > s.max_packet_size:
            pkt.properties.reason_string = None
            pkt.properties.user_property = []
            data = encode(pkt, self.version)
        self.write(data)

    def flush(self, force: bool = False) -> None:
        """Write the queued output (held back while a store write it depends on is in flight,
        unless `force`: the connection is closing anyway)."""
        self._flush_scheduled = False
        out = self._out
        if self._store_waits and not force:
            return
        if self._park is not None:
            if out and not self.closing and self._park.__class__ is int:
                self.wake()           # something to send: back on the loop, sent when it is there
            return
        if not out or self.transport is None or self.transport.is_closing():
            if out:
                out.clear()
            return
        self._wrote = True
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
        if self._park is not None:
            self._close_parked()
            return
        self.flush(force=True)
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def close_with_error(self, reason_code: int, reason: str = "") -> None:
        """Server-initiated close: MQTT 5 DISCONNECT with the reason (after CONNECT), then close.

        The will message stays armed: a close for any reason but a normal DISCONNECT from the client sends it.
        """
        if self.closing:
            return
        if self.left_because is None:
            self.left_because = f"0x{reason_code:02X} {reason}".strip()
        if self.connected and self.version == 5:
            d = P.Disconnect(reason_code)
            if reason:
                d.properties.reason_string = reason[:200]
            self.send_fitting(d)
        log.info("event=close client_id=%s peer=%s reason_code=0x%02X reason=%r", self.client_id, self.peer,
                 reason_code, reason)
        self.close()

    def protocol_error(self, reason_code: int, reason: str) -> None:
        self.metrics.protocol_errors.inc()
        log.warning("event=protocol_error client_id=%s peer=%s reason_code=0x%02X error=%r",
                    self.client_id, self.peer, reason_code, reason)
        if not self.connected:
            reply = encode_malformed_connect_reply(reason_code, reason, self.decoder.version)
            if reply is not None:
                self.write(reply)
            self.close()
            return
        self.close_with_error(reason_code, reason)

    # -- inbound flow control ----------------------------------------------------------------
    def pause_reading_for_store(self) -> None:
        if not self.reading_paused and self.transport is not None and not self.closing:
            self.reading_paused = True
            self._sync_reading()

    def maybe_resume_reading(self) -> None:
        if self.reading_paused and self.pending_publishes < self.cfg.max_pending_publish // 2:
            self.reading_paused = False
            self._sync_reading()
