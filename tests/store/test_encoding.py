"""The three CommitLog record writers byte for byte (`CommitLog.append_one`, the Python reference
`store.encoding.encode_py`, the C `store._append.encode` when built), the record layout the C
encoder accepts at configure(), and the accelerator loader."""
from __future__ import annotations

import os
import random
import types

import pytest

from lmqtt.store import Message, StoreConfig, accel, commitlog, encoding
from lmqtt.store.commitlog import CommitLog
from lmqtt.store.consume_queue import ENTRY_FIELDS
from lmqtt.store.errors import InvalidMessage
from lmqtt.store.message import (CHUNK_CQ, CHUNK_KEYED, CHUNK_RUNS, CHUNK_SIZES, CHUNK_STARTS,
                                 DR_DISPATCH_QUEUES, DR_PHYS, DR_STORE_TS, RECENT_FIELDS, RF_FLAGS,
                                 RF_QUEUE_OFFSET, DispatchRequest)
from lmqtt.store.record import HEADER_FIELDS, HEADER_SIZE, decode
from tests.store.accel_support import swapped

STORE_TS_S = 1_700_000_000.123
STORE_TS = int(STORE_TS_S * 1000)
SEG = 1 << 20


def new_log(tmp_path, name, seg=SEG):
    cl = CommitLog(StoreConfig(data_dir=str(tmp_path / name), segment_size=seg, max_message_size=min(4096, seg // 2),
                               preallocate=False), "0" * 16)
    cl.group_commit = types.SimpleNamespace(current=None)   # what append_* read when given no future
    return cl


def sample_messages(seed=7, n=60):
    """Messages covering every field the header carries: several topics (one non-ASCII), keys,
    dispatch queues, props, queue ids, flags, born times, bytes and bytearray bodies."""
    rng = random.Random(seed)
    topics = ["a", "site/1/dev2/temp", "é/ü", "b/c"]
    out = []
    for i in range(n):
        t = rng.choice(topics)
        body = os.urandom(rng.randint(0, 200))
        if i % 7 == 3:
            body = bytearray(body)
        out.append(Message(t, body, queue_id=rng.choice([0, 1, 7]), flags=rng.choice([0, 5, 2**32 - 1]),
                           props=rng.choice([b"", b"\x01qos=1", os.urandom(9)]),
                           keys=rng.choice([(), ("k1",), ("k1", "k2")]), born_ts=1_600_000_000_000 + i,
                           dispatch_queues=rng.choice([(), (t,), (t, "site/#", "+/+/#")])))
    return out


def bytes_by_append_one(tmp_path, msgs, monkeypatch):
    cl = new_log(tmp_path, "one")
    monkeypatch.setattr(commitlog.time, "time", lambda: STORE_TS_S)
    for m in msgs:
        cl.append_one(m, None, "x")
    mf = cl.mfq.find(0)
    return bytes(mf.mm[0:cl.wrote])


def bytes_by(tmp_path, name, msgs, fast):
    cl = new_log(tmp_path, name)
    if fast is None:
        r = encoding.encode_py(cl, msgs, 0, SEG, STORE_TS, False)
    else:
        r = fast.encode(msgs, cl, cl._topic_cache, cl._names_cache, cl.queue_table, 0, SEG, SEG, STORE_TS,
                        cl.cfg.max_message_size, False)
    chunks = r[0]
    assert len(chunks) == 1 and chunks[0][0] == 0
    return bytes(chunks[0][1])


def test_append_one_writes_the_same_bytes_as_the_batch_encoders(tmp_path, monkeypatch):
    msgs = sample_messages()
    one = bytes_by_append_one(tmp_path, msgs, monkeypatch)
    py = bytes_by(tmp_path, "py", msgs, None)
    assert one == py
    if commitlog._fast is not None:
        assert bytes_by(tmp_path, "c", msgs, commitlog._fast) == py
    # and the bytes are the records asked for (so the three cannot agree on something wrong)
    pos = 0
    for i, m in enumerate(msgs):
        sm = decode(py, pos, pos, "0" * 16)
        assert (sm.topic, bytes(sm.body), sm.props, sm.queue_id, sm.flags, sm.keys, sm.born_ts,
                sm.dispatch_queues, sm.store_ts) == (m.topic, bytes(m.body), m.props, m.queue_id, m.flags,
                                                     m.keys, m.born_ts, m.dispatch_queues, STORE_TS)
        pos += sm.size
    assert pos == len(py)


def test_append_one_across_a_segment_end_falls_back_to_the_batch_path(tmp_path, monkeypatch):
    cl = new_log(tmp_path, "small", seg=4096)
    monkeypatch.setattr(commitlog.time, "time", lambda: STORE_TS_S)
    ends = [cl.append_one(Message("t", b"x" * 1000), None, "x")[1] for _ in range(5)]
    assert ends[3] == 4096 + (HEADER_SIZE + 1 + 1000)   # the 4th record did not fit: filler, next segment
    assert [cl.read(p).queue_offset for p in (0, 4096)] == [0, 3]


def test_chunk_and_dispatch_request_positions_name_the_columns(tmp_path, monkeypatch):
    cl = new_log(tmp_path, "cols")
    monkeypatch.setattr(commitlog.time, "time", lambda: STORE_TS_S)
    res, _ = cl.append_batch([Message("a", b"1", keys=("k",), dispatch_queues=("a", "#")),
                              Message("a", b"22", keys=("k",), dispatch_queues=("a", "#"))], None, "x")
    chunk = res._chunk
    assert len(chunk) == CHUNK_CQ + 1
    assert chunk[CHUNK_SIZES] == [HEADER_SIZE + 1 + 1 + 3 + 1, HEADER_SIZE + 1 + 1 + 3 + 2]  # topic, key, "a\0#", body
    assert chunk[CHUNK_STARTS] == [0] and chunk[CHUNK_KEYED] is True
    run = chunk[CHUNK_RUNS][0]
    assert type(run) is DispatchRequest
    assert (run[DR_PHYS], run[DR_STORE_TS], run[DR_DISPATCH_QUEUES]) == (0, STORE_TS, ("a", "#"))


def test_append_one_hands_dispatch_a_chunk_of_the_same_shape(tmp_path, monkeypatch):
    """The live hand-off of append_one and of append_batch: one chunk shape, all five columns."""
    cl = new_log(tmp_path, "live")
    cl.live_enabled, cl.live_cap = True, 1000
    monkeypatch.setattr(commitlog.time, "time", lambda: STORE_TS_S)
    cl.append_batch([Message("a", b"1")], None, "x")
    cl.append_one(Message("a", b"22", keys=("k",), dispatch_queues=("a", "#")), None, "x")
    (_, end0, batch_chunk), (start1, end1, one_chunk) = cl.live
    assert start1 == end0 and cl.live_count == 2
    assert len(one_chunk) == len(batch_chunk) == CHUNK_CQ + 1
    size = HEADER_SIZE + 1 + 1 + 3 + 2
    assert (one_chunk[CHUNK_SIZES], one_chunk[CHUNK_STARTS], one_chunk[CHUNK_KEYED]) == ([size], [0], True)
    assert one_chunk[CHUNK_CQ] is None            # the ConsumeQueue dispatcher packs it from the run
    run = one_chunk[CHUNK_RUNS][0]
    assert type(run) is DispatchRequest and end1 == start1 + size
    assert (run[DR_PHYS], run[DR_STORE_TS], run[DR_DISPATCH_QUEUES]) == (start1, STORE_TS, ("a", "#"))


def recent_of_append_one(tmp_path, msgs, monkeypatch):
    cl = new_log(tmp_path, "recent-one")
    cl.keep_recent(1 << 20, 10_000)
    monkeypatch.setattr(commitlog.time, "time", lambda: STORE_TS_S)
    for m in msgs:
        cl.append_one(m, None, "x")
    return [(p, cl._recent[p]) for p in sorted(cl._recent)]


def recent_of_batch(tmp_path, name, msgs, fast):
    cl = new_log(tmp_path, name)
    if fast is None:
        r = encoding.encode_py(cl, msgs, 0, SEG, STORE_TS, True)
    else:
        r = fast.encode(msgs, cl, cl._topic_cache, cl._names_cache, cl.queue_table, 0, SEG, SEG, STORE_TS,
                        cl.cfg.max_message_size, True)
    return list(zip(r[7], r[8]))


def test_recent_fields_hold_what_their_names_say(tmp_path, monkeypatch):
    """Every writer keeps a recent record's fields at the positions RECENT_FIELDS names (read()
    unpacks them in that order): each slot equals the decoded record's field of that name."""
    msgs = sample_messages(seed=11)
    py_bytes = bytes_by(tmp_path, "ref", msgs, None)
    writers = {"append_one": recent_of_append_one(tmp_path, msgs, monkeypatch),
               "encode_py": recent_of_batch(tmp_path, "recent-py", msgs, None)}
    if commitlog._fast is not None:
        writers["c"] = recent_of_batch(tmp_path, "recent-c", msgs, commitlog._fast)
    kept = sum(type(m.body) is bytes for m in msgs)   # bytearray bodies are not kept (mutable)
    for name, recent in writers.items():
        assert len(recent) == kept, name
        for phys, t in recent:
            sm = decode(py_bytes, phys, phys, "0" * 16)
            assert len(t) == len(RECENT_FIELDS)
            assert {f: t[i] for i, f in enumerate(RECENT_FIELDS)} == {f: getattr(sm, f) for f in RECENT_FIELDS}, name


def test_read_of_a_kept_record_equals_the_record_read_from_the_log(tmp_path, monkeypatch):
    """CommitLog.read() rebuilds a kept record from its recent tuple with one positional unpack
    (RECENT_FIELDS order): it must give the very StoredMessage that decoding the log gives, for
    records kept by append_one and by append_batch."""
    msgs = sample_messages(seed=12)
    cl = new_log(tmp_path, "read-kept")
    cl.keep_recent(1 << 20, 10_000)
    monkeypatch.setattr(commitlog.time, "time", lambda: STORE_TS_S)
    for m in msgs[: len(msgs) // 2]:
        cl.append_one(m, None, "x")
    cl.append_batch(msgs[len(msgs) // 2:], None, "x")
    kept = sorted(cl._recent)
    assert len(kept) == sum(type(m.body) is bytes for m in msgs) > 0
    from_recent = [cl.read(p) for p in kept]
    cl._recent.clear()
    assert from_recent == [cl.read(p) for p in kept]


def test_rf_positions_are_those_of_recent_fields():
    assert (RECENT_FIELDS[RF_QUEUE_OFFSET], RECENT_FIELDS[RF_FLAGS]) == ("queue_offset", "flags")


# ------------------------------------------------------------------ the C encoder's layout check
needs_c = pytest.mark.skipif(encoding.c_encoder is None, reason="C encoder not built or LMQTT_PURE_PYTHON set")


@pytest.fixture
def c_mod():
    mod = encoding.c_encoder
    yield mod
    encoding.configure_c(mod)   # whatever a test did, leave the module configured as at import


@needs_c
@pytest.mark.parametrize("change,words", [
    ({"header_size": HEADER_SIZE + 2}, "header_size"),
    ({"header_format": "<IIIIIQQQQQIIHHHH"}, "fields"),
    ({"header_format": "<IIIIIQQQQQIIHIH"}, "offset"),
    # two fields of one width swapped: the offsets agree, the names do not
    ({"header_fields": swapped(HEADER_FIELDS, "born_ts", "store_ts")},
     "record header field 7 is 'store_ts', this encoder writes born_ts there"),
    ({"header_fields": HEADER_FIELDS[:-1]}, "record header has 14 field names, this encoder writes 15"),
    ({"header_fields": None}, "no tuple of record header field names"),
    ({"crc_start": 8}, "crc_start"),
    ({"min_blank": 4}, "min_blank"),
    ({"blank_magic": encoding.LAYOUT["msg_magic"]}, "magic"),
    ({"cq_entry_format": "<QQQ"}, r"ConsumeQueue entry field 1 \(size\) is 8 bytes at offset 8"),
    ({"cq_entry_fields": swapped(ENTRY_FIELDS, "phys_offset", "tags_code")},
     "ConsumeQueue entry field 0 is 'tags_code', this encoder writes phys_offset there"),
    ({"ti_dq": 10}, "ti_dq"),
    ({"recent_fields": RECENT_FIELDS[:-1]}, "recent record has 10 field names, this encoder writes 11"),
    ({"recent_fields": RECENT_FIELDS[:-1] + ("topic",)},
     "recent record field 10 is 'topic', this encoder writes dispatch_queues there"),
    # the order too: read() unpacks the tuple in RECENT_FIELDS order, the C loop fills one order only
    ({"recent_fields": swapped(RECENT_FIELDS, "queue_offset", "flags")},
     "recent record field 4 is 'flags', this encoder writes queue_offset there"),
    ({"recent_fields": None}, "no tuple of recent record field names"),
])
def test_the_c_encoder_refuses_a_layout_it_does_not_write(c_mod, change, words, tmp_path):
    with pytest.raises(ValueError, match=words):
        encoding.configure_c(c_mod, {**encoding.LAYOUT, **change})
    cl = new_log(tmp_path, "x")
    with pytest.raises(RuntimeError, match="configure"):   # unusable until configured again
        c_mod.encode([Message("a", b"")], cl, cl._topic_cache, cl._names_cache, cl.queue_table, 0, SEG, SEG,
                     STORE_TS, 4096, False)


@needs_c
def test_the_c_encoder_reads_the_topic_info_slots_it_is_given(c_mod, tmp_path):
    """Hand it the tags-code slot as the topic-length slot: the tags code it writes changes."""
    cl = new_log(tmp_path, "ti")
    msgs = [Message("a/b", b"x")]
    args = (0, SEG, SEG, STORE_TS, 4096, False)
    good = c_mod.encode(msgs, cl, cl._topic_cache, cl._names_cache, {}, *args)[3][0]
    encoding.configure_c(c_mod, {**encoding.LAYOUT, "ti_tags": encoding.TI_TOPIC_LEN})
    moved = c_mod.encode(msgs, cl, cl._topic_cache, cl._names_cache, {}, *args)[3][0]
    assert good.tags_code == cl._topic_cache["a/b"][encoding.TI_TAGS] and moved.tags_code == 3


@needs_c
def test_the_c_encoder_checks_dispatch_request_field_order(c_mod):
    from collections import namedtuple
    fields = list(DispatchRequest._fields)
    fields[1], fields[2] = fields[2], fields[1]
    Swapped = namedtuple("Swapped", fields)
    with pytest.raises(ValueError, match="DispatchRequest._fields"):
        c_mod.configure(Swapped, InvalidMessage, lambda *a: None, Message, encoding.LAYOUT)


@needs_c
def test_the_c_encoder_writes_the_magic_numbers_it_is_given(c_mod, tmp_path):
    """The magic is handed over, not compiled in: another value shows up in the bytes."""
    encoding.configure_c(c_mod, {**encoding.LAYOUT, "msg_magic": 0x01020304})
    cl = new_log(tmp_path, "m")
    r = c_mod.encode([Message("a", b"")], cl, cl._topic_cache, cl._names_cache, cl.queue_table, 0, SEG, SEG,
                     STORE_TS, 4096, False)
    assert bytes(r[0][0][1])[4:8] == (0x01020304).to_bytes(4, "little")


# ------------------------------------------------------------------ the loader
def test_accel_load_honours_pure_python(monkeypatch):
    monkeypatch.setenv("LMQTT_PURE_PYTHON", "1")
    assert accel.pure_python() is True
    assert accel.load("json") is None
    monkeypatch.setenv("LMQTT_PURE_PYTHON", "0")
    assert accel.load("json") is not None
    monkeypatch.delenv("LMQTT_PURE_PYTHON")
    assert accel.load("json") is not None
    assert accel.load("lmqtt.store._no_such_accelerator") is None

