"""Several store groups in one deployment (docs/groups.md): the SDK's layer above its connections.

    from lmqtt.store.client import connect
    c = connect("a:1,b:1,c:1;d:1,e:1,f:1")        # two groups, each its member list as for one
    c.producer().send("sensors/a/temp", b"21.5")    # to the group that owns "sensors"
    for rec in c.filter_consumer("#", start="earliest").poll(): ...   # every group, merged

As redis-py's cluster client sits above its connections, this module sits above the one
connection core (connection.py, failover.py): each group is an ordinary `Connection` (which
finds and follows that group's primary), and this layer only decides which group a request goes
to. One group (no `;` in the address) never comes here: `connect` returns the plain `Connection`,
exactly as before.

Which group owns a topic: the unit is the first-level topic (as RocketMQ-MQTT's), so a topic's
order is one group's order. The owner is recorded once, durably, in the SDK metadata of the
*directory*, the first group of the list (store/server `topic_group_claim`: put-if-absent,
replicated to the directory's in-sync members before it answers). A first-level topic without a
record is claimed for the group rendezvous hashing picks among the groups' names (`rendezvous`);
the first claim wins, so every client agrees whoever asked first, and a group added later gets
only topics never seen before: every recorded topic stays where its history is. Records never
change, so a client keeps what it learnt for good.

A group's name is the one its members were started with (`lmqtt store --group NAME`, in their
HELLO_OK); a single store without one is named by its address as given.
"""
from __future__ import annotations

import hashlib
import threading
from concurrent.futures import Future
from typing import Any, Iterable

from lmqtt.store import protocol as W

from .admin import Admin
from .commands import ClaimTopicGroup, TopicGroups
from .connection import Connection, connect as connect_one
from .consumer import FilterConsumer, Record
from .errors import StoreClientError
from .failover import parse_addresses

__all__ = ["GroupedConnection", "connect", "first_level", "rendezvous", "split_groups"]


def split_groups(address: str) -> list[str]:
    """"a:p,b:p;c:p,d:p" -> ["a:p,b:p", "c:p,d:p"]; ValueError naming the address when a group is
    empty or a member's port is not a port number."""
    parts = [g.strip() for g in str(address).split(";")]
    if any(not g for g in parts):
        raise ValueError(f"store address {address!r}: an empty group between ';' (groups are separated by "
                         f"';', the members of one group by ',')")
    for g in parts:
        parse_addresses(g)
    return parts


def first_level(topic: str) -> str:
    """The unit a group owns: the topic's first level ("sensors" of "sensors/a/temp")."""
    return topic.split("/", 1)[0]


def filter_first_level(flt: str) -> str | None:
    """The one first-level topic a filter can match, or None when it matches several (its first
    level is a wildcard: "#", "+/x")."""
    head = flt.split("/", 1)[0]
    return None if head in ("+", "#") else head


def rendezvous(topic: str, names: list[str]) -> int:
    """The index of the group a new first-level topic goes to: highest random weight (rendezvous)
    hashing over the groups' names. Why not `hash % n`: with it, the default of almost every topic
    changes when a group is added; with this one only the topics the new group wins (1/n) - and
    those only matter for topics never claimed, since a claim is kept for good."""
    best, at = b"", 0
    for i, name in enumerate(names):
        h = hashlib.blake2b(f"{name}\0{topic}".encode(), digest_size=8).digest()
        if h > best:
            best, at = h, i
    return at


def group_names(infos: list[dict], addresses: list[str], address: str) -> list[str]:
    """Each group's name from its handshake (`infos`: the HELLO_OKs, in list order), its address
    when it has none; StoreClientError when one group is listed twice."""
    names = [info.get("group") or a for info, a in zip(infos, addresses, strict=True)]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise StoreClientError(W.E_INVALID, f"store address {address!r} names group {sorted(dup)[0]!r} "
                                            f"twice (each group once, separated by ';')")
    return names


def owner_index(name: str, names: list[str], topic: str, addresses: list[str], address: str) -> int:
    """The index of the group named `name`, the recorded owner of `topic`; StoreClientError when
    the client's list does not have it (nothing may be written elsewhere)."""
    try:
        return names.index(name)
    except ValueError:
        raise StoreClientError(W.E_INVALID, f"topic {topic!r} belongs to store group {name!r} (recorded by "
                                            f"{addresses[0]}), which is not among the groups of {address!r}: "
                                            f"list every group of the deployment") from None


