"""atheris harness for the store's C loops over bytes read from disk (store/_fastpath.c) against
their Python references, the first input byte choosing the entry:

* `cq_runs` (ConsumeQueue entries -> runs of adjacent records) against fastpath.cq_runs_py: the
  same tuple, on raw entry bytes or entries built to be mostly adjacent (from anywhere in the
  64-bit range), little-endian or big-endian (the light-queue index's entries);
* `check_records` (sizes, magic and CRC of records back to back) against check_records_py: the
  same bool, on valid records, damaged ones, or raw bytes and raw sizes;
* `cq_entries` against consume_queue_entries._entries_py: the same bytes, or both refuse
  (struct.error in Python, OverflowError in C: tests/store/accel_support.py `outcome`);
* `cq_encode` / `cq_decode` (a stored ConsumeQueue block) against encode_block_py /
  decode_block_py: the same value and entries back; on damaged or raw values the same entries or
  both refuse (ValueError);
* `dispatch_scan` through `DispatchService.dispatch_round` with it and without it (its reference
  is that loop), over a CommitLog segment of records built from the input (runs, keys, dispatch
  queues, bad UTF-8, sizes that lie, a blank filler, raw bytes) or raw: the same batches, end
  offsets, caches and error (RuntimeError or UnicodeDecodeError, nothing else; struct.error for
  a segment tail shorter than a blank filler's header, which the store never writes), as
  tests/store/test_dispatch_scan_accel.py compares them.

Run for a bounded time by tests/fuzz/test_fuzz_harnesses.py; the long run's command and result
are in BENCHMARKS.md.

    python3 tests/fuzz/fuzz_fastpath.py -max_total_time=600 [CORPUS_DIR]
"""
from __future__ import annotations

import struct
import sys
import zlib
from array import array
from pathlib import Path

import atheris
from fuzz_input import Reader

# the dispatch rig of tests/store (this harness runs as a script, so it is found by path)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "store"))

with atheris.instrument_imports(include=["lmqtt"]):
    from lmqtt.store import fastpath
    from lmqtt.store.consume_queue_entries import ENTRY, ENTRY_SIZE, _entries_py, decode_block_py, encode_block_py
    from dispatch_rig import run_dispatch     # imports lmqtt.store.dispatch: instrumented
    from lmqtt.store.record import BLANK_MAGIC, CRC_START, HEADER, HEADER_SIZE, MSG_MAGIC, PREFIX

C = fastpath._fastpath
if C is None:
    sys.exit("lmqtt.store._fastpath is not built (or LMQTT_PURE_PYTHON is set): nothing to fuzz")

U64 = 2 ** 64 - 1


# ------------------------------------------------------------------ cq_runs
# the functions that turn the input into choices are instrumented too (@atheris.instrument_func): their
# branches guide the fuzzer to every kind of input, not only to new paths of the reference
@atheris.instrument_func
def _entries(r: Reader) -> bytes:
    """ConsumeQueue entries: raw, or built mostly adjacent from a base anywhere in 64 bits."""
    if r.byte() & 1:
        return r.rest()
    phys = r.num(0, U64)
    out = []
    for _ in range(r.byte() % 40):
        f = r.byte()
        size = (0, 1, 74, 100, 5000, 2 ** 32 - 1)[f & 7] if f & 7 < 6 else r.byte() << (8 * (f & 1))
        if f & 8:                                   # not right after the previous record
            phys = r.num(0, U64)
        out.append(ENTRY.pack(phys, size, r.byte()))
        phys = (phys + size) & U64
    return b"".join(out) + r.take(r.byte() % 20)


@atheris.instrument_func
def _cq_runs(r: Reader) -> None:
    # the carried count and byte total and the first queue offset as read_raw gives them (from 0,
    # growing by records of at most 2**32 - 1 bytes): up to 2**62, where the C's 64-bit sums
    # cannot wrap; the entries, `visible` and `max_bytes` anywhere in 64 bits
    first, visible, max_bytes = r.num(0, 2 ** 62), r.num(0, U64), r.num(0, U64)
    count, total = r.num(0, 2 ** 62), r.num(0, 2 ** 62)
    piece = _entries(r)
    big = bool(r.byte() & 1)        # read last: the seeds (written before it) stay little-endian
    if big:                         # the same entries in the light-queue index's byte order
        whole = len(piece) // ENTRY_SIZE * ENTRY_SIZE
        piece = b"".join(fastpath.BIG_ENDIAN_ENTRY.pack(*e) for e in ENTRY.iter_unpack(piece[:whole])) + piece[whole:]
    args = (piece, first, visible, max_bytes, count, total, big)
    got = _outcome(C.cq_runs, *args)
    want = _outcome(fastpath.cq_runs_py, *args)
    if got != want:
        raise AssertionError(f"cq_runs differs on {args!r}:\nC:  {got}\nPy: {want}")


