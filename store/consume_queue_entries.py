"""What a ConsumeQueue entry is, and how a dispatch batch becomes runs of packed entries.

Entry = CommitLog offset u64, record size u32, tag hash u64 (CRC-32 of the full topic), as in
RocketMQ's ConsumeQueue. The dispatch stage hands the ConsumeQueue a batch of records (a list of
DispatchRequests when it parsed the CommitLog, a columnar DispatchBatch from the appenders' live
hand-off: store/message.py); `RunGrouper` turns either into one call per run of consecutive
queue offsets of one queue, with the run's entries packed, which is all the queue store needs
to append (store/consume_queue.py). A module of its own because this is the per-record hot loop
of dispatch, with its C twin (store/_fastpath.c `cq_entries`), apart from where entries are kept.
"""
from __future__ import annotations

import struct
from itertools import accumulate

from .message import (CHUNK_CQ, CHUNK_RUNS, CHUNK_SIZES, CHUNK_STARTS, DR_PHYS, DR_QUEUE_ID, DR_QUEUE_OFFSET,
                      DR_SIZE, DR_TAGS_CODE, DR_TOPIC)
from .record import first_level

ENTRY = struct.Struct("<QIQ")
# its fields, one per code of the format (the C modules that read or pack entries, store/_fastpath.c
# and store/_append.c, check these names, not only the offsets: phys_offset and tags_code are both
# u64 and could trade places without changing the format)
ENTRY_FIELDS = ("phys_offset", "size", "tags_code")
ENTRY_SIZE = ENTRY.size  # 20
assert ENTRY_SIZE == 20 and len(ENTRY_FIELDS) == len(ENTRY.format) - 1

_BULK: dict[int, struct.Struct] = {}   # n -> Struct of n entries
_BULK_MAX = 1024


def _entries_py(phys: int, sizes: list, i0: int, i1: int, tags: int) -> bytes:
    """Entries of the consecutive records sizes[i0:i1] (each starts where the previous ends, the
    first at `phys`) sharing one tag hash: one Struct.pack for up to _BULK_MAX entries (~40 %
    cheaper than one pack per entry). The reference of store/_fastpath.c `cq_entries`, which
    store/fastpath.py binds as `_entries` when it is built (tests/store/test_fastpath_accel.py
    compares them): py-spy --gil of a replica under `lmqtt bench ha --cases append-replicated`
    put this at ~35 of 317 GIL samples. [i0, i1) is clamped to the list as the C loop does (no
    slice from the end for a negative i0)."""
    i0 = max(i0, 0)
    i1 = min(i1, len(sizes))
    if i1 <= i0:
        return b""
    if i1 - i0 > _BULK_MAX:
        out = []
        for i in range(i0, i1, _BULK_MAX):
            part = sizes[i:min(i + _BULK_MAX, i1)]
            out.append(_entries_py(phys, part, 0, len(part), tags))
            phys += sum(part)
        return b"".join(out)
    if i0 or i1 != len(sizes):
        sizes = sizes[i0:i1]
    n = len(sizes)
    st = _BULK.get(n)
    if st is None:
        if len(_BULK) > 256:
            _BULK.clear()
        st = _BULK[n] = struct.Struct("<" + "QIQ" * n)
    flat = [tags] * (3 * n)
    offs = list(accumulate(sizes, initial=phys))
    del offs[-1]
    flat[0::3] = offs
    flat[1::3] = sizes
    return st.pack(*flat)


# _entries(phys, sizes, i0, i1, tags): what `RunGrouper.columns` calls. store/fastpath.py replaces it
# with the C twin (store/_fastpath.c cq_entries) once it has configured that module (it imports
# this module, so this one cannot import it); the store's dispatch imports fastpath
# (store/dispatch.py), so a store's dispatch runs the C one when it is built.
_entries = _entries_py


