"""What the gateway needs from the store's light queues: the seam between MQTT and storage for
appends, pulls, offsets of queues and new-data events (`GatewayStore`).
The metadata concerns (sessions, offsets, retained messages, wills, group leases) and the filter
registrations are the facades of gateway/storage/facades.py, bundled with this in a `Storage`.
Issue 25's next step replaces `GatewayStore` by a `QueueStore` facade the same way.

Two implementations: in-process (`InProcessStore` in store/node/inprocess.py: the embedded
`lmqtt serve`, zero copies, calls straight into `MessageStore` / `LightQueueStore`, beside the
in-process metadata facades) and remote (`gateway/storage/remote_store.py` `RemoteStore`: the store's
native protocol, for `lmqtt gateway`, docs/fleet.md). The end-to-end tests run against both.

The composition root puts it in the `Storage` bundle (`queues`) it gives the broker,
which hands it to the publish pipeline, the delivery engine, the subscription registry and
the bundle's metadata facades to the session persistence and registry; none of them touches the store objects
otherwise.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple, Protocol, Sequence

from lmqtt.gateway.storage.facades import ReplayPlan


class GatewayStore(Protocol):
    """Append, pull, and "queues have new data" events."""

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

    # -- what a SUBSCRIBE or a resumed session reads, asked for before it is decided (a remote store: one pipelined
    #    round trip the connection waits for on hold, instead of blocking calls that would stop
    #    the whole gateway; in-process: None, the reads are local)
    def read_ahead(self, reads: "StoreReads") -> Any:
        """A future of a `ReadAhead` with the answers to `reads`, or None (nothing to wait for)."""
    def using(self, ahead: "ReadAhead | None") -> Any:
        """Context manager: while it is open, the filter registrations (`Storage.filters`),
        `start_offset`, `replay_plan`, `message_at` and the committed offsets (`Storage.offsets`)
        answer from `ahead`; on exit, registrations it made that nothing took are dropped again.
        `ahead` None: nothing."""
    def message_at(self, queue: str, offset: int) -> Any:
        """The entry at `offset` of `queue` (StoredMessage's fields), read now in-process; a remote
        store answers from the open read-ahead. None when not available (deleted by retention,
        or not read ahead)."""

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


__all__ = ["GatewayStore", "StoreReads", "ReadAhead", "ReplayPlan"]
