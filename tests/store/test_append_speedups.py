"""The C encoder (store/_append.c) against the Python reference (`store.encoding.encode_py`): same
bytes, same columns, same queue offsets and the same errors, record for record, on batches that
exercise every branch (runs, keys, dispatch queues, props, body types, segment cuts, the recent
cache), plus the ConsumeQueue blocks only the C encoder builds. CI builds the extension, so a
missing build fails here instead of silently measuring the slow path."""
from __future__ import annotations

import os
import random
import struct
import zlib

import pytest

from lmqtt.store import InvalidMessage, Message, StoreConfig, commitlog, encoding, record
from lmqtt.store.commitlog import CommitLog
from lmqtt.store.consume_queue import ENTRY
from lmqtt.store.errors import InvalidTopic, MessageTooLarge

fast = commitlog._fast
pytestmark = pytest.mark.skipif(os.environ.get("LMQTT_PURE_PYTHON", "") not in ("", "0"),
                                reason="LMQTT_PURE_PYTHON is set: the C encoder is off on purpose")


def test_the_c_encoder_is_built_and_used():
    assert fast is not None, ("lmqtt.store._append was not built: `pip install -e .` needs a C compiler "
                              "(the store falls back to the pure-Python encoder, several times slower)")
    assert commitlog.ENCODER == "c"


def new_log(tmp_path, name, seg=4096):
    return CommitLog(StoreConfig(data_dir=str(tmp_path / name), segment_size=seg,
                                 max_message_size=2048, preallocate=False), "0" * 16)


def encode_both(tmp_path, batches, seg=4096, recent=False):
    """Feed the same batches to a log encoding in C and one encoding in Python, carrying phys,
    segment end and queue table forward as _append_batch does; return both result lists."""
    out = []
    for name, enc in (("c", "fast"), ("py", "python")):
        cl = new_log(tmp_path, name, seg)
        res = []
        phys = 0
        for i, msgs in enumerate(batches):
            seg_end = phys - phys % seg + seg
            try:
                if enc == "fast":
                    r = fast.encode(msgs, cl, cl._topic_cache, cl._names_cache, cl.queue_table, phys,
                                    seg_end, seg, 1_700_000_000_000 + i, cl.cfg.max_message_size, recent)
                    cq, r = r[9], r[:9]
                else:
                    r = encoding.encode_py(cl, msgs, phys, seg_end, 1_700_000_000_000 + i, recent)
                    cq = None
            except Exception as e:   # noqa: BLE001 - compared below
                res.append((type(e), None))
                continue
            chunks, sizes, starts, runs, keyed, assigned, end, roffs, recent_f = r
            chunks = [(c, bytes(b)) for c, b in chunks]
            res.append((chunks, sizes, starts, list(map(tuple, runs)), keyed, assigned, end, roffs,
                        recent_f, cq))
            cl.queue_table.update(assigned)
            phys = end
        out.append(res)
    return out


def random_batches(rng, n_batches=40):
    topics = [f"site/{i % 3}/dev{i}/temp" for i in range(12)] + ["a", "b/c", "é/ü"]
    dqs = {t: (t, "site/#", "+/+/#") for t in topics}
    batches = []
    for _ in range(n_batches):
        b = []
        t = rng.choice(topics)
        for _ in range(rng.randint(1, 30)):
            if rng.random() < 0.4:
                t = rng.choice(topics)         # else: a run of the same topic object
            body = rng.choice([b"", b"x" * rng.randint(1, 300), os.urandom(rng.randint(1, 90))])
            kind = rng.random()
            if kind < 0.1:
                body = bytearray(body)
            elif kind < 0.2:
                body = memoryview(bytes(body))
            b.append(Message(t, body, rng.choice([0, 0, 1, 7]), rng.choice([0, 0, 3]),
                             rng.choice([b"", b"", b"props\x01"]),
                             rng.choice([(), (), ("k1",), ("k1", "k2")]), rng.choice([0, 0, 123456789]),
                             rng.choice([dqs[t], dqs[t], (), (t,)])))
        batches.append(b)
    return batches


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("recent", [False, True])
def test_c_and_python_encoders_agree(tmp_path, seed, recent):
    if fast is None:
        pytest.skip("C encoder not built (see test_the_c_encoder_is_built_and_used)")
    rng = random.Random(seed)
    c, py = encode_both(tmp_path, random_batches(rng), recent=recent)
    for rc, rp in zip(c, py):
        assert rc[:9] == rp[:9]
    # the segment size is small: batches were cut by blank fillers
    assert any(len(r[0]) > 1 for r in c)
    # every record's CRC is zlib's, over bytes 12.. (the C code has its own CRC-32)
    for r in c:
        for start, buf in r[0]:
            pos = 0
            while pos < len(buf):
                total, magic = struct.unpack_from("<II", buf, pos)
                if magic == commitlog.MSG_MAGIC:
                    assert struct.unpack_from("<I", buf, pos + 8)[0] == zlib.crc32(buf[pos + 12:pos + total])
                else:
                    assert magic == record.BLANK_MAGIC
                    break
                pos += total


