"""The store server's fast loops (store/fastpath.py, store/produce.py) and the SDK's raw-record decoder (C in
store/client/_records.c, Python in records.records_raw) against their plain references, on a
real MessageStore with real files: same messages, same PRODUCED bytes, same records, same errors.
A difference here means an SDK user would see other data than the reference path gives."""
from __future__ import annotations

import os
import random
import struct

import pytest

from lmqtt.store import Message, MessageStore, StoreConfig, fastpath, produce, protocol as W
from lmqtt.store.client import records
from tests.store.accel_support import swapped

IDENT = "0123456789ABCDEF"


def cfg(tmp_path, **kw):
    base = dict(data_dir=str(tmp_path / "store"), segment_size=64 * 1024, max_message_size=16 * 1024,
                flush_mode="async", index_slots=128, index_entries=4096, cq_block_entries=100)
    base.update(kw)
    return StoreConfig(**base)


def random_items(rng, n):
    topics = ["a/x", "a/y/z", "b", "ü/ñ", "a/x"]
    props = [b"", b"\x01\x02", b"\x00" * 7]
    out = []
    for i in range(n):
        keys = () if rng.random() < 0.7 else tuple(f"k{rng.randrange(5)}" for _ in range(rng.randrange(1, 3)))
        out.append((rng.choice(topics), os.urandom(rng.randrange(0, 300)), keys, rng.choice(props),
                    rng.randrange(3), rng.choice((0, 0, 1_700_000_000_000 + i))))
    return out


def route(topic):
    return (topic, topic.split("/")[0] + "/#") if "/" in topic else ()


def fields(m):
    return (m.topic, bytes(m.body), m.queue_id, m.flags, m.props, m.keys, m.born_ts, m.dispatch_queues)


def test_produce_messages_equal_decode_produce_plus_message():
    rng = random.Random(7)
    for n in (0, 1, 2, 50, 500):
        items = random_items(rng, n)
        body = W.encode_produce("prod-ü", 42, n, W.encode_messages_for_produce(items))
        pid, seq, got = produce.produce_messages(body, route, 99)
        rpid, rseq, ref = W.decode_produce(body)
        assert (pid, seq) == (rpid, rseq) == ("prod-ü", 42)
        want = [Message(t, b, q, 0, p, k, born or 99, route(t)) for t, b, k, p, q, born in ref]
        assert [fields(m) for m in got] == [fields(m) for m in want]
        _pid, _seq, noroute = produce.produce_messages(body, None, 99)
        assert all(m.dispatch_queues == () for m in noroute)


@pytest.mark.parametrize("mutate", ["truncate_head", "truncate_body", "trailing", "bad_utf8_topic", "bad_utf8_key",
                                    "bad_utf8_pid"])
def test_produce_messages_refuse_what_decode_produce_refuses(mutate):
    items = [("t/1", b"abc", ("k",), b"", 0, 0), ("t/2", b"defg", (), b"p", 1, 0)]
    packed = W.encode_messages_for_produce(items)
    body = W.encode_produce("p", 1, 2, packed)
    if mutate == "truncate_head":
        body = body[:20]
    elif mutate == "truncate_body":
        body = body[:-2]
    elif mutate == "trailing":
        body = body + b"xx"
    elif mutate == "bad_utf8_topic":
        body = body.replace(b"t/1", b"t\xff1")
    elif mutate == "bad_utf8_key":
        body = W.encode_produce("p", 1, 2, packed.replace(b"t/1k", b"t/1\xff"))   # key "k" follows topic "t/1"
    else:
        body = b"\x00\x01\xff" + body[3:]
    with pytest.raises(W.ProtocolError) as ref:
        W.decode_produce(body)
    with pytest.raises(W.ProtocolError) as got:
        produce.produce_messages(body, route, 1)
    assert (got.value.code, str(got.value)) == (ref.value.code, str(ref.value))


def test_produced_body_equals_encode_produced(tmp_path):
    rng = random.Random(3)
    with MessageStore(cfg(tmp_path)) as st:
        for n in (1, 2, 300):
            for _ in range(3):
                msgs = [Message(t, b, q, 0, p, k, born) for t, b, k, p, q, born in random_items(rng, n)]
                rs = st.append_batch(msgs)
                got = produce.produced_body(rs)        # before anything built the result tuples
                assert got == W.encode_produced([(r.phys_offset, r.queue_offset) for r in rs])
                assert len(got) == 4 + 16 * n
        # one topic, one queue: a single run of many records
        rs = st.append_batch([Message("solo/t", b"x" * 100) for _ in range(1000)])
        assert produce.produced_body(rs) == W.encode_produced([(r.phys_offset, r.queue_offset) for r in rs])


