"""The C loops of the store's raw pull (store/_fastpath.c) against their Python references in
store/fastpath.py, on arbitrary input: ConsumeQueue entries grouped into runs of adjacent records
(unwritten entries, the visibility limit, the byte limit), and the size/magic/CRC check of
records back to back (valid, damaged, truncated, nonsense), and the ConsumeQueue entries of a run
of records (`cq_entries` against store/consume_queue_entries.py `_entries_py`, and a store's dispatch going
through it). The raw pull itself, with the C loops
and with the references, is compared with the decoding path in test_fastpath.py."""
from __future__ import annotations

import os
import struct
import zlib
from array import array
from itertools import accumulate

import pytest
from hypothesis import given, settings, strategies as st

from lmqtt.store import accel, fastpath
from lmqtt.store.consume_queue import ENTRY, ENTRY_FIELDS
from lmqtt.store.record import CRC_START, HEADER_FIELDS, MSG_MAGIC
from tests.store.accel_support import outcome, run_unconfigured, swapped

_C = accel.load("lmqtt.store._fastpath")
needs_c = pytest.mark.skipif(_C is None, reason="lmqtt.store._fastpath not built (or LMQTT_PURE_PYTHON set)")


@pytest.mark.skipif(os.environ.get("LMQTT_PURE_PYTHON", "") not in ("", "0"),
                    reason="LMQTT_PURE_PYTHON is set: the C loops are off on purpose")
def test_the_c_loops_are_built_and_used():
    assert _C is not None, "lmqtt.store._fastpath was not built: `pip install -e .` needs a C compiler and zlib"
    assert fastpath._cq_runs is _C.cq_runs and fastpath._check_records is _C.check_records


entries = st.lists(st.tuples(st.integers(0, 5000), st.sampled_from([0, 1, 50, 74, 100, 300, 5000]),
                             st.integers(0, 2 ** 64 - 1)), max_size=60)


def _piece(es, adjacent_from=None, big=False):
    """Entries as stored (`big`: as the light-queue index stores them); with `adjacent_from`, most
    follow each other in the CommitLog."""
    pack = fastpath.BIG_ENDIAN_ENTRY.pack if big else ENTRY.pack
    out = []
    phys = adjacent_from
    for p, size, tags in es:
        if adjacent_from is not None and p % 4:
            p = phys
        out.append(pack(p, size, tags))
        phys = p + size
    return b"".join(out)


@needs_c
@settings(max_examples=400, deadline=None)
@given(es=entries, adjacent=st.booleans(), first=st.integers(0, 10 ** 6), visible=st.integers(0, 8000),
       max_bytes=st.sampled_from([0, 1, 100, 400, 10 ** 6]), count=st.integers(0, 3), total=st.integers(0, 500),
       tail=st.binary(max_size=19), big=st.booleans())
def test_cq_runs_equals_its_reference(es, adjacent, first, visible, max_bytes, count, total, tail, big):
    piece = _piece(es, 0 if adjacent else None, big) + tail
    assert _C.cq_runs(piece, first, visible, max_bytes, count, total, big) == \
        fastpath.cq_runs_py(piece, first, visible, max_bytes, count, total, big)
    if not big:         # the default byte order is the ConsumeQueue's
        assert _C.cq_runs(piece, first, visible, max_bytes, count, total) == \
            _C.cq_runs(piece, first, visible, max_bytes, count, total, False)


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


# ------------------------------------------------------------------ the layout handed to the C loops
@pytest.fixture
def c_mod():
    yield _C
    fastpath.configure_c(_C)        # whatever a test did, leave the module configured as at import


