"""A store group member as a process: `python3 -m lmqtt.store.node.ha_member` (docs/ha.md).

    python3 -m lmqtt.store.node.ha_member --group NAME --node-id N --peers HOST:PORT,HOST:PORT,...
        [--data-dir DIR] [--flush-mode sync|async|async+buffer] [--ack-replicas K] [--segment-mb 32]
        [--election-timeout-s 2.5] [--metrics-port P] [--token T] [--log-level INFO]

`--peers` lists every member's store address (what clients connect to), the same list in the same
order on every member; `--node-id` is this member's position in it (1-based). Each member uses
three consecutive ports: PORT (clients, the native protocol), PORT+1 (Raft, pysyncobj) and PORT+2
(CommitLog replication).

What runs: the store (CommitLog, ConsumeQueues, key index, light queues, SDK metadata) served over
the native protocol, as `lmqtt store` does, plus the member (store/ha/member.py). A replica answers
every request but `stats` / `ha_status` with ERROR not_primary naming the primary. When its log
diverged from the new primary's, the member cuts it and restarts in place (same process id:
`os.execv` of the same command line), before the store opens again.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from lmqtt.store.ha.peers import group_problem, parse_peers  # noqa: F401  (group_problem: NodeConfig's)

log = logging.getLogger("lmqtt.store.ha")

FLUSH_MODES = ("sync", "async", "async+buffer")


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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m lmqtt.store.node.ha_member",
                                description="one member of a replicated store group (docs/ha.md)")
    p.add_argument("--group", required=True, help="the group's name")
    p.add_argument("--node-id", type=int, required=True, help="this member's position in --peers (1-based)")
    p.add_argument("--peers", required=True, help="every member's HOST:PORT, in the same order on every member")
    p.add_argument("--data-dir", default="./lmqtt-data", help="data directory (default ./lmqtt-data)")
    p.add_argument("--flush-mode", choices=FLUSH_MODES, default="async", help="flush mode (default async)")
    p.add_argument("--ack-replicas", type=int, default=None,
                   help="replicas that must have a record before it is acknowledged (default: a majority of "
                        "the group counting the primary, i.e. group size // 2)")
    p.add_argument("--segment-mb", type=int, default=32, help="CommitLog segment MiB (the same on every member)")
    p.add_argument("--election-timeout-s", type=float, default=2.5,
                   help="a primary silent this long is replaced (default 2.5; its lease is 0.6 of it)")
    p.add_argument("--metrics-port", type=int, default=0, help="HTTP /metrics, /healthz, /readyz (0 = off)")
    p.add_argument("--token", default=None, help="auth token of the store protocol (required off loopback)")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    from lmqtt.store.node.process import DataDirError, check_data_dir, lock_data_dir, setup_logging
    try:
        peers = parse_peers(args.peers)
        if not 1 <= args.node_id <= len(peers):
            raise ValueError(f"--node-id {args.node_id} is not a position in --peers (1..{len(peers)})")
        if args.ack_replicas is not None and not 0 <= args.ack_replicas < len(peers):
            raise ValueError(f"--ack-replicas must be 0..{len(peers) - 1} for a group of {len(peers)}")
        from lmqtt.store.config import min_segment_mb
        if args.segment_mb < min_segment_mb():
            raise ValueError(f"--segment-mb must be at least {min_segment_mb()} (a segment holds the largest message)")
        if args.election_timeout_s < 0.5:
            raise ValueError("--election-timeout-s must be at least 0.5")
    except ValueError as e:
        print(f"lmqtt store group member: {e}", file=sys.stderr)
        return 2
    problem = check_data_dir(args.data_dir)
    if problem:
        print(f"lmqtt store group member: {problem}", file=sys.stderr)
        return 1
    try:
        lock = lock_data_dir(args.data_dir, "lmqtt store (group member)")
    except DataDirError as e:
        print(f"lmqtt store group member: {e}", file=sys.stderr)
        return 1
    setup_logging(args.log_level)
    sys.setswitchinterval(0.0005)
    try:
        rc = asyncio.run(_serve(args, peers))
    except KeyboardInterrupt:  # pragma: no cover
        rc = 0
    finally:
        os.close(lock)
    if rc == "restart":
        restart_in_place("lmqtt.store.node.ha_member", argv)
    return rc


async def _serve(args, peers):
    from lmqtt.lightqueue import LightQueueStore
    from lmqtt.store import MessageStore, StoreConfig
    from lmqtt.store.ha.member import Member
    from lmqtt.store.ha.truncate import apply_pending_cut
    from lmqtt.store.node.sdk_service import install
    from lmqtt.store.server import StoreServer

    data = args.data_dir
    host, port = peers[args.node_id - 1]
    ha_dir = os.path.join(data, "ha")
    store_dir = os.path.join(data, "store")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    restart = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    group_identity(args.group, store_dir)
    cut = apply_pending_cut(ha_dir, store_dir)
    store = lq = srv = member = None
    try:
        store = MessageStore(StoreConfig(data_dir=store_dir, flush_mode=args.flush_mode,
                                         segment_size=int(args.segment_mb) << 20))
        if cut is not None:
            store.cut_reason = f"store group {args.group!r}: rejoining as a replica, the tail after {cut[0]} " \
                               "was never acknowledged"
        lq = LightQueueStore(store, os.path.join(data, "lightqueue"))
        store.start()
        srv = StoreServer(store, os.path.join(data, "sdk-meta"), host=host, port=port, token=args.token)
        install(srv, lq)

        def on_restart():
            restart.append(True)
            loop.call_soon_threadsafe(stop.set)
        member = Member(group=args.group, node=args.node_id, peers=peers, store=store, ha_dir=ha_dir,
                        ack_replicas=args.ack_replicas, dead_after_s=args.election_timeout_s,
                        on_restart=on_restart)
        member.attach_meta(srv.meta)
        member.attach_server(srv)
        member.on_promoted.append(lambda: _register_filters(srv, lq))
        await srv.start()
    except OSError as e:
        print(f"lmqtt store group member: cannot listen or open files: {e.strerror or e}"
              f"{' (' + str(e.filename) + ')' if e.filename else ''}", file=sys.stderr)
        _close(member, srv, store, lq)
        return 1
    except Exception as e:  # noqa: BLE001 - named, logged, clean exit
        print(f"lmqtt store group member: startup failed: {type(e).__name__}: {e}", file=sys.stderr)
        log.exception("event=startup_failed")
        _close(member, srv, store, lq)
        return 1
    http = None
    if args.metrics_port:
        try:
            http = _start_http(host, args.metrics_port, member)
        except OSError as e:
            log.error("event=metrics_listen_failed port=%s error=%s", args.metrics_port, e)
    print(f"lmqtt store group member: group {args.group!r} node {args.node_id}/{len(peers)} listening on "
          f"lmqtt://{host}:{port} (raft {host}:{port + 1}, replication {host}:{port + 2})\n"
          f"  data dir:     {os.path.abspath(data)}\n"
          f"  flush mode:   {args.flush_mode}; ack replicas: {member.ack_replicas}\n"
          f"  election:     after {args.election_timeout_s:g} s without the primary's heartbeat",
          file=sys.stderr, flush=True)
    await stop.wait()
    if http is not None:
        http.shutdown()
        http.server_close()
    try:
        await srv.stop()
    except Exception as e:  # noqa: BLE001
        log.error("event=server_stop_failed error=%r", e)
    _close(member, None, store, lq)
    if restart:
        print("lmqtt store group member: restarting to cut the log back to the primary's", file=sys.stderr,
              flush=True)
        return "restart"
    print("lmqtt store group member: stopped cleanly", file=sys.stderr, flush=True)
    return 0


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


def _start_http(host: str, port: int, member):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, code = metrics_text(member).encode(), 200
            elif path == "/healthz":
                body, code = b"ok\n", 200
            elif path == "/readyz":
                ok, why = ready(member)
                body, code = (why + "\n").encode(), 200 if ok else 503
            else:
                body, code = b"not found\n", 404
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    http = ThreadingHTTPServer((host, port), Handler)
    http.daemon_threads = True
    threading.Thread(target=http.serve_forever, name="lmqtt-ha-http", daemon=True).start()
    return http


def _close(member, srv, store, lq) -> None:
    if member is not None:
        try:
            member.stop()
        except Exception as e:  # noqa: BLE001
            log.error("event=ha_member_stop_failed error=%r", e)
    for what, fn in (("store", getattr(store, "shutdown", None)), ("light queues", getattr(lq, "close", None))):
        if fn is None:
            continue
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            log.error("event=close_failed what=%s error=%r", what, e)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
