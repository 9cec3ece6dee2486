"""atheris harness for a gateway's C decode of the records a store pushes (store/_append.c
`decode_runs`, which reads the bytes of an OP_PUSH_RAW frame from the store) against its
reference, gateway/storage/remote_entries.py `decode_raw_entries_py`: the same StoredMessages
(field by field, and of type StoredMessage) or both None; nothing else may escape either. Frames
are built from the input through store/protocol.py `encode_push_raw` and `decode_push_raw` (what
the gateway's link does with a frame): runs of CommitLog records with fuzzer-chosen fields (topics,
keys and queues not always UTF-8, CRCs, offsets and sizes that lie), record sizes that lie, runs
at offsets near 2**63, and bytes of the frame flipped after its head was read.

Run for a bounded time by tests/fuzz/test_fuzz_harnesses.py; the long run's command and result
are in BENCHMARKS.md.

    python3 tests/fuzz/fuzz_pushed.py -max_total_time=600 [CORPUS_DIR]
"""
from __future__ import annotations

import sys
import zlib

import atheris
from fuzz_input import Reader

with atheris.instrument_imports(include=["lmqtt"]):
    from lmqtt.gateway.storage.remote_entries import MAX_RUN_PHYS, decode_raw_entries_py
    from lmqtt.store import protocol as W
    from lmqtt.store.message import StoredMessage
    from lmqtt.store.record import CRC_START, HEADER, HEADER_SIZE, MSG_MAGIC, c_decode_runs

if c_decode_runs is None:
    sys.exit("lmqtt.store._append is not built (or LMQTT_PURE_PYTHON is set): nothing to fuzz")

U32, U64 = 2 ** 32 - 1, 2 ** 64 - 1
_TEXT = [b"t", b"a/b", "ü/ñ".encode(), b"t\xffx", b"", b"k1\x00k2", b"\x00"]


@atheris.instrument_func
def _record(r: Reader, phys: int, prev: bytes | None) -> bytes:
    f = r.byte()
    if f & 1 and prev is not None:          # the one before again (shared topic and props; a wrong phys)
        return prev
    tb = _TEXT[r.byte() % len(_TEXT)] if f & 2 else r.take(r.byte() % 6)
    kb = _TEXT[r.byte() % len(_TEXT)] if f & 4 else b""
    db = _TEXT[r.byte() % len(_TEXT)] if f & 8 else b""
    pb = r.take(r.byte() % 6)
    body = r.take(r.byte() % 20)
    total = HEADER_SIZE + len(tb) + len(kb) + len(db) + len(pb) + len(body)
    if f & 16:                              # a size that lies
        total = r.num(0, U32) if f & 32 else max(0, min(U32, total + r.byte() - 128))
    stored = phys if not f & 64 else r.num(0, U64)
    rec = HEADER.pack(total, MSG_MAGIC if r.byte() else r.num(0, U32), 0, r.num(0, U32), r.num(0, U32),
                      r.num(0, U64), stored & U64, r.num(0, U64), r.num(0, U64), 0, len(body), len(pb), len(tb),
                      len(kb), len(db)) + tb + kb + db + pb + body
    crc = zlib.crc32(rec[CRC_START:]) if not f & 128 else r.num(0, U32)
    return rec[:8] + crc.to_bytes(4, "little") + rec[12:]


@atheris.instrument_func
def _frame(r: Reader):
    runs, sizes = [], []
    phys = [0, 4096, MAX_RUN_PHYS - 200, MAX_RUN_PHYS, 2 ** 63 - 100, U64 - 300][r.byte() % 6] + r.byte()
    prev = None
    for _ in range(r.byte() % 4):
        recs = []
        for _ in range(r.byte() % 5):
            rec = _record(r, phys + sum(len(x) for x in recs), prev)
            recs.append(rec)
            prev = rec
        chunk = b"".join(recs)
        runs.append((phys & U64, len(recs), chunk))
        sizes += [len(x) for x in recs]
        phys += len(chunk) + (r.byte() if r.byte() & 1 else 0)
    k = r.byte()
    if k & 1 and sizes:                     # sizes that lie (the runs' byte counts still add up)
        i = r.byte() % len(sizes)
        j = r.byte() % len(sizes)
        d = min(sizes[i], r.byte())
        sizes[i] -= d
        sizes[j] += d
    body = b"".join(W.encode_push_raw([("q", 0, r.num(0, U64), runs, sizes)]))
    try:
        [(_name, _mx, first, spans, got_sizes)] = W.decode_push_raw(body)
    except W.ProtocolError:
        return None
    if k & 2 and body:                      # bytes changed after the head was read
        b = bytearray(body)
        for _ in range(1 + r.byte() % 3):
            b[r.num(0, len(b) - 1)] ^= r.byte() | 1
        body = bytes(b)
    if k & 4 and spans:                     # a run whose bounds lie
        i = r.byte() % len(spans)
        p, c, s, e = spans[i]
        spans[i] = (p, c, max(0, s + r.byte() - 128), max(0, e + r.byte() - 128))
    return body, spans, got_sizes, first


def _ident(r: Reader) -> str:
    return ["0123456789ABCDEF", "", "ü"][r.byte() % 3]


def _decode(fn, body, spans, sizes, first, ident):
    out = fn(memoryview(body), spans, sizes, first, ident)
    if out is None:
        return None
    assert all(type(m) is StoredMessage for m in out), out
    return [tuple(m) for m in out]


def TestOneInput(data: bytes) -> None:
    r = Reader(data)
    ident = _ident(r)
    case = _frame(r)
    if case is None:
        return
    got = _decode(c_decode_runs, *case, ident)
    want = _decode(decode_raw_entries_py, *case, ident)
    if got != want:
        raise AssertionError(f"decode_runs and decode_raw_entries_py differ on {case!r:.3000}:\n"
                             f"C:  {got!r:.2000}\nPy: {want!r:.2000}")


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
