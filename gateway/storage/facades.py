"""What the gateway asks of the store, one small facade per concern (after apache/rocketmq-mqtt's
`LmqQueueStore`, `LmqOffsetStore`, `RetainedPersistManager`, `WillMsgPersistManager`).

Two implementations of each: in-process (store/node/inprocess.py: `lmqtt serve`, straight into
the engine's MetadataStore / LightQueueStore) and remote (gateway/storage/remote_metadata.py, over
the store node's `NodeClient`: `lmqtt gateway`, docs/fleet.md). The composition roots build a
`Storage` bundle and hand each collaborator only the facades it needs; no caller asks which
implementation it holds. One contract suite runs against both: tests/contract/.

Method semantics: the request is made when the method is called (a caller that does not wait
still has its requests ordered, as the remote link orders them), and the method returns an
`Answer`, a future of the store's answer. The in-process implementation returns answers already
done (a failure is a failed answer, never an exception raised by the call). A caller on a hot path
takes `.result()` of a done answer or adds a done-callback; start-up and rare paths may `wait()`
(a remote answer then blocks for its round trip, bounded by the link's timeout); asyncio code may
`await` it; several at once: `Answer.gather` / `Answer.all_in`. The light queues' reads
(`QueueStore`) are answers too, done at once on the delivery hot path (in-process, or from a
remote store's mirror). Events (`on_wills_published`, `on_sessions_moved`, ...) are registered on the facades
of both implementations; the in-process ones never fire (there is no other gateway, and the
store is this process).

This module imports nothing of lmqtt at run time: the store node's in-process implementations
import it (tests/architecture/test_layering.py).
"""
from __future__ import annotations

import asyncio
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generator, Generic, Iterable, Iterator, Protocol, Sequence, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.lightqueue.records import SessionRecord, WillRecord

T = TypeVar("T")
U = TypeVar("U")

Retained = tuple[str, bytes, bytes]            # (topic, payload, props) of a retained message


