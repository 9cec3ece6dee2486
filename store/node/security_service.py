"""Users and ACL rules managed live (Mosquitto's dynamic security in spirit): one JSON document in
the store's metadata (RocksDB with its WAL, replicated to a store group's members like the rest of
the gateway metadata), changed by `lmqtt admin --user-add ...` and the console, read by every
gateway started with `--live-security`.

    {"version": 7,
     "users": {"alice": {"hash": "$7$...", "updated_ms": 1764000000000}},
     "rules": ["allow user:alice publish sensors/alice/#", "deny all subscribe secret/#"],
     "default": null | "allow" | "deny"}

CALLs: `security_get` (the document, hashes included: the gateways verify passwords; the store
protocol's token guards it), `security_version` (what a fleet gateway polls), `security_update`
(`op`: `user_set` with `user` and `hash`, `user_remove`, `rule_add` with `rule` and an optional
1-based `position`, `rule_remove` with `index` or `rule`, `default` with `value`). Passwords never
reach the store: the CLI and the console hash them ($7$ PBKDF2-SHA512, as the password file). The
rule syntax is the gateway's (gateway/security/acl.py, lmqtt's form); the store checks its shape
only, the tools parse it before they send it.

Why one document: the users and rules of a deployment are a small, rarely written set that every
gateway wants whole; one key is one atomic write, and `version` tells a gateway whether to read it.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

from lmqtt.store import protocol as W
from lmqtt.store.server import CallError

log = logging.getLogger("lmqtt.store.security")

VERBS = ("allow", "deny")


def empty() -> dict:
    return {"version": 0, "users": {}, "rules": [], "default": None}


class SecurityDocs:
    """The document over a metadata store (`get_security` / `put_security`); `listeners` are called
    with the new document after every change (the embedded gateway applies it at once)."""

    def __init__(self, metadata: Any) -> None:
        self.md = metadata
        self.listeners: list[Callable[[dict], None]] = []

    def get(self) -> dict:
        raw = self.md.get_security()
        if not raw:
            return empty()
        doc = json.loads(raw)
        return {**empty(), **doc}

    def version(self) -> int:
        return int(self.get()["version"])

    def update(self, a: dict) -> dict:
        """One change; CallError(E_INVALID) naming what is wrong, nothing written then."""
        doc = self.get()
        op = a.get("op")
        changed = _apply(doc, op, a)
        if changed:
            doc["version"] = int(doc["version"]) + 1
            self.md.put_security(json.dumps(doc, separators=(",", ":")).encode())
            log.info("event=security_changed op=%s version=%d%s", op, doc["version"],
                     f" user={a.get('user')}" if a.get("user") else "")
            for fn in list(self.listeners):
                try:
                    fn(doc)
                except Exception:  # noqa: BLE001 - a listener's failure must not undo the change
                    log.exception("event=security_listener_failed")
        return {"version": doc["version"], "changed": changed}


def _bad(msg: str) -> CallError:
    return CallError(W.E_INVALID, msg)


def _apply(doc: dict, op: Any, a: dict) -> bool:
    users, rules = doc["users"], doc["rules"]
    if op == "user_set":
        user, h = a.get("user"), a.get("hash")
        if not isinstance(user, str) or not user or ":" in user or any(c.isspace() for c in user):
            raise _bad(f"user name {user!r}: not empty, no ':' and no spaces")
        if not isinstance(h, str) or not (h.startswith("$7$") or h.startswith("$6$")):
            raise _bad("hash: a $7$ (PBKDF2-SHA512) or $6$ password hash (the tools hash the password; "
                       "the store never sees it)")
        users[user] = {"hash": h, "updated_ms": int(time.time() * 1000)}
        return True
    if op == "user_remove":
        user = a.get("user")
        if user not in users:
            raise _bad(f"no user {user!r} (users: {', '.join(sorted(users)) or 'none'})")
        del users[user]
        return True
    if op == "rule_add":
        rule = a.get("rule")
        words = rule.split() if isinstance(rule, str) else []
        if len(words) != 4 or words[0] not in VERBS:
            raise _bad(f"rule {rule!r}: expected `allow|deny WHO ACTION FILTER`")
        pos = a.get("position")
        if pos is None:
            rules.append(" ".join(words))
        elif isinstance(pos, int) and 1 <= pos <= len(rules) + 1:
            rules.insert(pos - 1, " ".join(words))
        else:
            raise _bad(f"position {pos!r}: 1..{len(rules) + 1}")
        return True
    if op == "rule_remove":
        idx, rule = a.get("index"), a.get("rule")
        if isinstance(idx, int) and 1 <= idx <= len(rules):
            del rules[idx - 1]
            return True
        if isinstance(rule, str) and " ".join(rule.split()) in rules:
            rules.remove(" ".join(rule.split()))
            return True
        raise _bad(f"no such rule ({'index ' + str(idx) if idx is not None else repr(rule)}; "
                   f"{len(rules)} rule(s))")
    if op == "default":
        v = a.get("value")
        if v not in (None, "allow", "deny"):
            raise _bad(f"default {v!r}: allow, deny or null (none: the next ACL source decides)")
        if doc.get("default") == v:
            return False
        doc["default"] = v
        return True
    raise _bad(f"unknown op {op!r} (user_set, user_remove, rule_add, rule_remove, default)")


def install(server: Any, docs: SecurityDocs) -> None:
    """The CALLs on a store server (`lmqtt store`, and `lmqtt serve`'s SDK port)."""
    server.register_call("security_get", lambda _a: docs.get())
    server.register_call("security_version", lambda _a: {"version": docs.version()})
    server.register_call("security_update", docs.update)
