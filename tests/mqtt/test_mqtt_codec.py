"""Table tests for the sans-IO MQTT codec: spec byte examples, every packet type in 3.1.1 and 5.0,
strictness rules, remaining-length edges, max_packet_size and split feeds."""
from __future__ import annotations

from dataclasses import replace

import pytest

from lmqtt.gateway.mqtt import (Decoder, ProtocolError, PublishTemplate, ReasonCode, encode, encode_publish,
                                encode_publish_v5_parts, connack_return_code_v311,
                                message_expiry_prop)
from lmqtt.gateway.mqtt import packets as P
from lmqtt.gateway.mqtt.wire import encode_varint

CONNECT_V4 = bytes.fromhex("100c00044d5154540402003c0000")  # client id "", clean session, keepalive 60
CONNECT_V5 = bytes.fromhex("100d00044d5154540502003c000000")


def server(version: int = 4) -> Decoder:
    """A server-side decoder that has already accepted a CONNECT of `version`."""
    d = Decoder()
    [c] = d.feed(CONNECT_V5 if version == 5 else CONNECT_V4)
    assert c.protocol_level == version
    return d


def decode_one(data: bytes, version: int, server_side: bool = True):
    d = server(version) if server_side else Decoder(version, server_side=False)
    out = d.feed(data)
    assert len(out) == 1, out
    return out[0]


# ----------------------------------------------------------------------------- spec byte examples
def test_connect_311_minimal_bytes():
    assert encode(P.Connect("", 4, True, 60), 4) == CONNECT_V4
    [c] = Decoder().feed(CONNECT_V4)
    assert c == P.Connect("", 4, True, 60)


def test_connect_v5_spec_example_variable_header():
    # MQTT 5.0 spec figure 3-7 (variable header): flags 0xCE (user, password, will QoS 1, will,
    # clean start), keepalive 10, session expiry 10.
    body = (bytes.fromhex("00044d51545405ce000a05110000000a") + b"\x00\x03cid"
            + b"\x00" + b"\x00\x03w/t" + b"\x00\x02wp" + b"\x00\x01u" + b"\x00\x02pw")
    data = b"\x10" + encode_varint(len(body)) + body
    [c] = Decoder().feed(data)
    assert c.protocol_level == 5 and c.keepalive == 10 and c.clean_start
    assert c.properties.session_expiry_interval == 10
    assert c.will == P.Will("w/t", b"wp", 1, False)
    assert (c.client_id, c.username, c.password) == ("cid", "u", b"pw")
    assert encode(c, 5) == data


def test_mqtt31_connect_mqisdp():
    c = P.Connect("old-client", 3, keepalive=30)
    data = encode(c, 3)
    assert data[2:10] == b"\x00\x06MQIsdp" and data[10] == 3
    [got] = Decoder().feed(data)
    assert got == c
    d = Decoder()
    d.feed(data)
    assert d.version == 3
    assert d.feed(encode(P.PingReq(), 3)) == [P.PingReq()]


@pytest.mark.parametrize("n,wire", [
    (0, "00"), (127, "7f"), (128, "8001"), (16383, "ff7f"), (16384, "808001"),
    (2097151, "ffff7f"), (2097152, "80808001"), (268435455, "ffffff7f"),
])
def test_remaining_length_spec_table(n, wire):
    assert encode_varint(n).hex() == wire


def test_fixed_packets_bytes():
    assert encode(P.PingReq(), 4) == b"\xc0\x00"
    assert encode(P.PingResp(), 4) == b"\xd0\x00"
    assert encode(P.Disconnect(), 4) == b"\xe0\x00"
    assert encode(P.Disconnect(), 5) == b"\xe0\x00"
    assert encode(P.ConnAck(), 4) == b"\x20\x02\x00\x00"
    assert encode(P.ConnAck(True, 0), 5) == b"\x20\x03\x01\x00\x00"
    assert encode(P.PubAck(10), 4) == b"\x40\x02\x00\x0a"
    assert encode(P.PubRel(10), 4) == b"\x62\x02\x00\x0a"
    assert encode(P.PubAck(10, 0x10), 5) == b"\x40\x03\x00\x0a\x10"
    assert encode(P.Auth(), 5) == b"\xf0\x00"


