"""A publish batch writes what it queued (the subscriber's PUBLISH, the publisher's PUBACK) before
it returns to the loop, and schedules no WriteBatcher loop callback for it (issue 29: one idle
callback per message before). A real Gateway (store, inline dispatch, light queues, delivery) with
in-memory transports (tests/fakes.py); no timing assertions."""
from __future__ import annotations

import asyncio

from lmqtt.gateway.app.config import build_config
from lmqtt.gateway.app.gateway import Gateway
from lmqtt.gateway.mqtt import encode, packets as P
from lmqtt.gateway.net.connection import MQTTConnection, WriteBatcher
from tests.fakes import FakeTransport


def test_publish_batch_writes_itself_and_schedules_no_write_callback(tmp_path):
    async def run():
        cfg = build_config({}, {"host": "127.0.0.1", "port": 0, "metrics_port": 0,
                                "data_dir": str(tmp_path / "data")})
        gw = Gateway(cfg)
        await gw.start()
        try:
            conns = []
            for cid in ("sub", "pub"):
                c = MQTTConnection(gw.broker)
                tr = FakeTransport(c)
                c.connection_made(tr)
                c.data_received(encode(P.Connect(client_id=cid, protocol_level=4), 4))
                conns.append((c, tr))
            (sub, sub_tr), (pub, pub_tr) = conns
            sub.data_received(encode(P.Subscribe(1, [P.SubscriptionRequest("t/x", qos=1)]), 4))
            for _ in range(200):
                await asyncio.sleep(0.005)
                if sub_tr.take():             # CONNACK + SUBACK
                    break
            pub_tr.take()
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