@needs_c
@pytest.mark.parametrize("change,words", [
    ({"cq_entry_format": "<QQQ"}, r"ConsumeQueue entry field 1 \(size\) is 8 bytes at offset 8"),
    ({"cq_entry_format": "<IQQ"}, r"ConsumeQueue entry field 0 \(phys_offset\) is 4 bytes"),
    ({"cq_entry_format": "<QIQI"}, "ConsumeQueue entry format <QIQI has 4 fields"),
    ({"cq_entry_format": ">QIQ"}, "not little-endian"),
    ({"cq_entry_size": 24}, "cq_entry_size 24"),
    # two fields of one width swapped: the offsets agree, the names do not
    ({"cq_entry_fields": swapped(ENTRY_FIELDS, "phys_offset", "tags_code")},
     "ConsumeQueue entry field 0 is 'tags_code', these loops read phys_offset there"),
    ({"cq_entry_fields": ENTRY_FIELDS[:-1]}, "ConsumeQueue entry has 2 field names, these loops read 3"),
    ({"cq_entry_fields": None}, "no tuple of ConsumeQueue entry field names"),
    ({"record_header_format": "<QIIIIQQQQQIIHHH"}, r"record header field 0 \(total_size\)"),
    ({"record_header_format": "<IIHIIQQQQQIIHHH"}, r"record header field 2 \(crc\) is 2 bytes"),
    ({"record_header_format": "<II"}, "has 2 fields, these loops read 15"),
    ({"record_header_format": None}, "layout has no str record_header_format"),
    ({"record_header_fields": swapped(HEADER_FIELDS, "total_size", "magic")},
     "record header field 0 is 'magic', these loops read total_size there"),
    ({"record_header_fields": ("total_size", "magic")}, "record header has 2 field names"),
    ({"record_header_fields": None}, "no tuple of record header field names"),
])
def test_the_c_loops_refuse_a_layout_they_do_not_read(c_mod, change, words):
    with pytest.raises(ValueError, match=words):
        fastpath.configure_c(c_mod, {**fastpath.C_LAYOUT, **change})
    piece = ENTRY.pack(0, 50, 0)
    with pytest.raises(RuntimeError, match="configure"):        # unusable until configured again
        c_mod.cq_runs(piece, 0, 100, 0, 0, 0)
    with pytest.raises(RuntimeError, match="configure"):
        c_mod.check_records(_record(b"x"), array("I", [13]).tobytes(), MSG_MAGIC, CRC_START)
    with pytest.raises(RuntimeError, match="configure"):
        c_mod.cq_entries(0, [13], 0, 1, 0)
    fastpath.configure_c(c_mod)
    assert c_mod.cq_runs(piece, 0, 100, 0, 0, 0)[1] == 1


def test_the_layout_handed_over_is_the_stores():
    from lmqtt.store.consume_queue import ENTRY_SIZE
    from lmqtt.store.message import DispatchRequest
    from lmqtt.store.record import HEADER, SEP
    assert fastpath.C_LAYOUT == {"cq_entry_format": ENTRY.format, "cq_entry_fields": ENTRY_FIELDS,
                                 "cq_entry_size": ENTRY_SIZE,
                                 "record_header_format": HEADER.format, "record_header_fields": HEADER_FIELDS,
                                 "dispatch_request": DispatchRequest, "sep": SEP, "msg_magic": MSG_MAGIC}


@needs_c
def test_an_unconfigured_module_refuses_to_run():
    for call in ("m.cq_runs(bytes(20), 0, 1, 0, 0, 0)", "m.check_records(b'', b'', 0, 12)",
                 "m.cq_entries(0, [1], 0, 1, 0)",
                 "m.dispatch_scan(b'', 0, 1, 1, -1, 1, [], [], [], {}, {}, ())"):
        assert "lmqtt.store._fastpath.configure() was not called" in run_unconfigured("lmqtt.store._fastpath", call)
    assert run_unconfigured("lmqtt.store._fastpath", "m.configure(__import__('lmqtt.store.fastpath', fromlist=['C_LAYOUT']).C_LAYOUT); m.cq_runs(bytes(20), 0, 1, 0, 0, 0)") \
        == "ran"


# ------------------------------------------------------------------ cq_entries (store/consume_queue_entries.py _entries)

