"""The Spark reader's column-wise Arrow conversion (store/spark/columns.py and its C twin) agrees
with the SDK's per-record view (`Record.mqtt`, `Record.msg_id`) for every kind of props a record can
carry, and the C walk equals the Python reference byte for byte, malformed bodies included."""
import datetime as dt
import random
import time

import pytest

from lmqtt.store import protocol as W
from lmqtt.store.client.consumer import decode_messages
from lmqtt.store.client.props import encode_fields
from lmqtt.store.spark import columns as C
from lmqtt.store.spark.source import COLUMNS
from tests.store.accel_support import swapped


def _body(n=40, seed=0):
    props = [b"",                                                        # SDK default: QoS 0
             encode_fields(1, True, "dev-1"),
             encode_fields(2, False, "dev-2", content_type="application/json",
                           user_properties=[("a", "1"), ("b", "2"), ("a", "3")]),   # map: last wins
             b"\x07foreign"]                                             # not our format: QoS 0
    rnd = random.Random(seed)
    recs = [(100 + i, 5000 + 77 * i + rnd.randrange(1 << 40), 1_700_000_000_000 + i, 1_700_000_000_500 + i, 0,
             f"t/{i % 3}/ü", ("k", "k2") if i % 2 else (), props[i % len(props)], bytes([i % 256]) * (i % 300))
            for i in range(n)]
    return W.encode_messages({"next_offset": 100 + n, "min_offset": 0}, [_Rec(*r) for r in recs])


@pytest.mark.parametrize("pure", [False, True], ids=["accelerated", "python"])
def test_arrow_batch_matches_the_sdk_record_view(pure):
    body = _body()
    batch, header, nxt = C.arrow_batch("t:0", "ABCD", body, pure=pure)
    assert header["next_offset"] == 140 and nxt == 140
    batch = batch.to_pylist()
    _h, sdk = decode_messages("ABCD", body)
    assert [c for c in COLUMNS] == list(batch[0])
    for row, r in zip(batch, sdk, strict=True):
        m = r.mqtt
        assert row["topic"] == r.topic and row["payload"] == r.body and row["offset"] == r.queue_offset
        assert (row["qos"], row["retain"], row["client_id"], row["content_type"]) == \
            (m.qos, m.retain, m.client_id, m.content_type)
        assert dict(row["user_properties"]) == dict(m.user_properties)
        assert row["msg_id"] == r.msg_id and row["queue"] == "t:0"
        assert row["born_ts"] == dt.datetime.fromtimestamp(r.born_ts / 1000, dt.timezone.utc)
        assert row["store_ts"] == dt.datetime.fromtimestamp(r.store_ts / 1000, dt.timezone.utc)
    empty, _h, nxt = C.arrow_batch("t:0", "ABCD", W.encode_messages({}, []), pure=pure)
    assert empty.num_rows == 0 and nxt is None
    # a range narrower than the body keeps only the records inside it
    part, _h, nxt = C.arrow_batch("t:0", "ABCD", body, 105, 110, pure=pure)
    assert part.column("offset").to_pylist() == list(range(105, 110)) and nxt == 140


@pytest.mark.skipif(C._C is None, reason="the C accelerator is not built")
def test_c_walk_equals_the_python_reference_byte_for_byte():
    for seed in range(5):
        body = _body(200, seed)
        _h, pos, count = C.split_body(body)
        assert C._C.columns(body, pos, count, b"ID") == C.columns_py(body, pos, count, b"ID")
    # every truncation and a few corruptions: both refuse with ValueError, or agree
    body = _body(5)
    _h, pos, count = C.split_body(body)
    rnd = random.Random(1)
    cases = [body[:k] for k in range(pos, len(body))]
    for _ in range(300):
        b = bytearray(body)
        b[rnd.randrange(pos, len(b))] = rnd.randrange(256)
        cases.append(bytes(b))
    for b in cases:
        outcomes = []
        for fn in (C._C.columns, C.columns_py):
            try:
                outcomes.append(fn(b, pos, count, b"ID"))
            except ValueError:
                outcomes.append("ValueError")
        assert outcomes[0] == outcomes[1]


class _Rec:
    """The attributes `protocol.encode_messages` reads from a stored message."""

    def __init__(self, qo, po, born, st, qid, topic, keys, props, body):
        self.queue_offset, self.phys_offset, self.born_ts, self.store_ts = qo, po, born, st
        self.queue_id, self.topic, self.keys, self.props, self.body = qid, topic, keys, props, body


def _pull(conn, topic, flags):
    from lmqtt.store.client.connection import check_reply
    return check_reply(conn.request(W.OP_PULL, W.encode_pull(topic, 0, 0, 1000, 4 << 20), flags).result(10))


