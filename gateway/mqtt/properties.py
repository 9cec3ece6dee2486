"""MQTT 5 property table, encoder and decoder.

Why a table: one row per property (id, attribute, wire type, packets it may appear on, value check)
keeps the encoder, the strict decoder and the tests in agreement; adding a property is one row.
"""
from __future__ import annotations

from operator import attrgetter
from struct import pack, unpack_from

from .errors import ProtocolError
from .packets import Properties
from .wire import encode_varint, read_binary, read_string, read_varint

__all__ = ["PROPERTY_TABLE", "WILL", "encode_properties", "decode_properties", "ALLOWED"]

# Packet type numbers (fixed header high nibble); WILL is a pseudo-type for will properties.
CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT, AUTH = 8, 9, 10, 11, 12, 13, 14, 15
WILL = 0

_ALL = frozenset(range(0, 16))
_BOOL = (0, 1)


def _nonzero(v: int) -> bool:
    return v != 0


def _bool(v: int) -> bool:
    return v in _BOOL


# id: (attribute, kind, allowed packet types, value check or None)
PROPERTY_TABLE: dict[int, tuple[str, str, frozenset[int], object]] = {
    0x01: ("payload_format_indicator", "byte", frozenset({PUBLISH, WILL}), _bool),
    0x02: ("message_expiry_interval", "u32", frozenset({PUBLISH, WILL}), None),
    0x03: ("content_type", "str", frozenset({PUBLISH, WILL}), None),
    0x08: ("response_topic", "str", frozenset({PUBLISH, WILL}), None),
    0x09: ("correlation_data", "bin", frozenset({PUBLISH, WILL}), None),
    0x0B: ("subscription_identifier", "varint", frozenset({PUBLISH, SUBSCRIBE}), _nonzero),
    0x11: ("session_expiry_interval", "u32", frozenset({CONNECT, CONNACK, DISCONNECT}), None),
    0x12: ("assigned_client_identifier", "str", frozenset({CONNACK}), None),
    0x13: ("server_keep_alive", "u16", frozenset({CONNACK}), None),
    0x15: ("authentication_method", "str", frozenset({CONNECT, CONNACK, AUTH}), None),
    0x16: ("authentication_data", "bin", frozenset({CONNECT, CONNACK, AUTH}), None),
    0x17: ("request_problem_information", "byte", frozenset({CONNECT}), _bool),
    0x18: ("will_delay_interval", "u32", frozenset({WILL}), None),
    0x19: ("request_response_information", "byte", frozenset({CONNECT}), _bool),
    0x1A: ("response_information", "str", frozenset({CONNACK}), None),
    0x1C: ("server_reference", "str", frozenset({CONNACK, DISCONNECT}), None),
    0x1F: ("reason_string", "str",
           frozenset({CONNACK, PUBACK, PUBREC, PUBREL, PUBCOMP, SUBACK, UNSUBACK, DISCONNECT, AUTH}), None),
    0x21: ("receive_maximum", "u16", frozenset({CONNECT, CONNACK}), _nonzero),
    0x22: ("topic_alias_maximum", "u16", frozenset({CONNECT, CONNACK}), None),
    0x23: ("topic_alias", "u16", frozenset({PUBLISH}), _nonzero),
    0x24: ("maximum_qos", "byte", frozenset({CONNACK}), _bool),
    0x25: ("retain_available", "byte", frozenset({CONNACK}), _bool),
    0x26: ("user_property", "pair", _ALL, None),
    0x27: ("maximum_packet_size", "u32", frozenset({CONNECT, CONNACK}), _nonzero),
    0x28: ("wildcard_subscription_available", "byte", frozenset({CONNACK}), _bool),
    0x29: ("subscription_identifier_available", "byte", frozenset({CONNACK}), _bool),
    0x2A: ("shared_subscription_available", "byte", frozenset({CONNACK}), _bool),
}

#: packet type -> attribute names allowed on it (for tests and for callers building packets)
ALLOWED: dict[int, frozenset[str]] = {
    t: frozenset(attr for attr, _, types, _ in PROPERTY_TABLE.values() if t in types) for t in range(16)
}

_ENCODE_ORDER = [(pid, kind) for pid, (attr, kind, _, _) in PROPERTY_TABLE.items()]
# One C-level call fetches every property value; an all-absent tuple is the common case.
_GET_ALL = attrgetter(*(attr for attr, _, _, _ in PROPERTY_TABLE.values()))
_ABSENT = _GET_ALL(Properties())
_EMPTY = b"\x00"


def _enc_str(s: str) -> bytes:
    b = s.encode("utf-8")
    if len(b) > 0xFFFF:
        raise ValueError(f"string of {len(b)} bytes does not fit MQTT's 2-byte length")
    return pack("!H", len(b)) + b