class Answer(Generic[T]):
    """A future of the store's answer to one request (see the module docstring).

    Like an asyncio future (`done`, `result`, `exception`, `cancelled`, `add_done_callback`,
    `await`), with two differences: a callback added to an answer already done runs at once, not
    at the loop's next iteration; and `wait(timeout)` gives the answer right here, driving the
    remote link while the loop does not run (start-up, rare paths). An answer is never cancelled."""

    __slots__ = ("_done", "_value", "_error", "_callbacks", "_waiter")

    def __init__(self, waiter: "Callable[[Answer[T], float | None], None] | None" = None) -> None:
        """`waiter(answer, timeout)`: makes the answer done before returning (or leaves it not done
        when the store could not answer in time); None for an answer nobody can wait for."""
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Answer[T]], None]] = []
        self._waiter = waiter

    @classmethod
    def of(cls, value: T) -> "Answer[T]":
        """An answer done with `value` (an in-process implementation's, or a remote one the mirror
        holds). On the delivery hot path: only the three fields a done answer reads are set (a
        done answer never reads its callbacks or its waiter)."""
        return answered(value)

    @classmethod
    def failed(cls, error: BaseException) -> "Answer[T]":
        a: Answer[T] = cls()
        a._done, a._error = True, error
        return a

    @classmethod
    def now(cls, fn: Callable[..., T], *args: Any) -> "Answer[T]":
        """`fn(*args)` called now: done with its value, or failed with what it raised."""
        try:
            return cls.of(fn(*args))
        except Exception as e:  # noqa: BLE001 - the caller gets it as the answer
            return cls.failed(e)

    # -- completing
    def set_result(self, value: T) -> None:
        if not self._done:
            self._done, self._value = True, value
            self._run_callbacks()

    def set_exception(self, error: BaseException) -> None:
        if not self._done:
            self._done, self._error = True, error
            self._run_callbacks()

    def _run_callbacks(self) -> None:
        cbs, self._callbacks = self._callbacks, []
        for fn in cbs:
            fn(self)

    # -- reading
    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def result(self) -> T:
        if not self._done:
            raise asyncio.InvalidStateError("the store's answer is not in yet")
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self) -> BaseException | None:
        if not self._done:
            raise asyncio.InvalidStateError("the store's answer is not in yet")
        return self._error

    def add_done_callback(self, fn: "Callable[[Answer[T]], None]") -> None:
        if self._done:
            fn(self)
        else:
            self._callbacks.append(fn)

    def wait(self, timeout: float | None = None) -> T:
        """The answer, waited for here if it is not in (bounded by `timeout`, default the link's)."""
        if not self._done and self._waiter is not None:
            self._waiter(self, timeout)
        if not self._done:
            raise TimeoutError("the store did not answer")
        return self.result()

    def __await__(self) -> Generator[Any, None, T]:
        if not self._done:
            fut = asyncio.get_running_loop().create_future()
            def wake(_a: Answer[T]) -> None:
                if not fut.done():
                    fut.set_result(None)
            self.add_done_callback(wake)
            yield from fut
        return self.result()

    def then(self, fn: Callable[[T], U]) -> "Answer[U]":
        """An answer of `fn(this answer's value)` (a failure, of either, fails it)."""
        out: Answer[U] = Answer(lambda _a, timeout: self.wait_quietly(timeout))

        def done(a: Answer[T]) -> None:
            if a._error is not None:
                out.set_exception(a._error)
                return
            try:
                v = fn(a._value)
            except Exception as e:  # noqa: BLE001 - an answer we cannot read fails this request only
                out.set_exception(e)
                return
            out.set_result(v)
        self.add_done_callback(done)
        return out

    def take_outcome_of(self, src: "Answer[T]") -> None:
        """This answer done as `src` (done) is: its value, or its failure."""
        e = src.exception()
        if e is not None:
            self.set_exception(e)
        else:
            self.set_result(src.result())

    def follow(self, src: "Answer[T]") -> None:
        """This answer gets `src`'s outcome once it is in, and waiting for it waits for `src`
        (an answer handed out before the request that answers it was made)."""
        self.wait_with(lambda _a, timeout: src.wait_quietly(timeout))
        src.add_done_callback(self.take_outcome_of)

    def wait_quietly(self, timeout: float | None) -> None:
        """Wait (up to `timeout`) for the answer without raising its failure: what an answer made of
        others waits for them with, before it reads them."""
        if not self._done and self._waiter is not None:
            self._waiter(self, timeout)

    def wait_with(self, waiter: "Callable[[Answer[T], float | None], None] | None") -> None:
        """How `wait()` waits from now on: an answer made of another one, known only later."""
        self._waiter = waiter

    @staticmethod
    def gather(answers: "Sequence[Answer[Any]]") -> "Answer[list[Any]]":
        """One answer of every answer's value, in order, once all are in (the first failure, in
        order, fails it): what a caller that asked for everything a decision needs waits for.
        Done at once when they all are (in-process); `wait()` waits for each."""
        answers = list(answers)
        if all(a._done for a in answers):
            for a in answers:
                if a._error is not None:
                    return Answer.failed(a._error)
            return Answer.of([a._value for a in answers])

        def waiter(_out: Answer[list[Any]], timeout: float | None) -> None:
            for a in answers:
                a.wait_quietly(timeout)

        out: Answer[list[Any]] = Answer(waiter)
        left = [sum(1 for a in answers if not a._done)]

        def one(_a: Answer[Any]) -> None:
            left[0] -= 1
            if left[0]:
                return
            for a in answers:
                if a._error is not None:
                    out.set_exception(a._error)
                    return
            out.set_result([a._value for a in answers])
        for a in answers:
            if not a._done:
                a.add_done_callback(one)
        return out

    @staticmethod
    def all_in(answers: "Sequence[Answer[Any]]") -> "Answer[None]":
        """Done (with None) once every one of `answers` is in, failed or not: a caller that asked
        for several answers, some of which may fail on their own (a replay plan refused), waits
        for this, then reads each. Done at once when they all are."""
        answers = [a for a in answers if not a._done]
        if not answers:
            return Answer.of(None)

        def waiter(_out: Answer[None], timeout: float | None) -> None:
            for a in answers:
                a.wait_quietly(timeout)

        out: Answer[None] = Answer(waiter)
        left = [len(answers)]

        def one(_a: Answer[Any]) -> None:
            left[0] -= 1
            if not left[0]:
                out.set_result(None)
        for a in answers:
            a.add_done_callback(one)
        return out


