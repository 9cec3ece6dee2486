"""The publish pipeline keeps the cyclic garbage collector off while a batch of publishes waits
for its append, and on again once the batch is gone, so the batch's objects (alive until the
append, tens of thousands in a loop turn under load) are never scanned, while garbage made meanwhile
is still collected. A real Gateway (store, inline dispatch, light queues, delivery) with in-memory
transports (tests/fakes.py)."""
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
        try:
            assert gc.isenabled()
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
