"""What the console shows, read from the gateway's live objects on the loop thread.

The broker is read through what it exposes (`connections`, `sessions`, a connection's `session`,
`identity`, `peer`, ...); the store of `lmqtt serve` through its in-process store node
(`gateway.embedded`, store/node/embedded.py): the storage facades for the persistent sessions'
offsets, queue ends and retained messages (the reads the store's `session` CALL makes for
`lmqtt admin --session`), the node's own functions for its counters, topics and the tracer's
history. Nothing here imports the engine or the light queues.
"""
from __future__ import annotations

import asyncio
import os
import resource
import shutil
import time
from collections import deque

from lmqtt.lightqueue.topics import validate_filter
from lmqtt.store.client.props import decode_fields

from .fleet import StoreUnavailable

RING = 3600          # one sample a second: the last hour
_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _dir_size(path: str, limit: int = 20000) -> int:
    total = n = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            n += 1
            if n > limit:
                return total
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


class Sampler:
    """A sample a second into a ring of the last hour: counters as rates, gauges as values."""

    def __init__(self, gw, store_stats=None) -> None:
        """`store_stats`: a fleet gateway's (it has no data dir of its own) coroutine function
        answering the store's `stats`, read for the data and disk figures instead."""
        self.gw = gw
        self.store_stats = store_stats
        self._asking = False
        self.ring: deque[dict] = deque(maxlen=RING)
        self._prev = None
        self._handle = None
        self._disk = (0.0, None)
        self.listeners: set[asyncio.Queue] = set()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._tick()

    def stop(self) -> None:
        for q in list(self.listeners):       # the open event streams end (None) before the server stops
            q.put_nowait(None)
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _counters(self) -> dict:
        m = self.gw.metrics
        t = os.times()
        return {"t": time.time(), "mono": time.monotonic(), "in": sum(m.msg_in), "out": sum(m.msg_out),
                "bytes_in": m.bytes_in, "bytes_out": m.bytes_out, "appended": m.append_batch_size.sum,
                "lag_sum": m.dispatch_lag.sum, "lag_n": sum(m.dispatch_lag.counts),
                "cpu": t.user + t.system}

    def _tick(self) -> None:
        try:
            self.ring.append(self.sample())
            for q in list(self.listeners):
                if q.qsize() < 4:
                    q.put_nowait(self.ring[-1])
        finally:
            self._handle = self._loop.call_later(1.0, self._tick)

    def sample(self) -> dict:
        now = self._counters()
        prev, self._prev = self._prev, now
        dt = (now["mono"] - prev["mono"]) if prev else 0.0
        rate = (lambda k: round((now[k] - prev[k]) / dt, 1)) if dt > 0 else (lambda k: 0.0)
        lag_n = now["lag_n"] - prev["lag_n"] if prev else 0
        lag_ms = round((now["lag_sum"] - prev["lag_sum"]) / lag_n * 1000, 2) if lag_n > 0 else None
        # counts kept as clients come and go: a sample a second must not walk every session or
        # connection (a gateway holding 15,000 idle devices spent 5 ms a second on it)
        b = self.gw.broker
        conns = self.gw.metrics.connections if b is not None else 0
        reg = b.session_registry if b is not None else None
        known = reg.count() if reg is not None else 0
        dormant = len(getattr(reg, "dormant", {})) if reg is not None else 0
        return {"t": round(now["t"], 3), "connections": conns, "sessions": known, "sessions_dormant": dormant,
                "msg_in_s": rate("in"), "msg_out_s": rate("out"), "bytes_in_s": rate("bytes_in"),
                "bytes_out_s": rate("bytes_out"), "append_s": rate("appended"), "dispatch_lag_ms": lag_ms,
                "cpu_pct": round(rate("cpu") * 100, 1), "rss_mb": round(_rss_bytes() / 2**20, 1),
                "msg_in": now["in"], "msg_out": now["out"], **self.disk()}

    def disk(self) -> dict:
        """The data dir's size and its file system's free space, re-read every 10 s (a fleet
        gateway: the store's CommitLog size and free disk, as its last `stats` said)."""
        at, val = self._disk
        if self.store_stats is not None:
            if (val is None or time.monotonic() - at > 10) and not self._asking:
                self._asking = True
                asyncio.ensure_future(self._ask_store())
            return val or {"data_mb": None, "disk_free_mb": None, "disk_total_mb": None}
        if val is None or time.monotonic() - at > 10:
            d = self.gw.cfg.data_dir
            try:
                du = shutil.disk_usage(d)
                val = {"data_mb": round(_dir_size(d) / 2**20, 1), "disk_free_mb": round(du.free / 2**20),
                       "disk_total_mb": round(du.total / 2**20)}
            except OSError:
                val = {"data_mb": None, "disk_free_mb": None, "disk_total_mb": None}
            self._disk = (time.monotonic(), val)
        return val


    async def _ask_store(self) -> None:
        try:
            st = await self.store_stats()
            val = {"data_mb": round((st["max_offset"] - st["min_offset"]) / 2**20, 1),
                   "disk_free_mb": round(st["disk_free_bytes"] / 2**20)
                   if st.get("disk_free_bytes") is not None else None, "disk_total_mb": None}
            self._disk = (time.monotonic(), val)
        except Exception:  # noqa: BLE001 - the store unreachable: asked again at the next sample
            pass
        finally:
            self._asking = False


