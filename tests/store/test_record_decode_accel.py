"""The C record decoder (store/_append.c `decode` / `decode_many`) against the Python reference
(`store.record.decode` / `decode_many`): the same StoredMessage field for field, and for a bad
record the same exception class with the same message, on real CommitLog segments (valid records,
every kind of damage, bounds that cut a record short); `CommitLog.read` / `read_many` and
`MessageStore.read_many` give what `read` gives, per item, with either decoder; and the layout
check the C side does at configure_reader(). CI builds the extension, so a missing build fails
here instead of silently measuring the slow path."""
from __future__ import annotations

import os
import random
import types

import pytest

from lmqtt.store import Message, MessageStore, StoreConfig, accel, commitlog, record
from lmqtt.store.commitlog import CommitLog
from lmqtt.store.errors import CorruptRecord, NotVisible
from lmqtt.store.message import StoredMessage
from tests.store.accel_support import swapped

c_decode, c_decode_many = record.c_decode, record.c_decode_many
needs_c = pytest.mark.skipif(c_decode is None, reason="C decoder not built or LMQTT_PURE_PYTHON set")
IDENT = "0A0B0C0D0E0F1011"
SEG = 1 << 16


def test_the_c_decoder_is_built_and_used():
    if accel.pure_python():
        pytest.skip("LMQTT_PURE_PYTHON is set: the C decoder is off on purpose")
    assert c_decode is not None, ("lmqtt.store._append has no decoder: rebuild it "
                                  "(`python3 setup.py build_ext --inplace`)")
    assert record.DECODER == "c" and commitlog._decode is c_decode and commitlog._decode_many is c_decode_many


def new_log(tmp_path, name="log", seg=SEG):
    cl = CommitLog(StoreConfig(data_dir=str(tmp_path / name), segment_size=seg, max_message_size=4096,
                               preallocate=False), IDENT)
    cl.group_commit = types.SimpleNamespace(current=None)
    return cl


def sample_messages(rng, n=80):
    """Every field the header carries: topics (non-ASCII, repeated, one-character), keys,
    dispatch queues, props (repeated and distinct), queue ids, flags, born times, empty bodies."""
    topics = ["a", "site/1/dev2/temp", "é/ü/日本", "b/c", "x" * 300]
    out = []
    for i in range(n):
        t = rng.choice(topics)
        out.append(Message(t, os.urandom(rng.choice([0, 1, 64, 700])), queue_id=rng.choice([0, 1, 2 ** 32 - 1]),
                           flags=rng.choice([0, 5, 2 ** 32 - 1]),
                           props=rng.choice([b"", b"\x01qos=1", os.urandom(rng.randint(1, 30))]),
                           keys=rng.choice([(), ("k1",), ("k1", "ключ")]), born_ts=rng.choice([0, 2 ** 64 - 1, i]),
                           dispatch_queues=rng.choice([(), (t,), (t, "site/#", "+/+/#")])))
    return out


def written(cl, msgs):
    """Append in a few batches (so segments fill and blank fillers appear); [(phys, size)]."""
    out = []
    for k in range(0, len(msgs), 7):
        res, _ = cl.append_batch(msgs[k:k + 7], None, IDENT)
        out += [(r.phys_offset, r.size) for r in res]
    return out


def outcome(fn, *a):
    """What a decode gives: the fields, or (exception class, message)."""
    try:
        m = fn(*a)
    except Exception as e:   # noqa: BLE001 - compared
        return type(e), str(e)
    assert type(m) is StoredMessage
    return tuple(m)


def items(lst):
    return [(type(x), str(x)) if isinstance(x, Exception) else tuple(x) for x in lst]


@needs_c
def test_c_and_python_decode_every_record_alike(tmp_path):
    rng = random.Random(3)
    cl = new_log(tmp_path)
    msgs = sample_messages(rng)
    where = written(cl, msgs)
    for (phys, size), m in zip(where, msgs):
        mf = cl.mfq.find(phys)
        rel = phys - mf.start_offset
        py = outcome(record.decode, mf.mm, rel, phys, IDENT)
        assert py == outcome(c_decode, mf.mm, rel, phys, IDENT)
        assert py == outcome(c_decode, mf.mm, rel, phys, IDENT, True, rel + size)
        assert py[:3] == (m.topic, bytes(m.body), m.props) and py[11:] == (m.keys, m.dispatch_queues)
        # the same from a slice (what CommitLog.read used to decode) and from a bytearray
        raw = bytearray(mf.mm[rel:rel + size])
        assert py == outcome(c_decode, raw, 0, phys, IDENT) == outcome(record.decode, bytes(raw), 0, phys, IDENT)