def test_publish_bytes_spec_example():
    # 3.1.1 section 3.3.2.3: topic "a/b", packet id 10.
    data = encode(P.Publish("a/b", b"hi", 1, packet_id=10), 4)
    assert data == b"\x32\x09" + bytes.fromhex("0003612f62000a") + b"hi"
    assert decode_one(data, 4) == P.Publish("a/b", b"hi", 1, packet_id=10)


def test_subscribe_and_suback_bytes():
    sub = P.Subscribe(10, [P.SubscriptionRequest("a/b", 1), P.SubscriptionRequest("c/d", 2)])
    assert encode(sub, 4) == bytes.fromhex("820e000a0003612f6201000363 2f6402".replace(" ", ""))
    assert decode_one(encode(sub, 4), 4) == sub
    ack = P.SubAck(10, [0, 2, 0x80])
    assert encode(ack, 4) == bytes.fromhex("9005000a000280")
    assert decode_one(encode(ack, 4), 4, server_side=False) == ack


# ----------------------------------------------------------------------------- every packet type
def _v5_props(**kw) -> P.Properties:
    p = P.Properties(**kw)
    p.user_property.append(("k", "v"))
    return p


CLIENT_PACKETS = {
    4: [
        P.Connect("c1", 4, False, 10, "user", b"pass", P.Will("will/t", b"gone", 2, True)),
        P.Publish("a/b", b"payload", 0),
        P.Publish("a/b", b"payload", 1, True, True, 1),
        P.Publish("a/b", b"", 2, False, False, 65535),
        P.PubAck(1), P.PubRec(2), P.PubRel(3), P.PubComp(4),
        P.Subscribe(5, [P.SubscriptionRequest("a/+", 0), P.SubscriptionRequest("#", 2)]),
        P.Unsubscribe(6, ["a/+", "#"]),
        P.PingReq(), P.Disconnect(),
    ],
    5: [
        P.Connect("c1", 5, False, 10, "user", b"pass",
                  P.Will("will/t", b"gone", 1, False, _v5_props(will_delay_interval=5,
                                                                payload_format_indicator=1,
                                                                message_expiry_interval=60,
                                                                content_type="text/plain",
                                                                response_topic="r/t",
                                                                correlation_data=b"\x01")),
                  _v5_props(session_expiry_interval=3600, receive_maximum=20, maximum_packet_size=1 << 20,
                            topic_alias_maximum=10, request_response_information=1,
                            request_problem_information=0, authentication_method="SCRAM",
                            authentication_data=b"x")),
        P.Connect("", 5, True, 0, None, b"password-without-user"),
        P.Publish("a/b", b"payload", 0, properties=_v5_props(topic_alias=3)),
        P.Publish("", b"aliased", 1, False, False, 9, P.Properties(topic_alias=3)),
        P.PubAck(1, 0x10, _v5_props(reason_string="no subscribers")),
        P.PubRec(2, 0x80), P.PubRel(3, 0x92), P.PubComp(4, 0, _v5_props()),
        P.Subscribe(5, [P.SubscriptionRequest("a/+", 1, True, True, 2),
                        P.SubscriptionRequest("$share/g/x", 2, False, False, 1)],
                    P.Properties(subscription_identifier=[77])),
        P.Unsubscribe(6, ["a/+"], _v5_props()),
        P.PingReq(),
        P.Auth(0x18, P.Properties(authentication_method="SCRAM", authentication_data=b"abc")),
        P.Disconnect(0x04, _v5_props(session_expiry_interval=0, reason_string="bye")),
    ],
}