class GroupedConnection:
    """Several store groups behind one object with the `Connection`'s command API: produce goes to
    the group owning the topic's first level, reads of one topic to that group, a filter whose
    first level is a wildcard is read from every group and merged (`MergedFilterConsumer`).
    `groups`: each group's `Connection`, in the order given; `names`: their names (HELLO_OK)."""

    def __init__(self, address: str, **kw: Any) -> None:
        self.address = address
        self.addresses = split_groups(address)
        self._kw = kw
        self.groups: list[Connection] = []       # connected by open()
        self.names: list[str] = []
        self._owners: dict[str, int] = {}       # first-level topic -> group index, as recorded
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ groups and owners
    def open(self) -> "GroupedConnection":
        """Handshake with every group now (a bad address or token fails here), learn their names."""
        for a in self.addresses[len(self.groups):]:
            self.groups.append(connect_one(a, **self._kw))
        self.names = group_names([c.server_info for c in self.groups], self.addresses, self.address)
        return self

    @property
    def directory(self) -> Connection:
        """The group that records which group owns each first-level topic: the first one."""
        return self.groups[0]

    def owners(self) -> dict[str, str]:
        """{first-level topic: group name} of every topic the directory has recorded."""
        table = self.directory.execute(TopicGroups())
        with self._lock:
            for t, name in table.items():
                if name in self.names:
                    self._owners[t] = self.names.index(name)
        return table

    def owner(self, topic: str) -> int:
        """The index of the group owning `topic`'s first level (claimed on the directory when new)."""
        fl = first_level(topic)
        i = self._owners.get(fl)
        if i is not None:
            return i
        name = self.directory.execute(ClaimTopicGroup(fl, self.names[rendezvous(fl, self.names)]))
        i = owner_index(name, self.names, fl, self.addresses, self.address)
        with self._lock:
            self._owners[fl] = i
        return i

    def for_topic(self, topic: str) -> Connection:
        """The connection of the group owning `topic`."""
        return self.groups[self.owner(topic)]

    def for_filter(self, flt: str) -> list[Connection]:
        """The groups a filter's messages can be in: the owner of its first level, or every group."""
        head = filter_first_level(flt)
        return self.groups if head is None else [self.for_topic(head)]

    def for_msg_id(self, msg_id: str) -> Connection | None:
        """The group whose identity starts `msg_id` (a msg id is the group's identity + position)."""
        for c in self.groups:
            if c.ident and msg_id.startswith(c.ident):
                return c
        return None

    # ------------------------------------------------------------------ the command API
    @property
    def ident(self) -> str | None:
        return None      # several: each record's msg id names its own group

    def producer(self, producer_id: str | None = None, **kw):
        return GroupedProducer(self, producer_id, **kw)

    def auto_batch_producer(self, producer_id: str | None = None, **kw):
        return GroupedAutoBatch(self, producer_id, **kw)

    def pull(self, topic: str, queue_id: int = 0, offset: int = 0, max_count: int = 256, max_bytes: int = 4 << 20):
        return self.for_topic(topic).pull(topic, queue_id, offset, max_count, max_bytes)

    def pull_request(self, topic: str, queue_id: int = 0, offset: int = 0, max_count: int = 256,
                     max_bytes: int = 4 << 20):
        return self.for_topic(topic).pull_request(topic, queue_id, offset, max_count, max_bytes)

    def consumer(self, topic: str, group: str, queue_id: int = 0, **kw):
        return self.for_topic(topic).consumer(topic, group, queue_id, **kw)

    def pop_consumer(self, topic: str, group: str, queue_id: int = 0, **kw):
        return self.for_topic(topic).pop_consumer(topic, group, queue_id, **kw)

    def filter_consumer(self, topic_filter: str, group: str | None = None, **kw):
        """One group's `FilterConsumer` when the filter's first level is a topic; else every group's,
        merged (`MergedFilterConsumer`)."""
        head = filter_first_level(topic_filter)
        if head is not None:
            return self.for_topic(head).filter_consumer(topic_filter, group, **kw)
        return MergedFilterConsumer([c.filter_consumer(topic_filter, group, **kw) for c in self.groups])

    def admin(self):
        return GroupedAdmin(self)

    def cmd(self, name: str, **args):
        """A CALL by name to the directory (the first group); a group's own: `groups[i].cmd`."""
        return self.directory.cmd(name, **args)

    def close(self) -> None:
        for c in self.groups:
            c.close()

    def __enter__(self) -> "GroupedConnection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(address: str = f"127.0.0.1:{W.DEFAULT_PORT}", **kw: Any):
    """Open a connection, handshake done now: a `Connection` to one store or store group, a
    `GroupedConnection` when `address` lists several groups separated by ';'."""
    if ";" not in str(address):
        return connect_one(address, **kw)
    g = GroupedConnection(address, **kw)
    try:
        return g.open()
    except BaseException:
        g.close()
        raise


