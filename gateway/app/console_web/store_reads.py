"""What the store keeps, read for the console of a fleet gateway (docs/console.md "Where it
runs"): the store's overview (its members, roles, tier), the consumer groups, the persistent
sessions and the tracer's history, through the CALLs `lmqtt admin` makes - over every store group
the gateway uses (docs/groups.md). The gateway's own figures (samples, clients) are data.py's."""
from __future__ import annotations

import asyncio
import functools
import time

from lmqtt.lightqueue.topics import validate_filter
from lmqtt.store import protocol as W
from lmqtt.store.client.consumer import decode_reply

from .data import trace_row
from .fleet import StoreUnavailable


class RemoteTrace:
    """The tracer of a fleet gateway: the store's filter history read by CommitLog position, as the
    SDK's FilterConsumer does (`filter_position` with `since`, then `filter_read` from where the
    last read stopped: the history, then each new message as it is stored). Nothing is registered
    in the store (no `subscribe`: the read scans the filter's ConsumeQueues)."""

    MAX_PER_POLL = 200

    def __init__(self, fleet, flt: str, since_ms: int, allowed=None, link=None) -> None:
        validate_filter(flt)
        self.fleet, self.flt, self.since_ms, self.allowed = fleet, flt, int(since_ms), allowed
        self.link = link          # the store group read (None: the first)
        self.position: int | None = None
        self.hint = None

    async def start(self) -> None:
        """Where `since` is in the log (the store refuses a time outside its retention: StoreUnavailable)."""
        r = await self.fleet.call_at(self.link, "filter_position", filter=self.flt, since=self.since_ms)
        self.position, self.hint = int(r["position"]), r.get("lq_offset")

    async def apoll(self) -> list[dict]:
        out: list[dict] = []
        for _ in range(8):            # a stretch of other topics reads nothing and moves on
            before = self.position
            op, flags, body = await self.fleet.call_raw("filter_read", self.link, filter=self.flt,
                                                       position=self.position, max_count=self.MAX_PER_POLL,
                                                       hint=self.hint)
            if op != W.OP_MESSAGES:
                return out
            # either layout (F_RAW: the CommitLog's own records), decoded by the SDK's decoder
            header, recs = decode_reply(None, body, flags)
            self.position, self.hint = int(header["position"]), header.get("hint")
            for r in recs:
                if self.allowed is None or self.allowed(r.topic):
                    out.append(trace_row(r.topic, r.props, r.body, r.store_ts))
            if recs or self.position == before:
                return out
        return out


class GroupsTrace:
    """The tracer of a gateway over several store groups (docs/groups.md): the filter's history
    read in every group (a topic lives in one group; a filter whose first level is a wildcard
    matches topics of several), each poll's messages merged by the time they were stored."""

    MAX_PER_POLL = RemoteTrace.MAX_PER_POLL

    def __init__(self, fleet, flt: str, since_ms: int, allowed=None) -> None:
        self.parts = [RemoteTrace(fleet, flt, since_ms, allowed, link) for link in fleet.links()]

    async def start(self) -> None:
        await asyncio.gather(*(t.start() for t in self.parts))

    async def apoll(self) -> list[dict]:
        got = await asyncio.gather(*(t.apoll() for t in self.parts))
        return sorted((m for part in got for m in part), key=lambda m: m["store_ts"])


def remote_trace(fleet, flt: str, since_ms: int, allowed=None) -> "RemoteTrace | GroupsTrace":
    """The tracer of a fleet gateway: over its one store, or over every store group it uses."""
    if len(fleet.links()) > 1:
        return GroupsTrace(fleet, flt, since_ms, allowed)
    return RemoteTrace(fleet, flt, since_ms, allowed)


