"""The lmqtt ACL's per-identity rule index (gateway/security/acl.py LmqttAcl.rules_for) decides exactly as
the plain first-match scan of every rule, and a file with a rule per device does not make each
check scan them all (the ACL-cost limit of a broker with 10,000 rules)."""
from __future__ import annotations

import random

from lmqtt.gateway.security.acl import PUBLISH, READ, SUBSCRIBE, LmqttAcl, _hits, _overlaps, _substitute, parse_acl
from lmqtt.gateway.security.auth import Identity


def _linear_check(acl: LmqttAcl, ident, action, topic) -> bool:
    kind = SUBSCRIBE if action == READ else action
    for r in acl.rules:
        if kind not in r.actions or not r.applies(ident):
            continue
        f = _substitute(r.filter, ident)
        if f is not None and _hits(f, action, topic):
            return r.allow
    return acl.default_allow


def _linear_overlap(acl: LmqttAcl, ident, flt) -> bool:
    for r in acl.rules:
        if r.allow or SUBSCRIBE not in r.actions or not r.applies(ident):
            continue
        f = _substitute(r.filter, ident)
        if f is not None and _overlaps(f, flt):
            return True
    return False


def test_indexed_rules_decide_as_the_linear_scan():
    rnd = random.Random(13)
    names = ["alice", "bob", "dev-1", "dev-2", "dev-10", "gw-1"]
    whos = [f"user:{n}" for n in names] + [f"client:{n}" for n in names] + [f"cert:{n}" for n in names] + \
        ["user:dev-*", "client:gw-*", "all", "anonymous"]
    filters = ["#", "a/#", "a/+", "a/b", "%u/#", "%c/+", "dev/+/x", "+/b", "$SYS/#"]
    topics = ["a", "a/b", "a/c", "alice/x", "dev-1/q", "dev/7/x", "b/b", "$SYS/x", "gw-1/z"]
    for trial in range(30):
        lines = [f"default {rnd.choice(['allow', 'deny'])}"]
        for _ in range(rnd.randint(1, 40)):
            lines.append(f"{rnd.choice(['allow', 'deny'])} {rnd.choice(whos)} "
                         f"{rnd.choice(['publish', 'subscribe', 'all'])} {rnd.choice(filters)}")
        acl = parse_acl("t", "\n".join(lines))
        for _ in range(200):
            user = rnd.choice(names + [None])
            ident = Identity(user, rnd.choice(names), "anonymous" if user is None else "password",
                             rnd.choice(names + [None]))
            topic = rnd.choice(topics)
            for action in (PUBLISH, SUBSCRIBE, READ):
                assert acl.check(ident, action, topic) == _linear_check(acl, ident, action, topic), \
                    (lines, ident, action, topic)
            flt = rnd.choice(filters).replace("%u", "x").replace("%c", "y")
            assert acl.overlapping_deny(ident, flt) == _linear_overlap(acl, ident, flt)


def test_ten_thousand_device_rules_are_not_scanned_per_check():
    text = "default deny\n" + "".join(f"allow user:dev-{i} all devices/dev-{i}/#\n" for i in range(10_000)) + \
        "allow all subscribe $SYS/#\nallow anonymous publish open/#\n"
    acl = parse_acl("t", text)
    dev = Identity("dev-9999", "c-9999", "password")
    assert acl.check(dev, PUBLISH, "devices/dev-9999/temp")
    assert not acl.check(dev, PUBLISH, "devices/dev-1/temp")
    assert len(acl.rules_for(dev)) == 2                      # its own rule and the `all` one
    anon = Identity(None, "x", "anonymous")
    assert acl.check(anon, PUBLISH, "open/a") and not acl.check(anon, PUBLISH, "devices/dev-1/t")
    assert len(acl.rules_for(anon)) == 2
