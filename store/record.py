"""The CommitLog record format: constants, encoder/decoder and the framing check used by recovery.

Layout (little-endian), see docs/store.md for the byte-by-byte table:

    0  total_size u32     4  magic u32        8  crc u32 (CRC-32 of bytes 12..total_size)
    12 queue_id u32       16 flags u32        20 queue_offset u64     28 phys_offset u64
    36 born_ts u64        44 store_ts u64     52 tags_code u64
    60 body_len u32       64 props_len u32    68 topic_len u16        70 keys_len u16   72 dq_len u16
    74 topic | keys (NUL-joined) | dispatch_queues (NUL-joined) | props | body

Unlike RocketMQ (whose CRC covers only the body) the CRC covers every byte after the CRC field, so a
torn or corrupted header, topic or properties tail is detected as well. The record stores its own
physical offset, which lets recovery re-synchronise after a corrupt record: a candidate record is
only accepted if its stored offset equals its position.

A blank filler closes a segment: total_size = bytes left in the segment, magic = BLANK_MAGIC, and
the rest of the segment is left zero.
"""
from __future__ import annotations

import struct
import zlib

from . import accel
from .errors import CorruptRecord, InvalidMessage, InvalidTopic, MessageTooLarge
from .message import StoredMessage

_new = tuple.__new__

MSG_MAGIC = 0xDAA320A7
BLANK_MAGIC = 0xCBD43194
# The one definition of the header: every other Struct of header fields (here, in store.encoding
# and CommitLog._tail_struct) is a slice of this format, taken by field name with header_format().
HEADER = struct.Struct("<IIIIIQQQQQIIHHH")
HEADER_FIELDS = ("total_size", "magic", "crc", "queue_id", "flags", "queue_offset", "phys_offset", "born_ts",
                 "store_ts", "tags_code", "body_len", "props_len", "topic_len", "keys_len", "dq_len")
# one code per field, no repeat counts: header_format() slices the format by field position
assert len(HEADER_FIELDS) == len(HEADER.format) - 1 and HEADER.format[1:].isalpha()


def header_format(first: str, end: str | None = None) -> str:
    """The struct format (byte order included) of the header fields from `first` up to, not
    including, `end` (default: to the end of the header)."""
    i = HEADER_FIELDS.index(first)
    j = len(HEADER_FIELDS) if end is None else HEADER_FIELDS.index(end)
    return HEADER.format[0] + HEADER.format[1 + i:1 + j]


HEADER_SIZE = HEADER.size  # 74
CRC_START = struct.calcsize(header_format("total_size", "queue_id"))  # 12: the CRC covers the rest
PREFIX = struct.Struct(header_format("total_size", "crc"))  # total_size, magic
CRC_FIELD = struct.Struct(header_format("crc", "queue_id"))
MIN_BLANK = 8  # a segment always keeps room for a blank filler header
SEP = "\x00"

assert HEADER_SIZE == 74 and CRC_START == 12   # the layout docs/store.md documents


def tags_code_of(topic_bytes: bytes) -> int:
    """Stable 'tag hash' stored in ConsumeQueue entries: CRC-32 of the full topic, so a consumer of a
    first-level-topic queue can skip other sub-topics without reading the CommitLog."""
    return zlib.crc32(topic_bytes)


def first_level(topic: str) -> str:
    """ConsumeQueue name for a topic: everything before the first '/' (MQTT `a/b/c` -> `a`)."""
    i = topic.find("/")
    return topic if i < 0 else topic[:i]


def encode_topic(topic: str, max_topic_bytes: int) -> bytes:
    if not isinstance(topic, str) or not topic:
        raise InvalidTopic("topic must be a non-empty string")
    if SEP in topic:
        raise InvalidTopic(f"topic {topic[:64]!r} contains a NUL character")
    try:
        tb = topic.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidTopic(f"topic {topic[:64]!r} is not encodable as UTF-8: {e}") from None
    if len(tb) > max_topic_bytes:
        raise InvalidTopic(f"topic is {len(tb)} bytes, above the limit of {max_topic_bytes}")
    return tb


def encode_names(names: tuple[str, ...], what: str) -> bytes:
    """NUL-joined UTF-8 list (keys or dispatch queues); names must be non-empty and NUL-free."""
    if not names:
        return b""
    for n in names:
        if not isinstance(n, str) or not n or SEP in n:
            raise InvalidMessage(f"each of {what} must be a non-empty string without NUL, got {n!r}")
    b = SEP.join(names).encode("utf-8")
    if len(b) > 0xFFFF:
        raise InvalidMessage(f"{what} take {len(b)} bytes encoded, above the limit of 65535")
    return b


def check_size(total: int, max_message_size: int) -> None:
    if total > max_message_size:
        raise MessageTooLarge(
            f"record of {total} bytes (topic+keys+queues+props+body+{HEADER_SIZE}-byte header) is above "
            f"max_message_size={max_message_size}; nothing was written")