SERVER_PACKETS = {
    4: [P.ConnAck(True, 0), P.ConnAck(False, 5), P.SubAck(5, [0, 1, 2, 0x80]), P.UnsubAck(6),
        P.PingResp(), P.Publish("x", b"y", 2, packet_id=2), P.PubRel(2)],
    5: [P.ConnAck(False, 0x86, _v5_props(reason_string="no")),
        P.ConnAck(True, 0, _v5_props(assigned_client_identifier="auto-1", server_keep_alive=30,
                                     maximum_qos=1, retain_available=0, wildcard_subscription_available=1,
                                     subscription_identifier_available=0, shared_subscription_available=1,
                                     response_information="resp", server_reference="other:1883",
                                     receive_maximum=100, topic_alias_maximum=5,
                                     maximum_packet_size=1024, session_expiry_interval=7)),
        P.SubAck(5, [0, 1, 2, 0x80, 0x8F, 0xA2], _v5_props()), P.UnsubAck(6, [0, 0x11], _v5_props()),
        P.PingResp(), P.Disconnect(0x8E, P.Properties(server_reference="s2")),
        P.Publish("x", b"y", 1, packet_id=2, properties=P.Properties(subscription_identifier=[1, 2]))],
}


@pytest.mark.parametrize("version", [4, 5])
def test_every_client_packet_round_trips(version):
    pkts = CLIENT_PACKETS[version]
    for pkt in pkts:
        d = Decoder()
        stream = b"" if isinstance(pkt, P.Connect) else (CONNECT_V5 if version == 5 else CONNECT_V4)
        got = d.feed(stream + encode(pkt, version))
        assert got[-1] == pkt, (pkt, got)


@pytest.mark.parametrize("version", [4, 5])
def test_every_server_packet_round_trips(version):
    for pkt in SERVER_PACKETS[version]:
        assert Decoder(version, server_side=False).feed(encode(pkt, version)) == [pkt]


@pytest.mark.parametrize("version", [4, 5])
def test_byte_by_byte_feed_gives_same_packets(version):
    connect = CLIENT_PACKETS[version][0]
    rest = [p for p in CLIENT_PACKETS[version] if not isinstance(p, P.Connect)]
    data = b"".join(encode(p, version) for p in [connect] + rest)
    d = Decoder()
    got = []
    for i in range(len(data)):
        got += d.feed(data[i:i + 1])
    assert got == [connect] + rest
    assert d.buffered == 0


def test_v311_drops_v5_only_fields_when_encoding():
    assert encode(P.PubAck(1, 0x10, _v5_props()), 4) == b"\x40\x02\x00\x01"
    assert encode(P.UnsubAck(1, [0x11]), 4) == b"\xb0\x02\x00\x01"
    assert encode(P.Disconnect(0x04), 4) == b"\xe0\x00"
    # MQTT 5 CONNACK/SUBACK codes become their 3.1.1 equivalents
    assert encode(P.ConnAck(False, ReasonCode.BAD_USER_NAME_OR_PASSWORD), 4) == b"\x20\x02\x00\x04"
    assert encode(P.ConnAck(False, ReasonCode.NOT_AUTHORIZED), 4) == b"\x20\x02\x00\x05"
    assert encode(P.SubAck(1, [0x87, 1]), 4) == b"\x90\x04\x00\x01\x80\x01"
    with pytest.raises(ValueError):
        encode(P.Auth(), 4)


def test_connack_code_map():
    assert connack_return_code_v311(ReasonCode.SUCCESS) == 0
    assert connack_return_code_v311(ReasonCode.UNSUPPORTED_PROTOCOL_VERSION) == 1
    assert connack_return_code_v311(ReasonCode.CLIENT_IDENTIFIER_NOT_VALID) == 2
    assert connack_return_code_v311(ReasonCode.SERVER_UNAVAILABLE) == 3
    assert connack_return_code_v311(ReasonCode.BAD_USER_NAME_OR_PASSWORD) == 4
    assert connack_return_code_v311(ReasonCode.NOT_AUTHORIZED) == 5
    assert connack_return_code_v311(ReasonCode.QUOTA_EXCEEDED) == 3
    assert ReasonCode.MALFORMED_PACKET == 0x81 and ReasonCode.PACKET_TOO_LARGE == 0x95


