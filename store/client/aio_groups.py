"""Several store groups for asyncio (docs/groups.md): `connect_async("a:p,b:p;c:p,d:p")`.

The asyncio twin of groups.py, with the same rules (the owner of a first-level topic recorded once
by the first group, rendezvous hashing for a new one, a wildcard first level read from every group)
over `AsyncConnection`s. What differs from one group's `AsyncConnection`: `pop_consumer` is awaited
(finding its topic's group may ask the first group), and a merged filter consumer's `poll`,
`commit` and `seek` are awaited as its parts' are.
"""
from __future__ import annotations

import asyncio
from typing import Any, Iterable

from lmqtt.store import protocol as W

from .aio import AsyncConnection, connect_async as connect_one
from .aio_api import AsyncAdmin
from .commands import ClaimTopicGroup, TopicGroups
from .consumer import Record
from .groups import filter_first_level, first_level, group_names, owner_index, rendezvous, split_groups

__all__ = ["AsyncGroupedConnection", "connect_async"]


class AsyncGroupedConnection:
    """GroupedConnection (groups.py) for asyncio: `groups` each group's AsyncConnection."""

    def __init__(self, address: str, **kw: Any) -> None:
        self.address = address
        self.addresses = split_groups(address)
        self._kw = kw
        self.groups: list[AsyncConnection] = []
        self.names: list[str] = []
        self._owners: dict[str, int] = {}

    async def open(self) -> "AsyncGroupedConnection":
        for a in self.addresses[len(self.groups):]:
            self.groups.append(await connect_one(a, **self._kw))
        self.names = group_names([c.server_info for c in self.groups], self.addresses, self.address)
        return self

    @property
    def directory(self) -> AsyncConnection:
        return self.groups[0]

    async def owners(self) -> dict[str, str]:
        table = await self.directory.execute(TopicGroups())
        for t, name in table.items():
            if name in self.names:
                self._owners[t] = self.names.index(name)
        return table

    async def owner(self, topic: str) -> int:
        fl = first_level(topic)
        i = self._owners.get(fl)
        if i is not None:
            return i
        name = await self.directory.execute(ClaimTopicGroup(fl, self.names[rendezvous(fl, self.names)]))
        i = self._owners[fl] = owner_index(name, self.names, fl, self.addresses, self.address)
        return i

    async def for_topic(self, topic: str) -> AsyncConnection:
        return self.groups[await self.owner(topic)]

    def for_msg_id(self, msg_id: str) -> AsyncConnection | None:
        for c in self.groups:
            if c.ident and msg_id.startswith(c.ident):
                return c
        return None

    # ------------------------------------------------------------------ the command API
    async def send(self, topic: str, body: bytes, **kw: Any):
        return await (await self.for_topic(topic)).send(topic, body, **kw)

    async def cancel_delayed(self, msg_id: str) -> bool:
        c = self.for_msg_id(msg_id)
        return False if c is None else await c.cancel_delayed(msg_id)

    async def pull(self, topic: str, queue_id: int = 0, offset: int = 0, max_count: int = 256,
                   max_bytes: int = 4 << 20):
        return await (await self.for_topic(topic)).pull(topic, queue_id, offset, max_count, max_bytes)

    def producer(self, producer_id: str | None = None):
        return AsyncGroupedProducer(self, producer_id)

    def auto_batch_producer(self, producer_id: str | None = None, **kw):
        return AsyncGroupedAutoBatch(self, producer_id, **kw)

    async def consumer(self, topic: str, group: str, queue_id: int = 0, **kw):
        return await (await self.for_topic(topic)).consumer(topic, group, queue_id, **kw)

    async def pop_consumer(self, topic: str, group: str, queue_id: int = 0, **kw):
        return (await self.for_topic(topic)).pop_consumer(topic, group, queue_id, **kw)

    async def filter_consumer(self, topic_filter: str, group: str | None = None, **kw):
        head = filter_first_level(topic_filter)
        if head is not None:
            return await (await self.for_topic(head)).filter_consumer(topic_filter, group, **kw)
        parts = [await c.filter_consumer(topic_filter, group, **kw) for c in self.groups]
        return AsyncMergedFilterConsumer(parts)

    def admin(self):
        return AsyncGroupedAdmin(self)

    async def cmd(self, name: str, **args):
        return await self.directory.cmd(name, **args)

    async def close(self) -> None:
        for c in self.groups:
            await c.close()


async def connect_async(address: str = f"127.0.0.1:{W.DEFAULT_PORT}", **kw: Any):
    """An `AsyncConnection` to one store or store group, an `AsyncGroupedConnection` when
    `address` lists several groups separated by ';' (handshakes done now)."""
    if ";" not in str(address):
        return await connect_one(address, **kw)
    g = AsyncGroupedConnection(address, **kw)
    try:
        return await g.open()
    except BaseException:
        await g.close()
        raise


