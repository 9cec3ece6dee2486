"""The store side of the remote gateway seam: what `lmqtt gateway` (gateway/remote_store.py) asks
the store node for, plugged into the `StoreServer` like `service.py` (store/ may not import
lightqueue/). Every command is a CALL (docs/protocol.md "Remote gateways"):

  gw_watch {queues}            start pushing EVENT frames for these queues to this connection;
                               answers their max offsets (the watch and the answer are one step on
                               the server's loop, so no append can fall between them)
  gw_max_offsets {queues}      max offsets, no watch (the gateway's safety poll)
  gw_start_offsets {queues}    max offsets once every message appended before the request is
                               dispatched (where a new subscription starts: PRODUCED does not
                               wait for the light-queue dispatch)
  gw_pull {queue, offset, ...} a light-queue pull; the MESSAGES header carries each message's
                               dispatch queues ("dq"), which the gateway needs to deliver a message
                               once to a session whose subscriptions overlap
  gw_register / gw_unregister / gw_filters {gateway, filter}
                               wildcard filter registrations held per gateway id, persisted: a
                               gateway that restarts with the same id reconciles exactly its own
                               (`SubscriptionRegistry.sync_store_filters`), never another's
  gw_put_session, gw_get_session, gw_delete_session, gw_list_sessions, gw_get_offset(s),
  gw_set_offsets, gw_delete_offsets, gw_set_retained, gw_retained_matching, gw_put_will,
  gw_pop_will, gw_list_wills, gw_flush
                               the `SessionMetadata` of gateway/store_api.py over the store's
                               light-queue `MetadataStore` (binary fields base64 in JSON: these
                               run at connect/subscribe rate, not message rate)

Events: the light-queue store's listener (dispatch thread) feeds an `InProcessBus` on the server's
loop, which merges names within `window_s`; each merged set goes to every watching connection as
one EVENT {queue: max offset} holding only the queues it watches. Events are hints: the gateway's
safety poll finds anything a lost event would have announced. With a Redis URL the same names also
go to Redis pub/sub (notify/redis_bus.py) for gateways started with `--redis`.
"""
from __future__ import annotations

import asyncio
import base64
import logging

from lmqtt.notify import InProcessBus
from lmqtt.store import protocol as W
from lmqtt.store.server import Messages, StoreServer

from .light_queue_store import LightQueueStore
from .records import SessionRecord, WillRecord
from .topics import validate_filter

log = logging.getLogger("lmqtt.lightqueue.gateway_service")

_HOLD = "gwf\0"          # SdkMetadata key prefix: gwf \0 gateway id \0 filter -> count


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _unb64(s: str) -> bytes:
    return base64.b64decode(s)


