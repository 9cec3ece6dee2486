"""The value types crossing the store's API: what callers append, read back, and what dispatchers see.

`Message` is a plain class with `__slots__`; the types the store creates per record on hot paths
(`StoredMessage`, `DispatchRequest`, `AppendResult`) are immutable named tuples built with
`tuple.__new__` (no Python-level `__init__`).
"""
from __future__ import annotations

import threading
from collections import namedtuple
from collections.abc import Sequence
from concurrent.futures import Future


class Message:
    """A message to append. `props` is opaque bytes (the store never interprets it), `flags` an
    opaque u32, `keys` are indexed under `topic#key`, `dispatch_queues` is the multi-dispatch list
    of light-queue names handed to dispatchers untouched."""

    __slots__ = ("topic", "body", "queue_id", "flags", "props", "keys", "born_ts", "dispatch_queues")

    def __init__(self, topic: str, body: bytes, queue_id: int = 0, flags: int = 0, props: bytes = b"",
                 keys: tuple[str, ...] = (), born_ts: int = 0,
                 dispatch_queues: tuple[str, ...] = ()) -> None:
        self.topic = topic
        self.body = body
        self.queue_id = queue_id
        self.flags = flags
        self.props = props
        self.keys = tuple(keys)
        self.born_ts = born_ts
        self.dispatch_queues = tuple(dispatch_queues)

    def __repr__(self) -> str:
        return (f"Message(topic={self.topic!r}, body={len(self.body)}B, queue_id={self.queue_id}, "
                f"keys={self.keys!r}, dispatch_queues={self.dispatch_queues!r})")


_SM_FIELDS = ("topic", "body", "props", "queue_id", "flags", "queue_offset", "phys_offset", "size",
              "born_ts", "store_ts", "msg_id", "keys", "dispatch_queues")
_SM_QOFF = _SM_FIELDS.index("queue_offset")   # with_queue_offset() replaces this slot


class StoredMessage(namedtuple("_StoredMessageBase", _SM_FIELDS)):
    """A record read back from the CommitLog (CRC verified). Immutable.

    A named tuple (built with `tuple.__new__` by the decoder) rather than a slotted class: reading
    is on the delivery hot path, and immutability lets the light-queue cache hand one decoded
    object to every reader instead of copying it per reader (a reader that needs another
    `queue_offset` gets a new tuple via `with_queue_offset`, sharing topic/body/props). The
    positional constructor and attribute names are unchanged; attributes cannot be assigned."""

    __slots__ = ()

    def with_queue_offset(self, queue_offset: int) -> "StoredMessage":
        """This message with another `queue_offset` (payload objects shared, nothing copied)."""
        i = _SM_QOFF
        if self[i] == queue_offset:
            return self
        return tuple.__new__(StoredMessage, self[:i] + (queue_offset,) + self[i + 1:])

    def __repr__(self) -> str:
        return (f"StoredMessage(topic={self.topic!r}, phys_offset={self.phys_offset}, size={self.size}, "
                f"queue_offset={self.queue_offset}, body={len(self.body)}B)")


_DR_FIELDS = ("phys_offset", "size", "topic", "queue_id", "queue_offset", "flags", "born_ts", "store_ts",
              "tags_code", "keys", "dispatch_queues")


class DispatchRequest(namedtuple("_DispatchRequestBase", _DR_FIELDS)):
    """One record as the dispatch stage hands it to every dispatcher (no body, no props).

    A named tuple rather than a slotted class: the dispatch stage builds one per record with
    `tuple.__new__` (no Python-level __init__), which measured about 3x cheaper; attributes are
    read by name exactly as with slots, and the positional constructor is unchanged."""

    __slots__ = ()

    def __repr__(self) -> str:
        return (f"DispatchRequest(phys_offset={self.phys_offset}, size={self.size}, topic={self.topic!r}, "
                f"queue_id={self.queue_id}, queue_offset={self.queue_offset})")


