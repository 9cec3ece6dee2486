"""`lmqtt store`: the store node (CommitLog, ConsumeQueue, key index, light queues, metadata)
served over the native protocol (docs/protocol.md) for the SDK and remote gateways.

    lmqtt store [--host 127.0.0.1] [--port 10911] [--data-dir ./lmqtt-data] [--config lmqtt.toml]
                [--token TOKEN] [--flush-mode async|sync|async+buffer] [--segment-mb 32]
                [--redis redis://HOST:6379/0 [--notify-mode broadcast|precise]] [--metrics-port 9884]
                [--will-grace-s 5] [--session-sweep-s 60]

The data dir has the same layout as `lmqtt serve`'s (store/, lightqueue/, sdk-meta/), so a data
dir can move between the embedded and the scale-out shape. Precedence: defaults < TOML file
(`--config`, keys at top level or under `[store]`) < flags; every setting, its type, default and
doc is a field of `NodeConfig` (store/node/config.py). A non-loopback --host needs a token.
SIGTERM/SIGINT: stop accepting, flush SDK metadata, flush and close the store, exit 0.
Remote gateways (`lmqtt gateway --store`, docs/fleet.md) are served by the gw_* commands of
store/node/gateway_service.py; they hear of new data by EVENT frames on their connection, or, with
`--redis`, by Redis pub/sub as well. The token may also come from $LMQTT_STORE_TOKEN. With
`--metrics-port`, /metrics (a few store counters), /healthz and /readyz are served over HTTP.
The wills of a gateway whose store connection stays gone longer than `--will-grace-s` (and is
not back) are published by the store itself (docs/fleet.md "Wills in a fleet"); every
`--session-sweep-s` the sessions such a gateway served last are checked, and the expired ones end
(store/node/session_sweep.py, docs/fleet.md "Sessions across gateways").
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from lmqtt.store import gc_pauses
from lmqtt.store.file_budget import default_share, process_limit
from lmqtt.store.node import stop_signals
from lmqtt.store.node.config import ConfigError, NodeConfig, retention_ms
from lmqtt.store.node.process import (DataDirError, check_data_dir, install_event_loop, lock_data_dir,
                                      metrics_unavailable, raise_open_files_limit, remove_refused_data_dir,
                                      set_process_title, setup_logging)

log = logging.getLogger("lmqtt.store")


def _parser() -> argparse.ArgumentParser:
    """`lmqtt store`'s flags: one per NodeConfig setting (store/node/config.py), and --config."""
    p = argparse.ArgumentParser(prog="lmqtt store", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="TOML config file (keys at top level or under [store])")
    NodeConfig.add_arguments(p)
    for a in p._actions:        # every option that takes a value says its default in --help
        if a.nargs != 0 and a.help and not a.required and a.dest != "help" and "default" not in a.help.lower():
            a.help += " (default: none)"
    return p


def load_config(args: argparse.Namespace) -> NodeConfig:
    """Defaults < `--config` file < $LMQTT_STORE_TOKEN < flags; ConfigError naming what is wrong.
    A file shared by the fleet may hold the gateway's settings at its top level: their names are
    the gateway's (`GatewayConfig`), not typos."""
    file_values = {}
    if args.config:
        from lmqtt.gateway.app.config import GatewayConfig
        file_values = NodeConfig.from_file(args.config, GatewayConfig.field_names())
    return NodeConfig.build(file_values, {k: v for k, v in vars(args).items() if k != "config"})


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args)
    except ConfigError as e:
        print(f"lmqtt store: {e}", file=sys.stderr)
        return 2
    from lmqtt.store.loopback import is_loopback
    host, data = cfg.host, cfg.data_dir
    # settings that cannot work are refused before the data dir is touched
    if not is_loopback(host) and not cfg.token:
        print(f"lmqtt store: refusing to listen on non-loopback address {host!r} without an auth token "
              "(--token or `token` in the config)", file=sys.stderr)
        return 2
    existed = os.path.exists(data)
    problem = check_data_dir(data)
    if problem:
        print(f"lmqtt store: {problem}", file=sys.stderr)
        return 1
    try:
        lock = lock_data_dir(data, "lmqtt store")     # before anything in it is opened
    except DataDirError as e:
        print(f"lmqtt store: {e}", file=sys.stderr)
        return 1
    # `lmqtt serve --workers` names its store child (gateway/app/workers.py)
    child = os.environ.pop("LMQTT_PROCESS_NAME", None)
    set_process_title("store", list(sys.argv[2:] if argv is None else argv), child or "lmqtt-store", bool(child))
    setup_logging(cfg.log_level)
    # the event loop and the store's dispatch thread share one GIL; Python's default 5 ms hand-off
    # holds dispatch (and with it every append's back-pressure wait) behind the loop, as in serve
    sys.setswitchinterval(0.0005)
    gc_pauses.install()       # a collection of 50 ms or more is logged (event=slow_gc)
    raise_open_files_limit()
    # before any thread exists, so that every thread blocks them (store/node/stop_signals.py)
    stop_signals.block()
    loop_name = install_event_loop()
    rc = 0
    try:
        rc = asyncio.run(_serve(cfg, loop_name))
    except KeyboardInterrupt:  # pragma: no cover
        return 0
    finally:
        if rc == 1:     # _serve returns 1 only for a refused start
            remove_refused_data_dir(data, existed)
        os.close(lock)
    if rc == "restart":     # a group member cut its log back to the primary's (store/node/ha_member.py)
        from lmqtt.store.node.ha_member import restart_in_place
        restart_in_place("lmqtt.gateway.cli", ["store", *(sys.argv[2:] if argv is None else argv)])
    return rc


