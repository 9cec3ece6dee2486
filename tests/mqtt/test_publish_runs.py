"""Runs of PUBLISHes without properties, `encode_publish_run` (what a history sends, see
gateway/delivery/history.py; retained messages on SUBSCRIBE, gateway/delivery/retained.py; a reader's backlog,
`MqttSession.offer_records`, gateway/session/outbound.py), are byte for byte the `PublishTemplate` encodings joined, for MQTT 3.1.1 and 5, every
remaining-length width, retain both ways, non-ASCII topics; QoS 0 packets above a Maximum Packet
Size are left out and counted; the client-side decoder reads each run back in order. Each test
runs on the C loop (gateway/mqtt/_run.c, when built) and on its Python reference."""
from __future__ import annotations

import random

import pytest

from lmqtt.gateway.mqtt import Decoder, PublishTemplate, encoder, packets as P


@pytest.fixture(params=["c", "python"])
def encode_publish_run(request):
    if request.param == "python":
        return encoder.encode_publish_run_py
    if encoder._run is None:
        pytest.skip("lmqtt.gateway.mqtt._run is not built (or LMQTT_PURE_PYTHON is set)")
    return encoder._run.encode_publish_run


def qos0(msgs):
    """(topic, payload, retain) -> the run's (topic, payload, qos 0, retain, no packet id)."""
    return [(t, p, 0, r, None) for t, p, r in msgs]


def sample(rng, n=200):
    topics = ["a", "a/b", "é/ü/日本", "t" * 120, "x" * 3000]
    sizes = [0, 1, 60, 124, 125, 126, 127, 128, 300, 16_383, 16_384, 70_000]
    return [(rng.choice(topics), rng.randbytes(rng.choice(sizes)), rng.random() < 0.3) for _ in range(n)]


@pytest.mark.parametrize("version", [3, 4, 5])
def test_a_run_is_the_template_variants_joined(version, encode_publish_run):
    msgs = sample(random.Random(version))
    data, dropped = encode_publish_run(qos0(msgs), version)
    assert dropped == 0
    assert data == b"".join(PublishTemplate(t, p).encode(0, r, version) for t, p, r in msgs)
    got = Decoder(version=version, server_side=False).feed(data)
    assert [(g.topic, g.payload, g.retain, g.qos) for g in got if isinstance(g, P.Publish)] == \
        [(t, p, r, 0) for t, p, r in msgs]


@pytest.mark.parametrize("limit", [1, 10, 130, 131, 20_000])
def test_packets_over_the_maximum_packet_size_are_left_out(limit, encode_publish_run):
    msgs = sample(random.Random(limit), 120)
    data, dropped = encode_publish_run(qos0(msgs), 5, limit)
    each = [PublishTemplate(t, p).encode(0, r, 5) for t, p, r in msgs]
    kept = [b for b in each if len(b) <= limit]
    assert data == b"".join(kept) and dropped == len(each) - len(kept)


def test_an_empty_run(encode_publish_run):
    assert encode_publish_run([], 4) == (b"", 0)


@pytest.mark.parametrize("version", [3, 4, 5])
@pytest.mark.parametrize("retain", [False, True])
def test_a_run_with_one_retain_flag_is_the_template_encoding_joined(version, retain, encode_publish_run):
    """The QoS 0/1/2 run (retained messages on SUBSCRIBE): packet ids in place, every length width."""
    rng = random.Random(version * 2 + retain)
    msgs = [(t, p, q, rng.randint(1, 65535) if q else None)
            for (t, p, _r), q in zip(sample(rng), [rng.choice([0, 1, 2]) for _ in range(200)])]
    data, _ = encode_publish_run([(t, p, q, retain, pid) for t, p, q, pid in msgs], version)
    assert data == b"".join(PublishTemplate(t, p).encode(q, retain, version, pid) for t, p, q, pid in msgs)
    got = [g for g in Decoder(version=version, server_side=False).feed(data) if isinstance(g, P.Publish)]
    assert [(g.topic, g.payload, g.qos, g.packet_id, g.retain) for g in got] == \
        [(t, p, q, pid, retain) for t, p, q, pid in msgs]
    with pytest.raises(ValueError, match="packet id"):
        encode_publish_run([("a", b"", 1, retain, None)], version)


@pytest.mark.parametrize("version", [3, 4, 5])
def test_encode_publish_run_is_the_template_encoding_joined(version, encode_publish_run):
    """The backlog run (`MqttSession.offer_records`): QoS 0/1/2, retain per message, packet ids in place
    (1 and 65535 included), every length width."""
    rng = random.Random(100 + version)
    msgs = [(t, p, q, r, rng.choice([1, 65535, rng.randint(1, 65535)]) if q else None)
            for (t, p, r), q in zip(sample(rng, 300), [rng.choice([0, 1, 1, 2]) for _ in range(300)])]
    data, dropped = encode_publish_run(msgs, version)
    assert dropped == 0
    assert data == b"".join(PublishTemplate(t, p).encode(q, r, version, pid) for t, p, q, r, pid in msgs)
    got = [g for g in Decoder(version=version, server_side=False).feed(data) if isinstance(g, P.Publish)]
    assert [(g.topic, g.payload, g.qos, g.packet_id, g.retain, g.dup) for g in got] == \
        [(t, p, q, pid, r, False) for t, p, q, r, pid in msgs]
    assert encode_publish_run([], version) == (b"", 0)
    for bad in (None, 0, 65536):
        with pytest.raises(ValueError, match="packet id"):
            encode_publish_run([("a", b"", 1, False, bad)], version)
