"""Packet objects -> bytes, for MQTT 3.1.1 (version 4, or 3 = MQTT 3.1 "MQIsdp") and 5.0.

Why `PublishTemplate`: a message fanned out to N subscribers differs per subscriber only in the
first byte (QoS/DUP/retain flags) and the 2-byte packet id; encoding topic, properties and payload
once and patching those bytes keeps fan-out at one memcpy per subscriber.

The encoder trusts its caller (our own server/clients): it raises ValueError for values that cannot be
represented at all (e.g. strings over 65535 bytes), but it does not police MQTT semantics.
"""
from __future__ import annotations

from struct import pack

from . import packets as P
from .properties import encode_properties
from .reason_codes import SUBACK_FAILURE_V311, connack_return_code_v311
from .wire import encode_string, encode_varint

__all__ = ["encode", "encode_publish", "PublishTemplate"]


def _bin(b: bytes) -> bytes:
    if len(b) > 0xFFFF:
        raise ValueError(f"binary data of {len(b)} bytes does not fit MQTT's 2-byte length")
    return pack("!H", len(b)) + bytes(b)


def _frame(first: int, body: bytes) -> bytes:
    return bytes((first,)) + encode_varint(len(body)) + body


def _connect(p: P.Connect, version: int) -> bytes:
    # `version` wins, except that a 3.1 ("MQIsdp") CONNECT stays 3.1 when asked for the 3.x wire format.
    level = 3 if (version in (3, 4) and p.protocol_level == 3) else (version or p.protocol_level)
    name = b"\x00\x06MQIsdp" if level == 3 else b"\x00\x04MQTT"
    flags = 0x02 if p.clean_start else 0
    will = p.will
    if will is not None:
        flags |= 0x04 | (will.qos << 3) | (0x20 if will.retain else 0)
    if p.password is not None:
        flags |= 0x40
    if p.username is not None:
        flags |= 0x80
    parts = [name, bytes((level, flags)), pack("!H", p.keepalive)]
    if level == 5:
        parts.append(encode_properties(p.properties))
    parts.append(encode_string(p.client_id))
    if will is not None:
        if level == 5:
            parts.append(encode_properties(will.properties))
        parts.append(encode_string(will.topic))
        parts.append(_bin(will.payload))
    if p.username is not None:
        parts.append(encode_string(p.username))
    if p.password is not None:
        parts.append(_bin(p.password))
    return _frame(0x10, b"".join(parts))


def _connack(p: P.ConnAck, version: int) -> bytes:
    sp = 1 if p.session_present else 0
    if version == 5:
        return _frame(0x20, bytes((sp, p.reason_code)) + encode_properties(p.properties))
    return bytes((0x20, 2, sp, connack_return_code_v311(p.reason_code)))


def _ack(first: int):
    def enc(p, version: int) -> bytes:
        if version == 5:
            props = encode_properties(p.properties)
            if props != b"\x00":
                return _frame(first, pack("!HB", p.packet_id, p.reason_code) + props)
            if p.reason_code:  # reason code only: the short form
                return pack("!BBHB", first, 3, p.packet_id, p.reason_code)
        return pack("!BBH", first, 2, p.packet_id)
    return enc


def _subscribe(p: P.Subscribe, version: int) -> bytes:
    parts = [pack("!H", p.packet_id)]
    if version == 5:
        parts.append(encode_properties(p.properties))
    for s in p.subscriptions:
        opts = s.qos
        if version == 5:
            opts |= (0x04 if s.no_local else 0) | (0x08 if s.retain_as_published else 0) \
                | (s.retain_handling << 4)
        parts.append(encode_string(s.topic_filter))
        parts.append(bytes((opts,)))
    return _frame(0x82, b"".join(parts))


def _suback(p: P.SubAck, version: int) -> bytes:
    if version == 5:
        return _frame(0x90, pack("!H", p.packet_id) + encode_properties(p.properties)
                      + bytes(p.reason_codes))
    codes = bytes(c if c < 0x80 else SUBACK_FAILURE_V311 for c in p.reason_codes)
    return _frame(0x90, pack("!H", p.packet_id) + codes)


def _unsubscribe(p: P.Unsubscribe, version: int) -> bytes:
    parts = [pack("!H", p.packet_id)]
    if version == 5:
        parts.append(encode_properties(p.properties))
    parts.extend(encode_string(f) for f in p.topic_filters)
    return _frame(0xA2, b"".join(parts))


def _unsuback(p: P.UnsubAck, version: int) -> bytes:
    if version == 5:
        return _frame(0xB0, pack("!H", p.packet_id) + encode_properties(p.properties)
                      + bytes(p.reason_codes))
    return pack("!BBH", 0xB0, 2, p.packet_id)


