"""A consumer group's `start` (docs/sdk.md) is "earliest" or "latest": any other word is refused by
name, in the sync and the asyncio SDK alike, never read as one of them. Against a real `lmqtt serve`
subprocess."""
from __future__ import annotations

import asyncio

import pytest

from lmqtt.store.client import connect, connect_async
from tests.support import LmqttServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("cgstart") / "data"
    d.mkdir()
    srv = LmqttServer(str(d)).start()
    yield srv
    srv.stop()


def test_a_consumer_group_with_a_misspelt_start_is_refused_not_read_from_the_oldest(server):
    """docs/sdk.md: `c.consumer("sensors", group=..., start="earliest")`, "earliest" or "latest".
    Any other word (start="latests", "yesterday") was read as "earliest": a new group silently
    started at the queue's first message instead of saying the value is wrong, as the filter
    consumer (the store) and `lmqtt consume --from` do."""
    c = connect(server.store_address)
    try:
        c.producer().send("cgstart/a", b"old")
        for bad in ("latests", "yesterday", ""):
            with pytest.raises(ValueError, match=r"start must be 'earliest' or 'latest', got "):
                c.consumer("cgstart", group=f"g-{bad}", start=bad)
        assert c.consumer("cgstart", group="g-latest", start="latest").poll() == []
        assert [r.body for r in c.consumer("cgstart", group="g-earliest", start="earliest").poll()] == [b"old"]
    finally:
        c.close()


def test_the_async_consumer_group_refuses_a_misspelt_start_too(server):
    async def main():
        c = await connect_async(server.store_address)
        try:
            with pytest.raises(ValueError, match=r"start must be 'earliest' or 'latest', got 'latests'"):
                await c.consumer("cgstart", "ga", start="latests")
            assert await (await c.consumer("cgstart", "gb", start="latest")).poll() == []
        finally:
            await c.close()
    asyncio.run(main())