class _Done(Answer[T]):
    """An answer done with a value when made (`Answer.of`): the delivery hot path's reads
    in-process and from a remote mirror. Only its value is set; `_done` and `_error` are this
    class's (they shadow the slots), and `done`/`result` need no test."""

    __slots__ = ()
    _done = True            # type: ignore[assignment]
    _error = None           # type: ignore[assignment]

    def done(self) -> bool:
        return True

    def result(self) -> T:
        return self._value  # type: ignore[no-any-return]


_new = object.__new__


def answered(value: T) -> Answer[T]:
    """`Answer.of(value)` as a plain function (one call less: what the in-process hot path's
    reads return, store/node/inprocess.py)."""
    a: Answer[T] = _new(_Done)
    a._value = value
    return a


class WrittenAgain(Exception):
    """A write the store could not answer because its group is failing over, which the
    implementation writes again on the new primary by itself (gateway/storage/remote_metadata.py
    `reestablish`): nothing is lost, nothing for the caller to do."""


class Repeats:
    """Which failures to log: the first of each kind (event and error type), then at most one a
    `every_s`, which says how many were left out since the last. Why: a full disk or a store away
    fails the writes of every client at once, thousands a second, each logged alone; one line says
    it as well, and the operator's log stays readable (the store logs its disk-full episode once,
    store/disk_space.py)."""

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self._last: dict[tuple[str, str], list] = {}      # kind -> [time of its last line, left out since]

    def admit(self, event: str, error: BaseException) -> int | None:
        """None: not logged now (counted); else how many of its kind were left out before it."""
        kind = (event, type(error).__name__)
        now = self.clock()
        seen = self._last.get(kind)
        if seen is None or now - seen[0] >= self.every_s:
            left_out = 0 if seen is None else seen[1]
            self._last[kind] = [now, 0]
            return left_out
        seen[1] += 1
        return None


REPEATS = Repeats()


def log_failure(answer: Answer[Any], log: Any, event: str, **fields: Any) -> None:
    """Log `event` (ERROR, with `fields` and the error) if `answer` fails: a write nobody waits for.
    Repeats of one kind are logged once every `REPEATS.every_s` with their count (`Repeats`). A
    write that is written again after a store group's failover (`WrittenAgain`) is logged at INFO
    as `<event>_deferred`: it is not an error, and the operator's ERROR lines stay meaningful."""
    if answer.__class__ is _Done:     # an in-process write that succeeded: every CONNECT voids a will
        return
    def done(a: Answer[Any]) -> None:
        e = a.exception()
        if e is None:
            return
        what = " ".join(f"{k}={v}" for k, v in fields.items())
        if isinstance(e, WrittenAgain):
            log.info("event=%s_deferred %s reason=%r", event.removesuffix("_failed"), what, str(e))
            return
        left_out = REPEATS.admit(event, e)
        if left_out is None:
            return
        more = f" ({left_out} more like it since the last such line, not logged)" if left_out else ""
        log.error("event=%s %s error=%r%s", event, what, e, more)
    answer.add_done_callback(done)


