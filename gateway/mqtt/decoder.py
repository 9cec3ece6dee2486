"""Bytes -> packet objects, incremental and strict (MQTT 3.1.1 and 5.0).

Why this shape: one bytearray per connection, packets parsed in place with explicit bounds, and the
fixed header (type, flags, remaining length, maximum packet size) checked as soon as its bytes arrive,
so a hostile length field costs nothing: we never wait for or allocate the claimed size. After the first
ProtocolError the decoder stays failed (the connection must be closed; re-syncing a byte stream after a
framing error is impossible).
"""
from __future__ import annotations

from lmqtt.store import accel

from . import packets as P
from .errors import ProtocolError
from .properties import decode_properties
from .wire import VARINT_MAX, read_binary, read_string

__all__ = ["Decoder", "REASON_CODES_V5", "SUBACK_CODES_V311"]

_NAMES = {1: "CONNECT", 2: "CONNACK", 3: "PUBLISH", 4: "PUBACK", 5: "PUBREC", 6: "PUBREL", 7: "PUBCOMP",
          8: "SUBSCRIBE", 9: "SUBACK", 10: "UNSUBSCRIBE", 11: "UNSUBACK", 12: "PINGREQ", 13: "PINGRESP",
          14: "DISCONNECT", 15: "AUTH"}

# Required fixed-header flags (low nibble) for every type but PUBLISH.
_FLAGS = {1: 0, 2: 0, 4: 0, 5: 0, 6: 2, 7: 0, 8: 2, 9: 0, 10: 2, 11: 0, 12: 0, 13: 0, 14: 0, 15: 0}
_FROM_CLIENT = frozenset({1, 3, 4, 5, 6, 7, 8, 10, 12, 14, 15})
_FROM_SERVER = frozenset({2, 3, 4, 5, 6, 7, 9, 11, 13, 14, 15})

#: MQTT 5 reason codes each packet type may carry (spec tables 3-1 .. 3-13).
REASON_CODES_V5: dict[int, frozenset[int]] = {
    2: frozenset({0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C, 0x90,
                  0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F}),
    4: frozenset({0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99}),
    5: frozenset({0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99}),
    6: frozenset({0x00, 0x92}),
    7: frozenset({0x00, 0x92}),
    9: frozenset({0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2}),
    11: frozenset({0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91}),
    14: frozenset({0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F, 0x90, 0x93,
                   0x94, 0x95, 0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F, 0xA0, 0xA1,
                   0xA2}),
    15: frozenset({0x00, 0x18, 0x19}),
}
SUBACK_CODES_V311 = frozenset({0x00, 0x01, 0x02, 0x80})
_OK_TABLES: dict[tuple, bytes] = {}
_ACKS = {4: P.PubAck, 5: P.PubRec, 6: P.PubRel, 7: P.PubComp}
_SHARED_EMPTY = P.Properties()   # see Decoder(share_empty_properties=True); never mutate


# The steady state in C (gateway/mqtt/_scan.c): runs of PUBLISHes without MQTT 5 properties and
# two-byte acks, taken only where this module would accept them (it stops at the first packet it
# is not sure of, and the loop below goes on from there: errors are always this module's).
# tests/mqtt/test_scan_accel.py compares the two on arbitrary byte streams.
_scan_mod = accel.load("lmqtt.gateway.mqtt._scan")
if _scan_mod is not None:
    _scan_mod.configure(P.Publish, P.PubAck, P.PubRec, P.PubRel, P.PubComp, P.Properties)
_scan = _scan_mod.scan if _scan_mod is not None else None


def _err(msg: str, code: int = 0x81) -> ProtocolError:
    return ProtocolError(msg, code)