def classic(st, topic, qid, off, cnt, mb):
    """The reference: what the server answers without the raw flag, decoded by the SDK."""
    ms = st.read_consume_queue(topic, qid, off, cnt)
    if mb and ms:
        total = 0
        for i, m in enumerate(ms):
            total += m.size
            if total > mb and i:
                ms = ms[:i]
                break
    nxt = ms[-1].queue_offset + 1 if ms else off
    return records.decode_messages(IDENT, W.encode_messages({"next_offset": nxt}, ms))[1], nxt


def raw_reply(st, topic, qid, off, cnt, mb):
    res = fastpath.read_raw(st, topic, qid, off, cnt, mb)
    assert res is not None
    n, chunks, nxt = res
    body = struct.pack(">I", 2) + b"{}" + struct.pack(">I", n) + b"".join(chunks)
    return body, nxt


@pytest.fixture
def filled(tmp_path):
    """Records of queue `a` interleaved with other queues, crossing several 64 KiB segments."""
    rng = random.Random(11)
    with MessageStore(cfg(tmp_path)) as st:
        last = None
        for _ in range(40):
            items = random_items(rng, rng.randrange(1, 60))
            rs = st.append_batch([Message(t, b, q, 0, p, k, born, route(t)) for t, b, k, p, q, born in items])
            last = rs[-1]
        assert st.wait_dispatched(last.phys_offset + last.size, 10)
        yield st


@pytest.mark.parametrize("store_loops", ["c", "python"], ids=["c-store", "python-store"])
@pytest.mark.parametrize("pure", [False, True], ids=["c-decoder", "python-decoder"])
def test_raw_pull_gives_the_same_records_as_the_classic_path(filled, monkeypatch, pure, store_loops):
    """Both sides with either loops: the store's raw read (store/_fastpath.c or its references in
    fastpath.py) and the SDK's decode of it (store/client/_records.c or the Python loop)."""
    if pure:
        monkeypatch.setattr(records, "_C_RECORDS", None)
    elif records._C_RECORDS is None:
        pytest.skip("the C decoder is not built (or LMQTT_PURE_PYTHON is set)")
    if store_loops == "python":
        monkeypatch.setattr(fastpath, "_cq_runs", fastpath.cq_runs_py)
        monkeypatch.setattr(fastpath, "_check_records", fastpath.check_records_py)
    elif fastpath._fastpath is None:
        pytest.skip("lmqtt.store._fastpath is not built (or LMQTT_PURE_PYTHON is set)")
    st = filled
    for qid in range(3):
        lo, hi = st.consume_queue_offsets("a", qid)
        assert hi > 20
        for off, cnt, mb in ((lo, 10_000, 0), (lo + 3, 7, 0), (hi - 2, 100, 0), (hi, 10, 0), (lo, 1000, 1500),
                             (lo, 1000, 1)):
            want, want_next = classic(st, "a", qid, off, cnt, mb)
            body, nxt = raw_reply(st, "a", qid, off, cnt, mb)
            _h, got = records.records_raw(IDENT, body)
            assert got == want and nxt == want_next
        # paging through the queue in small raw pulls gives every record once, in order
        seen, off = [], lo
        while True:
            body, off2 = raw_reply(st, "a", qid, off, 5, 600)
            recs = records.records_raw(IDENT, body)[1]
            if not recs:
                break
            seen += recs
            off = off2
        assert [r.queue_offset for r in seen] == list(range(lo, hi))
        assert seen == classic(st, "a", qid, lo, 100_000, 0)[0]


def test_pulled_records_are_left_out_of_the_garbage_collectors_scans(filled):
    """A Record holds only str, bytes, int and a tuple of str: never in a reference cycle. As a
    named tuple (a tuple subclass) the collector would scan every one a consumer keeps, in every
    collection it lives through; the C decoder hands them over untracked, with the fields the
    Python loop decodes."""
    import gc
    if records._C_RECORDS is None:
        pytest.skip("the C decoder is not built (or LMQTT_PURE_PYTHON is set)")
    st = filled
    lo, hi = st.consume_queue_offsets("a", 0)
    body, _nxt = raw_reply(st, "a", 0, lo, 10_000, 0)
    got = records.records_raw(IDENT, body)[1]
    assert len(got) == hi - lo and any(r.keys for r in got)
    assert got == classic(st, "a", 0, lo, 10_000, 0)[0]
    for r in got:
        assert not gc.is_tracked(r), r
    gc.collect()            # nothing untracked was freed under a holder: every record still reads
    assert [r.queue_offset for r in got] == list(range(lo, hi))
    assert all(type(r.keys) is tuple and all(type(k) is str for k in r.keys) for r in got)