# ------------------------------------------------------------------ check_records
def _record(body: bytes) -> bytes:
    head = HEADER.pack(HEADER_SIZE + len(body), MSG_MAGIC, 0, 0, 0, 0, 0, 0, 0, 0, len(body), 0, 0, 0, 0)
    crc = zlib.crc32(head[CRC_START:] + body)
    return head[:8] + struct.pack("<I", crc) + head[CRC_START:] + body


@atheris.instrument_func
def _check_records(r: Reader) -> None:
    mode = r.byte()
    magic = MSG_MAGIC if mode & 1 else r.num(0, 2 ** 32 - 1)
    crc_start = CRC_START if mode & 2 else r.num(0, 2 ** 32 - 1)
    if mode & 4:                            # raw chunk and raw sizes
        n = r.byte()
        sizes = r.take(n)
        chunk = r.rest()
    else:                                   # valid records, then damage
        recs = [_record(r.take(r.byte() % 64)) for _ in range(r.byte() % 8)]
        chunk = bytearray(b"".join(recs))
        sz = array("I", [len(x) for x in recs])
        for _ in range(r.byte() % 4):
            what, where = r.byte(), r.num(0, 2 ** 16)
            if what % 4 == 0 and chunk:
                chunk[where % len(chunk)] ^= 1 + r.byte() % 255
            elif what % 4 == 1 and sz:
                sz[where % len(sz)] = r.num(0, 2 ** 32 - 1)
            elif what % 4 == 2:
                del chunk[where % (len(chunk) + 1):]
            else:
                chunk += r.take(r.byte() % 16)
        sizes = sz.tobytes() + r.take(r.byte() % 4)
        chunk = bytes(chunk)
    args = (chunk, sizes, magic, crc_start)
    got = _outcome(C.check_records, *args)
    want = _outcome(fastpath.check_records_py, *args)
    if got != want:
        raise AssertionError(f"check_records differs on {args!r}:\nC:  {got}\nPy: {want}")


# ------------------------------------------------------------------ cq_entries
@atheris.instrument_func
def _size(r: Reader) -> int:
    """A record size as cq_entries may be given one: in range, at its edges, or just past them."""
    k = r.byte() & 7
    if k < 6:
        return (0, 1, 74, 2 ** 32 - 1, 2 ** 32, -1)[k]
    return r.num(0, 5000) if k == 6 else r.num(0, 2 ** 32 - 1)


@atheris.instrument_func
def _cq_entries(r: Reader) -> None:
    sizes = [_size(r) for _ in range(r.byte() % 24)]
    sizes *= (1, 1, 2, 43, 1100)[r.byte() % 5]             # past the reference's 1024-entry bulk pack
    n = len(sizes)
    i0, i1 = r.num(0, n + 3), r.num(0, n + 3)
    phys, tags = r.num(-2, 2 ** 64 + 1), r.num(-2, 2 ** 64 + 1)
    args = (phys, sizes, i0, i1, tags)
    got = _outcome(C.cq_entries, *args)
    want = _outcome(_entries_py, *args)
    if got != want:
        raise AssertionError(f"cq_entries differs on (phys={phys}, {n} sizes, i0={i0}, i1={i1}, tags={tags}):\n"
                             f"C:  {got!r:.300}\nPy: {want!r:.300}")


def _outcome(fn, *args):
    """The result, or "raises" for the refusals tests/store/accel_support.py `outcome` equates
    (struct.error in Python, OverflowError in C); anything else propagates."""
    try:
        return fn(*args)
    except (struct.error, OverflowError):
        return "raises"


# ------------------------------------------------------------------ dispatch_scan
def _dispatch(data: bytes, corrupt: list, chunk: int, max_batch: int, scan, committed: int):
    # struct.error too: less than a blank filler's header left at the segment's end, which the
    # store never writes (record.py MIN_BLANK) and the loop cannot read; the C scan leaves such a
    # tail to the loop, so both raise it
    return run_dispatch(data, corrupt, chunk, max_batch, scan, committed, rounds=200,
                        errors=(RuntimeError, UnicodeDecodeError, struct.error))


_TOPICS = [b"t", b"a/b", "é/x".encode(), b"\xff\xfe", b""]
_NAMES = [b"", b"k", b"k1\x00k2", b"\xc3", b"q\x00"]


