"""The C loop of the retained scan (lightqueue/_retained.c) against its Python reference
(`retained_messages.retained_rows_py`) on arbitrary keys and values: the `below` filter, the batch limit and
the end of the iterator, UTF-8 topics, empty payloads and props, and the same errors for a value
shorter than its length prefix or a key that is not UTF-8. The scan itself (RocksDB ranges,
wildcards) is tested through MetadataStore in test_lightqueue_metadata.py, on whichever loop is
built."""
from __future__ import annotations

import os
import struct

import pytest
from hypothesis import given, settings, strategies as st

from lmqtt.lightqueue import metadata, retained_messages

_C = retained_messages._retained
needs_c = pytest.mark.skipif(_C is None, reason="lmqtt.lightqueue._retained not built (or LMQTT_PURE_PYTHON set)")


@pytest.mark.skipif(os.environ.get("LMQTT_PURE_PYTHON", "") not in ("", "0"),
                    reason="LMQTT_PURE_PYTHON is set: the C loop is off on purpose")
def test_the_c_loop_is_built_and_used():
    assert _C is not None, "lmqtt.lightqueue._retained was not built: `pip install -e .` needs a C compiler"
    assert retained_messages._retained_rows is _C.retained_rows


def _value(payload: bytes, props: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload + props


topic_parts = st.sampled_from(["a", "b", "ab", "é", "日本", "x" * 30, ""])
pairs = st.lists(st.tuples(st.lists(topic_parts, min_size=1, max_size=4).map("/".join),
                           st.binary(max_size=80), st.binary(max_size=20)), max_size=40)


@needs_c
@settings(max_examples=400, deadline=None)
@given(rows=pairs, n=st.integers(1, 50), prefix=st.sampled_from(["", "a", "a/b", "é"]), use_below=st.booleans())
def test_c_equals_its_reference(rows, n, prefix, use_below):
    kv = [(b"r" + t.encode(), _value(p, pr)) for t, p, pr in rows]
    scan = b"r" + prefix.encode()
    below = scan + b"/" if use_below else None
    c_it, py_it = iter(kv), iter(kv)
    while True:
        got = _C.retained_rows(c_it, n, 1, len(scan), below)
        want = retained_messages.retained_rows_py(py_it, n, 1, len(scan), below)
        assert got == want
        if got[1]:
            break


@needs_c
@pytest.mark.parametrize("value", [b"", b"\x00\x00", b"\x00\x00\x00\x05abcd"])
def test_a_short_value_is_refused_by_both(value):
    for f in (_C.retained_rows, retained_messages.retained_rows_py):
        with pytest.raises(ValueError, match="shorter than its length prefix"):
            f(iter([(b"rt", value)]), 5, 1, 2, None)


@needs_c
def test_a_key_that_is_not_utf8_is_refused_by_both():
    for f in (_C.retained_rows, retained_messages.retained_rows_py):
        with pytest.raises(UnicodeDecodeError):
            f(iter([(b"r\xff", _value(b"p", b""))]), 5, 1, 2, None)


@needs_c
def test_the_store_answers_the_same_with_either_loop(tmp_path, monkeypatch):
    """MetadataStore.retained_matching over a real RocksDB: the same lists with the reference."""
    m = metadata.MetadataStore(str(tmp_path / "meta"))
    try:
        topics = ["a", "a/b", "a/b/c", "a//c", "ab/c", "é/日本", "$SYS/x", "b/a"] + [f"a/n/{i}" for i in range(300)]
        for i, t in enumerate(topics):
            m.set_retained(t, b"p%d" % i, b"props" if i % 2 else b"")
        filters = ["#", "a/#", "a/+", "+/b/#", "a/n/#", "é/#", "$SYS/#", "a/b", "nothing/#"]
        with_c = {f: m.retained_matching(f) for f in filters}
        monkeypatch.setattr(retained_messages, "_retained_rows", retained_messages.retained_rows_py)
        assert {f: m.retained_matching(f) for f in filters} == with_c
        assert len(with_c["a/n/#"]) == 300 and [t for t, _, _ in with_c["a/+"]] == ["a/b"]
    finally:
        m.close()
