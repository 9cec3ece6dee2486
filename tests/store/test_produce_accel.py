"""The PRODUCE codec's C loops (store/_produce.c) against their Python references in
store/produce.py: the store's unpack of a PRODUCE body into Messages on arbitrary and damaged
bodies (same Messages, same shared objects, same ProtocolError), the PRODUCED answer from real
appends' columns, and a gateway's pack of Messages (same bytes; what C leaves to the reference
still packs or raises as the reference does). A difference here is a store that stores other
messages, or answers other offsets, than the reference path would."""
from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings, strategies as st

from lmqtt.store import Message, MessageStore, accel, produce, protocol as W
from tests.store.accel_support import run_unconfigured
from tests.store.test_fastpath import cfg, fields, random_items, route

_C = accel.load("lmqtt.store._produce")
needs_c = pytest.mark.skipif(_C is None, reason="lmqtt.store._produce not built (or LMQTT_PURE_PYTHON set)")


@pytest.mark.skipif(os.environ.get("LMQTT_PURE_PYTHON", "") not in ("", "0"),
                    reason="LMQTT_PURE_PYTHON is set: the C loops are off on purpose")
def test_the_c_loops_are_built_and_used():
    assert _C is not None, "lmqtt.store._produce was not built: `pip install -e .` needs a C compiler"
    assert produce.produce_messages is _C.produce_messages


def outcome(fn, *args):
    """(pid, seq, message fields) or the ProtocolError's (code, message)."""
    try:
        pid, seq, msgs = fn(*args)
    except W.ProtocolError as e:
        return ("error", e.code, str(e))
    return pid, seq, [fields(m) for m in msgs]


def body_of(items, pid="prod", seq=7):
    return W.encode_produce(pid, seq, len(items), W.encode_messages_for_produce(items))


item = st.tuples(st.sampled_from(["a/x", "a/y", "b", "ü/ñ", "", "x" * 300]), st.binary(max_size=40),
                 st.sampled_from([(), ("k",), ("k1", "k2"), ("", "ü")]), st.sampled_from([b"", b"\x01\x02", b"\0" * 9]),
                 st.integers(0, 2 ** 32 - 1), st.sampled_from([0, 1, 2 ** 64 - 1, 1_700_000_000_000]))


@needs_c
@settings(max_examples=500, deadline=None)
@given(items=st.lists(item, max_size=30), pid=st.text(max_size=5), seq=st.integers(0, 2 ** 64 - 1),
       cut=st.integers(0, 60), flip=st.integers(0, 1 << 20), junk=st.binary(max_size=6),
       how=st.sampled_from(["intact", "cut", "flip", "junk", "count"]), with_route=st.booleans())
def test_produce_messages_equals_its_reference(items, pid, seq, cut, flip, junk, how, with_route):
    body = body_of(items, pid, seq)
    if how == "cut":
        body = body[:max(0, len(body) - cut)]
    elif how == "flip" and body:
        i = flip % len(body)
        body = body[:i] + bytes([body[i] ^ (1 + flip % 255)]) + body[i + 1:]
    elif how == "junk":
        body += junk
    elif how == "count" and len(body) >= 2 + len(pid.encode()) + 12:
        at = 2 + len(pid.encode()) + 8          # the message count, after the producer id and seq
        body = body[:at] + (len(items) + 1 + cut).to_bytes(4, "big") + body[at + 4:]
    r = route if with_route else None
    assert outcome(_C.produce_messages, body, r, 99) == outcome(produce.produce_messages_py, body, r, 99)


@needs_c
def test_produce_messages_share_one_decode_per_shape_and_one_route_per_topic():
    calls = []

    def counting(topic):
        calls.append(topic)
        return route(topic)

    items = [("a/x", b"1", (), b"", 0, 0), ("a/x", b"2", (), b"", 0, 0), ("a/x", b"3", ("k",), b"", 0, 0),
             ("b", b"4", (), b"", 0, 5), ("a/x", b"5", (), b"", 1, 0)]
    _pid, _seq, msgs = _C.produce_messages(body_of(items), counting, 99)
    assert calls == ["a/x", "b"]
    assert msgs[0].topic is msgs[1].topic is msgs[4].topic and msgs[0].keys is msgs[1].keys
    assert msgs[0].dispatch_queues is msgs[2].dispatch_queues
    assert [m.born_ts for m in msgs] == [99, 99, 99, 5, 99] and [m.queue_id for m in msgs] == [0, 0, 0, 0, 1]
    assert type(msgs[0]) is Message and msgs[2].keys == ("k",)


