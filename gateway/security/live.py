"""Users and ACL rules managed live (`--live-security`): what the store's security document says
(store/node/security_service.py), applied to new connections at once and to connected clients'
next PUBLISH and SUBSCRIBE (the broker drops what each connection remembered of the old rules).

`LiveSecurity` is both an authenticator (a user of the document with a `$7$`/`$6$` hash, checked
as the password file's are: off the event loop, remembered by an HMAC of user and password) and a
source of ACL rules in lmqtt's form (gateway/security/acl.py): the first matching rule decides,
no match passes to the next source (the HTTP service, the ACL file), and the document's `default`
(allow | deny) decides when no source did.

How a gateway hears of a change: `lmqtt serve` at once (the store node's SDK port runs in the same
process and calls `apply`); a fleet gateway (`lmqtt gateway`, `serve --workers`) asks the store for
the document's version every `poll_s` (1 s) and reads the document when it changed (`LiveFeed`).
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import threading
from typing import Any, Callable

from lmqtt.gateway.security.acl import AclError, LmqttAcl, parse_acl
from lmqtt.gateway.security.auth import Credentials, Denied, Identity, verify_password

log = logging.getLogger("lmqtt.gateway.live_security")


def check_rule(rule: str) -> str:
    """The rule normalised, or AclError naming what is wrong (the tools check before they send)."""
    words = rule.split()
    if words and words[0] == "default":
        raise AclError("a default is set with --acl-default allow|deny, not as a rule")
    text = " ".join(words)
    try:
        parse_acl("rule", text)
    except AclError as e:
        raise AclError(f"rule {text!r}: {str(e).removeprefix('rule:1: ')}") from None
    if not words or words[0] not in ("allow", "deny"):
        raise AclError(f"rule {rule!r}: expected `allow|deny WHO ACTION FILTER`")
    return text


class LiveSecurity:
    name = "live"

    def __init__(self) -> None:
        self.version = -1
        self.users: dict[str, str] = {}
        self.rules: list[str] = []
        self.default: str | None = None
        self._acl: LmqttAcl | None = None
        self._key = secrets.token_bytes(32)
        self._ok: dict[bytes, bool] = {}
        self._lock = threading.Lock()
        self.changed: list[Callable[[], None]] = []     # called on the loop after a new document

    # ------------------------------------------------------------------------ the document
    def apply(self, doc: dict) -> bool:
        """Take a new document (True) or an old one again (False, nothing changes)."""
        version = int(doc.get("version", 0))
        if version == self.version:
            return False
        users = {u: str(v.get("hash", "")) for u, v in (doc.get("users") or {}).items()}
        rules = []
        for r in doc.get("rules") or []:
            try:
                rules.append(check_rule(r))
            except AclError as e:          # written by another tool: skipped, said once
                log.error("event=live_rule_skipped rule=%r error=%s", r, e)
        acl = parse_acl("live rules", "\n".join(rules)) if rules else None
        with self._lock:
            self.users, self.rules, self._acl = users, rules, acl
            self.default = doc.get("default")
            self._ok = {}
            self.version = version
        log.info("event=live_security_applied version=%d users=%d rules=%d default=%s", version, len(users),
                 len(rules), self.default)
        for fn in list(self.changed):
            fn()
        return True

    # ------------------------------------------------------------------------ authenticator
    def _cache_key(self, creds: Credentials) -> bytes:
        return hmac.new(self._key, (creds.username or "").encode() + b"\0" + (creds.password or b""),
                        hashlib.sha256).digest()

    def is_slow(self, creds: Credentials) -> bool:
        return creds.username in self.users and self._cache_key(creds) not in self._ok

    def authenticate(self, creds: Credentials):
        if creds.username is None:
            return None
        stored = self.users.get(creds.username)
        if stored is None:
            return None
        key = self._cache_key(creds)
        ok = self._ok.get(key)
        if ok is None:
            ok = verify_password(stored, creds.password or b"")
            with self._lock:
                if len(self._ok) > 100_000:
                    self._ok.clear()
                self._ok[key] = ok
        if not ok:
            return Denied(f"wrong password for user {creds.username!r} (live users)", "live")
        return Identity(creds.username, creds.client_id, "live", creds.cert_subject)

    # ------------------------------------------------------------------------ ACL source
    def match(self, ident: Identity, action: str, topic: str) -> bool | None:
        acl = self._acl
        return None if acl is None else acl.match(ident, action, topic)

    def overlapping_deny(self, ident: Identity, flt: str) -> bool:
        acl = self._acl
        return acl is not None and acl.overlapping_deny(ident, flt)


class LiveFeed:
    """Keeps a `LiveSecurity` current. `local`: the embedded store node's `SecurityDocs` (changes
    applied in the call that made them); `call`: a fleet gateway's CALL of its store (a coroutine
    function name, args -> result dict), polled every `poll_s`."""

    def __init__(self, live: LiveSecurity, *, local: Any = None, call: Any = None, poll_s: float = 1.0) -> None:
        self.live, self.local, self.call, self.poll_s = live, local, call, poll_s
        self._task: asyncio.Task | None = None
        self.errors = 0

    async def start(self) -> None:
        if self.local is not None:
            self.live.apply(self.local.get())
            self.local.listeners.append(self.live.apply)
            return
        try:
            self.live.apply(await self.call("security_get"))
        except Exception as e:  # noqa: BLE001 - the store away at start: the poll keeps asking
            self.errors += 1
            log.warning("event=live_security_unavailable error=%r (asked again every %g s)", e, self.poll_s)
        self._task = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                v = (await self.call("security_version"))["version"]
                if v != self.live.version:
                    self.live.apply(await self.call("security_get"))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the store away: the rules in force stay
                self.errors += 1
                log.debug("event=live_security_poll_failed error=%r", e)

    def close(self) -> None:
        if self.local is not None and self.live.apply in self.local.listeners:
            self.local.listeners.remove(self.live.apply)
        if self._task is not None:
            self._task.cancel()
            self._task = None
