"""What the gateway needs from the store's light queues: the seam between MQTT and storage for
appends, pulls, offsets of queues, new-data events and filter registrations (`GatewayStore`).
The metadata concerns (sessions, offsets, retained messages, wills, group leases) are the facades
of gateway/storage/facades.py; a `GatewayStore`'s `metadata` is their `Storage` bundle. Issue 25's
next steps replace `GatewayStore` by the `QueueStore` and `FilterRegistry` facades the same way.

Two implementations: in-process (`InProcessStore`, below: the embedded `lmqtt serve`, zero
copies, calls straight into `MessageStore` / `LightQueueStore`; its metadata facades are
store/node/inprocess.py's) and remote (`gateway/storage/remote_store.py` `RemoteStore`: the store's
native protocol, for `lmqtt gateway`, docs/fleet.md). The end-to-end tests run against both.

The broker uses the `GatewayStore` it is given (default: an `InProcessStore` built from the store
objects) and hands it to the publish pipeline, the delivery engine, the subscription registry and
(its `metadata`) the session persistence and registry; none of them touches the store objects
otherwise.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Iterable, NamedTuple, Protocol, Sequence

from lmqtt.gateway.storage.facades import Storage
from lmqtt.store.node.inprocess import metadata_storage


class GatewayStore(Protocol):
    """Append, pull, filter registrations, metadata, and "queues have new data" events."""

    metadata: Storage          # the metadata facades (storage/facades.py), and this as queues/filters

    # -- publish path
    def queues_for_topic(self, topic: str) -> tuple[str, ...]: ...
    def append_batch(self, messages: Sequence[Any]) -> Any:
        """All or none; the last result's `.durable` future covers the whole batch."""
    def append(self, message: Any) -> Any: ...
    def append_batch_delayed(self, messages: Sequence[Any], due_ms: Sequence[int]) -> Any:
        """append_batch where message i with `due_ms[i]` > 0 is delivered at that epoch ms (the
        store's timer wheel); the durable future means the timers are durable too."""
    def all_visible(self) -> bool:
        """Everything appended so far is readable from the light queues."""
    def unavailable(self) -> str | None:
        """Why the store cannot serve right now (CONNECT is refused with 0x88), or None."""

    # -- delivery path
    def max_offset(self, queue: str) -> int: ...
    def end_offset(self, queue: str) -> int:
        """Where the queue ends as far as the gateway knows (remote: what the store last said,
        which the mirror may not hold yet; in-process: `max_offset`)."""
    def start_offset(self, queue: str) -> int:
        """Where a new subscription to `queue` starts: after every message whose publish was
        acknowledged before this call (so it is not delivered as new, nor missed)."""
    def pull(self, queue: str, offset: int, max_count: int = 32, max_bytes: int = 1 << 20) -> Any: ...
    def on_new_data(self, callback: Callable[[Iterable[str]], None]) -> None:
        """Call `callback(queue_names)` when queues get new entries."""

    reads_ahead: bool      # True: `read_ahead` may ask for something (a remote store)

    # -- what a SUBSCRIBE or a resumed session reads, asked for before it is decided (a remote store: one pipelined
    #    round trip the connection waits for on hold, instead of blocking calls that would stop
    #    the whole gateway; in-process: None, the reads are local)
    def read_ahead(self, reads: "StoreReads") -> Any:
        """A future of a `ReadAhead` with the answers to `reads`, or None (nothing to ask for)."""
    def using(self, ahead: "ReadAhead") -> Any:
        """Context manager: while it is open, `register_filter`, `start_offset`, `replay_plan`
        and `offset_read_ahead` answer from `ahead`; on exit, registrations it made that nothing
        took are dropped again."""
    def offset_read_ahead(self, consumer: str, queue: str) -> tuple[bool, int | None]:
        """A consumer's committed offset as the open read-ahead has it: (True, offset or None if
        none is committed), or (False, None) when it was not read ahead (ask the metadata)."""
    def message_at(self, queue: str, offset: int) -> Any:
        """The entry at `offset` of `queue` (StoredMessage's fields), read now in-process; a remote
        store answers from the open read-ahead. None when not available (deleted by retention,
        or not read ahead)."""

    # -- wildcard filter registrations (one per filter the gateway uses)
    def register_filter(self, flt: str) -> int: ...
    def register_filters(self, flts: list[str]) -> dict[str, int]:
        """`register_filter` of each (remote: many per round trip)."""
    def unregister_filter(self, flt: str) -> int: ...
    def release_filter(self, flt: str) -> None:
        """`unregister_filter` without waiting for the count (remote: sent now, answered in order
        with what this gateway asks next; a failure is logged)."""
    def registered_filters(self) -> dict[str, int]: ...

    # -- subscribing from the past (gateway/delivery/history.py; off the delivery hot path)
    def replay_plan(self, flt: str, since_ms: int) -> "ReplayPlan":
        """Where the history of `flt` since `since_ms` is: the light queue from
        `plan.live_offset`, preceded (source "log") by `plan.read()` batches from the log up to
        the seam. Call after registering a wildcard `flt`. Raises
        `lmqtt.lightqueue.replay.ReplayRefused` (outside retention)."""