# ------------------------------------------------------------------ stored blocks
# A block of entries as the ConsumeQueue database stores it (store/consume_queue.py `E` keys).
# Why encoded: a busy topic's entries were ~20 MB/s into RocksDB at a million messages a second,
# written to the memtable, flushed and compacted again, and that work cost the store's batch-64
# append ~8 % of its throughput against mapped queue files (BENCHMARKS.md). Consecutive entries of
# a queue mostly point at records back to back or a fixed distance apart, with one tag hash, so
# a block is stored as runs:
#
#   value  = BLOCK_TAG, varint n (entries), group..., [one 0x00 pad byte]
#   group  = varint run (>= 1), varint delta, varint size, tag
#   delta  = (phys of the run's first entry - expected) mod 2**64, where expected is where the
#            previous run's last record ends (0 at the block's start)
#   tag    = 0x00 (the previous group's tag hash) | 0x01 and the tag hash, u64 little-endian
#            (whatever the entries' byte order: the light-queue index's are big-endian)
#   the k-th entry of a run is at phys + k * size (mod 2**64), with the run's size and tag.
#
# A block whose encoding would not be shorter is stored raw, as before: raw values are a whole
# number of entries long, an encoded value never is (the pad byte sees to it), which is how a
# reader tells them apart, also in a database written before the encoding.
# `encode_block`/`decode_block` are bound to store/_fastpath.c's `cq_encode`/`cq_decode` by
# store/fastpath.py when it is built; the functions below are their references
# (tests/store/test_cq_block_codec.py compares them). Without the C module the store writes raw
# blocks (`encode_block` is None): encoding per entry in Python would cost more than it saves.
BLOCK_TAG = 0xC1
BLOCK_MAX = 1 << 20         # entries in one encoded block at most (a longer one is stored raw)
_M64 = (1 << 64) - 1


def _varint(out: bytearray, v: int) -> None:
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def _read_varint(b, pos: int, limit: int = _M64) -> tuple[int, int]:
    v = shift = 0
    while True:
        if pos >= len(b):
            raise ValueError("ConsumeQueue block: truncated (a number runs past the end)")
        c = b[pos]
        pos += 1
        v |= (c & 0x7F) << shift
        if not c & 0x80:
            break
        shift += 7
        if shift > 63:
            raise ValueError("ConsumeQueue block: a number longer than 64 bits")
    if v > limit:
        raise ValueError(f"ConsumeQueue block: {v} is out of range (at most {limit})")
    return v, pos


_ENTRY_BE = struct.Struct(">QIQ")      # the light-queue index's entries (lightqueue/take.py ENTRY)


def encode_block_py(entries: bytes, big_endian: bool = False) -> bytes:
    """The stored form of `entries` (a whole number of entries): runs, or `entries` itself when
    that is not longer. `big_endian`: entries of the light-queue index (lightqueue/take.py
    ENTRY: the same fields, its third the store time), stored by lightqueue/index.py the same way."""
    n = len(entries) // ENTRY_SIZE
    if n * ENTRY_SIZE != len(entries):
        raise ValueError(f"ConsumeQueue block: {len(entries)} bytes is not a whole number of entries")
    if n > BLOCK_MAX:
        return bytes(entries)
    out = bytearray((BLOCK_TAG,))
    _varint(out, n)
    unpack = (_ENTRY_BE if big_endian else ENTRY).unpack_from
    exp = 0
    prev_tag = None
    i = 0
    while i < n:
        phys, size, tag = unpack(entries, i * ENTRY_SIZE)
        last = phys
        j = i + 1
        while j < n:
            p2, s2, t2 = unpack(entries, j * ENTRY_SIZE)
            if s2 != size or t2 != tag or p2 != (last + size) & _M64:
                break
            last = p2
            j += 1
        _varint(out, j - i)
        _varint(out, (phys - exp) & _M64)
        _varint(out, size)
        if tag == prev_tag:
            out.append(0)
        else:
            out.append(1)
            out += tag.to_bytes(8, "little")
        prev_tag = tag
        exp = (last + size) & _M64
        i = j
        if len(out) >= len(entries):
            return bytes(entries)
    if len(out) % ENTRY_SIZE == 0:
        out.append(0)
    return bytes(entries) if len(out) >= len(entries) else bytes(out)


