"""Authentication and authorization by the user's own HTTP service (`--auth-http URL`), in EMQX's
shape so a service written for EMQX works unchanged.

* **CONNECT**: `POST URL/auth` with JSON `{"clientid", "username", "password", "peerhost",
  "peerport", "protocol": "mqtt", "proto_ver", "cert_common_name"}`.
* **PUBLISH / SUBSCRIBE**: `POST URL/acl` with JSON `{"clientid", "username", "peerhost", "topic",
  "action": "publish" | "subscribe"}`; the decision is cached per client, action and topic for
  `auth_http_cache_s` seconds (EMQX's authorization cache), so a client publishing to the same
  topics asks once per TTL.

Replies, as EMQX reads them: status 200 with `{"result": "allow" | "deny" | "ignore",
"is_superuser": bool}` (a superuser is not subject to ACLs), 204 = allow, 4xx/5xx = ignore (the
body is not read). `ignore` falls through to the next method: the password file, live users, HMAC,
JWT for CONNECT; the live rules' and the ACL file's for PUBLISH/SUBSCRIBE.

A service that cannot be reached or does not answer within `auth_http_timeout_s` is never taken
for an allow: CONNECT is refused with Server unavailable (MQTT 5 0x88, 3.1.1 return code 3), a
PUBLISH or SUBSCRIBE with Unspecified error (0x80; 3.1.1: SUBACK 0x80, a PUBLISH dropped), each
logged (`event=auth_http_failed`) and counted (`lmqtt_auth_http_requests_total{kind,outcome}`). A
failed authorization is cached for one second only, so the next attempt asks again.

Why asyncio and aiohttp: a request is a wait, not work; on the event loop a thousand CONNECTs ask
the service concurrently (one pooled keep-alive connection each), while only the client that waits
for its answer is held (`MQTTConnection.hold`): the others are served meanwhile.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from typing import Any, Callable

from lmqtt.gateway.security.auth import Credentials, Denied, Identity

log = logging.getLogger("lmqtt.gateway.auth_http")

ALLOW, DENY, IGNORE = "allow", "deny", "ignore"
UNAVAILABLE = "unavailable"            # not a reply: the service could not be asked (refused, timeout)


class Refusal:
    """A refused PUBLISH/SUBSCRIBE with its MQTT 5 reason code: falsy, like the False an ACL
    returns, so callers that only ask "allowed?" stay correct."""

    __slots__ = ("reason_code", "reason")

    def __init__(self, reason_code: int, reason: str) -> None:
        self.reason_code, self.reason = reason_code, reason

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"Refusal(0x{self.reason_code:02X}, {self.reason!r})"


SERVICE_DOWN = Refusal(0x80, "authorization service unavailable")


def parse_reply(status: int, body: bytes) -> tuple[str, bool]:
    """(allow | deny | ignore, is_superuser) of an EMQX-shaped reply."""
    if status == 204:
        return ALLOW, False
    if status != 200:
        return IGNORE, False                 # EMQX: a 4xx/5xx is ignored, the chain goes on
    try:
        doc = json.loads(body or b"{}")
    except ValueError:
        return IGNORE, False
    if not isinstance(doc, dict):
        return IGNORE, False
    result = doc.get("result", IGNORE)
    if result not in (ALLOW, DENY, IGNORE):
        return IGNORE, False
    return result, doc.get("is_superuser") is True


class HttpAuthService:
    """The client of one auth service: `authenticate` (CONNECT) and the ACL's cached decisions."""

    name = "http"

    def __init__(self, url: str, timeout_s: float = 2.0, cache_s: float = 60.0,
                 max_cached: int = 100_000) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.cache_s = max(1.0, float(cache_s))     # a decision is used at least once after it is asked
        self.max_cached = max_cached
        self._session: Any = None
        # imported now, at start: `lmqtt serve` freezes what exists after start out of the garbage
        # collector's scans (gc_freeze), and aiohttp's modules are many objects
        import aiohttp  # noqa: F401
        # (client id, username, action, topic) -> (decision, expires at): an OrderedDict as an LRU
        self._acl: OrderedDict[tuple, tuple[Any, float]] = OrderedDict()
        self._asking: dict[tuple, asyncio.Future] = {}
        # (kind, outcome) -> count, for /metrics
        self.counts: dict[tuple[str, str], int] = {}

    # ------------------------------------------------------------------------------ transport
    def _http(self):
        if self._session is None:
            import aiohttp  # only HTTP auth, when configured
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                connector=aiohttp.TCPConnector(limit=256, ttl_dns_cache=60),
                headers={"User-Agent": "lmqtt"})
        return self._session

    async def _post(self, kind: str, doc: dict) -> tuple[str, bool]:
        """(decision, superuser) from the service; UNAVAILABLE when it could not be asked."""
        url = f"{self.url}/{kind}"
        try:
            async with self._http().post(url, json=doc) as r:
                body = await r.read()
                status = r.status
        except asyncio.TimeoutError:
            return self._failed(kind, url, f"no answer within {self.timeout_s:g} s (auth_http_timeout_s)")
        except Exception as e:  # noqa: BLE001 - connection refused, reset, DNS: the service is away
            return self._failed(kind, url, f"{type(e).__name__}: {e}")
        result, superuser = parse_reply(status, body)
        self._count(kind, result if status in (200, 204) else f"http_{status // 100}xx")
        if status >= 400:
            log.warning("event=auth_http_status kind=%s url=%s status=%d (taken as ignore, as EMQX does)",
                        kind, url, status)
        return result, superuser

    def _failed(self, kind: str, url: str, why: str) -> tuple[str, bool]:
        self._count(kind, UNAVAILABLE)
        log.warning("event=auth_http_failed kind=%s url=%s error=%r (refused, not allowed)", kind, url, why)
        return UNAVAILABLE, False

    def _count(self, kind: str, outcome: str) -> None:
        k = (kind, outcome)
        self.counts[k] = self.counts.get(k, 0) + 1

    async def close(self) -> None:
        if self._session is not None:
            s, self._session = self._session, None
            await s.close()

    # ------------------------------------------------------------------------------ CONNECT
    async def authenticate(self, creds: Credentials) -> Identity | Denied | None:
        """An Identity (allow), a Denied (deny, or the service unavailable: `method` says which),
        None (ignore: the next authenticator decides)."""
        host, _, port = (creds.peer or "").rpartition(":")
        doc = {"clientid": creds.client_id, "username": creds.username,
               "password": creds.password.decode("utf-8", "replace") if creds.password is not None else None,
               "peerhost": host.strip("[]") or None, "peerport": int(port) if port.isdigit() else None,
               "protocol": "mqtt", "proto_ver": creds.protocol, "cert_common_name": creds.cert_subject}
        result, superuser = await self._post("auth", doc)
        if result == ALLOW:
            return Identity(creds.username, creds.client_id, "http", creds.cert_subject, superuser)
        if result == DENY:
            return Denied(f"the auth service {self.url}/auth denied client {creds.client_id!r}", "http")
        if result == UNAVAILABLE:
            return Denied(f"the auth service {self.url}/auth is unavailable", "http", 0x88)
        return None

    # ------------------------------------------------------------------------------ ACL
    def decision(self, ident: Identity | None, action: str, topic: str):
        """The cached decision: True, False, a Refusal (service down), IGNORE, or None (not known:
        `ask` first). On the event loop, per PUBLISH: one dict lookup."""
        key = (ident.client_id if ident else None, ident.username if ident else None, action, topic)
        got = self._acl.get(key)
        if got is None:
            return None
        if got[1] < time.monotonic():
            del self._acl[key]
            return None
        return got[0]

    def ask(self, ident: Identity | None, action: str, topic: str, peer: str | None = None) -> asyncio.Future:
        """A future done once `decision(ident, action, topic)` is known (asked of the service;
        requests for the same key share one)."""
        key = (ident.client_id if ident else None, ident.username if ident else None, action, topic)
        fut = self._asking.get(key)
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = self._asking[key] = loop.create_future()
            loop.create_task(self._ask(key, fut, peer))
        return fut

    async def _ask(self, key: tuple, fut: asyncio.Future, peer: str | None) -> None:
        cid, user, action, topic = key
        host = (peer or "").rpartition(":")[0].strip("[]") or None
        try:
            result, _ = await self._post("acl", {"clientid": cid, "username": user, "peerhost": host,
                                                 "topic": topic, "action": action})
            if result == UNAVAILABLE:
                self._remember(key, SERVICE_DOWN, 1.0)
            else:
                self._remember(key, IGNORE if result == IGNORE else result == ALLOW, self.cache_s)
        finally:
            self._asking.pop(key, None)
            if not fut.done():
                fut.set_result(None)

    def _remember(self, key: tuple, value: Any, ttl: float) -> None:
        acl = self._acl
        acl[key] = (value, time.monotonic() + ttl)
        if len(acl) > self.max_cached:
            acl.popitem(last=False)

    def forget(self) -> None:
        """Drop every cached decision (SIGHUP, or the rules changed)."""
        self._acl.clear()


def ask_all(futures: list[asyncio.Future], then: Callable[[], None]) -> None:
    """Run `then` once every future in `futures` is done (at once when there are none)."""
    left = [f for f in futures if not f.done()]
    if not left:
        then()
        return
    n = [len(left)]

    def one(_f) -> None:
        n[0] -= 1
        if not n[0]:
            then()
    for f in left:
        f.add_done_callback(one)