class StoreReads(NamedTuple):
    """What a SUBSCRIBE (SubscriptionRegistry.read_ahead) or a resumed session (fleet.py
    `FleetSessionRegistry.load_later`) will ask the store: wildcard filters new to this gateway
    to register, queues to follow (a remote store mirrors them), queues whose start offset new
    subscriptions and shared groups need, filters whose retained messages are sent after the
    SUBACK; (consumer, queue) pairs whose committed offset a shared group resumes from, and
    (filter, since_ms) pairs of subscriptions from the past whose replay plan is needed; (queue,
    offset) of messages a resumed session had in flight (persistence.restore_inflight)."""
    register: list
    watch: list
    start: list
    retained: list
    offsets: Sequence = ()
    replay: Sequence = ()
    messages: Sequence = ()


class ReadAhead(NamedTuple):
    """The store's answers to `StoreReads`: registration counts by filter, start offsets by
    queue, retained (topic, payload, properties) lists by filter, committed offsets (or None) by
    (consumer, queue), replay plans by (filter, since_ms) (the store's answer, or the error it
    refused that one plan with), messages by (queue, offset). Taken (popped) as used."""
    registered: dict
    start: dict
    retained: dict
    offsets: dict
    replay: dict
    messages: dict


class ReplayPlan:
    """Answer of `GatewayStore.replay_plan` (lightqueue/replay.py `plan`): `source` "queue" (the
    light queue holds the whole period: start a cursor at `live_offset`) or "log" (first the
    history, `read()` until `done`, then the light queue from `live_offset`).

    The history is read with `read(cursor, max_count) -> (messages, cursor, done)` (in-process:
    at once), or with `read_later(cursor, max_count)` returning a future of the same (a remote
    store): then `read()` answers None while the chunk is on its way and calls `on_ready()` when it
    is in, and up to `AHEAD` chunks are read ahead, each asked for as the one before arrives, so
    the store reads while the gateway sends."""

    __slots__ = ("source", "live_offset", "cursor", "done", "_read", "_read_later", "_next", "_ready",
                 "_error", "_end", "on_ready")

    AHEAD = 2            # chunks read ahead (a remote store): the store reads while the gateway sends

    def __init__(self, plan: dict, read: Callable[[dict, int], tuple[list, dict, bool]] | None = None,
                 read_later: Callable[[dict, int], Any] | None = None) -> None:
        self.source = plan["source"]
        self.live_offset = int(plan["live_offset"])
        self.cursor = plan.get("cursor")
        self.done = self.cursor is None
        self._read = read
        self._read_later = read_later
        self._next = None                   # the chunk being read (read_later): at most one, each
                                            # is asked for with the cursor the one before returned
        self._ready: list = []              # chunks in, not taken: (messages, cursor, done)
        self._error: BaseException | None = None
        self._end = self.done               # the last chunk is asked for or in
        self.on_ready: Callable[[], None] | None = None

    def read(self, max_count: int = 1024) -> list | None:
        """The next history messages (StoredMessage-like, in log order); [] once `done`; None
        while they are on their way (`on_ready` follows). A failed read raises here once and is
        asked for again at the next call, from where the history stands."""
        if self.done:
            return []
        if self._read_later is None:
            msgs, self.cursor, self.done = self._read(self.cursor, max_count)
            return msgs
        if self._ready:
            msgs, self.cursor, self.done = self._ready.pop(0)
            self._fill(max_count)
            return msgs
        if self._error is not None:
            e, self._error = self._error, None
            raise e
        self._fill(max_count)
        return None

    def _fill(self, max_count: int) -> None:
        if self._next is not None or self._end or self._error is not None or len(self._ready) >= self.AHEAD:
            return
        cursor = self._ready[-1][1] if self._ready else self.cursor
        fut = self._next = self._read_later(cursor, max_count)

        def done(f) -> None:
            self._next = None
            e = f.exception() if not f.cancelled() else asyncio.CancelledError()
            if e is not None:
                self._error = e
            else:
                got = f.result()
                self._ready.append(got)
                self._end = bool(got[2])
                self._fill(max_count)
            if self.on_ready is not None:
                self.on_ready()
        fut.add_done_callback(done)


