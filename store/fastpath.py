"""The store server's per-message loops for the SDK's hot frames, each the fast twin of a plain
reference that tests compare it with (tests/store/test_fastpath.py):

* `read_raw(store, topic, queue_id, offset, max_count, max_bytes)`  a ConsumeQueue range as the
  CommitLog's own record bytes (the "raw" MESSAGES layout, docs/protocol.md); reference:
  `MessageStore.read_consume_queue` + `protocol.encode_messages`.

Why: profiles of `lmqtt store` under `lmqtt bench sdk` (py-spy) showed the server spending more
time around a pull than in it: per pulled message a CRC-checked decode of the record into a
`StoredMessage` (~3 us) only to pack the same fields back into MESSAGES. Here a pull copies
contiguous records with one slice and checks each record's CRC without decoding it. (The PRODUCE
side's loops, the decode into Messages and the PRODUCED answer, are store/produce.py.)
"""
from __future__ import annotations

import struct
import zlib
from array import array
from operator import itemgetter

from . import accel, consume_queue_entries as _cq_entries
from .consume_queue_entries import ENTRY, ENTRY_FIELDS, ENTRY_SIZE
from .errors import CorruptRecord, NotVisible
from .message import DispatchRequest
from .record import BLANK_MAGIC, CRC_START, HEADER, HEADER_FIELDS, MSG_MAGIC, PREFIX, SEP, decode, header_format

def read_raw(store, topic: str, queue_id: int, offset: int, max_count: int, max_bytes: int):
    """The visible records of a ConsumeQueue range as CommitLog bytes, CRC-checked, undecoded.

    -> (count, [bytes chunks], next_offset), or None when this path cannot serve the range as it
    is (a record in a segment that is not mapped here, a CRC failure, anything unusual): the
    caller then answers through the decoding path, which reports and skips bad records. Records
    adjacent in the CommitLog (the usual case: a producer's batch) are copied with one slice and
    their CRCs checked on that copy. `max_bytes` (0 = no limit) stops before the record that
    would pass it, never before the first. Like `read_consume_queue`, nothing at or past the
    dispatch point is returned.

    Both per-entry loops (grouping entries into runs, checking each record) are `cq_runs` and
    `check_records`: the C module `_fastpath` when built, else the Python references below."""
    cq = store.consume_queues.get(topic, queue_id)
    if cq is None or max_count <= 0:
        return 0, [], offset
    visible = store.dispatch.dispatched
    try:
        pieces = cq.pieces(offset, max_count)
    except ValueError:      # a file was deleted by retention meanwhile: let the reference path clamp
        return None
    # 1. the entries as runs of adjacent records: [first phys, sizes (u32 bytes), run bytes]
    runs = []
    count = total = 0
    next_off = offset
    for q0, piece in pieces:
        rs, count, total, nq, stopped = _cq_runs(piece, q0, visible, max_bytes, count, total)
        runs += rs
        if nq >= 0:
            next_off = nq
        if stopped:
            break
    # 2. one copy per run (cut where a run crosses into the next segment), then one check per copy
    chunks = []
    find = store.clog.mfq.find
    for phys, sizes, nbytes in runs:
        copied = _copy_checked(find, phys, sizes, nbytes)
        if copied is None:
            return None
        chunks += [chunk for _phys, _count, chunk in copied]
    return count, chunks, next_off


# The light-queue index's entries (lightqueue/take.py ENTRY: phys, size, store ts) are the
# ConsumeQueue entry's fields in big-endian order, so `cq_runs` reads them too (`raw_piece`);
# lightqueue/light_queue_store.py checks at import that its ENTRY is this one.
BIG_ENDIAN_ENTRY = struct.Struct(">" + ENTRY.format.lstrip("<"))


def cq_runs_py(piece: bytes, first_qoff: int, visible: int, max_bytes: int, count: int, total: int,
               big_endian: bool = False):
    """Reference of `_fastpath.cq_runs` (module doc of store/_fastpath.c): ConsumeQueue entries ->
    (runs [[first phys, sizes as native u32 bytes, run bytes]], count, total, next queue offset or
    -1, stopped before the end of the piece). `big_endian`: the same fields big-endian (the
    light-queue index's entries, `BIG_ENDIAN_ENTRY`)."""
    runs = []
    sizes = None
    run_phys = run_end = 0
    next_q = -1
    stopped = False
    whole = len(piece) // ENTRY_SIZE * ENTRY_SIZE
    for i, (phys, size, _tags) in enumerate((BIG_ENDIAN_ENTRY if big_endian else ENTRY).iter_unpack(piece[:whole])):
        if not size:
            continue
        if phys >= visible or (max_bytes and count and total + size > max_bytes):
            stopped = True
            break
        if sizes is None or phys != run_end:
            if sizes is not None:
                runs.append([run_phys, sizes.tobytes(), run_end - run_phys])
            sizes = array("I")
            run_phys = phys
        sizes.append(size)
        run_end = phys + size
        total += size
        count += 1
        next_q = first_qoff + i + 1
    if sizes is not None:
        runs.append([run_phys, sizes.tobytes(), run_end - run_phys])
    return runs, count, total, next_q, stopped