class AppendResult(namedtuple("_AppendResultBase", ("phys_offset", "size", "queue_offset", "durable", "ident"))):
    """Where one appended record landed. `durable` (a concurrent.futures.Future) resolves to the end
    offset it covers when the record is durable under the flush mode's promise; a batch shares one
    future. `msg_id` = store identity + physical offset (hex). A named tuple, built without a
    Python-level __init__ because the append path creates one per message."""

    __slots__ = ()

    @property
    def msg_id(self) -> str:
        return f"{self.ident}{self.phys_offset:016X}"

    def __repr__(self) -> str:
        return f"AppendResult(phys_offset={self.phys_offset}, size={self.size}, queue_offset={self.queue_offset})"


_SHARED_CONDITION = threading.Condition()


class ResolvedFuture(Future):
    """A `concurrent.futures.Future` born resolved, for the async modes' `durable`.

    `Future.__init__` allocates a `threading.Condition`, the largest single cost of a one-message
    append in async mode. A future that is already finished is never waited on, so it can share
    one condition (its lock is only taken briefly by result()/add_done_callback). Relies on the
    documented-by-source fields of Future (_state, _result, ...), stable since Python 3.8."""

    def __init__(self, value) -> None:  # noqa: D401 - deliberately not calling super().__init__
        self._condition = _SHARED_CONDITION
        self._state = "FINISHED"
        self._result = value
        self._exception = None
        self._waiters = []
        self._done_callbacks = []

    # Born finished and never changed: answered without taking the (shared) condition, which
    # Future's own methods take on every call (~0.4 us each; the gateway asks done() and
    # exception() once per publish batch).
    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def running(self) -> bool:
        return False

    def exception(self, timeout=None):
        return self._exception

    def result(self, timeout=None):
        if self._exception is not None:
            raise self._exception
        return self._result


# ---------------------------------------------------------------------------- columnar batches
# What one append call hands to dispatch and to its caller, kept as columns instead of one
# DispatchRequest + one AppendResult tuple per record: for batches of one topic those per-record
# tuples were ~40 % of the appender's time for small messages, and because they stay alive until
# dispatch (and until the caller drops its results) the cyclic GC scanned them again and again.
#
# A *chunk* is `(sizes, starts, runs, keyed, cq)` for the records of one append call, always all
# five (append_batch and append_one build the same shape; read them by the CHUNK_* names below):
#   sizes   list[int], the total record size of each record, in CommitLog order;
#   runs    list[DispatchRequest], the first record of each *run*: records that share every field
#           but phys_offset (each starts where the previous ends), size and queue_offset (+1 each);
#   starts  list[int], the index into sizes of each run's first record. A run ends where the next
#           starts (or at len(sizes));
#   keyed   whether any record carries keys (the key index skips the chunk otherwise);
#   cq      None, or {(first-level topic, queue_id): [first queue offset, bytearray of packed
#           ConsumeQueue entries]} when the C encoder (store/_append.c) packed them while
#           encoding: the ConsumeQueue dispatcher then copies one block per queue instead of
#           packing an entry per record on the dispatch thread.
# Appends of one topic/queue give one run per call; appends whose every record differs (many
# topics) give one run per record, whose DispatchRequests are then exactly `runs`.

_DR_new = tuple.__new__

# Positions in a chunk (above). CommitLog builds the tuple positionally (its columns come from the
# encoder, C or Python); readers index it with these names, bound to locals before a loop over
# chunks (a live hand-off of single-record appends is one chunk per record).
CHUNK_SIZES, CHUNK_STARTS, CHUNK_RUNS, CHUNK_KEYED, CHUNK_CQ = range(5)
# Positions in a DispatchRequest, for code that reads it by index in per-record loops (attribute
# access works everywhere else). Of the C loops, store/_append.c (which builds them) checks
# `DispatchRequest._fields` against the order it fills at configure(); lightqueue/_take.c (which
# reads them) is handed these DR_* positions instead (lightqueue/take.py TAKE_LAYOUT).
(DR_PHYS, DR_SIZE, DR_TOPIC, DR_QUEUE_ID, DR_QUEUE_OFFSET, DR_FLAGS, DR_BORN_TS, DR_STORE_TS, DR_TAGS_CODE,
 DR_KEYS, DR_DISPATCH_QUEUES) = range(11)