@atheris.instrument_func
def _segment(r: Reader) -> tuple[bytes, list]:
    """A CommitLog segment: records built from the input (mostly continuing each other), then
    maybe a blank filler, a bad record or raw bytes; or raw bytes alone."""
    if r.byte() % 8 == 0:
        return r.rest(), []
    out = bytearray()
    corrupt = []
    prev = None
    for i in range(r.byte() % 24):
        f = r.byte()
        if f & 1 and prev is not None:      # the shape of the one before: a run, if the offsets follow
            tb, kb, db, qid, flags, born, sts, tags = prev[:8]
        else:
            tb = _TOPICS[r.byte() % 5] if f & 2 else r.take(r.byte() % 8)
            kb = _NAMES[r.byte() % 5] if f & 4 else b""
            db = _NAMES[r.byte() % 5] if f & 8 else b""
            qid, flags, born, sts, tags = r.byte() % 3, r.byte() % 2, r.num(0, U64), 1, r.num(0, U64)
        body = r.byte() % 32
        pos = len(out)
        g = r.byte()
        if g % 4 == 0:                      # the next queue offset
            qoff = (prev[8] + 1) & U64 if prev else 0
        elif g % 4 == 1 and prev:           # the same one again
            qoff = prev[8]
        else:
            qoff = r.num(0, U64)
        phys = pos if g & 4 == 0 else r.num(0, U64)
        total = HEADER_SIZE + len(tb) + len(kb) + len(db) + body
        if g & 8:                           # a size that lies
            total = r.num(0, 2 ** 32 - 1) if g & 16 else max(0, total + r.byte() - 128)
        magic = MSG_MAGIC
        if g & 32:                          # a blank filler's magic, or any
            magic = BLANK_MAGIC if r.byte() & 1 else r.num(0, 2 ** 32 - 1)
        out += HEADER.pack(total, magic, 0, qid, flags, qoff, phys, born, sts, tags, body, 0, len(tb), len(kb),
                           len(db)) + tb + kb + db + b"x" * body
        if g & 64 and not corrupt:
            corrupt.append((pos, min(len(out), pos + total)))
        prev = (tb, kb, db, qid, flags, born, sts, tags, qoff)
    tail = r.byte() % 4
    if tail == 1:
        out += PREFIX.pack(40, BLANK_MAGIC) + bytes(32)
    elif tail == 2:
        out += PREFIX.pack(12, BLANK_MAGIC) + bytes(4)
    elif tail == 3:
        out += r.rest()
    return bytes(out), corrupt


@atheris.instrument_func
def _dispatch_scan(r: Reader) -> None:
    chunk = (60, 300, 1 << 20, 1)[r.byte() % 4]
    max_batch = (1, 3, 7, 2048)[r.byte() % 4]
    cut = r.byte()
    data, corrupt = _segment(r)
    if not data:
        return
    committed = len(data) if cut >= 200 else len(data) * cut // 200
    if corrupt:                             # a corrupt range is one recovery found in the log
        committed = max(committed, corrupt[0][1])
    want = _dispatch(data, corrupt, chunk, max_batch, None, committed)
    got = _dispatch(data, corrupt, chunk, max_batch, C.dispatch_scan, committed)
    if got != want:
        raise AssertionError(f"dispatch_scan differs on segment {data!r:.2000}, corrupt {corrupt}, chunk {chunk}, "
                             f"max_batch {max_batch}, committed {committed}:\nC:  {got!r:.2000}\nPy: {want!r:.2000}")


# ------------------------------------------------------------------ cq_encode / cq_decode
@atheris.instrument_func
def _cq_block(r: Reader) -> None:
    """A stored ConsumeQueue block: entries encoded by both (the same value, decoded back to the
    entries), or a value from disk - encoded then damaged, or raw bytes - decoded by both: the
    same entries or both refuse with ValueError."""
    entries = _entries(r)
    entries = entries[:len(entries) // 20 * 20]
    be = bool(r.byte() & 2)         # the light-queue index's byte order
    if r.byte() & 1:
        enc = C.cq_encode(entries, be)
        if enc != encode_block_py(entries, be) or C.cq_decode(enc, 0, -1, be) != entries:
            raise AssertionError(f"cq_encode differs or loses entries on {entries!r}")
        value = bytearray(enc)
        for _ in range(r.byte() % 4):
            what, where = r.byte(), r.num(0, 2 ** 16)
            if what % 3 == 0 and value:
                value[where % len(value)] ^= 1 + r.byte() % 255
            elif what % 3 == 1:
                del value[where % (len(value) + 1):]
            else:
                value += r.take(r.byte() % 4)
        value = bytes(value)
    else:
        value = r.rest()
    start, stop = r.num(0, 5000) - 5, r.num(0, 5000) - 5
    got = _decoded(C.cq_decode, value, start, stop, be)
    want = _decoded(decode_block_py, value, start, stop, be)
    if got != want:
        raise AssertionError(f"cq_decode differs on {value!r} [{start}:{stop}]:\nC:  {got!r}\nPy: {want!r}")


def _decoded(fn, *args):
    try:
        return fn(*args)
    except ValueError:
        return "refused"


ENTRIES = [_cq_runs, _check_records, _cq_entries, _dispatch_scan, _cq_block]


def TestOneInput(data: bytes) -> None:
    r = Reader(data)
    ENTRIES[r.byte() % len(ENTRIES)](r)


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
