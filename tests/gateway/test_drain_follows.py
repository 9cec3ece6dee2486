"""The publish pipeline drains the notify bus itself after each append, so the bus schedules no
safety-net `drain` callback for the names inline dispatch raised in that append (one loop
callback per publish batch that found nothing to do). Names raised on the loop by anyone else still
get the safety net. A real Gateway (store, inline dispatch, light queues, delivery) with in-memory
transports (tests/fakes.py); no timing assertions."""
from __future__ import annotations

import asyncio

from lmqtt.gateway.mqtt import encode, packets as P
from lmqtt.notify import InProcessBus
from tests.fakes import gateway_with_subscribed_pair


def test_bus_skips_the_safety_net_only_while_a_drain_follows():
    async def run():
        loop = asyncio.get_running_loop()
        bus = InProcessBus(loop, window_s=3600)
        got: list[set[str]] = []
        bus.subscribe(got.append)
        drains = []
        real = bus.drain
        bus.drain = lambda: (drains.append(1), real())   # what call_soon(self.drain) schedules
        bus.drain_follows = True
        bus.publish({"a"})                    # raised on the loop thread inside an append
        bus.drain_follows = False
        real()                                # the appender's own drain
        await asyncio.sleep(0.01)
        assert got == [{"a"}] and drains == []
        bus.publish({"b"})                    # nobody said a drain follows: the safety net runs
        await asyncio.sleep(0.01)
        assert got == [{"a"}, {"b"}] and drains == [1]
        bus.close()

    asyncio.run(run())


def test_gateway_publishes_schedule_no_idle_drain_and_deliver(tmp_path):
    async def run():
        gw, (sub, sub_tr), (pub, pub_tr) = await gateway_with_subscribed_pair(tmp_path)
        try:
            bus = gw.bus
            drains = []
            real = bus.drain
            bus.drain = lambda: (drains.append(1), real())
            got = b""
            for pid in range(1, 6):
                pub.data_received(encode(P.Publish("t/x", b"m%d" % pid, qos=1, packet_id=pid), 4))
                for _ in range(400):
                    await asyncio.sleep(0.005)
                    got += sub_tr.take()
                    if got.count(b"m%d" % pid):
                        break
            for pid in range(1, 6):
                assert b"m%d" % pid in got
            # the pipeline drained through gw.bus's bound drain (not the instance attribute): no
            # safety-net callback ran for any of the five appends
            assert drains == []
            assert not bus.drain_follows
        finally:
            await gw.stop()

    asyncio.run(run())
