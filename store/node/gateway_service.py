"""The store side of the remote gateway seam: what `lmqtt gateway` (gateway/storage/remote_store.py)
asks the store node for, plugged into the `StoreServer` like sdk_service.py. Every command is a
CALL whose request and reply types are in store/node/protocol.py (docs/protocol.md "Remote
gateways"); `GatewayService` answers each with its method of the same name (`gw_watch`, ...),
registered from the protocol's registry, and says in HELLO_OK which gateway protocol it speaks.
What the commands are for:

  the delivery path      gw_watch (EVENT / PUSH / PUSH_RAW frames from now on, and the queues' max
                         offsets, in one step on the loop: no append falls between them; with
                         `start`, that step once the dispatch is through: a SUBSCRIBE's watch
                         and start offset in one request), gw_unwatch, gw_max_offsets (the safety poll), gw_start_offsets (max
                         offsets once every message acknowledged before is dispatched: where a new
                         subscription starts), gw_pull (with each entry's dispatch queues, "dq"),
                         gw_group_pop / gw_group_ack / gw_group_renew (shared groups balanced
                         over the fleet: each message handed to one gateway, group_assign.py)
  from the past          gw_replay, gw_replay_read (lightqueue/replay.py `plan`, `read_history`)
  filter holds           gw_register, gw_unregister, gw_filters: wildcard filter registrations
                         held per gateway id, persisted (a gateway that restarts with the same id
                         reconciles exactly its own); gw_holders, gw_release_gateway (lmqtt admin)
  session metadata       gw_put/get/delete/list_sessions, gw_get_offset(s), gw_set/delete_offsets,
                         gw_set_retained, gw_retained_matching, gw_clear_retained_if, gw_flush: the
                         remote side of the gateway's sessions, offsets and retained facades
                         (gateway/storage/facades.py) over the light queues' `MetadataStore`
  who is who, wills      gw_hello (this connection is gateway G; answers the wills published and
                         the sessions swept while G was away: session_sweep.py), gw_claim_sessions,
                         gw_put_will, gw_pop_will, gw_void_wills, gw_take_wills,
                         gw_list_wills

Wills of a dead gateway, and which connection is which gateway: gateway_wills.py.

Events: the light-queue store's listener feeds an `InProcessBus` on the server's loop (from the
dispatch thread, names merging within `window_s`; or, with inline dispatch, on the loop itself,
delivered right after the frames that appended them: `StoreServer.after_frames`); each merged set
goes to every watching connection as one frame holding only the queues it watches:
  * EVENT {queue: max offset}, or
  * PUSH (`gw_watch {push: true}`): the same offsets plus the new entries themselves, read once per
    (queue, offset) however many connections get them, from the offset this connection was last
    pushed or pulled to (`push_cursors`), at most `push_max_count` entries of a queue and
    `push_max_bytes` per frame (the rest: the gateway pulls, as after an EVENT). The gateway then
    delivers without a `gw_pull` round trip.
  * PUSH_RAW (`gw_watch {push: true, raw: true}`): the same, the entries as the CommitLog's own
    record bytes (`LightQueueStore.pull_raw`: one slice per run of adjacent records, CRC-checked,
    never decoded here), which the gateway decodes in C; decoding them into messages only to
    encode them again was about half of this process's main thread in `serve --workers` fan-in.
Events and pushes are hints: the gateway's safety poll finds anything a lost frame would have
announced, and it keeps only pushed entries that continue its mirror (docs/protocol.md). With a
Redis URL the same names also go to Redis pub/sub (notify/redis_bus.py) for gateways started with
`--redis`.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from lmqtt.lightqueue import replay as replay_mod
from lmqtt.lightqueue.light_queue_store import LightQueueStore
from lmqtt.lightqueue.records import SessionRecord, WillRecord
from lmqtt.lightqueue.topics import validate_filter
from lmqtt.notify import InProcessBus
from lmqtt.store import protocol as W
from lmqtt.store.node import protocol as P
from lmqtt.store.node.gateway_wills import GatewayWills
from lmqtt.store.node.group_assign import GroupAssignments
from lmqtt.store.node.session_sweep import SessionSweep
from lmqtt.store.sdk_meta import SDK_FILTER
from lmqtt.store.server import CallError, Messages, StoreServer
from lmqtt.store.server.calls import RawFrame

log = logging.getLogger("lmqtt.store.node.gateway_service")

# how long the client id claims of the fleet's gateways are gathered before they are relayed
# (`relay_session_claims`): a write per gateway per interval, not per claiming batch
CLAIM_RELAY_S = 0.005
HOLD = "gwf\0"          # SdkMetadata key prefix: gwf \0 gateway id \0 filter -> count


class GatewayService:
    def __init__(self, server: StoreServer, lq: LightQueueStore, loop, window_s: float = 0.002,
                 redis_publisher=None, will_grace_s: float = 5.0,
                 retained_props: Callable[[bytes, int], bytes] | None = None,
                 session_sweep_s: float = 60.0, repair_counts: bool = True) -> None:
        """`repair_counts`: make the light-queue registry agree with the holds now (`load_holds`);
        a store group's member does it when it becomes primary, its metadata being the group's.
        `will_grace_s`: how long a gateway's connection may stay gone before the store publishes
        its wills (and before its sessions count as left by it, session_sweep.py);
        `session_sweep_s`: how often the sessions of gateways gone for good are checked.
        `retained_props(props, now_ms)`: what a retained will keeps as its props (the gateway's
        encoding, passed in by `lmqtt store`: this package knows no MQTT)."""
        self.srv = server
        self.lq = lq
        self.meta = lq.metadata
        self.watchers: dict[object, set[str]] = {}      # StoreConnection -> watched queue names
        # connections that asked for PUSH: queue -> next offset to push (the max offset answered
        # at gw_watch, then moved by every push and by the connection's own gw_pull)
        self.push_cursors: dict[object, dict[str, int]] = {}
        # of those, the ones that read the raw layout (`gw_watch {raw: true}`: OP_PUSH_RAW)
        self.raw_push: set[object] = set()
        self.events_sent = 0           # EVENT and PUSH frames
        self.pushed_entries = 0        # entries carried by PUSH frames
        self.push_read_errors = 0
        self.sessions_moved_told = 0        # SESSIONS_MOVED pushes sent (a session moved to another gateway)
        self.session_claims_relayed = 0     # client id claims relayed to the other gateways (SESSION_CLAIMS)
        self._claims_pending: dict[str, list] = {}   # gateway -> claims gathered for the next relay
        self._claims_flush: asyncio.TimerHandle | None = None
        self.loop = loop
        self.bus = InProcessBus(loop, window_s)
        self.bus.subscribe(self._fan_out)
        # shared groups across the fleet: parked pops are answered when their queue grows
        self.assign = GroupAssignments(lq, loop)
        self.bus.subscribe(self.assign.on_names)
        lq.add_listener(self.bus.publish)
        # inline dispatch raises the names on the loop: push them right after the frames that
        # appended them, before those frames' replies are written
        server.after_frames.append(self.bus.drain)
        self.redis = redis_publisher
        if redis_publisher is not None:
            lq.add_listener(redis_publisher.publish)
        server.on_connection_lost.append(self._lost)
        # filter holds per gateway: rebuilt from the persisted counts, and the light-queue
        # registry's counts made to agree with them
        self.holds: dict[str, dict[str, int]] = {}
        self.load_holds(repair_counts)
        # which connection is which gateway, and the wills of dead ones (gateway_wills.py). The
        # router is looked up at each publish (service.py may install it after this), and the
        # sweep, built next because it asks the wills who is connected, hears of the same
        # gateways going and coming back
        self.wills = GatewayWills(self.meta, loop, grace_s=will_grace_s,
                                  append_batch=server.store.append_batch, append=server.store.append,
                                  route=lambda topic: (server.router or lq.queues_for_topic)(topic),
                                  retained_props=retained_props,
                                  on_gone=lambda gid: self.session_sweep.gone(gid),
                                  on_back=lambda gid: self.session_sweep.back(gid))
        self.wills.start()
        self.session_sweep = SessionSweep(self.meta, loop, self.wills.is_connected,
                                          grace_s=self.wills.grace_s, interval_s=session_sweep_s)
        self.session_sweep.start()
        self._install()

    def close(self) -> None:
        if self._claims_flush is not None:
            self._claims_flush.cancel()
            self._claims_flush = None
        self.assign.close()
        self.wills.close()
        self.session_sweep.close()
        self.lq.remove_listener(self.bus.publish)
        try:
            self.srv.after_frames.remove(self.bus.drain)
        except ValueError:
            pass
        if self.redis is not None:
            self.lq.remove_listener(self.redis.publish)
            self.redis.close()
        self.bus.close()

    # ---------------------------------------------------------------- events
    # entries of one queue per PUSH. Above what one fan-out usually brings (a few hundred at 60,000
    # msg/s): an entry left out makes the gateway pull the rest, and a PUSH sent while that pull is
    # in flight carries the same entries again. At 1,024, `bench compare` fan-in on `serve
    # --workers 2` pulled 299,000 entries beside 592,000 pushed for 602,000 delivered; at 8,192,
    # 7,800 (push_max_bytes still bounds a frame).
    push_max_count = 8192
    push_max_bytes = 1 << 20       # record bytes per PUSH frame; queues beyond it go as hints

    def _fan_out(self, names: set[str]) -> None:
        if not self.watchers:
            return
        offsets: dict[str, int] = {}
        reads: dict[tuple[str, int], list] = {}      # (queue, from offset) -> entries, read once
        raws: dict[tuple[str, int], tuple | None] = {}     # the same as raw records
        for conn, watched in list(self.watchers.items()):
            hit = names & watched if len(names) > len(watched) else {q for q in names if q in watched}
            if not hit:
                continue
            cursors = self.push_cursors.get(conn)
            if cursors is None:
                conn.push(W.OP_EVENT, W.encode_event({q: self._max_offset(offsets, q) for q in hit}))
                self.events_sent += 1
                continue
            # a gateway that does not read its connection gets hints only (bounded like EVENT):
            # it pulls what it missed once it reads again
            budget = 0 if getattr(conn, "write_paused", False) else self.push_max_bytes
            if conn in self.raw_push:
                self._push_raw(conn, hit, cursors, offsets, raws, budget)
                continue
            out = []
            for q in hit:
                v = self._max_offset(offsets, q)
                c = cursors.get(q)
                msgs = ()
                if c is not None and c < v and budget > 0:
                    msgs = self._read_for_push(reads, q, c)
                    if msgs:
                        cursors[q] = msgs[-1].queue_offset + 1
                        budget -= sum([m.size for m in msgs])
                        self.pushed_entries += len(msgs)
                out.append((q, v, msgs))
            conn.push(W.OP_PUSH, W.encode_push(out))
            self.events_sent += 1

    def _push_raw(self, conn, hit, cursors: dict, offsets: dict, raws: dict, budget: int) -> None:
        """One OP_PUSH_RAW frame to `conn` for the queues `hit`: each one's new entries from its
        cursor as record bytes, within `budget` bytes (the rest of the queues: hints)."""
        out = []
        for q in hit:
            v = self._max_offset(offsets, q)
            c = cursors.get(q)
            if c is not None and c < v and budget > 0:
                key = (q, c)
                got = raws.get(key, False)
                if got is False:
                    got = raws[key] = self._read_raw_for_push(q, c)
                if got is not None and got[2]:
                    first, runs, sizes = got
                    cursors[q] = first + len(sizes)
                    budget -= sum(sizes)
                    self.pushed_entries += len(sizes)
                    out.append((q, v, first, runs, sizes))
                    continue
            out.append((q, v, v, (), ()))
        parts = W.encode_push_raw(out)
        conn.push_parts(W.OP_PUSH_RAW, parts)
        self.events_sent += 1

    def _max_offset(self, offsets: dict, q: str) -> int:
        """`q`'s max offset, read once per fan-out (`offsets`) however many connections get it."""
        v = offsets.get(q)
        if v is None:
            v = offsets[q] = self.lq.max_offset(q)
        return v

    def _read_raw_for_push(self, q: str, offset: int):
        try:
            return self.lq.pull_raw(q, offset, self.push_max_count, self.push_max_bytes)
        except Exception as e:  # noqa: BLE001 - a hint only then: the gateway pulls and sees the error
            self.push_read_errors += 1
            log.warning("event=push_read_failed queue=%s offset=%d error=%r (sent as a hint)", q, offset, e)
            return None

    def _read_for_push(self, reads: dict, q: str, offset: int) -> list:
        key = (q, offset)
        msgs = reads.get(key)
        if msgs is None:
            try:
                msgs = self.lq.pull(q, offset, max_count=self.push_max_count, max_bytes=self.push_max_bytes).messages
            except Exception as e:  # noqa: BLE001 - a hint only then: the gateway pulls and sees the error
                self.push_read_errors += 1
                log.warning("event=push_read_failed queue=%s offset=%d error=%r (sent as a hint)", q, offset, e)
                msgs = []
            reads[key] = msgs
        return msgs

    def _lost(self, conn) -> None:
        self.watchers.pop(conn, None)
        self.push_cursors.pop(conn, None)
        self.raw_push.discard(conn)
        self.assign.lost(conn)
        self.wills.detach(conn)

    def tell_session_moved(self, gid: str, client_id: str) -> None:
        """Another gateway wrote or ended the session record that named `gid`: tell `gid`'s
        connections (SESSIONS_MOVED), so that it drops a stale offline copy of the session and
        the copy's wildcard filter holds (else held until that copy's expiry, never for a 3.1.1
        session). A gateway not connected now learns nothing and needs nothing: it reads the
        record when the client comes back, and its restore takes only records naming it."""
        conns = self.wills.connections_of.get(gid)
        if conns:
            body = W.encode_sessions_moved([client_id])
            for conn in list(conns):
                conn.push(W.OP_SESSIONS_MOVED, body)
            self.sessions_moved_told += 1

    def relay_session_claims(self, gid: str, claims: list) -> None:
        """Gateway `gid` attached connections to these client ids (`[[client id, since ms], ...]`):
        tell the connections of every other gateway (SESSION_CLAIMS), the one holding an older
        connection of a client id closes it. The store is the fleet's session directory when the
        gateways have no Redis; it keeps nothing, as Redis pub/sub would not, so a gateway away at
        that moment learns nothing (docs/fleet.md).

        The claims of every gateway are gathered for CLAIM_RELAY_S and sent then, one write per
        connection of each gateway: each claim goes to every other gateway, so sending each batch
        at once cost a write per batch and per gateway, and the store's writes grew with the
        square of a `serve --workers N` fleet's size in a connect storm (with 6 workers, a third
        of the store's loop). A takeover across gateways waits those few milliseconds more."""
        if not claims:
            return
        self._claims_pending.setdefault(gid, []).extend(claims)
        if self._claims_flush is None:
            self._claims_flush = self.loop.call_later(CLAIM_RELAY_S, self._flush_session_claims)

    def _flush_session_claims(self) -> None:
        self._claims_flush = None
        pending, self._claims_pending = self._claims_pending, {}
        frames = {gid: W.frame(W.OP_SESSION_CLAIMS, 0, W.encode_session_claims(gid, claims))
                  for gid, claims in pending.items()}
        for other, conns in list(self.wills.connections_of.items()):
            if not conns:
                continue
            data = b"".join([f for gid, f in frames.items() if gid != other])
            if data:
                for conn in list(conns):
                    conn.push_framed(data)
        self.session_claims_relayed += sum(map(len, pending.values()))

    # ---------------------------------------------------------------- filter holds
    def load_holds(self, repair: bool = True) -> None:
        """Read the gateways' filter holds, and (`repair`) set the light-queue registry's count of
        each held filter to its holders: one per gateway holding it, one for an SDK consumer's registration
        (`f\\0<filter>`, store/node/sdk_service.py).

        Why: a hold is written in the SDK metadata and the count in the light-queue metadata, two
        RocksDBs, so no write covers both. A crash or a full disk between the two left them apart,
        and a count below its holders is lost data: the last unregistration drops the filter and
        its queue while a gateway's subscribers still read it, and they get nothing more. `_hold`
        orders its writes so that a failure leaves a holder too many, never one too few; this
        repairs either at each start (and on a store group's new primary)."""
        holds: dict[str, dict[str, int]] = {}
        for key in self.srv.meta.keys_with_prefix(HOLD):
            gid, _, flt = key[len(HOLD):].partition("\0")
            n = int(self.srv.meta.get_json(key) or 0)
            if n > 0:
                holds.setdefault(gid, {})[flt] = n
        self.holds = holds
        if not repair:
            return
        holders: dict[str, int] = {}
        for fs in holds.values():
            for flt in fs:
                holders[flt] = holders.get(flt, 0) + 1
        for key in self.srv.meta.keys_with_prefix(SDK_FILTER):
            flt = key[len(SDK_FILTER):]
            holders[flt] = holders.get(flt, 0) + 1
        registry = self.lq.registry
        wrong = {f: n for f, n in holders.items() if registry.refcount(f) != n}
        if not wrong:
            return
        for f, n in sorted(wrong.items()):
            log.warning("event=filter_count_repaired filter=%r count=%d holders=%d (the filter holds and the "
                        "light-queue registry were written apart: a crash or a full disk between the two)",
                        f, registry.refcount(f), n)
        try:
            self.lq.set_filter_counts(wrong)
        except Exception as e:  # noqa: BLE001 - held in memory: indexed now, written at the next start
            log.error("event=filter_count_write_failed filters=%d error=%r (the counts hold in memory; the next "
                      "start writes them again)", len(wrong), e)

    def _hold(self, gid: str, flt: str, delta: int) -> int:
        """Change gateway `gid`'s hold on `flt` by `delta` (+1 or -1); returns the hold's count.

        The hold (SDK metadata) and the filter's count in the light-queue registry are two writes.
        Their order makes a failure between them leave the registry counting a holder too many,
        never one too few (`load_holds` says why that matters and repairs it at the next start): a
        first hold registers the filter, then is written (its write failing takes the registration
        back); a hold let go is written, then the filter unregistered. A failed write changes
        nothing here and is raised."""
        mine = self.holds.setdefault(gid, {})
        n = mine.get(flt, 0)
        key = f"{HOLD}{gid}\0{flt}"
        if delta > 0:
            if n == 0:
                self.lq.register_filter(flt)
                try:
                    self.srv.meta.put_json(key, 1)
                except BaseException:
                    self._unregister(flt, gid)
                    raise
            else:
                self.srv.meta.put_json(key, n + 1)
            n += 1
        elif n > 0:
            self.srv.meta.put_json(key, n - 1)
            n -= 1
            if n == 0:
                self._unregister(flt, gid)
        if n:
            mine[flt] = n
        else:
            mine.pop(flt, None)
        return n

    def _unregister(self, flt: str, gid: str) -> None:
        """One holder less in the registry; a failure is logged, not raised: the hold is already
        as it should be, the registry counts one holder too many until the next start."""
        try:
            self.lq.unregister_filter(flt)
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.error("event=filter_unregister_failed filter=%r gateway=%s error=%r (its queue is kept, counted "
                      "with one holder too many until the store's next start)", flt, gid, e)

    def release_gateway(self, gid: str) -> dict:
        """Drop the filter holds of gateway id `gid`, one that is gone for good (an operator's
        call: e.g. the pod names a Deployment rollout retired). Refused while `gid` is connected.
        A filter a persistent session's record uses is kept when `gid` is its only holder: that
        session may have been created on `gid`, after the other gateways restored theirs, and its
        messages must keep being indexed until it comes back."""
        if self.wills.is_connected(gid):
            raise CallError(W.E_INVALID, f"gateway {gid!r} is connected: its holds are in use (release only a "
                                         "gateway id that is gone for good)")
        mine = dict(self.holds.get(gid, {}))
        needed = {rs.filter for rec in self.meta.list_sessions() for rs in rec.subscriptions}
        released, kept = [], []
        for flt, n in sorted(mine.items()):
            others = any(flt in fs for g, fs in self.holds.items() if g != gid)
            if flt in needed and not others:
                kept.append(flt)
                continue
            for _ in range(n):
                self._hold(gid, flt, -1)
            released.append(flt)
        if not self.holds.get(gid):
            self.holds.pop(gid, None)
        log.info("event=gateway_holds_released gateway=%s released=%d kept=%d", gid, len(released), len(kept))
        return {"released": released, "kept": kept}

    # ---------------------------------------------------------------- the gw_* commands
    # One method per command of store/node/protocol.py, named as the command: `req` is its typed
    # request, `conn` the StoreConnection it came on; the answer is its reply type, or a future of
    # it for a command that waits. `_install` registers them all from the protocol's registry.
    def _install(self) -> None:
        for name, (req_type, _reply_type) in P.COMMANDS.items():
            self.srv.register_call(name, self._handler(req_type, getattr(self, name)), with_connection=True)
        self.srv.hello_info[P.HELLO_KEY] = P.NODE_PROTOCOL_VERSION

    def _handler(self, req_type: type, method: Callable):
        def handle(args: dict, conn):
            try:
                req = req_type.from_wire(args)
            except P.BadRequest as e:            # the field named, as ERROR `invalid`
                raise CallError(W.E_INVALID, str(e)) from None
            out = method(req, conn)
            if asyncio.isfuture(out):
                done = self.loop.create_future()

                def then(f) -> None:
                    if f.cancelled():
                        done.cancel()
                    elif f.exception() is not None:
                        done.set_exception(f.exception())
                    else:
                        done.set_result(_on_wire(f.result()))
                out.add_done_callback(then)
                return done
            return _on_wire(out)
        return handle

    def _after_dispatch(self, answer: Callable[[], P.Wire], slow: Callable[[int], None]):
        """`answer()` once the store's dispatch has passed the log's end as of now: at once when it
        has (usually), else a future (waited for off the loop, at most 5 s; then `slow(target)`,
        which may raise)."""
        st = self.srv.store
        target = st.max_offset
        if st.dispatched_offset >= target:
            return answer()

        async def later():
            if not await self.loop.run_in_executor(None, st.wait_dispatched, target, 5.0):
                slow(target)
            return answer()
        return asyncio.ensure_future(later())

    # the delivery path
    def gw_watch(self, req: P.Watch, conn):
        """Watch and answer in one step on the loop: no append can fall between them. With
        `start`, that step is taken once the dispatch has passed the log's end as of the request
        (as `gw_start_offsets`): the offsets answered are then a new subscription's start, and the
        entries pushed from there on follow them."""
        if req.start:
            return self._after_dispatch(lambda: self._watch(req, conn), self._start_slow)
        return self._watch(req, conn)

    def _watch(self, req: P.Watch, conn) -> P.WatchReply:
        qs = req.queues
        if req.replace:
            self.watchers[conn] = set(qs)
        else:
            self.watchers.setdefault(conn, set()).update(qs)
        mo = {q: self.lq.max_offset(q) for q in qs}
        if not req.push:
            return P.WatchReply(mo)
        # from here on this connection gets PUSH frames: entries after these offsets
        cur = self.push_cursors.get(conn)
        if cur is None or req.replace:
            cur = self.push_cursors[conn] = {}
        cur.update(mo)
        if req.raw:
            self.raw_push.add(conn)
        else:
            self.raw_push.discard(conn)
        return P.WatchReply(mo, push=True, raw=req.raw)

    def gw_unwatch(self, req: P.Unwatch, conn) -> P.Ok:
        w = self.watchers.get(conn)
        if w is not None:
            w.difference_update(req.queues)
        cur = self.push_cursors.get(conn)
        if cur is not None:
            for q in req.queues:
                cur.pop(q, None)
        return P.Ok()

    def gw_max_offsets(self, req: P.MaxOffsets, conn) -> P.MaxOffsetsReply:
        return P.MaxOffsetsReply({q: self.lq.max_offset(q) for q in req.queues})

    def gw_start_offsets(self, req: P.StartOffsets, conn):
        """Where a new subscription starts: after every message already acknowledged. PRODUCED
        does not wait for the light-queue dispatch, so this waits until dispatch has passed the
        log's end as of this request (usually it already has)."""
        return self._after_dispatch(lambda: P.MaxOffsetsReply({q: self.lq.max_offset(q) for q in req.queues}),
                                    self._start_slow)

    def _start_slow(self, target: int) -> None:
        log.warning("event=start_offsets_dispatch_slow target=%d dispatched=%d",
                    target, self.srv.store.dispatched_offset)

    def gw_group_pop(self, req: P.GroupPop, conn):
        """A shared group's messages for this gateway's members (group_assign.py): now, or a
        future when parked until the queue grows."""
        def reply(msgs: list) -> P.GroupPopReply:
            return P.GroupPopReply([list(m.dispatch_queues or ()) for m in msgs], msgs)
        got = self.assign.pop(req.gateway, req.incarnation, req.group, req.queue, req.max_count, req.start,
                              req.ttl_ms, req.wait_ms, conn)
        if not asyncio.isfuture(got):
            return reply(got)
        out = self.loop.create_future()

        def done(f) -> None:
            if out.done():
                return
            if f.cancelled():
                out.cancel()
            else:
                out.set_result(reply(f.result()))
        got.add_done_callback(done)
        return out

    def gw_group_ack(self, req: P.GroupAck, conn) -> P.CountReply:
        return P.CountReply(self.assign.ack(req.gateway, req.incarnation, req.group, req.queue, req.offsets,
                                            req.back, req.leave, req.ttl_ms))

    def gw_group_renew(self, req: P.GroupRenew, conn) -> P.Ok:
        self.assign.renew(req.gateway, req.incarnation, req.ttl_ms)
        return P.Ok()

    def gw_pull(self, req: P.Pull, conn) -> P.PullReply | RawFrame:
        q = req.queue
        max_count = max(1, min(req.max_count, 65536))
        max_bytes = req.max_bytes or (1 << 20)
        if req.raw:
            # the records as stored, as a push carries them: no decode here, no re-encode, and the
            # gateway decodes them in C (a reader behind its mirror reads thousands this way); what
            # this path cannot serve (below the log's start, nothing there, a record failing its
            # check) gets the MESSAGES reply, which reports and skips
            try:
                got = self.lq.pull_raw(q, req.offset, max_count, max_bytes)
            except Exception:  # noqa: BLE001 - the decoded pull below reads the same entries and reports it
                got = None
            if got is not None and got[2]:
                first, runs, sizes = got
                self._pulled(conn, q, first + len(sizes))
                return RawFrame(W.OP_PUSH_RAW, W.encode_push_raw([(q, self.lq.max_offset(q), first, runs, sizes)]))
        res = self.lq.pull(q, req.offset, max_count=max_count, max_bytes=max_bytes)
        self._pulled(conn, q, res.next_offset)
        return P.PullReply(res.next_offset, res.min_offset, res.max_offset,
                           [list(m.dispatch_queues or ()) for m in res.messages], res.messages)

    def _pulled(self, conn, q: str, next_offset: int) -> None:
        cur = self.push_cursors.get(conn)
        if cur is not None and cur.get(q, next_offset) < next_offset:
            cur[q] = next_offset            # the connection has these now: push from there

    # subscribing from the past (lightqueue/replay.py): the gateway registered the filter before
    def gw_replay(self, req: P.Replay, conn):
        flt = validate_filter(req.filter)
        st = self.srv.store

        def answer() -> P.ReplayReply:
            try:
                p = replay_mod.plan(st, self.lq, flt, req.since)
            except replay_mod.ReplayRefused as e:
                raise CallError(W.E_INVALID, str(e)) from None
            return P.ReplayReply(p["source"], p["live_offset"], p.get("cursor"))

        def slow(_target: int) -> None:
            raise CallError(W.E_STORE, "the store's dispatch is behind; try again")
        return self._after_dispatch(answer, slow)

    def gw_replay_read(self, req: P.ReplayRead, conn) -> P.ReplayReadReply:
        msgs, cursor, done = replay_mod.read_history(self.srv.store, req.cursor, max(1, min(req.max_count, 65536)))
        return P.ReplayReadReply(cursor, done, msgs)

    # filter holds
    def gw_register(self, req: P.Register, conn) -> P.RegisterReply:
        if req.filters is not None:          # many at once: a gateway's filters at its start
            flts = [validate_filter(f) for f in req.filters]
            return P.RegisterReply(counts={f: self._hold(req.gateway, f, +1) for f in flts})
        return P.RegisterReply(count=self._hold(req.gateway, validate_filter(req.filter), +1))

    def gw_unregister(self, req: P.Unregister, conn) -> P.CountReply:
        return P.CountReply(self._hold(req.gateway, req.filter, -1))

    def gw_filters(self, req: P.Filters, conn) -> P.FiltersReply:
        return P.FiltersReply(dict(self.holds.get(req.gateway, {})))

    def gw_holders(self, req: P.Holders, conn) -> P.HoldersReply:
        return P.HoldersReply({gid: P.HolderInfo(len(fs), self.wills.is_connected(gid))
                               for gid, fs in sorted(self.holds.items())})

    def gw_release_gateway(self, req: P.ReleaseGateway, conn) -> P.ReleaseGatewayReply:
        r = self.release_gateway(req.gateway)
        return P.ReleaseGatewayReply(r["released"], r["kept"])

    # sessions, offsets, retained messages: the light-queue MetadataStore
    def gw_put_session(self, req: P.PutSession, conn) -> P.Ok:
        rec = SessionRecord.from_bytes(req.rec.encode())
        before = self.meta.session_host(req.client_id)
        written = self.meta.put_session(req.client_id, rec, before)
        if written and before is not None and before != rec.host:
            self.tell_session_moved(before, req.client_id)
        return P.Ok()

    def gw_get_session(self, req: P.GetSession, conn) -> P.SessionReply:
        rec = self.meta.get_session(req.client_id)
        return P.SessionReply(rec.to_bytes().decode() if rec is not None else None)

    def gw_delete_session(self, req: P.DeleteSession, conn) -> P.DeletedReply:
        cid = req.client_id
        before = self.meta.session_host(cid)
        deleted = bool(self.meta.delete_session(cid))
        if before is not None and before != self.wills.gateway_of.get(conn):
            self.tell_session_moved(before, cid)
        return P.DeletedReply(deleted)

    def gw_list_sessions(self, req: P.ListSessions, conn) -> P.ListSessionsReply:
        meta, limit = self.meta, req.limit
        if req.hosted_by is not None:     # a gateway's restore: its own sessions and those of no gateway
            recs, nxt = meta.sessions_of_gateways([req.hosted_by], req.after, limit or 5000, unhosted=True)
            more = nxt is not None
        else:
            recs = meta.list_sessions(req.after, limit)
            more = limit is not None and len(recs) >= limit
            nxt = recs[-1].client_id if recs else None
        offsets = [meta.get_offsets(r.client_id) for r in recs] if req.offsets else None
        return P.ListSessionsReply([r.to_bytes().decode() for r in recs], more, nxt, offsets)

    def gw_get_offset(self, req: P.GetOffset, conn) -> P.OffsetReply:
        return P.OffsetReply(self.meta.get_offset(req.consumer, req.queue))

    def gw_get_offsets(self, req: P.GetOffsets, conn) -> P.OffsetsReply:
        return P.OffsetsReply(self.meta.get_offsets(req.consumer))

    def gw_set_offsets(self, req: P.SetOffsets, conn) -> P.Ok:
        self.meta.set_offsets(req.consumer, req.offsets)
        return P.Ok()

    def gw_delete_offsets(self, req: P.DeleteOffsets, conn) -> P.Ok:
        self.meta.delete_offsets(req.consumer, req.queues)
        return P.Ok()

    def gw_set_retained(self, req: P.SetRetained, conn) -> P.Ok:
        self.meta.set_retained(req.topic, req.payload, req.props)
        return P.Ok()

    def gw_clear_retained_if(self, req: P.ClearRetainedIf, conn) -> P.ClearedReply:
        return P.ClearedReply(bool(self.meta.clear_retained_if(req.topic, req.props)))

    def gw_retained_matching(self, req: P.RetainedMatching, conn) -> P.RetainedReply:
        return P.RetainedReply(list(self.meta.retained_matching(req.filter)))

    def gw_flush(self, req: P.Flush, conn) -> P.Ok:
        self.meta.flush()
        return P.Ok()

    # which connection is which gateway; wills (gateway_wills.py)
    def gw_hello(self, req: P.Hello, conn) -> P.HelloReply:
        if not req.gateway:
            raise CallError(W.E_INVALID, "gw_hello: field 'gateway' must not be empty")
        return P.HelloReply(self.wills.hello(conn, req.gateway), self.session_sweep.take_swept(req.gateway))

    def gw_claim_sessions(self, req: P.ClaimSessions, conn) -> P.Ok:
        if not req.gateway:
            raise CallError(W.E_INVALID, "gw_claim_sessions: field 'gateway' must not be empty")
        self.wills.attach(conn, req.gateway)
        self.void_older_wills(req.gateway, req.claims)
        self.relay_session_claims(req.gateway, req.claims)
        return P.Ok()

    def void_older_wills(self, gid: str, claims: list) -> None:
        """A claim is a new connection of each client id on gateway `gid`: a will an earlier
        connection left on another gateway is void (MQTT: the client is back before it was sent;
        a live holder closes that connection once the claim is relayed, as on a takeover). The
        claimant's own wills stay: the will of the new connection may be stored before its claim
        arrives, and the gateway voids an earlier one of its own itself (a delayed will it was
        holding). This is the void a gateway used to send beside each claim (`gw_pop_will`
        without a gateway): a CONNECT costs the store one request less."""
        meta = self.meta
        for cid, _since in claims:
            w = meta.get_will(cid)
            if w is not None and w.gateway != gid:
                meta.pop_will(cid, gateway=w.gateway)

    def gw_put_will(self, req: P.PutWill, conn) -> P.Ok:
        if req.gateway:                   # a will comes with its gateway: this connection is it
            self.wills.attach(conn, req.gateway)
        self.meta.put_will(req.client_id, WillRecord.from_bytes(req.will), gateway=req.gateway)
        return P.Ok()

    def gw_pop_will(self, req: P.PopWill, conn) -> P.WillReply:
        w = self.meta.pop_will(req.client_id, gateway=req.gateway)
        return P.WillReply(w.to_bytes() if w is not None else None)

    def gw_void_wills(self, req: P.VoidWills, conn) -> P.Ok:
        for cid in req.client_ids:
            self.meta.pop_will(cid)
        return P.Ok()

    def gw_take_wills(self, req: P.TakeWills, conn) -> P.WillsReply:
        return P.WillsReply([(cid, w.to_bytes()) for cid, w in self.wills.take(req.gateway)])

    def gw_list_wills(self, req: P.ListWills, conn) -> P.WillsReply:
        return P.WillsReply([(cid, w.to_bytes()) for cid, w in self.meta.list_wills(req.gateway)])


def install(server: StoreServer, lq: LightQueueStore, loop, window_s: float = 0.002,
            redis_publisher=None, will_grace_s: float = 5.0, retained_props=None,
            session_sweep_s: float = 60.0, repair_counts: bool = True) -> GatewayService:
    return GatewayService(server, lq, loop, window_s, redis_publisher, will_grace_s, retained_props,
                          session_sweep_s, repair_counts)


def _on_wire(reply: P.Wire | RawFrame):
    """A reply as the StoreServer sends it: a MESSAGES frame's header and entries, a frame of
    record bytes (RawFrame), or a RESULT's JSON."""
    if isinstance(reply, RawFrame):
        return reply
    if reply.has_messages:
        return Messages(reply.to_wire(), reply.messages)
    return reply.to_wire()
