"""Property tests for the MQTT codec: encode -> decode round trips for every packet type and every
MQTT 5 property, and arbitrary / mutated bytes never raise anything but ProtocolError."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmqtt.gateway.mqtt import Decoder, ProtocolError, PublishTemplate, encode
from lmqtt.gateway.mqtt import packets as P
from lmqtt.gateway.mqtt.decoder import REASON_CODES_V5, SUBACK_CODES_V311
from lmqtt.gateway.mqtt.properties import PROPERTY_TABLE, WILL

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ----------------------------------------------------------------------------- value strategies
text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=20)
topic = text.filter(lambda s: s and "+" not in s and "#" not in s)
level = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00+#/"), max_size=5)
topic_filter = st.one_of(
    topic,
    st.lists(st.one_of(level, st.just("+")), min_size=1, max_size=4).map("/".join).filter(bool),
    st.lists(level, max_size=3).map(lambda ls: "/".join(ls + ["#"])),
)
binary = st.binary(max_size=40)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
pid = st.integers(1, 0xFFFF)

_KIND = {
    "byte": st.integers(0, 1), "u16": u16, "u32": u32, "str": text, "bin": binary,
}
_NONZERO = {"receive_maximum", "maximum_packet_size", "topic_alias"}


def _value(attr: str, kind: str):
    if attr == "subscription_identifier":
        return st.lists(st.integers(1, 268_435_455), min_size=1, max_size=3)
    if attr == "user_property":
        return st.lists(st.tuples(text, text), min_size=1, max_size=3)
    s = _KIND[kind]
    if attr in _NONZERO:
        s = s.filter(bool)
    return s


def properties(ptype: int, version: int):
    """Strategy of Properties valid on packet type `ptype` (0 = will) for `version`."""
    if version != 5:
        return st.just(P.Properties())
    rows = {attr: kind for attr, kind, types, _ in PROPERTY_TABLE.values() if ptype in types}
    if ptype == 8:  # a SUBSCRIBE carries at most one subscription identifier
        parts = {a: (st.lists(st.integers(1, 268_435_455), max_size=1) if a == "subscription_identifier"
                     else st.just([]) | _value(a, k)) for a, k in rows.items()}
    else:
        parts = {a: (st.just([]) | _value(a, k) if k in ("pair", "varint") else st.none() | _value(a, k))
                 for a, k in rows.items()}
    return st.fixed_dictionaries(parts).map(lambda d: P.Properties(**d))


def reason(ptype: int, version: int):
    return st.sampled_from(sorted(REASON_CODES_V5[ptype])) if version == 5 else st.just(0)


# ----------------------------------------------------------------------------- packet strategies
@st.composite
def connect(draw, version: int):
    will = None
    if draw(st.booleans()):
        will = P.Will(draw(topic), draw(binary), draw(st.integers(0, 2)), draw(st.booleans()),
                      draw(properties(WILL, version)))
    username = draw(st.none() | text)
    password = draw(st.none() | binary)
    if version != 5 and username is None:
        password = None
    props = draw(properties(1, version))
    if props.authentication_data is not None and props.authentication_method is None:
        props.authentication_method = draw(text)
    return P.Connect(draw(text), version, draw(st.booleans()), draw(u16), username, password, will,
                     props)


@st.composite
def publish(draw, version: int, from_client: bool = True):
    qos = draw(st.integers(0, 2))
    props = draw(properties(3, version))
    if from_client:  # only a server's PUBLISH may carry subscription identifiers
        props.subscription_identifier.clear()
    t = draw(topic)
    if version == 5 and props.topic_alias is not None and draw(st.booleans()):
        t = ""
    return P.Publish(t, draw(st.binary(max_size=300)), qos, draw(st.booleans()),
                     draw(st.booleans()) if qos else False, draw(pid) if qos else None, props)


@st.composite
def subscribe(draw, version: int):
    subs = []
    for f in draw(st.lists(topic_filter, min_size=1, max_size=4)):
        if version == 5:
            no_local = draw(st.booleans()) and not f.startswith("$share/")
            subs.append(P.SubscriptionRequest(f, draw(st.integers(0, 2)), no_local, draw(st.booleans()),
                                              draw(st.integers(0, 2))))
        else:
            subs.append(P.SubscriptionRequest(f, draw(st.integers(0, 2))))
    return P.Subscribe(draw(pid), subs, draw(properties(8, version)))


def ack(cls, ptype: int, version: int):
    return st.builds(cls, pid, reason(ptype, version), properties(ptype, version))


def client_packets(version: int):
    return st.one_of(
        publish(version), subscribe(version),
        st.builds(P.Unsubscribe, pid, st.lists(topic_filter, min_size=1, max_size=4),
                  properties(10, version)),
        ack(P.PubAck, 4, version), ack(P.PubRec, 5, version), ack(P.PubRel, 6, version),
        ack(P.PubComp, 7, version), st.just(P.PingReq()),
        st.builds(P.Disconnect, reason(14, version), properties(14, version)),
        *([st.builds(P.Auth, reason(15, 5), properties(15, 5))] if version == 5 else []),
    )


@st.composite
def connack(draw, version: int):
    if version == 5:
        rc = draw(reason(2, 5))
    else:
        rc = draw(st.integers(0, 5))
    return P.ConnAck(draw(st.booleans()) if rc == 0 else False, rc, draw(properties(2, version)))


def server_packets(version: int):
    sub_codes = sorted(REASON_CODES_V5[9]) if version == 5 else sorted(SUBACK_CODES_V311)
    unsub = (st.lists(st.sampled_from(sorted(REASON_CODES_V5[11])), min_size=1, max_size=4)
             if version == 5 else st.just([]))
    return st.one_of(
        connack(version), publish(version, from_client=False),
        st.builds(P.SubAck, pid, st.lists(st.sampled_from(sub_codes), min_size=1, max_size=4),
                  properties(9, version)),
        st.builds(P.UnsubAck, pid, unsub, properties(11, version)),
        ack(P.PubAck, 4, version), ack(P.PubRec, 5, version), ack(P.PubRel, 6, version),
        ack(P.PubComp, 7, version), st.just(P.PingResp()),
        st.builds(P.Disconnect, reason(14, version), properties(14, version)),
    )


versions = st.sampled_from([4, 5])


# ----------------------------------------------------------------------------- round trips
@SETTINGS
@given(st.data())
def test_client_stream_round_trips(data):
    version = data.draw(versions)
    c = data.draw(connect(version))
    pkts = data.draw(st.lists(client_packets(version), max_size=6))
    wire = b"".join(encode(p, version) for p in [c] + pkts)
    assert Decoder().feed(wire) == [c] + pkts
    # any split of the stream gives the same packets
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=8)))
    d = Decoder()
    got, prev = [], 0
    for cut in cuts + [len(wire)]:
        got += d.feed(wire[prev:cut])
        prev = cut
    assert got == [c] + pkts and d.buffered == 0


@SETTINGS
@given(st.data())
def test_server_packets_round_trip(data):
    version = data.draw(versions)
    pkts = data.draw(st.lists(server_packets(version), min_size=1, max_size=6))
    wire = b"".join(encode(p, version) for p in pkts)
    assert Decoder(version, server_side=False).feed(wire) == pkts


_SAMPLE = {"byte": 1, "u16": 513, "u32": 70000, "str": "é/x", "bin": b"\x00\xff",
           "varint": [5, 268_435_455], "pair": [("k", "v"), ("k", "v2")]}


def _carrier(ptype: int, props: P.Properties):
    """(packet of type `ptype` carrying `props`, server_side decoder?)"""
    if ptype == WILL:
        return P.Connect("c", 5, will=P.Will("w", b"", properties=props)), True
    return {
        1: lambda: (P.Connect("c", 5, properties=props), True),
        2: lambda: (P.ConnAck(False, 0, props), False),
        3: lambda: (P.Publish("t", b"p", 1, packet_id=1, properties=props), False),
        4: lambda: (P.PubAck(1, 0, props), True), 5: lambda: (P.PubRec(1, 0, props), True),
        6: lambda: (P.PubRel(1, 0, props), True), 7: lambda: (P.PubComp(1, 0, props), True),
        8: lambda: (P.Subscribe(1, [P.SubscriptionRequest("a")], props), True),
        9: lambda: (P.SubAck(1, [0], props), False),
        10: lambda: (P.Unsubscribe(1, ["a"], props), True),
        11: lambda: (P.UnsubAck(1, [0], props), False),
        14: lambda: (P.Disconnect(0, props), True),
        15: lambda: (P.Auth(0, props), True),
    }[ptype]()


@pytest.mark.parametrize("prop_id", sorted(PROPERTY_TABLE))
def test_every_property_round_trips_on_every_allowed_packet(prop_id):
    attr, kind, types, _ = PROPERTY_TABLE[prop_id]
    for ptype in sorted(types - {12, 13}):
        value = _SAMPLE[kind]
        if ptype == 8 and attr == "subscription_identifier":
            value = [7]
        props = P.Properties(**{attr: value})
        if attr == "authentication_data" and ptype == 1:
            props.authentication_method = "m"
        pkt, server_side = _carrier(ptype, props)
        if server_side:
            d = Decoder()
            pre = [] if isinstance(pkt, P.Connect) else d.feed(encode(P.Connect("c", 5), 5))
            assert pre == [] or len(pre) == 1
            got = d.feed(encode(pkt, 5))
        else:
            got = Decoder(5, server_side=False).feed(encode(pkt, 5))
        assert got == [pkt], (attr, ptype)
        assert (got[0].will.properties if ptype == WILL else got[0].properties) == props
    # and it is refused on a packet type that does not allow it
    other = next((t for t in (3, 1, 2, 14) if t not in types), None)
    if other is None:  # user property: allowed everywhere
        return
    pkt, server_side = _carrier(other, P.Properties(**{attr: _SAMPLE[kind]}))
    d = Decoder() if server_side else Decoder(5, server_side=False)
    if server_side and not isinstance(pkt, P.Connect):
        d.feed(encode(P.Connect("c", 5), 5))
    with pytest.raises(ProtocolError, match="not allowed"):
        d.feed(encode(pkt, 5))


@SETTINGS
@given(st.data())
def test_publish_template_round_trips(data):
    version = data.draw(versions)
    p = data.draw(publish(version, from_client=False).filter(lambda p: p.topic))
    t = PublishTemplate(p.topic, p.payload, p.qos, p.retain, p.properties, version)
    wire = t.for_packet_id(p.packet_id, p.dup) if p.qos else t.qos0
    assert wire == encode(p, version)
    assert Decoder(version, server_side=False).feed(wire) == [p]


# ----------------------------------------------------------------------------- hostile input
def _only_protocol_errors(d: Decoder, chunks) -> None:
    try:
        for c in chunks:
            d.feed(c)
            assert d.buffered <= sum(len(x) for x in chunks)
    except ProtocolError as e:
        assert "decoder failed" not in str(e), e  # an internal bug disguised as bad input
        assert str(e)
        assert 0x80 <= e.reason_code <= 0xA2


FUZZ = settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=300), versions, st.booleans())
def test_arbitrary_bytes_after_connect(blob, version, server_side):
    if server_side:
        d = Decoder()
        d.feed(encode(P.Connect("x", version), version))
    else:
        d = Decoder(version, server_side=False)
    _only_protocol_errors(d, [blob])


@FUZZ
@given(st.binary(max_size=300))
def test_arbitrary_bytes_as_first_bytes(blob):
    _only_protocol_errors(Decoder(), [blob])


@st.composite
def mutated(draw):
    version = draw(versions)
    server_side = draw(st.booleans())
    pkts = draw(st.lists(client_packets(version) if server_side else server_packets(version),
                         min_size=1, max_size=3))
    wire = bytearray(b"".join(encode(p, version) for p in pkts))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        i = draw(st.integers(0, max(0, len(wire) - 1)))
        if op == "flip" and wire:
            wire[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and wire:
            wire[i] = draw(st.sampled_from([0, 0x7F, 0x80, 0xFF, 0x01, 0x26, 0x0B]))
        elif op == "insert":
            wire[i:i] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete" and wire:
            del wire[i]
        elif op == "truncate":
            del wire[i:]
    return version, server_side, bytes(wire)


@pytest.mark.slow
@settings(max_examples=700, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_valid_encodings_only_raise_protocol_error(case):
    version, server_side, wire = case
    if server_side:
        d = Decoder()
        d.feed(encode(P.Connect("x", version), version))
    else:
        d = Decoder(version, server_side=False)
    _only_protocol_errors(d, [wire[:len(wire) // 2], wire[len(wire) // 2:]])


def test_claimed_length_is_never_allocated():
    d = Decoder(max_packet_size=268_435_460)
    d.feed(encode(P.Connect("x"), 4))
    for _ in range(1000):  # a slow-loris client trickling a huge packet: buffered grows with input only
        d.feed(b"\x30\xff\xff\xff\x7f" if d.buffered == 0 else b"x")
    assert d.buffered == 5 + 999