assert _DR_FIELDS[DR_STORE_TS] == "store_ts" and _DR_FIELDS[DR_DISPATCH_QUEUES] == "dispatch_queues"

# The fields of one recently appended record as the CommitLog keeps them for read() (keep_recent):
# what a StoredMessage holds but its phys_offset (the key they are kept under) and msg_id (made
# from it), so read() rebuilds the StoredMessage without decoding. A plain tuple, not a named one:
# the encoders build one per record (a tuple display is the cheapest object there is), and read()
# unpacks it into named locals (one unpack is cheaper than indexing). So the order is written out
# in four places and tied to this one: the C encoder receives RECENT_FIELDS in its layout
# (store.encoding.LAYOUT) and refuses any other order than the one it fills (store/_append.c);
# commitlog.py checks at import that read() unpacks in this order; the two Python writers
# (encoding.encode_py, CommitLog.append_one) are checked against it by
# tests/store/test_encoding.py. RF_* are the positions by name, for code that indexes the tuple.
RECENT_FIELDS = ("topic", "body", "props", "queue_id", "queue_offset", "flags", "size", "born_ts", "store_ts",
                 "keys", "dispatch_queues")
(RF_TOPIC, RF_BODY, RF_PROPS, RF_QUEUE_ID, RF_QUEUE_OFFSET, RF_FLAGS, RF_SIZE, RF_BORN_TS, RF_STORE_TS, RF_KEYS,
 RF_DISPATCH_QUEUES) = map(RECENT_FIELDS.index, ("topic", "body", "props", "queue_id", "queue_offset", "flags",
                                                 "size", "born_ts", "store_ts", "keys", "dispatch_queues"))
assert set(RECENT_FIELDS) == set(_SM_FIELDS) - {"phys_offset", "msg_id"}


def _chunk_requests(chunk, out: list) -> None:
    """Append the DispatchRequests of one chunk to `out`."""
    sizes, starts, runs = chunk[CHUNK_SIZES], chunk[CHUNK_STARTS], chunk[CHUNK_RUNS]
    nr = len(runs)
    if nr == len(sizes):
        out += runs
        return
    new = _DR_new
    DR = DispatchRequest
    append = out.append
    for k in range(nr):
        r = runs[k]
        append(r)
        i1 = starts[k + 1] if k + 1 < nr else len(sizes)
        i0 = starts[k]
        if i1 - i0 > 1:
            phys, sz, topic, qid, qoff, flags, born, sts, tags, keys, dq = r
            for i in range(i0 + 1, i1):
                phys += sz
                qoff += 1
                sz = sizes[i]
                append(new(DR, (phys, sz, topic, qid, qoff, flags, born, sts, tags, keys, dq)))


class DispatchBatch:
    """The records of one delivery, as the chunks of the append calls they came from.

    It is what `Dispatcher.dispatch` receives from the live hand-off. To a dispatcher that iterates
    it behaves as the list of `DispatchRequest` it stands for (len, index, slice, iteration; the
    tuples are built once, on first use, and shared by every such dispatcher). The built-in
    dispatchers read `chunks` directly."""

    __slots__ = ("chunks", "count", "_items")

    def __init__(self, chunks: list, count: int) -> None:
        self.chunks = chunks
        self.count = count
        self._items: list | None = None

    def requests(self) -> list:
        items = self._items
        if items is None:
            chunks = self.chunks
            if len(chunks) == 1 and len(chunks[0][CHUNK_RUNS]) == len(chunks[0][CHUNK_SIZES]):
                items = chunks[0][CHUNK_RUNS]
            else:
                items = []
                for c in chunks:
                    _chunk_requests(c, items)
            self._items = items
        return items

    def has_keys(self) -> bool:
        keyed = CHUNK_KEYED
        for c in self.chunks:
            if c[keyed]:
                return True
        return False

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    def __iter__(self):
        return iter(self.requests())

    def __getitem__(self, i):
        return self.requests()[i]

    def __eq__(self, other) -> bool:
        if isinstance(other, DispatchBatch):
            other = other.requests()
        return self.requests() == other

    __hash__ = None

    def __repr__(self) -> str:
        return f"DispatchBatch({self.count} records)"


