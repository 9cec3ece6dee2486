"""atheris harness for the Spark reader's C walk of MESSAGES replies (store/spark/_columns.c
`columns` and `columns_raw`, which read the bytes a store server sends) against their references
`columns_py` and `columns_raw_py` (store/spark/columns.py): the same twelve column buffers byte
for byte, or both raise ValueError (the message may differ), as tests/spark/test_columns.py
compares them; nothing else may escape either. Bodies in either layout (REC_HEAD records, or
CommitLog records for the raw one) are built from the input with fuzzer-chosen fields, lengths
that lie, truncation and trailing bytes, or are raw; the start, the count and the ident (any
bytes) are the input's too.

Run for a bounded time by tests/fuzz/test_fuzz_harnesses.py; the long run's command and result
are in BENCHMARKS.md.

    python3 tests/fuzz/fuzz_columns.py -max_total_time=600 [CORPUS_DIR]
"""
from __future__ import annotations

import struct
import sys

import atheris
from fuzz_input import Reader

with atheris.instrument_imports(include=["lmqtt"]):
    from lmqtt.store import protocol as W
    from lmqtt.store.record import HEADER, HEADER_SIZE, MSG_MAGIC
    from lmqtt.store.spark import columns

C = columns._C
if C is None:
    sys.exit("lmqtt.store.spark._columns is not built (or LMQTT_PURE_PYTHON is set): nothing to fuzz")

U64 = 2 ** 64 - 1


# the functions that turn the input into choices are instrumented too (@atheris.instrument_func): their
# branches guide the fuzzer to every kind of input, not only to new paths of the reference
@atheris.instrument_func
def _record(r: Reader, raw: bool) -> bytes:
    f = r.byte()
    tb = r.take(r.byte() % 8)
    kb = r.take(r.byte() % 6)
    db = r.take(r.byte() % 4) if raw else b""
    pb = r.take(r.byte() % 8)
    body = r.take(r.byte() % 24)
    lens = [len(tb), len(kb), len(db), len(pb), len(body)]
    if f & 1:                               # one length that lies
        lens[r.byte() % 5] = r.num(0, 2 ** 16 - 1 if f & 2 else 2 ** 32 - 1)
    tl, kl, dl, pl, bl = lens
    q, p, born, st = r.num(0, U64), r.num(0, U64), r.num(0, U64), r.num(0, U64)
    if raw:
        total = HEADER_SIZE + len(tb) + len(kb) + len(db) + len(pb) + len(body)
        if f & 4:
            total = r.num(0, 2 ** 32 - 1)
        head = HEADER.pack(total, MSG_MAGIC, 0, 0, 0, q, p, born, st, 0, bl, pl, min(tl, 0xFFFF), min(kl, 0xFFFF),
                           min(dl, 0xFFFF))
    else:
        head = W.REC_HEAD.pack(q, p, born, st, 0, min(tl, 0xFFFF), min(kl, 0xFFFF), min(pl, 0xFFFF), bl)
    return head + tb + kb + db + pb + body


@atheris.instrument_func
def _case(r: Reader):
    mode = r.byte()
    raw = bool(mode & 1)
    if mode & 2:                            # raw bytes, start and count from the input
        body = r.rest()
        return raw, body, r.num(-2, len(body) + 2), r.num(-2, 40), b"ID"
    ident = r.take(r.byte() % 24)
    header = b'{"next_offset": 3}' if mode & 4 else b""
    recs = [_record(r, raw) for _ in range(r.byte() % 10)]
    count = len(recs) + (0, 0, 1, -1, 2 ** 32 - 1, 2 ** 62)[r.byte() % 6]
    body = struct.pack(">I", len(header)) + header + struct.pack(">I", max(0, count) & 0xFFFFFFFF) + b"".join(recs)
    pos = 8 + len(header)
    if mode & 8:
        body = body[:r.num(0, len(body))]
    if mode & 16:
        body += r.take(r.byte() % 16)
    if mode & 32:
        pos = r.num(-2, len(body) + 2)
    return raw, body, pos, count, ident


def _walk(fn, body: bytes, pos: int, count: int, ident: bytes):
    try:
        return fn(body, pos, count, ident)
    except ValueError:
        return "ValueError"


def TestOneInput(data: bytes) -> None:
    raw, body, pos, count, ident = _case(Reader(data))
    c_fn, py_fn = (C.columns_raw, columns.columns_raw_py) if raw else (C.columns, columns.columns_py)
    got = _walk(c_fn, body, pos, count, ident)
    want = _walk(py_fn, body, pos, count, ident)
    if got != want:
        raise AssertionError(f"{c_fn.__name__} and its reference differ on body {body!r:.3000}, pos {pos}, "
                             f"count {count}, ident {ident!r}:\nC:  {got!r:.2000}\nPy: {want!r:.2000}")


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
