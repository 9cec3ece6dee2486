"""The SDK's asyncio connections (store/client/aio.py, gateway/storage/store_link.py) against a
real `lmqtt store`: EVENT pushes for watched queues, re-watch after the store restarts, and the
loop-driven connection's blocking calls keeping request order with what was sent before them."""
from __future__ import annotations

import asyncio
import time

import pytest

from lmqtt.gateway.storage.store_link import LoopConnection
from lmqtt.store import protocol as W
from lmqtt.store.client import StoreClientError, aio, connect
from lmqtt.store.client.aio import AsyncConnection, ConnectionLost
from tests.support import wait_until

pytestmark = pytest.mark.timeout(60)


def test_the_gateways_store_link_lives_with_the_gateways_storage():
    """The gateway's connection to its store is the gateway's (gateway/storage/store_link.py): the
    SDK, which may import only the store's vocabulary, no longer carries it."""
    assert LoopConnection.__module__ == "lmqtt.gateway.storage.store_link"
    assert not hasattr(aio, "LoopConnection")


def test_async_connection_gets_events_and_rewatches_after_a_store_restart(lmqtt_store):
    async def go():
        c = AsyncConnection(lmqtt_store.address, backoff_max=0.2, reconnect_attempts=20)
        events: list[dict] = []
        c.on_push(lambda op, body: events.append(W.decode_event(body)) if op == W.OP_EVENT else None)
        c.on_reconnect(lambda: asyncio.ensure_future(c.cmd("gw_watch", queues=["ev/t"])))
        r = await c.cmd("gw_watch", queues=["ev/t", "ev/other"])
        assert r["max_offsets"] == {"ev/t": 0, "ev/other": 0}
        await c.send("ev/t", b"one")
        assert await wait_until(lambda: any(e.get("ev/t", 0) >= 1 for e in events)), events
        assert all("ev/other" not in e for e in events)        # only queues that got entries
        lmqtt_store.restart()
        # an idempotent command rides over the restart (retried on a new connection), and the
        # reconnect callback re-watched the queue there
        r = await c.cmd("gw_max_offsets", queues=["ev/t"])
        assert r["max_offsets"]["ev/t"] == 1
        await c.send("ev/t", b"two")
        await asyncio.sleep(0.1)
        await c.send("ev/t", b"three")
        assert await wait_until(lambda: any(e.get("ev/t", 0) >= 3 for e in events)), events
        await c.close()
    asyncio.run(go())


def test_async_connection_refused_token_names_the_cause(tmp_path):
    from tests.support import LmqttStore
    st = LmqttStore(str(tmp_path / "d"), ("--token", "s3cret"), log_path=str(tmp_path / "log")).start()
    try:
        async def go():
            c = AsyncConnection(st.address, token="wrong")
            with pytest.raises(StoreClientError, match="token"):
                await c.cmd("stats")
        asyncio.run(go())
    finally:
        st.stop()


def test_loop_connection_blocking_call_keeps_order_and_fails_fast_without_store(lmqtt_store):
    async def go():
        loop = asyncio.get_running_loop()
        link = LoopConnection(lmqtt_store.address, loop=loop, timeout=3.0, backoff_max=0.2)
        link.connect_blocking()
        reconnected = []
        link.on_reconnect(lambda: reconnected.append(True))
        # a PRODUCE sent without waiting, then a blocking read: the reply of the PRODUCE came first
        fut = link.request(W.OP_PRODUCE, W.encode_produce("", 0, 1, W.encode_messages_for_produce(
            [("lc/t", b"x", (), b"", 0, 0)])))
        link.cmd_nowait("gw_set_retained", topic="lc/r", payload="eA==", props="")
        got = link.cmd_blocking("gw_retained_matching", filter="lc/+")
        assert fut.done() and fut.result()[0] == W.OP_PRODUCED
        assert got["retained"] == [["lc/r", "eA==", ""]]      # the write before it is seen
        with pytest.raises(StoreClientError, match="unknown command"):
            link.cmd_blocking("no_such_command")
        lmqtt_store.stop()
        await wait_until(lambda: not link.connected)
        t0 = time.monotonic()
        with pytest.raises(ConnectionLost, match=lmqtt_store.address):
            link.cmd_blocking("gw_max_offsets", queues=["lc/t"])
        assert time.monotonic() - t0 < 1.0                      # no wait for a dead store
        lmqtt_store.start()
        assert await wait_until(lambda: link.connected, 10), link.last_error
        assert reconnected
        assert link.cmd_blocking("gw_max_offsets", queues=["lc/t"])["max_offsets"]["lc/t"] == 1
        link.close()
    asyncio.run(go())


def test_sync_connection_still_connects_through_the_shared_hello_parser(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        assert c.server_info["server"] == "lmqtt-store" and c.ident