def _disconnect(p: P.Disconnect, version: int) -> bytes:
    if version == 5:
        props = encode_properties(p.properties)
        if props != b"\x00":
            return _frame(0xE0, bytes((p.reason_code,)) + props)
        if p.reason_code:
            return bytes((0xE0, 1, p.reason_code))
    return b"\xe0\x00"


def _auth(p: P.Auth, version: int) -> bytes:
    if version != 5:
        raise ValueError("AUTH exists only in MQTT 5")
    props = encode_properties(p.properties)
    if p.reason_code == 0 and props == b"\x00":
        return b"\xf0\x00"
    return _frame(0xF0, bytes((p.reason_code,)) + props)


def _publish(p: P.Publish, version: int) -> bytes:
    return encode_publish(p.topic, p.payload, p.qos, p.retain, p.dup, p.packet_id, p.properties, version)


_ENCODERS = {
    P.Connect: _connect, P.ConnAck: _connack, P.Publish: _publish,
    P.PubAck: _ack(0x40), P.PubRec: _ack(0x50), P.PubRel: _ack(0x62), P.PubComp: _ack(0x70),
    P.Subscribe: _subscribe, P.SubAck: _suback, P.Unsubscribe: _unsubscribe, P.UnsubAck: _unsuback,
    P.PingReq: lambda p, v: b"\xc0\x00", P.PingResp: lambda p, v: b"\xd0\x00",
    P.Disconnect: _disconnect, P.Auth: _auth,
}


def encode(packet, version: int) -> bytes:
    """Encode one packet for protocol `version` (3, 4 or 5)."""
    try:
        enc = _ENCODERS[type(packet)]
    except KeyError:
        raise TypeError(f"not an MQTT packet: {packet!r}") from None
    return enc(packet, version)


def encode_publish(topic: str, payload: bytes, qos: int = 0, retain: bool = False, dup: bool = False,
                   packet_id: int | None = None, properties: P.Properties | None = None,
                   version: int = 4) -> bytes:
    """Encode a PUBLISH without building a packet object (the hot path of every delivery)."""
    t = topic.encode("utf-8")
    first = 0x30 | (qos << 1) | (0x08 if dup else 0) | (0x01 if retain else 0)
    props = encode_properties(properties) if version == 5 else b""
    if qos:
        if not packet_id:
            raise ValueError("a QoS 1/2 PUBLISH needs a packet id in 1..65535")
        head = pack("!H", len(t)) + t + pack("!H", packet_id) + props
    else:
        head = pack("!H", len(t)) + t + props
    return b"".join((bytes((first,)), encode_varint(len(head) + len(payload)), head, payload))


class PublishTemplate:
    """One message pre-encoded for fan-out; per subscriber only flags and packet id change.

    `for_packet_id(pid)` returns the QoS 1/2 encoding with `pid` (the template's QoS), `qos0` the
    encoding for subscribers granted QoS 0 (computed once, on first use).
    """

    __slots__ = ("topic", "payload", "qos", "retain", "properties", "version", "_buf", "_pid_at",
                 "_qos0")

    def __init__(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False,
                 properties: P.Properties | None = None, version: int = 4) -> None:
        self.topic, self.payload, self.qos, self.retain = topic, payload, qos, retain
        self.properties, self.version = properties, version
        self._qos0: bytes | None = None
        if qos:
            enc = encode_publish(topic, payload, qos, retain, False, 0xFFFF, properties, version)
            self._buf = bytearray(enc)
            rl_len = 1
            while enc[rl_len] & 0x80:
                rl_len += 1
            self._pid_at = 1 + rl_len + 2 + len(topic.encode("utf-8"))
        else:
            self._buf = None
            self._pid_at = 0

    def for_packet_id(self, pid: int, dup: bool = False) -> bytes:
        buf = self._buf
        if buf is None:
            raise ValueError("a QoS 0 template has no packet id; use .qos0")
        if not 0 < pid <= 0xFFFF:
            raise ValueError(f"packet id must be 1..65535, got {pid}")
        buf[0] = 0x30 | (self.qos << 1) | (0x08 if dup else 0) | (0x01 if self.retain else 0)
        at = self._pid_at
        buf[at] = pid >> 8
        buf[at + 1] = pid & 0xFF
        return bytes(buf)

    @property
    def qos0(self) -> bytes:
        if self._qos0 is None:
            self._qos0 = encode_publish(self.topic, self.payload, 0, self.retain, False, None,
                                        self.properties, self.version)
        return self._qos0
