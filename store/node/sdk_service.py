"""Light-queue operations of the store server (`store/server.py`), plugged in from here because
`store/` may not import `lightqueue/`:

  router            every SDK-produced message gets the same dispatch queues as an MQTT publish of
                    its topic (exact-topic queue + every registered wildcard filter that matches),
                    so MQTT subscribers (and FilterConsumers) see SDK messages
  PULL_FILTER       read a filter's light queue (what an MQTT subscriber of the filter sees)
  CALL subscribe    register a filter (like the first MQTT SUBSCRIBE to it); persisted in the
                    server's SDK metadata and re-registered at startup if the registry lost it
                    (the embedded gateway reconciles its filters with its sessions at start)
  CALL unsubscribe  drop the SDK's registration
  CALL filter_offsets  min/max offset of a filter's queue
  CALL replay, replay_read  subscribing from the past (replay.py): where a filter's history since a
                    time is, and its messages from the log (the gateway's `$replay/` and `since`)
  CALL filter_read  a filter's history by CommitLog position (lightqueue/history.py `read_from`):
                    every stored message matching it, whether or not the filter was held when it was
                    written (`FilterConsumer`, `lmqtt consume --filter --from`)
  CALL filter_position  where a FilterConsumer starts: earliest / latest / a time / a group's commit
  CALL filter_commit  a FilterConsumer group's CommitLog position (and its light-queue offset, for lag)
  CALL filter_sources, filter_range  the ConsumeQueues a filter's history is in, and one queue's
                    offset range read with the filter applied (the Spark source's `filter` option)
  CALL sessions     a page of the persistent MQTT sessions (`lmqtt admin --sessions`): client id,
                    gateway, connected or since when not, expiry, number of subscriptions
  CALL session      one session in full (`lmqtt admin --session ID`): each subscription with its
                    committed offset, its queue's end and the lag between them
"""
from __future__ import annotations

import asyncio
import logging

from lmqtt.lightqueue import history, replay
from lmqtt.lightqueue.light_queue_store import LightQueueStore
from lmqtt.lightqueue.replay import ReplayRefused, check_retention
from lmqtt.lightqueue.topics import validate_filter
from lmqtt.store import protocol as W
from lmqtt.store.sdk_meta import SDK_FILTER, lq_key
from lmqtt.store.server import CallError, Messages, RawMessages, StoreServer

log = logging.getLogger("lmqtt.store.node.sdk_service")


def install(server: StoreServer, lq: LightQueueStore) -> None:
    meta = server.meta
    held: set[str] = set()

    def ensure(flt: str) -> None:
        if flt in held:
            return
        if lq.registry.refcount(flt) == 0 or meta.get_json(SDK_FILTER + flt) is None:
            lq.register_filter(flt)
            try:
                meta.put_json(SDK_FILTER + flt, 1)
            except BaseException:
                # not registered after all (a full disk): the count is taken back, else each
                # retry would add one that nothing lets go of until the next start repairs it
                # (gateway_service.py `load_holds`)
                try:
                    lq.unregister_filter(flt)
                except Exception as e:  # noqa: BLE001 - one count too many: repaired at the next start
                    log.error("event=filter_unregister_failed filter=%r error=%r", flt, e)
                raise
        held.add(flt)

    for key in meta.keys_with_prefix(SDK_FILTER):
        flt = key[len(SDK_FILTER):]
        try:
            if lq.registry.refcount(flt) == 0:
                lq.register_filter(flt)
            held.add(flt)
        except Exception as e:  # noqa: BLE001 - one bad stored filter must not stop the server
            log.error("event=filter_restore_failed filter=%r error=%r", flt, e)

    def subscribe(a: dict) -> dict:
        flt = validate_filter(str(a["filter"]))
        ensure(flt)
        return {"filter": flt, "min_offset": lq.min_offset(flt), "max_offset": lq.max_offset(flt)}

    def unsubscribe(a: dict) -> dict:
        flt = str(a["filter"])
        if meta.get_json(SDK_FILTER + flt) is None:
            return {"ok": False}
        meta.delete_json(SDK_FILTER + flt)      # shipped to a store group's replicas (docs/ha.md)
        held.discard(flt)
        lq.unregister_filter(flt)
        return {"ok": True}

    def filter_offsets(a: dict) -> dict:
        flt = str(a["filter"])
        return {"min_offset": lq.min_offset(flt), "max_offset": lq.max_offset(flt)}

    def filter_pull(flt: str, offset: int, max_count: int, max_bytes: int, group: str) -> Messages:
        ensure(validate_filter(flt))
        res = lq.pull(flt, offset, max_count=max(1, min(max_count, 65536)), max_bytes=max_bytes or (4 << 20))
        return Messages({"next_offset": res.next_offset, "min_offset": res.min_offset,
                         "max_offset": res.max_offset}, res.messages)

    server.router = lq.queues_for_topic
    server.filter_pull = filter_pull
    # the filters known registered (a cache of `ensure`): a store group member that becomes primary
    # empties it, its registrations being the previous primary's (store/node/ha_member.py)
    server.sdk_filters_held = held
    server.filter_max_offset = lq.max_offset
    server.register_call("subscribe", subscribe)
    server.register_call("unsubscribe", unsubscribe)
    server.register_call("filter_offsets", filter_offsets)

    def sessions(a: dict) -> dict:
        limit = max(1, min(int(a.get("limit") or 500), 5000))
        after = a.get("after")
        recs = lq.metadata.list_sessions(None if after is None else str(after), limit)
        return {"sessions": [_summary(r) for r in recs],
                "next": recs[-1].client_id if len(recs) >= limit else None}

    def session(a: dict) -> dict:
        md = lq.metadata
        rec = md.get_session(str(a["client_id"]))
        if rec is None:
            return {"session": None}
        own = md.get_offsets(rec.client_id)
        subs = []
        for sub in rec.subscriptions:
            # a shared group's offset belongs to the group (consumer `$share/{group}`), not the member
            committed = (md.get_offset(f"$share/{sub.share_group}", sub.filter) if sub.share_group
                         else own.get(sub.filter))
            end = lq.max_offset(sub.filter)
            subs.append({"filter": sub.filter, "qos": sub.qos, "share_group": sub.share_group,
                         "no_local": sub.no_local, "retain_as_published": sub.retain_as_published,
                         "retain_handling": sub.retain_handling, "subscription_id": sub.subscription_id,
                         "committed_offset": committed, "max_offset": end,
                         "lag": None if committed is None else max(0, end - committed)})
        return {"session": {**_summary(rec), "protocol_version": rec.protocol_version, "subscriptions": subs}}

    server.register_call("sessions", sessions)
    server.register_call("session", session)
    plan, read = replay_handlers(server.store, lq)
    server.register_call("replay", plan)
    server.register_call("replay_read", read)
    _install_history(server, lq)


