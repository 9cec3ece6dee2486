"""A publish batch writes what it queued (the subscriber's PUBLISH, the publisher's PUBACK) before
it returns to the loop, and schedules no WriteBatcher loop callback for it (one idle
callback per message before). A real Gateway (store, inline dispatch, light queues, delivery) with
in-memory transports (tests/fakes.py); no timing assertions."""
from __future__ import annotations

import asyncio

from lmqtt.gateway.mqtt import encode, packets as P
from lmqtt.gateway.net.write_batcher import WriteBatcher
from tests.fakes import gateway_with_subscribed_pair


def test_publish_batch_writes_itself_and_schedules_no_write_callback(tmp_path):
    async def run():
        gw, (sub, sub_tr), (pub, pub_tr) = await gateway_with_subscribed_pair(tmp_path)
        try:
            writes = gw.broker.writes
            assert isinstance(writes, WriteBatcher)
            callbacks = []
            loop = writes.loop

            class Counting:                   # the batcher's loop, counting what it schedules
                def call_soon(self, fn, *args):
                    callbacks.append(fn)
                    return loop.call_soon(fn, *args)
            writes.loop = Counting()
            pipeline = gw.broker.publisher
            for pid in range(1, 6):
                pub.data_received(encode(P.Publish("t/x", b"m%d" % pid, qos=1, packet_id=pid), 4))
                pipeline.flush()              # the batch, as its loop callback runs it
                # written when the batch returns: the PUBLISH out and the PUBACK back
                got = sub_tr.take()
                assert b"m%d" % pid in got
                assert pub_tr.take() == bytes([0x40, 2, 0, pid])
                sub.data_received(bytes([0x40, 2]) + got[4 + 3:4 + 5])   # PUBACK (topic t/x)
            await asyncio.sleep(0.01)
            assert callbacks == []
            assert not writes._scheduled and not writes._dirty
            # a write outside a batch still gets its callback
            pub.write(b"\xd0\x00")
            await asyncio.sleep(0.01)
            assert len(callbacks) == 1 and pub_tr.take() == b"\xd0\x00"
        finally:
            await gw.stop()

    asyncio.run(run())
