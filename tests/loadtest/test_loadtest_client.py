"""The load generator's own MQTT client against the gateway's codec: what it writes decodes as
the intended PUBLISH packets, and what it reads — through the fast same-shape path or the
general scanner, in reads of any size — is accounted exactly like one ``Stream.see`` per message.

No broker here (tests/loadtest/test_loadtest_mosquitto.py runs the generator against a real one); the
"transport" only records the bytes the client writes back (its acks).
"""
from __future__ import annotations

import asyncio
import random

import pytest

from lmqtt.gateway.mqtt import Decoder, encode
from lmqtt.gateway.mqtt import packets as P
from lmqtt.loadtest.mqtt_client import Client, PidAllocator, Sink, StampedPublisher
from lmqtt.loadtest.stamp import STAMP, Stream, Tracker, make_payload

from tests.fakes import RecordingTransport as Transport


def _client(sub_id: int = 0, sink: bool = True) -> tuple[Client, Tracker]:
    tr = Tracker()
    c = Client("c", 4, sub_id=sub_id, sink=Sink(tr) if sink else None)
    c.transport = Transport()
    return c, tr


def _stamped(pub: int, seq: int, size: int = 40) -> bytes:
    payload = make_payload(size)
    STAMP.pack_into(payload, 0, pub, seq, 1_000)
    return bytes(payload)


def _run(coro_fn):
    """Client needs a running loop (it creates a future); the tests themselves are synchronous."""
    async def main():
        return coro_fn()
    return asyncio.run(main())


@pytest.mark.parametrize("qos", [0, 1, 2])
@pytest.mark.parametrize("version", [4, 5])
def test_stamped_batches_decode_with_the_gateway_codec(qos, version):
    def body():
        sp = StampedPublisher(9, "lb/run/in/0042", 64, qos, version)
        pids = [65534, 65535, 1, 2] if qos else None
        first = 2**32 - 2  # sequence numbers wrap at 32 bits inside the stamp
        wire = sp.batch(first, pids, 4)
        pkts = list(Decoder(version=version, server_side=False).feed(bytes(wire)))
        assert len(pkts) == 4
        for i, pkt in enumerate(pkts):
            assert isinstance(pkt, P.Publish)
            assert (pkt.topic, pkt.qos, pkt.retain, len(pkt.payload)) == ("lb/run/in/0042", qos, False, 64)
            assert pkt.packet_id == (pids[i] if qos else None)
            pub, seq, sent = STAMP.unpack_from(pkt.payload)
            assert (pub, seq) == (9, (first + i) & 0xFFFFFFFF) and sent > 0
            assert pkt.payload[16:] == make_payload(64)[16:]
    _run(body)


def test_pid_allocator_skips_ids_in_flight_and_wraps():
    inflight = {3, 4}
    a = PidAllocator(inflight)
    assert a.take(4) == [1, 2, 5, 6]
    assert inflight == {1, 2, 3, 4, 5, 6}
    a.next = 65533
    inflight.clear()
    assert a.take(4) == [65534, 65535, 1, 2]  # 0 is never a packet id
    assert a.take(2) == [3, 4]
    inflight.add(5)
    assert a.take(1) == [6]  # the one-id path (fixed-rate publishing) skips in-flight ids too
    a.next = 65535
    assert a.take(1) == [7]  # wraps past 0 to 1; 1-6 are in flight, so 7
    assert inflight >= {1, 2, 3, 4, 5, 6, 7}


def _scenario(rng: random.Random, n: int) -> list[int]:
    """A delivery order with gaps, late arrivals and duplicates, mostly in order (as in a run)."""
    seqs = list(range(n))
    out: list[int] = []
    i = 0
    while i < n:
        r = rng.random()
        if r < 0.03 and i + 3 < n:  # a gap filled a little later (out of order)
            out += [seqs[i + 1], seqs[i + 2], seqs[i]]
            i += 3
        elif r < 0.05:  # lost for good
            i += 1
        elif r < 0.07 and out:  # a duplicate of something already delivered
            out.append(rng.choice(out))
        else:
            out.append(seqs[i])
            i += 1
    return out