# ---------------------------------------------------------------------------------- produce
class GroupedProducer:
    """A `Producer` per group (the same producer id: each group deduplicates its own sends), each
    send routed by its topic's first level. `send_batch` keeps a batch whole within a group (one
    frame, all or none there); a batch spanning groups is one batch per group, sent one after the
    other, each all or none."""

    def __init__(self, conn: GroupedConnection, producer_id: str | None = None, **kw: Any) -> None:
        self.conn = conn
        self.producers = [c.producer(producer_id, **kw) for c in conn.groups]
        self.producer_id = self.producers[0].producer_id
        for p in self.producers[1:]:
            p.producer_id = self.producer_id

    def _of(self, topic: str):
        return self.producers[self.conn.owner(topic)]

    def send(self, topic: str, body: bytes, **kw: Any):
        return self._of(topic).send(topic, body, **kw)

    def send_async(self, topic: str, body: bytes, **kw: Any) -> Future:
        return self._of(topic).send_async(topic, body, **kw)

    def send_batch(self, messages: Iterable) -> list:
        items = list(messages)
        by_group: dict[int, list[int]] = {}
        for k, m in enumerate(items):
            topic = m["topic"] if isinstance(m, dict) else m[0]
            by_group.setdefault(self.conn.owner(topic), []).append(k)
        out: list = [None] * len(items)
        for g, idx in by_group.items():
            for k, r in zip(idx, self.producers[g].send_batch([items[k] for k in idx]), strict=True):
                out[k] = r
        return out

    def cancel_delayed(self, msg_id: str) -> bool:
        c = self.conn.for_msg_id(msg_id)
        if c is None:
            return False
        return self.producers[self.conn.groups.index(c)].cancel_delayed(msg_id)


class GroupedAutoBatch:
    """An `AutoBatchProducer` per group, made when the group gets its first message; `send` routes
    by topic, `flush` flushes them all and raises the first failure, `acknowledged` sums them."""

    # topics whose AutoBatch is remembered (a send's routing is then one dict lookup, ~0.4 us of
    # client CPU less per message than splitting the topic each time; bounded: a device per topic
    # sends to far more topics than this, and they are looked up the long way)
    TOPIC_CACHE = 65536

    def __init__(self, conn: GroupedConnection, producer_id: str | None = None, **kw: Any) -> None:
        self.conn, self.producer_id, self.kw = conn, producer_id, kw
        self.batches: dict[int, Any] = {}
        self._by_topic: dict[str, Any] = {}

    def _of(self, topic: str):
        g = self.conn.owner(topic)
        ab = self.batches.get(g)
        if ab is None:
            ab = self.batches[g] = self.conn.groups[g].auto_batch_producer(self.producer_id, **self.kw)
        if len(self._by_topic) < self.TOPIC_CACHE:
            self._by_topic[topic] = ab
        return ab

    def send(self, topic: str, body: bytes, **kw: Any):
        ab = self._by_topic.get(topic)
        if ab is None:
            ab = self._of(topic)
        return ab.send(topic, body, **kw)

    @property
    def acknowledged(self) -> int:
        return sum(ab.acknowledged for ab in self.batches.values())

    @property
    def failed(self) -> BaseException | None:
        return next((ab.failed for ab in self.batches.values() if ab.failed is not None), None)

    def flush(self, timeout: float | None = None) -> int:
        first: BaseException | None = None
        for ab in self.batches.values():
            try:
                ab.flush(timeout)
            except Exception as e:  # noqa: BLE001 - every group is flushed; the first failure is raised
                first = first or e
        if first is not None:
            raise first
        return self.acknowledged

    wait_all = flush

    def close(self) -> None:
        first: BaseException | None = None
        for ab in self.batches.values():
            try:
                ab.close()
            except Exception as e:  # noqa: BLE001 - every group is closed; the first failure is raised
                first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> "GroupedAutoBatch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------- consume