def damaged_cases(cl, where):
    """(buffer, pos, phys, end) that fail, one per check, plus a good one."""
    phys, size = where[3]
    mf = cl.mfq.find(phys)
    rel = phys - mf.start_offset
    raw = bytes(mf.mm[rel:rel + size])
    cases = [(raw, 0, phys, None)]
    for i in (0, 4, 12, 30, 60, 68, record.HEADER_SIZE, size - 1):   # size, magic, qid, phys, lengths, data
        bad = bytearray(raw)
        bad[i] ^= 0x41
        cases.append((bytes(bad), 0, phys, None))
    cases += [(raw, 0, phys + 1, None),                 # another offset than the stored one
              (raw[:size - 1], 0, phys, None),          # cut short
              (raw, 0, phys, size - 1),                 # bounded short
              (raw, 0, phys, 10),                       # not even a header
              (raw, size - 5, phys, None),              # header past the end
              (b"\0" * 200, 0, phys, None),             # zeroes (a hole)
              (raw, 0, phys, size + 100)]               # an end past the buffer: the buffer's
    return cases


@needs_c
def test_c_and_python_refuse_damaged_records_alike(tmp_path):
    cl = new_log(tmp_path)
    where = written(cl, sample_messages(random.Random(5), 12))
    kinds = set()
    for buf, pos, phys, end in damaged_cases(cl, where):
        py = outcome(record.decode, buf, pos, phys, IDENT, True, end)
        assert py == outcome(c_decode, buf, pos, phys, IDENT, True, end)
        if type(py[0]) is type:
            assert py[0] is CorruptRecord
            kinds.add(py[1].split(": ")[-1][:12] if ": " in py[1] else py[1][:12])
        # with verify=False the CRC is not checked, the rest is
        assert outcome(record.decode, buf, pos, phys, IDENT, False, end) == \
            outcome(c_decode, buf, pos, phys, IDENT, False, end)
    assert len(kinds) >= 4, kinds      # header past the end, magic, framing, CRC all seen


@needs_c
def test_decode_many_agrees_and_stops_at_the_segment_end(tmp_path):
    rng = random.Random(11)
    cl = new_log(tmp_path, seg=8192)
    where = written(cl, sample_messages(rng, 120))
    assert len(cl.mfq.files) > 3
    # ask for some records twice, with a wrong size, and one at a wrong offset
    wanted = list(where)
    wanted.insert(5, (where[5][0], where[5][1] - 1))
    wanted.insert(9, (where[9][0], 10))
    wanted.insert(12, (where[12][0] + 1, where[12][1]))
    wanted.insert(20, (where[20][0], 1 << 20))
    wanted.append(where[0])
    mf = cl.mfq.files[1]
    start = next(i for i, w in enumerate(wanted) if w[0] >= mf.start_offset)
    out_py, out_c = [], []
    j_py = record.decode_many(mf.mm, mf.start_offset, wanted, start, IDENT, out_py)
    j_c = c_decode_many(mf.mm, mf.start_offset, wanted, start, IDENT, out_c)
    assert j_py == j_c and wanted[j_c][0] >= mf.end_offset
    assert items(out_py) == items(out_c) and len(out_c) == j_c - start
    for buf_first in (0,):
        whole = cl.mfq.files[0]
        a, b = [], []
        assert record.decode_many(whole.mm, 0, wanted, buf_first, IDENT, a) == \
            c_decode_many(whole.mm, 0, wanted, buf_first, IDENT, b)
        assert items(a) == items(b)
        assert any(isinstance(x, CorruptRecord) for x in a)


