"""The C decode of a raw PUSH's records (store/_append.c `decode_runs`) against its Python
reference (gateway/storage/remote_entries.py `decode_raw_entries_py`): on OP_PUSH_RAW frames a real
store's records make (runs that break at segment ends, repeated topics and props, keys, dispatch
queues), intact and damaged every way a frame from a peer can be (a flipped byte anywhere, sizes
and run offsets that lie, a cut body), both give the same StoredMessages field for field, or both
refuse the queue (None). CI builds the extension, so a missing build fails here instead of
silently measuring the slow path."""
from __future__ import annotations

import gc
import random

import pytest
from hypothesis import given, settings, strategies as st

from lmqtt.gateway.storage import remote_entries
from lmqtt.gateway.storage.remote_entries import MAX_RUN_PHYS, decode_raw_entries_py
from lmqtt.store import Message, MessageStore, StoreConfig, accel, protocol as W
from lmqtt.store.fastpath import raw_runs
from lmqtt.store.message import StoredMessage
from lmqtt.store.record import c_decode_runs

needs_c = pytest.mark.skipif(c_decode_runs is None, reason="C decoder not built or LMQTT_PURE_PYTHON set")


def test_the_c_decode_of_pushed_records_is_built_and_used():
    if accel.pure_python():
        pytest.skip("LMQTT_PURE_PYTHON is set: the C decoder is off on purpose")
    assert c_decode_runs is not None, "lmqtt.store._append has no decode_runs: rebuild it"
    assert remote_entries.decode_raw_entries is c_decode_runs


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A store holding 90 records over several 8 KiB segments: [(phys, size)], the store."""
    rng = random.Random(7)
    cfg = StoreConfig(data_dir=str(tmp_path_factory.mktemp("push") / "store"), segment_size=8192,
                      max_message_size=4096, flush_mode="async")
    topics = ["a", "site/1/dev2/temp", "é/日本", "x" * 200]
    with MessageStore(cfg) as ms:
        msgs = []
        for i in range(90):
            t = rng.choice(topics)
            msgs.append(Message(t, rng.randbytes(rng.choice([0, 1, 40, 700])), rng.choice([0, 3]), 0,
                                rng.choice([b"", b"\x01p", rng.randbytes(9)]), rng.choice([(), ("k1", "ключ")]),
                                1000 + i, rng.choice([(t,), (t, "site/#")])))
        res = []
        for k in range(0, len(msgs), 9):
            res += ms.append_batch(msgs[k:k + 9])
        yield [(r.phys_offset, r.size) for r in res], ms


def frame(ms, entries, first: int) -> tuple[bytes, tuple, tuple, int]:
    """An OP_PUSH_RAW body of one queue holding `entries`, and its decoded head: (body, runs, sizes, first)."""
    runs = raw_runs(ms, entries)
    assert runs is not None
    body = b"".join(W.encode_push_raw([("q/1", first + len(entries), first, runs, [s for _p, s in entries])]))
    [(_name, _mx, got_first, spans, sizes)] = W.decode_push_raw(body)
    return body, tuple(spans), sizes, got_first


def outcome(fn, body, runs, sizes, first, ident="0A0B0C0D0E0F1011"):
    out = fn(memoryview(body), runs, sizes, first, ident)
    if out is None:
        return None
    assert all(type(m) is StoredMessage for m in out)
    return [tuple(m) for m in out]


@needs_c
def test_an_intact_push_decodes_alike_with_the_queues_offsets(store):
    where, ms = store
    body, runs, sizes, first = frame(ms, where, 500)
    assert len(runs) > 3                      # the segments cut it into runs
    got = outcome(c_decode_runs, body, runs, sizes, first)
    assert got == outcome(decode_raw_entries_py, body, runs, sizes, first)
    assert [m[5] for m in got] == list(range(500, 590))
    assert [m[6] for m in got] == [p for p, _s in where]
    for m in c_decode_runs(memoryview(body), runs, sizes, first, "X"):
        assert not gc.is_tracked(m)           # strings, bytes, ints and tuples of strings only


DAMAGE = ["none", "flip", "size", "sizes_short", "sizes_long", "run_phys", "run_count", "run_bounds", "cut",
          "huge_phys", "negative_phys", "empty_run"]


@needs_c
@settings(max_examples=500, deadline=None)
@given(data=st.data(), damage=st.sampled_from(DAMAGE))
def test_c_and_python_take_or_refuse_every_push_alike(store, data, damage):
    where, ms = store
    i = data.draw(st.integers(0, len(where) - 1))
    j = data.draw(st.integers(i + 1, len(where)))
    first = data.draw(st.integers(0, 2 ** 40))
    body, runs, sizes, first = frame(ms, where[i:j], first)
    runs, sizes = list(runs), list(sizes)
    r = data.draw(st.integers(0, len(runs) - 1))
    phys, count, start, end = runs[r]
    if damage == "flip":
        pos = data.draw(st.integers(0, len(body) - 1))
        b = bytearray(body)
        b[pos] ^= data.draw(st.integers(1, 255))
        body = bytes(b)
    elif damage == "size":
        k = data.draw(st.integers(0, len(sizes) - 1))
        sizes[k] = data.draw(st.sampled_from([0, 1, sizes[k] - 1, sizes[k] + 1, 2 ** 32 - 1]))
    elif damage == "sizes_short":
        sizes = sizes[:data.draw(st.integers(0, len(sizes) - 1))]
    elif damage == "sizes_long":
        sizes = sizes + [sizes[0]]
    elif damage == "run_phys":
        runs[r] = (phys + data.draw(st.sampled_from([-1, 1, sizes[0]])), count, start, end)
    elif damage == "run_count":
        runs[r] = (phys, count + data.draw(st.sampled_from([-1, 1])), start, end)
    elif damage == "run_bounds":
        runs[r] = (phys, count, start + data.draw(st.integers(-3, 3)), end + data.draw(st.integers(-3, 3)))
    elif damage == "cut":
        body = body[:data.draw(st.integers(0, len(body)))]
    elif damage == "huge_phys":
        runs[r] = (data.draw(st.sampled_from([MAX_RUN_PHYS, MAX_RUN_PHYS + 1, 2 ** 64 - 1, 2 ** 70])), count, start,
                   end)
    elif damage == "negative_phys":
        runs[r] = (-data.draw(st.integers(1, 2 ** 64)), count, start, end)
    elif damage == "empty_run":
        runs.insert(r, (data.draw(st.integers(-2 ** 70, 2 ** 70)), 0, data.draw(st.integers(0, len(body))),
                        data.draw(st.integers(0, len(body)))))
    want = outcome(decode_raw_entries_py, body, runs, sizes, first)
    assert outcome(c_decode_runs, body, runs, sizes, first) == want
    if damage == "none":
        assert want is not None and len(want) == j - i


@needs_c
def test_a_negative_record_count_is_refused_as_malformed(store):
    """The wire carries counts as u32: a negative one is a caller's error, not a frame to decode."""
    where, ms = store
    body, runs, sizes, first = frame(ms, where[:3], 0)
    with pytest.raises(ValueError, match="negative"):
        c_decode_runs(memoryview(body), [(runs[0][0], -1, runs[0][2], runs[0][3])], sizes, first, "X")
