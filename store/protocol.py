"""The store's native protocol, sans-IO: bytes in -> frames out, frames -> bytes (like h11).

Shared by the server (`store/server/`) and the SDK (`store/client/`). No sockets here, so it can
be fuzzed and reused by load generators. The wire format is specified in docs/protocol.md; the
constants and layouts below are the normative copy.

Frame:  u32 length (bytes after this field, >= 6) | u8 opcode | u8 flags | u32 request id | body

The hot frames (PRODUCE, PULL/PULL_FILTER and their MESSAGES reply) are fixed binary layouts packed
with `struct`; control frames (HELLO, CALL, RESULT, ERROR) carry UTF-8 JSON (ERROR: u16 code first).
"""
from __future__ import annotations

import json
import struct
import sys
from array import array

PROTOCOL_VERSION = 1
DEFAULT_PORT = 10911
DEFAULT_MAX_FRAME = 64 << 20

# compact JSON of a CALL's arguments, a reply or a header: one encoder for all of them
# (json.dumps with separators builds a new JSONEncoder per call, ~3 µs of every request and reply)
compact_json = json.JSONEncoder(separators=(",", ":")).encode

HEADER = struct.Struct(">IBBI")          # length, opcode, flags, request id
HEADER_SIZE = HEADER.size                # 10
_MIN_LEN = HEADER_SIZE - 4

# opcodes (client -> server)
OP_HELLO = 0x01
OP_PRODUCE = 0x10
OP_PULL = 0x20
OP_PULL_FILTER = 0x21
OP_CALL = 0x30
# opcodes (server -> client)
OP_HELLO_OK = 0x81
OP_PRODUCED = 0x90
OP_MESSAGES = 0xA0
OP_RESULT = 0xB0
OP_EVENT = 0xC0          # server push, request id 0: queues with new entries (docs/protocol.md)
OP_ERROR = 0xFF

# error codes (ERROR frame)
E_BAD_FRAME = 1          # malformed/truncated body or unknown opcode; connection stays open
E_TOO_LARGE = 2          # frame length above the server's limit; connection closed after it
E_VERSION = 3            # unsupported protocol version in HELLO
E_AUTH = 4               # missing/wrong token; connection closed after it
E_NOT_READY = 5          # request before HELLO; connection closed after it
E_UNKNOWN_CMD = 6        # CALL with a command nobody registered
E_INVALID = 7            # a well-formed request the store refuses (bad topic, too large message...)
E_STORE = 8              # the store failed (disk full, closed...)
E_INTERNAL = 9           # a bug on the server: reported, the connection stays open
E_DISK_FULL = 10         # refused for lack of disk space, nothing stored; retry once space is freed
E_NOT_PRIMARY = 11       # a replica of a store group (docs/ha.md): nothing done; the message ends
                         # with "primary=HOST:PORT" (or "primary=unknown" during an election)

ERROR_NAMES = {E_BAD_FRAME: "bad_frame", E_TOO_LARGE: "too_large", E_VERSION: "version",
               E_AUTH: "auth", E_NOT_READY: "not_ready", E_UNKNOWN_CMD: "unknown_command",
               E_INVALID: "invalid", E_STORE: "store", E_INTERNAL: "internal", E_DISK_FULL: "disk_full",
               E_NOT_PRIMARY: "not_primary"}