def replay_handlers(store, lq):
    """The CALL handlers `(plan, read)` of the store protocol (docs/protocol.md): `gw_replay` /
    `gw_replay_read` for remote gateways (gateway_service.py), `replay` / `replay_read` for the SDK
    (service.py). `plan` answers once dispatch has passed the log's end as of the request (a
    future then, waited for off the loop); refused: ERROR `invalid` with the reason (the plan and
    its reads: lightqueue/replay.py)."""
    def plan(a: dict):
        flt, since = validate_filter(str(a["filter"])), int(a["since"])

        def answer():
            try:
                return replay.plan(store, lq, flt, since)
            except ReplayRefused as e:
                raise CallError(W.E_INVALID, str(e)) from None
        target = store.max_offset
        if store.dispatched_offset >= target:
            return answer()

        async def later():
            loop = asyncio.get_running_loop()
            if not await loop.run_in_executor(None, store.wait_dispatched, target, 5.0):
                raise CallError(W.E_STORE, "the store's dispatch is behind; try again")
            return answer()
        return asyncio.ensure_future(later())

    def read(a: dict):
        msgs, cursor, done = replay.read_history(store, a["cursor"], max(1, min(int(a.get("max_count", 1024)), 65536)))
        return Messages({"cursor": cursor, "done": done}, msgs)
    return plan, read


_FP = "fp\0"          # SDK meta key prefix of a FilterConsumer group's position: fp \0 group \0 filter


def _reply(header: dict, got: history.Got):
    if got.msgs is not None:
        return Messages(header, got.msgs)
    return RawMessages(header, got.count, got.chunks)