async def _serve(cfg: NodeConfig, loop_name: str) -> int:
    from lmqtt.lightqueue import LightQueueStore
    from lmqtt.store.node import gateway_service
    from lmqtt.store.client.props import retained_props
    from lmqtt.store.node.sdk_service import install
    from lmqtt.store import MessageStore, StoreConfig
    from lmqtt.store.server import StoreServer

    host, port, data = cfg.host, int(cfg.port), cfg.data_dir
    member = cut_reason = None
    restart: list = []
    removed: list = []       # why this group member was removed from its group (it stops)
    if cfg.group:           # a replicated store group member (docs/ha.md)
        from lmqtt.store.node import ha_member
        try:
            host, port = ha_member.member_address(cfg)
        except ValueError as e:      # a data dir removed from the group, or of another group
            print(f"lmqtt store: {e}", file=sys.stderr)
            return 1
        cut_reason = ha_member.before_open(cfg, data)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # SIGTERM/SIGINT, also one that came while this member restarted in place to cut its log
    signals = stop_signals.StopSignals(lambda _sig: loop.call_soon_threadsafe(stop.set))
    # SIGHUP reloads a gateway's files; the store has none, and a `kill -HUP` meant for a gateway
    # must not end it (the default action of SIGHUP)
    loop.add_signal_handler(signal.SIGHUP, lambda: log.info("event=sighup_ignored reason=\"nothing to reload\""))
    store = lq = srv = gws = None
    try:
        store = MessageStore(StoreConfig(data_dir=os.path.join(data, "store"), flush_mode=cfg.flush_mode,
                                         segment_size=int(cfg.segment_mb) << 20,
                                         dispatch_inline=bool(cfg.dispatch_inline),
                                         retention_ms=retention_ms(cfg.retention),
                                         # a store node's sockets are a few gateways and SDK clients
                                         max_open_files=int(cfg.max_open_files)
                                         or default_share(process_limit(), with_clients=False)))
        store.cut_reason = cut_reason
        if cfg.tier:       # tiered storage (store/tier; checked by NodeConfig.validate)
            from lmqtt.store.tier.config import TierConfig
            store.enable_tier(TierConfig.from_flags(cfg.tier, cfg.tier_endpoint, cfg.local_retention,
                                                    cfg.tier_retention, cfg.tier_cache_mb, cfg.tier_parquet_file_mb,
                                                    cfg.tier_parquet_merge_after_s))
            from lmqtt.store.node.tier_parquet import attach_parquet
            attach_parquet(store, cfg.tier_parquet)
        lq = LightQueueStore(store, os.path.join(data, "lightqueue"), filter_linger_s=cfg.filter_linger_s)
        store.start()
        srv = StoreServer(store, os.path.join(data, "sdk-meta"), host=host, port=port, token=cfg.token,
                          max_frame=int(cfg.max_frame_mb) << 20)
        install(srv, lq)
        from lmqtt.store.node import security_service     # users and ACL rules managed live
        security_service.install(srv, security_service.SecurityDocs(lq.metadata))
        publisher = None
        if cfg.redis:
            from lmqtt.notify.redis_bus import RedisEventPublisher
            publisher = RedisEventPublisher(cfg.redis, cfg.notify_mode, float(cfg.notify_window_ms) / 1000.0)
        gws = gateway_service.install(srv, lq, loop, float(cfg.notify_window_ms) / 1000.0, publisher,
                                      will_grace_s=cfg.will_grace_s, retained_props=retained_props,
                                      session_sweep_s=cfg.session_sweep_s,
                                      repair_counts=not cfg.group)     # a group's: when it becomes primary
        from lmqtt.store.node import console_peers      # the fleet's consoles find each other here
        console_peers.install(srv, gws)
        if cfg.group:
            member = ha_member.attach(cfg, store, srv, lq, lambda: (restart.append(1), loop.call_soon_threadsafe(stop.set)),
                                      gws, on_removed=lambda why: (removed.append(why),
                                                                   loop.call_soon_threadsafe(stop.set)))
        await srv.start()
    except OSError as e:
        if member is not None:
            member.stop()
        if e.filename:
            print(f"lmqtt store: cannot use {e.filename}: {e.strerror or e}", file=sys.stderr)
        else:
            print(f"lmqtt store: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        _close(store, lq)
        return 1
    except Exception as e:  # noqa: BLE001 - named, logged, clean exit
        print(f"lmqtt store: startup failed: {type(e).__name__}: {e}", file=sys.stderr)
        log.exception("event=startup_failed")
        if member is not None:
            member.stop()
        _close(store, lq)
        return 1
    h, p = srv.address
    http = None
    metrics_url = "off (the `stats` command answers over the protocol)"
    if int(cfg.metrics_port or 0):
        try:
            http = _start_http(cfg.metrics_host or host, int(cfg.metrics_port), srv, gws, member)
            metrics_url = "http://{}:{}/metrics (/healthz, /readyz)".format(*http.server_address[:2])
        except OSError as e:
            log.error("event=metrics_listen_failed port=%s error=%s", cfg.metrics_port, e)
            metrics_url = metrics_unavailable(cfg.metrics_host or host, int(cfg.metrics_port), e)
    redis_note = ""
    if publisher is not None:
        from lmqtt.notify.reachable import unreachable_note
        redis_note = await unreachable_note(cfg.redis, asyncio.to_thread(publisher._redis.ping),
                                            "gateways notified over Redis fall back on their safety poll")
    print(f"lmqtt store: listening on lmqtt://{h}:{p} (native protocol v1, {loop_name})\n"
          f"  data dir:   {os.path.abspath(data)}\n"
          f"  flush mode: {cfg.flush_mode}\n"
          f"  files:      {store.budget.describe()}\n"
          f"{'  group:      ' + _group_line(cfg, member) + chr(10) if member is not None else ''}"
          f"  notify:     EVENT frames to watching gateways"
          f"{'; Redis ' + cfg.notify_mode + ' at ' + cfg.redis if cfg.redis else ''}{redis_note}\n"
          f"  auth:       {'token required' if cfg.token else 'none (loopback only)'}\n"
          f"  wills:      of a gateway gone longer than {cfg.will_grace_s:g} s published here\n"
          f"  metrics:    {metrics_url}"
          + (f"\n  tier:       {cfg.tier} (sealed segments uploaded; lmqtt admin --tier)" if cfg.tier else ""),
          file=sys.stderr, flush=True)
    await stop.wait()
    log.info("event=shutdown_begin")
    if http is not None:
        http.shutdown()
        http.server_close()
    await srv.stop()
    gws.close()
    if member is not None:
        member.stop()
    _close(store, lq)
    signals.close()     # a stop sent from here on stays pending: the restarted store takes it
    if restart and not signals.stop_pending():
        print("lmqtt store: restarting to cut the log back to the group primary's", file=sys.stderr, flush=True)
        return "restart"
    if removed:
        print(f"lmqtt store: stopped: {removed[0]}", file=sys.stderr, flush=True)
        return 0
    print("lmqtt store: stopped cleanly", file=sys.stderr, flush=True)
    return 0


def _group_line(cfg, member) -> str:
    if member.node is None:
        return (f"{cfg.group!r}, joining through {cfg.join}: waits until `lmqtt admin --store {cfg.join} "
                f"--add-member {cfg.host}:{cfg.port}` adds it")
    return f"{cfg.group!r} node {member.node} of {','.join(member.members_map().values())} (raft +1, replication +2)"


def _start_http(host: str, port: int, srv, gws, member=None):
    """/metrics (Prometheus text: connections, frames, errors, events pushed, store offsets),
    /healthz and /readyz (the store listens) on a daemon thread."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    def metrics() -> bytes:
        st = srv.store
        rows = [("lmqtt_store_connections", "gauge", "Open native-protocol connections", len(srv.connections)),
                ("lmqtt_store_frames_total", "counter", "Frames received", srv.frames),
                ("lmqtt_store_errors_total", "counter", "Requests answered with ERROR", srv.errors),
                ("lmqtt_store_events_pushed_total", "counter", "EVENT and PUSH frames sent to gateways", gws.events_sent),
                ("lmqtt_store_pushed_entries_total", "counter", "Light-queue entries sent in PUSH frames", gws.pushed_entries),
                ("lmqtt_store_push_read_errors_total", "counter",
                 "Reads for a PUSH that failed (sent as a hint; the gateway pulls)", gws.push_read_errors),
                ("lmqtt_store_watching_gateways", "gauge", "Connections watching queues", len(gws.watchers)),
                ("lmqtt_store_gateways_connected", "gauge", "Gateway ids with a live connection", len(gws.wills.connections_of)),
                ("lmqtt_store_gateway_wills_published_total", "counter",
                 "Wills of absent gateways published by the store", gws.wills.wills_published),
                ("lmqtt_store_gateway_will_errors_total", "counter",
                 "Failed attempts to publish an absent gateway's will", gws.wills.will_publish_errors),
                ("lmqtt_store_gateway_sessions_ended_total", "counter",
                 "Expired sessions of gateways gone for good, ended by the store", gws.session_sweep.ended),
                ("lmqtt_store_sessions_moved_told_total", "counter",
                 "Gateways told that a session record naming them was taken over by another gateway",
                 gws.sessions_moved_told),
                ("lmqtt_store_session_claims_relayed_total", "counter",
                 "Client id claims relayed to the other gateways (one live connection per client id)",
                 gws.session_claims_relayed),
                # shared groups across the fleet (store/node/group_assign.py)
                ("lmqtt_store_group_messages_handed_out_total", "counter",
                 "Shared-group messages handed to a gateway (gw_group_pop), redeliveries included", gws.assign.handed_out),
                ("lmqtt_store_group_messages_redelivered_total", "counter",
                 "Shared-group messages handed out again (handed back, or held by a gateway whose lease lapsed)",
                 gws.assign.redelivered),
                ("lmqtt_store_group_messages_lapsed_total", "counter",
                 "Shared-group messages taken from gateways whose lease lapsed (gone, frozen, restarted)", gws.assign.lapsed),
                ("lmqtt_store_max_offset_bytes", "gauge", "CommitLog max physical offset", st.max_offset),
                ("lmqtt_store_dispatched_offset_bytes", "gauge", "CommitLog dispatched offset", st.dispatched_offset),
                # recoveries that cut the log (store/recovery.py, docs/store.md "Recovery")
                ("lmqtt_store_recoveries_total", "counter",
                 "Recoveries that cut the CommitLog in this data dir (a torn tail, or less data than recorded)",
                 st.recoveries.generation),
                ("lmqtt_store_recovery_lost_bytes", "gauge",
                 "CommitLog bytes the checkpoints recorded that this start's recovery did not find",
                 st.recovery.lost_bytes if st.recovery is not None else 0),
                ("lmqtt_store_consumer_offsets_reset_total", "counter",
                 "Consumer offsets beyond their queue's end after a recovery, reset to it", st.offsets_reset),
                # the data dir's disk (store/disk_space.py), as `lmqtt serve` exports it
                ("lmqtt_store_disk_free_bytes", "gauge", "Free bytes on the data dir's file system",
                 st.clog.disk.free_bytes()),
                ("lmqtt_store_disk_full", "gauge", "1 while appends are refused for lack of disk space",
                 1 if st.clog.disk.stats()["disk_full"] else 0)]
        out = []
        for name, kind, help_, v in rows:
            if v is None:               # not known (the disk's free space could not be read)
                continue
            out.append(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n{name} {v}\n")
        if member is not None:      # a store group member: role, epoch, in-sync set, replica lag
            from lmqtt.store.node.ha_member import metrics_text
            out.append(metrics_text(member))
        return "".join(out).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, code = metrics(), 200
            elif path == "/readyz" and member is not None:    # a group member: primary or in sync
                from lmqtt.store.node.ha_member import ready
                ok, why = ready(member)
                body, code = (why + "\n").encode(), 200 if ok else 503
            elif path in ("/healthz", "/readyz"):
                body, code = b"ok\n", 200
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
    threading.Thread(target=http.serve_forever, name="lmqtt-store-http", daemon=True).start()
    return http


def _close(store, lq) -> None:
    if store is not None:
        try:
            store.shutdown()
        except Exception as e:  # noqa: BLE001
            log.error("event=store_shutdown_failed error=%r", e)
    if lq is not None:
        try:
            lq.close()
        except Exception as e:  # noqa: BLE001
            log.error("event=lightqueue_close_failed error=%r", e)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
