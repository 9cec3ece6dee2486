"""Who decides a PUBLISH, a SUBSCRIBE and a delivered message: the ACL sources in order.

1. a **superuser** (an HTTP auth service's `is_superuser`) is allowed everything;
2. the **live rules** (`--live-security`, gateway/security/live.py): the first matching rule;
3. the **HTTP service** (`--auth-http`, gateway/security/http_auth.py): allow or deny (cached with a
   TTL); `ignore` goes on; a decision not cached yet is asked first (`ask`): the broker holds that
   connection's packets meanwhile and handles the packet again when the answer is in;
4. the **ACL file** (`--acl-file`, gateway/security/acl.py), which always decides (its default);
5. without a file: the live rules' `default` when set, else allow (as with no ACL at all).

The chain has the AclFile's interface (`can_publish`, `can_subscribe`, `needs_read_check`,
`can_read`, `read_checks`, `reload_or_keep`), so the broker, the subscribe handler and delivery
call it as they called the file. A decision is falsy when refused: False (not authorized, 0x87) or
a `Refusal` carrying another reason code (the service unavailable: 0x80). Per-message delivery
checks (`can_read`) use the live rules and the file: the HTTP service is asked at SUBSCRIBE only,
as EMQX does.
"""
from __future__ import annotations

from typing import Any

from lmqtt.gateway.security.acl import PUBLISH, READ, SUBSCRIBE
from lmqtt.gateway.security.auth import Identity
from lmqtt.gateway.security.http_auth import IGNORE


class AclChain:
    def __init__(self, file: Any = None, http: Any = None, live: Any = None) -> None:
        self.file, self.http, self.live = file, http, live
        # a connection may remember topics it was allowed to publish to until the rules change
        # (`Broker.acl_changed`); with a service, whose decisions expire, those memos are dropped
        # every `auth_http_cache_s` as well (gateway/integrations/wiring.py), so a PUBLISH with a
        # warm cache costs what it costs with the ACL file: one set lookup
        self.memo_ok = True
        self.asks = http is not None

    def _decide(self, ident: Identity | None, action: str, topic: str, ask_http: bool = True):
        if ident is not None and ident.superuser:
            return True
        live = self.live
        if live is not None:
            r = live.match(ident, action, topic)
            if r is not None:
                return r
        if ask_http and self.http is not None:
            r = self.http.decision(ident, action, topic)
            if r is None:
                return None                  # not known yet: `ask`
            if r is not IGNORE:
                return r
        if self.file is not None:
            return self.file.check(ident, action, topic)
        if live is not None and live.default is not None:
            return live.default == "allow"
        return True

    # ------------------------------------------------------------------ the AclFile interface
    def can_publish(self, ident: Identity, topic: str):
        """True, a falsy refusal, or None: the HTTP service must be asked first (`ask`)."""
        return self._decide(ident, PUBLISH, topic)

    def can_subscribe(self, ident: Identity, flt: str):
        return self._decide(ident, SUBSCRIBE, flt)

    def can_read(self, ident: Identity, topic: str) -> bool:
        return bool(self._decide(ident, READ, topic, ask_http=False))

    def needs_read_check(self, ident: Identity, flt: str) -> bool:
        if ident is not None and ident.superuser:
            return False
        return bool((self.live is not None and self.live.overlapping_deny(ident, flt))
                    or (self.file is not None and self.file.needs_read_check(ident, flt)))

    def read_checks(self, ident: Identity, queues) -> set[str] | None:
        """The subscribed queues whose messages need `can_read` at delivery (see AclFile)."""
        checks = {q for q in queues if self.needs_read_check(ident, q)
                  or self._decide(ident, SUBSCRIBE, q, ask_http=False) is False}
        return checks or None

    def reload_or_keep(self) -> bool:
        """SIGHUP: the file re-read (a failing one keeps its rules), the service's decisions dropped."""
        ok = self.file.reload_or_keep() if self.file is not None else False
        if self.http is not None:
            self.http.forget()
            ok = True
        return ok

    # ------------------------------------------------------------------ asking the service
    def ask(self, ident: Identity | None, action: str, topics, peer: str | None = None) -> list:
        """Futures for the decisions of `topics` the HTTP service must be asked for (none: [])."""
        http = self.http
        if http is None:
            return []
        return [http.ask(ident, action, t, peer) for t in topics if self._decide(ident, action, t) is None]
