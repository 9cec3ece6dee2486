"""The gateway's storage facades (gateway/storage/facades.py) in-process: `lmqtt serve`, where the
gateway and the store are one process and every call goes straight into the engine's objects
(`MetadataStore` of the light queues, `MessageStore`, `LightQueueStore`); `InProcessQueues` is the
`QueueStore` of the light queues. Every answer is done when
the method returns; a failure (a RocksDB write refused for space...) is a failed answer. The events
of the facades never fire here: there is no other gateway, and the store is this process.

`lmqtt serve`'s in-process store node (store/node/embedded.py) hands the gateway its bundle from
`storage(store, lq)`; the gateway's own modules never import the engine (tests/architecture/test_layering.py)."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from lmqtt.gateway.storage.facades import Answer, ReplayPlan, ReplayRefused, Retained, Storage, answered
from lmqtt.lightqueue.metadata import MetadataStore
from lmqtt.lightqueue.records import SessionRecord, WillRecord, is_stub_bytes
from lmqtt.lightqueue.replay import ReplayRefused as LightQueueReplayRefused


class InProcessSessions:
    claims_void_wills = False      # no claims: one process serves every client

    def __init__(self, md: MetadataStore) -> None:
        self.md = md

    def put(self, client_id: str, rec: SessionRecord) -> Answer[None]:
        def put() -> None:
            self.md.put_session(client_id, rec)      # a stub not written over a record: nothing to answer
        return Answer.now(put)

    def put_many(self, records: list[tuple[str, SessionRecord]]) -> Answer[None]:
        return Answer.now(self.md.put_sessions, records)

    def get(self, client_id: str) -> Answer[SessionRecord | None]:
        return Answer.now(self.md.get_session, client_id)

    def load(self, client_id: str) -> Answer[tuple[SessionRecord | None, dict[str, int]]]:
        return Answer.now(lambda: (self.md.get_session(client_id), self.md.get_offsets(client_id)))

    def delete(self, client_id: str) -> Answer[bool]:
        return Answer.now(self.md.delete_session, client_id)

    def all(self) -> Answer[list[SessionRecord]]:
        return Answer.now(self.md.list_sessions)

    def list_for_restore(self, hosted_by: str | None = None) -> Answer[list[tuple[SessionRecord, dict[str, int]]]]:
        return Answer.now(self.md.sessions_with_offsets, hosted_by)

    def records_for_restore(self, hosted_by: str | None = None) -> Answer[Iterable[bytes]]:
        """The records' bytes in client id order, read in pages as they are consumed (a million
        sessions' bytes are never all in memory at once); no host filtering in-process (the
        embedded gateway restores them all; the caller checks the host)."""
        md = self.md

        def pages() -> Iterator[bytes]:
            after = None
            while True:
                page, after = md.session_page(after, 10000)
                for _cid, raw in page:
                    if not is_stub_bytes(raw):
                        yield raw
                if after is None:
                    return
        return Answer.of(pages())

    def claim(self, claims: list[tuple[str, int]]) -> Answer[None]:
        return Answer.of(None)            # no other gateway to tell

    def flush(self) -> Answer[None]:
        return Answer.now(self.md.flush)

    def on_sessions_swept(self, fn: Callable[[list[str]], None]) -> None:
        pass

    def on_sessions_moved(self, fn: Callable[[list[str]], None]) -> None:
        pass

    def on_session_claims(self, fn: Callable[[str, list], None]) -> None:
        pass


class InProcessOffsets:
    def __init__(self, md: MetadataStore) -> None:
        self.md = md

    def get(self, consumer: str, queue: str) -> Answer[int | None]:
        return Answer.now(self.md.get_offset, consumer, queue)

    def get_all(self, consumer: str) -> Answer[dict[str, int]]:
        return Answer.now(self.md.get_offsets, consumer)

    def set(self, consumer: str, offsets: dict[str, int]) -> Answer[None]:
        return Answer.now(self.md.set_offsets, consumer, offsets)

    def delete(self, consumer: str, queues: list[str] | None = None) -> Answer[None]:
        return Answer.now(self.md.delete_offsets, consumer, queues)


class InProcessRetained:
    def __init__(self, md: MetadataStore) -> None:
        self.md = md

    def set(self, topic: str, payload: bytes, props: bytes = b"") -> Answer[None]:
        return Answer.now(self.md.set_retained, topic, payload, props)

    def matching(self, flt: str) -> Answer[list[Retained]]:
        return Answer.now(self.md.retained_matching, flt)

    def batches(self, flt: str) -> Answer[Iterator[list[Retained]]]:
        return Answer.now(self.md.retained_batches, flt)     # lazy: read as they are consumed

    def clear_if(self, topic: str, props: bytes) -> Answer[bool]:
        return Answer.now(self.md.clear_retained_if, topic, props)


class InProcessWills:
    """The embedded gateway's wills: it is the only gateway (its wills carry no gateway id)."""

    def __init__(self, md: MetadataStore) -> None:
        self.md = md

    def put(self, client_id: str, will: WillRecord) -> Answer[None]:
        return Answer.now(self.md.put_will, client_id, will)

    def pop(self, client_id: str) -> Answer[None]:
        def pop() -> None:
            self.md.pop_will(client_id)
        return Answer.now(pop)

    def void(self, client_id: str) -> Answer[None]:
        return Answer.now(self.md.void_will, client_id)

    def take(self) -> Answer[list[tuple[str, WillRecord]]]:
        return Answer.now(self.md.take_wills)

    def held(self) -> Answer[list[tuple[str, WillRecord]]]:
        return Answer.now(self.md.list_wills)

    def on_wills_published(self, fn: Callable[[list[str]], None]) -> None:
        pass