async def groups(fleet) -> dict:
    """Consumer groups of the SDK service (the store's; what `lmqtt admin --group` reads): each
    queue's committed offset, end and lag (the `lag` CALL), with the POP state of a ConsumeQueue
    (next offset, messages invisible now, backlog); groups that only POP and never commit (the
    `pop_groups` CALL) too; and each group's dead letters (the end of its `%DLQ%group` queue).
    Over several store groups (docs/groups.md) every store group is asked, a consumer group's
    queues gathered from all of them (each row with its `store_group`)."""
    links = fleet.links() if fleet.remote else []
    if len(links) <= 1:
        return await _groups_of(fleet.call)
    parts = await asyncio.gather(*(_groups_of(functools.partial(fleet.call_at, link)) for link in links))
    why = [p["why"] for p in parts if not p["available"]]
    if len(why) == len(parts):
        return {"available": False, "why": "; ".join(why), "groups": []}
    merged: dict[str, dict] = {}
    for link, part in zip(links, parts):
        name = fleet.group_name(link)
        for g in part["groups"]:
            for r in g["queues"]:
                r["store_group"] = name
            m = merged.get(g["group"])
            if m is None:
                merged[g["group"]] = g
            else:
                m["queues"].extend(g["queues"])
                m["lag"] += g["lag"]
                m["dead_letters"] += g["dead_letters"]
                if not g.get("pop_only"):
                    m.pop("pop_only", None)
    out = {"available": True, "groups": sorted(merged.values(), key=lambda x: x["group"])}
    if why:
        out["why"] = "; ".join(why)       # the groups that could answer are shown
    return out


async def _groups_of(call) -> dict:
    """`groups` of one store: `call(name, **args)` asks it."""
    try:
        names = (await call("stats")).get("groups", [])[:200]
        pops = await call("pop_groups")
    except StoreUnavailable as e:
        return {"available": False, "why": str(e), "groups": []}
    pop_of = {(r["group"], r["topic"], r["queue_id"]): r for r in pops.get("pop", [])}
    dead = pops.get("dead_letters", {})
    out, seen = [], set()
    for g in names:
        try:
            rows = (await call("lag", group=g))["queues"]
        except StoreUnavailable:
            rows = []
        for r in rows:
            if "topic" in r:
                p = pop_of.pop((g, r["topic"], r["queue_id"]), None)
                r["pop"] = {k: p[k] for k in ("next", "inflight", "backlog")} if p else None
        seen.add(g)
        out.append({"group": g, "queues": rows, "lag": sum(r["lag"] for r in rows),
                    "dead_letters": dead.get(g, 0) if g in dead else await _dead_letters(call, g)})
    # groups that only POP (no committed offset): their POP state is where they are
    pop_only: dict[str, list] = {}
    for (g, t, q), p in sorted(pop_of.items()):
        pop_only.setdefault(g, []).append({"topic": t, "queue_id": q, "committed": None,
                                           "max_offset": p["next"] + p["backlog"], "lag": p["backlog"],
                                           "pop": {k: p[k] for k in ("next", "inflight", "backlog")}})
    for g, rows in pop_only.items():
        if g in seen:            # a POP queue of a group that also commits elsewhere
            next(x for x in out if x["group"] == g)["queues"].extend(rows)
            continue
        out.append({"group": g, "queues": rows, "lag": sum(r["lag"] for r in rows), "pop_only": True,
                    "dead_letters": dead.get(g, 0)})
    out.sort(key=lambda x: x["group"])
    return {"available": True, "groups": out}


async def _dead_letters(call, g: str) -> int:
    try:
        return (await call("offsets", topic=f"%DLQ%{g}", queue_id=0))["max_offset"]
    except (StoreUnavailable, KeyError, TypeError):
        return 0


