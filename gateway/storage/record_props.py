"""The gateway's compact encoding of MQTT metadata inside `Message.props` (opaque to the store).

Why our own format: the store must not know MQTT (docs/internals.md), yet a delivery needs the publish QoS,
the retain flag, the publisher's client id (MQTT 5 No Local) and the MQTT 5 application properties
that must be forwarded unchanged (payload format, message expiry, content type, response topic,
correlation data, user properties). A few bytes per record, decoded once per pulled message and
shared by every session that receives it.

The byte layout and its one codec are in `store/client/props.py` (the SDK writes and reads the same bytes);
this module adds the conversions from and to the MQTT packet classes and the gateway's caches.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

from lmqtt.gateway.mqtt import packets as P
from lmqtt.store.client.props import VERSION, decode_fields, encode_fields  # noqa: F401  (VERSION re-exported)
# a retained value's props carry its expiry deadline in front (`retained_props`, `split_retained`):
# that encoding is the SDK's props module's too, since the store node writes it for the retained
# will of a gateway that is gone (store/node/command.py)
from lmqtt.store.client.props import RETAINED_DEADLINE, retained_props, split_retained  # noqa: F401  (re-exported)


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


def encode(qos: int, retain: bool, client_id: str, props: P.Properties | None = None) -> bytes:
    if props is None:
        return encode_fields(qos, retain, client_id)
    return encode_fields(qos, retain, client_id, props.payload_format_indicator, props.message_expiry_interval,
                         props.content_type, props.response_topic, props.correlation_data, props.user_property)


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
    """Parse props; empty props (e.g. a plain SDK record) decode as QoS 0 without properties."""
    try:
        return RecordMeta(*decode_fields(data))
    except ValueError as e:
        raise RecordPropsError(str(e)) from None


def safe_decode(data: bytes) -> RecordMeta:
    """decode(), but a foreign/corrupt props value becomes plain QoS 0 metadata instead of an error."""
    try:
        return decode(data)
    except (RecordPropsError, struct.error, UnicodeDecodeError, IndexError):
        return RecordMeta()


class MetaCache(dict):
    """props bytes -> decoded RecordMeta (`safe_decode`): a publisher's records usually carry
    identical props (QoS, retain, client id), so each distinct value is decoded once (a RecordMeta
    is never mutated after decoding). `cache[props]` decodes on a miss; `cache.get(props)` is the
    plain lookup for loops that inline the hit. Bounded: cleared when it holds 4,096 values."""

    __slots__ = ()

    def __missing__(self, props: bytes) -> RecordMeta:
        rec = safe_decode(props)
        if len(self) >= 4096:
            self.clear()
        self[props] = rec
        return rec

