"""What the console shows, read from the gateway's live objects on the loop thread.

The broker is read through what it exposes (`connections`, `sessions`, a connection's `session`,
`identity`, `peer`, ...); the persistent sessions and their offsets through the embedded store's
light-queue metadata (`lmqtt serve`: gateway.lq), the same reads the store's `session` CALL makes
for `lmqtt admin --session` (store/node/sdk_service.py).
"""
from __future__ import annotations

import asyncio
import os
import resource
import shutil
import time
from collections import deque

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

    def __init__(self, gw) -> None:
        self.gw = gw
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
        b = self.gw.broker
        conns = sum(1 for c in b.connections if c.connected) if b is not None else 0
        return {"t": round(now["t"], 3), "connections": conns,
                "sessions": len(b.sessions) if b is not None else 0,
                "msg_in_s": rate("in"), "msg_out_s": rate("out"), "bytes_in_s": rate("bytes_in"),
                "bytes_out_s": rate("bytes_out"), "append_s": rate("appended"), "dispatch_lag_ms": lag_ms,
                "cpu_pct": round(rate("cpu") * 100, 1), "rss_mb": round(_rss_bytes() / 2**20, 1),
                "msg_in": now["in"], "msg_out": now["out"], **self.disk()}

    def disk(self) -> dict:
        """The data dir's size and its file system's free space, re-read every 10 s."""
        at, val = self._disk
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


def overview(gw, sampler: Sampler) -> dict:
    last = sampler.ring[-1] if sampler.ring else sampler.sample()
    cfg = gw.cfg
    return {"gateway": {"mqtt": "{}:{}".format(*gw.address) if getattr(gw, "address", None) else None,
                        "pid": os.getpid(), "flush_mode": cfg.flush_mode, "data_dir": os.path.abspath(cfg.data_dir),
                        "mode": "fleet gateway" if gw.remote else "lmqtt serve (embedded store)"},
            "now": last, "subscriptions": sum(len(s.subs) for s in gw.broker.sessions.values())}


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
            "inflight": len(s.outbound) if s is not None else 0,
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
    """Messages in a connected client's queues beyond what it has been sent (embedded store only)."""
    lq = getattr(gw, "lq", None)
    if lq is None:
        return
    b = gw.broker
    for r in rows:
        s = b.sessions.get(r["client_id"])
        if s is None:
            continue
        n = 0
        for qname, cur in list(s.cursors.items()):
            try:
                n += max(0, lq.max_offset(qname) - cur.next_offset)
            except Exception:  # noqa: BLE001 - a queue gone meanwhile counts nothing
                pass
        r["queued"] = n


def find_connection(gw, client_id: str):
    for c in list(gw.broker.connections):
        if c.connected and c.client_id == client_id:
            return c
    return None


def sessions(gw, limit: int = 500) -> dict:
    """Persistent sessions with each subscription's committed offset, queue end and lag."""
    lq = getattr(gw, "lq", None)
    if lq is None:
        return {"available": False, "why": "a fleet gateway: `lmqtt admin --store ... --sessions` reads the store",
                "sessions": []}
    md = lq.metadata
    out = []
    now_ms = int(time.time() * 1000)
    for rec in md.list_sessions(None, limit):
        own = md.get_offsets(rec.client_id)
        subs = []
        for sub in rec.subscriptions:
            committed = (md.get_offset(f"$share/{sub.share_group}", sub.filter) if sub.share_group
                         else own.get(sub.filter))
            end = lq.max_offset(sub.filter)
            subs.append({"filter": sub.filter, "qos": sub.qos, "share_group": sub.share_group,
                         "committed_offset": committed, "max_offset": end,
                         "lag": None if committed is None else max(0, end - committed)})
        connected = rec.last_disconnect_ms is None
        out.append({"client_id": rec.client_id, "connected": connected,
                    "protocol": {3: "3.1", 4: "3.1.1", 5: "5.0"}.get(rec.protocol_version, str(rec.protocol_version)),
                    "offline_s": None if connected else round((now_ms - rec.last_disconnect_ms) / 1000),
                    "expiry_interval": rec.expiry_interval, "subscriptions": subs,
                    "lag": sum(s["lag"] or 0 for s in subs)})
    return {"available": True, "sessions": out, "truncated": len(out) >= limit}


