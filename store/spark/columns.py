"""MESSAGES bodies -> Arrow record batches for the Spark reader, without a Python object per row.

A pull's reply (docs/protocol.md, MESSAGES) is walked once into Arrow column buffers: offsets and
data of the topic, props, body and message-id columns, little-endian int64 queue/physical offsets
and born/store times in microseconds. `columns_py` is the reference; `lmqtt.store.spark._columns`
is its C twin (built by setup.py, optional; loaded through `lmqtt.store.accel`, so
LMQTT_PURE_PYTHON=1 selects the reference). tests/spark/test_columns.py compares the two byte
for byte and checks the batch against the SDK's per-record view (`Record.mqtt`, `Record.msg_id`).

Props columns (qos, retain, client id, user properties, content type) are decoded once per
distinct props value (Arrow's dictionary encoding finds them) and spread with `take`: records of
one producer or device share their props bytes.
"""
from __future__ import annotations

import json
import struct
import sys
from array import array

import pyarrow as pa
import pyarrow.compute as pc

from lmqtt.store import accel, protocol as W
from lmqtt.store.client.props import decode_fields
from lmqtt.store.record import HEADER, HEADER_FIELDS, HEADER_SIZE

_REC = W.REC_HEAD       # a MESSAGES record head (docs/protocol.md)
_RAW = HEADER           # a CommitLog record head (docs/store.md): the raw layout's records

# What the C walk reads, from the one Python definition of each head, handed over at import;
# store/spark/_columns.c checks it against the offsets it was written for (ValueError naming the
# field that differs: rebuild the extension) and walks nothing until it has accepted it.
C_LAYOUT = {
    "rec_head_format": _REC.format, "rec_head_fields": W.REC_HEAD_FIELDS, "rec_head_size": _REC.size,
    "raw_head_format": _RAW.format, "raw_head_fields": HEADER_FIELDS, "raw_head_size": HEADER_SIZE,
}


def configure_c(mod, layout: dict = C_LAYOUT) -> None:
    """Hand the MESSAGES and CommitLog record heads to the C walk `mod`; ValueError when they are
    not the ones it reads."""
    mod.configure(layout)


_C = accel.load("lmqtt.store.spark._columns")
if _C is not None:
    configure_c(_C)

COLUMNS = ["topic", "payload", "qos", "retain", "client_id", "user_properties", "content_type",
           "born_ts", "store_ts", "msg_id", "queue", "offset"]

_U64 = (1 << 64) - 1
_EMPTY_PROPS = (0, False, "", None, None, None, None, None, [])


def _raw_fields(body, pos):
    """(head size, queue offset, phys offset, born, store, topic, keys, queues, props, body lengths)
    of the CommitLog record at pos (raw MESSAGES layout)."""
    total, _magic, _crc, _qid, _fl, q, p, b, s, _tags, bl, pl, tl, kl, dl = _RAW.unpack_from(body, pos)
    if total != _RAW.size + tl + kl + dl + pl + bl:
        raise ValueError("MESSAGES body malformed: record size does not match its lengths")
    return _RAW.size, q, p, b, s, tl, kl, dl, pl, bl


def _fields(body, pos):
    q, p, b, s, _qid, tl, kl, pl, bl = _REC.unpack_from(body, pos)
    return _REC.size, q, p, b, s, tl, kl, 0, pl, bl


def columns_raw_py(body: bytes, pos: int, count: int, ident: bytes) -> tuple:
    """`columns_py` for a raw MESSAGES body (flag F_RAW: CommitLog records)."""
    return columns_py(body, pos, count, ident, raw=True)


def columns_py(body: bytes, pos: int, count: int, ident: bytes, raw: bool = False) -> tuple:
    """The reference walk: see the C module's comment for the tuple it returns."""
    # unsigned 64-bit, wrapping like the C walk (Arrow reads the same bits as int64)
    qo, po, born, st = array("Q"), array("Q"), array("Q"), array("Q")
    offs = [array("i", [0]) for _ in range(4)]          # topic, props, body, msg id
    data = [bytearray() for _ in range(4)]
    fields, hs = (_raw_fields, _RAW.size) if raw else (_fields, _REC.size)
    n = len(body)
    if count < 0 or not 0 <= pos <= n:
        raise ValueError("MESSAGES body malformed: bad start or count")
    for _ in range(count):
        if n - pos < hs:
            raise ValueError("MESSAGES body malformed: record header truncated")
        hs, q, p, b, s, tl, kl, dl, pl, bl = fields(body, pos)
        pos += hs
        kl += dl                        # dispatch queues (raw layout) are skipped like the keys
        if n - pos < tl + kl + pl + bl:
            raise ValueError("MESSAGES body malformed: record truncated")
        qo.append(q)
        po.append(p)
        born.append((b * 1000) & _U64)
        st.append((s * 1000) & _U64)
        for k, chunk in ((0, body[pos:pos + tl]), (1, body[pos + tl + kl:pos + tl + kl + pl]),
                         (2, body[pos + tl + kl + pl:pos + tl + kl + pl + bl]), (3, ident + b"%016X" % p)):
            data[k] += chunk
            offs[k].append(len(data[k]))
        pos += tl + kl + pl + bl
    if max(len(d) for d in data) > 0x7FFFFFFF:
        raise ValueError("MESSAGES batch too large for 32-bit Arrow offsets")
    le = _little_endian
    return (le(qo).tobytes(), le(po).tobytes(), le(born).tobytes(), le(st).tobytes(),
            le(offs[0]).tobytes(), bytes(data[0]), le(offs[1]).tobytes(), bytes(data[1]),
            le(offs[2]).tobytes(), bytes(data[2]), le(offs[3]).tobytes(), bytes(data[3]))


