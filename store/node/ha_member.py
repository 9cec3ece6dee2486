"""`lmqtt store --group NAME --node-id N --peers HOST:PORT,...`: the store node as a member of a
replicated store group (docs/ha.md). store/node/command.py calls these; the member itself is
store/ha/member.py.

`--peers` lists every member's store address (what clients connect to), the same list in the same
order on every member; `--node-id` is this member's position in it (1-based). Each member uses
three consecutive ports: PORT (clients, the native protocol), PORT+1 (Raft, pysyncobj) and PORT+2
(CommitLog replication).

A replica answers every request but `stats` / `ha_status` with ERROR not_primary naming the
primary. When its log diverged from the new primary's, the member asks for a cut and the process
restarts in place (same process id: `os.execv` of the same command line); the cut is applied
before the store opens again (`before_open`).
"""
from __future__ import annotations

import logging
import os
import sys

from lmqtt.store.ha.peers import parse_peers

log = logging.getLogger("lmqtt.store.ha")


# ------------------------------------------------------------------ `lmqtt store --group` (command.py)
def member_address(cfg) -> tuple[str, int]:
    """Where a group member listens: --host (when given) and its --peers entry's port."""
    host, port = parse_peers(cfg.peers)[int(cfg.node_id) - 1]
    return (cfg.host if cfg.host not in ("127.0.0.1",) else host), port


def group_identity(group: str, store_dir: str) -> None:
    """A new member's store identity (the first half of every msg id) is the group's, the same on
    every member, so a msg id names the same record whichever member serves it. A data dir that
    had its own identity before joining keeps it (its msg ids are its own)."""
    import hashlib
    from lmqtt.store.checkpoint import write_atomic
    path = os.path.join(store_dir, "identity")
    if not os.path.exists(path):
        os.makedirs(store_dir, exist_ok=True)
        write_atomic(path, hashlib.sha256(f"lmqtt-group:{group}".encode()).hexdigest()[:16].upper().encode())


def before_open(cfg, data_dir: str) -> str | None:
    """Before the store opens: apply a cut this member asked for (rejoining as a replica). Returns
    the reason to give the store's recovery (MessageStore.cut_reason), or None."""
    from lmqtt.store.ha.truncate import apply_pending_cut
    group_identity(cfg.group, os.path.join(data_dir, "store"))
    cut = apply_pending_cut(os.path.join(data_dir, "ha"), os.path.join(data_dir, "store"))
    if cut is None:
        return None
    return f"store group {cfg.group!r}: rejoining as a replica, the tail after {cut[0]} was never acknowledged"


def attach(cfg, store, srv, lq, on_restart):
    """Make the started store and its server (not listening yet) a group member. Returns the Member."""
    from lmqtt.store.ha.member import Member
    member = Member(group=cfg.group, node=int(cfg.node_id), peers=parse_peers(cfg.peers), store=store,
                    ha_dir=os.path.join(cfg.data_dir, "ha"), ack_replicas=cfg.ack_replicas,
                    dead_after_s=float(cfg.election_timeout_s), on_restart=on_restart,
                    listen_host=None if cfg.host in ("127.0.0.1",) else cfg.host)
    member.attach_meta(srv.meta)
    member.attach_server(srv)
    member.on_promoted.append(lambda: _register_filters(srv, lq))
    return member


def restart_in_place(module: str, args: list[str]) -> None:
    """After a cut was asked for: the same command again in this process (same pid), which applies
    the cut before its store opens."""
    logging.shutdown()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


def _register_filters(srv, lq) -> None:
    """A new primary serves the filters SDK consumers registered on the old one (shipped as SDK
    metadata, `f\\0<filter>` keys, store/node/sdk_service.py)."""
    for key in srv.meta.keys_with_prefix("f\0"):
        flt = key[2:]
        if lq.registry.refcount(flt) == 0:
            lq.register_filter(flt)


def metrics_text(member) -> str:
    """The group rows of /metrics (Prometheus text), for `lmqtt store --group` and this module."""
    st = member.status()
    roles = ("primary", "replica", "electing", "starting", "deposed")
    rows = [("lmqtt_ha_epoch", "gauge", "Epoch (term) of the group's primary", st["epoch"]),
            ("lmqtt_ha_in_sync_members", "gauge", "Members in the in-sync set (primary included)", len(st["in_sync"])),
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
    out += [f'lmqtt_ha_in_sync{{node="{n}"}} {1 if n in st["in_sync"] else 0}\n' for n in range(1, member.size + 1)]
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
