"""atheris harness for the SDK's C decode of raw MESSAGES replies (store/client/_records.c, which
reads the bytes a store server sends) against its reference, the Python loop of
`records.records_raw` (run with `_C_RECORDS` set to None, as tests/store/test_fastpath.py does):
the same header and Records (field by field, and of type Record), or both raise ProtocolError
with the same code; nothing else may escape either. Bodies are built from the input: a JSON
header, a record count that may lie, CommitLog records with fuzzer-chosen fields (topics and keys
not always UTF-8, sizes that lie, truncation, trailing bytes), or raw bytes; the ident is the
store's 16 hex digits, empty, None, or any ASCII up to the C's 100 characters.

Run for a bounded time by tests/fuzz/test_fuzz_harnesses.py; the long run's command and result
are in BENCHMARKS.md.

    python3 tests/fuzz/fuzz_records.py -max_total_time=600 [CORPUS_DIR]
"""
from __future__ import annotations

import struct
import sys

import atheris
from fuzz_input import Reader

with atheris.instrument_imports(include=["lmqtt"]):
    from lmqtt.store import protocol as W
    from lmqtt.store.client import records
    from lmqtt.store.record import HEADER, HEADER_SIZE, MSG_MAGIC

C = records._C_RECORDS
if C is None:
    sys.exit("lmqtt.store.client._records is not built (or LMQTT_PURE_PYTHON is set): nothing to fuzz")

U64 = 2 ** 64 - 1
_TOPICS = [b"t", b"a/b", "ü/ñ".encode(), b"t\xffx", b""]
_KEYS = [b"", b"k", b"k1\x00k2", b"\xc3", b"\x00"]
_HEADERS = [b"", b'{"next_offset": 7, "min_offset": 0}', b"{}", b"[1, 2]", b"{", b'"\xff"']


# the functions that turn the input into choices are instrumented too (@atheris.instrument_func): their
# branches guide the fuzzer to every kind of input, not only to new paths of the reference
@atheris.instrument_func
def _record(r: Reader, prev: bytes | None) -> bytes:
    f = r.byte()
    if f & 1 and prev is not None:          # the one before again (its topic and props shared)
        return prev
    tb = _TOPICS[r.byte() % 5] if f & 2 else r.take(r.byte() % 8)
    kb = _KEYS[r.byte() % 5] if f & 4 else b""
    db = r.take(r.byte() % 4) if f & 8 else b""
    pb = r.take(r.byte() % 8)
    body = r.take(r.byte() % 24)
    total = HEADER_SIZE + len(tb) + len(kb) + len(db) + len(pb) + len(body)
    if f & 16:                              # a size that lies
        total = r.num(0, 2 ** 32 - 1) if f & 32 else max(0, total + r.byte() - 128)
    return HEADER.pack(total, MSG_MAGIC, 0, r.num(0, 2 ** 32 - 1), 0, r.num(0, U64), r.num(0, U64), r.num(0, U64),
                       r.num(0, U64), 0, len(body), len(pb), len(tb), len(kb), len(db)) + tb + kb + db + pb + body


@atheris.instrument_func
def _body(r: Reader) -> bytes:
    mode = r.byte()
    if mode % 8 == 0:
        return r.rest()
    header = _HEADERS[r.byte() % len(_HEADERS)]
    recs: list[bytes] = []
    for _ in range(r.byte() % 12):
        recs.append(_record(r, recs[-1] if recs else None))
    count = len(recs) + (0, 0, 1, -1, 1000, 2 ** 32 - 1 - len(recs))[r.byte() % 6]
    out = struct.pack(">I", len(header)) + header + struct.pack(">I", max(0, count)) + b"".join(recs)
    if mode & 8:
        out = out[:r.num(0, len(out))]
    if mode & 16:
        out += r.take(r.byte() % 16)
    return out


@atheris.instrument_func
def _ident(r: Reader):
    k = r.byte() % 4
    if k == 0:
        return "0123456789ABCDEF"
    if k == 1:
        return None
    if k == 2:
        return ""
    return "".join(chr(32 + b % 95) for b in r.take(r.byte() % 101))


def _decode(ident, body: bytes, c):
    records._C_RECORDS = c
    try:
        header, recs = records.records_raw(ident, body)
        return "ok", header, [(type(x), tuple(x)) for x in recs]
    except W.ProtocolError as e:
        return "ProtocolError", e.code
    finally:
        records._C_RECORDS = C


def TestOneInput(data: bytes) -> None:
    r = Reader(data)
    ident = _ident(r)
    body = _body(r)
    got = _decode(ident, body, C)
    want = _decode(ident, body, None)
    if got != want:
        raise AssertionError(f"C decode and records_raw differ on ident {ident!r}, body {body!r:.3000}:\n"
                             f"C:  {got!r:.2000}\nPy: {want!r:.2000}")


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