class MergedFilterConsumer:
    """A filter read from every group (its first level a wildcard): one `FilterConsumer` per group.
    `poll()` asks each group in turn and returns what they gave, group after group: every topic's
    records in its order (a topic is one group's), no order between topics of different groups
    (there is none to keep). Each group keeps its own position; `commit()` commits each group's,
    `commit(record)` commits through `record` in its group and everything returned before it by
    the same poll in the others."""

    def __init__(self, parts: list[FilterConsumer]) -> None:
        self.parts = parts
        self.filter = parts[0].filter
        self.group = parts[0].group
        self._last: list[tuple[int, list[Record]]] = []

    @property
    def log_position(self) -> list[int]:
        """Each group's CommitLog position (see FilterConsumer.log_position)."""
        return [p.log_position for p in self.parts]

    def poll(self) -> list[Record]:
        out: list[Record] = []
        self._last = []
        for i, p in enumerate(self.parts):
            recs = p.poll()
            if recs:
                self._last.append((i, recs))
                out.extend(recs)
        return out

    def seek(self, start):
        for p in self.parts:
            p.seek(start)

    def commit(self, offset=None):
        if not self.group:
            raise ValueError("FilterConsumer without a group has nothing to commit to")
        if offset is None:
            for p in self.parts:
                p.commit()
            return None
        if not isinstance(offset, Record):
            raise ValueError("commit(int): a light-queue offset is one group's; over several store groups commit() "
                             "or commit(record)")
        for i, recs in self._last:
            if any(r is offset for r in recs):
                self.parts[i].commit(offset)
                return None
            self.parts[i].commit()        # returned before `offset`: through all of it
        raise ValueError("commit(record): the record was not returned by this consumer's last poll")


class GroupedAdmin:
    """`Admin` over every group: what names a topic goes to its owner, what spans the store
    (topics, a consumer group's lag) is gathered from every group, each row with its `store_group`;
    `stats()` is {group name: that group's stats}."""

    def __init__(self, conn: GroupedConnection) -> None:
        self.conn = conn
        self.admins = [Admin(c) for c in conn.groups]

    def _gather(self, fn) -> list:
        out = []
        for name, a in zip(self.conn.names, self.admins, strict=True):
            out += [{**row, "store_group": name} for row in fn(a)]
        return out

    def topics(self):
        return self._gather(lambda a: a.topics())

    def lag(self, group: str):
        return self._gather(lambda a: a.lag(group))

    def stats(self):
        return {name: a.stats() for name, a in zip(self.conn.names, self.admins, strict=True)}

    def owners(self) -> dict[str, str]:
        return self.conn.owners()

    def _owner(self, topic: str) -> Admin:
        return self.admins[self.conn.owner(topic)]

    def offsets(self, topic: str, queue_id: int = 0):
        return self._owner(topic).offsets(topic, queue_id)

    def committed(self, group: str, topic: str, queue_id: int = 0):
        return self._owner(topic).committed(group, topic, queue_id)

    def query_by_key(self, topic: str, key: str, begin_ms: int = 0, end_ms: int | None = None, max_count: int = 32):
        return self._owner(topic).query_by_key(topic, key, begin_ms, end_ms, max_count)

    def offset_for_time(self, topic: str, ts_ms: int, queue_id: int = 0):
        return self._owner(topic).offset_for_time(topic, ts_ms, queue_id)

    def pop_info(self, group: str, topic: str, queue_id: int = 0):
        return self._owner(topic).pop_info(group, topic, queue_id)

    def get_by_msg_id(self, msg_id: str):
        c = self.conn.for_msg_id(msg_id)
        return None if c is None else Admin(c).get_by_msg_id(msg_id)