@needs_c
@pytest.mark.parametrize("body, message", [
    (b"", "PRODUCE body truncated"),
    (b"\x00", "PRODUCE body truncated"),
    (b"\x00\x05ab", "PRODUCE body truncated"),                 # the producer id runs past the end
    (b"\x00\x01\xff" + bytes(12), "PRODUCE topic/key/producer id is not UTF-8"),
    (b"\x00\x00" + bytes(8) + (1).to_bytes(4, "big") + bytes(21), "PRODUCE body truncated"),
    (b"\x00\x00" + bytes(8) + (1).to_bytes(4, "big") + bytes(6) + b"\xff\xff\xff\xff" + bytes(12),
     "PRODUCE body truncated inside a message"),
    (b"\x00\x00" + bytes(8) + (0).to_bytes(4, "big") + b"xyz", "PRODUCE body has 3 bytes after its 0 messages"),
    (b"\x00\x00" + bytes(8) + (2 ** 32 - 1).to_bytes(4, "big"), "PRODUCE body truncated"),  # a count that lies
])
def test_a_malformed_body_is_refused_as_the_reference_refuses_it(body, message):
    with pytest.raises(W.ProtocolError) as got:
        _C.produce_messages(body, route, 1)
    with pytest.raises(W.ProtocolError) as ref:
        produce.produce_messages_py(body, route, 1)
    assert (got.value.code, str(got.value)) == (ref.value.code, str(ref.value)) == (W.E_BAD_FRAME, message)


@needs_c
def test_an_error_of_the_router_reaches_the_caller():
    def broken(topic):
        raise LookupError(f"no route for {topic}")

    with pytest.raises(LookupError, match="no route for a/x"):
        _C.produce_messages(body_of([("a/x", b"1", (), b"", 0, 0)]), broken, 1)


@needs_c
def test_produced_body_equals_its_reference_on_real_appends(tmp_path):
    rng = random.Random(11)
    with MessageStore(cfg(tmp_path)) as s:
        for n in (2, 3, 40, 300):       # (one message is appended alone: no columns)
            for _ in range(4):
                msgs = [Message(t, b, q, 0, p, k, born) for t, b, k, p, q, born in random_items(rng, n)]
                rs = s.append_batch(msgs)
                chunk = rs._chunk
                assert _C.produced_body(chunk[0], chunk[1], chunk[2]) == \
                    produce.produced_body_py(chunk[0], chunk[1], chunk[2]) == \
                    W.encode_produced([(r.phys_offset, r.queue_offset) for r in rs])
        # runs cut by segment ends (64 KiB segments): one topic, many records
        rs = s.append_batch([Message("solo/t", b"x" * 900) for _ in range(300)])
        chunk = rs._chunk
        assert _C.produced_body(chunk[0], chunk[1], chunk[2]) == produce.produced_body_py(chunk[0], chunk[1], chunk[2])


@needs_c
def test_produced_body_refuses_columns_that_do_not_hold_together():
    dr = (0, 10, "t", 0, 5, 0, 0, 0, 0, (), ())
    with pytest.raises(ValueError, match="run start"):
        _C.produced_body([10, 10], [1, 0], [dr, dr])
    with pytest.raises(OverflowError):
        _C.produced_body([10, 10], [0], [(2 ** 64 - 5,) + dr[1:]])
    with pytest.raises(TypeError, match="DispatchRequest"):
        _C.produced_body([10], [0], [(1, 2)])


def pending(topic, body, keys, props, qid, born):
    return Message(topic, body, qid, 0, props, keys, born)


@needs_c
@settings(max_examples=300, deadline=None)
@given(items=st.lists(item, max_size=20))
def test_encode_messages_equals_its_reference(items):
    msgs = [pending(*it) for it in items]
    assert _C.encode_messages(msgs) == produce.encode_produce_messages_py(msgs) == \
        W.encode_messages_for_produce(items)


@needs_c
@pytest.mark.parametrize("change", ["long_topic", "long_props", "qid", "negative_born", "bytearray_body",
                                    "surrogate", "not_a_message", "list_keys", "key_not_str"])