def _enc_bin(b: bytes) -> bytes:
    if len(b) > 0xFFFF:
        raise ValueError(f"binary data of {len(b)} bytes does not fit MQTT's 2-byte length")
    return pack("!H", len(b)) + bytes(b)


def encode_properties(props: Properties | None) -> bytes:
    """Property block with its varint length prefix (b"\\x00" when there are none)."""
    if props is None:
        return _EMPTY
    values = _GET_ALL(props)
    if values == _ABSENT:
        return _EMPTY
    parts: list[bytes] = []
    for (pid, kind), v in zip(_ENCODE_ORDER, values):
        if v is None or (v == [] and kind in ("pair", "varint")):
            continue
        if kind == "byte":
            parts.append(bytes((pid, v)))
        elif kind == "u16":
            parts.append(pack("!BH", pid, v))
        elif kind == "u32":
            parts.append(pack("!BI", pid, v))
        elif kind == "str":
            parts.append(bytes((pid,)) + _enc_str(v))
        elif kind == "bin":
            parts.append(bytes((pid,)) + _enc_bin(v))
        elif kind == "varint":
            for one in v:
                parts.append(bytes((pid,)) + encode_varint(one))
        else:  # pair
            for k, val in v:
                parts.append(bytes((pid,)) + _enc_str(k) + _enc_str(val))
    if not parts:
        return _EMPTY
    body = b"".join(parts)
    return encode_varint(len(body)) + body


def decode_properties(buf, pos: int, end: int, ptype: int) -> tuple[Properties, int]:
    """Decode the property block at `pos` (length prefix included); returns (properties, new pos).

    Strict: unknown ids, properties not allowed on `ptype`, duplicates and out-of-range values are
    ProtocolErrors; the block must not run past `end`.
    """
    if pos < end and buf[pos] == 0:  # the common case: no properties
        return Properties(), pos + 1
    length, pos = read_varint(buf, pos, end)
    stop = pos + length
    if stop > end:
        raise ProtocolError("malformed packet: property length runs past the end of the packet")
    props = Properties()
    seen = 0  # bit set of property ids already read (all ids are < 64)
    while pos < stop:
        pid = buf[pos]
        pos += 1
        row = PROPERTY_TABLE.get(pid)
        if row is None:
            raise ProtocolError(f"malformed packet: unknown property id 0x{pid:02X}")
        attr, kind, types, check = row
        if ptype not in types:
            raise ProtocolError(f"protocol error: property {attr} (0x{pid:02X}) is not allowed on "
                                f"{_TYPE_NAMES[ptype]}", 0x82)
        bit = 1 << pid
        if seen & bit and kind != "pair" and not (pid == 0x0B and ptype == PUBLISH):
            raise ProtocolError(f"protocol error: property {attr} (0x{pid:02X}) appears more than once",
                                0x82)
        seen |= bit
        if kind == "byte":
            if pos + 1 > stop:
                raise ProtocolError(f"malformed packet: property {attr} truncated")
            v = buf[pos]
            pos += 1
        elif kind == "u16":
            if pos + 2 > stop:
                raise ProtocolError(f"malformed packet: property {attr} truncated")
            v = unpack_from("!H", buf, pos)[0]
            pos += 2
        elif kind == "u32":
            if pos + 4 > stop:
                raise ProtocolError(f"malformed packet: property {attr} truncated")
            v = unpack_from("!I", buf, pos)[0]
            pos += 4
        elif kind == "str":
            v, pos = read_string(buf, pos, stop, attr)
        elif kind == "bin":
            v, pos = read_binary(buf, pos, stop, attr)
        elif kind == "varint":
            v, pos = read_varint(buf, pos, stop)
        else:
            k, pos = read_string(buf, pos, stop, "user property name")
            val, pos = read_string(buf, pos, stop, "user property value")
            props.user_property.append((k, val))
            continue
        if check is not None and not check(v):
            raise ProtocolError(f"protocol error: property {attr} has invalid value {v}", 0x82)
        if kind == "varint":
            props.subscription_identifier.append(v)
        else:
            setattr(props, attr, v)
    if pos != stop:
        raise ProtocolError("malformed packet: property block length mismatch")
    return props, pos


_TYPE_NAMES = {0: "will properties", 1: "CONNECT", 2: "CONNACK", 3: "PUBLISH", 4: "PUBACK", 5: "PUBREC",
               6: "PUBREL", 7: "PUBCOMP", 8: "SUBSCRIBE", 9: "SUBACK", 10: "UNSUBSCRIBE", 11: "UNSUBACK",
               12: "PINGREQ", 13: "PINGRESP", 14: "DISCONNECT", 15: "AUTH"}