def decode(buf, pos: int, phys_offset: int, ident: str, verify: bool = True, end: int | None = None) -> StoredMessage:
    """Decode the record at `buf[pos:]` whose CommitLog offset is `phys_offset`; raise CorruptRecord
    if framing or CRC is wrong. Never returns data from a bad record. `end` (default: the end of
    `buf`) bounds the record, so a caller can decode in place from a whole segment's map what it
    would otherwise slice out first (CommitLog.read passes pos + the size the index recorded).

    The reference for the C `decode` in store/_append.c (`c_decode` below), which does the same
    from the same buffer; tests/store/test_record_decode_accel.py compares them field for field
    and error for error."""
    limit = len(buf) if end is None or end > len(buf) else end
    if pos + HEADER_SIZE > limit:
        raise CorruptRecord(f"record at offset {phys_offset}: header runs past the segment end")
    (total, magic, crc, qid, flags, qoff, phys, born, store_ts, _tags, blen, plen, tlen, klen,
     dlen) = HEADER.unpack_from(buf, pos)
    if magic != MSG_MAGIC:
        raise CorruptRecord(f"no record at offset {phys_offset} (magic {magic:#010x})")
    if phys != phys_offset or total != HEADER_SIZE + tlen + klen + dlen + plen + blen or pos + total > limit:
        raise CorruptRecord(f"record at offset {phys_offset}: inconsistent framing (size {total}, "
                            f"stored offset {phys})")
    if verify and zlib.crc32(memoryview(buf)[pos + CRC_START:pos + total]) != crc:
        raise CorruptRecord(f"record at offset {phys_offset}: CRC mismatch (corrupt data, not served)")
    p = pos + HEADER_SIZE
    topic = bytes(buf[p:p + tlen]).decode("utf-8")
    p += tlen
    keys = tuple(bytes(buf[p:p + klen]).decode("utf-8").split(SEP)) if klen else ()
    p += klen
    dq = tuple(bytes(buf[p:p + dlen]).decode("utf-8").split(SEP)) if dlen else ()
    p += dlen
    props = bytes(buf[p:p + plen])
    p += plen
    body = bytes(buf[p:p + blen])
    return _new(StoredMessage, (topic, body, props, qid, flags, qoff, phys_offset, total, born, store_ts,
                                f"{ident}{phys_offset:016X}", keys, dq))


def decode_many(buf, base: int, wanted: list, i: int, ident: str, out: list, verify: bool = True) -> int:
    """Decode `wanted[i:]` ([(phys, size), ...], CommitLog offsets and the sizes the index
    recorded) for as long as they lie in `buf`, the segment starting at CommitLog offset `base`;
    append to `out` one item per record: the StoredMessage, or the exception its check raised
    (CorruptRecord: not served, the caller decides whether that is an error). Returns the index of
    the first item not in this segment (len(wanted) when all were).

    Why a batch: a history read or a light-queue pull wants hundreds of records of one segment at
    a time, and one call per batch (in C: `c_decode_many`) takes the per-call cost off each record.
    The size check is CommitLog.read's: a size below a header or past the segment is refused."""
    n = len(buf)
    stop = len(wanted)
    while i < stop:
        phys, size = wanted[i]
        rel = phys - base
        if rel < 0 or rel >= n:
            break
        try:
            if size < HEADER_SIZE or rel + size > n:
                raise CorruptRecord(f"no valid record at offset {phys} (size field {size})")
            out.append(decode(buf, rel, phys, ident, verify, rel + size))
        except Exception as e:   # noqa: BLE001 - handed over per record
            out.append(e)
        i += 1
    return i


def valid_at(buf, pos: int, phys_offset: int, limit: int) -> int:
    """Size of a valid record (framing + CRC) at `pos`, 0 if there is none. `limit` = end of the
    readable data in `buf`. Used by recovery, never on the hot path."""
    if pos + HEADER_SIZE > limit:
        return 0
    (total, magic, crc, _q, _f, _qo, phys, _b, _s, _t, blen, plen, tlen, klen, dlen) = HEADER.unpack_from(buf, pos)
    if magic != MSG_MAGIC or phys != phys_offset:
        return 0
    if total != HEADER_SIZE + tlen + klen + dlen + plen + blen or pos + total > limit:
        return 0
    if zlib.crc32(memoryview(buf)[pos + CRC_START:pos + total]) != crc:
        return 0
    return total


# The C decoder (store/_append.c `decode` / `decode_many`), configured with this module's layout
# (it refuses a header whose fields differ from the ones it reads: offset, width or name), or None
# when the extension is not built or LMQTT_PURE_PYTHON is set: then `decode` / `decode_many` above run.
READ_LAYOUT = {"header_format": HEADER.format, "header_fields": HEADER_FIELDS, "header_size": HEADER_SIZE,
               "crc_start": CRC_START, "msg_magic": MSG_MAGIC}


def _load_c():
    mod = accel.load("lmqtt.store._append")
    if mod is None or not hasattr(mod, "configure_reader"):
        return None, None, None
    mod.configure_reader(StoredMessage, CorruptRecord, READ_LAYOUT)
    return mod.decode, mod.decode_many, mod.decode_runs


# c_decode_runs: a raw PUSH queue's records (its reference: gateway/storage/remote_entries.py)
c_decode, c_decode_many, c_decode_runs = _load_c()
DECODER = "c" if c_decode is not None else "python"