class InProcessStore:
    """`GatewayStore` over the embedded `MessageStore` and `LightQueueStore` (no copies)."""

    reads_ahead = False

    def __init__(self, store, lq) -> None:
        self.store = store
        self.lq = lq
        # the metadata facades (storage/facades.py), in-process (store/node/inprocess.py)
        self.metadata = metadata_storage(lq)
        self.metadata.queues = self.metadata.filters = self
        # bound methods: the hot paths call straight into the store objects
        self.queues_for_topic = lq.queues_for_topic
        self.append_batch = store.append_batch
        self.append = store.append
        self.max_offset = self.end_offset = lq.max_offset
        self.pull = lq.pull
        self.register_filter = lq.register_filter

    def all_visible(self) -> bool:
        return self.store.dispatched_offset >= self.store.max_offset

    def start_offset(self, queue: str) -> int:
        st = self.store
        if st.dispatched_offset < st.max_offset:          # dispatch on its own thread (not inline)
            st.wait_dispatched(st.max_offset, 1.0)
        return self.lq.max_offset(queue)

    def unavailable(self) -> str | None:
        return None               # the embedded store is this process

    def read_ahead(self, reads: StoreReads) -> None:
        return None               # local reads: nothing to wait for

    def offset_read_ahead(self, consumer: str, queue: str) -> tuple[bool, int | None]:
        return False, None

    def message_at(self, queue: str, offset: int):
        for m in self.lq.pull(queue, offset, max_count=1).messages:
            if m.queue_offset == offset:
                return m
        return None

    def on_new_data(self, callback: Callable[[Iterable[str]], None]) -> None:
        self.lq.add_listener(callback)

    def register_filters(self, flts: list[str]) -> dict[str, int]:
        self.lq.register_filters(flts)            # one metadata write for all
        return {f: self.lq.registry.refcount(f) for f in flts}

    def unregister_filter(self, flt: str) -> int:
        return self.lq.unregister_filter(flt)

    def release_filter(self, flt: str) -> None:
        self.lq.unregister_filter(flt)

    def enable_delayed(self, loop) -> None:
        """Delayed publishes: the store's timer wheel, firing on the gateway's loop (so the loop
        stays the store's only appender) and routed through the light queues at firing time."""
        self.store.enable_delayed(self.lq.queues_for_topic, loop)

    def append_batch_delayed(self, messages, due_ms):
        """append_batch where `due_ms[i]` > 0 parks message i in the timer wheel until then (one
        append, all or none; the timers are written before this returns)."""
        d = self.store.delayed
        msgs, parked = d.park(messages, due_ms)
        rs = self.store.append_batch(msgs)
        d.arm(rs, parked, due_ms)
        return rs

    def registered_filters(self) -> dict[str, int]:
        return dict(self.lq.registry.filters())

    def replay_plan(self, flt: str, since_ms: int) -> ReplayPlan:
        return ReplayPlan(self.lq.replay_plan(flt, since_ms), self.lq.replay_read)
