"""The record `props` encoding shared by MQTT and SDK messages (opaque to the store itself).

The same bytes as `gateway/record_props.py` writes (layout below); this is the pure codec without
the MQTT packet classes, so the SDK in `store/client/` can write and read it without importing the
gateway. `tests/store/test_sdk_mqtt.py::test_props_codec_matches_gateway` checks both agree.

Layout (version 1):
    u8  version (=1)
    u8  flags: bits 0-1 QoS, bit 2 retain
    u16 client-id length, client id (UTF-8)
    then zero or more MQTT 5 application properties, each `u8 id` + value:
      0x01 payload_format_indicator u8 | 0x02 message_expiry_interval u32 |
      0x03 content_type str | 0x08 response_topic str | 0x09 correlation_data bin |
      0x26 user_property str,str        (str/bin = u16 length + bytes)
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

VERSION = 1
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")


@dataclass(slots=True)
class MessageProperties:
    qos: int = 0
    retain: bool = False
    client_id: str = ""
    payload_format_indicator: int | None = None
    message_expiry_interval: int | None = None
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None
    user_properties: list[tuple[str, str]] = field(default_factory=list)


def _str(b: bytearray, s: str) -> None:
    raw = s.encode("utf-8")
    b += _U16.pack(len(raw))
    b += raw


def encode(p: MessageProperties) -> bytes:
    b = bytearray((VERSION, (p.qos & 3) | (4 if p.retain else 0)))
    _str(b, p.client_id)
    if p.payload_format_indicator is not None:
        b += bytes((0x01, p.payload_format_indicator & 0xFF))
    if p.message_expiry_interval is not None:
        b.append(0x02)
        b += _U32.pack(p.message_expiry_interval)
    if p.content_type is not None:
        b.append(0x03)
        _str(b, p.content_type)
    if p.response_topic is not None:
        b.append(0x08)
        _str(b, p.response_topic)
    if p.correlation_data is not None:
        b.append(0x09)
        b += _U16.pack(len(p.correlation_data))
        b += p.correlation_data
    for k, v in p.user_properties:
        b.append(0x26)
        _str(b, k)
        _str(b, v)
    return bytes(b)


def decode(data: bytes) -> MessageProperties:
    """Empty props decode as QoS 0 without properties; ValueError for bytes of another format."""
    if not data:
        return MessageProperties()
    if data[0] != VERSION or len(data) < 4 or data[1] & 3 == 3:
        raise ValueError("props are not lmqtt record props (version 1)")
    m = MessageProperties(qos=data[1] & 3, retain=bool(data[1] & 4))
    pos = 2
    try:
        def take() -> bytes:
            nonlocal pos
            (n,) = _U16.unpack_from(data, pos)
            pos += 2
            if pos + n > len(data):
                raise ValueError("props truncated")
            v = bytes(data[pos:pos + n])
            pos += n
            return v

        m.client_id = take().decode()
        while pos < len(data):
            pid = data[pos]
            pos += 1
            if pid == 0x01:
                m.payload_format_indicator = data[pos]
                pos += 1
            elif pid == 0x02:
                (m.message_expiry_interval,) = _U32.unpack_from(data, pos)
                pos += 4
            elif pid == 0x03:
                m.content_type = take().decode()
            elif pid == 0x08:
                m.response_topic = take().decode()
            elif pid == 0x09:
                m.correlation_data = take()
            elif pid == 0x26:
                k = take().decode()
                m.user_properties.append((k, take().decode()))
            else:
                raise ValueError(f"unknown property id 0x{pid:02X}")
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise ValueError(f"props malformed: {e}") from None
    return m
