"""The metadata store's RocksDB key layout: one byte prefix per kind, so each kind is a
contiguous range:

    o consumer \\0 queue -> u64 offset         s client_id -> SessionRecord JSON
    r topic              -> u32 plen, payload, props
    w client_id          -> WillRecord bytes     f filter -> u32 reference count
    W gateway \0 client_id -> b""  (the wills a gateway holds)
    h gateway \0 client_id -> b""  (the session records naming that gateway, `SessionRecord.host`;
                                    gateway "" for those naming none: a fleet gateway's restore
                                    reads its own records only. An entry may be stale - the
                                    record moved to another gateway or ended - so a reader checks
                                    the record's host and drops it: a write needs no read first.)
    I                    -> b"1"  every session record has its `h` entry (written once the index
                                    was built: a data dir of a version before it gets it on open)
    R                    -> u64 the store's last recovery generation whose cut the offsets were
                            checked against (store/recovery.py)
    A                    -> JSON  the users and ACL rules managed live (store/node/security_service.py)

Separate from lightqueue/metadata.py because every part of the metadata store (metadata.py,
retained_messages.py, wills.py) writes its own kind of key: the prefixes are kept together here,
so no two kinds share one.
"""
from __future__ import annotations

import struct

U64 = struct.Struct(">Q")
U32 = struct.Struct(">I")
EPOCH = struct.Struct(">QQ")

P_OFFSET = b"o"
P_SESSION = b"s"
P_RETAINED = b"r"
P_WILL = b"w"
P_WILL_BY_GATEWAY = b"W"
P_FILTER = b"f"
P_EPOCH = b"e"          # wildcard filter -> (CommitLog end, ms) when it was last registered (0 -> 1)
K_RECOVERY = b"R"       # the store's recovery generation the offsets were last checked against
P_SESSION_BY_HOST = b"h"    # host \0 client_id -> b"": the session records by gateway (module docstring)
K_SESSION_INDEX = b"I"      # present: every session record is in P_SESSION_BY_HOST
K_SECURITY = b"A"           # the users and ACL rules managed live: one JSON document (store/node/security_service.py)


def host_key(host: str | None, client_id: str) -> bytes:
    return P_SESSION_BY_HOST + (host or "").encode("utf-8") + b"\x00" + client_id.encode("utf-8")


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key starting with `prefix` (prefixes here start with a kind
    byte below 0xff, so one always exists)."""
    p = prefix.rstrip(b"\xff")
    return p[:-1] + bytes((p[-1] + 1,))
