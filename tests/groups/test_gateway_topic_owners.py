"""The gateway's view of which store group owns a first-level topic (gateway/storage/topic_owners.py)
over two real `lmqtt store` processes: the same owners as the SDK's, claimed once per first level
in the first group (the directory), shared by concurrent askers, kept for good."""
from __future__ import annotations

import asyncio


from lmqtt.gateway.storage.store_link import LoopConnection
from lmqtt.gateway.storage.topic_owners import TopicOwners
from lmqtt.store.client import connect
from lmqtt.store.client.groups import rendezvous


def test_owners_are_claimed_once_in_the_directory_and_agree_with_the_sdk(two):
    a, b = two
    address = f"{a.address};{b.address}"
    names = [a.address, b.address]                  # stores without --group are named by address
    first = next(f"own{k}" for k in range(1000) if rendezvous(f"own{k}", names) == 1)
    sdk = connect(address)
    try:
        recorded = sdk.producer().send(f"{first}/x", b"v")          # the SDK claims it first
        assert recorded.queue_offset == 0
    finally:
        sdk.close()

    async def main():
        loop = asyncio.get_running_loop()
        link = LoopConnection(a.address, loop=loop)
        await loop.run_in_executor(None, lambda: None)
        link.connect_blocking()
        try:
            owners = TopicOwners(link, names, [a.address, b.address], address)
            one, two_ = owners.owner(first), owners.owner(first)     # one request for both
            assert owners.claims == 1
            assert await one == 1 and await two_ == 1
            assert owners.known(first) == 1 and owners.owner(first).done()
            new = next(f"fresh{k}" for k in range(1000) if rendezvous(f"fresh{k}", names) == 0)
            assert await owners.of_topic(f"{new}/a/b") == 0
            assert owners.of_filter("#") is None and owners.of_filter("+/x") is None
            assert await owners.of_filter(f"{first}/+") == 1
            assert owners.claims == 2
        finally:
            link.close()

    asyncio.run(main())
