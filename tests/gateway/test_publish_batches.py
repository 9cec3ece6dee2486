"""How the publish pipeline batches: a read that brings more client publishes than `max_batch`
has them appended in batches of that size inside the read, in order (internal publishes never
append inline); and the cyclic garbage collector is off while a batch waits for its append and on
again once the batch is gone, so the batch's objects (alive until the append) are never scanned,
while garbage made meanwhile is still collected. A real Gateway (store, inline dispatch, light
queues, delivery) with in-memory transports (tests/fakes.py)."""
from __future__ import annotations

import asyncio
import gc
import weakref

from lmqtt.gateway.mqtt import encode, packets as P
from tests.fakes import gateway_with_subscribed_pair


class _Node:
    def __init__(self) -> None:
        self.me = self            # a reference cycle: only the cyclic collector frees it


def test_a_waiting_batch_is_not_scanned_and_garbage_made_meanwhile_is_still_collected(tmp_path):
    async def run():
        gw, (sub, sub_tr), (pub, pub_tr) = await gateway_with_subscribed_pair(tmp_path)
        threshold = gc.get_threshold()
        gc.set_threshold(700, 10, 10)
        gc.enable()
        try:
            for pid in range(1, 4):
                pub.data_received(encode(P.Publish("t/x", b"m%d" % pid, qos=1, packet_id=pid), 4))
            assert not gc.isenabled()             # three publishes wait for the batch's append
            cycle = _Node()
            dead = weakref.ref(cycle)
            del cycle
            gw.broker.publisher.flush()           # the batch, as its loop callback runs it
            assert gc.isenabled()
            assert pub_tr.take() == b"".join(bytes([0x40, 2, 0, pid]) for pid in range(1, 4))
            assert sub_tr.take().count(b"t/x") == 3
            keep = [[] for _ in range(5000)]      # allocations: the young generation's collection runs
            assert dead() is None, "a cycle made while the batch waited was not collected"
            del keep
        finally:
            gc.set_threshold(*threshold)
            gc.enable()
            await gw.stop()

    asyncio.run(run())


def test_a_batch_leaves_the_collector_off_when_it_was_off_before(tmp_path):
    """Another part turned the collector off for its own reasons (a session restore does): a
    batch does not turn it on behind its back."""
    async def run():
        gw, (sub, sub_tr), (pub, pub_tr) = await gateway_with_subscribed_pair(tmp_path)
        gc.disable()
        try:
            pub.data_received(encode(P.Publish("t/x", b"m", qos=1, packet_id=1), 4))
            gw.broker.publisher.flush()
            assert pub_tr.take() == bytes([0x40, 2, 0, 1])
            assert not gc.isenabled()
        finally:
            gc.enable()
            await gw.stop()

    asyncio.run(run())


def test_a_read_of_more_publishes_than_a_batch_takes_is_appended_in_batches_inside_the_read(tmp_path):
    async def run():
        gw, (sub, sub_tr), (pub, pub_tr) = await gateway_with_subscribed_pair(tmp_path)
        try:
            pipeline = gw.broker.publisher
            pipeline.max_batch = 4
            pub.data_received(b"".join(encode(P.Publish("t/x", b"m%d" % pid, qos=1, packet_id=pid), 4)
                                       for pid in range(1, 11)))
            # two batches of 4 appended and acknowledged before the read's handling returned; the
            # last 2 wait for the loop's callback
            assert pub_tr.take() == b"".join(bytes([0x40, 2, 0, pid]) for pid in range(1, 9))
            assert len(pipeline._pending) == 2
            pipeline.flush()
            assert pub_tr.take() == bytes([0x40, 2, 0, 9, 0x40, 2, 0, 10])
            got = sub_tr.take()
            assert [got.find(b"m%d" % i) for i in range(1, 11)] == sorted(got.find(b"m%d" % i) for i in range(1, 11))
            assert got.count(b"t/x") == 10
            # internal publishes (a will, $SYS, events) wait for the loop's callback however many
            for i in range(10):
                gw.broker._publish_will("gone", 0, "t/x", b"w%d" % i, False, None)
            assert len(pipeline._pending) == 10 and b"w0" not in sub_tr.take()
            pipeline.flush()
            assert sub_tr.take().count(b"t/x") == 10
        finally:
            await gw.stop()

    asyncio.run(run())
