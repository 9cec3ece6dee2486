"""The asyncio SDK (store/client/aio_api.py) against a real `lmqtt store`: producer (single, batch,
delayed, many tasks on one connection, on after a store restart), group consumer with committed
offsets surviving a restart, filter consumer seeing what an MQTT subscriber of the filter sees
(and its history with `since`), POP shared by two members with redelivery after the invisible time."""
from __future__ import annotations

import asyncio
import time

import pytest

from lmqtt.store.client import connect, connect_async

pytestmark = pytest.mark.timeout(120)


async def _collect(consumer, n, timeout=10.0):
    """Poll until `n` records came (records become visible once dispatched), bounded."""
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += await consumer.poll()
        await asyncio.sleep(0.01)
    return out


async def _until(fn, timeout=10.0):
    """Await `fn()` until it returns something truthy (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        got = await fn()
        if got or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.02)


def test_producer_and_group_consumer_resume_after_a_store_restart(lmqtt_store):
    async def first():
        c = await connect_async(lmqtt_store.address)
        p = c.producer()
        r = await p.send("aio/orders", b"o-0", keys=("k0",), user_properties=[("src", "aio")])
        rs = await p.send_batch([("aio/orders", b"o-1"), {"topic": "aio/orders", "body": b"o-2", "keys": ("k2",)}])
        assert [x.queue_offset for x in [r, *rs]] == [0, 1, 2] and len({x.msg_id for x in [r, *rs]}) == 3
        # many tasks share the connection and its producer: pipelined, each stored once
        more = await asyncio.gather(*(p.send("aio/orders", f"o-{i}".encode()) for i in range(3, 23)))
        assert sorted(x.queue_offset for x in more) == list(range(3, 23))
        g = await c.consumer("aio/orders", "billing")
        got = await _collect(g, 23)
        assert [x.body for x in got[:3]] == [b"o-0", b"o-1", b"o-2"] and got[0].mqtt.user_properties == [("src", "aio")]
        assert got[0].keys == ("k0",) and len(got) == 23
        await g.commit(10)                                  # processed the first ten only
        await c.close()
    asyncio.run(first())
    lmqtt_store.restart()

    async def second():
        c = await connect_async(lmqtt_store.address)
        g = await c.consumer("aio/orders", "billing")
        got = await _collect(g, 13)
        assert [x.body for x in got] == [f"o-{i}".encode() for i in range(10, 23)]   # from the commit on
        r = await c.producer().send("aio/orders", b"after")                          # a new connection
        assert r.queue_offset == 23
        await c.close()
    asyncio.run(second())


def test_filter_consumer_sees_what_a_subscriber_of_the_filter_sees_and_its_history(lmqtt_store):
    async def go():
        c = await connect_async(lmqtt_store.address)
        p = c.producer()
        t0 = int(time.time() * 1000)
        await p.send("plant/a/temp", b"old-a")             # before anyone holds the filter
        f = await c.filter_consumer("plant/+/temp", group="dash")
        await p.send_batch([("plant/b/temp", b"b"), ("plant/b/hum", b"h"), ("yard/b/temp", b"y"),
                            ("plant/c/temp", b"c")])
        got = await _collect(f, 2)
        assert [x.body for x in got] == [b"b", b"c"] and [x.topic for x in got] == ["plant/b/temp", "plant/c/temp"]
        await f.commit()
        h = await c.filter_consumer("plant/+/temp", since=t0)     # the history first, then live
        assert [x.body for x in await _collect(h, 3)] == [b"old-a", b"b", b"c"]
        await p.send("plant/d/temp", b"d")
        assert [x.body for x in await _collect(h, 1)] == [b"d"]
        await c.close()
    asyncio.run(go())


def test_pop_members_share_a_queue_and_unacked_records_come_back(lmqtt_store):
    with connect(lmqtt_store.address) as sync:
        sync.producer().send_batch([("jobs", f"j{i}".encode()) for i in range(10)])

    async def go():
        c = await connect_async(lmqtt_store.address)
        a = c.pop_consumer("jobs", "workers", invisible_ms=400)
        b = c.pop_consumer("jobs", "workers", invisible_ms=400)
        ra, rb = [], []
        for _ in range(200):                               # the records become visible at dispatch
            x, y = await asyncio.gather(a.pop(5), b.pop(5))
            ra, rb = ra + x, rb + y
            if len(ra) + len(rb) >= 10:
                break
            await asyncio.sleep(0.02)
        assert ra and rb
        assert sorted(x.body for x in ra + rb) == sorted(f"j{i}".encode() for i in range(10))
        assert not {x.queue_offset for x in ra} & {x.queue_offset for x in rb}      # each to one member
        assert await a.ack(ra) == len(ra)                                            # b never acks
        back = await _until(lambda: b.pop(10))                                       # after 400 ms
        assert sorted(x.body for x in back) == sorted(x.body for x in rb)
        assert all(b.last_attempts[x.queue_offset] == 2 for x in back)
        assert await b.ack(back) == len(back)
        assert await a.pop(10) == []
        await c.close()
    asyncio.run(go())
