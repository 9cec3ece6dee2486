"""CommitLog record encoders: the Python reference loop, the C loop's selection and its layout check.

Three code paths write CommitLog records and must produce the same bytes:

* `encode_py` (here): the batch encoder in Python, the reference for the other two;
* `lmqtt.store._append.encode` (store/_append.c): the same loop in C, used when it was built and
  LMQTT_PURE_PYTHON is not set (`ENCODER` says which one runs);
* `CommitLog.append_one`: the single-record path the gateway uses (one PUBLISH per call). Its
  pack/CRC lines stay inline in commitlog.py under the log's lock: a function call there is a
  per-record call, and that path is tuned to ~1/3 of append_batch's fixed cost. It uses the same
  caches and Structs as `encode_py` (`CommitLog._topic_info`, `_tail_struct`, `_names`).

tests/store/test_encoding.py checks all three byte for byte; tests/store/test_append_speedups.py
compares C and Python column for column on random batches.

The C module does not repeat the record format: `configure_c` hands it `LAYOUT` (header format,
field names, size, CRC start, filler size, magic numbers, ConsumeQueue entry format, all from
store/record.py and store/consume_queue_entries.py) and the C side refuses a layout whose fields differ
from the ones it writes (offset, width or name), with a ValueError naming the field.

`encode_py` reads the caches and helpers of the CommitLog it is given (`_topic_cache`,
`_names_cache`, `queue_table`, `_topic_info`, `_dq_info`, `_names`, `_tail_struct`); the C loop
calls back into the same methods on a cache miss, so validation and caching rules live in one
place (commitlog.py).
"""
from __future__ import annotations

import struct
import zlib

from . import accel
from .consume_queue import ENTRY as CQ_ENTRY, ENTRY_FIELDS as CQ_ENTRY_FIELDS
from .errors import InvalidMessage
from .message import RECENT_FIELDS, DispatchRequest, Message
from .record import (BLANK_MAGIC, CRC_START, HEADER, HEADER_FIELDS, HEADER_SIZE, MIN_BLANK, MSG_MAGIC, PREFIX,
                     check_size, header_format)

_NONE = object()  # matches nothing (`is` comparisons)

# Slices of the record header (store.record.HEADER, the one definition), by field name:
PREFIX3 = struct.Struct(header_format("total_size", "queue_id"))      # total_size, magic, crc
# the fields after the CRC, up to the variable part (topic, keys, queues); CommitLog._tail_struct
# appends the `s` codes of those
TAIL_FORMAT = header_format("queue_id")
# a record after the CRC split around the two fields that change from record to record of a run
_PRE = struct.Struct(header_format("queue_id", "queue_offset"))       # queue_id, flags
_QQ = struct.Struct(header_format("queue_offset", "born_ts"))         # queue_offset, phys_offset
_POST = struct.Struct(header_format("born_ts"))   # born_ts, store_ts, tags, body_len, props_len, 3 lengths

# Slots of a topic-info list (`CommitLog._topic_info`, cached per topic in `_topic_cache`): the
# topic's bytes, its first level (ConsumeQueue name), tags code, byte length, the tail Struct and
# header size without keys/queues, then the last dispatch-queue tuple seen with the topic, its
# encoding, Struct and header size. A list, not an object: it is read per run on the append path.
# The per-record loop below binds these names to locals before it starts (a global name there
# would be a lookup per record); the C loop gets the positions it reads in LAYOUT.
(TI_TOPIC_BYTES, TI_FIRST_LEVEL, TI_TAGS, TI_TOPIC_LEN, TI_STRUCT, TI_HBASE, TI_DQ, TI_DQ_BYTES,
 TI_DQ_STRUCT, TI_DQ_HBASE) = range(10)
TI_LEN = TI_DQ_HBASE + 1