def test_raw_replies_give_the_same_batch_as_the_plain_layout(server):
    """The store answers PULL with F_RAW_OK in its CommitLog record layout: the raw walk (C and
    Python alike) yields exactly the rows of the plain layout."""
    from lmqtt.store.client import connect
    with connect(server.store_address) as c:
        p = c.producer()
        p.send_batch([(f"rawcols/{i % 3}", bytes([i]) * i) for i in range(50)])
        p.send("rawcols/x", b"props", qos=1, retain=True, user_properties={"k": "v"}, content_type="text/plain",
               keys=("key-1",))
        deadline = time.monotonic() + 10                # dispatch is asynchronous to the send
        while c.admin().offsets("rawcols")[1] < 51 and time.monotonic() < deadline:
            time.sleep(0.02)
        _op, f_plain, plain = _pull(c, "rawcols", 0)
        _op, f_raw, raw = _pull(c, "rawcols", W.F_RAW_OK)
        ident = c.ident
    assert not f_plain & W.F_RAW and f_raw & W.F_RAW
    want = C.arrow_batch("rawcols:0", ident, plain)[0]
    for pure in (True, False):
        got, _h, nxt = C.arrow_batch("rawcols:0", ident, raw, raw=True, pure=pure)
        assert got.equals(want) and nxt == 51
    last = want.to_pylist()[-1]
    assert (last["qos"], last["retain"], dict(last["user_properties"]), last["content_type"]) == \
        (1, True, {"k": "v"}, "text/plain")
    if C._C is not None:
        _h, pos, count = C.split_body(raw)
        assert C._C.columns_raw(raw, pos, count, b"ID") == C.columns_raw_py(raw, pos, count, b"ID")
        rnd = random.Random(3)
        cases = [raw[:k] for k in range(pos, len(raw), 7)]
        for _ in range(300):
            b = bytearray(raw)
            b[rnd.randrange(pos, len(b))] = rnd.randrange(256)
            cases.append(bytes(b))
        for b in cases:
            outcomes = []
            for fn in (C._C.columns_raw, C.columns_raw_py):
                try:
                    outcomes.append(fn(b, pos, count, b"ID"))
                except ValueError:
                    outcomes.append("ValueError")
            assert outcomes[0] == outcomes[1]


# ------------------------------------------------------------------ the layouts handed to the C walk
needs_c = pytest.mark.skipif(C._C is None, reason="the C accelerator is not built (or LMQTT_PURE_PYTHON is set)")


@pytest.fixture
def c_walk():
    yield C._C
    C.configure_c(C._C)         # whatever a test did, leave the module configured as at import


def test_the_layouts_handed_over_are_the_stores():
    from lmqtt.store.record import HEADER, HEADER_FIELDS, HEADER_SIZE
    assert C.C_LAYOUT == {"rec_head_format": W.REC_HEAD.format, "rec_head_fields": W.REC_HEAD_FIELDS,
                          "rec_head_size": W.REC_HEAD.size,
                          "raw_head_format": HEADER.format, "raw_head_fields": HEADER_FIELDS,
                          "raw_head_size": HEADER_SIZE}


@needs_c
@pytest.mark.parametrize("change,words", [
    ({"rec_head_format": ">QQQQIHHII"}, r"MESSAGES record head field 7 \(props_len\) is 4 bytes at offset 40"),
    ({"rec_head_format": ">QQQQIHHH"}, "MESSAGES record head format >QQQQIHHH has 8 fields, this walk reads 9"),
    ({"rec_head_format": "<QQQQIHHHI"}, "not big-endian"),
    ({"rec_head_size": 48}, "MESSAGES record head rec_head_size 48"),
    # two fields of one width swapped: the offsets agree, the names do not
    ({"rec_head_fields": swapped(C.C_LAYOUT["rec_head_fields"], "born_ts", "store_ts")},
     "MESSAGES record head field 2 is 'store_ts', this walk reads born_ts there"),
    ({"rec_head_fields": C.C_LAYOUT["rec_head_fields"][:-1]}, "MESSAGES record head has 8 field names"),
    ({"rec_head_fields": None}, "no tuple of MESSAGES record head field names"),
    ({"raw_head_format": "<IIIIIQQQQQIIHHHH"}, "CommitLog record head format .* has 16 fields"),
    ({"raw_head_format": "<IIIIIQQQQQIHHHH"}, r"CommitLog record head field 11 \(props_len\) is 2 bytes"),
    ({"raw_head_format": ">IIIIIQQQQQIIHHH"}, "not little-endian"),
    ({"raw_head_size": 72}, "CommitLog record head raw_head_size 72"),
    ({"raw_head_size": None}, "layout has no int raw_head_size"),
    # two fields of one width swapped: the offsets agree, the names do not
    ({"raw_head_fields": swapped(C.C_LAYOUT["raw_head_fields"], "queue_offset", "phys_offset")},
     "CommitLog record head field 5 is 'phys_offset', this walk reads queue_offset there"),
])
def test_the_c_walk_refuses_a_layout_it_does_not_read(c_walk, change, words):
    with pytest.raises(ValueError, match=words):
        C.configure_c(c_walk, {**C.C_LAYOUT, **change})
    body = _body(3)
    _h, pos, count = C.split_body(body)
    for walk in (c_walk.columns, c_walk.columns_raw):       # unusable until configured again
        with pytest.raises(RuntimeError, match="configure"):
            walk(body, pos, count, b"ID")
    C.configure_c(c_walk)
    assert c_walk.columns(body, pos, count, b"ID") == C.columns_py(body, pos, count, b"ID")


@needs_c
def test_an_unconfigured_walk_refuses_to_run():
    from tests.store.accel_support import run_unconfigured
    for fn in ("columns", "columns_raw"):
        assert "lmqtt.store.spark._columns.configure() was not called" in run_unconfigured(
            "lmqtt.store.spark._columns", f"m.{fn}(b'', 0, 0, b'ID')")
    assert run_unconfigured("lmqtt.store.spark._columns", f"m.configure({C.C_LAYOUT!r}); m.columns(b'', 0, 0, b'ID')") \
        == "ran"
