"""What the SDK reads: `Record` (a stored message as a consumer sees it; `.mqtt` decodes the MQTT
metadata of records written by the gateway or by an SDK producer, docs/sdk.md), `PullResult`, and
the decoders of MESSAGES replies in both layouts: the plain one (`decode_messages`) and the raw one,
the CommitLog's own records (`records_raw`, with its C twin store/client/_records.c).

Why a module of its own: the command layer (commands.py) decodes replies into these, and the
consumers (consumer.py) send those commands; both import this module, which imports neither.
"""
from __future__ import annotations

import json
import struct
from typing import NamedTuple

from lmqtt.store import accel, protocol as W
from lmqtt.store.client.props import MessageProperties, decode as decode_props
from lmqtt.store.record import HEADER as _CLOG_HEAD, HEADER_FIELDS as _CLOG_FIELDS, HEADER_SIZE as _CLOG_HEAD_SIZE


class Record(NamedTuple):
    topic: str
    body: bytes
    keys: tuple
    props: bytes
    queue_id: int
    queue_offset: int     # ConsumeQueue offset (of the first-level topic's queue)
    offset: int           # physical CommitLog offset
    born_ts: int
    store_ts: int
    msg_id: str

    @property
    def mqtt(self) -> MessageProperties:
        """QoS, retain, MQTT 5 properties; foreign props decode as plain QoS 0."""
        try:
            return decode_props(self.props)
        except ValueError:
            return MessageProperties()


class PullResult(NamedTuple):
    records: list
    next_offset: int
    header: dict


def decode_messages(ident: str | None, body: bytes) -> tuple[dict, list[Record]]:
    header, raw = W.decode_messages(body)
    ident = ident or ""
    return header, [Record(t, b, k, p, qid, qo, po, born, st, f"{ident}{po:016X}")
                    for qo, po, born, st, qid, t, k, p, b in raw]


_U32 = struct.Struct(">I").unpack_from
_NEW = tuple.__new__

# What the C twin of the loop in records_raw reads and builds, handed over at import: the record
# head from store/record.py and (as configure's first argument) `Record`, whose `_fields` it
# checks against the order it fills. store/client/_records.c refuses a layout whose field offsets
# differ from the ones it reads (ValueError naming the field: rebuild the extension) and decodes
# nothing until configured.
C_LAYOUT = {"header_format": _CLOG_HEAD.format, "header_fields": _CLOG_FIELDS, "header_size": _CLOG_HEAD_SIZE}


def configure_c(mod, record_type=Record, layout: dict = C_LAYOUT) -> None:
    """Hand `Record` and the record head layout to the C decoder `mod`; ValueError when either is
    not what its loop reads and fills."""
    mod.configure(record_type, layout)


_C_RECORDS = accel.load("lmqtt.store.client._records")    # C twin of the loop in records_raw
if _C_RECORDS is not None:
    configure_c(_C_RECORDS)


def records_raw(ident: str | None, body: bytes) -> tuple[dict, list[Record]]:
    """Decode a MESSAGES body in the raw layout (flag F_RAW): the CommitLog's own records
    (docs/store.md: the little-endian head of store/record.py's HEADER, then topic, keys, dispatch
    queues, props, body). The store checked each record's CRC before sending it. Topic strings and
    props are decoded once per distinct value in the reply and shared by the records that carry
    them."""
    try:
        (hl,) = _U32(body, 0)
        header = json.loads(body[4:4 + hl]) if hl else {}
        pos = 4 + hl
        (count,) = _U32(body, pos)
        pos += 4
        ident = ident or ""
        if _C_RECORDS is not None and len(ident) <= 100 and ident.isascii():   # the C loop's bounds
            return header, _C_RECORDS.decode(body, pos, count, ident)
        unpack = _CLOG_HEAD.unpack_from
        hs = _CLOG_HEAD.size
        topics: dict[bytes, str] = {}
        props_seen: dict[bytes, bytes] = {}
        out = []
        append = out.append
        n = len(body)
        for _ in range(count):
            total, _magic, _crc, qid, _fl, qo, po, born, st, _tags, bl, pl, tl, kl, dl = unpack(body, pos)
            end = pos + total
            if end > n or total != hs + tl + kl + dl + pl + bl:
                raise ValueError(f"record at {pos} of {total} bytes does not fit its fields")
            p = pos + hs
            tb = body[p:p + tl]
            topic = topics.get(tb)
            if topic is None:
                topic = topics[tb] = tb.decode()
            p += tl
            keys = tuple(body[p:p + kl].decode().split("\x00")) if kl else ()
            p += kl + dl
            props = body[p:p + pl]
            props = props_seen.setdefault(props, props)
            append(_NEW(Record, (topic, body[p + pl:end], keys, props, qid, qo, po, born, st,
                                 f"{ident}{po:016X}")))            # in Record._fields order
            pos = end
        return header, out
    except (struct.error, ValueError, RecursionError) as e:     # RecursionError: a header nested too deep
        raise W.ProtocolError(W.E_BAD_FRAME, f"raw MESSAGES body malformed: {e}") from None


def decode_reply(ident: str | None, body: bytes, flags: int = 0) -> tuple[dict, list[Record]]:
    """(header, Records) of a MESSAGES body in either layout (`flags`: the frame's, F_RAW = raw)."""
    return (records_raw if flags & W.F_RAW else decode_messages)(ident, body)


def pull_result(ident, body: bytes, flags: int = 0) -> PullResult:
    header, recs = (records_raw if flags & W.F_RAW else decode_messages)(ident, body)
    return PullResult(recs, header.get("next_offset", 0), header)