class InProcessFilters:
    """The light queues' wildcard filter registrations (`lq.registry`): the embedded gateway is
    the only holder besides the store port's SDK consumers, so `registered` is every hold."""

    def __init__(self, lq: Any) -> None:
        self.lq = lq

    def register(self, flt: str) -> Answer[int]:
        return Answer.now(self.lq.register_filter, flt)

    def register_all(self, flts: list[str]) -> Answer[dict[str, int]]:
        def register() -> dict[str, int]:
            self.lq.register_filters(flts)            # one metadata write for all
            return {f: self.lq.registry.refcount(f) for f in flts}
        return Answer.now(register)

    def unregister(self, flt: str) -> Answer[int]:
        return Answer.now(self.lq.unregister_filter, flt)

    def release(self, flt: str) -> Answer[None]:
        def release() -> None:
            self.lq.unregister_filter(flt)
        return Answer.now(release)

    def registered(self) -> Answer[dict[str, int]]:
        return Answer.now(lambda: dict(self.lq.registry.filters()))


class InProcessQueues:
    """`QueueStore` over the embedded `MessageStore` and `LightQueueStore`: every read is local,
    its answer done when the method returns (`Answer.of`, the only cost the seam adds)."""

    def __init__(self, store: Any, lq: Any) -> None:
        self.store = store
        self.lq = lq
        # bound methods: the hot paths call straight into the store objects
        self.queues_for_topic = lq.queues_for_topic
        self.append_batch = store.append_batch
        self.append = store.append
        self.dispatch_appended = store.dispatch_appended
        # the delivery hot path's reads: functions made here (no bound method, no attribute
        # lookup per call) around the light queues' own; a try costs nothing in Python 3.11
        # unless it raises (a failure is a failed answer, as everywhere on the seam)
        lq_max, lq_pull, failed = lq.max_offset, lq.pull, Answer.failed

        def max_offset(queue: str) -> Answer[int]:
            try:
                return answered(lq_max(queue))
            except Exception as e:  # noqa: BLE001 - the caller gets it as the answer
                return failed(e)

        def pull(queue: str, offset: int, max_count: int = 32, max_bytes: int = 1 << 20) -> Answer[Any]:
            try:
                return answered(lq_pull(queue, offset, max_count, max_bytes))
            except Exception as e:  # noqa: BLE001 - the caller gets it as the answer
                return failed(e)
        self.max_offset = self.end_offset = max_offset
        self.pull = pull

    def all_visible(self) -> bool:
        return self.store.dispatched_offset >= self.store.max_offset

    def start_offset(self, queue: str) -> Answer[int]:
        st = self.store
        if st.dispatched_offset < st.max_offset:          # dispatch on its own thread (not inline)
            st.wait_dispatched(st.max_offset, 1.0)
        return Answer.now(self.lq.max_offset, queue)

    def unavailable(self) -> str | None:
        return None               # the embedded store is this process

    def disk_state(self) -> dict | None:
        return self.store.clog.disk.stats()

    def message_at(self, queue: str, offset: int) -> Answer[Any]:
        def read() -> Any:
            for m in self.lq.pull(queue, offset, max_count=1).messages:
                if m.queue_offset == offset:
                    return m
            return None
        return Answer.now(read)

    def on_new_data(self, callback: Callable[[Iterable[str]], None]) -> None:
        self.lq.add_listener(callback)

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

    def replay_plan(self, flt: str, since_ms: int) -> Answer[ReplayPlan]:
        try:
            plan = self.lq.replay_plan(flt, since_ms)
        except LightQueueReplayRefused as e:
            return Answer.failed(ReplayRefused(str(e)))
        except Exception as e:  # noqa: BLE001 - the caller gets it as the answer
            return Answer.failed(e)
        return Answer.of(ReplayPlan(plan, self.lq.replay_read))


def storage(store: Any, lq: Any) -> Storage:
    """The whole in-process bundle of `lmqtt serve` over `store` (MessageStore) and `lq`
    (LightQueueStore): the metadata facades over `lq.metadata`, the filter registrations and the
    light queues."""
    md = lq.metadata
    return Storage(InProcessSessions(md), InProcessOffsets(md), InProcessRetained(md), InProcessWills(md),
                   InProcessFilters(lq), InProcessQueues(store, lq), one_write=md.one_write)


__all__ = ["storage", "InProcessQueues", "InProcessSessions", "InProcessOffsets", "InProcessRetained",
           "InProcessWills", "InProcessFilters"]
