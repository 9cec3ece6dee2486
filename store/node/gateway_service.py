"""The store side of the remote gateway seam: what `lmqtt gateway` (gateway/storage/remote_store.py) asks
the store node for, plugged into the `StoreServer` like `service.py` (store/ may not import
lightqueue/). Every command is a CALL (docs/protocol.md "Remote gateways"):

  gw_watch {queues}            start pushing EVENT frames for these queues to this connection;
                               answers their max offsets (the watch and the answer are one step on
                               the server's loop, so no append can fall between them)
  gw_max_offsets {queues}      max offsets, no watch (the gateway's safety poll)
  gw_group_lease {gateway, group, queue, consumer, ttl_ms | release}
                               one gateway at a time delivers a shared group (in memory: after a
                               store restart the gateways claim again); the holder gets the group's
                               committed offset
  gw_start_offsets {queues}    max offsets once every message appended before the request is
                               dispatched (where a new subscription starts: PRODUCED does not
                               wait for the light-queue dispatch)
  gw_replay {filter, since}    subscribing from the past: where the history is (replay.py `plan`),
  gw_replay_read {cursor, ..}  and its next messages from the log (`read_history`)
  gw_pull {queue, offset, ...} a light-queue pull; the MESSAGES header carries each message's
                               dispatch queues ("dq"), which the gateway needs to deliver a message
                               once to a session whose subscriptions overlap
  gw_register / gw_unregister / gw_filters {gateway, filter} (gw_register also {gateway, filters}: many)
  gw_holders, gw_release_gateway {gateway}
                               who holds filters; drop a gone gateway id's holds (lmqtt admin)
                               wildcard filter registrations held per gateway id, persisted: a
                               gateway that restarts with the same id reconciles exactly its own
                               (`SubscriptionRegistry.sync_store_filters`), never another's
  gw_put_session, gw_get_session, gw_delete_session, gw_list_sessions {after?, limit?,
  offsets?, hosted_by?} (a page, with the sessions' offsets; `hosted_by`: only the sessions that
  gateway served last and those of no gateway, a gateway's restore), gw_get_offset(s),
  gw_set_offsets, gw_delete_offsets, gw_set_retained, gw_retained_matching,
  gw_clear_retained_if, gw_flush
                               the `SessionMetadata` of gateway/storage/store_api.py over the store's
                               light-queue `MetadataStore` (binary fields base64 in JSON: these
                               run at connect/subscribe rate, not message rate)
  gw_hello {gateway}           this connection is gateway G (sent at connect and every reconnect);
                               answers the client ids whose wills the store published while G
                               was away, and those whose session records its sweep changed
                               (session_sweep.py: G writes again those still connected to it)
  gw_put_will {client_id, will, gateway}   G holds the client's connection with this will
  gw_pop_will {client_id[, gateway]}       drop it (with gateway: only if G still holds it)
  gw_take_wills {gateway}      remove and return G's wills (G restarted after a crash)
  gw_list_wills [{gateway}]    read them

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
import base64
import logging
import time
from typing import Callable

from lmqtt.notify import InProcessBus
from lmqtt.store import protocol as W
from lmqtt.store.server import Messages, StoreServer

from lmqtt.lightqueue import replay as replay_mod

from lmqtt.store.node.gateway_wills import GatewayWills
from lmqtt.lightqueue.light_queue_store import LightQueueStore
from lmqtt.lightqueue.records import SessionRecord, WillRecord
from lmqtt.store.node.session_sweep import SessionSweep
from lmqtt.lightqueue.topics import validate_filter

log = logging.getLogger("lmqtt.store.node.gateway_service")

_HOLD = "gwf\0"          # SdkMetadata key prefix: gwf \0 gateway id \0 filter -> count


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _unb64(s: str) -> bytes:
    return base64.b64decode(s)


class GatewayService:
    def __init__(self, server: StoreServer, lq: LightQueueStore, loop, window_s: float = 0.002,
                 redis_publisher=None, will_grace_s: float = 5.0,
                 retained_props: Callable[[bytes, int], bytes] | None = None,
                 session_sweep_s: float = 60.0) -> None:
        """`will_grace_s`: how long a gateway's connection may stay gone before the store publishes
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
        self.loop = loop
        self.group_leases: dict[tuple[str, str], tuple[str, float]] = {}   # (group, queue) -> (gateway, until)
        self.bus = InProcessBus(loop, window_s)
        self.bus.subscribe(self._fan_out)
        lq.add_listener(self.bus.publish)
        # inline dispatch raises the names on the loop: push them right after the frames that
        # appended them, before those frames' replies are written
        server.after_frames.append(self.bus.drain)
        self.redis = redis_publisher
        if redis_publisher is not None:
            lq.add_listener(redis_publisher.publish)
        server.on_connection_lost.append(self._lost)
        # filter holds per gateway: rebuilt from the persisted counts (the light-queue registry
        # persists its own refcounts; this only remembers who holds what)
        self.holds: dict[str, dict[str, int]] = {}
        for key in server.meta.keys_with_prefix(_HOLD):
            gid, _, flt = key[len(_HOLD):].partition("\0")
            n = int(server.meta.get_json(key) or 0)
            if n > 0:
                self.holds.setdefault(gid, {})[flt] = n
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
        gateways have no Redis; it keeps nothing (one frame per claiming batch and gateway), as
        Redis pub/sub would not, so a gateway away at that moment learns nothing (docs/fleet.md)."""
        if not claims:
            return
        body = None
        for other, conns in list(self.wills.connections_of.items()):
            if other == gid or not conns:
                continue
            if body is None:
                body = W.encode_session_claims(gid, claims)
            for conn in list(conns):
                conn.push(W.OP_SESSION_CLAIMS, body)
        self.session_claims_relayed += len(claims)

    # ---------------------------------------------------------------- filter holds
    def _hold(self, gid: str, flt: str, delta: int) -> int:
        mine = self.holds.setdefault(gid, {})
        n = mine.get(flt, 0)
        if delta > 0:
            if n == 0:
                self.lq.register_filter(flt)
            n += 1
        elif n > 0:
            n -= 1
            if n == 0:
                self.lq.unregister_filter(flt)
        if n:
            mine[flt] = n
        else:
            mine.pop(flt, None)
        self.srv.meta.put_json(f"{_HOLD}{gid}\0{flt}", n)
        return n

    def release_gateway(self, gid: str) -> dict:
        """Drop the filter holds of gateway id `gid`, one that is gone for good (an operator's
        call: e.g. the pod names a Deployment rollout retired). Refused while `gid` is connected.
        A filter a persistent session's record uses is kept when `gid` is its only holder: that
        session may have been created on `gid`, after the other gateways restored theirs, and its
        messages must keep being indexed until it comes back."""
        if self.wills.is_connected(gid):
            raise ValueError(f"gateway {gid!r} is connected: its holds are in use")
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

    # ---------------------------------------------------------------- CALLs
    def _install(self) -> None:
        lq, meta, reg, loop = self.lq, self.meta, self.srv.register_call, self.loop

        def watch(a, conn):
            qs = [str(q) for q in a.get("queues", ())]
            if a.get("replace"):
                self.watchers[conn] = set(qs)
            else:
                self.watchers.setdefault(conn, set()).update(qs)
            mo = {q: lq.max_offset(q) for q in qs}
            if a.get("push"):
                # from here on this connection gets PUSH frames: entries after these offsets
                cur = self.push_cursors.get(conn)
                if cur is None or a.get("replace"):
                    cur = self.push_cursors[conn] = {}
                cur.update(mo)
                if a.get("raw"):
                    self.raw_push.add(conn)
                    return {"max_offsets": mo, "push": True, "raw": True}
                self.raw_push.discard(conn)
                return {"max_offsets": mo, "push": True}
            return {"max_offsets": mo}

        def unwatch(a, conn):
            qs = [str(q) for q in a.get("queues", ())]
            w = self.watchers.get(conn)
            if w is not None:
                w.difference_update(qs)
            cur = self.push_cursors.get(conn)
            if cur is not None:
                for q in qs:
                    cur.pop(q, None)
            return {"ok": True}

        leases: dict[tuple[str, str], tuple[str, float]] = self.group_leases
        released: dict[tuple[str, str], int] = {}       # offset a holder handed back with the lease

        def group_lease(a):
            # one deliverer per shared group across the fleet (gateway/fleet/group_leases.py)
            gid, key = str(a["gateway"]), (str(a["group"]), str(a["queue"]))
            now = time.monotonic()
            held = leases.get(key)
            if a.get("release"):
                if held is not None and held[0] == gid:
                    del leases[key]
                    if a.get("offset") is not None:          # where the next holder starts
                        released[key] = int(a["offset"])
                return {"owner": None}
            if held is None or held[0] == gid or held[1] < now:
                leases[key] = held = (gid, now + max(0.1, int(a.get("ttl_ms", 3000)) / 1000.0))
            out = {"owner": held[0]}
            if held[0] == gid and a.get("consumer"):
                off = meta.get_offset(str(a["consumer"]), key[1])
                out["offset"] = max(off, released.get(key, off)) if off is not None else released.get(key)
            return out

        def max_offsets(a):
            return {"max_offsets": {str(q): lq.max_offset(str(q)) for q in a.get("queues", ())}}

        def start_offsets(a):
            # Where a new subscription starts: after every message already acknowledged. The
            # PRODUCED reply does not wait for the light-queue dispatch, so wait here until
            # dispatch has passed the log's end as of this request (usually it already has).
            st = self.srv.store
            target = st.max_offset
            if st.dispatched_offset >= target:
                return max_offsets(a)

            async def later():
                if not await loop.run_in_executor(None, st.wait_dispatched, target, 5.0):
                    log.warning("event=start_offsets_dispatch_slow target=%d dispatched=%d",
                                target, st.dispatched_offset)
                return max_offsets(a)
            return asyncio.ensure_future(later())

        def pull(a, conn):
            q = str(a["queue"])
            res = lq.pull(q, int(a.get("offset", 0)),
                          max_count=max(1, min(int(a.get("max_count", 64)), 65536)),
                          max_bytes=int(a.get("max_bytes", 1 << 20)) or (1 << 20))
            cur = self.push_cursors.get(conn)
            if cur is not None and cur.get(q, res.next_offset) < res.next_offset:
                cur[q] = res.next_offset        # the connection has these now: push from there
            return Messages({"next_offset": res.next_offset, "min_offset": res.min_offset,
                             "max_offset": res.max_offset,
                             "dq": [list(m.dispatch_queues or ()) for m in res.messages]}, res.messages)

        # subscribing from the past (lightqueue/replay.py): the gateway registered the filter before
        replay, replay_read = replay_mod.call_handlers(self.srv.store, lq)

        def register(a):
            gid = str(a["gateway"])
            if "filters" in a:            # many at once: a gateway's filters at its start
                flts = [validate_filter(str(f)) for f in a["filters"]]
                return {"counts": {f: self._hold(gid, f, +1) for f in flts}}
            return {"count": self._hold(gid, validate_filter(str(a["filter"])), +1)}

        def unregister(a):
            return {"count": self._hold(str(a["gateway"]), str(a["filter"]), -1)}

        def filters(a):
            return {"filters": dict(self.holds.get(str(a["gateway"]), {}))}

        def holders(_a):
            return {"gateways": {gid: {"filters": len(fs), "connected": self.wills.is_connected(gid)}
                                 for gid, fs in sorted(self.holds.items())}}

        def release_gateway(a):
            return self.release_gateway(str(a["gateway"]))

        def put_session(a):
            cid = str(a["client_id"])
            rec = SessionRecord.from_bytes(a["rec"].encode())
            before = meta.session_host(cid)
            meta.put_session(cid, rec)
            if before is not None and before != rec.host:
                self.tell_session_moved(before, cid)
            return {"ok": True}

        def get_session(a):
            rec = meta.get_session(str(a["client_id"]))
            return {"rec": rec.to_bytes().decode() if rec is not None else None}

        def delete_session(a, conn):
            cid = str(a["client_id"])
            before = meta.session_host(cid)
            deleted = bool(meta.delete_session(cid))
            if before is not None and before != self.wills.gateway_of.get(conn):
                self.tell_session_moved(before, cid)
            return {"deleted": deleted}

        def list_sessions(a):
            after, limit = a.get("after"), a.get("limit")
            after = None if after is None else str(after)
            host = a.get("hosted_by")
            if host is not None:        # a gateway's restore: its own sessions and those of no gateway
                recs, nxt = meta.sessions_of_gateways([str(host)], after, int(limit or 5000), unhosted=True)
                more = nxt is not None
            else:
                recs = meta.list_sessions(after, None if limit is None else int(limit))
                more = limit is not None and len(recs) >= int(limit)
                nxt = recs[-1].client_id if recs else None
            out = {"sessions": [r.to_bytes().decode() for r in recs], "more": more, "next": nxt}
            if a.get("offsets"):
                out["offsets"] = [meta.get_offsets(r.client_id) for r in recs]
            return out

        def get_offset(a):
            return {"offset": meta.get_offset(str(a["consumer"]), str(a["queue"]))}

        def get_offsets(a):
            return {"offsets": meta.get_offsets(str(a["consumer"]))}

        def set_offsets(a):
            meta.set_offsets(str(a["consumer"]), {str(k): int(v) for k, v in a["offsets"].items()})
            return {"ok": True}

        def delete_offsets(a):
            qs = a.get("queues")
            meta.delete_offsets(str(a["consumer"]), [str(q) for q in qs] if qs is not None else None)
            return {"ok": True}

        def set_retained(a):
            meta.set_retained(str(a["topic"]), _unb64(a["payload"]), _unb64(a.get("props", "")))
            return {"ok": True}

        def clear_retained_if(a):
            return {"cleared": meta.clear_retained_if(str(a["topic"]), _unb64(a.get("props", "")))}

        def retained_matching(a):
            return {"retained": [[t, _b64(p), _b64(pr)] for t, p, pr in meta.retained_matching(str(a["filter"]))]}

        def hello(a, conn):
            gid = str(a["gateway"])
            if not gid:
                raise ValueError("gw_hello needs a non-empty gateway id")
            return {"wills_published": self.wills.hello(conn, gid),
                    "sessions_swept": self.session_sweep.take_swept(gid)}

        def claim_sessions(a, conn):
            gid = str(a["gateway"])
            if not gid:
                raise ValueError("gw_claim_sessions needs a non-empty gateway id")
            self.wills.attach(conn, gid)
            self.relay_session_claims(gid, [(str(c), int(t)) for c, t in a["claims"]])
            return {"ok": True}

        def put_will(a, conn):
            gid = a.get("gateway")
            if gid:                       # a will comes with its gateway: this connection is it
                self.wills.attach(conn, str(gid))
            meta.put_will(str(a["client_id"]), WillRecord.from_bytes(_unb64(a["will"])),
                          gateway=str(gid) if gid is not None else None)
            return {"ok": True}

        def pop_will(a):
            gid = a.get("gateway")
            w = meta.pop_will(str(a["client_id"]), gateway=str(gid) if gid is not None else None)
            return {"will": _b64(w.to_bytes()) if w is not None else None}

        def take_wills(a):
            return {"wills": [[cid, _b64(w.to_bytes())] for cid, w in self.wills.take(str(a["gateway"]))]}

        def list_wills(a):
            gid = a.get("gateway")
            return {"wills": [[cid, _b64(w.to_bytes())]
                              for cid, w in meta.list_wills(str(gid) if gid is not None else None)]}

        def flush(_a):
            meta.flush()
            return {"ok": True}

        reg("gw_watch", watch, with_connection=True)
        reg("gw_unwatch", unwatch, with_connection=True)
        reg("gw_hello", hello, with_connection=True)
        reg("gw_put_will", put_will, with_connection=True)
        reg("gw_claim_sessions", claim_sessions, with_connection=True)
        reg("gw_pull", pull, with_connection=True)
        reg("gw_delete_session", delete_session, with_connection=True)
        for name, fn in (("gw_max_offsets", max_offsets), ("gw_group_lease", group_lease), ("gw_start_offsets", start_offsets), ("gw_replay", replay),
                         ("gw_replay_read", replay_read), ("gw_register", register),
                         ("gw_holders", holders), ("gw_release_gateway", release_gateway),
                         ("gw_unregister", unregister), ("gw_filters", filters),
                         ("gw_put_session", put_session), ("gw_get_session", get_session),
                         ("gw_list_sessions", list_sessions),
                         ("gw_get_offset", get_offset), ("gw_get_offsets", get_offsets),
                         ("gw_set_offsets", set_offsets), ("gw_delete_offsets", delete_offsets),
                         ("gw_set_retained", set_retained), ("gw_retained_matching", retained_matching),
                         ("gw_clear_retained_if", clear_retained_if),
                         ("gw_pop_will", pop_will), ("gw_take_wills", take_wills), ("gw_list_wills", list_wills),
                         ("gw_flush", flush)):
            reg(name, fn)


def install(server: StoreServer, lq: LightQueueStore, loop, window_s: float = 0.002,
            redis_publisher=None, will_grace_s: float = 5.0, retained_props=None,
            session_sweep_s: float = 60.0) -> GatewayService:
    return GatewayService(server, lq, loop, window_s, redis_publisher, will_grace_s, retained_props,
                          session_sweep_s)