class Decoder:
    """Incremental MQTT decoder for one connection.

    `version` None (server side) means "learn it from CONNECT". `server_side` selects which packet
    types may arrive (a server never receives CONNACK, a client never receives CONNECT) and, on the
    server, that the first packet is CONNECT and there is only one. A client-side decoder must be told
    the version it connected with.
    """

    __slots__ = ("version", "max_packet_size", "server_side", "_buf", "_failed", "_connected",
                 "_allowed", "_ok_first", "_empty_props")

    def __init__(self, version: int | None = None, max_packet_size: int = VARINT_MAX,
                 server_side: bool = True, share_empty_properties: bool = False) -> None:
        if version not in (None, 3, 4, 5):
            raise ValueError(f"MQTT version must be 3, 4, 5 or None, got {version!r}")
        if version is None and not server_side:
            raise ValueError("a client-side Decoder needs the protocol version it connected with")
        self.version = version
        self.max_packet_size = max_packet_size
        self.server_side = server_side
        self._buf = bytearray()
        self._failed: ProtocolError | None = None
        self._connected = False
        self._allowed = _FROM_CLIENT if server_side else _FROM_SERVER
        # share_empty_properties: MQTT 3.1.x PUBLISHes and 2-byte acks (which carry no properties)
        # all get ONE shared empty `Properties` object instead of a fresh one each (~1 us per packet
        # on the gateway's hot path). The caller promises never to mutate decoded packets' properties.
        self._empty_props = _SHARED_EMPTY if share_empty_properties else None
        self._update_table()

    @property
    def buffered(self) -> int:
        """Bytes received but not yet forming a complete packet."""
        return len(self._buf)

    def feed(self, data: bytes) -> list:
        """Add received bytes; return the complete packets now available (possibly none)."""
        if self._failed is not None:
            raise ProtocolError(f"decoder already failed: {self._failed}", self._failed.reason_code)
        buf = self._buf
        buf += data
        out: list = []
        pos = 0
        n = len(buf)
        ok = self._ok_first
        mv = memoryview(buf)  # one view per feed: payloads are copied out of it exactly once
        scan = _scan          # (the view also keeps `buf` from being resized while C reads it)
        try:
            while pos < n:
                if scan is not None:
                    pos = scan(buf, pos, out, ok, self.version == 5, self.max_packet_size, self._empty_props)
                    if pos >= n:
                        break
                b0 = buf[pos]
                if not ok[b0]:
                    self._check_first_byte(b0)  # raises with the precise reason
                # Remaining length: at most 4 bytes, checked before waiting for the body.
                i = pos + 1
                if i >= n:
                    break
                rl = buf[i]
                i += 1
                if rl >= 0x80:   # more than one length byte (packets of 128 bytes and more)
                    rl &= 0x7F
                    shift = 7
                    while True:
                        if i >= n:
                            rl = -1
                            break
                        b = buf[i]
                        i += 1
                        rl |= (b & 0x7F) << shift
                        if b < 0x80:
                            break
                        shift += 7
                        if shift >= 28:
                            raise _err("malformed packet: remaining length longer than 4 bytes")
                    if rl < 0:
                        break
                total = i - pos + rl
                if total > self.max_packet_size:
                    raise _err(f"packet too large: {total} bytes > maximum packet size "
                               f"{self.max_packet_size}", 0x95)
                end = i + rl
                if end > n:
                    break
                if b0 >> 4 == 3:
                    out.append(self._publish(b0, buf, mv, i, end))
                elif b0 == 0x40 and rl == 2 and self._empty_props is not None:
                    # PUBACK without reason code: the QoS 1 hot path, no dispatch through _parse
                    pid = (buf[i] << 8) | buf[i + 1]
                    if pid == 0:
                        raise _err("protocol error: PUBACK with packet id 0", 0x82)
                    out.append(P.PubAck(pid, 0, self._empty_props))
                else:
                    out.append(self._parse(b0, buf, i, end))
                    ok = self._ok_first  # CONNECT changes what may follow
                pos = end
        except ProtocolError as e:
            e.packets = out
            self._fail(mv, e)
            raise
        except Exception as e:  # defence in depth: a bug here must still look like bad input
            err = _err(f"malformed packet: decoder failed on input ({type(e).__name__}: {e})")
            err.packets = out
            self._fail(mv, err)
            raise err from e
        mv.release()
        if pos:
            del buf[:pos]
        return out

    def _fail(self, mv: memoryview, err: ProtocolError) -> None:
        mv.release()
        self._failed = err
        self._buf = bytearray()

    def _update_table(self) -> None:
        """Cache which first bytes pass `_check_first_byte` in the current state (hot-path shortcut)."""
        key = (self.server_side, self._connected, self.version)
        table = _OK_TABLES.get(key)
        if table is None:
            table = bytearray(256)
            for b0 in range(256):
                try:
                    self._check_first_byte(b0)
                    table[b0] = 1
                except ProtocolError:
                    pass
            _OK_TABLES[key] = table = bytes(table)
        self._ok_first = table

    def _check_first_byte(self, b0: int) -> None:
        t = b0 >> 4
        flags = b0 & 0x0F
        if t == 0:
            raise _err("malformed packet: packet type 0 is reserved")
        if t == 15 and self.version is not None and self.version != 5:
            raise _err("malformed packet: packet type 15 (AUTH) is reserved before MQTT 5")
        if t == 3:
            qos = (flags >> 1) & 3
            if qos == 3:
                raise _err("malformed packet: PUBLISH with QoS 3")
            if qos == 0 and flags & 0x08:
                raise _err("malformed packet: PUBLISH with QoS 0 must not set DUP")
        elif _FLAGS[t] != flags:
            raise _err(f"malformed packet: {_NAMES[t]} fixed header flags must be "
                       f"0x{_FLAGS[t]:X}, got 0x{flags:X}")
        if t not in self._allowed:
            side = "server" if self.server_side else "client"
            raise _err(f"protocol error: a {side} must not receive {_NAMES[t]}", 0x82)
        if self.server_side:
            if t == 1:
                if self._connected:
                    raise _err("protocol error: second CONNECT on the same connection", 0x82)
            elif not self._connected:
                raise _err(f"protocol error: first packet must be CONNECT, got {_NAMES[t]}", 0x82)

    # ------------------------------------------------------------------ packet bodies
    def _parse(self, b0: int, buf: bytearray, pos: int, end: int):
        t = b0 >> 4
        if t in _ACKS:
            return self._ack(t, buf, pos, end)
        if t == 12:
            self._empty(t, pos, end)
            return P.PingReq()
        if t == 13:
            self._empty(t, pos, end)
            return P.PingResp()
        if t == 1:
            pkt = _connect(self, buf, pos, end)
            self._connected = True
            self._update_table()
            return pkt
        v5 = self.version == 5
        if t == 8:
            return _subscribe(buf, pos, end, v5)
        if t == 10:
            return _unsubscribe(buf, pos, end, v5)
        if t == 14:
            return _reason_props(P.Disconnect, 14, buf, pos, end, v5)
        if t == 15:
            return _reason_props(P.Auth, 15, buf, pos, end, v5)
        if t == 2:
            return _connack(buf, pos, end, v5)
        if t == 9:
            return _suback(buf, pos, end, v5)
        return _unsuback(buf, pos, end, v5)  # t == 11

    @staticmethod
    def _empty(t: int, pos: int, end: int) -> None:
        if end != pos:
            raise _err(f"malformed packet: {_NAMES[t]} must have remaining length 0, got {end - pos}")

    def _publish(self, b0: int, buf: bytearray, mv: memoryview, pos: int, end: int) -> P.Publish:
        qos = (b0 >> 1) & 3
        if pos + 2 > end:
            raise _err("malformed packet: PUBLISH too short for its topic length")
        tlen = (buf[pos] << 8) | buf[pos + 1]
        tstop = pos + 2 + tlen
        if tstop > end:
            raise _err("malformed packet: PUBLISH topic runs past the end of the packet")
        try:
            topic = buf[pos + 2:tstop].decode("utf-8")
        except UnicodeDecodeError as e:
            raise _err(f"malformed packet: PUBLISH topic is not valid UTF-8 ({e.reason})") from None
        if "\x00" in topic:
            raise _err("malformed packet: PUBLISH topic contains U+0000")
        if "+" in topic or "#" in topic:
            raise _err(f"protocol error: PUBLISH topic {topic!r} contains a wildcard", 0x90)
        pos = tstop
        packet_id = None
        if qos:
            if pos + 2 > end:
                raise _err("malformed packet: PUBLISH missing its packet id")
            packet_id = (buf[pos] << 8) | buf[pos + 1]
            if packet_id == 0:
                raise _err("protocol error: PUBLISH with QoS > 0 has packet id 0", 0x82)
            pos += 2
        if self.version == 5:
            props, pos = decode_properties(buf, pos, end, 3)
            if not topic and props.topic_alias is None:
                raise _err("protocol error: PUBLISH with an empty topic and no topic alias", 0x82)
            if props.subscription_identifier and self.server_side:
                raise _err("protocol error: a client's PUBLISH must not carry a subscription identifier",
                           0x82)
        else:
            props = self._empty_props
            if props is None:
                props = P.Properties()
            if not topic:
                raise _err("protocol error: PUBLISH with an empty topic", 0x82)
        return P.Publish(topic, bytes(mv[pos:end]), qos, bool(b0 & 1), bool(b0 & 8), packet_id, props)

    def _ack(self, t: int, buf: bytearray, pos: int, end: int):
        rl = end - pos
        if rl < 2:
            raise _err(f"malformed packet: {_NAMES[t]} too short")
        pid = (buf[pos] << 8) | buf[pos + 1]
        if pid == 0:
            raise _err(f"protocol error: {_NAMES[t]} with packet id 0", 0x82)
        cls = _ACKS[t]
        if rl == 2:
            return cls(pid) if self._empty_props is None else cls(pid, 0, self._empty_props)
        if self.version != 5:
            raise _err(f"malformed packet: {_NAMES[t]} must have remaining length 2 before MQTT 5")
        rc = buf[pos + 2]
        if rc not in REASON_CODES_V5[t]:
            raise _err(f"malformed packet: reason code 0x{rc:02X} is not valid on {_NAMES[t]}")
        if rl == 3:
            return cls(pid, rc)
        props, p2 = decode_properties(buf, pos + 3, end, t)
        if p2 != end:
            raise _err(f"malformed packet: {end - p2} trailing bytes after {_NAMES[t]}")
        return cls(pid, rc, props)