# ---------------------------------------------------------------- the facades
class SessionStore(Protocol):
    """Persistent MQTT sessions' records (SessionRecord), and in a fleet who serves which.

    `claims_void_wills`: True when a `claim` also voids the wills that earlier connections of the
    claimed client ids left on other gateways, in the store that keeps this facade's wills (one
    store: the claim and the wills are there; over several groups a will lives in its topic's
    group, which the claim may not reach)."""

    claims_void_wills: bool

    def put(self, client_id: str, rec: "SessionRecord") -> Answer[None]:
        """Write the record; a CONNACK / SUBACK it backs waits for the answer."""
    def put_many(self, records: "list[tuple[str, SessionRecord]]") -> Answer[None]:
        """Write several records (client id, record) that nothing waits for (sessions gone
        offline): in-process one metadata write; remote, one `put` each, in order."""
    def get(self, client_id: str) -> "Answer[SessionRecord | None]": ...
    def load(self, client_id: str) -> "Answer[tuple[SessionRecord | None, dict[str, int]]]":
        """The record and the client's committed offsets together (a CONNECT resuming a session)."""
    def delete(self, client_id: str) -> Answer[bool]:
        """The record and the session's offsets (consumer = client id) go."""
    def all(self) -> "Answer[list[SessionRecord]]": ...
    def list_for_restore(self, hosted_by: str | None = None) -> "Answer[list[tuple[SessionRecord, dict[str, int]]]]":
        """Every record with its committed offsets (a gateway's restore at start); `hosted_by`:
        a fleet gateway's own and those of no gateway."""
    def records_for_restore(self, hosted_by: str | None = None) -> "Answer[Iterable[bytes]]":
        """The records' bytes (SessionRecord JSON, as written), without offsets: a gateway's
        restore at start decodes only what it needs of each (gateway/clients/session_persistence.py
        `dormant_from`) and reads a session's offsets when its client comes back. In-process read
        as they are consumed; remote a page per round trip. `hosted_by`: as `list_for_restore`
        (a node of the previous version may send them all: the caller checks the host too)."""
    def claim(self, claims: list[tuple[str, int]]) -> Answer[None]:
        """This gateway attached connections to these client ids at these wall-clock ms: the
        other gateways are told (in-process: there are none); see `claims_void_wills`."""
    def flush(self) -> Answer[None]:
        """Everything written so far through any metadata facade is durable."""
    # events (in-process: never fire)
    def on_sessions_swept(self, fn: Callable[[list[str]], None]) -> None:
        """The store took this gateway for gone and changed these clients' records."""
    def on_sessions_moved(self, fn: Callable[[list[str]], None]) -> None:
        """Another gateway wrote or ended these clients' records."""
    def on_session_claims(self, fn: Callable[[str, list], None]) -> None:
        """(gateway, [(client id, since ms)]): another gateway attached connections to these."""


class OffsetStore(Protocol):
    """Consumer offsets in light queues (a session's client id, or `$share/{group}`)."""

    def get(self, consumer: str, queue: str) -> Answer[int | None]: ...
    def get_all(self, consumer: str) -> Answer[dict[str, int]]: ...
    def set(self, consumer: str, offsets: dict[str, int]) -> Answer[None]: ...
    def delete(self, consumer: str, queues: list[str] | None = None) -> Answer[None]:
        """`queues` None: all of the consumer's."""


class RetainedStore(Protocol):
    """Retained messages (an empty payload clears)."""

    def set(self, topic: str, payload: bytes, props: bytes = b"") -> Answer[None]: ...
    def matching(self, flt: str) -> Answer[list[Retained]]:
        """Every retained message `flt` matches, in topic order."""
    def batches(self, flt: str) -> Answer[Iterator[list[Retained]]]:
        """`matching` in lists, read as they are consumed in-process (a subscriber's first
        retained messages go out before the whole range is read); remote: one list."""
    def clear_if(self, topic: str, props: bytes) -> Answer[bool]:
        """Clear `topic`'s retained message if it is still the one stored with `props`."""


