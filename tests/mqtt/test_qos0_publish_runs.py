"""`encode_qos0_publishes`: a run of QoS 0 PUBLISHes without properties (what a history sends, see
gateway/replay.py) is byte for byte the `PublishTemplate` QoS 0 variants joined, for MQTT 3.1.1
and 5, every remaining-length width, retain both ways, non-ASCII topics; those above a Maximum
Packet Size are left out and counted; the client-side decoder reads the run back in order."""
from __future__ import annotations

import random

import pytest

from lmqtt.gateway.mqtt import Decoder, PublishTemplate, encode_qos0_publishes, packets as P


def sample(rng, n=200):
    topics = ["a", "a/b", "é/ü/日本", "t" * 120, "x" * 3000]
    sizes = [0, 1, 60, 124, 125, 126, 127, 128, 300, 16_383, 16_384, 70_000]
    return [(rng.choice(topics), rng.randbytes(rng.choice(sizes)), rng.random() < 0.3) for _ in range(n)]


@pytest.mark.parametrize("version", [3, 4, 5])
def test_a_run_is_the_template_variants_joined(version):
    msgs = sample(random.Random(version))
    data, dropped = encode_qos0_publishes(msgs, version)
    assert dropped == 0
    assert data == b"".join(PublishTemplate(t, p).encode(0, r, version) for t, p, r in msgs)
    got = Decoder(version=version, server_side=False).feed(data)
    assert [(g.topic, g.payload, g.retain, g.qos) for g in got if isinstance(g, P.Publish)] == \
        [(t, p, r, 0) for t, p, r in msgs]


@pytest.mark.parametrize("limit", [1, 10, 130, 131, 20_000])
def test_packets_over_the_maximum_packet_size_are_left_out(limit):
    msgs = sample(random.Random(limit), 120)
    data, dropped = encode_qos0_publishes(msgs, 5, limit)
    each = [PublishTemplate(t, p).encode(0, r, 5) for t, p, r in msgs]
    kept = [b for b in each if len(b) <= limit]
    assert data == b"".join(kept) and dropped == len(each) - len(kept)


def test_an_empty_run():
    assert encode_qos0_publishes([], 4) == (b"", 0)