@needs_c
def test_decoded_messages_are_left_out_of_the_garbage_collectors_scans(tmp_path):
    """A StoredMessage holds only str, bytes, int and tuples of str: it can never be in a
    reference cycle, but as a tuple subclass the collector would scan it in every collection it
    lives through (the light queues' cache holds hundreds of thousands). The C decoder hands them
    over untracked; their fields are what the Python reference decodes."""
    import gc
    rng = random.Random(5)
    cl = new_log(tmp_path, seg=8192)
    where = written(cl, sample_messages(rng, 60))
    mf = cl.mfq.files[0]
    out_c, out_py = [], []
    c_decode_many(mf.mm, 0, where, 0, IDENT, out_c)
    record.decode_many(mf.mm, 0, where, 0, IDENT, out_py)
    assert out_c and items(out_c) == items(out_py)
    for m in out_c:
        assert not gc.is_tracked(m), m
        assert not gc.is_tracked(m.dispatch_queues) and not gc.is_tracked(m.keys)
    one = c_decode(mf.mm, where[0][0], where[0][0], IDENT)
    assert not gc.is_tracked(one)


@needs_c
@pytest.mark.parametrize("which", ["python", "c"])
def test_commitlog_read_many_is_read_per_item(tmp_path, monkeypatch, which):
    if which == "python":
        monkeypatch.setattr(commitlog, "_decode", record.decode)
        monkeypatch.setattr(commitlog, "_decode_many", record.decode_many)
    rng = random.Random(17)
    cl = new_log(tmp_path, seg=8192)
    msgs = sample_messages(rng, 150)
    where = written(cl, msgs)
    cl.keep_recent(0, 0)
    wanted = [where[i] for i in rng.sample(range(len(where)), 60)] + where[:30] + [
        (where[3][0], where[3][1] + 8), (cl.wrote + 10 ** 9, 100), (where[7][0] + 2, where[7][1])]

    def one(phys, size):
        try:
            return tuple(cl.read(phys, size))
        except Exception as e:   # noqa: BLE001
            return type(e), str(e)
    assert items(cl.read_many(wanted)) == [one(p, s) for p, s in wanted]
    got = cl.read_many(where)
    assert [(m.topic, bytes(m.body), m.props, m.keys, m.dispatch_queues) for m in got] == \
        [(m.topic, bytes(m.body), m.props, m.keys, m.dispatch_queues) for m in msgs]
    # a segment deleted meanwhile (retention): its records are NotVisible, the others are served
    gone = cl.mfq.files[0]
    gone.close()
    out = cl.read_many([where[0], where[-1]])
    assert isinstance(out[0], NotVisible) and out[1].phys_offset == where[-1][0]
    with pytest.raises(NotVisible):
        cl.read(*where[0])


@needs_c
def test_commitlog_read_serves_the_same_with_either_decoder(tmp_path, monkeypatch):
    cl = new_log(tmp_path)
    where = written(cl, sample_messages(random.Random(23), 40))
    cl.keep_recent(0, 0)
    c_got = [tuple(cl.read(p)) for p, _ in where] + [tuple(cl.read(p, s)) for p, s in where]
    monkeypatch.setattr(commitlog, "_decode", record.decode)
    assert c_got == [tuple(cl.read(p)) for p, _ in where] + [tuple(cl.read(p, s)) for p, s in where]
    for dec in (record.decode, c_decode):
        monkeypatch.setattr(commitlog, "_decode", dec)
        with pytest.raises(CorruptRecord, match="inconsistent framing"):
            cl.read(where[2][0], where[2][1] - 1)
        with pytest.raises(CorruptRecord, match="no valid record"):
            cl.read(where[2][0], 3)


def test_message_store_read_many_refuses_what_read_refuses(tmp_path):
    st = MessageStore(StoreConfig(data_dir=str(tmp_path / "st"), segment_size=SEG, max_message_size=4096,
                                 preallocate=False))
    st.start()
    try:
        res = st.append_batch([Message(f"t/{i}", b"x" * i, props=b"p") for i in range(20)])
        assert st.wait_dispatched(st.max_offset, 10)
        wanted = [(r.phys_offset, r.size) for r in res]
        wanted.append((st.max_offset + 500, 80))          # past the dispatched end
        got = st.read_many(wanted)
        assert [m.body for m in got[:-1]] == [b"x" * i for i in range(20)]
        assert isinstance(got[-1], NotVisible)
        with pytest.raises(NotVisible):
            st.read(*wanted[-1])
        assert [tuple(m) for m in got[:-1]] == [tuple(st.read(p, s)) for p, s in wanted[:-1]]
    finally:
        st.shutdown()