def test_what_c_does_not_pack_is_packed_or_refused_by_the_reference(change):
    m = pending("a/b", b"body", ("k",), b"p", 1, 5)
    if change == "long_topic":
        m.topic = "t" * 70000
    elif change == "long_props":
        m.props = b"p" * 70000
    elif change == "qid":
        m.queue_id = 2 ** 32
    elif change == "negative_born":
        m.born_ts = -1
    elif change == "bytearray_body":
        m.body = bytearray(b"body")
    elif change == "surrogate":
        m.topic = "a\udc80"
    elif change == "list_keys":
        m.keys = ["k"]
    elif change == "key_not_str":
        m.keys = (b"k",)
    msgs = [pending("ok", b"1", (), b"", 0, 0), m if change != "not_a_message" else _Other()]
    assert _C.encode_messages(msgs) is None and produce.encode_within(msgs, 0) is None
    try:
        ref = produce.encode_produce_messages_py(msgs)
    except Exception as e:  # noqa: BLE001 - what the reference does is what a gateway does
        ref = type(e)
    assert ref == {"long_topic": W.struct.error, "long_props": W.struct.error, "qid": W.struct.error,
                   "negative_born": W.struct.error, "surrogate": UnicodeEncodeError,
                   "key_not_str": TypeError}.get(change, ref)


@needs_c
def test_a_message_past_the_limit_is_left_to_the_callers_check():
    msgs = [pending("ok", b"1", (), b"", 0, 0), pending("a/ü", b"x" * 90, ("key" * 20,), b"pp", 0, 0)]
    limit = len("a/ü".encode()) + 2 + 90           # topic, props and body bytes (keys are not counted)
    assert _C.encode_messages(msgs, limit - 1) is None
    assert _C.encode_messages(msgs, limit) == produce.encode_produce_messages_py(msgs) == _C.encode_messages(msgs)


class _Other:
    """Not a Message, with its fields: the reference packs it, C leaves it to the reference."""
    topic, body, keys, props, queue_id, born_ts = "o", b"x", (), b"", 0, 0


@needs_c
def test_a_subclass_of_message_is_packed_from_its_slots():
    class Pending(Message):
        __slots__ = ("extra",)

    m = Pending("a/b", b"body", 3, 0, b"pp", ("k1", "k2"), 77)
    m.extra = object()
    assert _C.encode_messages([m]) == W.encode_messages_for_produce([("a/b", b"body", ("k1", "k2"), b"pp", 3, 77)])


@needs_c
def test_the_c_loops_refuse_to_run_until_configured():
    assert "configure() was not called" in run_unconfigured("lmqtt.store._produce", "m.produced_body([], [], [])")
    assert "configure() was not called" in run_unconfigured("lmqtt.store._produce", "m.encode_messages([])")


@needs_c
@pytest.mark.parametrize("key, value, says", [
    ("msg_head_format", ">HHHIIIQ", "PRODUCE message head format >HHHIIIQ has 7 fields"),
    ("msg_head_format", "<HHHIIQ", "is not big-endian"),
    ("produce_head_format", ">QQ", r"PRODUCE head field 1 \(count\) is 8 bytes"),
    ("message", int, "has no slot topic"),
    ("dispatch_request", tuple, "_fields"),
    ("protocol_error", 3, "needs message"),
])
def test_configure_refuses_a_layout_it_was_not_written_for(key, value, says):
    layout = dict(produce.C_LAYOUT, **{key: value})
    try:
        with pytest.raises((ValueError, AttributeError), match=says):
            _C.configure(layout)
    finally:
        _C.configure(produce.C_LAYOUT)          # configured again for the rest of the session


@pytest.mark.parametrize("unpack", ["c", "reference"])
def test_items_whose_topic_keys_and_props_read_alike_keep_their_own_fields(unpack):
    """Two items whose topic, keys and props bytes are the same run of bytes split elsewhere are two
    messages: the shared decode must not hand the second the first one's split."""
    if unpack == "c" and _C is None:
        pytest.skip("lmqtt.store._produce not built (or LMQTT_PURE_PYTHON set)")
    fn = _C.produce_messages if unpack == "c" else produce.produce_messages_py
    items = [("a/b", b"1", (), b"c", 0, 0), ("a/bc", b"2", (), b"", 0, 0), ("a/b", b"3", ("c",), b"", 0, 0),
             ("a/b", b"4", (), b"c", 0, 0)]
    _pid, _seq, msgs = fn(body_of(items), None, 1)
    assert [(m.topic, m.keys, m.props) for m in msgs] == \
        [("a/b", (), b"c"), ("a/bc", (), b""), ("a/b", ("c",), b""), ("a/b", (), b"c")]