def _connect(dec: Decoder, buf: bytearray, pos: int, end: int) -> P.Connect:
    name, pos = read_string(buf, pos, end, "protocol name")
    if pos + 4 > end:
        raise _err("malformed packet: CONNECT variable header truncated")
    level = buf[pos]
    flags = buf[pos + 1]
    keepalive = (buf[pos + 2] << 8) | buf[pos + 3]
    pos += 4
    if name == "MQTT":
        if level not in (4, 5):
            raise _err(f"unsupported protocol level {level} for protocol name MQTT", 0x84)
    elif name == "MQIsdp":
        if level != 3:
            raise _err(f"unsupported protocol level {level} for protocol name MQIsdp", 0x84)
    else:
        raise _err(f"unsupported protocol name {name!r}", 0x84)
    # Known from here on, so a server can answer a malformed CONNECT in the client's version.
    dec.version = level
    if flags & 0x01:
        raise _err("malformed packet: CONNECT reserved flag must be 0")
    will_flag = bool(flags & 0x04)
    will_qos = (flags >> 3) & 3
    will_retain = bool(flags & 0x20)
    if not will_flag and (will_qos or will_retain):
        raise _err("malformed packet: CONNECT will QoS/retain set without the will flag")
    if will_qos == 3:
        raise _err("malformed packet: CONNECT will QoS 3")
    has_user = bool(flags & 0x80)
    has_pass = bool(flags & 0x40)
    if has_pass and not has_user and level != 5:
        raise _err("protocol error: CONNECT password flag without user name flag before MQTT 5", 0x82)
    v5 = level == 5
    if v5:
        props, pos = decode_properties(buf, pos, end, 1)
    else:
        props = P.Properties()
    if props.authentication_data is not None and props.authentication_method is None:
        raise _err("protocol error: CONNECT authentication data without an authentication method", 0x82)
    client_id, pos = read_string(buf, pos, end, "client identifier")
    will = None
    if will_flag:
        wprops = P.Properties()
        if v5:
            wprops, pos = decode_properties(buf, pos, end, 0)
        wtopic, pos = read_string(buf, pos, end, "will topic")
        if not wtopic or "+" in wtopic or "#" in wtopic:
            raise _err(f"protocol error: invalid will topic {wtopic!r}", 0x82)
        wpayload, pos = read_binary(buf, pos, end, "will payload")
        will = P.Will(wtopic, wpayload, will_qos, will_retain, wprops)
    username = password = None
    if has_user:
        username, pos = read_string(buf, pos, end, "user name")
    if has_pass:
        password, pos = read_binary(buf, pos, end, "password")
    if pos != end:
        raise _err(f"malformed packet: {end - pos} trailing bytes after CONNECT payload")
    return P.Connect(client_id, level, bool(flags & 0x02), keepalive, username, password, will, props)


