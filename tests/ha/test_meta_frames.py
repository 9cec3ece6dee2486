"""The metadata changes a primary ships (META frames, store/ha/replication.py): a change that carries
bytes (a producer's dedup result) travels as bytes, not base64 inside JSON, and comes out of the
replica's frame reader exactly as it went in; a change from a primary of an earlier version
(base64 text) is still applied; a damaged frame is refused with a message naming it."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmqtt.store.ha.metadata_sync import _body
from lmqtt.store.ha.replication import FrameReader, meta_frame, parse_meta


def _through_the_wire(op: dict) -> dict:
    frames = FrameReader(None).feed(meta_frame(op))
    assert len(frames) == 1 and frames[0][0] == b"M"
    return parse_meta(frames[0][1])


@settings(max_examples=200, deadline=None)
@given(pid=st.text(max_size=40), seq=st.integers(0, 2**63), v=st.binary(max_size=5000))
def test_a_dedup_result_comes_out_as_it_went_in(pid, seq, v):
    op = {"k": "remember", "p": pid, "s": seq, "v": v, "n": 7}
    assert _through_the_wire(op) == op


def test_the_bytes_are_not_base64_in_json():
    body = os.urandom(32_004)                      # a 2,000-message batch's result
    f = meta_frame({"k": "remember", "p": "prod-1", "s": 3, "v": body, "n": 1})
    assert body in f and len(f) < len(body) + 100  # base64 would be a third larger


def test_changes_without_bytes_stay_json():
    op = {"k": "commit", "g": "g1", "q": "t/1", "o": 42, "n": 9}
    f = meta_frame(op)
    assert f[5:6] == b"{" and _through_the_wire(op) == op


def test_a_primary_of_an_earlier_version_ships_base64_text_still_applied():
    import base64
    body = b"\x00\x00\x00\x02" + bytes(range(32))
    old = _through_the_wire({"k": "remember", "p": "x", "s": 1, "v": base64.b64encode(body).decode()})
    assert isinstance(old["v"], str) and _body(old["v"]) == body
    assert _body(body) == body


def test_a_damaged_frame_is_refused_naming_it():
    f = meta_frame({"k": "remember", "p": "x", "s": 1, "v": b"abc"})
    payload = FrameReader(None).feed(f)[0][1]
    bad = payload[:1] + (10_000).to_bytes(4, "big") + payload[5:]
    with pytest.raises(ValueError, match="metadata change frame"):
        parse_meta(bad)