@pytest.mark.parametrize("store_loops", ["c", "python"])
def test_raw_pull_declines_a_corrupt_record_and_the_classic_path_skips_it(filled, monkeypatch, store_loops):
    if store_loops == "python":
        monkeypatch.setattr(fastpath, "_cq_runs", fastpath.cq_runs_py)
        monkeypatch.setattr(fastpath, "_check_records", fastpath.check_records_py)
    st = filled
    lo, hi = st.consume_queue_offsets("a", 0)
    victim = st.read_consume_queue("a", 0, lo + 2, 1)[0]
    mf = st.clog.mfq.find(victim.phys_offset)
    rel = victim.phys_offset - mf.start_offset + victim.size - 1
    mf.mm[rel] ^= 0xFF                           # flip the last body byte: CRC no longer matches
    assert fastpath.read_raw(st, "a", 0, lo, 100, 0) is None
    recs, _n = classic(st, "a", 0, lo, 100, 0)
    assert victim.queue_offset not in [r.queue_offset for r in recs]
    assert fastpath.read_raw(st, "a", 0, lo + 3, 100, 0) is not None     # after it: served raw again


@pytest.mark.skipif(os.environ.get("LMQTT_PURE_PYTHON", "") not in ("", "0"),
                    reason="LMQTT_PURE_PYTHON is set: the C decoder is off on purpose")
def test_the_c_record_decoder_is_built_and_used():
    assert records._C_RECORDS is not None, (
        "lmqtt.store.client._records was not built: `pip install -e .` needs a C compiler (the SDK "
        "falls back to the Python loop, ~4x slower per pulled record)")


def test_c_decoder_refuses_what_does_not_fit():
    if records._C_RECORDS is None:
        pytest.skip("the C decoder is not built (or LMQTT_PURE_PYTHON is set)")
    from lmqtt.store.record import HEADER
    rec = HEADER.pack(74 + 3 + 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 3, 0, 0) + b"t/x" + b"hi"
    good = struct.pack(">I", 0) + struct.pack(">I", 1) + rec
    assert records.records_raw(IDENT, good)[1][0].body == b"hi"
    for bad in (good[:-1], struct.pack(">I", 0) + struct.pack(">I", 2) + rec,
                good.replace(b"t/x", b"t\xffx")):
        with pytest.raises(W.ProtocolError):
            records.records_raw(IDENT, bad)


def test_pop_raw_hands_out_the_same_records_as_pop_decoded(filled, tmp_path, monkeypatch):
    from lmqtt.store import pop as popmod
    from lmqtt.store.sdk_meta import SdkMetadata
    st = filled
    meta = SdkMetadata(str(tmp_path / "meta"))
    try:
        pm = popmod.PopManager(st, meta)
        lo, hi = st.consume_queue_offsets("a", 1)
        now = [1_000_000]
        monkeypatch.setattr(popmod, "_now_ms", lambda: now[0])
        got = {}
        for raw in (False, True):
            group = f"g-{raw}"
            seen = []
            for _ in range(3):
                ms, att, dead = pm.pop(group, "a", 1, 7, 100, 2, raw)
                assert all(isinstance(m, fastpath.RawRecord) == raw for m in ms) and dead == 0
                seen.append([(m.message(IDENT) if raw else m) for m in ms])
            pm.ack(group, "a", 1, [m.queue_offset for m in seen[0]])
            now[0] += 200                                   # the un-acked ones are due again
            ms, att, dead = pm.pop(group, "a", 1, 100, 100, 2, raw)
            seen.append([(m.message(IDENT) if raw else m) for m in ms])
            assert att[:14] == [2] * 14
            now[0] += 200
            ms, att, dead = pm.pop(group, "a", 1, 5, 100, 2, raw)    # attempts used up: dead-lettered
            assert dead == 14
            got[raw] = [[(m.queue_offset, m.topic, m.body, m.props, m.keys, m.phys_offset, m.born_ts, m.store_ts)
                         for m in batch] for batch in seen]
        assert got[True] == got[False]
        assert [m[0] for m in got[True][0]] == list(range(lo, lo + 7))
        assert st.wait_dispatched(st.clog.wrote, 10)
        dlq = {raw: [(m.body, m.props, m.keys) for m in st.read_consume_queue(f"%DLQ%g-{raw}", 0, 0, 100)]
               for raw in (False, True)}
        assert len(dlq[True]) == 14 and dlq[True] == dlq[False]
    finally:
        meta.close()


