"""A ConsumeQueue block as the database stores it (store/consume_queue_entries.py "stored blocks"):
the C encoder and decoder (store/_fastpath.c cq_encode / cq_decode) against their Python
references on arbitrary entries and on damaged values, and the store reading blocks of both
forms - those written before the encoding (raw) and encoded ones - as the same entries."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings, strategies as st

from lmqtt.store import accel, consume_queue_entries as cqe, fastpath  # noqa: F401 - fastpath configures _C
from lmqtt.store.consume_queue import ConsumeQueueStore, queue_key
from lmqtt.store.consume_queue_entries import ENTRY, ENTRY_SIZE, block_count, decode_block_py, encode_block_py
from lmqtt.store.errors import StoreError
from lmqtt.store.message import DispatchRequest

_C = accel.load("lmqtt.store._fastpath")
needs_c = pytest.mark.skipif(_C is None, reason="lmqtt.store._fastpath not built (or LMQTT_PURE_PYTHON set)")
M64 = 2 ** 64 - 1
ENTRY_BE = struct.Struct(">QIQ")        # the light-queue index's entries


@st.composite
def blocks(draw, be=False):
    """Entries as a queue holds them: mostly runs of records back to back with one tag (a busy
    topic), a fixed distance apart, gaps (all-zero entries), and anything at all, near 2**64 too."""
    out = []
    phys = draw(st.one_of(st.integers(0, 10 ** 9), st.integers(M64 - 10 ** 4, M64)))
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(["run", "run", "spaced", "gap", "any"]))
        n = draw(st.integers(1, 300))
        size = draw(st.sampled_from([1, 100, 187, 2 ** 32 - 1]))
        tag = draw(st.sampled_from([0, 7, M64, 0xDEADBEEF]))
        if kind == "any":
            for _ in range(min(n, 5)):
                out.append((draw(st.integers(0, M64)), draw(st.integers(0, 2 ** 32 - 1)), draw(st.integers(0, M64))))
            continue
        step = size if kind == "run" else size + draw(st.integers(1, 10 ** 6))
        for _ in range(n):
            out.append((0, 0, 0) if kind == "gap" else (phys & M64, size, tag))
            if kind != "gap":
                phys += step
    return b"".join((ENTRY_BE if be else ENTRY).pack(*e) for e in out)


@needs_c
@settings(max_examples=300, deadline=None)
@given(data=st.data(), start=st.integers(-5, 3000), stop=st.integers(-5, 3000), be=st.booleans())
def test_the_c_codec_equals_its_reference_and_gives_back_every_entry(data, start, stop, be):
    """Both byte orders: the ConsumeQueue's entries (little-endian) and the light-queue index's."""
    entries = data.draw(blocks(be))
    enc = _C.cq_encode(entries, be)
    assert enc == encode_block_py(entries, be)
    assert len(enc) <= len(entries)
    # an encoded value is never a whole number of entries long: that is how readers tell the forms apart
    assert enc == entries or len(enc) % ENTRY_SIZE
    n = len(entries) // ENTRY_SIZE
    assert block_count(enc) == n
    assert _C.cq_decode(enc, 0, -1, be) == decode_block_py(enc, 0, -1, be) == entries
    a = max(0, min(start, n))
    b = n if stop < 0 else max(a, min(stop, n))
    assert _C.cq_decode(enc, start, stop, be) == decode_block_py(enc, start, stop, be) == \
        entries[a * ENTRY_SIZE:b * ENTRY_SIZE]


def _outcome(fn, *args):
    try:
        return fn(*args)
    except ValueError:
        return "refused"


@needs_c
@settings(max_examples=600, deadline=None)
@given(entries=blocks(), cut=st.integers(0, 10 ** 6), flips=st.lists(st.tuples(st.integers(0, 10 ** 6),
                                                                            st.integers(1, 255)), max_size=3),
       junk=st.binary(max_size=60), use_junk=st.booleans(), be=st.booleans())
def test_a_damaged_block_is_refused_alike_by_c_and_its_reference(entries, cut, flips, junk, use_junk, be):
    """Values read from disk: truncated, bytes changed, or anything at all. Both decoders give the
    same entries or both refuse with ValueError; nothing else escapes (no crash, no huge block)."""
    v = bytearray(junk if use_junk else _C.cq_encode(entries))
    if v and not use_junk:
        if cut % 3 == 0:
            del v[cut % len(v) + 1:]
        for pos, x in flips:
            v[pos % len(v)] ^= x
    v = bytes(v)
    got = _outcome(_C.cq_decode, v, 0, -1, be)
    assert got == _outcome(decode_block_py, v, 0, -1, be)
    if got != "refused":
        assert block_count(v) == len(got) // ENTRY_SIZE


@needs_c
def test_a_busy_topics_block_is_a_few_bytes_and_device_topics_are_smaller_than_raw():
    busy = b"".join(ENTRY.pack(10 ** 9 + i * 187, 187, 0xABCDEF) for i in range(4096))
    assert len(_C.cq_encode(busy)) < 30                 # 80 KiB of entries in one run
    # one device of 2,000 sending in turn: its records ~400 KB apart, sizes varying a little
    dev = b"".join(ENTRY.pack(i * 401_234 + (i % 3), 180 + i % 3, 42) for i in range(4096))
    assert len(_C.cq_encode(dev)) < len(dev) / 2


def _req(qoff: int, phys: int, size: int = 100) -> DispatchRequest:
    return DispatchRequest(phys, size, "t/x", 0, qoff, 0, 0, 0, 5, (), ())


def test_blocks_written_raw_before_the_encoding_and_encoded_ones_read_as_one_queue(tmp_path, monkeypatch):
    """A data dir from before the encoding holds raw blocks: the store reads them, extends its small
    last block, and writes new blocks encoded (when the C module is built) beside them."""
    path = str(tmp_path / "db")
    expect = []
    monkeypatch.setattr(cqe, "encode_block", None)          # as the store before the encoding wrote them
    cqs = ConsumeQueueStore(path, block_entries=50)
    cqs.load()
    phys = 0
    for rnd in range(3):                                    # 70 entries: a block of 50, one of 20
        reqs = [_req(len(expect) + k, phys + k * 100) for k in range(70 if rnd == 0 else 5)]
        cqs.dispatch(reqs, phys + len(reqs) * 100)
        phys += len(reqs) * 100
        expect += [(r.queue_offset, r.phys_offset, 100, 5) for r in reqs]
        cqs.flush()
    cqs.close()
    monkeypatch.undo()
    cqs = ConsumeQueueStore(path, block_entries=50)
    cqs.load()
    try:
        stored = [v for _, v in cqs._scan(b"E")]
        assert all(len(v) % ENTRY_SIZE == 0 for v in stored)        # every block raw so far
        assert cqs.get("t/x", 0).range(0, 1000) == expect
        reqs = [_req(len(expect) + k, phys + k * 100) for k in range(400)]
        cqs.dispatch(reqs, phys + 400 * 100)
        expect += [(r.queue_offset, r.phys_offset, 100, 5) for r in reqs]
        cqs.flush()
        assert cqs.get("t/x", 0).range(0, 1000) == expect
        assert [e for f in (0, 33, 79, 80, 449) for e in cqs.get("t/x", 0).range(f, 3)] == \
            [e for f in (0, 33, 79, 80, 449) for e in expect[f:f + 3]]
        if _C is not None:
            stored = [v for _, v in cqs._scan(b"E")]
            assert any(len(v) % ENTRY_SIZE for v in stored)          # the new ones encoded
            assert sum(map(len, stored)) < len(expect) * ENTRY_SIZE / 3
    finally:
        cqs.close()


def test_a_damaged_stored_block_is_a_store_error_naming_the_queue(tmp_path):
    path = str(tmp_path / "db")
    cqs = ConsumeQueueStore(path, block_entries=50)
    cqs.load()
    try:
        cqs.dispatch([_req(k, k * 100) for k in range(10)], 1000)
        cqs.flush()
        key = b"E" + queue_key("t", 0) + bytes(8)
        cqs._db.put(key, bytes([cqe.BLOCK_TAG, 10, 1, 0]))       # a run whose numbers stop short
        cqs.queues.clear()
        with pytest.raises(StoreError, match=r"ConsumeQueue t/0: the stored block from offset 0 is damaged"):
            cqs.get("t/x", 0).range(0, 10)
    finally:
        cqs.close()


def test_a_damaged_newest_block_does_not_stop_the_flushes_of_its_queue(tmp_path):
    """The next flush starts a block of its own beside it: later entries are stored and read, the
    checkpoint moves on, and only a read of the damaged range fails, naming it."""
    path = str(tmp_path / "db")
    cqs = ConsumeQueueStore(path, block_entries=50)
    cqs.load()
    try:
        cqs.dispatch([_req(k, k * 100) for k in range(3)], 300)     # a small block: extended next
        cqs.flush()
        cqs._db.put(b"E" + queue_key("t", 0) + bytes(8), bytes([cqe.BLOCK_TAG, 0x80]))
        cqs.queues.clear()
        cqs.dispatch([_req(k, k * 100) for k in range(3, 9)], 900)
        cqs.flush()
        assert cqs.checkpoint() == 900
        assert cqs.get("t/x", 0).range(3, 10) == [(k, k * 100, 100, 5) for k in range(3, 9)]
        with pytest.raises(StoreError, match="damaged"):
            cqs.get("t/x", 0).range(0, 10)
    finally:
        cqs.close()