def block_count(value) -> int:
    """How many entries a stored block holds (raw or encoded), without decoding it."""
    if len(value) % ENTRY_SIZE == 0:
        return len(value) // ENTRY_SIZE
    if value[0] != BLOCK_TAG:
        raise ValueError(f"ConsumeQueue block: unknown format {value[0]:#04x} ({len(value)} bytes)")
    return _read_varint(value, 1, BLOCK_MAX)[0]


def decode_block_py(value, start: int = 0, stop: int = -1, big_endian: bool = False) -> bytes:
    """Entries [start, stop) of a stored block (stop -1: to its end; both clipped to it), raw."""
    if len(value) % ENTRY_SIZE == 0:
        n = len(value) // ENTRY_SIZE
        start = max(0, min(start, n))
        stop = n if stop < 0 else max(start, min(stop, n))
        return bytes(value[start * ENTRY_SIZE:stop * ENTRY_SIZE])
    if value[0] != BLOCK_TAG:
        raise ValueError(f"ConsumeQueue block: unknown format {value[0]:#04x} ({len(value)} bytes)")
    n, pos = _read_varint(value, 1, BLOCK_MAX)
    start = max(0, min(start, n))
    stop = n if stop < 0 else max(start, min(stop, n))
    out = []
    exp = 0
    tag = None
    k = 0
    while k < n:
        run, pos = _read_varint(value, pos)
        if run == 0 or run > n - k:
            raise ValueError(f"ConsumeQueue block: a run of {run} entries at entry {k} of {n}")
        delta, pos = _read_varint(value, pos)
        size, pos = _read_varint(value, pos, 0xFFFFFFFF)
        if pos >= len(value):
            raise ValueError("ConsumeQueue block: truncated (a run without its tag)")
        flag = value[pos]
        pos += 1
        if flag == 1:
            if pos + 8 > len(value):
                raise ValueError("ConsumeQueue block: truncated (a tag hash runs past the end)")
            tag = int.from_bytes(value[pos:pos + 8], "little")
            pos += 8
        elif flag != 0 or tag is None:
            raise ValueError(f"ConsumeQueue block: bad tag marker {flag} at entry {k}")
        phys = (exp + delta) & _M64
        a, b = max(start, k), min(stop, k + run)
        pack = (_ENTRY_BE if big_endian else ENTRY).pack
        for e in range(a, b):
            out.append(pack((phys + (e - k) * size) & _M64, size, tag))
        exp = (phys + run * size) & _M64
        k += run
    if len(value) - pos > 1 or (len(value) - pos == 1 and value[pos] != 0):
        raise ValueError(f"ConsumeQueue block: {len(value) - pos} bytes after its {n} entries")
    return b"".join(out)


# encode_block(entries, big_endian=False) -> bytes, or None: the store writes raw blocks (see
# above); decode_block(value, start=0, stop=-1, big_endian=False) -> bytes. store/fastpath.py binds the C twins here once it has
# configured that module.
encode_block = None
decode_block = decode_block_py