def test_c_consumequeue_blocks_match_the_runs(tmp_path):
    """The fifth chunk column: per (first level, queue id) the entries the ConsumeQueue would have
    packed from the runs, at the queue offsets the records got."""
    if fast is None:
        pytest.skip("C encoder not built")
    rng = random.Random(99)
    c, _ = encode_both(tmp_path, random_batches(rng))
    for chunks, sizes, starts, runs, keyed, assigned, end, _, _, cq in c:
        expect: dict = {}
        for k, r in enumerate(runs):
            i1 = starts[k + 1] if k + 1 < len(runs) else len(sizes)
            phys, qoff = r[0], r[4]
            fl = r[2].split("/")[0]
            for i in range(starts[k], i1):
                if i > starts[k]:
                    phys += sizes[i - 1]
                    qoff += 1
                e = expect.setdefault((fl, r[3]), [qoff, []])
                assert e[0] + len(e[1]) == qoff
                e[1].append(ENTRY.pack(phys, sizes[i], r[8]))
        assert {k: [v[0], bytearray(b"".join(v[1]))] for k, v in expect.items()} == cq
        assert {k: v[0] + len(v[1]) // 20 for k, v in cq.items()} == assigned


@pytest.mark.parametrize("bad, err", [
    (dict(queue_id=-1), InvalidMessage),
    (dict(queue_id=1 << 32), InvalidMessage),
    (dict(flags="x"), InvalidMessage),
    (dict(born_ts=-5), InvalidMessage),
    (dict(body=None), InvalidMessage),
    (dict(props=123), InvalidMessage),
    (dict(body=b"x" * 5000), MessageTooLarge),
    (dict(topic=""), InvalidTopic),
    (dict(topic="a\x00b"), InvalidTopic),
    (dict(dispatch_queues=("ok", "")), InvalidMessage),
    (dict(keys=("a\x00",)), InvalidMessage),
])
def test_bad_message_raises_the_same_error_from_both_encoders(tmp_path, bad, err):
    if fast is None:
        pytest.skip("C encoder not built")
    good = [Message("t/1", b"a" * 10, dispatch_queues=("t/1",)) for _ in range(3)]
    args = dict(topic="t/2", body=b"b")
    args.update(bad)
    batch = good + [Message(**args)] + good
    c, py = encode_both(tmp_path, [batch])
    assert c[0][0] is py[0][0]
    assert issubclass(c[0][0], err)


class Duck:
    """Not a `Message`, only its attributes (the C encoder then reads them by name)."""

    def __init__(self, topic, body, dq=(), keys=(), props=b"", queue_id=0, flags=0, born_ts=0):
        self.topic, self.body, self.dispatch_queues, self.keys = topic, body, dq, keys
        self.props, self.queue_id, self.flags, self.born_ts = props, queue_id, flags, born_ts


def test_objects_with_message_attributes_encode_alike(tmp_path):
    if fast is None:
        pytest.skip("C encoder not built")
    batch = [Duck("d/1", b"a" * 20, ("d/1", "d/#")), Duck("d/2", bytearray(b"bb"), keys=("k",)),
             Message("d/1", b"c", dispatch_queues=("d/1", "d/#")), Duck("d/1", b"", props=b"p", queue_id=True)]
    c, py = encode_both(tmp_path, [batch, batch[::-1]], recent=True)
    assert c[0][:9] == py[0][:9] and c[1][:9] == py[1][:9]
    missing = [Message("d/1", b"x"), object()]
    c, py = encode_both(tmp_path / "m", [missing])
    assert c[0][0] is py[0][0] is AttributeError
    unhashable = [Duck("d/1", b"x", keys=["k"])]   # a TypeError inside the loop: InvalidMessage
    c, py = encode_both(tmp_path / "u", [unhashable])
    assert c[0][0] is py[0][0] is InvalidMessage


try:
    from hypothesis import HealthCheck, given, settings, strategies as st

    _name = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), min_size=0,
                    max_size=12)
    _num = st.one_of(st.integers(0, 3), st.integers(-2, 2 ** 64 + 1), st.sampled_from([True, 1.0, "1"]))
    _msg = st.builds(Message, _name, st.one_of(st.binary(max_size=400), st.sampled_from([None, "s"])),
                     _num, _num, st.one_of(st.binary(max_size=20), st.just(b"")),
                     st.lists(_name, max_size=2).map(tuple), _num,
                     st.lists(_name, max_size=3).map(tuple))

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(st.lists(_msg, min_size=1, max_size=12), min_size=1, max_size=4), st.booleans())
    def test_c_and_python_encoders_agree_on_anything(tmp_path_factory, batches, recent):
        """Arbitrary field values, valid or not: the same results, or the same exception class."""
        if fast is None:
            pytest.skip("C encoder not built")
        c, py = encode_both(tmp_path_factory.mktemp("h"), batches, seg=4096, recent=recent)
        for rc, rp in zip(c, py):
            assert rc[:9] == rp[:9]
except ImportError:   # hypothesis is a test extra; the seeded tests above still run
    pass