def _install_history(server: StoreServer, lq: LightQueueStore) -> None:
    """A filter's history (lightqueue/history.py) for the SDK and Spark."""
    store, meta = server.store, server.meta

    def flt_of(a: dict) -> str:
        try:
            return validate_filter(str(a["filter"]))
        except ValueError as e:
            raise CallError(W.E_INVALID, str(e)) from None

    def limits(a: dict) -> tuple[int, int]:
        return max(1, min(int(a.get("max_count", 1024)), 65536)), max(1, min(int(a.get("max_bytes") or 4 << 20), 64 << 20))

    def lq_offset_of(flt: str, position: int) -> int | None:
        """The filter's light-queue offset of `position` when its queue covers it, else None."""
        cover = history.lq_covers_from(lq, flt)
        if cover is None or position < cover:
            return None
        return history.lq_offset(lq, flt, position, 0)

    def filter_read(a: dict):
        flt = flt_of(a)
        mc, mb = limits(a)
        pos = int(a["position"])
        got, nxt, hint = history.read_from(store, lq, flt, pos, mc, mb, a.get("end"), a.get("hint"))
        return _reply({"position": nxt, "hint": hint, "end": store.dispatched_offset}, got)

    def committed_position(group: str, flt: str) -> int | None:
        """A group's committed position, checked against the log: a log cut below it in a recovery
        (its last record is gone or another one took its place) falls back to the group's
        light-queue offset, which recovery brought back to the queue's end."""
        rec = meta.get_json(f"{_FP}{group}\0{flt}")
        if rec is not None:
            pos, last = int(rec["position"]), rec.get("last")
            ok = pos <= store.max_offset
            if ok and last:
                try:
                    ok = int(store.read(int(last[0])).store_ts) == int(last[1])
                except Exception:   # noqa: BLE001 - unreadable: cut, or deleted by retention
                    ok = int(last[0]) < store.min_offset
            if ok:
                return pos
            log.warning("event=filter_position_reset group=%r filter=%r position=%d: the log no longer holds "
                        "the last record read there (cut in a recovery); going on from the group's light-queue "
                        "offset", group, flt, pos)
        off = meta.committed(group, lq_key(flt))
        if off is None:
            return None
        e = lq.index.read(flt, max(off, lq.index.min_offset(flt)), 1)
        return e[0].phys_offset if e else store.dispatched_offset

    def filter_position(a: dict) -> dict:
        flt = flt_of(a)
        pos = None
        if a.get("since") is not None:
            since = int(a["since"])
            try:
                check_retention(store, since)
            except ReplayRefused as e:
                raise CallError(W.E_INVALID, str(e)) from None
            pos = history.position_for_time(store, flt, since)
        elif a.get("lq_offset") is not None:      # where a light-queue offset of the filter is
            off = int(a["lq_offset"])
            e = lq.index.read(flt, max(off, lq.index.min_offset(flt)), 1)
            pos = e[0].phys_offset if e else store.dispatched_offset
        elif a.get("group"):
            pos = committed_position(str(a["group"]), flt)
        if pos is None:
            start = str(a.get("start") or "latest")
            if start not in ("earliest", "latest"):
                raise CallError(W.E_INVALID, f"start must be earliest or latest, got {start!r}")
            pos = store.min_offset if start == "earliest" else store.dispatched_offset
        return {"position": pos, "lq_offset": lq_offset_of(flt, pos)}

    def filter_commit(a: dict) -> dict:
        flt, group = flt_of(a), str(a["group"])
        if a.get("lq_offset") is not None:          # a light-queue offset (FilterConsumer.commit(int))
            off = int(a["lq_offset"])
            e = lq.index.read(flt, max(off, lq.index.min_offset(flt)), 1)
            pos, last = (e[0].phys_offset if e else store.dispatched_offset), None
        else:
            pos, last = int(a["position"]), a.get("last")
        if pos < 0:
            raise CallError(W.E_INVALID, f"position must be >= 0, got {pos}")
        meta.put_json(f"{_FP}{group}\0{flt}", {"position": pos, "last": last})
        off = lq_offset_of(flt, pos)
        if off is not None:                     # the light-queue offset too: lmqtt admin's lag
            meta.commit(group, lq_key(flt), off)
        return {"ok": True, "position": pos, "lq_offset": off}

    def filter_sources(a: dict) -> dict:
        flt = flt_of(a)
        at = a.get("position")        # optional: each queue's offset of that CommitLog position too
        out = []
        for fl, qid in history.sources(store, flt):
            lo, hi = store.consume_queue_offsets(fl, qid)
            row = [fl, qid, lo, hi]
            if at is not None:
                row.append(store.consume_queues.get(fl, qid).first_at_or_after(int(at)))
            out.append(row)
        return {"sources": out}

    def filter_range(a: dict):
        flt = flt_of(a)
        mc, mb = limits(a)
        fl, qid = str(a["topic"]), int(a.get("queue_id", 0))
        got, nxt = history.read_range(store, flt, fl, qid, int(a["start"]), int(a["end"]), mc, mb)
        lo, hi = store.consume_queue_offsets(fl, qid)
        return _reply({"next_offset": nxt, "min_offset": lo, "max_offset": hi}, got)

    for name, fn in (("filter_read", filter_read), ("filter_position", filter_position),
                     ("filter_commit", filter_commit), ("filter_sources", filter_sources),
                     ("filter_range", filter_range)):
        server.register_call(name, fn)


def _summary(rec) -> dict:
    """What `lmqtt admin` shows of a session record: `connected` is what the record says (written
    at CONNECT and at disconnect; a server that crashed leaves its sessions connected until it or,
    in a fleet, the store's session sweep says otherwise)."""
    return {"client_id": rec.client_id, "gateway": rec.host, "connected": rec.last_disconnect_ms is None,
            "last_disconnect_ms": rec.last_disconnect_ms, "expiry_interval": rec.expiry_interval,
            "subscriptions": len(rec.subscriptions)}