def produce_body(pid, seq, items):
    return W.encode_produce(pid, seq, len(items), W.encode_messages_for_produce(items))


@pytest.fixture
def server(tmp_path):
    from lmqtt.store.server import StoreServer
    with MessageStore(cfg(tmp_path)) as st:
        srv = StoreServer(st, str(tmp_path / "meta"))
        try:
            yield srv
        finally:
            srv.meta.close()


def test_retry_after_a_crash_between_append_and_results_is_found_not_stored_twice(server):
    """The crash window of dedup: the first attempt wrote its pending marker and reached the log,
    the process died before the results were remembered. The retry must answer the stored offsets
    as a duplicate and append nothing."""
    st, meta = server.store, server.meta
    server.produce(produce_body("p1", 1, [("x/a", b"before", (), b"", 0, 0)]))
    items = [("x/a", b"m%d" % i, ("k",) if i == 2 else (), b"\x01", 0, 0) for i in range(5)]
    body = produce_body("p1", 2, items)
    # the first attempt, as far as it got: marker, then the append; no results remembered
    _pid, _seq, msgs = produce.produce_messages(body, None, 1)
    meta.begin("p1", 2, st.clog.wrote, len(msgs))
    st.append_batch([Message("other/t", b"interleaved")])       # another appender came first
    rs = st.append_batch(msgs)
    wrote = st.clog.wrote
    out, durable, dup = server.produce(body)                      # the retry
    assert dup and durable is None and st.clog.wrote == wrote     # nothing appended again
    assert W.decode_produced(out) == [(r.phys_offset, r.queue_offset) for r in rs]
    assert server.produce(body)[0] == out                        # later retries: plain duplicate


def test_retry_after_a_crash_before_the_append_stores_the_batch_once(server):
    st, meta = server.store, server.meta
    items = [("y/a", b"n%d" % i, (), b"", 0, 0) for i in range(3)]
    body = produce_body("p2", 7, items)
    meta.begin("p2", 7, st.clog.wrote, 3)                          # died right after the marker
    st.append_batch([Message("y/a", b"n0"), Message("y/a", b"other")])   # a look-alike, not the batch
    out, durable, dup = server.produce(body)
    assert not dup
    res = W.decode_produced(out)
    assert [st.clog.read(p).body for p, _q in res] == [b"n0", b"n1", b"n2"]
    assert [q for _p, q in res] == [2, 3, 4]
    out2, _d, dup2 = server.produce(body)
    assert dup2 and out2 == out


def test_pending_marker_is_never_mistaken_for_results(tmp_path):
    from lmqtt.store.sdk_meta import SdkMetadata
    meta = SdkMetadata(str(tmp_path / "m"))
    try:
        for n in range(0, 70):
            body = W.encode_produced([(i, i) for i in range(n)])
            assert meta.pending(body) is None
        meta.begin("p", 5, 123456789, 32)
        assert meta.pending(meta.seen("p", 5)) == (123456789, 32)
        meta.remember("p", 5, W.encode_produced([(1, 2)]))
        assert meta.pending(meta.seen("p", 5)) is None and meta._window("p") == [5]
    finally:
        meta.close()


# ------------------------------------------------------------------ the layout handed to the C decoder
needs_c_decoder = pytest.mark.skipif(records._C_RECORDS is None,
                                     reason="the C decoder is not built (or LMQTT_PURE_PYTHON is set)")


@pytest.fixture
def c_decoder():
    yield records._C_RECORDS
    records.configure_c(records._C_RECORDS)     # whatever a test did, leave it configured as at import


def _one_record_body():
    from lmqtt.store.record import HEADER
    rec = HEADER.pack(HEADER.size + 3 + 2, 0, 0, 7, 0, 5, 99, 1, 2, 0, 2, 0, 3, 0, 0) + b"t/x" + b"hi"
    return struct.pack(">I", 0) + struct.pack(">I", 1) + rec