async def sessions_remote(fleet, limit: int = 200) -> dict:
    """`sessions` of a fleet gateway: the store's `sessions` and `session` CALLs (lmqtt admin),
    of every store group (the records are spread over them by client id: each asked where it
    is), each row naming its group over several."""
    links = fleet.links()
    try:
        if len(links) <= 1:
            listed = (await fleet.call("sessions", limit=limit))["sessions"]
            full = await asyncio.gather(*(fleet.call("session", client_id=r["client_id"]) for r in listed))
            where = [None] * len(full)
            truncated = len(listed) >= limit
        else:
            per = await asyncio.gather(*(fleet.call_at(link, "sessions", limit=limit) for link in links))
            asks = [(link, r["client_id"]) for link, got in zip(links, per) for r in got["sessions"]]
            truncated = any(len(got["sessions"]) >= limit for got in per)
            full = await asyncio.gather(*(fleet.call_at(link, "session", client_id=cid) for link, cid in asks))
            where = [fleet.group_name(link) for link, _cid in asks]
    except StoreUnavailable as e:
        return {"available": False, "why": str(e), "sessions": []}
    now_ms = int(time.time() * 1000)
    out = []
    for r, group in zip(full, where):
        rec = r.get("session")
        if rec is None:          # gone between the two calls
            continue
        subs = [{k: x.get(k) for k in ("filter", "qos", "share_group", "committed_offset", "max_offset", "lag")}
                for x in rec["subscriptions"]]
        connected = rec["connected"]
        out.append({"client_id": rec["client_id"], "connected": connected, "gateway": rec.get("gateway"),
                    "protocol": {3: "3.1", 4: "3.1.1", 5: "5.0"}.get(rec.get("protocol_version"),
                                                                     str(rec.get("protocol_version"))),
                    "offline_s": None if connected or rec.get("last_disconnect_ms") is None
                    else round((now_ms - rec["last_disconnect_ms"]) / 1000),
                    "expiry_interval": rec.get("expiry_interval"), "subscriptions": subs,
                    "lag": sum(s["lag"] or 0 for s in subs)})
        if group is not None:
            out[-1]["store_group"] = group
    return {"available": True, "sessions": out, "truncated": truncated}


async def store_overview(gw, fleet) -> dict:
    """The store: where, its counters (log end, dispatch lag, disk), the store group's members and
    roles (a replicated group: docs/ha.md) and the tier's use. Over several store groups
    (docs/groups.md): the first group's at the top level, every group's (with its `group` name)
    under `groups`."""
    links = fleet.links() if fleet.remote else []
    if len(links) <= 1:
        return await _store_of(gw, fleet.call, fleet.store_where())

    async def one(link) -> dict:
        out = await _store_of(None, functools.partial(fleet.call_at, link), fleet.store_where(link))
        out["group"] = fleet.group_name(link)
        return out
    every = await asyncio.gather(*(one(link) for link in links))
    return {**every[0], "groups": every}


async def _store_of(gw, call, where: str) -> dict:
    """`store_overview` of one store: `call(name, **args)` asks it (`gw`: lmqtt serve's, embedded)."""
    out: dict = {"where": where, "error": None, "ha": None, "members": None, "tier": None}
    try:
        if gw is not None and gw.embedded is not None:
            st = gw.embedded.stats()
            tier = gw.embedded.tier_stats()
        else:
            st = await call("stats")
            tier = (await call("tier")).get("tier")
    except StoreUnavailable as e:
        out["error"] = str(e)
        return out
    out["stats"] = {k: st.get(k) for k in ("max_offset", "dispatch_lag_bytes", "segments", "disk_free_bytes",
                                           "disk_full", "disk_full_reason", "connections", "recoveries")}
    ha = st.get("ha")
    if ha:
        out["ha"] = ha
        members = [{"node": ha.get("node"), "role": ha.get("role"), "address": ha.get("primary_address"),
                    "in_sync": ha.get("node") in (ha.get("in_sync") or []), "lag_bytes": 0}]
        try:
            status = await call("ha_status")
        except StoreUnavailable:
            status = {}
        for r in status.get("replicas", []):
            members.append({"node": r["node"], "role": "replica", "connected": r.get("connected"),
                            "in_sync": r["node"] in (ha.get("in_sync") or []), "lag_bytes": r.get("lag_bytes")})
        out["members"] = members
    if tier:
        out["tier"] = {k: tier.get(k) for k in ("url", "reachable", "error", "local_segments", "local_bytes",
                                                "uploading_segments", "tier_segments", "tier_stored_bytes",
                                                "tier_raw_bytes", "oldest_readable_ms")}
    return out