def _connack(buf, pos: int, end: int, v5: bool) -> P.ConnAck:
    if end - pos < 2:
        raise _err("malformed packet: CONNACK too short")
    ack_flags, rc = buf[pos], buf[pos + 1]
    if ack_flags & 0xFE:
        raise _err("malformed packet: CONNACK reserved flags must be 0")
    if v5:
        if rc not in REASON_CODES_V5[2]:
            raise _err(f"malformed packet: reason code 0x{rc:02X} is not valid on CONNACK")
        props, p2 = decode_properties(buf, pos + 2, end, 2)
        if p2 != end:
            raise _err("malformed packet: trailing bytes after CONNACK")
        if rc and ack_flags:
            raise _err("malformed packet: CONNACK session present set with a failure reason code")
        return P.ConnAck(bool(ack_flags), rc, props)
    if end - pos != 2:
        raise _err("malformed packet: CONNACK must have remaining length 2 before MQTT 5")
    if rc > 5:
        raise _err(f"malformed packet: CONNACK return code {rc} is not defined in MQTT 3.1.1")
    if rc and ack_flags:
        raise _err("malformed packet: CONNACK session present set with a failure return code")
    return P.ConnAck(bool(ack_flags), rc)


def _subscribe(buf, pos: int, end: int, v5: bool) -> P.Subscribe:
    if end - pos < 2:
        raise _err("malformed packet: SUBSCRIBE too short")
    pid = (buf[pos] << 8) | buf[pos + 1]
    if pid == 0:
        raise _err("protocol error: SUBSCRIBE with packet id 0", 0x82)
    pos += 2
    props = P.Properties()
    if v5:
        props, pos = decode_properties(buf, pos, end, 8)
    subs = []
    while pos < end:
        f, pos = read_string(buf, pos, end, "topic filter")
        if pos >= end:
            raise _err("malformed packet: SUBSCRIBE topic filter without subscription options")
        o = buf[pos]
        pos += 1
        qos = o & 3
        if qos == 3:
            raise _err(f"malformed packet: SUBSCRIBE to {f!r} with QoS 3")
        if not f:
            raise _err("protocol error: empty topic filter", 0x82)
        if v5:
            if o & 0xC0:
                raise _err("malformed packet: SUBSCRIBE options reserved bits must be 0")
            rh = (o >> 4) & 3
            if rh == 3:
                raise _err("protocol error: SUBSCRIBE retain handling 3", 0x82)
            no_local = bool(o & 4)
            if no_local and f.startswith("$share/"):
                raise _err("protocol error: No Local on a shared subscription", 0x82)
            subs.append(P.SubscriptionRequest(f, qos, no_local, bool(o & 8), rh))
        else:
            if o & 0xFC:
                raise _err("malformed packet: SUBSCRIBE requested QoS reserved bits must be 0")
            subs.append(P.SubscriptionRequest(f, qos))
    if not subs:
        raise _err("protocol error: SUBSCRIBE with no topic filters", 0x82)
    return P.Subscribe(pid, subs, props)