class WillStore(Protocol):
    """Wills of connected clients, held by the gateway serving the connection: published by that
    gateway when the connection ends uncleanly, at its next start after a crash (`take`), or in a
    fleet by the store node when the gateway stays away past its grace period (docs/fleet.md)."""

    def put(self, client_id: str, will: "WillRecord") -> Answer[None]:
        """This gateway holds `client_id`'s connection with this will (replaces any earlier one)."""
    def pop(self, client_id: str) -> Answer[None]:
        """This gateway's will of `client_id` is gone; a will another gateway wrote since stays."""
    def void(self, client_id: str) -> Answer[None]:
        """A new connection of `client_id`: a previous connection's will, whichever gateway held
        it, is never published."""
    def take(self) -> "Answer[list[tuple[str, WillRecord]]]":
        """Remove and return the wills this gateway holds (at start: the orphans of its crash)."""
    def held(self) -> "Answer[list[tuple[str, WillRecord]]]":
        """The wills this gateway holds (in-process: all)."""
    def on_wills_published(self, fn: Callable[[list[str]], None]) -> None:
        """The store published these clients' wills while this gateway was away (in-process: never)."""


class FilterRegistry(Protocol):
    """This gateway's holds on wildcard filters: the store indexes a wildcard filter's light queue
    while some gateway holds it (one hold per filter per gateway; the subscription registry,
    gateway/subscriptions/subscription_registry.py, counts the local users). A hold is what a new
    subscription waits for: a message appended after `register`'s answer is in the queue."""

    def register(self, flt: str) -> Answer[int]:
        """Hold `flt` (validated: an invalid filter fails the answer): its new hold count."""
    def register_all(self, flts: list[str]) -> Answer[dict[str, int]]:
        """`register` of each (a restore at start: one metadata write in-process, many per round
        trip remote): hold counts by filter."""
    def unregister(self, flt: str) -> Answer[int]:
        """Let go of one hold: the count left (at 0 the filter's queue is dropped)."""
    def release(self, flt: str) -> Answer[None]:
        """`unregister` whose count nobody reads (remote: sent now, answered in order with what
        this gateway asks next; the caller logs a failure)."""
    def registered(self) -> Answer[dict[str, int]]:
        """This gateway's holds by filter (in-process: every hold of the store)."""


class ReplayRefused(Exception):
    """`QueueStore.replay_plan` cannot serve the period asked for (outside retention, ...): the
    message says why (the subscription is refused with it). Both implementations raise this one
    (in-process: translated from the light queues' own)."""


