"""The C loop of `encode_publish_run` (gateway/mqtt/_run.c) against its Python reference
(`encoder.encode_publish_run_py`) on arbitrary runs: every QoS, retain both ways, packet ids at the
edges, MQTT 3.1.1 and 5, payloads as bytes and memoryviews across the remaining-length widths,
Maximum Packet Size limits, and the same ValueError for a bad packet id, QoS or topic length.
test_publish_runs.py checks both against the PUBLISH template."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings, strategies as st

from lmqtt.gateway.mqtt import encoder

_C = encoder._run
needs_c = pytest.mark.skipif(_C is None, reason="lmqtt.gateway.mqtt._run not built (or LMQTT_PURE_PYTHON set)")


@pytest.mark.skipif(os.environ.get("LMQTT_PURE_PYTHON", "") not in ("", "0"),
                    reason="LMQTT_PURE_PYTHON is set: the C loop is off on purpose")
def test_the_c_loop_is_built_and_used():
    assert _C is not None, "lmqtt.gateway.mqtt._run was not built: `pip install -e .` needs a C compiler"
    assert encoder.encode_publish_run is _C.encode_publish_run


topics = st.one_of(st.sampled_from(["a", "a/b", "é/ü/日本", "t" * 200]), st.text(max_size=40))
payloads = st.one_of(st.binary(max_size=300), st.sampled_from([b"x" * 16_384, b"y" * 130_000]))
pids = st.one_of(st.sampled_from([1, 65535]), st.integers(1, 65535))


@st.composite
def message(draw):
    qos = draw(st.sampled_from([0, 1, 2]))
    payload = draw(payloads)
    if draw(st.booleans()):
        payload = memoryview(payload)
    return (draw(topics), payload, qos, draw(st.booleans()), draw(pids) if qos else None)


@needs_c
@settings(max_examples=500, deadline=None)
@given(msgs=st.lists(message(), max_size=40), version=st.sampled_from([3, 4, 5]),
       max_packet=st.sampled_from([0, 1, 10, 200, 20_000, 268_435_460]), as_tuple=st.booleans())
def test_c_equals_its_reference(msgs, version, max_packet, as_tuple):
    run = tuple(msgs) if as_tuple else msgs
    assert _C.encode_publish_run(run, version, max_packet) == encoder.encode_publish_run_py(run, version, max_packet)
    if not max_packet:
        assert _C.encode_publish_run(run, version) == encoder.encode_publish_run_py(run, version)


@needs_c
@pytest.mark.parametrize("bad, match", [
    (("a", b"", 1, False, None), "packet id"),
    (("a", b"", 2, True, 0), "packet id"),
    (("a", b"", 1, False, 65536), "packet id"),
    (("a", b"", 3, False, 1), "qos"),
    (("a", b"", -1, False, None), "qos"),
    (("é" * 32_768, b"", 0, False, None), "more than 65535"),
])
def test_the_same_errors(bad, match):
    """A bad message anywhere in the run raises the same ValueError from both, and nothing is
    returned (no partial run)."""
    run = [("ok", b"1", 0, False, None), bad]
    with pytest.raises(ValueError, match=match):
        encoder.encode_publish_run_py(run, 4)
    with pytest.raises(ValueError, match=match):
        _C.encode_publish_run(run, 4)
