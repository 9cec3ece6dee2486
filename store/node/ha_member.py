"""`lmqtt store --group NAME --node-id N --peers HOST:PORT,...`: the store node as a member of a
replicated store group (docs/ha.md). store/node/command.py calls these; the member itself is
store/ha/member.py.

`--peers` lists every member's store address (what clients connect to), the same list in the same
order on every member; `--node-id` is this member's position in it (1-based). Each member uses
three consecutive ports: PORT (clients, the native protocol), PORT+1 (Raft, pysyncobj) and PORT+2
(CommitLog replication). Members change online (store/ha/membership.py): a store started with
`--join HOST:PORT` waits to be added; once a data dir has been a member, `<data-dir>/ha/members`
(the list it last applied, its node id) is used at every start instead of `--peers` / `--node-id`.

A replica answers every request but `stats` / `ha_status` with ERROR not_primary naming the
primary. When its log diverged from the new primary's, the member asks for a cut and the process
restarts in place (same process id: `os.execv` of the same command line); the cut is applied
before the store opens again (`before_open`).
"""
from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import logging
import os
import sys

from lmqtt.lightqueue.errors import MetadataError
from lmqtt.store.checkpoint import write_atomic
from lmqtt.store.ha.member import Member
from lmqtt.store.ha.membership import load_members
from lmqtt.store.ha.peers import parse_peers
from lmqtt.store.ha.truncate import apply_pending_cut
from lmqtt.store.node import protocol as P
from lmqtt.store.sdk_meta import SDK_FILTER

log = logging.getLogger("lmqtt.store.ha")


# ------------------------------------------------------------------ `lmqtt store --group` (command.py)
class Plan:
    """Who this member is at start: its node id (None: joining), the members, their version."""

    def __init__(self, node: int | None, peers: dict, version: int, join: list[str], listen: tuple[str, int]):
        self.node, self.peers, self.version, self.join, self.listen = node, peers, version, join, listen


def plan(cfg) -> Plan:
    """Once the group's list was changed online (version 1 on), the list this data dir last applied
    (ha/members) wins over --peers / --node-id / --join: a member restarted after the group
    changed uses the group's current members. Before that --peers is the list, as it always was (a
    group whose members were all restarted with a new --peers keeps working that way). Raises
    ValueError (the cause, for one line) for a data dir that cannot start as a member."""
    saved = load_members(os.path.join(cfg.data_dir, "ha"))
    if saved is not None and int(saved.get("version", 0)) == 0 and cfg.peers and not saved.get("removed"):
        saved = None
    if saved is not None:
        if saved.get("group") != cfg.group:
            raise ValueError(f"{cfg.data_dir} holds node {saved.get('node')} of store group {saved.get('group')!r}, "
                             f"not {cfg.group!r}")
        if saved.get("removed"):
            raise ValueError(f"{cfg.data_dir} holds node {saved['node']} of store group {cfg.group!r}, which was "
                             "removed from the group: to add this store again, start it with an empty data dir "
                             "and --join")
        peers = {n: parse_peers(a)[0] for n, a in saved["members"].items()}
        node = int(saved["node"])
        host, port = peers[node]
        if cfg.peers or cfg.join:
            log.info("event=ha_members_from_data_dir node=%d members=%s (--peers/--join are for the first "
                     "start)", node, saved["members"])
        return Plan(node, peers, int(saved.get("version", 0)), [], (_listen_host(cfg, host), port))
    if cfg.join:
        return Plan(None, {}, 0, [a.strip() for a in cfg.join.split(",") if a.strip()],
                    (cfg.host, int(cfg.port)))
    peers = {i + 1: hp for i, hp in enumerate(parse_peers(cfg.peers))}
    host, port = peers[int(cfg.node_id)]
    return Plan(int(cfg.node_id), peers, 0, [], (_listen_host(cfg, host), port))


def _listen_host(cfg, host: str) -> str:
    return cfg.host if cfg.host not in ("127.0.0.1",) else host