def check_records_py(chunk, sizes: bytes, magic: int, crc_start: int) -> bool:
    """Reference of `_fastpath.check_records`: the records back to back in `chunk` have these
    sizes (native u32), each head says its size and `magic`, each CRC matches."""
    mv = memoryview(chunk)
    crc32 = zlib.crc32
    head = _RAW_HEAD.unpack_from
    least = _RAW_HEAD.size           # a record holds at least the three fields read here
    a = 0
    part = array("I")
    part.frombytes(sizes[:len(sizes) // 4 * 4])
    for size in part:
        if size < least or size < crc_start or a + size > len(chunk):
            return False
        rsize, m, crc = head(chunk, a)
        if rsize != size or m != magic or crc32(mv[a + crc_start:a + size]) != crc:
            return False
        a += size
    return True


# total size, magic, CRC: the first fields of a record (store/record.py), all `check_records` reads
_RAW_HEAD = struct.Struct(header_format("total_size", "queue_id"))
assert _RAW_HEAD.size == CRC_START

# What the C loops read, from the one Python definition of each layout, handed over at import;
# store/_fastpath.c checks it against the offsets it was written for and refuses to run until it
# has accepted it (a ValueError here names the field that differs: rebuild the extension).
C_LAYOUT = {
    "cq_entry_format": ENTRY.format,
    "cq_entry_fields": ENTRY_FIELDS,
    "cq_entry_size": ENTRY_SIZE,
    "record_header_format": HEADER.format,
    "record_header_fields": HEADER_FIELDS,
    # dispatch_scan (the dispatch round's record scan, store/dispatch.py): what it builds and matches
    "dispatch_request": DispatchRequest,
    "sep": SEP,
    "msg_magic": MSG_MAGIC,
}


def configure_c(mod, layout: dict = C_LAYOUT) -> None:
    """Hand the ConsumeQueue entry and record header layouts to the C module `mod`; ValueError when
    they are not the ones its loops read."""
    mod.configure(layout)


_fastpath = accel.load("lmqtt.store._fastpath")
if _fastpath is not None:
    configure_c(_fastpath)
_cq_runs = _fastpath.cq_runs if _fastpath is not None else cq_runs_py
_check_records = _fastpath.check_records if _fastpath is not None else check_records_py
# the C twin of the record scan in store/dispatch.py's `dispatch_round` (the Python loop there is
# its reference); None when not built or LMQTT_PURE_PYTHON is set
dispatch_scan = _fastpath.dispatch_scan if _fastpath is not None else None
# the ConsumeQueue entries of a run (store/consume_queue_entries.py `_entries`, whose Python
# reference is `_entries_py` there): bound into that module here, after configure (it cannot import this one)
cq_entries = _fastpath.cq_entries if _fastpath is not None else None
if cq_entries is not None:
    _cq_entries._entries = cq_entries
# a stored ConsumeQueue block (store/consume_queue_entries.py "stored blocks": the references and
# why the store writes raw blocks without the C module)
if _fastpath is not None:
    _cq_entries.encode_block = _fastpath.cq_encode
    _cq_entries.decode_block = _fastpath.cq_decode

# Positions in a RawRecord (below), which the per-record loops of this module build and read by
# index (a global name there is a lookup per record; they copy these into locals, or build the
# tuple in this order, which the assert ties to the names).
RR_QUEUE_OFFSET, RR_PHYS, RR_BUF, RR_START, RR_SIZE = range(5)
assert (RR_QUEUE_OFFSET, RR_PHYS, RR_BUF, RR_START, RR_SIZE) == (0, 1, 2, 3, 4)


class RawRecord(tuple):
    """One CommitLog record as stored, with where it is: what POP hands around in raw mode instead
    of a decoded StoredMessage. The bytes are `buf[start:start + size]` of a buffer shared by the
    records of one read (no copy per record); `data` slices them out. `message(ident)` decodes the
    record (CRC checked again) when the whole of it is needed (dead-lettering, or a reply that
    must use the decoded layout)."""

    __slots__ = ()

    # plain C getters, as a named tuple's fields are (read per record by POP)
    queue_offset = property(itemgetter(RR_QUEUE_OFFSET), doc="ConsumeQueue offset of the record")
    phys_offset = property(itemgetter(RR_PHYS), doc="CommitLog offset of the record")

    @property
    def data(self) -> bytes:
        start = self[RR_START]
        return self[RR_BUF][start:start + self[RR_SIZE]]

    def message(self, ident: str):
        return decode(self[RR_BUF], self[RR_START], self[RR_PHYS], ident)


def raw_chunks(records) -> list:
    """The bytes of `records` (RawRecords) in order, as few pieces as possible: records adjacent in
    one shared buffer go out as one memoryview slice of it."""
    out = []
    buf = None
    a = b = 0
    BUF, START, SIZE = RR_BUF, RR_START, RR_SIZE
    for r in records:
        if r[BUF] is buf and r[START] == b:
            b += r[SIZE]
            continue
        if buf is not None:
            out.append(memoryview(buf)[a:b])
        buf, a, b = r[BUF], r[START], r[START] + r[SIZE]
    if buf is not None:
        out.append(memoryview(buf)[a:b])
    return out


_RAW_NEW = tuple.__new__


def _header_field(name: str) -> tuple[int, struct.Struct]:
    """(byte offset, Struct) of the record header field `name` (store/record.py HEADER_FIELDS), so
    the cut below reads the fields where HEADER puts them."""
    after = HEADER_FIELDS[HEADER_FIELDS.index(name) + 1]
    return struct.calcsize(header_format(HEADER_FIELDS[0], name)), struct.Struct(header_format(name, after))


# the two fields read per record: its total size and its own CommitLog offset
_SIZE_FROM, _SIZE_ST = _header_field("total_size")
_PHYS_FROM, _PHYS_ST = _header_field("phys_offset")
assert _SIZE_FROM == 0            # records are cut by their leading size
_SIZE_AT = _SIZE_ST.unpack_from
_PHYS_AT = _PHYS_ST.unpack_from


def read_raw_records(store, topic: str, queue_id: int, offset: int, max_count: int):
    """`read_raw` cut into one `RawRecord` per record; None when `read_raw` declines."""
    got = read_raw(store, topic, queue_id, offset, max_count, 0)
    if got is None:
        return None
    count, chunks, next_off = got
    if not count:
        return []
    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    out = []
    append = out.append
    pos = 0
    qoff = next_off - count          # ConsumeQueue offsets are dense: the served ones end at next_off
    new = _RAW_NEW
    RR = RawRecord
    size_at = _SIZE_AT
    phys_at = _PHYS_AT
    phys_from = _PHYS_FROM
    for _ in range(count):
        size = size_at(data, pos)[0]
        append(new(RR, (qoff, phys_at(data, pos + phys_from)[0], data, pos, size)))    # RR_* order
        pos += size
        qoff += 1
    return out


def find_batch(store, position: int, msgs: list, max_records: int = 4096):
    """Where the batch `msgs` was appended at or after CommitLog `position`, if it was: ->
    [(phys_offset, queue_offset)] per message, or None.

    Used for a retried PRODUCE whose first attempt got as far as a pending dedup marker
    (SdkMetadata.begin) before the store process died: the batch may or may not have reached the
    log. A batch is appended contiguously (blank fillers at segment ends aside) but other appends
    may come first, so records from `position` on are scanned (at most `max_records`) for a run of
    records equal to the messages in order (topic, body, props, keys, queue id)."""
    clog = store.clog
    seg = clog.seg_size
    n = len(msgs)
    if not n:
        return None

    def record_at(pos):
        """(record, next position) or (None, next position) for a filler; raises at the end."""
        mf = clog.mfq.find(pos)
        if mf is None or pos >= clog.wrote:
            raise NotVisible(f"{pos} is past the CommitLog end")
        total, magic = PREFIX.unpack_from(mf.mm, pos - mf.start_offset)
        if magic == BLANK_MAGIC:
            return None, pos - pos % seg + seg
        m = clog.read(pos)
        return m, pos + m.size

    def same(m, want) -> bool:
        return (m.topic == want.topic and m.body == bytes(want.body) and m.props == want.props
                and tuple(m.keys) == tuple(want.keys) and m.queue_id == want.queue_id)

    pos = position
    try:
        for _ in range(max_records):
            m, nxt = record_at(pos)
            if m is not None and same(m, msgs[0]):
                found = [(m.phys_offset, m.queue_offset)]
                p2 = nxt
                while len(found) < n:
                    m2, p2 = record_at(p2)
                    if m2 is None:
                        continue
                    if not same(m2, msgs[len(found)]):
                        break
                    found.append((m2.phys_offset, m2.queue_offset))
                if len(found) == n:
                    return found
            pos = nxt
    except (NotVisible, CorruptRecord, ValueError):
        return None
    return None


def raw_runs(store, entries) -> list | None:
    """`entries` [(phys, size), ...] (in order, all below the dispatch point) as the CommitLog's
    own bytes: [(phys of the run's first record, record count, bytes)], one run per stretch of
    records adjacent in one segment, each copied with one slice and CRC-checked without decoding
    (`_copy_checked`, as `read_raw` above does for a ConsumeQueue range). None when this path
    cannot serve them as they are (a record not mapped here, a CRC failure): the caller then uses
    the decoding path, which reports and skips bad records. For pushes of a light queue's new
    entries (store/node/gateway_service.py)."""
    out = []
    find = store.clog.mfq.find
    i = 0
    n = len(entries)
    while i < n:
        phys, end = entries[i][0], entries[i][0] + entries[i][1]
        j = i + 1
        while j < n and entries[j][0] == end:
            end += entries[j][1]
            j += 1
        copied = _copy_checked(find, phys, array("I", [e[1] for e in entries[i:j]]).tobytes(), end - phys)
        if copied is None:
            return None
        out += copied
        i = j
    return out


def raw_piece(store, piece, offset: int, visible: int, max_bytes: int, min_phys: int):
    """A light queue's entries from `offset` as its index holds them (`piece`: BIG_ENDIAN_ENTRY
    each, for consecutive queue offsets) as the CommitLog's own bytes: -> (offset, [(phys, record
    count, bytes)], sizes as array("I")), nothing at or past `visible`, within `max_bytes` (at least
    one record); None when this path cannot serve them (an entry below `min_phys`, a gap left by an
    unwritten one, a record not mapped here or failing its check). The answer `raw_runs` gives for the same entries
    taken one by one (LightQueueStore.pull_raw's loop), from one `cq_runs` call: a push of a fan-in's
    new entries cost ~25 % of the store's loop in that per-entry Python (py-spy, `bench external
    --brokers lmqtt-workers`)."""
    runs, count, _total, next_q, _stopped = _cq_runs(piece, offset, visible, max(max_bytes, 1), 0, 0, True)
    if not runs:
        return offset, [], ()
    if next_q - offset != count or min(r[0] for r in runs) < min_phys:
        return None
    out: list = []
    sizes = array("I")
    find = store.clog.mfq.find
    for phys, sz, nbytes in runs:
        copied = _copy_checked(find, phys, sz, nbytes)
        if copied is None:
            return None
        out += copied
        sizes.frombytes(sz)
    return offset, out, sizes


def _copy_checked(find, phys: int, sizes: bytes, nbytes: int) -> list | None:
    """The records of one run of adjacent records (`sizes`: their native u32 sizes, `nbytes` their
    sum) copied from the CommitLog's maps, cut where the run crosses into the next segment:
    [(phys, record count, bytes)], each piece CRC-checked without decoding; None if a record is
    not mapped here, lies across a segment end or fails its check."""
    out = []
    while nbytes:
        mf = find(phys)
        if mf is None:
            return None
        room = mf.start_offset + mf.size - phys
        if nbytes > room:               # rare: a record ended exactly at the segment's end
            part = array("I")
            part.frombytes(sizes)
            k = used = 0
            while k < len(part) and used + part[k] <= room:
                used += part[k]
                k += 1
            if k == 0:
                return None             # a record across a segment end: not a valid layout
            here, sizes = part[:k].tobytes(), part[k:].tobytes()
        else:
            here, used = sizes, nbytes
        rel = phys - mf.start_offset
        try:
            chunk = mf.mm[rel:rel + used]
        except ValueError:   # map closed by retention meanwhile
            return None
        if not _check_records(chunk, here, MSG_MAGIC, CRC_START):
            return None
        out.append((phys, len(here) // 4, chunk))
        phys += used
        nbytes -= used
    return out