# The record format as handed to the C encoder (checked there, see store/_append.c configure()).
LAYOUT = {
    "header_format": HEADER.format,
    "header_fields": HEADER_FIELDS,
    "header_size": HEADER_SIZE,
    "crc_start": CRC_START,
    "min_blank": MIN_BLANK,
    "msg_magic": MSG_MAGIC,
    "blank_magic": BLANK_MAGIC,
    "cq_entry_format": CQ_ENTRY.format,
    "cq_entry_fields": CQ_ENTRY_FIELDS,
    "ti_topic_bytes": TI_TOPIC_BYTES, "ti_first_level": TI_FIRST_LEVEL, "ti_tags": TI_TAGS,
    "ti_dq": TI_DQ, "ti_dq_bytes": TI_DQ_BYTES, "ti_len": TI_LEN,
    "recent_fields": RECENT_FIELDS,
}
assert PREFIX.size <= MIN_BLANK and PREFIX3.size == CRC_START


def configure_c(mod, layout: dict = LAYOUT) -> None:
    """Hand the value types, error class, size check and record layout to the C encoder `mod`.
    Raises ValueError when the layout is not the one the C loop writes."""
    mod.configure(DispatchRequest, InvalidMessage, check_size, Message, layout)


_c = accel.load("lmqtt.store._append")
if _c is not None:
    configure_c(_c)

# the C batch encoder (`encode(msgs, commitlog, tcache, ncache, qt, phys, seg_end, seg, store_ts,
# maxsize, want_recent)`, see store/_append.c), or None: then `encode_py` runs
c_encoder = _c
ENCODER = "c" if _c is not None else "python"