# ----------------------------------------------------------------------------- fast publish encoding
@pytest.mark.parametrize("version", [4, 5])
def test_publish_template_matches_plain_encoding(version):
    props = _v5_props(content_type="a") if version == 5 else None
    t = PublishTemplate("t/1", b"x" * 300, 1, True, props, version)
    for pid in (1, 256, 65535):
        for dup in (False, True):
            want = encode_publish("t/1", b"x" * 300, 1, True, dup, pid, props, version)
            assert t.for_packet_id(pid, dup) == want
    assert t.qos0 == encode_publish("t/1", b"x" * 300, 0, True, False, None, props, version)
    # earlier results are not changed by later patches
    a = t.for_packet_id(5)
    t.for_packet_id(6, True)
    assert decode_one(a, version, server_side=False) == P.Publish(
        "t/1", b"x" * 300, 1, True, False, 5, props or P.Properties())
    with pytest.raises(ValueError):
        t.for_packet_id(0)
    with pytest.raises(ValueError):
        PublishTemplate("t", b"", 0).for_packet_id(1)


# ----------------------------------------------------------------------------- strictness
def _bad(data: bytes, version: int = 4, code: int | None = None, server_side: bool = True,
         match: str | None = None) -> ProtocolError:
    d = server(version) if server_side else Decoder(version, server_side=False)
    with pytest.raises(ProtocolError) as ei:
        d.feed(data)
    if code is not None:
        assert ei.value.reason_code == code, ei.value
    if match:
        assert match in str(ei.value)
    # stays failed, even for valid input afterwards
    with pytest.raises(ProtocolError):
        d.feed(b"\xc0\x00")
    return ei.value


@pytest.mark.parametrize("first", [0x63, 0x80, 0x81, 0xA0, 0x41, 0xC1, 0xE2, 0x12])
def test_reserved_flag_bits(first):
    _bad(bytes((first, 0)), 5, 0x81, match="flags")


def test_pubrel_subscribe_unsubscribe_need_flags_0010():
    _bad(b"\x60\x02\x00\x01", match="PUBREL")
    _bad(b"\x80\x06\x00\x01\x00\x01a\x00", match="SUBSCRIBE")
    _bad(b"\xa0\x05\x00\x01\x00\x01a", match="UNSUBSCRIBE")


def test_publish_qos3_and_qos0_dup():
    _bad(b"\x36\x05\x00\x01a\x00\x01", match="QoS 3")
    _bad(b"\x38\x03\x00\x01a", 4, match="DUP")
    _bad(b"\x38\x04\x00\x01a\x00", 5, match="DUP")


def test_publish_topic_rules():
    _bad(encode_publish("a/+", b"", 0), code=0x90, match="wildcard")
    _bad(encode_publish("a/#", b"", 0), 5, match="wildcard")
    _bad(b"\x30\x02\x00\x00", 4, code=0x82, match="empty topic")
    _bad(b"\x30\x03\x00\x00\x00", 5, code=0x82, match="topic alias")
    _bad(b"\x30\x05\x00\x03a\x00b", match="U+0000")
    _bad(b"\x30\x05\x00\x03a\xff\xfe", match="UTF-8")
    _bad(b"\x30\x05\x00\x03\xed\xa0\x80", match="UTF-8")  # UTF-16 surrogate D800 in UTF-8
    _bad(b"\x30\x04\x00\x02\xc0\x80", match="UTF-8")  # overlong U+0000
    _bad(b"\x32\x05\x00\x01a\x00\x00", code=0x82, match="packet id 0")
    _bad(b"\x30\x03\x00\x05a", match="past the end")


def test_zero_packet_ids():
    for first in (0x40, 0x50, 0x62, 0x70):
        _bad(bytes((first, 2, 0, 0)), code=0x82, match="packet id 0")
    _bad(b"\x82\x06\x00\x00\x00\x01a\x00", code=0x82, match="packet id 0")
    _bad(b"\xa2\x05\x00\x00\x00\x01a", code=0x82, match="packet id 0")
    _bad(b"\x90\x03\x00\x00\x00", server_side=False, code=0x82)


def test_empty_subscription_lists():
    _bad(b"\x82\x02\x00\x01", code=0x82, match="no topic filters")
    _bad(b"\x82\x03\x00\x01\x00", 5, code=0x82, match="no topic filters")
    _bad(b"\xa2\x02\x00\x01", code=0x82, match="no topic filters")


