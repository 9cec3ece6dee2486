"""The decoder's C steady state (gateway/mqtt/_scan.c) against the Python decoder alone, its
reference: byte streams of PUBLISHes (any QoS, flags, topic bytes - invalid UTF-8, U+0000,
wildcards, empty - packet ids 0 and up, MQTT 5 with and without properties), acks of every kind
and length, other packets, bytes flipped, cut and inserted, fed in pieces cut anywhere, to server-
and client-side decoders of MQTT 3.1.1 and 5: every `feed` returns the same packets, or raises the
same ProtocolError (message, reason code, and the packets decoded before it)."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings, strategies as st

from lmqtt.gateway.mqtt import Decoder, ProtocolError, decoder as decoder_mod, encode, packets as P

_C = decoder_mod._scan_mod
needs_c = pytest.mark.skipif(_C is None, reason="lmqtt.gateway.mqtt._scan not built (or LMQTT_PURE_PYTHON set)")


@pytest.mark.skipif(os.environ.get("LMQTT_PURE_PYTHON", "") not in ("", "0"),
                    reason="LMQTT_PURE_PYTHON is set: the C scan is off on purpose")
def test_the_c_scan_is_built_and_used():
    assert _C is not None, "lmqtt.gateway.mqtt._scan was not built: `pip install -e .` needs a C compiler"
    assert decoder_mod._scan is _C.scan


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


good_topics = st.one_of(st.sampled_from([b"a", b"a/b", "é/日本".encode(), b"t" * 300, b"plant/7/temp"]),
                        st.text(alphabet=st.characters(blacklist_characters="+#\x00", blacklist_categories=["Cs"]),
                                min_size=1, max_size=12).map(str.encode))
bad_topics = st.one_of(st.sampled_from([b"", b"a/+", b"#", b"a\x00b", b"\xff\xfe", b"\xed\xa0\x80", b"\xc0\xaf"]),
                       st.binary(max_size=12))


@st.composite
def publish(draw, v5: bool):
    """Mostly valid (the C scan takes those), one part in ten broken somewhere (the scan must stop
    and leave the error to the reference)."""
    bad = draw(st.integers(0, 9)) == 0
    what = draw(st.sampled_from(["qos", "topic", "pid", "props"])) if bad else None
    qos = 3 if what == "qos" else draw(st.sampled_from([0, 1, 2]))
    flags = qos << 1 | draw(st.sampled_from([0, 1])) | (draw(st.sampled_from([0, 8])) if qos else
                                                         (8 if what == "qos" and draw(st.booleans()) else 0))
    topic = draw(bad_topics if what == "topic" else good_topics)
    body = len(topic).to_bytes(2, "big") + topic
    if qos:
        body += (0 if what == "pid" else draw(st.sampled_from([1, 65535, 7, 300]))).to_bytes(2, "big")
    if v5:
        body += (draw(st.sampled_from([b"\x02\x23\x00", b"\x80\x00", b"\x05\x01", b"\x03\x01\x01"]))
                 if what == "props" or draw(st.integers(0, 5)) == 0 else b"\x00")
    body += draw(st.binary(max_size=40)) if draw(st.booleans()) else draw(st.sampled_from([b"", b"p" * 200]))
    return bytes([0x30 | flags]) + _varint(len(body)) + body


@st.composite
def ack(draw):
    b0 = draw(st.sampled_from([0x40, 0x40, 0x50, 0x62, 0x70] + ([0x60, 0x41] if draw(st.integers(0, 9)) == 0 else [])))
    pid = 0 if draw(st.integers(0, 19)) == 0 else draw(st.sampled_from([1, 65535, 300]))
    tail = b"" if draw(st.integers(0, 3)) else draw(st.sampled_from([b"\x00", b"\x10", b"\x00\x00", b"\x80\x00", b"\x92"]))
    body = pid.to_bytes(2, "big") + tail
    return bytes([b0]) + _varint(len(body)) + body


def other(v5: bool):
    v = 5 if v5 else 4
    return st.sampled_from([encode(P.PingReq(), v), encode(P.Subscribe(3, [P.SubscriptionRequest("s/#", 1)]), v),
                            encode(P.Disconnect(), v), b"\x00\x00", b"\x30\xff\xff\xff\xff\x01", b"\x30"])


@st.composite
def stream(draw):
    v5 = draw(st.booleans())
    server = draw(st.booleans())
    parts = [encode(P.Connect("c", 5 if v5 else 4), 5 if v5 else 4)] if server else []
    parts += draw(st.lists(st.one_of(publish(v5), publish(v5), publish(v5), ack(), ack(), other(v5)), max_size=25))
    data = bytearray(b"".join(parts))
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):    # damage: flip, cut or insert a byte
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        kind = draw(st.sampled_from(["flip", "cut", "insert"]))
        if kind == "flip":
            data[i] ^= draw(st.integers(1, 255))
        elif kind == "cut":
            del data[i]
        else:
            data.insert(i, draw(st.integers(0, 255)))
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=6)))
    pieces = [bytes(data[a:b]) for a, b in zip([0] + cuts, cuts + [len(data)], strict=True)]
    return v5, server, pieces, draw(st.sampled_from([1 << 28, 64, 20])), draw(st.booleans())


def _run(v5, server, pieces, max_packet, share, scan):
    saved = decoder_mod._scan
    decoder_mod._scan = scan
    try:
        d = Decoder(None if server else (5 if v5 else 4), max_packet_size=max_packet, server_side=server,
                    share_empty_properties=share)
        out = []
        for piece in pieces:
            try:
                out.append(("ok", d.feed(piece)))
            except ProtocolError as e:
                out.append(("error", str(e), e.reason_code, e.packets))
                break
        return out, d.buffered
    finally:
        decoder_mod._scan = saved


@needs_c
@settings(max_examples=1500, deadline=None)
@given(s=stream())
def test_c_scan_equals_the_python_decoder(s):
    v5, server, pieces, max_packet, share = s
    assert _run(v5, server, pieces, max_packet, share, _C.scan) == _run(v5, server, pieces, max_packet, share, None)


@needs_c
def test_a_publisher_run_is_taken_whole_and_shares_its_topic_string():
    d = Decoder(4, share_empty_properties=True, server_side=False)
    frames = b"".join(encode(P.Publish("plant/7/temp", bytes([i]) * 20, 1, False, False, i + 1), 4) for i in range(200))
    pkts = d.feed(frames + b"\x40\x02\x00\x05")
    assert len(pkts) == 201 and pkts[-1] == P.PubAck(5)
    assert [p.packet_id for p in pkts[:-1]] == list(range(1, 201))
    assert all(p.topic is pkts[0].topic for p in pkts[:-1])     # decoded once per feed
    assert pkts[0].properties is pkts[-1].properties             # the shared empty Properties


@needs_c
def test_configure_refuses_classes_of_another_shape():
    from dataclasses import dataclass

    @dataclass(slots=True)
    class Other:
        topic: str
        payload: bytes

    with pytest.raises(ValueError, match="fields"):
        _C.configure(Other, P.PubAck, P.PubRec, P.PubRel, P.PubComp, P.Properties)
    with pytest.raises(RuntimeError, match="not configured"):
        _C.scan(bytearray(b"\x40\x02\x00\x01"), 0, [], bytes(256), False, 100, None)
    _C.configure(P.Publish, P.PubAck, P.PubRec, P.PubRel, P.PubComp, P.Properties)
    out = []
    assert _C.scan(bytearray(b"\x40\x02\x00\x01"), 0, out, bytes([1]) * 256, False, 100, None) == 4
    assert out == [P.PubAck(1)]