def member_address(cfg) -> tuple[str, int]:
    """Where a group member listens: --host (when given) and its entry's port."""
    return plan(cfg).listen


def group_identity(group: str, store_dir: str) -> None:
    """A new member's store identity (the first half of every msg id) is the group's, the same on
    every member, so a msg id names the same record whichever member serves it. A data dir that
    had its own identity before joining keeps it (its msg ids are its own)."""
    path = os.path.join(store_dir, "identity")
    if not os.path.exists(path):
        os.makedirs(store_dir, exist_ok=True)
        write_atomic(path, hashlib.sha256(f"lmqtt-group:{group}".encode()).hexdigest()[:16].upper().encode())


def before_open(cfg, data_dir: str) -> str | None:
    """Before the store opens: apply a cut this member asked for (rejoining as a replica). Returns
    the reason to give the store's recovery (MessageStore.cut_reason), or None."""
    group_identity(cfg.group, os.path.join(data_dir, "store"))
    cut = apply_pending_cut(os.path.join(data_dir, "ha"), os.path.join(data_dir, "store"))
    if cut is None:
        return None
    return f"store group {cfg.group!r}: rejoining as a replica, the tail after {cut[0]} was never acknowledged"


def attach(cfg, store, srv, lq, on_restart, gws=None, on_removed=None):
    """Make the started store and its server (not listening yet) a group member. Returns the Member.
    `gws`: the GatewayService (its wills and session sweep run on the primary only);
    `on_removed(why)`: the member was removed from the group (the process stops)."""
    p = plan(cfg)
    member = Member(group=cfg.group, node=p.node, peers=p.peers, store=store,
                    ha_dir=os.path.join(cfg.data_dir, "ha"), ack_replicas=cfg.ack_replicas,
                    dead_after_s=float(cfg.election_timeout_s), on_restart=on_restart,
                    listen_host=None if cfg.host in ("127.0.0.1",) else cfg.host, members_version=p.version,
                    join=p.join, listen_addr=p.listen, token=cfg.token)
    member.on_removed = on_removed
    member.attach_meta(srv.meta)
    replicate_metadata(member, lq.metadata)
    member.run_consistent = lambda fn: _on_loop(srv, fn)
    member.attach_server(srv)
    _wait_for_replicas(member, srv)
    _pop_waited(member, srv)
    if gws is not None:
        _primary_only(member, srv, gws)
        _group_assignments(member, srv, gws)
    member.on_promoted.append(lambda: _promoted(srv, lq, gws))
    member.on_promoted.append(lambda: _register_filters(srv, lq))
    follow_delayed(member, store)
    return member


def follow_delayed(member, store) -> None:
    """Delayed messages on a group member (store/delayed.py "In a store group"): the timers come
    from the replicated log on every member, a replica's wheel keeps pace with the primary's
    releases, a new primary schedules what it had not read yet and releases from then on.
    Cancellations are shipped ({"k": "timer_cancel", "ref": offset})."""
    store.delayed_role = "replica"           # read when the server's start() enables the wheel

    def role(r: str):
        def change() -> None:
            store.delayed_role = r
            d = store.delayed
            if d is not None:
                d.promote() if r == "primary" else d.demote()
        return change

    def ship_cancel(ref: int) -> None:
        if member.role == "primary":
            member.ship({"k": "timer_cancel", "ref": int(ref)})

    def apply_cancel(op) -> None:
        d = store.delayed
        if d is not None:
            d.wheel.cancel(int(op["ref"]))
    store.delayed_on_cancel = ship_cancel
    member.meta_kind("timer_cancel", apply_cancel)
    # before the other promotion work: the wheel is complete before appends are taken
    member.on_promoted.insert(0, role("primary"))
    member.on_demoted.append(role("replica"))