def test_subscribe_options():
    _bad(b"\x82\x06\x00\x01\x00\x01a\x03", match="QoS 3")
    _bad(b"\x82\x06\x00\x01\x00\x01a\x04", 4, match="reserved")  # no-local bit is reserved in 3.1.1
    _bad(b"\x82\x07\x00\x01\x00\x00\x01a\x40", 5, match="reserved")
    _bad(b"\x82\x07\x00\x01\x00\x00\x01a\x30", 5, code=0x82, match="retain handling")
    f = b"$share/g/a"
    _bad(b"\x82" + bytes((6 + len(f),)) + b"\x00\x01\x00\x00" + bytes((len(f),)) + f + b"\x04", 5,
         code=0x82, match="No Local")


def test_properties_strictness():
    # duplicate property (content type twice) on PUBLISH
    props = b"\x03\x00\x01a\x03\x00\x01b"
    _bad(b"\x30" + bytes((4 + len(props),)) + b"\x00\x01t" + bytes((len(props),)) + props,
         5, code=0x82, match="more than once")
    # user property twice and subscription identifier twice are fine on PUBLISH
    ok = P.Properties(user_property=[("a", "1"), ("a", "2")], subscription_identifier=[1, 2])
    assert decode_one(encode(P.Publish("t", b"", properties=ok), 5), 5, server_side=False).properties == ok
    # ... but two subscription identifiers on SUBSCRIBE are a protocol error
    sub = encode(P.Subscribe(1, [P.SubscriptionRequest("a")], P.Properties(subscription_identifier=[1, 2])), 5)
    _bad(sub, 5, code=0x82, match="more than once")
    # property not allowed on the packet type (session expiry on PUBLISH)
    _bad(b"\x30\x09\x00\x01t\x05\x11\x00\x00\x00\x01", 5, code=0x82, match="not allowed on PUBLISH")
    # unknown property id
    _bad(b"\x30\x06\x00\x01t\x02\x7f\x00", 5, code=0x81, match="unknown property")
    # out-of-range values
    _bad(b"\x30\x06\x00\x01t\x02\x01\x02", 5, code=0x82, match="payload_format_indicator")
    _bad(b"\x30\x07\x00\x01t\x03\x23\x00\x00", 5, code=0x82, match="topic_alias")
    _bad(b"\x30\x06\x00\x01t\x02\x0b\x00", 5, code=0x82, match="subscription_identifier")
    # property length runs past the packet
    _bad(b"\x30\x05\x00\x01t\x09\x01", 5, match="past the end")
    # a client's PUBLISH must not carry a subscription identifier (a server's may)
    _bad(encode(P.Publish("t", b"", properties=P.Properties(subscription_identifier=[3])), 5), 5,
         code=0x82, match="subscription identifier")
    # authentication data needs an authentication method
    with pytest.raises(ProtocolError, match="authentication method"):
        Decoder().feed(encode(P.Connect("c", 5, properties=P.Properties(authentication_data=b"x")), 5))
    # reason string on PUBACK is allowed; on PUBLISH it is not
    _bad(b"\x30\x08\x00\x01t\x04\x1f\x00\x01x", 5, code=0x82, match="reason_string")


def test_connect_rules():
    def connect(flags: int, rest: bytes = b"\x00\x00", name: bytes = b"\x00\x04MQTT", level: int = 4):
        body = name + bytes((level, flags)) + b"\x00\x3c" + rest
        return b"\x10" + encode_varint(len(body)) + body

    def bad(data, code=None, match=None):
        with pytest.raises(ProtocolError) as ei:
            Decoder().feed(data)
        if code is not None:
            assert ei.value.reason_code == code
        if match:
            assert match in str(ei.value)

    bad(connect(0x03), match="reserved flag")
    bad(connect(0x12), match="without the will flag")  # will QoS 2 without will flag
    bad(connect(0x22), match="without the will flag")  # will retain without will flag
    bad(connect(0x1E, b"\x00\x00\x00\x01w\x00\x00"), match="QoS 3")
    bad(connect(0x42, b"\x00\x00\x00\x01p"), code=0x82, match="password")
    bad(connect(0x02, level=6), code=0x84, match="protocol level 6")
    bad(connect(0x02, name=b"\x00\x04MQTX"), code=0x84, match="protocol name")
    bad(connect(0x02, b"\x00\x00\x00"), match="trailing")
    bad(connect(0x02, b"\x00\x05ab"), match="client identifier")
    # v5: password without user name is allowed
    [c] = Decoder().feed(connect(0x42, b"\x00\x00\x00\x00\x01p", level=5))
    assert c.password == b"p" and c.username is None


