"""The C loops of the store's raw pull (store/_fastpath.c) against their Python references in
store/fastpath.py, on arbitrary input: ConsumeQueue entries grouped into runs of adjacent records
(unwritten entries, the visibility limit, the byte limit), and the size/magic/CRC check of
records back to back (valid, damaged, truncated, nonsense). Then the raw pull itself, with the C
loops and with the references, on a real MessageStore: the same records as the decoding path."""
from __future__ import annotations

import os
import struct
import zlib
from array import array

import pytest
from hypothesis import given, settings, strategies as st

from lmqtt.store import accel, fastpath
from lmqtt.store.consume_queue import ENTRY
from lmqtt.store.record import CRC_START, MSG_MAGIC

_C = accel.load("lmqtt.store._fastpath")
needs_c = pytest.mark.skipif(_C is None, reason="lmqtt.store._fastpath not built (or LMQTT_PURE_PYTHON set)")


@pytest.mark.skipif(os.environ.get("LMQTT_PURE_PYTHON", "") not in ("", "0"),
                    reason="LMQTT_PURE_PYTHON is set: the C loops are off on purpose")
def test_the_c_loops_are_built_and_used():
    assert _C is not None, "lmqtt.store._fastpath was not built: `pip install -e .` needs a C compiler and zlib"
    assert fastpath._cq_runs is _C.cq_runs and fastpath._check_records is _C.check_records


entries = st.lists(st.tuples(st.integers(0, 5000), st.sampled_from([0, 1, 50, 74, 100, 300, 5000]),
                             st.integers(0, 2 ** 64 - 1)), max_size=60)


def _piece(es, adjacent_from=None):
    """Entries as stored; with `adjacent_from`, most follow each other in the CommitLog."""
    out = []
    phys = adjacent_from
    for p, size, tags in es:
        if adjacent_from is not None and p % 4:
            p = phys
        out.append(ENTRY.pack(p, size, tags))
        phys = p + size
    return b"".join(out)


@needs_c
@settings(max_examples=400, deadline=None)
@given(es=entries, adjacent=st.booleans(), first=st.integers(0, 10 ** 6), visible=st.integers(0, 8000),
       max_bytes=st.sampled_from([0, 1, 100, 400, 10 ** 6]), count=st.integers(0, 3), total=st.integers(0, 500),
       tail=st.binary(max_size=19))
def test_cq_runs_equals_its_reference(es, adjacent, first, visible, max_bytes, count, total, tail):
    piece = _piece(es, 0 if adjacent else None) + tail
    assert _C.cq_runs(piece, first, visible, max_bytes, count, total) == \
        fastpath.cq_runs_py(piece, first, visible, max_bytes, count, total)


def _record(body: bytes, magic: int = MSG_MAGIC) -> bytes:
    size = 12 + len(body)
    head = struct.pack("<II", size, magic)
    crc = zlib.crc32(body)                  # CRC over [CRC_START, size): the body here
    return head + struct.pack("<I", crc) + body


def test_synthetic_records_have_the_stores_crc_start():
    assert CRC_START == 12          # _record above puts the CRC'd bytes right after the 12-byte head


records = st.lists(st.binary(min_size=0, max_size=200), min_size=0, max_size=20)


@needs_c
@settings(max_examples=400, deadline=None)
@given(bodies=records, damage=st.sampled_from(["none", "flip", "size", "magic", "truncate", "sizes"]),
       where=st.integers(0, 10 ** 6), junk=st.binary(max_size=40))
def test_check_records_equals_its_reference(bodies, damage, where, junk):
    recs = [_record(b) for b in bodies]
    chunk = bytearray(b"".join(recs))
    sizes = array("I", [len(r) for r in recs])
    if damage == "flip" and chunk:
        chunk[where % len(chunk)] ^= 0x5A
    elif damage == "size" and sizes:
        sizes[where % len(sizes)] += 1 + where % 7
    elif damage == "magic" and recs:
        i = where % len(recs)
        a = sum(sizes[:i])
        chunk[a + 4:a + 8] = struct.pack("<I", MSG_MAGIC ^ 1)
    elif damage == "truncate" and chunk:
        del chunk[where % len(chunk):]
    elif damage == "sizes":
        chunk = bytearray(junk)
    for args in ((bytes(chunk), sizes.tobytes(), MSG_MAGIC, CRC_START),
                 (bytes(chunk), sizes.tobytes() + b"\x01", MSG_MAGIC, CRC_START)):
        got = _C.check_records(*args)
        assert got == fastpath.check_records_py(*args)
    if damage == "none":
        assert _C.check_records(bytes(chunk), sizes.tobytes(), MSG_MAGIC, CRC_START) is True


@pytest.mark.parametrize("loops", ["c", "python"])
def test_raw_pull_with_either_loops_gives_the_records_of_the_decoding_path(tmp_path, monkeypatch, loops):
    """Records of queue `a` interleaved with other queues over several 64 KiB segments: every
    raw pull decodes to the records the decoding path gives (the same check as test_fastpath.py,
    here for the store-side loops)."""
    import random

    from lmqtt.store import Message, MessageStore
    from lmqtt.store.client import consumer
    from tests.store.test_fastpath import IDENT, cfg, classic, random_items, raw_reply, route
    if loops == "c":
        if _C is None:
            pytest.skip("lmqtt.store._fastpath not built")
        monkeypatch.setattr(fastpath, "_cq_runs", _C.cq_runs)
        monkeypatch.setattr(fastpath, "_check_records", _C.check_records)
    else:
        monkeypatch.setattr(fastpath, "_cq_runs", fastpath.cq_runs_py)
        monkeypatch.setattr(fastpath, "_check_records", fastpath.check_records_py)
    rng = random.Random(5)
    with MessageStore(cfg(tmp_path)) as s:
        last = None
        for _ in range(40):
            items = random_items(rng, rng.randrange(1, 60))
            rs = s.append_batch([Message(t, b, q, 0, p, k, born, route(t)) for t, b, k, p, q, born in items])
            last = rs[-1]
        assert s.wait_dispatched(last.phys_offset + last.size, 10)
        for qid in range(3):
            lo, hi = s.consume_queue_offsets("a", qid)
            for off, cnt, mb in ((lo, 10_000, 0), (lo + 3, 7, 0), (hi - 2, 100, 0), (lo, 1000, 1500), (lo, 1000, 1)):
                want, want_next = classic(s, "a", qid, off, cnt, mb)
                body, nxt = raw_reply(s, "a", qid, off, cnt, mb)
                assert consumer._records_raw(IDENT, body)[1] == want and nxt == want_next
        # a flipped byte: the raw path declines the range (the decoding path reports and skips it)
        lo, _hi = s.consume_queue_offsets("a", 0)
        victim = s.read_consume_queue("a", 0, lo + 2, 1)[0]
        mf = s.clog.mfq.find(victim.phys_offset)
        mf.mm[victim.phys_offset - mf.start_offset + victim.size - 1] ^= 0xFF
        assert fastpath.read_raw(s, "a", 0, lo, 100, 0) is None
        assert fastpath.read_raw(s, "a", 0, lo + 3, 100, 0) is not None