# ------------------------------------------------------------------ replicated gateway metadata
def replicate_metadata(member, md) -> None:
    """The light queues' MetadataStore (sessions, offsets, retained, wills, filter counts and
    epochs, `$share` group offsets) on the group's metadata stream: every write on the primary is
    shipped as {"k": "md", "ops": [[key, value | null], ...]} (base64) after the log bytes written
    before it, and applied by the replicas in that order; a member that is not the primary refuses
    to write it (its copy is the primary's)."""
    b64, unb64 = base64.b64encode, base64.b64decode

    def check() -> None:
        if member.role != "primary":
            raise MetadataError(f"node {member.node} of store group {member.group!r} is a {member.role}, not the "
                                f"primary: its metadata is written by the primary only")

    def ship(ops) -> None:
        member.ship({"k": "md", "ops": [[b64(k).decode(), None if v is None else b64(v).decode()]
                                        for k, v in ops]})

    def apply(op) -> None:
        md.apply_replicated([(unb64(k), None if v is None else unb64(v)) for k, v in op["ops"]])
    md.replicate(check, ship)
    member.meta_kind("md", apply)
    member.meta_dbs["md"] = md


def _on_loop(srv, fn):
    """fn() on the store server's loop (where every metadata write runs), waited for."""
    loop = getattr(srv, "_loop", None)
    if loop is None or loop.is_closed():
        return fn()
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            done.set_exception(e)
    loop.call_soon_threadsafe(run)
    return done.result(timeout=30)


# the gw_* commands that write the metadata (the protocol marks them: store/node/protocol.py
# WRITES), answered once the in-sync replicas applied the change; gw_group_ack is wrapped with its
# shared groups' state below (`_group_assignments`); the console's user and ACL changes too
GW_WRITES = (*sorted(P.WRITES - {"gw_group_ack"}), "security_update")


# the SDK calls that write the metadata beyond those the member itself waits for: a first-level
# topic's owning group (docs/groups.md), answered once the in-sync replicas hold it, so a failover
# of the first group never forgets where a topic's history is
SDK_WRITES = ("topic_group_claim",)


def _wait_for_replicas(member, srv) -> None:
    for name in GW_WRITES + SDK_WRITES:
        fn = srv.calls.get(name)
        if fn is not None:
            srv.register_call(name, member.replicated_call(fn), with_connection=srv.takes_connection(name))


# the POP calls that change the POP state: answered once the in-sync replicas applied the change
POP_WRITES = ("pop", "ack", "change_invisible_time")


def _pop_waited(member, srv) -> None:
    """POP on a group member (store/pop.py): each pop, ack and change of invisible time writes the
    queue's POP state in the call (`PopManager.eager`, instead of at the next 0.1 s persist), so
    the change is shipped then, and the call answers once the in-sync replicas applied it, as a
    group offset commit does: an acknowledged message is not popped again after a failover, a
    popped one stays invisible there for its invisible time. A pop that changes nothing (an empty
    queue) answers at once."""
    pop = getattr(srv, "pop", None)
    if pop is None:
        return
    pop.eager = True
    for name in POP_WRITES:
        fn = srv.calls.get(name)
        if fn is not None:
            srv.register_call(name, member.replicated_call(fn), with_connection=srv.takes_connection(name))


def _group_assignments(member, srv, gws) -> None:
    """Shared groups across the fleet on a group member (store/node/group_assign.py): a
    `gw_group_ack` writes the group's committed offset in the call (`eager`) and answers once the
    in-sync replicas applied it, so a new primary starts the group after every message acknowledged
    in order; the in-memory assignments are dropped when the member changes role (a new primary
    starts from the replicated committed offsets, a deposed one keeps nothing for a later term)."""
    assign = getattr(gws, "assign", None)
    if assign is None:
        return
    assign.eager = True
    fn = srv.calls.get("gw_group_ack")
    if fn is not None:
        srv.register_call("gw_group_ack", member.replicated_call(fn),
                          with_connection=srv.takes_connection("gw_group_ack"))

    def reset() -> None:
        loop = getattr(srv, "_loop", None)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(assign.reset)
        else:
            assign.reset()
    member.on_promoted.append(reset)
    member.on_demoted.append(reset)