def test_first_packet_must_be_connect_and_only_once():
    with pytest.raises(ProtocolError, match="first packet must be CONNECT") as ei:
        Decoder().feed(b"\xc0\x00")
    assert ei.value.reason_code == 0x82
    d = server(4)
    with pytest.raises(ProtocolError, match="second CONNECT"):
        d.feed(CONNECT_V4)


def test_direction_and_unknown_types():
    _bad(b"\x20\x02\x00\x00", code=0x82, match="server must not receive CONNACK")
    _bad(b"\xd0\x00", code=0x82)
    _bad(CONNECT_V4, server_side=False, code=0x82, match="client must not receive CONNECT")
    _bad(b"\x00\x00", code=0x81, match="type 0")
    _bad(b"\xf0\x00", 4, code=0x81, match="AUTH")  # type 15 is reserved in 3.1.1
    assert decode_one(b"\xf0\x00", 5) == P.Auth()


def test_v311_acks_and_disconnect_with_extra_bytes_are_malformed():
    _bad(b"\x40\x03\x00\x01\x00", 4, match="remaining length 2")
    _bad(b"\xe0\x01\x00", 4, match="remaining length 0")
    _bad(b"\xc0\x01\x00", 5, match="remaining length 0")
    _bad(b"\x40\x03\x00\x01\x05", 5, match="reason code 0x05")
    _bad(b"\xe0\x01\x03", 5, match="reason code 0x03")


def test_client_side_checks():
    _bad(b"\x20\x02\x02\x00", 4, server_side=False, match="reserved flags")
    _bad(b"\x20\x02\x00\x06", 4, server_side=False, match="return code 6")
    _bad(b"\x20\x02\x01\x05", 4, server_side=False, match="session present")
    _bad(b"\x90\x03\x00\x01\x03", 4, server_side=False, match="0x03")
    with pytest.raises(ValueError):
        Decoder(None, server_side=False)


# ----------------------------------------------------------------------------- lengths and limits
@pytest.mark.parametrize("rl", [127, 128, 16383, 16384, 2097151, 2097152])
def test_remaining_length_edges_decode(rl):
    topic = b"\x00\x01t"
    payload = b"p" * (rl - len(topic))
    data = b"\x30" + encode_varint(rl) + topic + payload
    d = server(4)
    assert d.feed(data[:-1]) == []
    [p] = d.feed(data[-1:])
    assert p.topic == "t" and len(p.payload) == rl - 3
    assert encode(p, 4) == data


def test_remaining_length_max_header_is_accepted_but_not_allocated():
    d = server(4)
    d.max_packet_size = 268_435_455 + 5
    assert d.feed(b"\x30\xff\xff\xff\x7f\x00\x01t") == []
    assert d.buffered == 8  # waits for the body; nothing of the claimed size was allocated


def test_remaining_length_five_bytes_is_malformed():
    _bad(b"\x30\xff\xff\xff\xff\x01", match="longer than 4 bytes")
    d = server(4)  # detected even when the 5th byte has not arrived yet
    with pytest.raises(ProtocolError, match="longer than 4 bytes"):
        d.feed(b"\x30\xff\xff\xff\xff")