def _unsubscribe(buf, pos: int, end: int, v5: bool) -> P.Unsubscribe:
    if end - pos < 2:
        raise _err("malformed packet: UNSUBSCRIBE too short")
    pid = (buf[pos] << 8) | buf[pos + 1]
    if pid == 0:
        raise _err("protocol error: UNSUBSCRIBE with packet id 0", 0x82)
    pos += 2
    props = P.Properties()
    if v5:
        props, pos = decode_properties(buf, pos, end, 10)
    filters = []
    while pos < end:
        f, pos = read_string(buf, pos, end, "topic filter")
        if not f:
            raise _err("protocol error: empty topic filter", 0x82)
        filters.append(f)
    if not filters:
        raise _err("protocol error: UNSUBSCRIBE with no topic filters", 0x82)
    return P.Unsubscribe(pid, filters, props)


def _suback(buf, pos: int, end: int, v5: bool) -> P.SubAck:
    if end - pos < 2:
        raise _err("malformed packet: SUBACK too short")
    pid = (buf[pos] << 8) | buf[pos + 1]
    if pid == 0:
        raise _err("protocol error: SUBACK with packet id 0", 0x82)
    pos += 2
    props = P.Properties()
    if v5:
        props, pos = decode_properties(buf, pos, end, 9)
    codes = list(buf[pos:end])
    allowed = REASON_CODES_V5[9] if v5 else SUBACK_CODES_V311
    for c in codes:
        if c not in allowed:
            raise _err(f"malformed packet: SUBACK return code 0x{c:02X} is not valid")
    if not codes:
        raise _err("protocol error: SUBACK with no return codes", 0x82)
    return P.SubAck(pid, codes, props)