def _little_endian(a: array) -> array:
    if sys.byteorder == "big":
        a.byteswap()
    return a


def split_body(body: bytes) -> tuple[dict, int, int]:
    """(JSON header, position of the first record, record count) of a MESSAGES body."""
    try:
        (hl,) = struct.unpack_from(">I", body)
        header = json.loads(body[4:4 + hl]) if hl else {}
        (count,) = struct.unpack_from(">I", body, 4 + hl)
    except (struct.error, ValueError, RecursionError) as e:     # RecursionError: a header nested too deep
        raise W.ProtocolError(W.E_BAD_FRAME, f"MESSAGES body malformed: {e}") from None
    return header, 8 + hl, count


def body_columns(body: bytes, pos: int, count: int, ident: str, *, pure: bool = False, raw: bool = False) -> tuple:
    if raw:
        fn = columns_raw_py if pure or _C is None else _C.columns_raw
    else:
        fn = columns_py if pure or _C is None else _C.columns
    try:
        return fn(body, pos, count, ident.encode())
    except ValueError as e:
        raise W.ProtocolError(W.E_BAD_FRAME, str(e)) from None


def props_dictionary(props):
    """Arrow arrays (qos, retain, client_id, user_properties, content_type) over the distinct
    props values of `props` (a BinaryArray), plus the per-record indices into them."""
    enc = props.dictionary_encode()
    uniq = []
    for p in enc.dictionary.to_pylist():
        try:
            f = decode_fields(p)
        except ValueError:                  # foreign props: plain QoS 0, like Record.mqtt
            f = _EMPTY_PROPS
        uniq.append((f[0], f[1], f[2], list(dict(f[8]).items()), f[5]))    # map: last value wins
    cols = list(zip(*uniq)) if uniq else [(), (), (), (), ()]
    return (pa.array(cols[0], pa.int32()), pa.array(cols[1], pa.bool_()), pa.array(cols[2], pa.string()),
            pa.array(cols[3], pa.map_(pa.string(), pa.string())), pa.array(cols[4], pa.string())), enc.indices


def arrow_batch(key: str, ident: str, body: bytes, start: int | None = None, end: int | None = None,
                *, pure: bool = False, raw: bool = False):
    """A MESSAGES body (`raw`: in the raw layout, frame flag F_RAW) -> (RecordBatch in the data
    source's schema, header, next offset or None).

    Records outside [start, end) (queue offsets) are left out; the next offset is one past the
    last record of the body (None when it has none)."""
    header, pos, count = split_body(body)
    (qo, po, born, st, t_off, t_dat, p_off, p_dat, b_off, b_dat, m_off, m_dat) = body_columns(
        body, pos, count, ident, pure=pure, raw=raw)
    n = count
    buf = pa.py_buffer
    offset = pa.Array.from_buffers(pa.int64(), n, [None, buf(qo)])
    ts = pa.timestamp("us", tz="UTC")
    props = pa.Array.from_buffers(pa.binary(), n, [None, buf(p_off), buf(p_dat)])
    (qos_d, retain_d, cid_d, up_d, ct_d), idx = props_dictionary(props)
    batch = pa.RecordBatch.from_arrays([
        pa.Array.from_buffers(pa.string(), n, [None, buf(t_off), buf(t_dat)]),
        pa.Array.from_buffers(pa.binary(), n, [None, buf(b_off), buf(b_dat)]),
        qos_d.take(idx), retain_d.take(idx), cid_d.take(idx), up_d.take(idx), ct_d.take(idx),
        pa.Array.from_buffers(ts, n, [None, buf(born)]),
        pa.Array.from_buffers(ts, n, [None, buf(st)]),
        pa.Array.from_buffers(pa.string(), n, [None, buf(m_off), buf(m_dat)]),
        pa.repeat(pa.scalar(key, pa.string()), n) if n else pa.array([], pa.string()),
        offset,
    ], names=COLUMNS)
    nxt = offset[n - 1].as_py() + 1 if n else None
    if n and (start is not None and offset[0].as_py() < start or end is not None and offset[n - 1].as_py() >= end):
        keep = pc.and_(pc.greater_equal(offset, start if start is not None else -1),
                       pc.less(offset, end if end is not None else 1 << 62))
        batch = batch.filter(keep)
    return batch, header, nxt
