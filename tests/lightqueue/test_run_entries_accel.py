"""The entries of one run of the light-queue index's `take_runs` in C (lightqueue/_take.c
`run_entries`) against its Python reference (`lightqueue.take.run_entries_py`), on arbitrary input:
sizes up to 2**32-1, phys up to 2**63, the checkpoint anywhere (before, inside, exactly at a record,
past the run), empty ranges, long runs. Plus: a real store's dispatch of multi-record runs goes
through the C function when it is built, and the module refuses to run unconfigured."""
from __future__ import annotations

import os
import struct

import pytest
from hypothesis import given, settings, strategies as st

from lmqtt.lightqueue import take as lqtake
from lmqtt.store import Message
from tests.lightqueue.pairs import open_pair
from tests.store.accel_support import outcome, run_unconfigured

_C = lqtake._ctake
needs_c = pytest.mark.skipif(_C is None, reason="lmqtt.lightqueue._take not built (or LMQTT_PURE_PYTHON set)")


@pytest.mark.skipif(os.environ.get("LMQTT_PURE_PYTHON", "") not in ("", "0"),
                    reason="LMQTT_PURE_PYTHON is set: the C loop is off on purpose")
def test_the_c_run_entries_is_built():
    assert _C is not None and callable(_C.run_entries), "lmqtt.lightqueue._take was not built"



@st.composite
def runs(draw):
    base = draw(st.lists(st.one_of(st.integers(0, 2 ** 32 - 1), st.integers(0, 400)), max_size=30))
    sizes = base * draw(st.sampled_from([1, 1, 2, 50]))       # up to 1500 records
    n = len(sizes)
    i0 = draw(st.integers(0, n))
    i1 = draw(st.integers(0, n))                             # i1 <= i0: an empty range
    phys = draw(st.one_of(st.integers(0, 2 ** 63), st.integers(0, 10_000)))
    sts = draw(st.integers(0, 2 ** 64 - 1))
    ends = [phys]                                            # each record's phys, and the run's end
    for s in sizes[i0:i1]:
        ends.append(ends[-1] + s)
    at = draw(st.sampled_from(ends))
    ckpt = draw(st.one_of(st.just(at), st.just(at + 1), st.just(at - 1), st.integers(-5, 2 ** 64 + 5),
                          st.just(0), st.just(2 ** 64 + 1)))
    return phys, sizes, i0, i1, sts, ckpt


@needs_c
@settings(max_examples=400, deadline=None)
@given(runs())
def test_run_entries_equals_its_reference(run):
    phys, sizes, i0, i1, sts, ckpt = run
    got = outcome(_C.run_entries, phys, sizes, i0, i1, sts, ckpt)
    assert got == outcome(lqtake.run_entries_py, phys, sizes, i0, i1, sts, ckpt)


@needs_c
@pytest.mark.parametrize("phys,sizes,ckpt", [
    (2 ** 64 - 10, [5, 5], 0),              # the last record ends at 2**64: nothing past it is packed
    (2 ** 64 - 10, [5, 5, 5], 0),           # the third would start at 2**64: both refuse
    (2 ** 64 - 10, [5, 5, 5], 2 ** 64 - 1),  # skipped up to the checkpoint, then refused
    (2 ** 64 - 10, [5, 5, 5], 2 ** 64),     # nothing can reach the checkpoint: none taken
    (2 ** 64 - 1, [2 ** 32 - 1], 2 ** 64 - 1),
    (0, [2 ** 32 - 1] * 3, 2 ** 33),
])
def test_run_entries_at_the_edges_of_64_bits(phys, sizes, ckpt):
    sts = 2 ** 64 - 1
    c = outcome(_C.run_entries, phys, sizes, 0, len(sizes), sts, ckpt)
    assert c == outcome(lqtake.run_entries_py, phys, sizes, 0, len(sizes), sts, ckpt)


@needs_c
def test_run_entries_mid_run_checkpoint_by_hand():
    """A replay whose checkpoint falls inside a run takes the records from the first one at or
    past it: the entries are big-endian (phys u64, size u32, store_ts u64)."""
    got = _C.run_entries(1000, [7, 100, 200, 300, 9], 1, 4, 42, 1100)     # records at 1000, 1100, 1300
    assert got == (struct.pack(">QIQ", 1100, 200, 42) + struct.pack(">QIQ", 1300, 300, 42), 1100)
    assert _C.run_entries(1000, [7, 100, 200, 300, 9], 1, 4, 42, 1101) == (struct.pack(">QIQ", 1300, 300, 42), 1300)
    assert _C.run_entries(1000, [7, 100], 0, 2, 42, 1008) == (b"", -1)
    assert _C.run_entries(1000, [7, 100], 1, 1, 42, 0) == (b"", -1)


@needs_c
def test_run_entries_refuses_what_is_not_a_size():
    with pytest.raises(TypeError, match="sizes must be ints"):
        _C.run_entries(0, [1, "2"], 0, 2, 0, 0)
    with pytest.raises(OverflowError, match="32 bits"):
        _C.run_entries(0, [2 ** 32], 0, 1, 0, 0)


@needs_c
def test_a_stores_dispatch_of_runs_goes_through_the_c_function(tmp_path, monkeypatch):
    """Records of one topic appended together reach the index as one run (store.message), whose
    entries `take_runs` builds with `run_entries`: with the extension built, the C one."""
    calls = []
    real = _C.run_entries

    def counting(*a):
        calls.append(a[3] - a[2])
        return real(*a)

    monkeypatch.setattr(_C, "run_entries", counting)
    st_, lq = open_pair(tmp_path)
    st_.start()
    try:
        lq.register_filter("t/#")
        qs = lq.queues_for_topic("t/1")
        rs = st_.append_batch([Message(topic="t/1", body=b"x%d" % i, dispatch_queues=qs) for i in range(300)])
        assert st_.wait_dispatched(rs[-1].phys_offset + rs[-1].size, 20)
        assert calls and max(calls) > 1, "take_runs did not call the C run_entries"
        for q in qs:
            got = lq.pull(q, 0, 1000, 1 << 24).messages
            assert [(m.phys_offset, m.body) for m in got] == [(r.phys_offset, b"x%d" % i) for i, r in enumerate(rs)]
    finally:
        lq.close()
        st_.shutdown()


@needs_c
def test_an_unconfigured_module_refuses_to_run():
    assert "configure() was not called" in run_unconfigured("lmqtt.lightqueue._take",
                                                            "m.run_entries(0, [1], 0, 1, 0, 0)")
    assert run_unconfigured(
        "lmqtt.lightqueue._take",
        "m.configure(__import__('lmqtt.lightqueue.take', fromlist=['T']).TAKE_LAYOUT); "
        "m.run_entries(0, [1], 0, 1, 0, 0)") == "ran"