class AppendResults:
    """The `list[AppendResult]` of one append_batch call, built on demand.

    Length, `[-1]` and `[0]` (what most callers read: the last record's end and durable future)
    are answered from the columns; anything else builds the list of AppendResult tuples once.
    Behaves like a list for reading: len, index, slice (returns a list), iteration, ==, + ."""

    __slots__ = ("_chunk", "_fut", "_ident", "_end", "_items")

    def __init__(self, chunk, fut, ident: str, end: int) -> None:
        self._chunk = chunk
        self._fut = fut
        self._ident = ident
        self._end = end
        self._items: list | None = None

    def _list(self) -> list:
        items = self._items
        if items is None:
            chunk = self._chunk
            sizes, starts, runs = chunk[CHUNK_SIZES], chunk[CHUNK_STARTS], chunk[CHUNK_RUNS]
            fut = self._fut
            ident = self._ident
            new = _DR_new
            AR = AppendResult
            at_phys, at_size, at_qoff = DR_PHYS, DR_SIZE, DR_QUEUE_OFFSET
            nr = len(runs)
            if nr == len(sizes):
                items = [new(AR, (r[at_phys], r[at_size], r[at_qoff], fut, ident)) for r in runs]
            else:
                items = []
                append = items.append
                for k in range(nr):
                    r = runs[k]
                    phys = r[at_phys]
                    qoff = r[at_qoff]
                    for i in range(starts[k], starts[k + 1] if k + 1 < nr else len(sizes)):
                        sz = sizes[i]
                        append(new(AR, (phys, sz, qoff, fut, ident)))
                        phys += sz
                        qoff += 1
            self._items = items
        return items

    def __len__(self) -> int:
        return len(self._chunk[CHUNK_SIZES])

    def __getitem__(self, i):
        if self._items is None and type(i) is int:
            chunk = self._chunk
            sizes, starts, runs = chunk[CHUNK_SIZES], chunk[CHUNK_STARTS], chunk[CHUNK_RUNS]
            n = len(sizes)
            if i == -1 or i == n - 1:
                r = runs[-1]
                sz = sizes[-1]
                return _DR_new(AppendResult, (self._end - sz, sz, r[DR_QUEUE_OFFSET] + (n - 1 - starts[-1]),
                                              self._fut, self._ident))
            if i == 0 or i == -n:
                r = runs[0]
                return _DR_new(AppendResult, (r[DR_PHYS], r[DR_SIZE], r[DR_QUEUE_OFFSET], self._fut, self._ident))
        return self._list()[i]

    def __iter__(self):
        return iter(self._list())

    def __reversed__(self):
        return reversed(self._list())

    def __contains__(self, x) -> bool:
        return x in self._list()

    def index(self, x, *args) -> int:
        return self._list().index(x, *args)

    def count(self, x) -> int:
        return self._list().count(x)

    def __eq__(self, other) -> bool:
        if isinstance(other, AppendResults):
            other = other._list()
        return self._list() == other

    __hash__ = None

    def __add__(self, other) -> list:
        return self._list() + list(other)

    def __radd__(self, other) -> list:
        return list(other) + self._list()

    def __repr__(self) -> str:
        return repr(self._list())


def _register_sequences() -> None:
    Sequence.register(DispatchBatch)
    Sequence.register(AppendResults)


_register_sequences()
