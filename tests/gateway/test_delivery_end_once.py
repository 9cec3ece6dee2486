"""Delivery asks the store for a queue's end once per published message, not twice: the end the
append's `record_appended` read is used by that append's own delivery run, and forgotten after it
(so a later run, after appends the store's thread dispatched, asks again and misses nothing).

In-process gateway (real store, real delivery), clients on the connection's in-memory transport."""
from __future__ import annotations

import asyncio

from lmqtt.gateway.app.config import build_config
from lmqtt.gateway.app.gateway import Gateway
from lmqtt.gateway.mqtt import packets as P
from tests.fakes import memory_pair


def test_one_end_lookup_per_message_and_nothing_missed(tmp_path):
    async def run():
        cfg = build_config({}, {"host": "127.0.0.1", "port": 0, "metrics_port": 0,
                                "data_dir": str(tmp_path / "d")})
        gw = Gateway(cfg)
        await gw.start()
        try:
            sub, pub = await memory_pair(gw, "e/t")
            queues = gw.broker.delivery.store
            real = queues.max_offset
            calls = []

            def counting(q, real=real):
                calls.append(q)
                return real(q)
            queues.max_offset = counting
            got = []
            n = 40
            for i in range(n):
                pub.send(P.Publish("e/t", f"m{i}".encode(), qos=1, packet_id=i + 1))
                await asyncio.sleep(0)
                for pk in sub.packets():
                    if isinstance(pk, P.Publish):
                        got.append(pk.payload)
                        sub.send(P.PubAck(pk.packet_id))
                await asyncio.sleep(0)
                pub.packets()
            for _ in range(100):                 # anything left (not expected) arrives meanwhile
                if len(got) == n:
                    break
                await asyncio.sleep(0.01)
                for pk in sub.packets():
                    if isinstance(pk, P.Publish):
                        got.append(pk.payload)
                        sub.send(P.PubAck(pk.packet_id))
            # the ends kept for one run are gone after it
            assert getattr(gw.broker.delivery.recent, "ends", {}) == {}
            return got, calls, n
        finally:
            await gw.stop()

    got, calls, n = asyncio.run(run())
    assert got == [f"m{i}".encode() for i in range(n)]
    assert len(calls) <= n + 5, len(calls)          # before: two per message
