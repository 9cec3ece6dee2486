"""`lmqtt admin --users / --user-add / --acls / --acl-add ...`: the users and ACL rules kept in the
store (store/node/security_service.py) and applied live by gateways started with
`--live-security` (gateway/security/live.py): a new connection at once, a connected client at its
next PUBLISH or SUBSCRIBE, without reconnecting.

Passwords are hashed here ($7$ PBKDF2-SHA512, as `lmqtt passwd`), so the store never sees one; a
rule is parsed here with the gateway's own parser before it is sent, so a mistyped rule is one
line naming the problem, and nothing changes.
"""
from __future__ import annotations

import argparse
import getpass
import json
import sys
from datetime import datetime, timezone

from lmqtt.store.client import ConnectionLost, StoreClientError


def add_security_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("users and ACL rules managed live (gateways with --live-security; docs/integrations.md)")
    g.add_argument("--users", action="store_true", help="list the users kept in the store")
    g.add_argument("--user-add", metavar="NAME", help="add a user; the password is read from stdin (one line) or "
                                                      "asked, or given with --password")
    g.add_argument("--user-passwd", metavar="NAME", help="change a user's password (as --user-add)")
    g.add_argument("--user-remove", metavar="NAME", help="remove a user (its connected clients keep their "
                                                         "connection; new ones are refused)")
    g.add_argument("--password", help="with --user-add / --user-passwd: the password (scripts; it shows in the "
                                      "process list - stdin is safer; default: read from stdin or asked)")
    g.add_argument("--acls", action="store_true", help="list the ACL rules (numbered, first match wins) and the default")
    g.add_argument("--acl-add", metavar="RULE", help="add a rule `allow|deny WHO ACTION FILTER` (WHO: user:NAME, "
                                                     "client:ID, cert:CN, all, anonymous; ACTION: publish, "
                                                     "subscribe, all), last unless --position")
    g.add_argument("--position", type=int, help="with --acl-add: its place, 1 = first (default: last)")
    g.add_argument("--acl-remove", metavar="N|RULE", help="remove rule number N (see --acls) or the rule with this text")
    g.add_argument("--acl-default", choices=("allow", "deny", "none"),
                   help="what no rule decides, when no ACL file does: allow, deny, or none (the next source; "
                        "the default)")


def wanted(args) -> bool:
    return bool(args.users or args.user_add or args.user_passwd or args.user_remove or args.acls or args.acl_add
                or args.acl_remove or args.acl_default)


def _password(args, user: str) -> str | None:
    if args.password is not None:
        return args.password
    if sys.stdin.isatty():
        pw = getpass.getpass(f"password for {user}: ")
        if getpass.getpass("again: ") != pw:
            print("lmqtt admin: the passwords differ", file=sys.stderr)
            return None
        return pw
    line = sys.stdin.readline()
    return line[:-1] if line.endswith("\n") else line


def _when(ms) -> str:
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def admin_security(conn, args, call, table) -> int:
    """Run the asked change or listing over `conn`; `call(conn, store, fn)` maps store failures to
    exit codes, `table(headers, rows)` renders rows."""
    from lmqtt.gateway.security.acl import AclError  # only when configured
    from lmqtt.gateway.security.auth import hash_password  # only when configured
    from lmqtt.gateway.security.live import check_rule  # only when configured
    change: dict | None = None
    if args.user_add or args.user_passwd:
        user = args.user_add or args.user_passwd
        if not user or ":" in user or any(c.isspace() for c in user):
            print(f"lmqtt admin: user name {user!r}: not empty, no ':' and no spaces", file=sys.stderr)
            return 2
        if args.user_passwd:        # said before a password is asked for nothing
            try:
                known = user in conn.cmd("security_get")["users"]
            except (StoreClientError, ConnectionLost, OSError) as e:
                print(f"lmqtt admin: store {args.store}: {e}", file=sys.stderr)
                conn.close()
                return 4
            if not known:
                print(f"lmqtt admin: no user {user!r} (add it with --user-add)", file=sys.stderr)
                conn.close()
                return 2
        pw = _password(args, user)
        if not pw:
            print("lmqtt admin: an empty password is not accepted", file=sys.stderr)
            return 2
        change = {"op": "user_set", "user": user, "hash": hash_password(pw)}
    elif args.user_remove:
        change = {"op": "user_remove", "user": args.user_remove}
    elif args.acl_add:
        try:
            rule = check_rule(args.acl_add)
        except AclError as e:
            print(f"lmqtt admin: {e}", file=sys.stderr)
            return 2
        change = {"op": "rule_add", "rule": rule}
        if args.position is not None:
            change["position"] = args.position
    elif args.acl_remove:
        r = args.acl_remove.strip()
        change = {"op": "rule_remove", **({"index": int(r)} if r.isdigit() else {"rule": r})}
    elif args.acl_default:
        change = {"op": "default", "value": None if args.acl_default == "none" else args.acl_default}

    def run(c):
        if change is not None:
            if change["op"] == "user_set":
                users = c.cmd("security_get")["users"]
                exists = change["user"] in users
                if args.user_add and exists:
                    raise _Refused(f"user {change['user']!r} exists (change its password with --user-passwd)")
                if args.user_passwd and not exists:
                    raise _Refused(f"no user {change['user']!r} (add it with --user-add)")
            return c.cmd("security_update", **change)
        return c.cmd("security_get")
    try:
        r, code = call(conn, args.store, run)
    except _Refused as e:
        print(f"lmqtt admin: {e}", file=sys.stderr)
        return 2
    if code:
        return code
    if change is not None:
        what = {"user_set": f"user {change.get('user')} {'added' if args.user_add else 'password changed'}",
                "user_remove": f"user {change.get('user')} removed", "rule_add": f"rule added: {change.get('rule')}",
                "rule_remove": "rule removed", "default": f"default: {args.acl_default}"}[change["op"]]
        print(json.dumps(r) if args.format == "json" else
              f"{what} (version {r['version']}; gateways with --live-security apply it now)")
        return 0
    if args.format == "json":
        doc = dict(r)
        doc["users"] = {u: {"updated_ms": v.get("updated_ms")} for u, v in doc["users"].items()}   # no hashes
        print(json.dumps(doc, indent=2))
        return 0
    if args.users:
        rows = [[u, _when(v.get("updated_ms"))] for u, v in sorted(r["users"].items())]
        print("\n".join(table(["user", "changed"], rows)) if rows else "(no users)")
    if args.acls:
        rules = r["rules"]
        w = len(str(len(rules)))
        print("\n".join([f"{'#'.rjust(w)}  rule (first match wins)"] + [f"{str(i).rjust(w)}  {rule}" for i, rule in
                                                                       enumerate(rules, 1)]) if rules else "(no rules)")
        print(f"default: {r.get('default') or 'none (the next source decides: the ACL file, else allow)'}")
    return 0


class _Refused(Exception):
    pass
