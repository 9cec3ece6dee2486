"""Access control: may this identity publish to a topic, or subscribe to a filter?

Two file formats, told apart by their first rule keyword:

* **Mosquitto's `acl_file`**, so a Mosquitto deployment moves as it is:
  `user NAME` starts a user's block; `topic [read|write|readwrite|deny] FILTER` lines before any
  `user` line apply to anonymous clients, after it to that user; `pattern [access] FILTER` lines
  apply to every client, with `%u` (username) and `%c` (client id) substituted. As in Mosquitto, a
  matching `deny` wins over any grant, anything not granted is denied, and `read` governs
  subscribing (and what is delivered) while `write` governs publishing.

* **lmqtt's own form**, for rules Mosquitto's cannot say — ordered, first match wins:

      default deny                                  # what no rule matches (allow | deny)
      allow  user:alice      publish    sensors/alice/#
      deny   client:legacy-* all        #
      allow  cert:gw-01      subscribe  devices/+/state
      allow  all             subscribe  devices/%u/#
      deny   anonymous       all        #

  who: `user:NAME`, `client:ID`, `cert:CN` (each may end in `*` for a prefix), `all`,
  `anonymous`; action: `publish`, `subscribe`, `all`; then a topic filter, where `%u` and `%c`
  are substituted (a rule whose `%u` meets a client without a username never matches).

A subscribe is allowed when a granting rule's filter *covers* the requested filter (every topic
the request can match is matched by the rule's filter), so `sensors/#` allows subscribing to
`sensors/+/temp` but `sensors/+/temp` does not allow `sensors/#`; it is refused when a denying
rule covers it. A subscription that only *overlaps* a denied area is accepted, as in Mosquitto,
and the messages inside that area are withheld at delivery: `needs_read_check` tells the gateway
at subscribe time which subscriptions need the per-message `can_read` (most need none, so
delivery pays nothing for ACLs it cannot hit). `reload()` re-reads the file
(the server calls it on SIGHUP); a file that fails to parse leaves the previous rules in force.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from lmqtt.gateway.security.auth import Identity

log = logging.getLogger("lmqtt.gateway")

PUBLISH, SUBSCRIBE, READ = "publish", "subscribe", "read"   # READ: one message at delivery


class AclError(Exception):
    """A malformed ACL file; names the file and line."""


def _levels(s: str) -> list[str]:
    return s.split("/")


def topic_matches(flt: str, topic: str) -> bool:
    """MQTT matching of a concrete topic against a filter (`$` topics need an explicit first level)."""
    if topic.startswith("$") and flt[:1] in ("+", "#"):
        return False
    f, t = _levels(flt), _levels(topic)
    for i, lv in enumerate(f):
        if lv == "#":
            return True
        if i >= len(t):
            return False
        if lv != "+" and lv != t[i]:
            return False
    return len(f) == len(t)


def filter_covers(rule: str, requested: str) -> bool:
    """True when every topic `requested` can match is also matched by `rule`."""
    if requested.startswith("$") and rule[:1] in ("+", "#"):
        return False                          # wildcards never reach $ topics
    r, q = _levels(rule), _levels(requested)
    for i, lv in enumerate(r):
        if lv == "#":
            return True
        if i >= len(q):
            return False
        if q[i] == "#":
            return False                      # the request reaches deeper than the rule
        if lv == "+":
            continue
        if q[i] == "+" or q[i] != lv:
            return False
    return len(r) == len(q)


def _substitute(flt: str, ident: Identity) -> str | None:
    if "%u" in flt:
        if not ident.username or any(c in ident.username for c in "+#/"):
            return None
        flt = flt.replace("%u", ident.username)
    if "%c" in flt:
        if any(c in ident.client_id for c in "+#/"):
            return None
        flt = flt.replace("%c", ident.client_id)
    return flt


def _hits(rule_filter: str, action: str, topic_or_filter: str) -> bool:
    """Does a rule with this filter decide the request? Publish and read are about one topic; a
    subscribe is decided by a rule whose filter covers the whole requested filter."""
    if action == SUBSCRIBE:
        return filter_covers(rule_filter, topic_or_filter)
    return topic_matches(rule_filter, topic_or_filter)


# -------------------------------------------------------------------------------- Mosquitto
@dataclass(frozen=True)
class _MosqRule:
    read: bool
    write: bool
    deny: bool
    filter: str


class MosquittoAcl:
    def __init__(self, anonymous: list, users: dict, patterns: list) -> None:
        self.anonymous, self.users, self.patterns = anonymous, users, patterns

    def _rules(self, ident: Identity) -> list:
        rules = [(r, r.filter) for r in (self.users.get(ident.username, []) if ident.username is not None
                                         else self.anonymous)]
        for r in self.patterns:
            f = _substitute(r.filter, ident)
            if f is not None:
                rules.append((r, f))
        return rules

    def check(self, ident: Identity, action: str, topic: str) -> bool:
        rules = self._rules(ident)
        for r, f in rules:                     # deny wins
            if r.deny and _hits(f, action, topic):
                return False
        for r, f in rules:
            if (r.write if action == PUBLISH else r.read) and _hits(f, action, topic):
                return True
        return False

    def overlapping_deny(self, ident: Identity, flt: str) -> bool:
        return any(r.deny and _overlaps(f, flt) for r, f in self._rules(ident))


def _overlaps(a: str, b: str) -> bool:
    """Could some topic match both filters? (A subscription overlapping a denied area is refused.)"""
    x, y = _levels(a), _levels(b)
    for i in range(max(len(x), len(y))):
        if i >= len(x) or i >= len(y):
            return (i < len(x) and x[i] == "#") or (i < len(y) and y[i] == "#")
        if x[i] == "#" or y[i] == "#":
            return True
        if x[i] != "+" and y[i] != "+" and x[i] != y[i]:
            return False
    return True


def _parse_mosquitto(path: str, lines: list[tuple[int, list[str]]]) -> MosquittoAcl:
    anonymous: list[_MosqRule] = []
    users: dict[str, list[_MosqRule]] = {}
    patterns: list[_MosqRule] = []
    current: list[_MosqRule] = anonymous
    for n, words in lines:
        kw = words[0]
        if kw == "user":
            if len(words) < 2:
                raise AclError(f"{path}:{n}: `user` needs a name")
            current = users.setdefault(" ".join(words[1:]), [])
            continue
        if kw not in ("topic", "pattern"):
            raise AclError(f"{path}:{n}: unknown keyword {kw!r} (Mosquitto format: user, topic, pattern)")
        access, flt = "readwrite", None
        if len(words) >= 2 and words[1] in ("read", "write", "readwrite", "deny"):
            access, flt = words[1], " ".join(words[2:])
        elif len(words) >= 2:
            flt = " ".join(words[1:])
        if not flt:
            raise AclError(f"{path}:{n}: `{kw}` needs a topic filter")
        _validate_filter(path, n, flt)
        rule = _MosqRule(read=access in ("read", "readwrite"), write=access in ("write", "readwrite"),
                         deny=access == "deny", filter=flt)
        (patterns if kw == "pattern" else current).append(rule)
    return MosquittoAcl(anonymous, users, patterns)


# -------------------------------------------------------------------------------------- lmqtt
@dataclass(frozen=True)
class _Rule:
    allow: bool
    who_kind: str          # user, client, cert, all, anonymous
    who: str
    actions: frozenset
    filter: str
    line: int

    def applies(self, ident: Identity) -> bool:
        k = self.who_kind
        if k == "all":
            return True
        if k == "anonymous":
            return ident.method == "anonymous"
        value = {"user": ident.username, "client": ident.client_id, "cert": ident.cert_subject}[k]
        if value is None:
            return False
        if self.who.endswith("*"):
            return value.startswith(self.who[:-1])
        return value == self.who


class LmqttAcl:
    """lmqtt's ordered rules. Why an index: a file with a rule per device (10,000 `user:` lines)
    scanned in full on every PUBLISH cost milliseconds per message. Rules naming one user, client
    id or certificate exactly are indexed by that name; the rest (`all`, `anonymous`, prefixes
    ending in `*`) stay in a general list. The rules that apply to an identity are those of its
    three names plus the general ones that apply, merged back into file order (first match still
    wins), computed once per identity and cached (bounded; a reload builds a new object)."""

    _MAX_CACHED = 65536

    def __init__(self, rules: list[_Rule], default_allow: bool) -> None:
        self.rules, self.default_allow = rules, default_allow
        self._exact: dict[tuple[str, str], list[tuple[int, _Rule]]] = {}
        self._general: list[tuple[int, _Rule]] = []
        for i, r in enumerate(rules):
            if r.who_kind in ("user", "client", "cert") and not r.who.endswith("*"):
                self._exact.setdefault((r.who_kind, r.who), []).append((i, r))
            else:
                self._general.append((i, r))
        self._for: dict[tuple, list[_Rule]] = {}

    def rules_for(self, ident: Identity) -> list[_Rule]:
        """The rules that apply to `ident`, in file order."""
        key = (ident.username, ident.client_id, ident.cert_subject, ident.method)
        got = self._for.get(key)
        if got is None:
            ex = self._exact
            picked = [x for x in self._general if x[1].applies(ident)]
            for kind, name in (("user", ident.username), ("client", ident.client_id), ("cert", ident.cert_subject)):
                if name is not None:
                    picked += ex.get((kind, name), ())
            picked.sort(key=lambda x: x[0])
            got = [r for _, r in picked]
            if len(self._for) >= self._MAX_CACHED:
                self._for.clear()
            self._for[key] = got
        return got

    def check(self, ident: Identity, action: str, topic: str) -> bool:
        got = self.match(ident, action, topic)
        return self.default_allow if got is None else got

    def match(self, ident: Identity, action: str, topic: str) -> bool | None:
        """The first matching rule's verdict, None when no rule matches (the caller's default)."""
        kind = SUBSCRIBE if action == READ else action      # subscribe rules also govern delivery
        for r in self.rules_for(ident):
            if kind not in r.actions:
                continue
            f = _substitute(r.filter, ident)
            if f is not None and _hits(f, action, topic):
                return r.allow
        return None

    def overlapping_deny(self, ident: Identity, flt: str) -> bool:
        for r in self.rules_for(ident):
            if r.allow or SUBSCRIBE not in r.actions:
                continue
            f = _substitute(r.filter, ident)
            if f is not None and _overlaps(f, flt):
                return True
        return False


_ACTIONS = {"publish": frozenset({PUBLISH}), "subscribe": frozenset({SUBSCRIBE}),
            "all": frozenset({PUBLISH, SUBSCRIBE})}


def _parse_lmqtt(path: str, lines: list[tuple[int, list[str]]]) -> LmqttAcl:
    rules: list[_Rule] = []
    default_allow = False
    for n, words in lines:
        if words[0] == "default":
            if len(words) != 2 or words[1] not in ("allow", "deny"):
                raise AclError(f"{path}:{n}: expected `default allow` or `default deny`")
            default_allow = words[1] == "allow"
            continue
        if words[0] not in ("allow", "deny") or len(words) != 4:
            raise AclError(f"{path}:{n}: expected `allow|deny WHO ACTION FILTER` "
                           f"(WHO: user:N, client:ID, cert:CN, all, anonymous)")
        verb, who, action, flt = words
        if who in ("all", "anonymous"):
            kind, name = who, ""
        else:
            kind, sep, name = who.partition(":")
            if not sep or kind not in ("user", "client", "cert") or not name:
                raise AclError(f"{path}:{n}: bad WHO {who!r} (user:NAME, client:ID, cert:CN, all, anonymous)")
        if action not in _ACTIONS:
            raise AclError(f"{path}:{n}: bad action {action!r} (publish, subscribe, all)")
        _validate_filter(path, n, flt)
        rules.append(_Rule(verb == "allow", kind, name, _ACTIONS[action], flt, n))
    return LmqttAcl(rules, default_allow)


def _validate_filter(path: str, n: int, flt: str) -> None:
    lv = flt.split("/")
    for i, x in enumerate(lv):
        if ("#" in x and (x != "#" or i != len(lv) - 1)) or ("+" in x and x != "+"):
            raise AclError(f"{path}:{n}: invalid topic filter {flt!r}")


def parse_acl(path: str, text: str):
    lines = []
    for n, raw in enumerate(text.splitlines(), 1):
        s = raw.strip()
        if s and not s.startswith("#"):
            lines.append((n, s.split()))
    if not lines:
        return LmqttAcl([], False)
    first = lines[0][1][0]
    if first in ("user", "topic", "pattern"):
        return _parse_mosquitto(path, lines)
    if first in ("allow", "deny", "default"):
        return _parse_lmqtt(path, lines)
    raise AclError(f"{path}:{lines[0][0]}: unknown keyword {first!r}: an ACL file starts with "
                   f"user/topic/pattern (Mosquitto) or allow/deny/default (lmqtt)")


class AclFile:
    """The rules of one ACL file, reloadable without dropping connections."""

    memo_ok = True        # a connection may remember the topics it was allowed to publish to (until a reload)
    asks = False          # no decision needs asking elsewhere first (acl_chain.py `AclChain.asks`)

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._acl = None
        self.reload()

    def reload(self) -> None:
        """Re-read the file; on a parse error the previous rules stay and the error is raised."""
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise AclError(f"cannot read ACL file {self.path}: {e.strerror or e}") from e
        acl = parse_acl(self.path, text)
        with self._lock:
            self._acl = acl

    def reload_or_keep(self) -> bool:
        """SIGHUP: `reload`, logged; a file that fails keeps the previous rules (False)."""
        try:
            self.reload()
        except Exception as e:
            log.error("event=reload_failed what=acl error=%s (previous rules kept)", e)
            return False
        log.info("event=reloaded what=acl path=%s", self.path)
        return True

    def check(self, ident: Identity, action: str, topic: str) -> bool:
        return self._acl.check(ident, action, topic)

    def can_publish(self, ident: Identity, topic: str) -> bool:
        return self._acl.check(ident, PUBLISH, topic)

    def can_subscribe(self, ident: Identity, flt: str) -> bool:
        return self._acl.check(ident, SUBSCRIBE, flt)

    def needs_read_check(self, ident: Identity, flt: str) -> bool:
        """True when an accepted subscription overlaps a denied area, so each message delivered on
        it must pass `can_read`; False lets delivery skip the check for this subscription."""
        return self._acl.overlapping_deny(ident, flt)

    def can_read(self, ident: Identity, topic: str) -> bool:
        """May this message be delivered to this identity (per-message check at delivery)?"""
        return self._acl.check(ident, READ, topic)

    def read_checks(self, ident: Identity, queues) -> set[str] | None:
        """Which of a session's subscribed `queues` need `can_read` per message at delivery (a
        connection's `read_checks`): those overlapping a denied area, and a restored subscription
        the identity may no longer make. None when none does: delivery's fast path."""
        checks = {q for q in queues if self.needs_read_check(ident, q) or not self.can_subscribe(ident, q)}
        return checks or None
