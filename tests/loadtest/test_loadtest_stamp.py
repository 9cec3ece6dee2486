"""Loss / duplicate / out-of-order accounting of the load generator's subscribers."""
from __future__ import annotations

import random

from lmqtt.loadtest.stamp import (STAMP_SIZE, Stream, Tracker, account, make_payload, merge_per_publisher,
                                  read_stamp, stamp_into)


def feed(seqs):
    st = Stream()
    for s in seqs:
        st.see(s)
    return st


def test_in_order_stream():
    st = feed(range(100))
    assert (st.unique, st.duplicates, st.out_of_order, st.missing) == (100, 0, 0, 0)


def test_gap_then_late_arrival_is_out_of_order_not_lost():
    st = feed([0, 1, 4, 2, 5, 3])
    assert (st.unique, st.duplicates, st.out_of_order, st.missing) == (6, 0, 2, 0)


def test_duplicates_of_delivered_and_of_late_messages():
    st = feed([0, 1, 1, 3, 2, 2, 3, 0])
    assert st.unique == 4 and st.out_of_order == 1 and st.duplicates == 4 and st.missing == 0


def test_loss_in_the_middle_and_at_the_tail():
    st = feed([0, 1, 5, 6])  # 2,3,4 missing; 7..9 never came
    assert st.missing == 3 and st.unique == 4
    totals = account({7: {"streams": 1, "unique": st.unique, "duplicates": 0, "out_of_order": 0}},
                     sent={7: 10})
    assert totals["lost"] == 6 and totals["received"] == 4 and totals["expected"] == 10


def test_large_gap_is_cheap_and_filled_piecewise():
    st = feed([0, 1_000_000])
    assert len(st.gaps) == 1 and st.missing == 999_999
    for s in (500_000, 1, 999_999, 500_001, 499_999):
        st.see(s)
    assert st.out_of_order == 5 and st.missing == 999_994 and st.duplicates == 0
    st.see(500_000)
    assert st.duplicates == 1


def test_random_shuffle_with_duplicates_matches_ground_truth():
    rnd = random.Random(11)
    sent = 3000
    delivered = [s for s in range(sent) if rnd.random() > 0.05]  # 5 % lost
    dups = rnd.sample(delivered, 100)
    stream = delivered + dups
    # local reordering, as a broker with several paths might do
    for i in range(0, len(stream) - 5, 7):
        j = i + rnd.randrange(1, 5)
        stream[i], stream[j] = stream[j], stream[i]
    st = feed(stream)
    assert st.unique == len(delivered)
    assert st.duplicates == 100
    assert st.missing == sent - len(delivered) - (sent - 1 - st.hi)
    t = account({1: {"streams": 1, "unique": st.unique, "duplicates": st.duplicates,
                     "out_of_order": st.out_of_order}}, {1: sent})
    assert t["lost"] == sent - len(delivered)


def test_tracker_counts_silent_expected_streams_as_lost_and_merges_workers():
    a, b = Tracker(), Tracker()
    for sub in range(3):  # fan-out: 3 subscribers of publisher 9, one in another process
        (a if sub < 2 else b).expect(sub, 9)
    for seq in range(5):
        a.see(0, 9, seq)
        a.see(1, 9, seq)
    # subscriber 2 (in b) received nothing; an unknown publisher 4 shows up in a
    a.see(0, 4, 0)
    per_pub = merge_per_publisher([a.to_dict(), b.to_dict()])
    t = account(per_pub, {9: 5})
    assert t == {"expected": 15, "received": 10, "lost": 5, "duplicated": 0, "out_of_order": 0,
                 "unexpected": 1}


def test_stamp_roundtrip_inside_an_encoded_packet():
    payload = make_payload(64)
    pkt = bytearray(b"\x30\x00topic") + payload
    off = len(pkt) - len(payload)
    stamp_into(pkt, off, 12, 2**32 + 5, 123456789)
    assert read_stamp(pkt, off) == (12, 5, 123456789)
    assert pkt[off + STAMP_SIZE:] == payload[STAMP_SIZE:]


def test_client_scanner_accounts_split_reads_and_rejects_malformed_publish():
    """The receive scanner on real encoded bytes: packets split across reads at every offset are
    counted once each; a PUBLISH whose topic length runs past the packet closes the connection."""
    import asyncio

    from tests.fakes import RecordingTransport as Transport
    from lmqtt.loadtest.mqtt_client import Client, Sink, StampedPublisher

    async def run():
        sp = StampedPublisher(3, "lb/t/x", 40, 1, 4)
        wire = bytes(sp.batch(0, [1, 2, 3, 4, 5], 5))
        for cut in range(1, len(wire)):
            tr = Tracker()
            c = Client("c", 4, sub_id=7, sink=Sink(tr))
            c.transport = Transport()
            c.data_received(wire[:cut])
            c.data_received(wire[cut:])
            st = tr.streams[(7, 3)]
            assert (st.unique, st.duplicates, st.hi) == (5, 0, 4), cut
            assert bytes(c.transport.out) == b"".join(b"\x40\x02\x00" + bytes([i]) for i in range(1, 6))
        bad = Client("c", 4, sub_id=1, sink=Sink())
        bad.transport = Transport()
        bad.data_received(b"\x30\x05\x00\x7fabc")  # topic length 127 in a 5-byte packet
        assert bad.transport.closed and "malformed PUBLISH" in bad.error

    asyncio.run(run())
