"""`lmqtt admin --sessions` and `--session CLIENT_ID`: the persistent MQTT sessions the store keeps,
read over its native protocol (the `sessions` / `session` CALLs of store/node/sdk_service.py), from
`lmqtt store` (a fleet) or `lmqtt serve --store-port` alike; over several store groups (a `;`
list) from every group, where the gateways spread the records by client id.

Why: "my device gets nothing" is mostly one of three things an operator can read here without
touching the device: the session is gone (expired, or started clean), it is not subscribed to
what the publisher sends, or it is subscribed and behind (its committed offset far from its
queue's end: a slow or offline client, or a full in-flight window).
"""
from __future__ import annotations

import json
import sys
import time
from datetime import datetime, timezone

from lmqtt.lightqueue.records import NEVER_EXPIRES

PAGE = 500


def _duration(s: float) -> str:
    s = int(max(0, s))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            rest = s % size
            sub = {"d": ("h", 3600), "h": ("m", 60), "m": ("s", 1)}[unit]
            return f"{s // size}{unit}" + (f" {rest // sub[1]}{sub[0]}" if rest >= sub[1] else "")
    return f"{s}s"


def _state(r: dict, now_ms: int) -> tuple[str, str]:
    """(state, expires in) of a session summary."""
    exp = r["expiry_interval"]
    if r["connected"]:
        return "connected", "never" if exp == NEVER_EXPIRES else f"{_duration(exp)} after it leaves"
    away = (now_ms - r["last_disconnect_ms"]) / 1000
    if exp == NEVER_EXPIRES:
        left = "never"
    elif away >= exp:
        left = "expired"
    else:
        left = _duration(exp - away)
    return f"offline {_duration(away)}", left


def admin_sessions(conn, args, call, table, groups: list[tuple[str, object]] | None = None) -> int:
    """`call(conn, store, fn)`: console's error handling (exit codes); `table(headers, rows)`.
    `groups`: (name, connection) of each store group of a `;` list: the gateways spread the
    records over them by client id, so each group is asked and every row names its group."""
    if args.session:
        def one(c) -> dict | None:
            for name, g in groups or [(None, c)]:
                rec = g.cmd("session", client_id=args.session)["session"]
                if rec is not None:
                    return rec if name is None else {**rec, "store_group": name}
            return None
        r, code = call(conn, args.store, one)
        if code:
            return code
        return _print_session(r, args, table)

    def page_all(c, name: str | None = None) -> tuple[list[dict], bool]:
        out: list[dict] = []
        after = None
        while len(out) < args.limit:
            r = c.cmd("sessions", after=after, limit=min(PAGE, args.limit - len(out)))
            out += r["sessions"] if name is None else [{**x, "store_group": name} for x in r["sessions"]]
            after = r["next"]
            if after is None:
                return out, False
        return out, after is not None

    def every(c) -> tuple[list[dict], bool]:
        if groups is None:
            return page_all(c)
        per = [page_all(g, name) for name, g in groups]
        rows = sorted((x for got, _more in per for x in got), key=lambda x: x["client_id"])
        return rows[:args.limit], len(rows) > args.limit or any(more for _got, more in per)
    r, code = call(conn, args.store, every)
    if code:
        return code
    rows, more = r
    if args.format == "json":
        print(json.dumps({"sessions": rows, "truncated": more}, indent=2))
        return 0
    if not rows:
        print("(no persistent session)")
        return 0
    now = int(time.time() * 1000)
    grouped = groups is not None          # a column naming each record's store group
    print("\n".join(table(["client id", *(["store group"] if grouped else []), "gateway", "state", "expires in",
                           "subscriptions"],
                          [[x["client_id"], *([x["store_group"]] if grouped else []), x["gateway"] or "-",
                            *_state(x, now), x["subscriptions"]] for x in rows])))
    if more:
        print(f"(first {len(rows)} by client id; --limit N for more)")
    return 0


def _print_session(s: dict | None, args, table) -> int:
    if s is None:
        msg = f"lmqtt admin: no persistent session {args.session!r} (never created, ended clean, or expired)"
        if args.format == "json":
            print(json.dumps({"session": None}))
        print(msg, file=sys.stderr)
        return 1
    if args.format == "json":
        print(json.dumps({"session": s}, indent=2))
        return 0
    now = int(time.time() * 1000)
    state, left = _state(s, now)
    version = {3: "3.1", 4: "3.1.1", 5: "5.0"}.get(s["protocol_version"], str(s["protocol_version"]))
    since = ""
    if not s["connected"]:
        at = datetime.fromtimestamp(s["last_disconnect_ms"] / 1000, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        since = f" since {at}"
    where = f" (store group {s['store_group']})" if s.get("store_group") else ""
    print(f"session {s['client_id']}{where}: MQTT {version}, gateway {s['gateway'] or '-'}, {state}{since}, "
          f"expires in {left}")
    if not s["subscriptions"]:
        print("(no subscription)")
        return 0
    rows = []
    for sub in s["subscriptions"]:
        c = sub["committed_offset"]
        rows.append([sub["filter"], sub["qos"], sub["share_group"] or "-",
                     "-" if c is None else c, sub["max_offset"], "-" if sub["lag"] is None else sub["lag"]])
    print("\n".join(table(["filter", "qos", "group", "committed", "end", "lag"], rows)))
    return 0