class Trace:
    """The message tracer: the messages matching a filter, from `since_ms` on, read from the
    embedded store's ConsumeQueues (the same history read as `$replay/` and the SDK's `since`,
    lightqueue/history.py and replay.read_history) and then followed as they arrive. Nothing is
    registered in the store (no light queue is created for the filter): each poll reads the
    ConsumeQueues of the filter's first-level topics from where the last one stopped.
    `allowed(topic)`: False hides a message (the user's ACL would not let them read it)."""

    MAX_PER_POLL = 200

    def __init__(self, gw, flt: str, since_ms: int, allowed=None) -> None:
        from lmqtt.lightqueue import history
        from lmqtt.lightqueue.topics import validate_filter
        validate_filter(flt)            # ValueError-like InvalidTopic with the reason
        self.gw, self.flt, self.since_ms = gw, flt, int(since_ms)
        self.allowed = allowed
        self._history = history
        self.cursor = {"filter": flt, "seam": 1 << 62, "end": 1 << 62, "sources": []}
        self._known: set[tuple[str, int]] = set()

    def _refresh_sources(self) -> None:
        store = self.gw.store
        for fl, qid in self._history.sources(store, self.flt):
            if (fl, qid) not in self._known:
                self._known.add((fl, qid))
                self.cursor["sources"].append([fl, qid, self._history.cq_offset_for_time(store, fl, qid, self.since_ms)])

    def poll(self) -> list[dict]:
        from lmqtt.lightqueue.replay import read_history
        from lmqtt.store.client.props import decode_fields
        self._refresh_sources()
        if not self.cursor["sources"]:
            return []
        msgs, self.cursor, _done = read_history(self.gw.store, self.cursor, max_count=self.MAX_PER_POLL)
        out = []
        for m in msgs:
            if self.allowed is not None and not self.allowed(m.topic):
                continue
            try:
                qos, retain, client_id, pfi, expiry, ctype, resp, corr, user = decode_fields(m.props)
            except ValueError:
                qos, retain, client_id, pfi, expiry, ctype, resp, corr, user = 0, False, "", None, None, None, None, None, []
            body = bytes(m.body)
            try:
                text, binary = body[:2048].decode("utf-8"), False
            except UnicodeDecodeError:
                text, binary = body[:64].hex(" "), True
            out.append({"topic": m.topic, "payload": text, "binary": binary, "size": len(body),
                        "truncated": len(body) > 2048, "qos": qos, "retain": retain, "client_id": client_id,
                        "store_ts": m.store_ts, "content_type": ctype, "response_topic": resp,
                        "message_expiry_interval": expiry,
                        "user_properties": [list(p) for p in user]})
        return out


class TopicRates:
    """Messages stored per first-level topic (the ConsumeQueues' ends) and their rate since the
    previous look: computed when the topics page asks (every 2 s while it is open), nothing
    otherwise."""

    def __init__(self, gw) -> None:
        self.gw = gw
        self._prev: tuple[float, dict[str, int]] | None = None

    def snapshot(self, limit: int = 200) -> dict:
        store = getattr(self.gw, "store", None)
        if store is None:
            return {"available": False, "topics": []}
        totals: dict[str, int] = {}
        for (fl, _qid), end in store.consume_queues.max_offsets().items():
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


def retained(gw, flt: str, allowed=None, limit: int = 200) -> dict:
    """Retained messages matching `flt` (topic order, at most `limit`), payload previews."""
    from lmqtt.store.client.props import decode_fields
    lq = getattr(gw, "lq", None)
    if lq is None:
        return {"available": False, "messages": []}
    out, hidden = [], 0
    for batch in lq.metadata.retained_batches(flt):
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


def groups(sdk) -> dict:
    """Consumer groups of the SDK service (`lmqtt serve`'s store port): each queue's committed
    offset, end and lag (the `lag` CALL of `lmqtt admin --group`), with the POP state of a
    ConsumeQueue (`pop_info`: next, in flight, backlog) and the group's dead letters (the end of
    its `%DLQ%group` queue)."""
    if sdk is None:
        return {"available": False, "why": "no SDK store port (--store-port 0 or unavailable): groups are the "
                                           "SDK service's", "groups": []}
    calls = sdk.calls
    out = []
    for g in calls["stats"]({}).get("groups", [])[:200]:
        rows = calls["lag"]({"group": g})["queues"]
        for r in rows:
            if "topic" in r:
                try:
                    r["pop"] = calls["pop_info"]({"group": g, "topic": r["topic"], "queue_id": r["queue_id"]})
                except Exception:  # noqa: BLE001 - no POP state: a plain offset group
                    r["pop"] = None
        try:
            dead = calls["offsets"]({"topic": f"%DLQ%{g}", "queue_id": 0})["max_offset"]
        except Exception:  # noqa: BLE001 - no dead letter queue yet
            dead = 0
        out.append({"group": g, "queues": rows, "lag": sum(r["lag"] for r in rows), "dead_letters": dead})
    return {"available": True, "groups": out}