@pytest.mark.parametrize("qos", [0, 1])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_receive_paths_account_like_one_see_per_message(qos, seed):
    """Codec-encoded PUBLISHes in random read sizes (1 byte to hundreds of packets, so both the
    row and the column fast path and partial tails are exercised), with other packets between
    them (PINGRESP, a DUP redelivery, a PUBLISH of another topic length): the per-publisher
    counts equal those of feeding the same sequence numbers to ``Stream.see`` one by one,
    every QoS 1 PUBLISH is acknowledged once, in order, and every stamped message has a latency."""
    def body():
        rng = random.Random(seed)
        order = _scenario(rng, 3000)
        packets: list[bytes] = []
        expect_acks: list[int] = []
        truth: dict[int, Stream] = {}
        pid = 0
        for seq in order:
            pub = 7 if rng.random() < 0.9 else 8  # mostly one publisher, like fan-out and pairs
            topic = "lb/x/pair/07" if rng.random() > 0.01 else "lb/x/other-length"
            dup = qos == 1 and rng.random() < 0.01
            pid = pid % 0xFFFF + 1
            packets.append(encode(P.Publish(topic, _stamped(pub, seq), qos, False, dup,
                                            pid if qos else None), 4))
            if qos:
                expect_acks.append(pid)
            truth.setdefault(pub, Stream()).see(seq)
            if rng.random() < 0.01:
                packets.append(encode(P.PingResp(), 4))
        wire = b"".join(packets)
        c, tr = _client(sub_id=3)
        pos = 0
        while pos < len(wire):
            step = rng.choice([1, 5, 60, 81, 400, 2000, 20000])
            c.data_received(wire[pos:pos + step])
            pos += step
        assert c.error is None and c.buf == b""
        for pub, want in truth.items():
            got = tr.streams[(3, pub)]
            assert (got.unique, got.duplicates, got.out_of_order, got.hi, got.gaps) == \
                (want.unique, want.duplicates, want.out_of_order, want.hi, want.gaps)
        assert c.received == len(order)
        assert len(c.sink.take_latencies()) == len(order)
        if qos:
            out = bytes(c.transport.out)
            assert len(out) == 4 * len(expect_acks)
            assert [int.from_bytes(out[i + 2:i + 4], "big") for i in range(0, len(out), 4)] == expect_acks
            assert set(out[0::4]) == {0x40} and set(out[1::4]) == {2}
        else:
            assert not c.transport.out
    _run(body)


def test_publisher_acks_fast_path_and_qos2_handshake_through_the_scanner():
    def body():
        c, _ = _client(sink=False)
        released: list[int] = []
        c.on_acks = released.append
        c.inflight.update(range(1, 11))
        c.data_received(b"".join(encode(P.PubAck(i), 4) for i in (1, 2, 3, 4)))  # fast path
        c.data_received(encode(P.PubAck(99), 4))  # not in flight (a stale ack): nothing released
        assert c.inflight == set(range(5, 11)) and released == [4]
        # QoS 2: PUBREC -> we send PUBREL; PUBCOMP frees the slot
        c.data_received(encode(P.PubRec(5), 4) + encode(P.PubAck(6), 4))
        assert bytes(c.transport.out) == encode(P.PubRel(5), 4)
        c.data_received(encode(P.PubComp(5), 4))
        assert c.inflight == set(range(7, 11)) and released == [4, 1, 1]
    _run(body)


def test_publish_shape_that_runs_past_its_length_is_still_rejected_after_learning():
    """Once the fast path has learned a shape, a malformed packet (header bytes that differ from
    the shape) still reaches the bounds-checked scanner and closes the connection."""
    def body():
        c, tr = _client(sub_id=1)
        good = encode(P.Publish("lb/t", _stamped(1, 0), 0), 4)
        c.data_received(good)
        assert c.shape
        c.data_received(encode(P.Publish("lb/t", _stamped(1, 1), 0), 4) + b"\x30\x05\x00\x7fabc")
        assert tr.streams[(1, 1)].unique == 2
        assert c.transport.closed and "malformed PUBLISH" in c.error
    _run(body)