class AsyncGroupedProducer:
    """AsyncProducer per group (one producer id); a batch spanning groups is one batch per group."""

    def __init__(self, conn: AsyncGroupedConnection, producer_id: str | None = None) -> None:
        self.conn = conn
        self.producers = [c.producer(producer_id) for c in conn.groups]
        self.producer_id = self.producers[0].producer_id
        for p in self.producers[1:]:
            p.producer_id = self.producer_id

    async def send(self, topic: str, body: bytes, **kw: Any):
        return await self.producers[await self.conn.owner(topic)].send(topic, body, **kw)

    async def send_batch(self, messages: Iterable) -> list:
        items = list(messages)
        by_group: dict[int, list[int]] = {}
        for k, m in enumerate(items):
            topic = m["topic"] if isinstance(m, dict) else m[0]
            by_group.setdefault(await self.conn.owner(topic), []).append(k)
        out: list = [None] * len(items)
        for g, idx in by_group.items():
            res = await self.producers[g].send_batch([items[k] for k in idx])
            for k, r in zip(idx, res, strict=True):
                out[k] = r
        return out

    async def cancel_delayed(self, msg_id: str) -> bool:
        return await self.conn.cancel_delayed(msg_id)


class AsyncGroupedAutoBatch:
    """AsyncAutoBatchProducer per group, made at the group's first message (inside the loop)."""

    def __init__(self, conn: AsyncGroupedConnection, producer_id: str | None = None, **kw: Any) -> None:
        self.conn, self.producer_id, self.kw = conn, producer_id, kw
        self.batches: dict[int, Any] = {}

    async def send(self, topic: str, body: bytes, **kw: Any):
        g = await self.conn.owner(topic)
        ab = self.batches.get(g)
        if ab is None:
            ab = self.batches[g] = self.conn.groups[g].auto_batch_producer(self.producer_id, **self.kw)
        return await ab.send(topic, body, **kw)

    @property
    def acknowledged(self) -> int:
        return sum(ab.acknowledged for ab in self.batches.values())

    async def _every(self, name: str) -> None:
        results = await asyncio.gather(*(getattr(ab, name)() for ab in self.batches.values()),
                                       return_exceptions=True)
        first = next((r for r in results if isinstance(r, BaseException)), None)
        if first is not None:
            raise first

    async def flush(self) -> int:
        await self._every("flush")
        return self.acknowledged

    async def close(self) -> None:
        await self._every("close")

    async def __aenter__(self) -> "AsyncGroupedAutoBatch":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class AsyncMergedFilterConsumer:
    """MergedFilterConsumer (groups.py) over AsyncFilterConsumers: each awaited in turn."""

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.filter = parts[0].filter
        self.group = parts[0].group
        self._last: list[tuple[int, list[Record]]] = []

    async def poll(self) -> list[Record]:
        out: list[Record] = []
        self._last = []
        for i, p in enumerate(self.parts):
            recs = await p.poll()
            if recs:
                self._last.append((i, recs))
                out.extend(recs)
        return out

    async def seek(self, start) -> None:
        for p in self.parts:
            await p.seek(start)

    async def commit(self, offset=None) -> None:
        if not self.group:
            raise ValueError("FilterConsumer without a group has nothing to commit to")
        if offset is None:
            for p in self.parts:
                await p.commit()
            return
        if not isinstance(offset, Record):
            raise ValueError("commit(int): a light-queue offset is one group's; over several store groups commit() "
                             "or commit(record)")
        for i, recs in self._last:
            if any(r is offset for r in recs):
                await self.parts[i].commit(offset)
                return
            await self.parts[i].commit()
        raise ValueError("commit(record): the record was not returned by this consumer's last poll")


class AsyncGroupedAdmin:
    """GroupedAdmin (groups.py), awaited."""

    def __init__(self, conn: AsyncGroupedConnection) -> None:
        self.conn = conn
        self.admins = [AsyncAdmin(c) for c in conn.groups]

    async def _gather(self, fn) -> list:
        out = []
        for name, a in zip(self.conn.names, self.admins, strict=True):
            out += [{**row, "store_group": name} for row in await fn(a)]
        return out

    async def topics(self):
        return await self._gather(lambda a: a.topics())

    async def lag(self, group: str):
        return await self._gather(lambda a: a.lag(group))

    async def stats(self):
        return {name: await a.stats() for name, a in zip(self.conn.names, self.admins, strict=True)}

    async def owners(self) -> dict[str, str]:
        return await self.conn.owners()

    async def _owner(self, topic: str) -> AsyncAdmin:
        return self.admins[await self.conn.owner(topic)]

    async def offsets(self, topic: str, queue_id: int = 0):
        return await (await self._owner(topic)).offsets(topic, queue_id)

    async def committed(self, group: str, topic: str, queue_id: int = 0):
        return await (await self._owner(topic)).committed(group, topic, queue_id)

    async def query_by_key(self, topic: str, key: str, begin_ms: int = 0, end_ms: int | None = None,
                           max_count: int = 32):
        return await (await self._owner(topic)).query_by_key(topic, key, begin_ms, end_ms, max_count)

    async def offset_for_time(self, topic: str, ts_ms: int, queue_id: int = 0):
        return await (await self._owner(topic)).offset_for_time(topic, ts_ms, queue_id)

    async def get_by_msg_id(self, msg_id: str):
        c = self.conn.for_msg_id(msg_id)
        return None if c is None else await AsyncAdmin(c).get_by_msg_id(msg_id)
