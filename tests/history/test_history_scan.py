"""The filter-history scan (lightqueue/history.py): its C loop (lightqueue/_history.c) against the
Python reference on a real store, and the C matcher against lightqueue/topics.py's rule."""
from __future__ import annotations

import os
import random
import struct

import pytest
from lmqtt.lightqueue import history as H
from lmqtt.lightqueue.topics import topic_matches
from lmqtt.store import protocol as W
from lmqtt.store.client.consumer import decode_reply
from lmqtt.store.config import StoreConfig
from lmqtt.store.consume_queue import ENTRY
from lmqtt.store.message import Message
from lmqtt.store.message_store import MessageStore

needs_c = pytest.mark.skipif(H._C is None, reason="lightqueue._history not built")
PURE = os.environ.get("LMQTT_PURE_PYTHON", "") not in ("", "0")


@pytest.mark.skipif(PURE, reason="LMQTT_PURE_PYTHON is set: the C loop is off on purpose")
def test_the_c_history_scan_is_built_and_used():
    """Every C test below skips when the module is missing: this one says so instead."""
    assert H._C is not None, ("lmqtt.lightqueue._history was not built: `pip install -e .` needs a C compiler "
                              "(filter history reads fall back to the Python scan)")
    assert H.scan is H._C.scan, "the history read does not use the C scan"

TOPICS = ["p/a/t", "p/b/t", "p/a/h", "p", "p/", "p//t", "p/a/t/x", "p/$x/t", "q/a/t", "$sys/a", "p/a/tt"]
FILTERS = ["p/+/t", "p/#", "#", "+/a/t", "p/a/t", "p/+", "p/+/+/x", "p//t", "p/+/#", "+", "+/+", "$sys/#",
           "q/#", "p/a/t/#", "+/#"]


@pytest.fixture
def store(tmp_path):
    st = MessageStore(StoreConfig(data_dir=str(tmp_path / "store"), segment_size=1 << 16, max_message_size=1 << 12,
                                  preallocate=False))
    st.start()
    rnd = random.Random(7)
    for b in range(30):
        st.append_batch([Message(rnd.choice(TOPICS), b"x" * rnd.randrange(0, 300)) for _ in range(40)])
    assert st.wait_dispatched(st.max_offset, 10)
    yield st
    st.shutdown()


@needs_c
def test_c_match_is_the_topics_rule():
    rnd = random.Random(3)
    levels = ["a", "b", "", "$s", "+", "#"]
    for f in FILTERS:
        for t in TOPICS:
            assert H._C.match(f.encode(), t.encode()) == topic_matches(f, t), (f, t)
    for _ in range(3000):
        t = "/".join(rnd.choice(levels[:4]) for _ in range(rnd.randrange(1, 5)))
        f = [rnd.choice(levels) for _ in range(rnd.randrange(1, 5))]
        f = [x if x != "#" else "a" for x in f[:-1]] + f[-1:]
        f = "/".join(f)
        assert H._C.match(f.encode(), t.encode()) == topic_matches(f, t), (f, t)