def test_max_packet_size_refused_before_buffering():
    d = Decoder(max_packet_size=1000)
    d.feed(CONNECT_V4)
    ok = encode_publish("t", b"x" * 994, 0)  # 1 + 2 (remaining length) + 3 (topic) + 994 = 1000
    assert len(ok) == 1000
    assert d.feed(ok)[0].payload == b"x" * 994
    with pytest.raises(ProtocolError) as ei:
        d.feed(encode_publish("t", b"x" * 995, 0)[:5])  # only the header has arrived
    assert ei.value.reason_code == 0x95 and "1001" in str(ei.value)


def test_huge_claimed_length_with_default_limit():
    d = server(5)
    with pytest.raises(ProtocolError) as ei:
        d.feed(b"\x30\xff\xff\xff\x7f")
    assert ei.value.reason_code == ReasonCode.PACKET_TOO_LARGE


def test_partial_packets_are_buffered_and_multiple_packets_per_feed():
    d = Decoder()
    data = CONNECT_V4 + encode(P.Subscribe(1, [P.SubscriptionRequest("a")]), 4) + b"\xc0\x00" + b"\x30"
    got = d.feed(data)
    assert [type(p) for p in got] == [P.Connect, P.Subscribe, P.PingReq]
    assert d.buffered == 1
    assert d.feed(b"\x03\x00\x01a") == [P.Publish("a", b"")]
    assert d.buffered == 0


def test_packets_before_the_bad_bytes_are_kept_on_the_error():
    d = server(4)
    good = encode(P.Publish("a", b"1", 1, packet_id=1), 4) + b"\xc0\x00"
    with pytest.raises(ProtocolError) as ei:
        d.feed(good + b"\x00\x00")
    assert ei.value.packets == [P.Publish("a", b"1", 1, packet_id=1), P.PingReq()]
    with pytest.raises(ProtocolError, match="already failed") as again:
        d.feed(b"\xc0\x00")
    assert again.value.packets == [] and again.value.reason_code == ei.value.reason_code


def test_version_known_after_a_malformed_v5_connect():
    d = Decoder()
    body = b"\x00\x04MQTT\x05\x02\x00\x3c\x00" + b"\x00\x02\xff\xfe"  # client id is not UTF-8
    with pytest.raises(ProtocolError, match="client identifier"):
        d.feed(b"\x10" + bytes((len(body),)) + body)
    assert d.version == 5  # so the server can answer CONNACK 0x81 in MQTT 5


# ----------------------------------------------------------------------------- server-side helpers
@pytest.mark.parametrize("version", [4, 5])
def test_success_acks_equal_encoded_puback_and_pubrec(version):
    from lmqtt.gateway.mqtt import SUCCESS_ACK_HEAD, encode_success_acks
    acks = [(1, 1), (2, 256), (1, 65535), (2, 7)]
    words = []
    for qos, pid in acks:
        words += [SUCCESS_ACK_HEAD[qos], pid]
    want = b"".join(encode(P.PubAck(pid) if qos == 1 else P.PubRec(pid), version) for qos, pid in acks)
    assert encode_success_acks(words) == want
    assert encode_success_acks(words[:2]) == encode(P.PubAck(1), version)


def test_connack_refusal_and_malformed_connect_reply():
    from lmqtt.gateway.mqtt import encode_connack_refusal, encode_malformed_connect_reply
    want5 = P.ConnAck(False, ReasonCode.NOT_AUTHORIZED)
    want5.properties.reason_string = "no"
    assert encode_connack_refusal(ReasonCode.NOT_AUTHORIZED, "no", 5) == encode(want5, 5)
    assert decode_one(encode_connack_refusal(ReasonCode.NOT_AUTHORIZED, "no", 4), 4,
                      server_side=False).reason_code == 5
    assert encode_malformed_connect_reply(ReasonCode.UNSUPPORTED_PROTOCOL_VERSION, "x", 4) == bytes(
        [0x20, 2, 0, 1])
    assert encode_malformed_connect_reply(ReasonCode.MALFORMED_PACKET, "x", 4) is None
    assert encode_malformed_connect_reply(ReasonCode.MALFORMED_PACKET, "x", None) is None
    ack = decode_one(encode_malformed_connect_reply(ReasonCode.TOPIC_ALIAS_INVALID, "bad", 5), 5,
                     server_side=False)
    assert ack.reason_code == ReasonCode.MALFORMED_PACKET      # CONNACK cannot carry 0x94
    ack = decode_one(encode_malformed_connect_reply(ReasonCode.PACKET_TOO_LARGE, "big", 5), 5,
                     server_side=False)
    assert ack.reason_code == ReasonCode.PACKET_TOO_LARGE and ack.properties.reason_string == "big"


