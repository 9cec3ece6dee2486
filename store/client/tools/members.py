"""`lmqtt admin --members`, `--add-member HOST:PORT`, `--remove-member HOST:PORT|NODE`: a store
group's member list, changed online (docs/ha.md "Changing the members"), over the native protocol
(the `members`, `member_add` and `member_remove` CALLs of store/ha/membership.py, answered by the
primary, which the connection finds).

An add or a removal is one change at a time. The command waits (`--wait`, default 120 s) until
the change is settled and, for an add, until the new member is in the in-sync set (it then counts
toward the acknowledgements): exit 0 then, 5 when the wait ran out (the change goes on; `--members`
shows where it is)."""
from __future__ import annotations

import json
import secrets
import sys
import time

from lmqtt.store.client import StoreClientError

EXIT_NOT_DONE = 5


def add_members_args(p) -> None:
    p.add_argument("--members", action="store_true",
                   help="a store group's members: node id, address, primary / in sync, a change under way")
    p.add_argument("--add-member", metavar="HOST:PORT",
                   help="add the store started with `lmqtt store --group G --join ...` at HOST:PORT to the group "
                        "(it copies the log, then counts toward acknowledgements)")
    p.add_argument("--remove-member", metavar="HOST:PORT|NODE",
                   help="remove a member from the group (the primary first hands over to the in-sync member with "
                        "the longest log; the removed store stops)")
    p.add_argument("--wait", type=float, default=120.0, metavar="S",
                   help="--add-member/--remove-member: wait this long for the change to be done (default 120)")


def wanted(args) -> bool:
    return bool(args.members or args.add_member or args.remove_member)


def _state(m: dict, n: int) -> str:
    if m.get("primary") == n:
        return "primary"
    return "in sync" if n in m.get("in_sync", []) else "not in sync"


def render(m: dict, table) -> str:
    rows = [[n, a, _state(m, int(n))] for n, a in sorted(m["members"].items(), key=lambda x: int(x[0]))]
    lines = [f"store group {m['group']!r}: {len(rows)} members (list version {m['version']}), "
             f"ack replicas {m['ack_replicas']}"]
    lines += table(["node", "address", "state"], rows)
    ch = m.get("changing")
    if ch:
        lines.append(f"under way: {ch['op']} node {ch['node']} {ch['address']}")
    return "\n".join(lines)


def _remove(c, member: str) -> dict:
    """member_remove; the primary itself first hands over (it answers so), then the new primary,
    which the connection follows, removes it."""
    try:
        return c.cmd("member_remove", member=member, request=secrets.token_hex(8))
    except StoreClientError as e:
        if "handed over to node" not in str(e):
            raise
        print(f"{str(e).split('; ask again')[0]}; removing it now", file=sys.stderr)
    return c.cmd("member_remove", member=member, request=secrets.token_hex(8))


def admin_members(conn, args, call, table, groups=None) -> int:
    """`groups`: each group's connection when --store names several (';'); a change is of one."""
    if groups is not None and not args.members:
        for g in groups:
            g.close()
        print("lmqtt admin: --add-member / --remove-member change one store group: give that group's members "
              "with --store (a ';' list names several groups)", file=sys.stderr)
        return 2
    if args.members:
        out = []
        for c in groups or [conn]:
            r, code = call(c, args.store, lambda c: c.cmd("members"))
            if code:
                return code
            if r.get("node") is None and r.get("role") == "joining":
                print(f"lmqtt admin: {args.store} is a store joining group {r['group']!r}, not a member yet",
                      file=sys.stderr)
                return 4
            out.append(r)
        if args.format == "json":
            print(json.dumps(out if groups is not None else out[0], indent=2))
        else:
            print("\n\n".join(render(r, table) for r in out))
        return 0

    def change(c):
        if args.add_member:
            # the request id: a CALL the connection sends again is answered, not done twice
            got = c.cmd("member_add", address=args.add_member, request=secrets.token_hex(8))
            print(f"node {got['node']} ({got['address']}) added to the member list; waiting for it to catch up",
                  file=sys.stderr)
        else:
            got = _remove(c, args.remove_member)
            print(f"node {got['node']} ({got['address']}) removed from the member list", file=sys.stderr)
        node = int(got["node"])
        deadline = time.monotonic() + args.wait
        m = None
        while time.monotonic() < deadline:
            m = c.cmd("members")
            settled = not m.get("changing")
            if settled and (args.remove_member or node in m.get("in_sync", [])):
                return True, m
            time.sleep(0.2)
        return False, m

    r, code = call(conn, args.store, change)
    if code:
        return code
    done, m = r
    if args.format == "json":
        print(json.dumps({"done": done, "members": m}, indent=2))
    else:
        print(render(m, table))
    if not done:
        what = "in sync" if args.add_member else "out of the group's Raft"
        print(f"lmqtt admin: the change is not done after {args.wait:g} s (the new member not {what} yet); it goes "
              "on: look again with --members", file=sys.stderr)
        return EXIT_NOT_DONE
    return 0
