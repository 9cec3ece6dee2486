"""The gateway's compact encoding of MQTT metadata inside `Message.props` (opaque to the store).

Why our own format: the store must not know MQTT (DESIGN.md), yet a delivery needs the publish QoS,
the retain flag, the publisher's client id (MQTT 5 No Local) and the MQTT 5 application properties
that must be forwarded unchanged (payload format, message expiry, content type, response topic,
correlation data, user properties). A few bytes per record, decoded once per pulled message and
shared by every session that receives it.

Layout (version 1):
    u8  version (=1)
    u8  flags: bits 0-1 QoS, bit 2 retain
    u16 client-id length, client id (UTF-8)
    then zero or more MQTT 5 application properties, each `u8 id` + value, ids as in MQTT 5:
      0x01 payload_format_indicator u8 | 0x02 message_expiry_interval u32 |
      0x03 content_type str | 0x08 response_topic str | 0x09 correlation_data bin |
      0x26 user_property str,str        (str/bin = u16 length + bytes)
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

from lmqtt.gateway.mqtt import packets as P

VERSION = 1
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")


@dataclass(slots=True)
class RecordMeta:
    qos: int = 0
    retain: bool = False
    client_id: str = ""
    payload_format_indicator: int | None = None
    message_expiry_interval: int | None = None
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None
    user_property: list[tuple[str, str]] = field(default_factory=list)

    def has_app_properties(self) -> bool:
        return (self.payload_format_indicator is not None or self.message_expiry_interval is not None
                or self.content_type is not None or self.response_topic is not None
                or self.correlation_data is not None or bool(self.user_property))

    def to_properties(self) -> P.Properties:
        """MQTT 5 properties to put on an outbound PUBLISH (forwarded unchanged)."""
        return P.Properties(
            payload_format_indicator=self.payload_format_indicator,
            message_expiry_interval=self.message_expiry_interval,
            content_type=self.content_type,
            response_topic=self.response_topic,
            correlation_data=self.correlation_data,
            user_property=list(self.user_property),
        )


def _str(b: bytearray, s: str) -> None:
    raw = s.encode("utf-8")
    b += _U16.pack(len(raw))
    b += raw


def _bin(b: bytearray, raw: bytes) -> None:
    b += _U16.pack(len(raw))
    b += raw


def encode(qos: int, retain: bool, client_id: str, props: P.Properties | None = None) -> bytes:
    b = bytearray((VERSION, (qos & 3) | (4 if retain else 0)))
    _str(b, client_id)
    if props is not None:
        if props.payload_format_indicator is not None:
            b += bytes((0x01, props.payload_format_indicator & 0xFF))
        if props.message_expiry_interval is not None:
            b.append(0x02)
            b += _U32.pack(props.message_expiry_interval)
        if props.content_type is not None:
            b.append(0x03)
            _str(b, props.content_type)
        if props.response_topic is not None:
            b.append(0x08)
            _str(b, props.response_topic)
        if props.correlation_data is not None:
            b.append(0x09)
            _bin(b, props.correlation_data)
        for k, v in props.user_property:
            b.append(0x26)
            _str(b, k)
            _str(b, v)
    return bytes(b)


_ENCODED: dict[tuple[int, bool, str], bytes] = {}


def encode_cached(qos: int, retain: bool, client_id: str, props: P.Properties | None = None) -> bytes:
    """encode(), memoised for the common case of a PUBLISH without application properties (a
    publisher's records then all carry the same few bytes: QoS, retain, client id)."""
    if props is not None and (props.payload_format_indicator is not None
                              or props.message_expiry_interval is not None
                              or props.content_type is not None or props.response_topic is not None
                              or props.correlation_data is not None or props.user_property):
        return encode(qos, retain, client_id, props)
    key = (qos, retain, client_id)
    b = _ENCODED.get(key)
    if b is None:
        b = encode(qos, retain, client_id)
        if len(_ENCODED) >= 4096:
            _ENCODED.clear()
        _ENCODED[key] = b
    return b


class RecordPropsError(ValueError):
    """props bytes that this gateway did not write (e.g. a record produced through the SDK)."""


def decode(data: bytes) -> RecordMeta:
    """Parse props; records written by other producers (SDK) decode as QoS 0, no properties."""
    if not data:
        return RecordMeta()
    if data[0] != VERSION or len(data) < 4:
        raise RecordPropsError(f"unknown record props version {data[0]}")
    if data[1] & 3 == 3:
        raise RecordPropsError("record props carry QoS 3")
    m = RecordMeta(qos=data[1] & 3, retain=bool(data[1] & 4))
    mv = memoryview(data)
    pos = 2

    def take_str() -> str:
        nonlocal pos
        (n,) = _U16.unpack_from(data, pos)
        pos += 2
        s = bytes(mv[pos:pos + n]).decode("utf-8")
        pos += n
        return s

    m.client_id = take_str()
    end = len(data)
    while pos < end:
        pid = data[pos]
        pos += 1
        if pid == 0x01:
            m.payload_format_indicator = data[pos]
            pos += 1
        elif pid == 0x02:
            (m.message_expiry_interval,) = _U32.unpack_from(data, pos)
            pos += 4
        elif pid == 0x03:
            m.content_type = take_str()
        elif pid == 0x08:
            m.response_topic = take_str()
        elif pid == 0x09:
            (n,) = _U16.unpack_from(data, pos)
            pos += 2
            m.correlation_data = bytes(mv[pos:pos + n])
            pos += n
        elif pid == 0x26:
            k = take_str()
            m.user_property.append((k, take_str()))
        else:
            raise RecordPropsError(f"unknown property id 0x{pid:02X} in record props")
    return m


def safe_decode(data: bytes) -> RecordMeta:
    """decode(), but a foreign/corrupt props value becomes plain QoS 0 metadata instead of an error."""
    try:
        return decode(data)
    except (RecordPropsError, struct.error, UnicodeDecodeError, IndexError):
        return RecordMeta()
