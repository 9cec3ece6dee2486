"""What a CALL handler of the store server answers with or raises, and the flags and texts the
server and its connections share (server/__init__.py `StoreServer`, server/connection.py
`StoreConnection`): a module of its own so that the connection needs nothing of the server's."""
from __future__ import annotations

import struct

from .. import protocol as W

# what the disk-full episode calls the SDK metadata's writes (store/disk_space.py write_failed)
META_WRITES = "writing the SDK metadata (RocksDB: producer dedup, consumer offsets)"
META_THEN = "SDK requests that write it are refused until space is freed"

# StoreServer.produce's flag for a PRODUCE from an SDK client's connection (not a gateway's link):
# above the wire's one byte of frame flags, so no frame can carry it; wrappers of produce pass it on
F_SDK_CLIENT = 0x10000
_U32 = struct.Struct(">I")


class Messages:
    """Return value of a CALL handler that answers with a MESSAGES frame."""

    __slots__ = ("header", "msgs")

    def __init__(self, header: dict, msgs: list) -> None:
        self.header = header
        self.msgs = msgs


class RawMessages:
    """Return value of a CALL handler that answers with a MESSAGES frame in the raw layout (flag
    F_RAW, docs/protocol.md): `chunks` are CommitLog records as stored, `count` of them."""

    __slots__ = ("header", "count", "chunks")

    def __init__(self, header: dict, count: int, chunks: list) -> None:
        self.header = header
        self.count = count
        self.chunks = chunks


class RawFrame:
    """Return value of a CALL handler that answers with a frame of opcode `op` whose body is
    `parts` sent as they are (not joined first): a gateway's raw `gw_pull`, answered as a PUSH_RAW
    body (the CommitLog's record bytes, store/node/gateway_service.py)."""

    __slots__ = ("op", "parts")

    def __init__(self, op: int, parts: list) -> None:
        self.op = op
        self.parts = parts


def raw_messages_head(header: dict, count: int) -> bytes:
    """What precedes the records of a raw-layout MESSAGES body: u32 header length, JSON, u32 count."""
    h = W.compact_json(header).encode()
    return _U32.pack(len(h)) + h + _U32.pack(count)


class CallError(Exception):
    """Raised by a CALL handler: answered with ERROR `code` and the message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