class ProtocolError(Exception):
    """A frame this side cannot parse. `code` is the ERROR code to answer with; `fatal` means the
    byte stream is no longer in sync (or cannot be trusted) and the connection must close."""

    def __init__(self, code: int, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.fatal = fatal
        # bytes of the offending frame still to come (E_TOO_LARGE): a server reads and drops them
        # before closing, so the peer is not reset while still sending and always reads the ERROR
        self.unread = 0


class FrameDecoder:
    """Feed bytes, take complete frames `(opcode, flags, request_id, body: bytes)`.

    A length above `max_frame` raises ProtocolError(E_TOO_LARGE, fatal=True) as soon as the header
    is seen (nothing is buffered for it); a length below the header's raises E_BAD_FRAME, fatal."""

    __slots__ = ("_buf", "max_frame")

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self._buf = bytearray()
        self.max_frame = max_frame

    def feed(self, data: bytes) -> list[tuple[int, int, int, bytes]]:
        buf = self._buf
        buf += data
        out = []
        pos = 0
        n = len(buf)
        unpack = HEADER.unpack_from
        while n - pos >= HEADER_SIZE:
            length, op, flags, rid = unpack(buf, pos)
            if length < _MIN_LEN:
                raise ProtocolError(E_BAD_FRAME, f"frame length {length} below the header size", True)
            if length > self.max_frame:
                err = ProtocolError(E_TOO_LARGE, f"frame of {length} bytes exceeds the limit of "
                                    f"{self.max_frame}", True)
                err.unread = pos + 4 + length - n
                del buf[:]
                raise err
            end = pos + 4 + length
            if end > n:
                break
            out.append((op, flags, rid, bytes(buf[pos + HEADER_SIZE:end])))
            pos = end
        if pos:
            del buf[:pos]
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)


def frame(op: int, rid: int, body: bytes = b"", flags: int = 0) -> bytes:
    return HEADER.pack(len(body) + _MIN_LEN, op, flags, rid) + body


def frame_head(op: int, rid: int, body_len: int, flags: int = 0) -> bytes:
    """The frame header for a body of `body_len` bytes sent after it in pieces (a large reply is
    written as header + its parts, not joined into one buffer first)."""
    return HEADER.pack(body_len + _MIN_LEN, op, flags, rid)


def json_frame(op: int, rid: int, obj) -> bytes:
    return frame(op, rid, compact_json(obj).encode())


def error_frame(rid: int, code: int, message: str) -> bytes:
    return frame(OP_ERROR, rid, struct.pack(">H", code) + message.encode("utf-8", "replace"))


def parse_error(body: bytes) -> tuple[int, str]:
    if len(body) < 2:
        return E_INTERNAL, "empty error frame"
    return struct.unpack_from(">H", body)[0], body[2:].decode("utf-8", "replace")