class RunGrouper:
    """Groups a dispatch batch into runs per (first-level topic, queue id), remembering each
    topic's first level. Not thread-safe: the queue store calls it under its lock."""

    def __init__(self) -> None:
        self._fl_cache: dict[str, str] = {}

    def rows(self, batch, write_run) -> None:
        """A plain list of DispatchRequests -> `write_run(key, first qoff, [packed entries])` per run."""
        groups: dict[tuple[str, int], list] = {}
        flc = self._fl_cache
        pack = ENTRY.pack
        last_topic = None
        last_qid = -1
        g: list = []
        key: tuple[str, int] = ("", 0)
        nxt = 0
        at_phys, at_size, at_topic, at_qid, at_qoff, at_tags = (DR_PHYS, DR_SIZE, DR_TOPIC, DR_QUEUE_ID,
                                                                DR_QUEUE_OFFSET, DR_TAGS_CODE)
        for r in batch:
            topic = r[at_topic]
            qid = r[at_qid]
            if topic is not last_topic or qid != last_qid:
                fl = flc.get(topic) or self._first_level(topic)
                key = (fl, qid)
                g = groups.get(key)
                if g is None:
                    g = groups[key] = [r[at_qoff]]
                nxt = g[0] + len(g) - 1
                last_topic = topic
                last_qid = qid
            qoff = r[at_qoff]
            if qoff != nxt:  # not consecutive: write what we have and start a new run
                write_run(key, g[0], g[1:])
                g = groups[key] = [qoff]
                nxt = qoff
            g.append(pack(r[at_phys], r[at_size], r[at_tags]))
            nxt += 1
        for key, g in groups.items():
            write_run(key, g[0], g[1:])

    def columns(self, batch, write_run) -> None:
        """One packed block of entries per run of the batch (records of one queue with consecutive
        offsets, see store.message), blocks of one queue joined while they continue each other."""
        groups: dict[tuple[str, int], list] = {}   # key -> [first qoff, next qoff, [blocks]]
        flc = self._fl_cache
        pack = ENTRY.pack
        last_topic = None
        last_qid = -1
        key: tuple[str, int] = ("", 0)
        g: list = []
        at_sizes, at_starts, at_runs, at_cq = CHUNK_SIZES, CHUNK_STARTS, CHUNK_RUNS, CHUNK_CQ
        at_phys, at_size, at_topic, at_qid, at_qoff, at_tags = (DR_PHYS, DR_SIZE, DR_TOPIC, DR_QUEUE_ID,
                                                                DR_QUEUE_OFFSET, DR_TAGS_CODE)
        for c in batch.chunks:
            sizes, starts, runs, cqs = c[at_sizes], c[at_starts], c[at_runs], c[at_cq]
            if cqs is not None:   # packed by the encoder: a block per queue of this append
                for key, (qoff, data) in cqs.items():
                    g = groups.get(key)
                    if g is None:
                        g = groups[key] = [qoff, qoff, []]
                    elif g[1] != qoff:
                        write_run(key, g[0], g[2])
                        g = groups[key] = [qoff, qoff, []]
                    g[1] = qoff + len(data) // ENTRY_SIZE
                    g[2].append(data)
                last_topic = None   # `g`/`key` of the row path below no longer apply
                continue
            ns = len(sizes)
            if len(runs) == ns:   # one record per run (the usual single append): runs = records
                blocks = None
            else:
                blocks = []
                nr = len(runs)
                for k in range(nr):
                    i0 = starts[k]
                    i1 = starts[k + 1] if k + 1 < nr else ns
                    r = runs[k]
                    if i1 - i0 == 1:
                        blocks.append((1, pack(r[at_phys], sizes[i0], r[at_tags])))
                    else:
                        blocks.append((i1 - i0, _entries(r[at_phys], sizes, i0, i1, r[at_tags])))
            for k, r in enumerate(runs):
                if blocks is None:
                    n = 1
                    data = pack(r[at_phys], r[at_size], r[at_tags])
                else:
                    n, data = blocks[k]
                topic = r[at_topic]
                qid = r[at_qid]
                qoff = r[at_qoff]
                if topic is not last_topic or qid != last_qid:
                    fl = flc.get(topic) or self._first_level(topic)
                    key = (fl, qid)
                    g = groups.get(key)
                    if g is None:
                        g = groups[key] = [qoff, qoff, []]
                    last_topic = topic
                    last_qid = qid
                if g[1] != qoff:  # not consecutive: write what we have and start a new run
                    write_run(key, g[0], g[2])
                    g = groups[key] = [qoff, qoff, []]
                g[1] = qoff + n
                g[2].append(data)
        for key, g in groups.items():
            if g[2]:
                write_run(key, g[0], g[2])

    def _first_level(self, topic: str) -> str:
        """first_level(topic), remembered (the dispatch loops look the cache up inline first)."""
        flc = self._fl_cache
        fl = first_level(topic)
        if len(flc) > 100_000:
            flc.clear()
        flc[topic] = fl
        return fl