def overview(gw, sampler: Sampler) -> dict:
    last = sampler.ring[-1] if sampler.ring else sampler.sample()
    cfg = gw.cfg
    return {"gateway": {"mqtt": "{}:{}".format(*gw.address) if getattr(gw, "address", None) else None,
                        "pid": os.getpid(), "flush_mode": cfg.flush_mode,
                        # a fleet gateway keeps no data: its store is where the data is
                        "data_dir": None if gw.remote else os.path.abspath(cfg.data_dir),
                        "store": cfg.store_address if gw.remote else None,
                        "mode": "fleet gateway" if gw.remote else "lmqtt serve (embedded store)"},
            "now": last, "subscriptions": session_counts(gw.broker)[2]}


def session_counts(b) -> tuple[int, int, int]:
    """(sessions, of which dormant, subscriptions) of the broker `b`: a persistent session restored
    at start and not built yet (dormant: gateway/clients/session_persistence.py `Dormant`, its client
    not back) counts with its subscriptions, as `$SYS` and `lmqtt_sessions` count it."""
    if b is None:
        return 0, 0, 0
    reg = b.session_registry
    dormant = getattr(reg, "dormant", {})
    subs = sum(s.subscription_count() for s in reg.sessions.values()) + sum(len(d.subs) // 2 for d in dormant.values())
    return reg.count(), len(dormant), subs


def _client_row(c, now_loop: float) -> dict:
    s = c.session
    ident = c.identity
    subs = []
    queued = 0
    if s is not None:
        subs = [{"filter": f, "qos": getattr(sub, "qos", None)} for f, sub in s.subs.items()]
    return {"client_id": c.client_id, "username": getattr(ident, "username", None), "address": c.peer,
            "protocol": {3: "3.1", 4: "3.1.1", 5: "5.0"}.get(c.version, str(c.version)),
            "keepalive": c.keepalive, "subscriptions": subs,
            "inflight": s.inflight_count() if s is not None else 0,
            "queued": queued, "persistent": bool(s is not None and s.expiry_interval),
            "idle_s": round(max(0.0, now_loop - c.last_rx), 1),
            "connected_s": round(max(0.0, now_loop - c.accepted_at), 1)}


def clients(gw, q: str = "", limit: int = 500) -> dict:
    b = gw.broker
    now = b.loop.time()
    q = q.strip().lower()
    rows, total = [], 0
    for c in list(b.connections):
        if not c.connected:
            continue
        total += 1
        if q and not any(q in (v or "").lower() for v in (c.client_id, getattr(c.identity, "username", None), c.peer)):
            continue
        if len(rows) < limit:
            rows.append(_client_row(c, now))
    rows.sort(key=lambda r: r["client_id"] or "")
    _queued(gw, rows)
    return {"total": total, "shown": len(rows), "clients": rows}


def _queued(gw, rows: list[dict]) -> None:
    """Messages in a connected client's queues beyond what it has been sent: the embedded store's
    queue ends, or a fleet gateway's mirror of the queues it serves (the end the store last told
    it; a queue it does not mirror is not asked for here)."""
    node = gw.embedded
    storage = gw.storage
    mirrors = storage.queues if node is None and storage is not None else None
    if node is None and mirrors is None:
        return

    def end(qname: str) -> int | None:
        if node is not None:
            return node.storage.queues.max_offset(qname).result()
        if qname not in mirrors:
            return None
        a = storage.end_offset(qname)
        return a.result() if a.done() else None
    b = gw.broker
    for r in rows:
        s = b.sessions.get(r["client_id"])
        if s is None:
            continue
        n = 0
        for qname, cur in list(s.cursors.items()):
            try:
                e = end(qname)
            except Exception:  # noqa: BLE001 - a queue gone meanwhile counts nothing
                e = None
            if e is not None:
                n += max(0, e - cur.next_offset)
        r["queued"] = n


def find_connection(gw, client_id: str):
    for c in list(gw.broker.connections):
        if c.connected and c.client_id == client_id:
            return c
    return None


def sessions(gw, limit: int = 500) -> dict:
    """Persistent sessions with each subscription's committed offset, queue end and lag."""
    node = gw.embedded
    if node is None:
        return {"available": False, "why": "a fleet gateway: `lmqtt admin --store ... --sessions` reads the store",
                "sessions": []}
    offsets, ends = node.storage.offsets, node.storage.queues
    out = []
    now_ms = int(time.time() * 1000)
    reg = gw.broker.session_registry if gw.broker is not None else None
    for rec in node.session_page(limit):
        own = offsets.get_all(rec.client_id).result()
        subs = []
        for sub in rec.subscriptions:
            committed = (offsets.get(f"$share/{sub.share_group}", sub.filter).result() if sub.share_group
                         else own.get(sub.filter))
            end = ends.max_offset(sub.filter).result()
            subs.append({"filter": sub.filter, "qos": sub.qos, "share_group": sub.share_group,
                         "committed_offset": committed, "max_offset": end,
                         "lag": None if committed is None else max(0, end - committed)})
        # the live state where the broker knows it: a record of a session connected when the
        # gateway was killed still says "connected", while its session waits dormant here
        d = reg.dormant.get(rec.client_id) if reg is not None else None
        live = reg.sessions.get(rec.client_id) if reg is not None else None
        connected = (live is not None and live.online) if reg is not None else rec.last_disconnect_ms is None
        last_ms = d.last_ms if d is not None else rec.last_disconnect_ms
        out.append({"client_id": rec.client_id, "connected": connected, "dormant": d is not None,
                    "protocol": {3: "3.1", 4: "3.1.1", 5: "5.0"}.get(rec.protocol_version, str(rec.protocol_version)),
                    "offline_s": None if connected or last_ms is None else round((now_ms - last_ms) / 1000),
                    "expiry_interval": rec.expiry_interval, "subscriptions": subs,
                    "lag": sum(s["lag"] or 0 for s in subs)})
    return {"available": True, "sessions": out, "truncated": len(out) >= limit}


class Trace:
    """The message tracer of `lmqtt serve`: the messages matching a filter, from `since_ms` on,
    read by the in-process store node (store/node/embedded.py `HistoryTrace`: the ConsumeQueues'
    history, the same read as `$replay/` and the SDK's `since`) and then followed as they arrive.
    Nothing is registered in the store (no light queue is created for the filter).
    `allowed(topic)`: False hides a message (the user's ACL would not let them read it)."""

    MAX_PER_POLL = 200

    def __init__(self, gw, flt: str, since_ms: int, allowed=None) -> None:
        self.gw, self.flt, self.since_ms = gw, flt, int(since_ms)
        self.allowed = allowed
        self.history = gw.embedded.trace(flt, since_ms)     # an invalid filter: its reason (InvalidTopicFilter)

    def poll(self) -> list[dict]:
        return [trace_row(m.topic, m.props, m.body, m.store_ts) for m in self.history.poll(self.MAX_PER_POLL)
                if self.allowed is None or self.allowed(m.topic)]

    async def apoll(self) -> list[dict]:
        return self.poll()


def trace_row(topic: str, props, payload, store_ts: int) -> dict:
    """One traced message as the tracer page shows it (payload preview, MQTT properties)."""
    try:
        qos, retain, client_id, _pfi, expiry, ctype, resp, _corr, user = decode_fields(props)
    except ValueError:
        qos, retain, client_id, expiry, ctype, resp, user = 0, False, "", None, None, None, []
    body = bytes(payload)
    try:
        text, binary = body[:2048].decode("utf-8"), False
    except UnicodeDecodeError:
        text, binary = body[:64].hex(" "), True
    return {"topic": topic, "payload": text, "binary": binary, "size": len(body),
            "truncated": len(body) > 2048, "qos": qos, "retain": retain, "client_id": client_id,
            "store_ts": store_ts, "content_type": ctype, "response_topic": resp,
            "message_expiry_interval": expiry, "user_properties": [list(p) for p in user]}


class TopicRates:
    """Messages stored per first-level topic (the ConsumeQueues' ends) and their rate since the
    previous look: computed when the topics page asks (every 2 s while it is open), nothing
    otherwise."""

    def __init__(self, gw, fleet=None) -> None:
        self.gw, self.fleet = gw, fleet
        self._prev: tuple[float, dict[str, int]] | None = None

    async def _ends(self) -> dict:
        """{(first-level topic, queue id): end}: the embedded store's, or the store's `topics` CALL."""
        node = self.gw.embedded
        if node is not None:
            return node.topic_ends()
        if self.fleet is None or not self.fleet.remote:
            return {}
        ends: dict = {}
        for _group, got in await self.fleet.call_each("topics"):     # every store group's topics
            if isinstance(got, StoreUnavailable):
                raise got
            for q in got.get("queues", []):
                key = (q["topic"], q["queue_id"])     # a system topic ($timer, %DLQ%) may be in several
                ends[key] = ends.get(key, 0) + q["max_offset"]
        return ends

    async def snapshot(self, limit: int = 200) -> dict:
        if self.gw.embedded is None and (self.fleet is None or not self.fleet.remote):
            return {"available": False, "topics": []}
        try:
            ends = await self._ends()
        except StoreUnavailable as e:
            return {"available": False, "why": str(e), "topics": []}
        totals: dict[str, int] = {}
        for (fl, _qid), end in ends.items():
            if not fl.startswith("$"):
                totals[fl] = totals.get(fl, 0) + end
        now = time.monotonic()
        prev, self._prev = self._prev, (now, totals)
        rows = []
        for fl, n in totals.items():
            rate = None
            if prev is not None and now > prev[0]:
                rate = round(max(0, n - prev[1].get(fl, 0)) / (now - prev[0]), 1)
            rows.append({"topic": fl, "stored": n, "rate": rate})
        rows.sort(key=lambda r: (-(r["rate"] or 0), -r["stored"], r["topic"]))
        return {"available": True, "count": len(rows), "topics": rows[:limit]}


async def retained(gw, flt: str, allowed=None, limit: int = 200) -> dict:
    """Retained messages matching `flt` (topic order, at most `limit`), payload previews: the
    embedded store's metadata read in batches, or a fleet gateway's retained facade (the store's
    gw_retained_matching)."""
    node = gw.embedded
    if node is not None:
        validate_filter(flt)
        return _retained_rows(node.storage.retained.batches(flt).result(), allowed, limit)
    storage = gw.storage
    if storage is None:
        return {"available": False, "messages": []}
    validate_filter(flt)             # the reason in one line before the store is asked
    found = await storage.metadata.retained.matching(flt)
    return _retained_rows((found,), allowed, limit)


def _retained_rows(batches, allowed, limit: int) -> dict:
    out, hidden = [], 0
    for batch in batches:
        for topic, payload, props in batch:
            if allowed is not None and not allowed(topic):
                hidden += 1
                continue
            try:
                qos = decode_fields(props)[0]
            except ValueError:
                qos = 0
            body = bytes(payload)
            try:
                text, binary = body[:512].decode("utf-8"), False
            except UnicodeDecodeError:
                text, binary = body[:32].hex(" "), True
            out.append({"topic": topic, "qos": qos, "size": len(body), "payload": text, "binary": binary,
                        "truncated": len(body) > 512})
            if len(out) >= limit:
                return {"available": True, "messages": out, "truncated": True}
    return {"available": True, "messages": out, "truncated": False}


def member_row(gw, fleet, sampler, ready) -> dict:
    """This gateway as a member of the fleet (the overview's table, and a peer's answer)."""
    last = sampler.ring[-1] if sampler.ring else sampler.sample()
    b = gw.broker
    ok, why = ready() if ready is not None else ((b is not None and b.accepting),
                                                 "ready" if b is not None and b.accepting else "not accepting MQTT clients")
    return {"gateway": fleet.gateway_id, "url": fleet.url, "pid": os.getpid(),
            "mqtt": "{}:{}".format(*gw.address) if getattr(gw, "address", None) else None,
            "ready": ok, "health": why, "connections": last["connections"], "sessions": last["sessions"],
            "subscriptions": session_counts(b)[2],
            "msg_in_s": last["msg_in_s"], "msg_out_s": last["msg_out_s"], "cpu_pct": last["cpu_pct"],
            "rss_mb": last["rss_mb"]}