@pytest.mark.parametrize("version", [4, 5])
def test_publish_template_encode_every_variant_equals_plain_encoding(version):
    props = _v5_props(content_type="a") if version == 5 else None
    t = PublishTemplate("v/1", b"p" * 200, 0, False, props, version)
    for qos in (0, 1, 2):
        for retain in (False, True):
            for dup in (False, True):
                pid = 300 if qos else None
                want = encode_publish("v/1", b"p" * 200, qos, retain, dup and qos > 0, pid, props, version)
                assert t.encode(qos, retain, version, pid, dup and qos > 0) == want
    with pytest.raises(ValueError):
        t.encode(1, False, version, None)


def test_publish_template_expiry_variants_carry_the_seconds_left_and_the_other_properties():
    """`encode_with_expiry` is the MQTT 5 PUBLISH with the template's other properties and the
    seconds left as Message Expiry Interval (last, as a per-subscriber build appends it): byte for
    byte `encode_publish_v5_parts` from `properties_body`, every QoS, retain and DUP, read back
    with the seconds left; a new second gives new bytes, not the previous second's cached ones."""
    props = _v5_props(message_expiry_interval=60, content_type="c", user_property=[("k", "v")])
    t = PublishTemplate("e/1", b"p" * 200, 0, False, props, 5)
    for left in (60, 59, 1):
        for qos in (0, 1, 2):
            for retain in (False, True):
                for dup in ((False, True) if qos else (False,)):
                    pid = 65535 if qos else None
                    data = t.encode_with_expiry(qos, retain, pid, dup, left)
                    assert data == encode_publish_v5_parts("e/1", b"p" * 200, qos, retain, dup, pid,
                                                           t.properties_body() + message_expiry_prop(left))
                    assert decode_one(data, 5, server_side=False) == P.Publish(
                        "e/1", b"p" * 200, qos, retain, dup, pid, replace(props, message_expiry_interval=left))
    assert props.message_expiry_interval == 60        # the caller's properties are left as they were
    with pytest.raises(ValueError):
        t.encode_with_expiry(1, False, None, False, 5)


@pytest.mark.parametrize("props", [None, P.Properties(), _v5_props(message_expiry_interval=9),
                                   _v5_props(message_expiry_interval=9, response_topic="r", correlation_data=b"x")])
def test_publish_template_properties_body_is_every_property_but_the_expiry(props):
    """`properties_body` is what a per-subscriber PUBLISH starts from (no length prefix): sent as
    it is, the client reads the template's properties without the Message Expiry Interval."""
    t = PublishTemplate("b/1", b"", 0, False, props, 5)
    got = decode_one(encode_publish_v5_parts("b/1", b"", 0, False, False, None, t.properties_body()), 5,
                     server_side=False)
    assert got.properties == (replace(props, message_expiry_interval=None) if props else P.Properties())


def test_templates_of_one_message_share_their_encodings():
    """A template given another template's `encodings` (the gateway's message read through another
    queue) reuses what the first one encoded, and adds to it what it encodes itself."""
    first = PublishTemplate("s/1", b"x" * 50, 0, False, _v5_props(content_type="a"), 5)
    a = first.encode(1, False, 5, 7)

    class Bare(PublishTemplate):
        __slots__ = ()

        def __init__(self, same):
            self.topic, self.payload, self.encodings = "s/1", b"x" * 50, same.encodings

        def message_properties(self):
            raise AssertionError("the shared encodings hold the property block already")

    second = Bare(first)
    assert second.encode(1, False, 5, 7) == a
    b = second.encode(2, True, 4, 9, True)
    assert first.encode(2, True, 4, 9, True) == b == encode_publish("s/1", b"x" * 50, 2, True, True, 9, None, 4)