def _primary_only(member, srv, gws) -> None:
    """The store's own work on the gateway metadata (publishing the wills of gone gateways, the
    session sweep) runs on the primary only: a replica has no gateway connected and its metadata
    is the primary's copy."""
    def on_loop(fn):
        loop = getattr(srv, "_loop", None)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn)
        else:
            fn()

    def pause() -> None:
        gws.wills.pause()
        gws.session_sweep.close()

    def resume() -> None:
        gws.wills.resume()
        gws.session_sweep.resume()
    pause()
    member.on_demoted.append(lambda: on_loop(pause))
    member.on_promoted.append(lambda: on_loop(resume))


def _promoted(srv, lq, gws) -> None:
    """A new primary serves the metadata the previous one shipped: the filter registrations are
    read again (which queues a topic lands in), and the gateways' filter holds."""
    lq.registry.reload()
    lq.forget_epochs()
    held = getattr(srv, "sdk_filters_held", None)
    if held is not None:
        held.clear()
    if gws is not None:
        gws.load_holds()


def restart_in_place(module: str, args: list[str]) -> None:
    """After a cut was asked for: the same command again in this process (same pid), which applies
    the cut before its store opens."""
    logging.shutdown()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


def _register_filters(srv, lq) -> None:
    """A new primary serves the filters SDK consumers registered on the old one (shipped as SDK
    metadata, `f\\0<filter>` keys, store/node/sdk_service.py)."""
    for key in srv.meta.keys_with_prefix(SDK_FILTER):
        flt = key[len(SDK_FILTER):]
        if lq.registry.refcount(flt) == 0:
            lq.register_filter(flt)


def metrics_text(member) -> str:
    """The group rows of /metrics (Prometheus text), for `lmqtt store --group` and this module."""
    st = member.status()
    roles = ("primary", "replica", "electing", "starting", "deposed")
    rows = [("lmqtt_ha_epoch", "gauge", "Epoch (term) of the group's primary", st["epoch"]),
            ("lmqtt_ha_in_sync_members", "gauge", "Members in the in-sync set (primary included)", len(st["in_sync"])),
            ("lmqtt_ha_members", "gauge", "Members of the group (its member list, changed online)", len(st["members"])),
            ("lmqtt_ha_ack_replicas", "gauge", "Replicas that must have a record before it is acknowledged",
             st["ack_replicas"]),
            ("lmqtt_ha_log_end_bytes", "gauge", "This member's CommitLog end", st["log_end"]),
            ("lmqtt_ha_elections_won_total", "counter", "Times this member became primary", st["elections_won"]),
            ("lmqtt_ha_acks_blocked", "gauge", "1 when this primary acknowledges nothing now (and why: ha_status)",
             1 if st["acks_blocked"] else 0)]
    out = [f"# HELP {n} {h}\n# TYPE {n} {k}\n{n} {v}\n" for n, k, h, v in rows]
    out.append("# HELP lmqtt_ha_role This member's role\n# TYPE lmqtt_ha_role gauge\n")
    out += [f'lmqtt_ha_role{{role="{r}"}} {1 if st["role"] == r else 0}\n' for r in roles]
    out.append("# HELP lmqtt_ha_in_sync 1 per member in the in-sync set\n# TYPE lmqtt_ha_in_sync gauge\n")
    out += [f'lmqtt_ha_in_sync{{node="{n}"}} {1 if n in st["in_sync"] else 0}\n' for n in sorted(member.peers)]
    out.append("# HELP lmqtt_ha_replica_lag_bytes Bytes a replica has not acknowledged (on the primary)\n"
               "# TYPE lmqtt_ha_replica_lag_bytes gauge\n")
    out += [f'lmqtt_ha_replica_lag_bytes{{node="{r["node"]}"}} {r["lag_bytes"]}\n' for r in st["replicas"]]
    return "".join(out)


def ready(member) -> tuple[bool, str]:
    """/readyz of a member: the primary, or a replica in the in-sync set."""
    st = member.status()
    if st["role"] == "primary" or (st["role"] == "replica" and member.node in st["in_sync"]):
        return True, "ok"
    return False, f"not ready: {st['role']}, not in the in-sync set {st['in_sync']}"
