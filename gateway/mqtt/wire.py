"""Primitive MQTT wire types: variable byte integers, UTF-8 strings, binary data.

Readers work on a bytearray/bytes `buf` with explicit `pos`/`end` bounds (the end of the current
packet), so a length field can never make them read into the next packet or allocate more than
the packet holds. All failures are ProtocolError.
"""
from __future__ import annotations

from struct import pack

from .errors import ProtocolError

__all__ = ["encode_varint", "read_varint", "read_string", "read_binary", "encode_string",
           "VARINT_MAX"]

VARINT_MAX = 268_435_455
_SMALL_VARINTS = [bytes((i,)) for i in range(128)]


def encode_varint(n: int) -> bytes:
    """MQTT variable byte integer (1..4 bytes)."""
    if n < 128:
        if n < 0:
            raise ValueError(f"variable byte integer must be >= 0, got {n}")
        return _SMALL_VARINTS[n]
    if n > VARINT_MAX:
        raise ValueError(f"variable byte integer {n} exceeds the maximum {VARINT_MAX}")
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def read_varint(buf, pos: int, end: int) -> tuple[int, int]:
    """Read a variable byte integer at `pos`; at most 4 bytes, never past `end`."""
    value = 0
    shift = 0
    for i in range(4):
        if pos >= end:
            raise ProtocolError("malformed packet: variable byte integer runs past the end of the packet")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
    raise ProtocolError("malformed packet: variable byte integer longer than 4 bytes")


def read_string(buf, pos: int, end: int, what: str = "string") -> tuple[str, int]:
    """Read a 2-byte-length UTF-8 string; rejects invalid UTF-8, surrogates and U+0000."""
    pos, stop = _length_prefixed(buf, pos, end, what)
    try:
        s = buf[pos:stop].decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"malformed packet: {what} is not valid UTF-8 ({e.reason})") from None
    if "\x00" in s:
        raise ProtocolError(f"malformed packet: {what} contains U+0000")
    return s, stop


def read_binary(buf, pos: int, end: int, what: str = "binary data") -> tuple[bytes, int]:
    pos, stop = _length_prefixed(buf, pos, end, what)
    return bytes(buf[pos:stop]), stop


def _length_prefixed(buf, pos: int, end: int, what: str) -> tuple[int, int]:
    """Bounds of a 2-byte-length-prefixed field at `pos`, checked against `end` (never trusts the
    length: a claimed size past the packet is a malformed packet, not a read past it)."""
    if pos + 2 > end:
        raise ProtocolError(f"malformed packet: {what} length runs past the end of the packet")
    n = (buf[pos] << 8) | buf[pos + 1]
    pos += 2
    stop = pos + n
    if stop > end:
        raise ProtocolError(f"malformed packet: {what} of {n} bytes runs past the end of the packet")
    return pos, stop


def encode_string(s: str) -> bytes:
    b = s.encode("utf-8")
    if len(b) > 0xFFFF:
        raise ValueError(f"string of {len(b)} bytes does not fit MQTT's 2-byte length")
    return pack("!H", len(b)) + b