class ReplayPlan:
    """Answer of `QueueStore.replay_plan` (lightqueue/replay.py `plan`): `source` "queue" (the
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
        self.source: str = plan["source"]
        self.live_offset = int(plan["live_offset"])
        self.cursor: Any = plan.get("cursor")
        self.done = self.cursor is None
        self._read = read
        self._read_later = read_later
        self._next: Any = None              # the chunk being read (read_later): at most one, each
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
            assert self._read is not None
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
        assert self._read_later is not None
        fut = self._next = self._read_later(cursor, max_count)

        def done(f: Any) -> None:
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


class QueueStore(Protocol):
    """The light queues: appends (delayed ones too), pulls, offsets, "queues have new data" events,
    the history of a filter.

    Every read returns an `Answer`. In-process it is done when the method returns (`Answer.of`:
    the reads are local). Remote (gateway/storage/remote_store.py) it is done at once when the
    gateway holds what is asked (the mirror of each queue this gateway reads), else the request
    is sent now and the answer completes when the store's reply is in: never a blocking round
    trip on the event loop. Requests asked for in one loop turn travel together (one round trip).
    The delivery hot path takes `.result()` when `.done()` (the case of every read in-process and
    of the mirror remote) and otherwise lets the answer wake it; a SUBSCRIBE or a resumed
    session's CONNECT asks every facade for every answer it needs and waits for them together
    (subscriptions/subscription_registry.py `Prepared`, the connection on hold). An append's results carry
    a `.durable` future the PUBACK waits for."""

    # -- publish path
    def queues_for_topic(self, topic: str) -> tuple[str, ...]:
        """The light queues a publish to `topic` is dispatched to (remote: (), the store's
        router computes them)."""
    def append_batch(self, messages: Sequence[Any], dispatch: bool = True) -> Any:
        """All or none; the last result's `.durable` future covers the whole batch.
        `dispatch=False`: readable from the light queues only after `dispatch_appended()` (the
        publish path writes its acks in between); remote, the store node dispatches regardless."""
    def dispatch_appended(self) -> None:
        """Make readable what `append_batch(..., dispatch=False)` appended (remote: nothing to do)."""
    def append(self, message: Any) -> Any: ...
    def append_batch_delayed(self, messages: Sequence[Any], due_ms: Sequence[int]) -> Any:
        """append_batch where message i with `due_ms[i]` > 0 is delivered at that epoch ms (the
        store's timer wheel); the durable future means the timers are durable too."""
    def enable_delayed(self, loop: Any) -> None:
        """Delayed publishes fire on `loop` (in-process: the store's timer wheel, so the loop stays
        the store's only appender; remote: nothing to do, the store node fires them)."""
    def all_visible(self) -> bool:
        """Everything appended so far is readable from the light queues."""
    def unavailable(self) -> str | None:
        """Why the store cannot serve right now (CONNECT is refused with 0x88), or None."""
    def disk_state(self) -> dict | None:
        """The store's disk-full state (`disk_full`, `disk_full_refused`, `disk_free_bytes`,
        store/disk_space.py) when the store is this process, for the gateway's /metrics; None
        when it is elsewhere (`lmqtt store` exports its own)."""

    # -- delivery path (each an Answer: see the class docstring)
    def max_offset(self, queue: str) -> Answer[int]:
        """Where the queue's readable entries end (remote: the mirror's end; a queue not mirrored
        yet is watched now, and the answer completes with the store's reply)."""
    def end_offset(self, queue: str) -> Answer[int]:
        """Where the queue ends as far as the gateway knows (remote: what the store last said,
        which the mirror may not hold yet; in-process: `max_offset`)."""
    def start_offset(self, queue: str) -> Answer[int]:
        """Where a new subscription to `queue` starts: after every message whose publish was
        acknowledged before this call (so it is not delivered as new, nor missed)."""
    def pull(self, queue: str, offset: int, max_count: int = 32, max_bytes: int = 1 << 20) -> Answer[Any]:
        """The entries from `offset` (`.messages`, `.next_offset`...). Remote, behind the mirror:
        the chunk is asked for now and the answer completes when it is in (`on_new_data` names
        the queue then too); an answer that fails (the store away) is asked again later."""
    def on_new_data(self, callback: Callable[[Iterable[str]], None]) -> None:
        """Call `callback(queue_names)` when queues get new entries."""
    def message_at(self, queue: str, offset: int) -> Answer[Any]:
        """The entry at `offset` of `queue` (StoredMessage's fields), or None when it is no longer
        stored (retention). Remote: one read (asked with the session it resumes)."""

    # -- subscribing from the past (gateway/delivery/history.py; off the delivery hot path)
    def replay_plan(self, flt: str, since_ms: int) -> "Answer[ReplayPlan]":
        """Where the history of `flt` since `since_ms` is: the light queue from
        `plan.live_offset`, preceded (source "log") by `plan.read()` batches from the log up to
        the seam. Ask after registering a wildcard `flt` (in the same loop turn is enough: the
        requests are answered in order). A failed answer with `ReplayRefused` (outside
        retention...)."""


@dataclass
class Storage:
    """The facades a composition root builds and hands out, each collaborator taking only those
    it needs (the Broker gets the bundle and hands them on)."""
    sessions: SessionStore
    offsets: OffsetStore
    retained: RetainedStore
    wills: WillStore
    filters: FilterRegistry
    queues: QueueStore
    # a context whose filter references, session records and offsets written inside go in one
    # metadata write at its end (a SUBSCRIBE's, before its SUBACK: lightqueue/metadata.py
    # `one_write`, in-process); a remote store writes each when asked: a context doing nothing
    one_write: "Callable[[], Any]" = nullcontext