def _unsuback(buf, pos: int, end: int, v5: bool) -> P.UnsubAck:
    if end - pos < 2:
        raise _err("malformed packet: UNSUBACK too short")
    pid = (buf[pos] << 8) | buf[pos + 1]
    if pid == 0:
        raise _err("protocol error: UNSUBACK with packet id 0", 0x82)
    pos += 2
    if not v5:
        if pos != end:
            raise _err("malformed packet: UNSUBACK must have remaining length 2 before MQTT 5")
        return P.UnsubAck(pid)
    props, pos = decode_properties(buf, pos, end, 11)
    codes = list(buf[pos:end])
    for c in codes:
        if c not in REASON_CODES_V5[11]:
            raise _err(f"malformed packet: UNSUBACK reason code 0x{c:02X} is not valid")
    if not codes:
        raise _err("protocol error: UNSUBACK with no reason codes", 0x82)
    return P.UnsubAck(pid, codes, props)


def _reason_props(cls, t: int, buf, pos: int, end: int, v5: bool):
    if pos == end:
        return cls()
    if not v5:
        raise _err(f"malformed packet: {_NAMES[t]} must have remaining length 0 before MQTT 5")
    rc = buf[pos]
    if rc not in REASON_CODES_V5[t]:
        raise _err(f"malformed packet: reason code 0x{rc:02X} is not valid on {_NAMES[t]}")
    if end - pos == 1:
        return cls(rc)
    props, p2 = decode_properties(buf, pos + 1, end, t)
    if p2 != end:
        raise _err(f"malformed packet: trailing bytes after {_NAMES[t]}")
    return cls(rc, props)