def test_the_decoder_layout_handed_over_is_the_stores():
    from lmqtt.store.record import HEADER, HEADER_FIELDS, HEADER_SIZE
    assert records.C_LAYOUT == {"header_format": HEADER.format, "header_fields": HEADER_FIELDS,
                                 "header_size": HEADER_SIZE}

@needs_c_decoder
@pytest.mark.parametrize("change,words", [
    ({"header_format": "<IIIIIQQQQQIIHHHH"}, "has 16 fields, this decoder reads 15"),
    ({"header_format": "<IIIIIQQQQQIIHIH"}, r"record header field 13 \(keys_len\) is 4 bytes at offset 70"),
    ({"header_format": "<IIIIIIQQQQIIHHH"}, r"record header field 5 \(queue_offset\) is 4 bytes at offset 20"),
    ({"header_format": ">IIIIIQQQQQIIHHH"}, "not little-endian"),
    ({"header_size": 76}, "header_size 76"),
    ({"header_format": 74}, "layout has no str header_format"),
    # two fields of one width swapped: the offsets agree, the names do not
    ({"header_fields": swapped(records.C_LAYOUT["header_fields"], "born_ts", "store_ts")},
     "record header field 7 is 'store_ts', this decoder reads born_ts there"),
    ({"header_fields": records.C_LAYOUT["header_fields"][:-1]}, "has 14 field names, this decoder reads 15"),
])
def test_the_c_decoder_refuses_a_layout_it_does_not_read(c_decoder, change, words):
    with pytest.raises(ValueError, match=words):
        records.configure_c(c_decoder, records.Record, {**records.C_LAYOUT, **change})
    body = _one_record_body()
    with pytest.raises(RuntimeError, match="configure"):       # unusable until configured again
        c_decoder.decode(body, 8, 1, IDENT)
    records.configure_c(c_decoder)
    assert c_decoder.decode(body, 8, 1, IDENT) == [
        records.Record("t/x", b"hi", (), b"", 7, 5, 99, 1, 2, f"{IDENT}{99:016X}")]


@needs_c_decoder
def test_the_c_decoder_checks_the_record_field_order(c_decoder):
    from collections import namedtuple
    fields = list(records.Record._fields)
    fields[4], fields[5] = fields[5], fields[4]                # queue_id <-> queue_offset
    with pytest.raises(ValueError, match=r"Record._fields .*queue_offset', 'queue_id'.* differ"):
        records.configure_c(c_decoder, namedtuple("Swapped", fields))
    with pytest.raises(ValueError, match="Record._fields"):
        records.configure_c(c_decoder, namedtuple("Short", fields[:-1]))
    with pytest.raises(TypeError, match="tuple subclass"):
        records.configure_c(c_decoder, dict)
    with pytest.raises(RuntimeError, match="configure"):
        c_decoder.decode(_one_record_body(), 8, 1, IDENT)


@needs_c_decoder
def test_an_unconfigured_decoder_refuses_to_run():
    from tests.store.accel_support import run_unconfigured
    body = _one_record_body()
    assert "lmqtt.store.client._records.configure() was not called" in run_unconfigured(
        "lmqtt.store.client._records", f"m.decode({body!r}, 8, 1, 'X')")


@pytest.mark.parametrize("ident", ["Ünïcode-store-", "s" * 300, ""], ids=["non-ascii", "300-chars", "empty"])
def test_a_raw_reply_decodes_for_any_store_identity(ident):
    # the C loop takes short ASCII identities; any other goes through the Python loop, same records
    assert records.records_raw(ident, _one_record_body())[1] == [
        records.Record("t/x", b"hi", (), b"", 7, 5, 99, 1, 2, f"{ident}{99:016X}")]


def _deep_header_body():
    header = b"[" * 100_000 + b"]" * 100_000
    return struct.pack(">I", len(header)) + header + struct.pack(">I", 0)


@pytest.mark.parametrize("decode", ["records_raw", "decode_messages", "split_body", "parse_json"])
def test_a_json_nested_too_deep_is_a_bad_frame_not_a_crash(decode):
    from lmqtt.store.spark.columns import split_body
    body = _deep_header_body()
    call = {"records_raw": lambda: records.records_raw("X", body),
            "decode_messages": lambda: W.decode_messages(body),
            "split_body": lambda: split_body(body),
            "parse_json": lambda: W.parse_json(body[4:-4])}[decode]
    with pytest.raises(W.ProtocolError) as e:
        call()
    assert e.value.code == W.E_BAD_FRAME