@st.composite
def cq_runs_of_sizes(draw):
    from lmqtt.store.consume_queue_entries import _BULK_MAX
    base = draw(st.lists(st.one_of(st.integers(0, 2 ** 32 - 1), st.integers(1, 400)), max_size=30))
    sizes = base * draw(st.sampled_from([1, 1, 2, 40, _BULK_MAX // 3 + 1]))    # past _BULK_MAX too
    n = len(sizes)
    i0 = draw(st.integers(-3, n))                                       # < 0: clamped, not from the end
    i1 = draw(st.one_of(st.integers(-3, n + 3), st.just(n)))            # i1 <= i0: an empty range
    phys = draw(st.one_of(st.integers(0, 2 ** 63), st.integers(0, 10_000)))
    return phys, sizes, i0, i1, draw(st.integers(0, 2 ** 64 - 1))


@needs_c
@settings(max_examples=300, deadline=None)
@given(cq_runs_of_sizes())
def test_cq_entries_equals_its_reference(run):
    from lmqtt.store.consume_queue_entries import _entries_py
    phys, sizes, i0, i1, tags = run
    got = outcome(_C.cq_entries, phys, sizes, i0, i1, tags)
    assert got == outcome(_entries_py, phys, sizes, i0, i1, tags)
    if got != "raises":     # and both are the entries packed one by one, [i0, i1) clamped to the list
        part = sizes[max(i0, 0):max(min(i1, len(sizes)), 0)]
        offs = list(accumulate(part, initial=phys))
        assert got == b"".join(ENTRY.pack(p, s, tags) for p, s in zip(offs, part))


@needs_c
@pytest.mark.parametrize("phys,sizes", [(2 ** 64 - 10, [5, 5]), (2 ** 64 - 10, [5, 5, 5]), (2 ** 64 - 1, [1]),
                                        (0, [2 ** 32 - 1] * 3)])
def test_cq_entries_at_the_edge_of_64_bits(phys, sizes):
    from lmqtt.store.consume_queue_entries import _entries_py
    c = outcome(_C.cq_entries, phys, sizes, 0, len(sizes), 2 ** 64 - 1)
    assert c == outcome(_entries_py, phys, sizes, 0, len(sizes), 2 ** 64 - 1)


@needs_c
def test_cq_entries_by_hand_and_its_refusals():
    assert _C.cq_entries(1000, [7, 100, 200, 9], 1, 3, 5) == ENTRY.pack(1000, 100, 5) + ENTRY.pack(1100, 200, 5)
    assert _C.cq_entries(1000, [7, 100], 2, 2, 5) == b""
    with pytest.raises(TypeError, match="sizes must be ints"):
        _C.cq_entries(0, [1, 2.0], 0, 2, 0)
    with pytest.raises(OverflowError, match="32 bits"):
        _C.cq_entries(0, [2 ** 32], 0, 1, 0)


@pytest.mark.skipif(os.environ.get("LMQTT_PURE_PYTHON", "") not in ("", "0"),
                    reason="LMQTT_PURE_PYTHON is set: the C loops are off on purpose")
def test_the_consume_queue_packs_its_entries_in_c_when_built():
    from lmqtt.store import consume_queue_entries
    assert fastpath.cq_entries is _C.cq_entries and consume_queue_entries._entries is _C.cq_entries


@needs_c
def test_a_stores_dispatch_of_runs_goes_through_cq_entries(tmp_path, monkeypatch):
    """Records of one queue appended together reach the ConsumeQueue dispatcher as runs, whose
    entries `_entries` packs: with the extension built, the C cq_entries (a replica's dispatch,
    which parses its CommitLog, builds the same runs: tests/ha/test_log_shipping_runs.py)."""
    from lmqtt.store import Message, MessageStore, StoreConfig, consume_queue_entries
    calls = []

    def counting(*a):
        calls.append(a[3] - a[2])
        return _C.cq_entries(*a)

    monkeypatch.setattr(consume_queue_entries, "_entries", counting)
    s = MessageStore(StoreConfig(data_dir=str(tmp_path / "d"), flush_mode="async", dispatch_from_memory=False))
    s.start()
    try:
        rs = s.append_batch([Message("t/1", b"x%d" % i) for i in range(300)])
        rs += s.append_batch([Message("t/1", b"y%d" % i, queue_id=i % 2) for i in range(40)])
        assert s.wait_dispatched(s.clog.wrote, 20)
        assert calls and max(calls) > 1, "the ConsumeQueue dispatch did not pack a run with cq_entries"
        for qid in (0, 1):
            got = s.read_consume_queue("t/1", qid, 0, 1000)
            want = [r for r, m in zip(rs, [None] * 300 + list(range(40))) if (m is None and qid == 0)
                    or (m is not None and m % 2 == qid)]
            assert [(m.phys_offset, m.queue_offset) for m in got] == [(r.phys_offset, r.queue_offset) for r in want]
    finally:
        s.shutdown()


@needs_c
def test_cq_runs_does_not_continue_a_run_whose_record_ends_past_64_bits():
    """An entry (from a damaged ConsumeQueue file) whose record ends past 2**64, followed by one
    at the wrapped-around end: not adjacent (the reference computes the end exactly), so two runs;
    the C loop once joined them on its 64-bit sum."""
    piece = ENTRY.pack(2 ** 64 - 34, 5000, 0) + ENTRY.pack(4966, 100, 0) + ENTRY.pack(5066, 7, 0)
    want = ([[2 ** 64 - 34, array("I", [5000]).tobytes(), 5000], [4966, array("I", [100, 7]).tobytes(), 107]],
            3, 5107, 3, False)
    assert fastpath.cq_runs_py(piece, 0, 2 ** 64 - 1, 0, 0, 0) == want
    assert _C.cq_runs(piece, 0, 2 ** 64 - 1, 0, 0, 0) == want
