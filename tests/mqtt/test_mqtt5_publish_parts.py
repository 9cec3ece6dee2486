"""The per-subscriber MQTT 5 PUBLISH (`encode_publish_v5_parts` + the property helpers): what the
gateway sends when a subscriber gets a topic alias, subscription identifiers or a remaining
message expiry. Checked by decoding with the client-side codec and against the general encoder."""
from __future__ import annotations

import itertools

import pytest

from lmqtt.gateway.mqtt import (Decoder, encode_publish, encode_publish_v5_parts, message_expiry_prop,
                                packets as P, subscription_identifier_props, topic_alias_prop)
from lmqtt.gateway.mqtt.properties import encode_properties
from lmqtt.gateway.mqtt.wire import read_varint


def _decode(data: bytes) -> P.Publish:
    pkts = Decoder(version=5, server_side=False).feed(data)
    assert len(pkts) == 1 and isinstance(pkts[0], P.Publish)
    return pkts[0]


@pytest.mark.parametrize("qos,retain,dup", [(q, r, d) for q, r, d in itertools.product((0, 1, 2), (False, True),
                                                                                     (False, True)) if q or not d])
def test_parts_equal_the_general_encoder(qos, retain, dup):
    props = P.Properties(content_type="text/plain", correlation_data=b"\x00c", user_property=[("k", "v")])
    block = encode_properties(props)
    _, start = read_varint(block, 0, len(block))
    extra = message_expiry_prop(30) + subscription_identifier_props([1, 268435455]) + topic_alias_prop(65535)
    pid = 513 if qos else None
    got = _decode(encode_publish_v5_parts("a/b", b"payload", qos, retain, dup, pid, block[start:] + extra))
    props.message_expiry_interval = 30
    props.subscription_identifier = [1, 268435455]
    props.topic_alias = 65535
    want = _decode(encode_publish("a/b", b"payload", qos, retain, dup, pid, props, 5))
    assert got == want
    assert (got.qos, got.retain, got.dup, got.packet_id) == (qos, retain, dup, pid)


def test_empty_topic_with_alias_only():
    p = _decode(encode_publish_v5_parts(None, b"x", 1, False, False, 9, topic_alias_prop(4)))
    assert (p.topic, p.properties.topic_alias, p.payload, p.packet_id) == ("", 4, b"x", 9)


def test_no_properties_is_an_empty_block():
    data = encode_publish_v5_parts("t", b"", 0, False, False, None, b"")
    assert data == encode_publish("t", b"", 0, False, False, None, None, 5)


def test_qos1_without_packet_id_is_refused():
    with pytest.raises(ValueError):
        encode_publish_v5_parts("t", b"", 1, False, False, None, b"")


def test_subscription_identifier_varint_sizes():
    for sid, size in ((1, 2), (127, 2), (128, 3), (16383, 3), (16384, 4), (268435455, 5)):
        assert len(subscription_identifier_props([sid])) == size