def encode_py(cl, msgs: list, phys: int, seg_end: int, store_ts: int, want_recent: bool) -> tuple:
    """Encode `msgs` as records from `phys` on; touches nothing but the caches. Returns
    (chunks [(start, bytes) per segment touched], sizes, starts, runs, keyed, assigned queue
    offsets, end offset, recent offsets, recent fields). The reference for store._append,
    which does the same in C (tests/store/test_append_speedups.py compares them).

    One pass per message: one Struct.pack for header fields+topic+keys+queues (joined with
    the body), one CRC, a 12-byte prefix pack; the parts are joined once per segment."""
    maxsize = cl.cfg.max_message_size
    tcache = cl._topic_cache
    ncache = cl._names_cache
    seg = cl.seg_size
    crc32 = zlib.crc32
    p3pack = PREFIX3.pack
    magic = MSG_MAGIC
    limit = seg_end - MIN_BLANK
    qt = cl.queue_table
    assigned: dict = {}
    parts: list = []
    sizes: list = []
    starts: list = []
    runs: list = []
    keyed = False
    new = tuple.__new__
    DR = DispatchRequest
    cuts: list = []
    cstart = phys
    last_fl = None
    last_qid = -1
    qoff = 0
    # the current run's shared fields; `_NONE` never matches, so the first record starts one
    r_topic = r_qid = r_flags = r_born = r_keys = r_dq = _NONE
    tb = kb = db = b""
    fl = tags = tl = kl = dl = S = hbase = t = None
    r_pre = r_post = b""
    join = b"".join
    qqpack = _QQ.pack
    sb_len = prev_bl = -1
    size_append = sizes.append
    recent: list | None = [] if want_recent else None
    recent_offs: list = []
    # topic-info slots (TI_*) as locals: read per run, which is per record for many topics
    ti_tb, ti_fl, ti_tags, ti_tl, ti_struct, ti_hbase = (TI_TOPIC_BYTES, TI_FIRST_LEVEL, TI_TAGS, TI_TOPIC_LEN,
                                                         TI_STRUCT, TI_HBASE)
    ti_dq, ti_db, ti_dstruct, ti_dhbase = TI_DQ, TI_DQ_BYTES, TI_DQ_STRUCT, TI_DQ_HBASE
    try:
        for m in msgs:
            topic = m.topic
            qid = m.queue_id
            flags = m.flags
            born = m.born_ts
            keys = m.keys
            dq = m.dispatch_queues
            new_run = False
            if (topic is not r_topic or qid is not r_qid or flags is not r_flags or born is not r_born
                    or keys is not r_keys or dq is not r_dq):
                # values are immutable: identity means equal; equal values that are
                # different objects start a new run (harmless, only less compact)
                new_run = True
                if topic is not r_topic:
                    t = tcache.get(topic)
                    if t is None:
                        t = cl._topic_info(topic)
                    tb, fl, tags, tl = t[ti_tb], t[ti_fl], t[ti_tags], t[ti_tl]
                    r_topic = topic
                if keys:
                    keyed = True
                    kb = ncache.get(keys) or cl._names(keys, "keys")
                    db = (ncache.get(dq) or cl._names(dq, "dispatch_queues")) if dq else b""
                    kl = len(kb)
                    dl = len(db)
                    S = cl._tail_struct(tl, kl, dl)
                    hbase = t[ti_hbase] + kl + dl
                elif dq:
                    if dq is not t[ti_dq]:
                        cl._dq_info(t, dq)
                    kb = b""
                    kl = 0
                    db = t[ti_db]
                    dl = len(db)
                    S = t[ti_dstruct]
                    hbase = t[ti_dhbase]
                else:
                    kb = db = b""
                    kl = dl = 0
                    S = t[ti_struct]
                    hbase = t[ti_hbase]
                if qid != last_qid or fl is not last_fl:
                    if last_fl is not None:
                        assigned[(last_fl, last_qid)] = qoff
                    key = (fl, qid)
                    qoff = assigned.get(key)
                    if qoff is None:
                        qoff = qt.get(key, 0)
                    last_fl = fl
                    last_qid = qid
                sb_len = prev_bl = -1  # new run: r_pre/r_post no longer match
                r_qid = qid
                r_flags = flags
                r_born = born
                r_keys = keys
                r_dq = dq
            body = m.body
            props = m.props
            bl = len(body)
            pl = len(props)
            total = hbase + bl + pl
            if total > maxsize:
                check_size(total, maxsize)
            if phys + total > limit:  # close the segment with a blank filler
                parts.append(PREFIX.pack(seg_end - phys, BLANK_MAGIC))
                cuts.append((len(parts), cstart))
                phys = cstart = seg_end
                seg_end += seg
                limit = seg_end - MIN_BLANK
                new_run = True
            if new_run:
                starts.append(len(sizes))
                runs.append(new(DR, (phys, total, topic, qid, qoff, flags, born, store_ts, tags, keys, dq)))
            if pl:
                rec = b"".join((S.pack(qid, flags, qoff, phys, born, store_ts, tags, bl, pl, tl, kl, dl,
                                       tb, kb, db), props, body))
            elif bl == sb_len:
                # same body size as the previous record of this run: only queue offset
                # and position differ, the bytes around them are packed once per run
                rec = join((r_pre, qqpack(qoff, phys), r_post, body))
            else:
                rec = S.pack(qid, flags, qoff, phys, born, store_ts, tags, bl, 0, tl, kl, dl,
                             tb, kb, db) + body
                if bl == prev_bl:
                    r_pre = _PRE.pack(qid, flags)
                    r_post = b"".join((_POST.pack(born, store_ts, tags, bl, 0, tl, kl, dl), tb, kb, db))
                    sb_len = bl
                prev_bl = bl
            parts += (p3pack(total, magic, crc32(rec)), rec)
            size_append(total)
            if recent is not None and type(body) is bytes and type(props) is bytes:
                recent_offs.append(phys)
                # in store.message.RECENT_FIELDS order (tests/store/test_encoding.py checks it)
                recent.append((topic, body, props, qid, qoff, flags, total, born, store_ts, keys, dq))
            qoff += 1
            phys += total
    except struct.error as e:
        raise InvalidMessage(f"a numeric field is out of range (queue_id/flags u32, born_ts u64 "
                             f"non-negative): {e}; nothing was written") from None
    except TypeError as e:
        raise InvalidMessage(f"body and props must be bytes-like: {e}; nothing was written") from None
    if last_fl is not None:
        assigned[(last_fl, last_qid)] = qoff
    if not sizes:
        return [], [], [], [], False, assigned, phys, [], []
    cuts.append((len(parts), cstart))
    chunks = []
    i = 0
    for j, c in cuts:
        chunks.append((c, b"".join(parts[i:j])))
        i = j
    return chunks, sizes, starts, runs, keyed, assigned, phys, recent_offs, recent or []