# ------------------------------------------------------------------ the C decoder's layout check
@pytest.fixture
def c_mod():
    from lmqtt.store import _append
    yield _append
    _append.configure_reader(StoredMessage, CorruptRecord, record.READ_LAYOUT)


@needs_c
@pytest.mark.parametrize("change,words", [
    ({"header_size": record.HEADER_SIZE + 2}, "header_size"),
    ({"header_format": "<IIIIIQQQQQIIHHHH"}, "fields"),
    ({"header_format": "<IIIIIQQQQQIIHIH"}, "offset"),
    # two fields of one width swapped: the offsets agree, the names do not
    ({"header_fields": swapped(record.HEADER_FIELDS, "queue_offset", "phys_offset")},
     "record header field 5 is 'phys_offset', this decoder reads queue_offset there"),
    ({"header_fields": None}, "no tuple of record header field names"),
    ({"crc_start": 8}, "crc_start"),
    ({"msg_magic": -1}, "msg_magic"),
])
def test_the_c_decoder_refuses_a_layout_it_does_not_read(c_mod, change, words, tmp_path):
    with pytest.raises(ValueError, match=words):
        c_mod.configure_reader(StoredMessage, CorruptRecord, {**record.READ_LAYOUT, **change})
    with pytest.raises(RuntimeError, match="configure_reader"):   # unusable until configured again
        c_mod.decode(b"\0" * 100, 0, 0, IDENT)


@needs_c
def test_the_c_decoder_checks_stored_message_field_order(c_mod):
    from collections import namedtuple
    fields = list(StoredMessage._fields)
    fields[1], fields[2] = fields[2], fields[1]
    with pytest.raises(ValueError, match="StoredMessage._fields"):
        c_mod.configure_reader(namedtuple("Swapped", fields), CorruptRecord, record.READ_LAYOUT)


@needs_c
def test_the_c_decoder_reads_the_magic_it_is_given(c_mod, tmp_path):
    cl = new_log(tmp_path)
    phys, size = written(cl, [Message("a", b"z")])[0]
    raw = bytes(cl.mfq.find(0).mm[:size])
    c_mod.configure_reader(StoredMessage, CorruptRecord, {**record.READ_LAYOUT, "msg_magic": 0x01020304})
    with pytest.raises(CorruptRecord, match="no record at offset 0 \\(magic 0x"):
        c_mod.decode(raw, 0, 0, IDENT)


try:
    from hypothesis import HealthCheck, given, settings, strategies as st

    @needs_c
    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.binary(min_size=0, max_size=300), st.integers(0, 120), st.integers(-2, 2 ** 20),
           st.one_of(st.none(), st.integers(-5, 400)), st.booleans())
    def test_c_and_python_agree_on_any_bytes(data, pos, phys, end, verify):
        """Arbitrary bytes at any position and bound: the same fields or the same error."""
        assert outcome(record.decode, data, pos, phys, IDENT, verify, end) == \
            outcome(c_decode, data, pos, phys, IDENT, verify, end)

    @needs_c
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(st.tuples(st.integers(0, 2), st.binary(max_size=90), st.binary(max_size=12)), min_size=1,
                    max_size=20),
           st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=6),
           st.lists(st.tuples(st.integers(-3, 3000), st.integers(-5, 400)), max_size=8))
    def test_c_and_python_agree_on_damaged_segments(tmp_path_factory, recs, flips, extra):
        """Valid records with random bytes flipped, asked for at their offsets and at random ones."""
        cl = new_log(tmp_path_factory.mktemp("h"), seg=8192)
        msgs = [Message(["a/b", "é", "c"][t], body, props=props, dispatch_queues=("q", "r/#") if t else ())
                for t, body, props in recs]
        where = written(cl, msgs)
        mf = cl.mfq.files[0]
        for at, x in flips:
            mf.mm[at] ^= x
        wanted = [w for w in where if w[0] < mf.end_offset] + [(max(0, p), s) for p, s in extra]
        a, b = [], []
        assert record.decode_many(mf.mm, 0, wanted, 0, IDENT, a) == c_decode_many(mf.mm, 0, wanted, 0, IDENT, b)
        assert items(a) == items(b)
except ImportError:   # hypothesis is a test extra; the seeded tests above still run
    pass
