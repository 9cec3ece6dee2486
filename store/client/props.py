"""The record `props` encoding shared by MQTT and SDK messages (opaque to the store itself).

The one implementation of this format: the gateway (`gateway/storage/record_props.py`, which adds the MQTT
packet conversions) and the SDK (`store/client/`) both encode and decode through `encode_fields` /
`decode_fields`, so an MQTT publish and an SDK send carry byte-identical props.

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


def encode_fields(qos: int, retain: bool, client_id: str, payload_format_indicator=None,
                  message_expiry_interval=None, content_type=None, response_topic=None,
                  correlation_data=None, user_properties=()) -> bytes:
    b = bytearray((VERSION, (qos & 3) | (4 if retain else 0)))
    _str(b, client_id)
    if payload_format_indicator is not None:
        b += bytes((0x01, payload_format_indicator & 0xFF))
    if message_expiry_interval is not None:
        b.append(0x02)
        b += _U32.pack(message_expiry_interval)
    if content_type is not None:
        b.append(0x03)
        _str(b, content_type)
    if response_topic is not None:
        b.append(0x08)
        _str(b, response_topic)
    if correlation_data is not None:
        b.append(0x09)
        b += _U16.pack(len(correlation_data))
        b += correlation_data
    for k, v in user_properties:
        b.append(0x26)
        _str(b, k)
        _str(b, v)
    return bytes(b)


def decode_fields(data) -> tuple:
    """(qos, retain, client_id, payload_format_indicator, message_expiry_interval, content_type,
    response_topic, correlation_data, user_properties list): the order of both dataclasses built
    from it. Empty props are QoS 0 without properties; ValueError for bytes of another format."""
    if not data:
        return (0, False, "", None, None, None, None, None, [])
    if data[0] != VERSION or len(data) < 4:
        raise ValueError(f"unknown record props version {data[0]}")
    if data[1] & 3 == 3:
        raise ValueError("record props carry QoS 3")
    pfi = mei = ct = rt = cd = None
    user: list[tuple[str, str]] = []
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

        client_id = take().decode()
        end = len(data)
        while pos < end:
            pid = data[pos]
            pos += 1
            if pid == 0x01:
                pfi = data[pos]
                pos += 1
            elif pid == 0x02:
                (mei,) = _U32.unpack_from(data, pos)
                pos += 4
            elif pid == 0x03:
                ct = take().decode()
            elif pid == 0x08:
                rt = take().decode()
            elif pid == 0x09:
                cd = take()
            elif pid == 0x26:
                k = take().decode()
                user.append((k, take().decode()))
            else:
                raise ValueError(f"unknown property id 0x{pid:02X} in record props")
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise ValueError(f"props malformed: {e}") from None
    return (data[1] & 3, bool(data[1] & 4), client_id, pfi, mei, ct, rt, cd, user)


def encode(p: MessageProperties) -> bytes:
    return encode_fields(p.qos, p.retain, p.client_id, p.payload_format_indicator, p.message_expiry_interval,
                         p.content_type, p.response_topic, p.correlation_data, p.user_properties)


def decode(data: bytes) -> MessageProperties:
    """Empty props decode as QoS 0 without properties; ValueError for bytes of another format."""
    return MessageProperties(*decode_fields(data))


# A retained message keeps its expiry deadline in front of its record props: the store keeps no
# time for a retained value, and MQTT 5 §3.3.2.3.3 wants a retained message with an expiry gone
# once it expired, and its remaining interval forwarded when it is sent on subscribe. Written by
# the gateway (a retained PUBLISH) and by the store node (the retained will of a gateway that is
# gone, store/node/gateway_wills.py), read by the gateway (gateway/delivery/retained.py).
RETAINED_DEADLINE = 0xFE       # never a record props VERSION byte
_U64 = struct.Struct(">Q")


def retained_props(props: bytes, now_ms: int) -> bytes:
    """What to keep as the retained value's props: `props`, prefixed with the expiry deadline
    (ms since the epoch) when the message has a Message Expiry Interval. Props of another format
    are kept as they are."""
    if not props:
        return props
    try:
        mei = decode_fields(props)[4]
    except ValueError:
        return props
    if mei is None:
        return props
    return bytes((RETAINED_DEADLINE,)) + _U64.pack(now_ms + mei * 1000) + props


def split_retained(value: bytes) -> tuple[bytes, int | None]:
    """(record props, expiry deadline ms or None) of a retained value written by `retained_props`."""
    if value and value[0] == RETAINED_DEADLINE and len(value) >= 9:
        return value[9:], _U64.unpack_from(value, 1)[0]
    return value, None