class GatewayService:
    def __init__(self, server: StoreServer, lq: LightQueueStore, loop, window_s: float = 0.002,
                 redis_publisher=None) -> None:
        self.srv = server
        self.lq = lq
        self.meta = lq.metadata
        self.watchers: dict[object, set[str]] = {}      # StoreConnection -> watched queue names
        self.events_sent = 0
        self.loop = loop
        self.bus = InProcessBus(loop, window_s)
        self.bus.subscribe(self._fan_out)
        lq.add_listener(self.bus.publish)
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
        self._install()

    def close(self) -> None:
        self.lq.remove_listener(self.bus.publish)
        if self.redis is not None:
            self.lq.remove_listener(self.redis.publish)
            self.redis.close()
        self.bus.close()

    # ---------------------------------------------------------------- events
    def _fan_out(self, names: set[str]) -> None:
        if not self.watchers:
            return
        mx = self.lq.max_offset
        offsets: dict[str, int] = {}
        for conn, watched in list(self.watchers.items()):
            hit = names & watched if len(names) > len(watched) else {q for q in names if q in watched}
            if not hit:
                continue
            body = {}
            for q in hit:
                v = offsets.get(q)
                if v is None:
                    v = offsets[q] = mx(q)
                body[q] = v
            conn.push(W.OP_EVENT, W.encode_event(body))
            self.events_sent += 1

    def _lost(self, conn) -> None:
        self.watchers.pop(conn, None)

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

    # ---------------------------------------------------------------- CALLs
    def _install(self) -> None:
        lq, meta, reg, loop = self.lq, self.meta, self.srv.register_call, self.loop

        def watch(a, conn):
            qs = [str(q) for q in a.get("queues", ())]
            if a.get("replace"):
                self.watchers[conn] = set(qs)
            else:
                self.watchers.setdefault(conn, set()).update(qs)
            return {"max_offsets": {q: lq.max_offset(q) for q in qs}}

        def unwatch(a, conn):
            w = self.watchers.get(conn)
            if w is not None:
                w.difference_update(str(q) for q in a.get("queues", ()))
            return {"ok": True}

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

        def pull(a):
            res = lq.pull(str(a["queue"]), int(a.get("offset", 0)),
                          max_count=max(1, min(int(a.get("max_count", 64)), 65536)),
                          max_bytes=int(a.get("max_bytes", 1 << 20)) or (1 << 20))
            return Messages({"next_offset": res.next_offset, "min_offset": res.min_offset,
                             "max_offset": res.max_offset,
                             "dq": [list(m.dispatch_queues or ()) for m in res.messages]}, res.messages)

        def register(a):
            return {"count": self._hold(str(a["gateway"]), validate_filter(str(a["filter"])), +1)}

        def unregister(a):
            return {"count": self._hold(str(a["gateway"]), str(a["filter"]), -1)}

        def filters(a):
            return {"filters": dict(self.holds.get(str(a["gateway"]), {}))}

        def put_session(a):
            meta.put_session(str(a["client_id"]), SessionRecord.from_bytes(a["rec"].encode()))
            return {"ok": True}

        def get_session(a):
            rec = meta.get_session(str(a["client_id"]))
            return {"rec": rec.to_bytes().decode() if rec is not None else None}

        def delete_session(a):
            return {"deleted": bool(meta.delete_session(str(a["client_id"])))}

        def list_sessions(_a):
            return {"sessions": [r.to_bytes().decode() for r in meta.list_sessions()]}

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

        def retained_matching(a):
            return {"retained": [[t, _b64(p), _b64(pr)] for t, p, pr in meta.retained_matching(str(a["filter"]))]}

        def put_will(a):
            meta.put_will(str(a["client_id"]), WillRecord.from_bytes(_unb64(a["will"])))
            return {"ok": True}

        def pop_will(a):
            w = meta.pop_will(str(a["client_id"]))
            return {"will": _b64(w.to_bytes()) if w is not None else None}

        def list_wills(_a):
            return {"wills": [[cid, _b64(w.to_bytes())] for cid, w in meta.list_wills()]}

        def flush(_a):
            meta.flush()
            return {"ok": True}

        reg("gw_watch", watch, with_connection=True)
        reg("gw_unwatch", unwatch, with_connection=True)
        for name, fn in (("gw_max_offsets", max_offsets), ("gw_start_offsets", start_offsets), ("gw_pull", pull), ("gw_register", register),
                         ("gw_unregister", unregister), ("gw_filters", filters),
                         ("gw_put_session", put_session), ("gw_get_session", get_session),
                         ("gw_delete_session", delete_session), ("gw_list_sessions", list_sessions),
                         ("gw_get_offset", get_offset), ("gw_get_offsets", get_offsets),
                         ("gw_set_offsets", set_offsets), ("gw_delete_offsets", delete_offsets),
                         ("gw_set_retained", set_retained), ("gw_retained_matching", retained_matching),
                         ("gw_put_will", put_will), ("gw_pop_will", pop_will), ("gw_list_wills", list_wills),
                         ("gw_flush", flush)):
            reg(name, fn)


def install(server: StoreServer, lq: LightQueueStore, loop, window_s: float = 0.002,
            redis_publisher=None) -> GatewayService:
    return GatewayService(server, lq, loop, window_s, redis_publisher)
