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
                    time is, and its messages from the log (`FilterConsumer(since=...)`)
  CALL sessions     a page of the persistent MQTT sessions (`lmqtt admin --sessions`): client id,
                    gateway, connected or since when not, expiry, number of subscriptions
  CALL session      one session in full (`lmqtt admin --session ID`): each subscription with its
                    committed offset, its queue's end and the lag between them
"""
from __future__ import annotations

import logging

from lmqtt.store.server import Messages, StoreServer

from lmqtt.lightqueue.light_queue_store import LightQueueStore
from lmqtt.lightqueue.replay import call_handlers
from lmqtt.lightqueue.topics import validate_filter

log = logging.getLogger("lmqtt.store.node.sdk_service")

_PREFIX = "f\0"


def install(server: StoreServer, lq: LightQueueStore) -> None:
    meta = server.meta
    held: set[str] = set()

    def ensure(flt: str) -> None:
        if flt in held:
            return
        if lq.registry.refcount(flt) == 0 or meta.get_json(_PREFIX + flt) is None:
            lq.register_filter(flt)
            meta.put_json(_PREFIX + flt, 1)
        held.add(flt)

    for key in meta.keys_with_prefix(_PREFIX):
        flt = key[len(_PREFIX):]
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
        if meta.get_json(_PREFIX + flt) is None:
            return {"ok": False}
        meta._db.delete((_PREFIX + flt).encode())
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
    replay, replay_read = call_handlers(server.store, lq)
    server.register_call("replay", replay)
    server.register_call("replay_read", replay_read)


def _summary(rec) -> dict:
    """What `lmqtt admin` shows of a session record: `connected` is what the record says (written
    at CONNECT and at disconnect; a server that crashed leaves its sessions connected until it or,
    in a fleet, the store's session sweep says otherwise)."""
    return {"client_id": rec.client_id, "gateway": rec.host, "connected": rec.last_disconnect_ms is None,
            "last_disconnect_ms": rec.last_disconnect_ms, "expiry_interval": rec.expiry_interval,
            "subscriptions": len(rec.subscriptions)}