def parse_json(body: bytes) -> dict:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:    # RecursionError: a JSON nested too deep
        raise ProtocolError(E_BAD_FRAME, f"body is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(E_BAD_FRAME, "body must be a JSON object")
    return obj


# ---------------------------------------------------------------- PRODUCE
# body: u16 producer-id length, producer id (UTF-8), u64 sequence (0 = no dedup), u32 count,
#       then `count` messages: MSG_HEAD + topic + keys (joined by \x00) + props + body
PRODUCE_HEAD = struct.Struct(">QI")
MSG_HEAD = struct.Struct(">HHHIIQ")      # topic len, keys len, props len, body len, queue id, born ts
# PRODUCED body: u32 count, then per message u64 physical offset, u64 queue offset; msg id is the
# store identity (HELLO_OK "ident") + 16 hex digits of the physical offset
PRODUCED_ENTRY = struct.Struct(">QQ")


def encode_messages_for_produce(msgs) -> bytes:
    """msgs: iterable of (topic, body, keys tuple, props bytes, queue_id, born_ts)."""
    parts = []
    pack = MSG_HEAD.pack
    for topic, body, keys, props, qid, born in msgs:
        t = topic.encode()
        k = "\x00".join(keys).encode() if keys else b""
        parts.append(pack(len(t), len(k), len(props), len(body), qid, born))
        parts.append(t)
        parts.append(k)
        parts.append(props)
        parts.append(body)
    return b"".join(parts)


def encode_produce(producer_id: str, seq: int, count: int, packed_msgs: bytes) -> bytes:
    p = producer_id.encode()
    return struct.pack(">H", len(p)) + p + PRODUCE_HEAD.pack(seq, count) + packed_msgs


def decode_produce(body: bytes):
    """-> (producer_id, seq, [(topic, body, keys, props, queue_id, born_ts)]); ProtocolError if
    the body is truncated or inconsistent (nothing of it is appended then)."""
    try:
        (plen,) = struct.unpack_from(">H", body, 0)
        pos = 2 + plen
        pid = body[2:pos].decode()
        seq, count = PRODUCE_HEAD.unpack_from(body, pos)
        pos += PRODUCE_HEAD.size
        out = []
        n = len(body)
        unpack = MSG_HEAD.unpack_from
        hs = MSG_HEAD.size
        mv = memoryview(body)
        for _ in range(count):
            tl, kl, pl, bl, qid, born = unpack(body, pos)
            pos += hs
            end = pos + tl + kl + pl + bl
            if end > n:
                raise ProtocolError(E_BAD_FRAME, "PRODUCE body truncated inside a message")
            topic = body[pos:pos + tl].decode()
            pos += tl
            keys = tuple(body[pos:pos + kl].decode().split("\x00")) if kl else ()
            pos += kl
            props = body[pos:pos + pl]
            pos += pl
            out.append((topic, bytes(mv[pos:end]), keys, props, qid, born))
            pos = end
        if pos != n:
            raise ProtocolError(E_BAD_FRAME, f"PRODUCE body has {n - pos} bytes after its {count} messages")
        return pid, seq, out
    except struct.error:
        raise ProtocolError(E_BAD_FRAME, "PRODUCE body truncated") from None
    except UnicodeDecodeError:
        raise ProtocolError(E_BAD_FRAME, "PRODUCE topic/key/producer id is not UTF-8") from None


# PRODUCE frame flag bit 1 (optional, docs/protocol.md "Delayed messages"): the body is followed by
# a trailer of `count` u64 due times (epoch ms; 0 = not delayed), one per message in order. A
# delayed message is parked in the store's timer wheel and appears under its topic at its due time.
# A store that does not know the flag refuses the frame (bytes after the last message: bad_frame),
# so a delay is never silently ignored.
F_DELAYED = 0x02
# PRODUCE frame flag bit 2 (docs/protocol.md "Unique keys"): a message with keys is stored at most
# once per (topic, first key); one the store holds already is answered with the stored record's
# offsets and not written again (store/unique_keys.py). The gateway sets it on batches carrying an
# inbound QoS 2 message's key.
F_UNIQUE_KEYS = 0x04
_DUE = struct.Struct(">Q")


def encode_due_trailer(due_ms) -> bytes:
    """The F_DELAYED trailer for due times in message order (0 = that message is not delayed)."""
    return struct.pack(f">{len(due_ms)}Q", *due_ms)


def split_due_trailer(body: bytes) -> tuple[bytes, list[int]]:
    """A PRODUCE body sent with F_DELAYED -> (the plain PRODUCE body, [due ms per message]);
    ProtocolError when it cannot hold the trailer its count announces."""
    try:
        (plen,) = struct.unpack_from(">H", body, 0)
        _seq, count = PRODUCE_HEAD.unpack_from(body, 2 + plen)
    except struct.error:
        raise ProtocolError(E_BAD_FRAME, "PRODUCE body truncated") from None
    n = 8 * count
    if len(body) < 2 + plen + PRODUCE_HEAD.size + n:
        raise ProtocolError(E_BAD_FRAME, f"delayed PRODUCE body too short for {count} due times")
    return body[:len(body) - n], list(struct.unpack_from(f">{count}Q", body, len(body) - n))


def encode_produced(results) -> bytes:
    """results: list of (phys_offset, queue_offset)."""
    flat = [x for pq in results for x in pq]
    return struct.pack(f">I{len(flat)}Q", len(results), *flat)


def decode_produced(body: bytes) -> list[tuple[int, int]]:
    (n,) = struct.unpack_from(">I", body)
    return list(struct.iter_unpack(">QQ", body[4:4 + 16 * n]))


# ---------------------------------------------------------------- PULL / PULL_FILTER
# body: u32 queue id, u64 offset, u32 max count, u32 max bytes, u16 name length, name (topic or
# MQTT filter), u16 group length, group ("" = none: no offset commit)
PULL_REQ = struct.Struct(">IQII")


def encode_pull(name: str, queue_id: int, offset: int, max_count: int, max_bytes: int, group: str = "") -> bytes:
    n = name.encode()
    g = group.encode()
    return PULL_REQ.pack(queue_id, offset, max_count, max_bytes) + struct.pack(">H", len(n)) + n + \
        struct.pack(">H", len(g)) + g


def decode_pull(body: bytes):
    try:
        qid, off, cnt, mb = PULL_REQ.unpack_from(body)
        pos = PULL_REQ.size
        (nl,) = struct.unpack_from(">H", body, pos)
        pos += 2
        name = body[pos:pos + nl].decode()
        pos += nl
        (gl,) = struct.unpack_from(">H", body, pos)
        pos += 2
        group = body[pos:pos + gl].decode()
        if pos + gl != len(body) or len(name.encode()) != nl:
            raise ProtocolError(E_BAD_FRAME, "PULL body length mismatch")
        return name, qid, off, cnt, mb, group
    except struct.error:
        raise ProtocolError(E_BAD_FRAME, "PULL body truncated") from None
    except UnicodeDecodeError:
        raise ProtocolError(E_BAD_FRAME, "PULL name is not UTF-8") from None


# ---------------------------------------------------------------- MESSAGES
# Frame flags of PULL and MESSAGES (protocol version 1, optional both ways): a PULL with
# F_RAW_OK set says the client reads the raw layout; the server MAY then answer MESSAGES with
# F_RAW set, whose records are the CommitLog's own record bytes (docs/store.md layout,
# little-endian, each starting with its total size) instead of REC_HEAD records. A server that
# ignores the flag answers the layout below; a client that does not set it never sees F_RAW.
F_RAW_OK = 0x01
F_RAW = 0x01
# body: u32 JSON-header length, JSON header (e.g. {"next_offset": n, "max_offset": m}), u32 count,
#       then per message REC_HEAD + topic + keys (\x00-joined) + props + body
REC_HEAD = struct.Struct(">QQQQIHHHI")
# its fields, one per code of the format (store/spark/_columns.c checks these names, not only the
# offsets: two fields of one width could trade places without changing the format)
REC_HEAD_FIELDS = ("queue_offset", "phys_offset", "born_ts", "store_ts", "queue_id", "topic_len", "keys_len",
                   "props_len", "body_len")
assert len(REC_HEAD_FIELDS) == len(REC_HEAD.format) - 1 and REC_HEAD.format[1:].isalpha()


def encode_messages(header: dict, msgs) -> bytes:
    """msgs: StoredMessage-like objects (topic, body, props, queue_id, queue_offset, phys_offset,
    born_ts, store_ts, keys)."""
    h = compact_json(header).encode()
    parts = [struct.pack(">I", len(h)), h, struct.pack(">I", len(msgs))]
    pack = REC_HEAD.pack
    app = parts.append
    for m in msgs:
        t = m.topic.encode()
        k = "\x00".join(m.keys).encode() if m.keys else b""
        p = m.props or b""
        app(pack(m.queue_offset, m.phys_offset, m.born_ts, m.store_ts, m.queue_id, len(t), len(k), len(p),
                 len(m.body)))
        app(t)
        app(k)
        app(p)
        app(m.body)
    return b"".join(parts)


def decode_messages(body: bytes):
    """-> (header dict, [(queue_offset, phys_offset, born_ts, store_ts, queue_id, topic, keys, props,
    body)])."""
    try:
        (hl,) = struct.unpack_from(">I", body)
        header = json.loads(body[4:4 + hl]) if hl else {}
        pos = 4 + hl
        (count,) = struct.unpack_from(">I", body, pos)
        pos += 4
        out = []
        unpack = REC_HEAD.unpack_from
        hs = REC_HEAD.size
        for _ in range(count):
            qo, po, born, st, qid, tl, kl, pl, bl = unpack(body, pos)
            pos += hs
            topic = body[pos:pos + tl].decode()
            pos += tl
            keys = tuple(body[pos:pos + kl].decode().split("\x00")) if kl else ()
            pos += kl
            props = body[pos:pos + pl]
            pos += pl
            b = body[pos:pos + bl]
            pos += bl
            out.append((qo, po, born, st, qid, topic, keys, props, b))
        return header, out
    except (struct.error, ValueError, RecursionError) as e:
        raise ProtocolError(E_BAD_FRAME, f"MESSAGES body malformed: {e}") from None


# ---------------------------------------------------------------- HELLO (sans-IO, every client)
def hello_frame(client: str, token: str | None = None) -> bytes:
    """The first frame a client sends."""
    hello = {"version": PROTOCOL_VERSION, "client": client}
    if token:
        hello["token"] = token
    return json_frame(OP_HELLO, 0, hello)


def parse_hello_reply(op: int, body: bytes) -> dict:
    """The server's answer to HELLO -> its info dict (ident, max_frame, ...). An ERROR (wrong
    token, version) or any other frame raises ProtocolError(code, message, fatal=True); clients
    turn it into their own error type. Shared by the sync, asyncio and loop-driven clients."""
    if op == OP_ERROR:
        code, msg = parse_error(body)
        raise ProtocolError(code, msg, True)
    if op != OP_HELLO_OK:
        raise ProtocolError(E_BAD_FRAME, f"unexpected opcode {op:#x} in answer to HELLO", True)
    return parse_json(body)


# ---------------------------------------------------------------- EVENT (server push)
# body: JSON object {queue name: max offset (next offset to be written)}; request id 0. Sent to
# connections that asked for it (the gateway's `gw_watch` CALL); a hint, never the data itself.
def encode_event(max_offsets: dict) -> bytes:
    return compact_json(max_offsets).encode()


def decode_event(body: bytes) -> dict[str, int]:
    obj = parse_json(body)
    return {str(k): int(v) for k, v in obj.items()}


# ---------------------------------------------------------------- SESSIONS_MOVED (server push)
# body: JSON object {"client_ids": [...]}; request id 0. Sent to the connections of a gateway
# (those that said `gw_hello`) when another gateway wrote or ended the session record that named
# it: its offline copies of those sessions are stale (docs/fleet.md "Sessions across gateways").
# A hint: the gateway checks the record before it drops anything; a client ignores unknown pushes.
OP_SESSIONS_MOVED = 0xC3


def encode_sessions_moved(client_ids: list) -> bytes:
    return compact_json({"client_ids": list(client_ids)}).encode()


def decode_sessions_moved(body: bytes) -> list[str]:
    return [str(c) for c in parse_json(body)["client_ids"]]


# ---------------------------------------------------------------- SESSION_CLAIMS (server push)
# body: JSON object {"gateway": G, "claims": [[client id, since ms], ...]}; request id 0. The
# store relays a gateway's `gw_claim_sessions` ("G attached a connection to these client ids at
# these wall-clock times") to the connections of every other gateway, which close an older
# connection of the same client id (MQTT 5 reason 0x8E): one live connection per client id across
# the fleet (docs/fleet.md). A hint, like Redis pub/sub: a claim lost leaves two connections open.
OP_SESSION_CLAIMS = 0xC4


def encode_session_claims(gateway: str, claims: list) -> bytes:
    return compact_json({"gateway": gateway, "claims": [[c, int(t)] for c, t in claims]}).encode()


def decode_session_claims(body: bytes) -> tuple[str, list[tuple[str, int]]]:
    obj = parse_json(body)
    return str(obj["gateway"]), [(str(c), int(t)) for c, t in obj["claims"]]


# ---------------------------------------------------------------- PUSH (server push, optional)
# An EVENT that carries the new entries (docs/protocol.md "EVENT push and the gw_* commands"):
# sent instead of EVENT to a connection that asked with `gw_watch {push: true}`. Binary, no JSON:
#   u16 queue count
#   per queue: u16 name length, name, u64 max offset, u32 entry count,
#              entry count x (PUSH_REC + topic + keys (\x00-joined) + dispatch queues (\x00-joined)
#                             + props + body)
# A queue with 0 entries is a plain hint (as in EVENT). Entries are the queue's, in offset order,
# usually from the offset the store last pushed or the client last pulled on this connection; the
# client keeps only entries that continue what it holds and pulls for anything else.
OP_PUSH = 0xC1
PUSH_REC = struct.Struct(">QQQQIHHIHI")  # queue offset, phys offset, born ts, store ts, queue id,
                                          # topic len, keys len, dispatch-queues len, props len, body len
_PUSH_Q = struct.Struct(">QI")            # max offset, entry count
_U16 = struct.Struct(">H")


def encode_push(queues) -> bytes:
    """queues: iterable of (name, max offset, messages) where messages are StoredMessage-like
    objects (their `dispatch_queues` travel with them); a queue with no messages is a hint."""
    parts = [b""]
    n = 0
    pack = PUSH_REC.pack
    app = parts.append
    for name, mx, msgs in queues:
        nb = name.encode()
        app(_U16.pack(len(nb)))
        app(nb)
        app(_PUSH_Q.pack(mx, len(msgs)))
        for m in msgs:
            t = m.topic.encode()
            k = "\x00".join(m.keys).encode() if m.keys else b""
            dq = "\x00".join(m.dispatch_queues).encode() if m.dispatch_queues else b""
            p = m.props or b""
            app(pack(m.queue_offset, m.phys_offset, m.born_ts, m.store_ts, m.queue_id, len(t), len(k),
                     len(dq), len(p), len(m.body)))
            app(t)
            app(k)
            app(dq)
            app(p)
            app(m.body)
        n += 1
    parts[0] = _U16.pack(n)
    return b"".join(parts)


def decode_push(body: bytes):
    """-> [(name, max offset, [(queue_offset, phys_offset, born_ts, store_ts, queue_id, topic, keys,
    props, body)], [dispatch queues tuple per entry])]; ProtocolError if malformed."""
    try:
        (n,) = _U16.unpack_from(body, 0)
        pos = 2
        out = []
        unpack = PUSH_REC.unpack_from
        hs = PUSH_REC.size
        for _ in range(n):
            (nl,) = _U16.unpack_from(body, pos)
            pos += 2
            name = body[pos:pos + nl].decode()
            pos += nl
            mx, count = _PUSH_Q.unpack_from(body, pos)
            pos += _PUSH_Q.size
            recs = []
            dqs = []
            for _ in range(count):
                qo, po, born, st, qid, tl, kl, dl, pl, bl = unpack(body, pos)
                pos += hs
                end = pos + tl + kl + dl + pl + bl
                if end > len(body):
                    raise ProtocolError(E_BAD_FRAME, "PUSH body truncated inside an entry")
                topic = body[pos:pos + tl].decode()
                pos += tl
                keys = tuple(body[pos:pos + kl].decode().split("\x00")) if kl else ()
                pos += kl
                dqs.append(tuple(body[pos:pos + dl].decode().split("\x00")) if dl else ())
                pos += dl
                props = body[pos:pos + pl]
                pos += pl
                recs.append((qo, po, born, st, qid, topic, keys, props, body[pos:end]))
                pos = end
            out.append((name, mx, recs, dqs))
        if pos != len(body):
            raise ProtocolError(E_BAD_FRAME, f"PUSH body has {len(body) - pos} bytes after its {n} queues")
        return out
    except struct.error:
        raise ProtocolError(E_BAD_FRAME, "PUSH body truncated") from None
    except UnicodeDecodeError:
        raise ProtocolError(E_BAD_FRAME, "PUSH queue name, topic or key is not UTF-8") from None


# ---------------------------------------------------------------- PUSH, raw records (optional)
# PUSH with the entries as the CommitLog's own record bytes (docs/store.md layout, each starting
# with its total size), sent instead of OP_PUSH to a connection that asked with `gw_watch {push:
# true, raw: true}`: the store sends what it wrote without decoding it into messages and encoding
# them again (in `serve --workers` fan-in that round trip was ~45 % of the store's main thread).
#   u16 queue count
#   per queue: u16 name length, name, u64 max offset, u64 first queue offset, u32 entry count,
#              u32 run count, run count x (u64 phys offset of the run's first record, u32 record
#              count, u32 run bytes), entry count x u32 record size (big-endian), then the runs'
#              bytes back to back
# Entry i has queue offset first + i (consecutive: the store stops a queue's entries at a gap);
# a run is records adjacent in the CommitLog. A queue with 0 entries is a hint, as in EVENT.
OP_PUSH_RAW = 0xC2
_RAW_Q = struct.Struct(">QQII")          # max offset, first queue offset, entry count, run count
_RAW_RUN = struct.Struct(">QII")         # phys offset, record count, bytes


def _sizes_be(sizes) -> bytes:
    """Record sizes as big-endian u32s: from an array("I") (the store's raw pulls) by one byte swap."""
    if type(sizes) is array and sizes.typecode == "I":
        if sys.byteorder == "big":
            return sizes.tobytes()
        swapped = array("I", sizes)
        swapped.byteswap()
        return swapped.tobytes()
    return struct.pack(f">{len(sizes)}I", *sizes)


def encode_push_raw(queues) -> list:
    """queues: iterable of (name, max offset, first queue offset, runs, sizes) where runs are
    [(phys, record count, bytes-like records)] and sizes the records' sizes in order (empty runs:
    a hint). -> the body as a list of parts (the record bytes are not copied into one buffer)."""
    head: list = [b""]
    data: list = []
    n = 0
    for name, mx, first, runs, sizes in queues:
        nb = name.encode()
        head.append(_U16.pack(len(nb)))
        head.append(nb)
        head.append(_RAW_Q.pack(mx, first, len(sizes), len(runs)))
        for phys, count, chunk in runs:
            head.append(_RAW_RUN.pack(phys, count, len(chunk)))
        if sizes:
            head.append(_sizes_be(sizes))
        for _phys, _count, chunk in runs:
            data.append(chunk)
        n += 1
    head[0] = _U16.pack(n)
    return [b"".join(head), *data]


def decode_push_raw(body):
    """-> [(name, max offset, first queue offset, [(phys, record count, start, end)], sizes)] where
    start/end index the records of each run in `body`; ProtocolError if malformed."""
    try:
        (n,) = _U16.unpack_from(body, 0)
        pos = 2
        out = []
        for _ in range(n):
            (nl,) = _U16.unpack_from(body, pos)
            pos += 2
            name = bytes(body[pos:pos + nl]).decode()
            pos += nl
            mx, first, count, nruns = _RAW_Q.unpack_from(body, pos)
            pos += _RAW_Q.size
            runs = []
            for _ in range(nruns):
                runs.append(_RAW_RUN.unpack_from(body, pos))
                pos += _RAW_RUN.size
            sizes = struct.unpack_from(f">{count}I", body, pos)
            pos += 4 * count
            if sum(c for _p, c, _b in runs) != count or sum(b for _p, _c, b in runs) != sum(sizes):
                raise ProtocolError(E_BAD_FRAME, f"raw PUSH of {name!r}: runs do not add up to its entries")
            out.append([name, mx, first, runs, sizes])
        for q in out:           # the runs' bytes follow the heads, in the same order
            spans = []
            for phys, count, nbytes in q[3]:
                spans.append((phys, count, pos, pos + nbytes))
                pos += nbytes
            q[3] = spans
        if pos != len(body):
            raise ProtocolError(E_BAD_FRAME, f"raw PUSH body is {len(body)} bytes, its heads say {pos}")
        return [tuple(q) for q in out]
    except struct.error:
        raise ProtocolError(E_BAD_FRAME, "raw PUSH body truncated") from None
    except UnicodeDecodeError:
        raise ProtocolError(E_BAD_FRAME, "raw PUSH queue name is not UTF-8") from None
