"""StoreServer: a `MessageStore` served over the native protocol (docs/protocol.md), asyncio.

One `StoreConnection` (asyncio.Protocol, server/connection.py) per client: bytes go through the sans-IO
`protocol.FrameDecoder`; each frame is answered with a frame carrying the same request id, so a
client may pipeline (replies to PRODUCE come when the batch is durable and can overtake others).

Extension without imports the wrong way: `store/` knows nothing of light queues, so
`store/node/sdk_service.py` plugs them in through
  `server.router`           topic -> dispatch queues for every produced message (MQTT filters),
  `server.filter_pull`      handler of PULL_FILTER,
  `server.register_call()`  extra CALL commands (filter registration, filter offsets).

Bad input: a malformed body gets an ERROR frame and the connection goes on; an oversized or
unparsable length, or a request before HELLO / a bad token, gets an ERROR frame and a close. A
PRODUCE is decoded completely before anything of it is appended, so a bad one stores nothing.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any, Callable

from .. import protocol as W
from ..errors import InvalidTopic, is_disk_full
from ..fastpath import RawRecord, find_batch, raw_chunks
from ..loopback import is_loopback  # the one loopback rule (store/loopback.py)
from ..pop import PopManager, dlq_topic
from ..produce import produce_messages, produced_body
from ..sdk_meta import TOPIC_GROUP, SdkMetadata, cq_key
from ..unique_keys import UniqueKeys
from .calls import F_SDK_CLIENT, META_THEN, META_WRITES, CallError, Messages, RawMessages, raw_messages_head
from .connection import StoreConnection

__all__ = ["F_SDK_CLIENT", "META_THEN", "META_WRITES", "CallError", "Messages", "RawMessages", "StoreConnection",
           "StoreServer", "raw_messages_head"]

log = logging.getLogger("lmqtt.store.server")


class StoreServer:
    def __init__(self, store, meta_path: str, *, host: str = "127.0.0.1", port: int = W.DEFAULT_PORT,
                 token: str | None = None, max_frame: int = W.DEFAULT_MAX_FRAME,
                 persist_interval: float = 0.1) -> None:
        if not is_loopback(host) and not token:
            raise ValueError(f"refusing to listen on non-loopback address {host!r} without an auth "
                             "token (--token or `token` in the config)")
        self.store = store
        self.host, self.port = host, port
        self.token = token
        self.max_frame = max_frame
        budget = getattr(store, "budget", None)
        self.meta = SdkMetadata(meta_path, budget.rocksdb_tables if budget is not None else -1)
        self.pop = PopManager(store, self.meta)
        self.unique = UniqueKeys(store)      # PRODUCE flag F_UNIQUE_KEYS (store/unique_keys.py)
        self.router: Callable[[str], tuple] | None = None
        self.filter_pull: Callable[..., Messages] | None = None
        self.filter_max_offset: Callable[[str], int] | None = None
        self.calls: dict[str, Callable[[dict], Any]] = {}
        # more fields of HELLO_OK, set by what plugs in: the gateway protocol the node speaks (0:
        # none, store/node/gateway_service.py sets its version), so a gateway can refuse a store
        # that does not serve it before it sends anything (store/node/protocol.py `peer_refusal`)
        self.hello_info: dict[str, Any] = {"gateway_protocol": 0}
        self._conn_calls: set[str] = set()     # CALLs whose handler also gets the StoreConnection
        # fn(connection) when a client connection goes away (e.g. drop its event watch)
        self.on_connection_lost: list[Callable[["StoreConnection"], None]] = []
        # fn() after the frames of one read were handled, before their replies are written (with
        # inline dispatch: deliver the notify events the appends raised, in the same callback)
        self.after_frames: list[Callable[[], None]] = []
        self.connections: set["StoreConnection"] = set()
        self.server: asyncio.base_events.Server | None = None
        self.address: tuple[str, int] | None = None
        self._persist_interval = persist_interval
        self._timer: asyncio.TimerHandle | None = None
        self._persist_failures = 0      # POP state writes failed in a row (logged once per episode)
        self.frames = 0
        self.errors = 0
        self.disk_full_refusals = 0     # requests answered disk_full (each also counted in errors)
        self.meta_full = False          # a write of the SDK metadata failed for lack of space
        # store/ha: `guard(op, cmd)` runs before every request after HELLO (cmd: a CALL's name, else
        # None) and raises CallError to refuse it (a replica answers not_primary); None = serve all
        self.guard: Callable[[int, str | None], None] | None = None
        self.serve_delayed = True       # start() turns the store's timer wheel on (off on a group member)
        self._register_builtin()

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: StoreConnection(self), self.host, self.port,
                                               reuse_address=True, backlog=512)
        self.address = self.server.sockets[0].getsockname()[:2]
        self._loop = loop
        # delayed messages (PRODUCE flag F_DELAYED, CALL cancel_delayed): the timer wheel fires
        # on this loop, routed like a produced message (an embedded gateway may have enabled it)
        enable = getattr(self.store, "enable_delayed", None)
        if enable is not None and self.serve_delayed:
            enable(self.router, loop)
        self._tick()

    def _tick(self) -> None:
        self._timer = None
        try:
            self.pop.persist()
        except Exception as e:  # noqa: BLE001 - retried next tick; logged once per episode
            # retried every tick (10 a second): a full disk would log each one
            if not self._persist_failures:
                log.error("event=pop_persist_failed error=%r (retried until it succeeds; logged once)", e)
            self._persist_failures += 1
        else:
            if self._persist_failures:
                log.info("event=pop_persist_resumed failed_attempts=%d", self._persist_failures)
                self._persist_failures = 0
        if self.pop.dirty:
            self._arm_persist()
        self.pop.on_dirty = self._arm_persist   # armed by the next change only: an idle store sleeps

    def _arm_persist(self) -> None:
        if self._timer is None and self._loop is not None:
            self._timer = self._loop.call_later(self._persist_interval, self._tick)

    async def stop(self) -> None:
        self.pop.on_dirty = None
        if self._timer is not None:
            self._timer.cancel()
        if self.server is not None:
            self.server.close()
        for c in list(self.connections):
            c.transport.close()
        # on a full disk RocksDB refuses these writes (and its close, "Writer has previous error"):
        # one line each, and the stop goes on - the store still has to close its files
        for what, fn in (("saving the POP state", self.pop.persist), ("closing the SDK metadata", self.meta.close)):
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                if not is_disk_full(e) and "previous error" not in str(e):
                    raise
                log.error("event=store_server_stop_failed step=%r error=%r (disk full: what it did not write "
                          "is what a producer's retry or a consumer's re-read covers)", what, str(e)[:200])

    def register_call(self, name: str, fn: Callable[..., Any], with_connection: bool = False) -> None:
        """Add a CALL command: `fn(args) -> dict | Messages`, may raise CallError/ValueError/KeyError.
        A handler that must wait returns an asyncio future of that instead (answered when done).
        `with_connection`: called as `fn(args, connection)`, for commands that keep per-connection
        state (an event watch answered later with `connection.push`)."""
        self.calls[name] = fn
        if with_connection:
            self._conn_calls.add(name)
        else:
            self._conn_calls.discard(name)

    def takes_connection(self, name: str) -> bool:
        """CALL `name`'s handler is called with the connection too (`register_call(with_connection=True)`)."""
        return name in self._conn_calls

    # ---------------------------------------------------------------- produce
    def produce(self, body: bytes, flags: int = 0):
        """Decode, dedup, route and append one PRODUCE. -> (PRODUCED body, durable future or None,
        duplicate flag). With F_DELAYED, messages with a due time are parked in the timer wheel
        (store/delayed.py) in the same append; their timers are written before the reply.
        With F_SDK_CLIENT (set by an SDK client's connection, never on the wire): a topic starting
        with '$' is refused (InvalidTopic, nothing of the batch written), see `_client_route`."""
        # No cyclic GC pass while a batch's Message objects exist: each would scan all of them (and
        # promote them) for nothing; they are freed by reference count right after the append.
        # Dedup across a crash: a pending marker (log position, count) is written before the
        # append and replaced by the results after it, so a retry of a batch whose first attempt
        # died in between finds the batch in the log instead of storing it twice (find_batch).
        gc_on = gc.isenabled()
        gc.disable()
        try:
            dues = parked = None
            if flags & W.F_DELAYED:
                body, dues = W.split_due_trailer(body)
            pid, seq, msgs = produce_messages(body, self._client_route if flags & F_SDK_CLIENT else self.router,
                                              int(time.time() * 1000))
            if dues is not None and any(dues):
                delayed = self.store.delayed
                if delayed is None:
                    raise CallError(W.E_INVALID, "this store does not serve delayed messages")
                msgs, parked = delayed.park(msgs, dues)      # DelayError (ValueError): nothing stored
            if pid and seq:
                prev = self.meta.seen(pid, seq)
                if prev is not None:
                    pending = self.meta.pending(prev)
                    if pending is None:
                        return prev or W.encode_produced([]), None, True
                    # the first attempt died between its pending marker and its results: stored?
                    found = find_batch(self.store, pending[0], msgs) if pending[1] == len(msgs) else None
                    if found is not None:
                        if parked:       # the timers may not have been written: again, once each
                            delayed.rearm([p for p, _q in found], parked, dues)
                        out = W.encode_produced(found)
                        self._remember(pid, seq, out)
                        log.info("event=produce_retry_found producer=%s seq=%d messages=%d", pid, seq, len(msgs))
                        return out, None, True
                if msgs:
                    self.meta.begin(pid, seq, self.store.clog.wrote, len(msgs))
            if not msgs:
                return W.encode_produced([]), None, False
            if flags & W.F_UNIQUE_KEYS:
                return self._produce_unique(pid, seq, msgs, parked, dues)
            rs = self.store.append_batch(msgs)
            if parked:
                delayed.arm(rs, parked, dues)
            out = produced_body(rs)
            if pid and seq:
                self._remember(pid, seq, out)
            del msgs
        finally:
            if gc_on:
                gc.enable()
        return out, rs[-1].durable, False

    def _produce_unique(self, pid: str, seq: int, msgs: list, parked, dues):
        """The append of a PRODUCE sent with F_UNIQUE_KEYS (store/unique_keys.py): a message whose
        (topic, first key) the store holds already is answered with that record's offsets and not
        written. Nothing appended: the answer waits until that earlier record is durable."""
        keep, dups = self.unique.split(msgs, set(parked) if parked else ())
        offs: list[tuple[int, int]] = []
        durable = None
        if keep:
            rs = self.store.append_batch(keep)
            if parked:      # the timers by the batch's own indexes (parked messages are all kept)
                kept = [i for i in range(len(msgs)) if i not in dups]
                self.store.delayed.arm({i: rs[k] for k, i in enumerate(kept)}, parked, dues)
            offs = [(r.phys_offset, r.queue_offset) for r in rs]
            self.unique.appended(keep, offs)
            durable = rs[-1].durable
        out = W.encode_produced(self.unique.merge(len(msgs), offs, dups))
        if pid and seq:
            self._remember(pid, seq, out)
        if dups:
            log.info("event=produce_unique_key_stored_already messages=%d appended=%d", len(dups), len(keep))
        if durable is None:
            durable = self._durable_after(max(d[0] for d in dups.values() if not isinstance(d, int)))
            return out, durable, True
        return out, durable, False

    def _remember(self, pid: str, seq: int, out: bytes) -> None:
        """Remember a producer's batch result after its append. On a full metadata disk the batch
        is stored all the same and the reply says so (it is): a retry finds it through begin()'s
        pending marker, or by its unique keys; any other error is the caller's."""
        try:
            self.meta.remember(pid, seq, out)
        except Exception as e:  # noqa: BLE001 - only a full disk is survivable here
            if not is_disk_full(e):
                raise
            self.store.clog.disk.write_failed(META_WRITES, e, META_THEN)
            self.meta_full = True
        else:
            if self.meta_full:      # the metadata is written again: part of the episode ends
                self.meta_full = False
                self.store.clog.disk.write_ok(META_WRITES)

    def _durable_after(self, phys: int):
        """A future resolved once the record at `phys` is durable, or None if it is already or
        the flush mode answers appends once written (async)."""
        clog = self.store.clog
        commits = clog.group_commit
        if commits is None:
            return None
        with clog.lock:
            if clog.flushed > phys:
                return None
            fut = commits.current
        commits.wake()
        return fut

    def _client_route(self, topic: str) -> tuple:
        """`router` for an SDK client's PRODUCE (called once per distinct topic of a batch): '$'
        topics belong to the broker and the store - `$SYS/...` would reach MQTT subscribers as the
        broker's own statistics, `$timer` is the queue of parked delayed messages. The store's own
        appends ($timer parking, POP, tier, replication) do not come through PRODUCE; a gateway's
        link (HELLO client "lmqtt-gateway ...") keeps its MQTT rules (gateway/broker/broker.py)."""
        if topic[:1] == "$":
            raise InvalidTopic(f"topic {topic!r}: topics starting with '$' belong to the broker and the store "
                               f"($SYS, $timer ...); clients may not publish there (as over MQTT)")
        return self.router(topic) if self.router is not None else ()

    # ---------------------------------------------------------------- built-in CALLs
    def _register_builtin(self) -> None:
        s = self.store
        meta = self.meta

        def qkey(a: dict) -> tuple[str, int | None]:
            if "filter" in a:
                return "lq\0" + str(a["filter"]), None
            return cq_key(str(a["topic"]), int(a.get("queue_id", 0))), None

        def max_of(key: str) -> int:
            kind, _, rest = key.partition("\0")
            if kind == "lq":
                return self.filter_max_offset(rest) if self.filter_max_offset else 0
            topic, _, qid = rest.rpartition("\0")
            return s.consume_queue_offsets(topic, int(qid))[1]

        def commit(a):
            k, _ = qkey(a)
            meta.commit(str(a["group"]), k, int(a["offset"]))
            return {"ok": True}

        def committed(a):
            k, _ = qkey(a)
            return {"offset": meta.committed(str(a["group"]), k)}

        def lag(a):
            out = []
            for k, off in meta.group_offsets(str(a["group"])).items():
                kind, _, rest = k.partition("\0")
                mx = max_of(k)
                if kind == "lq":
                    out.append({"filter": rest, "committed": off, "max_offset": mx, "lag": max(0, mx - off)})
                else:
                    topic, _, qid = rest.rpartition("\0")
                    out.append({"topic": topic, "queue_id": int(qid), "committed": off, "max_offset": mx,
                                "lag": max(0, mx - off)})
            return {"group": a["group"], "queues": out}

        def offsets(a):
            lo, hi = s.consume_queue_offsets(str(a["topic"]), int(a.get("queue_id", 0)))
            return {"min_offset": lo, "max_offset": hi}

        def topics(_a):
            return {"queues": [{"topic": t, "queue_id": q, "max_offset": m}
                               for (t, q), m in sorted(s.consume_queues.max_offsets().items())]}

        def stats(_a):
            st = dict(s.stats())
            st.update(connections=len(self.connections), frames=self.frames, errors=self.errors,
                      disk_full_refusals=self.disk_full_refusals, groups=meta.groups())
            return st

        def by_msg_id(a):
            m = s.get_by_msg_id(str(a["msg_id"]))
            return Messages({}, [m] if m is not None else [])

        def by_key(a):
            now = int(time.time() * 1000)
            ms = s.query_by_key(str(a["topic"]), str(a["key"]), int(a.get("begin_ms", 0)),
                                int(a.get("end_ms", now)), int(a.get("max_count", 32)))
            return Messages({}, ms)

        def offset_for_time(a):
            """First queue offset whose store time is >= ts (binary search over the ConsumeQueue)."""
            topic, qid, ts = str(a["topic"]), int(a.get("queue_id", 0)), int(a["ts"])
            lo, hi = s.consume_queue_offsets(topic, qid)
            while lo < hi:
                mid = (lo + hi) // 2
                m = s.read_consume_queue(topic, qid, mid, 1)
                if not m:       # not visible / gone: treat as "later"
                    hi = mid
                elif m[0].store_ts < ts:
                    lo = m[0].queue_offset + 1
                else:
                    hi = mid
            return {"offset": lo}

        def pop(a):
            g, t, q = str(a["group"]), str(a["topic"]), int(a.get("queue_id", 0))
            raw = bool(a.get("raw"))        # the client reads the raw layout (docs/protocol.md)
            ms, att, dead = self.pop.pop(g, t, q, int(a.get("max_count", 32)), int(a.get("invisible_ms", 30_000)),
                                         int(a.get("max_attempts", 16)), raw)
            header = {"attempts": att, "dead_lettered": dead}
            if raw:
                if all(type(m) is RawRecord for m in ms):
                    return RawMessages(header, len(ms), raw_chunks(ms))
                ms = [m.message(s.ident) if type(m) is RawRecord else m for m in ms]
            return Messages(header, ms)

        def ack(a):
            n = self.pop.ack(str(a["group"]), str(a["topic"]), int(a.get("queue_id", 0)), a["offsets"])
            return {"acked": n}

        def change_invisible(a):
            ok = self.pop.change_invisible_time(str(a["group"]), str(a["topic"]), int(a.get("queue_id", 0)),
                                                int(a["offset"]), int(a["invisible_ms"]))
            return {"ok": ok}

        def pop_info(a):
            info = self.pop.info(str(a["group"]), str(a["topic"]), int(a.get("queue_id", 0)))
            info["dlq_topic"] = dlq_topic(str(a["group"]))
            return info

        def cancel_delayed(a):
            d = getattr(s, "delayed", None)
            if d is None:
                raise CallError(W.E_INVALID, "this store does not serve delayed messages")
            return {"cancelled": d.cancel(str(a["msg_id"]))}

        self.register_call("cancel_delayed", cancel_delayed)

        # several store groups in one deployment (docs/groups.md): the first group of a client's
        # `--store` list keeps which group owns each first-level topic, in its SDK metadata
        # (replicated like a group offset). A claim is put-if-absent, so every client that asks
        # about a topic gets the one owner the first claim recorded, whoever asked first.
        def topic_groups(_a):
            return {"topics": {k[len(TOPIC_GROUP):]: (meta.get_json(k) or {}).get("group")
                               for k in meta.keys_with_prefix(TOPIC_GROUP)}}

        def topic_group_claim(a):
            topic, group = str(a.get("topic") or ""), str(a.get("group") or "")
            if not topic or "/" in topic or "+" in topic or "#" in topic:
                raise CallError(W.E_INVALID, f"a topic group is claimed for a first-level topic, got {topic!r}")
            if not group:
                raise CallError(W.E_INVALID, "topic_group_claim needs the owning group's name")
            key = TOPIC_GROUP + topic
            held = meta.get_json(key)
            if held is not None:
                return {"group": held["group"], "claimed": False}
            meta.put_json(key, {"group": group, "ms": int(time.time() * 1000)})
            return {"group": group, "claimed": True}

        self.register_call("topic_groups", topic_groups)
        self.register_call("topic_group_claim", topic_group_claim)
        # tiered storage (store/tier): what is local, uploading, in the tier (lmqtt admin --tier)
        self.register_call("tier", lambda _a: {"tier": s.tier_stats() if hasattr(s, "tier_stats") else None})
        for name, fn in (("commit", commit), ("committed", committed), ("lag", lag), ("offsets", offsets),
                         ("topics", topics), ("stats", stats), ("get_by_msg_id", by_msg_id),
                         ("query_by_key", by_key), ("offset_for_time", offset_for_time), ("pop", pop),
                         ("ack", ack), ("change_invisible_time", change_invisible), ("pop_info", pop_info)):
            self.register_call(name, fn)
