"""`lmqtt admin --tier`: the store's tiered storage (store/tier) read over its native protocol (the
`tier` CALL of store/server.py): what is on the local disk, waiting for upload, in the tier, and
the oldest time still readable."""
from __future__ import annotations

import json
from datetime import datetime, timezone


def _mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f} MB"


def _when(ms) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _span(ms, size) -> str:
    parts = []
    if ms is not None:
        parts.append(f"{ms / 3_600_000:g} h" if ms >= 3_600_000 else f"{ms / 1000:g} s")
    if size is not None:
        parts.append(_mb(size))
    return " or ".join(parts) if parts else "forever"


def render(t: dict) -> str:
    state = "reachable" if t["reachable"] else f"NOT REACHABLE: {t['error']}" if t["error"] else "connecting"
    rows = [
        ("tier", f"{t['url']} ({state}; codec {t['codec']})"),
        ("local", f"{t['local_segments']} segment(s), {_mb(t['local_bytes'])}, from offset {t['local_min_offset']}"
                  f" (oldest {_when(t['local_oldest_ms'])}); kept {_span(t['local_retention_ms'], t['local_retention_bytes'])}"
                  f" once uploaded"),
        ("uploading", f"{t['uploading_segments']} sealed segment(s) waiting, {_mb(t['uploading_bytes'])}"
                      + (f" (now: segment {t['uploading_now']})" if t["uploading_now"] is not None else "")),
        ("in tier", f"{t['tier_segments']} segment(s), {_mb(t['tier_raw_bytes'])} stored as {_mb(t['tier_stored_bytes'])}"
                    + (f", offsets [{t['tier_min_offset']}, {t['tier_end_offset']})" if t["tier_segments"] else "")
                    + f"; kept {_span(t['tier_retention_ms'], t['tier_retention_bytes'])}"),
        ("oldest readable", f"{_when(t['oldest_readable_ms'])} (offset {t['min_readable_offset']})"),
        ("read cache", f"{_mb(t['cache_bytes'])} of {_mb(t['cache_limit_bytes'])}, {t['cache_hits']} hits, "
                       f"{t['cache_misses']} fetches"),
    ]
    if t["corrupt_objects"]:
        rows.append(("CORRUPT", f"{t['corrupt_objects']} tier object(s) failed their checksum (see the store's log)"))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def admin_tier(conn, args, call) -> int:
    """`call(conn, store, fn)` is console._admin_call (errors -> exit codes)."""
    r, code = call(conn, args.store, lambda c: c.cmd("tier")["tier"])
    if code:
        return code
    if args.format == "json":
        print(json.dumps({"store": args.store, "tier": r}, indent=2))
    elif r is None:
        print(f"store {args.store} has no tier (start it with --tier URL: docs/store.md \"Tiered storage\")")
    else:
        print(render(r))
    return 0