def test_a_read_maps_only_the_segments_its_entries_point_into(store):
    """A filter's read of a few entries maps the CommitLog segments those entries are in, not
    every segment the retention keeps (each map costs a descriptor: store/file_budget.py)."""
    files = store.clog.mfq.files
    assert len(files) > 3
    for mf in files[:-2]:
        mf.release()
    cq = store.consume_queues.get("p", 0)
    pieces = cq.pieces(cq.max_offset // 2, 3)
    phys = [e[0] for _, piece in pieces for e in ENTRY.iter_unpack(piece)]
    segs, size = H._segs(store, pieces)
    assert [s for s, _ in segs] == sorted({p - p % size for p in phys})
    assert sum(1 for mf in files[:-2] if mf.mapped) == len(segs) - sum(1 for s, _ in segs
                                                                       if s >= files[-2].start_offset)


@needs_c
@pytest.mark.parametrize("flt", FILTERS)
def test_c_scan_equals_the_reference(store, flt):
    """Same records, same next offset, same status, for every filter over ConsumeQueues spanning
    several CommitLog segments, with count, byte, position and time limits."""
    segs, seg_size = H._segs(store)
    assert len(segs) > 3
    rnd = random.Random(flt)
    for fl, qid in H.sources(store, flt):
        cq = store.consume_queues.get(fl, qid)
        n = cq.max_offset
        mid = cq.entry(n // 2)[0]
        ts_mid = store.read(mid).store_ts
        for case in range(12):
            args = dict(tag=H.exact_tag(flt), phys_lo=rnd.choice([0, mid]), phys_hi=rnd.choice([H.TS_MAX, mid + 1]),
                        ts_lo=rnd.choice([0, ts_mid]), ts_hi=rnd.choice([H.TS_MAX, ts_mid + 1]),
                        max_count=rnd.choice([0, 1, 7, 100]), max_bytes=rnd.choice([0, 200, 5000]))
            q0 = rnd.randrange(0, n)
            for first, piece in cq.pieces(q0, n):
                res = []
                for fn in (H._C.scan, H.scan_py):
                    out, idx = bytearray(), bytearray()
                    r = fn(piece, first, segs, seg_size, flt.encode(), args["tag"], args["phys_lo"], args["phys_hi"],
                           args["ts_lo"], args["ts_hi"], args["max_count"], args["max_bytes"], out, idx)
                    res.append((r, bytes(out), bytes(idx)))
                assert res[0] == res[1], (flt, args)


@needs_c
def test_c_scan_tells_apart_topics_with_the_same_tag(tmp_path):
    """The C scan caches each distinct topic's match by the entries' tag code (the topic's CRC-32):
    two topics with the same CRC-32, one matching `p/+/t` and one not (found by a birthday search),
    interleaved over many entries, give exactly the reference's records (a cache trusting the tag
    alone would keep the `/h` ones or drop the `/t` ones after the first of the other)."""
    import zlib
    a, b = "p/ofyuw5he/t", "p/k4g0jn20/h"
    assert zlib.crc32(a.encode()) == zlib.crc32(b.encode())
    st = MessageStore(StoreConfig(data_dir=str(tmp_path / "store"), segment_size=1 << 16, max_message_size=1 << 12,
                                  preallocate=False))
    st.start()
    try:
        rnd = random.Random(11)
        st.append_batch([Message(rnd.choice((a, b, "p/x/t")), b"v%d" % i) for i in range(3000)])
        assert st.wait_dispatched(st.max_offset, 10)
        segs, seg_size = H._segs(st)
        cq = st.consume_queues.get("p", 0)
        for first, piece in cq.pieces(0, cq.max_offset):
            res = []
            for fn in (H._C.scan, H.scan_py):
                out, idx = bytearray(), bytearray()
                r = fn(piece, first, segs, seg_size, b"p/+/t", -1, 0, H.TS_MAX, 0, H.TS_MAX, 0, 0, out, idx)
                res.append((r, bytes(out), bytes(idx)))
            assert res[0] == res[1]
        got = H.read_range(st, "p/+/t", "p", 0, 0, 3000, 0, 0)[0]
        assert got.count == sum(1 for m in st.read_consume_queue("p", 0, 0, 3000) if m.topic != b)
    finally:
        st.shutdown()


@needs_c
def test_c_crc32_is_zlibs():
    """The scan checks each matching record's CRC-32 with carry-less multiplication where the CPU
    has it (lightqueue/_history.c): the same value as zlib.crc32 for every length (below, at and
    above the 64-byte threshold, not a multiple of 16) and alignment."""
    import zlib
    rnd = random.Random(13)
    for n in list(range(0, 300)) + [rnd.randrange(300, 70000) for _ in range(100)]:
        data = rnd.randbytes(n + 7)
        for off in (0, 1, 5):
            mv = memoryview(data)[off:off + n]
            assert H._C.crc32(mv) == zlib.crc32(mv), (n, off)


@pytest.mark.parametrize("flt", FILTERS)
def test_read_from_is_every_matching_record_once_in_log_order(store, flt):
    """read_from, page by page from the log's start: exactly the records whose topic matches, in
    CommitLog order (checked against a decode of every record)."""
    want = []
    pos = store.min_offset
    for fl, qid in H.sources(store, flt):
        want += [m for m in store.read_consume_queue(fl, qid, 0, 10_000) if topic_matches(flt, m.topic)]
    want.sort(key=lambda m: m.phys_offset)
    got = []
    for _ in range(10_000):
        g, nxt, _h = H.read_from(store, None, flt, pos, max_count=13, max_bytes=3000)
        assert g.msgs is None and nxt >= pos
        data = b"".join(bytes(c) for c in g.chunks)
        body = struct.pack(">I", 2) + b"{}" + struct.pack(">I", g.count) + data
        got += decode_reply("", body, W.F_RAW)[1]
        if nxt == pos:
            break
        pos = nxt
    assert [(r.offset, r.topic) for r in got] == [(m.phys_offset, m.topic) for m in want]


@pytest.mark.parametrize("flt", ["p/+/t", "#", "p/a/t"])
def test_records_the_raw_scan_cannot_reach_come_through_the_store_reads(store, flt, monkeypatch):
    """A record whose segment is not mapped here (another layer serves it) stops the raw scan;
    the read goes on through the store's decoding reads with the same records and positions."""
    def every(read):
        out, pos = [], store.min_offset
        for _ in range(10_000):
            g, nxt, _h = read(pos)
            out.append((g.count, nxt))
            if nxt == pos:
                return out
            pos = nxt
        return out
    raw_ranges = every(lambda pos: H.read_from(store, None, flt, pos, max_count=11))
    raw_range = H.read_range(store, flt, flt.split("/")[0] if flt[0] not in "+#" else "p", 0, 0, 10_000)
    monkeypatch.setattr(H, "_segs", lambda st, pieces=None: ([], 1 << 16))
    got = H.read_from(store, None, flt, store.min_offset, max_count=11)[0]
    assert got.msgs is not None and not got.chunks
    assert every(lambda pos: H.read_from(store, None, flt, pos, max_count=11)) == raw_ranges
    dec_range = H.read_range(store, flt, flt.split("/")[0] if flt[0] not in "+#" else "p", 0, 0, 10_000)
    assert dec_range[0].msgs is not None
    assert (dec_range[0].count, dec_range[1]) == (raw_range[0].count, raw_range[1])
