"""`lmqtt serve`: gateway + store + notify in one process (the embedded default).

    lmqtt serve [--host 127.0.0.1] [--port 1883] [--data-dir ./lmqtt-data] [--config lmqtt.toml]
                [--flush-mode async|sync|async+buffer] [--metrics-port 9883 (0 = off)]
                [--store-port 10911 (0 = off)] [--store-host 127.0.0.1] [--token TOKEN]
                [--tls-port P --cert FILE --key FILE [--cafile FILE] [--require-certificate]]
                [--ws-port P] [--wss-port P] [--password-file FILE] [--allow-anonymous]
                [--hmac-keys FILE] [--jwt-secret S | --jwt-public-key FILE] [--acl-file FILE]
                [--max-connections N] [--max-connections-per-address N] [--connect-rate-per-address R]
                [--publish-rate-per-client R] [--max-subscriptions N] (limits: docs/gateway.md)

Precedence: built-in defaults < the TOML file (`--config`, keys at top level or under `[serve]`)
< flags given on the command line. Binds to loopback unless told otherwise; without authentication
anonymous clients are accepted on loopback only (a non-loopback --host needs --password-file etc.
or --allow-anonymous). SIGHUP re-reads the password/keys files and the ACL. SIGTERM/SIGINT: stop accepting, close connections
(MQTT 5: DISCONNECT 0x8B), persist sessions and offsets, flush the store, exit 0.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys

from lmqtt.gateway.app.config import FLUSH_MODES, ConfigError, DefaultsSaid, build_config, hostport, load_toml
from lmqtt.gateway.app.gateway import Gateway, ListenerError, SecurityConfigError, build_security
from lmqtt.store import allocator, gc_pauses
from lmqtt.store.loopback import is_loopback
from lmqtt.store.node.process import (
    DataDirError,
    check_data_dir,
    install_event_loop,
    lock_data_dir,
    metrics_unavailable,
    raise_open_files_limit,
    remove_refused_data_dir,
    set_process_title,
    setup_logging,
)

log = logging.getLogger("lmqtt.serve")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmqtt serve", description=__doc__.split("\n\n")[0], formatter_class=DefaultsSaid)
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="MQTT port (default 1883; 0 = any free port)")
    p.add_argument("--data-dir", help="data directory (default ./lmqtt-data)")
    p.add_argument("--config", help="TOML config file")
    p.add_argument("--flush-mode", choices=FLUSH_MODES, help="store flush mode (default async)")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port, and the web console's (default 9883, 0 = off)")
    from lmqtt.gateway.app.console_web import add_console_args  # only with the console's port open
    add_console_args(p)
    p.add_argument("--max-inflight", type=int, help="cap on the outbound QoS 1/2 window (default 1000)")
    p.add_argument("--segment-mb", type=int,
                   help="CommitLog segment size in MiB of a new data dir (default 32, preallocated; an existing "
                        "data dir keeps its own; a busy server: 256)")
    p.add_argument("--retention", help="how long sealed CommitLog segments are kept: 10m, 72h, 7d (default 72h; "
                                       "with --tier: --local-retention)")
    p.add_argument("--max-open-files", type=int,
                   help="the store's share of the open-files limit (RocksDB table files, mapped CommitLog "
                        "segments); client connections get the rest, past it CONNACK 0x97 (default 0: a quarter "
                        "of the process limit, at most 4096)")
    p.add_argument("--workers", type=int,
                   help="gateway processes on this port over one store process (SO_REUSEPORT; default 1 = "
                        "everything in this process); worker i serves metrics and console on --metrics-port + i")
    p.add_argument("--sys-interval", type=float,
                   help="seconds between $SYS/broker/... updates, Mosquitto's names (default 10, 0 = off)")
    p.add_argument("--store-port", type=int,
                   help="port of the store's native protocol for the SDK (default 10911, 0 = off)")
    p.add_argument("--store-host", help="address of the store protocol listener (default 127.0.0.1)")
    p.add_argument("--token", help="auth token SDK clients must send (required for a non-loopback --store-host)")
    add_listener_args(p)
    t = p.add_argument_group("tiered storage (docs/store.md \"Tiered storage\")")
    t.add_argument("--tier", help="upload sealed CommitLog segments to this fsspec URL (file:///mnt/cold/x, "
                                  "s3://bucket/prefix) and read offloaded ranges back from it")
    t.add_argument("--tier-endpoint", help="with an s3:// --tier: the endpoint of an S3-compatible server")
    t.add_argument("--local-retention", help="kept on the local disk once in the tier: 24h, 20GB, 24h,20GB "
                                             "(default 24h)")
    t.add_argument("--tier-retention", help="kept in the tier: 60d, 1TB, forever (default 60d)")
    t.add_argument("--tier-cache-mb", type=int, help="memory for segments read back from the tier (default 256)")
    t.add_argument("--tier-parquet", choices=("auto", "on", "off"),
                   help="also write each uploaded segment's records as Parquet files for Spark (docs/spark.md): "
                        "auto (when pyarrow is importable), on, off (default auto)")
    t.add_argument("--tier-parquet-file-mb", type=int,
                   help="merge a topic's and day's small Parquet files into files of up to this size (default 128)")
    t.add_argument("--tier-parquet-merge-after-s", type=float,
                   help="merge a topic's and day's small Parquet files once the newest is this old (default 60)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING (default INFO)")
    return p


def add_listener_args(p: argparse.ArgumentParser) -> None:
    """The TLS/WebSocket listener and authentication flags, shared by `lmqtt serve` and `lmqtt gateway`."""
    g = p.add_argument_group("listeners (all on --host; docs/gateway.md \"Security and listeners\")")
    g.add_argument("--tls-port", type=int, help="MQTT over TLS port (needs --cert, --key; 0 = off)")
    g.add_argument("--ws-port", type=int, help="MQTT over WebSocket port (path /mqtt; 0 = off)")
    g.add_argument("--wss-port", type=int, help="MQTT over secure WebSocket port (same --cert/--key; 0 = off)")
    g.add_argument("--cert", help="server certificate chain, PEM")
    g.add_argument("--key", help="server private key, PEM (default: inside --cert)")
    g.add_argument("--cafile", help="CA of client certificates; a verified certificate's CN becomes the username")
    g.add_argument("--require-certificate", action="store_true", default=None,
                   help="TLS clients must present a certificate signed by --cafile")
    a = p.add_argument_group("authentication and access control")
    a.add_argument("--password-file", help="Mosquitto-compatible password file (lmqtt passwd / mosquitto_passwd)")
    a.add_argument("--allow-anonymous", action="store_true", default=None,
                   help="accept clients without credentials (default: only on a loopback --host with no auth)")
    a.add_argument("--hmac-keys", help="access_key:secret_key file for signature auth (RocketMQ-MQTT style)")
    a.add_argument("--jwt-secret", help="HS256 secret: clients send a JWT as the password")
    a.add_argument("--jwt-public-key", help="RS256/ES256 public key file for JWT passwords")
    a.add_argument("--acl-file", help="ACL file (Mosquitto acl_file or lmqtt allow/deny rules)")
    a.add_argument("--auth-http", metavar="URL",
                   help="HTTP auth/ACL service in EMQX's shape: POST URL/auth on CONNECT, URL/acl on PUBLISH and "
                        "SUBSCRIBE; ignore falls through to the other methods (docs/integrations.md)")
    a.add_argument("--auth-http-timeout-s", type=float,
                   help="no answer within this: refused as server unavailable, never allowed (default 2)")
    a.add_argument("--auth-http-cache-s", type=float, help="how long an ACL decision of the service is used (default 60)")
    a.add_argument("--live-security", action="store_true", default=None,
                   help="users and ACL rules kept in the store, changed live with lmqtt admin --user-add ... and "
                        "the console")
    e = p.add_argument_group("events (docs/integrations.md)")
    e.add_argument("--webhook", metavar="URL",
                   help="POST client, session and message events as JSON batches to URL (and store them under $events/)")
    e.add_argument("--webhook-queue", type=int, help="events waiting for the webhook; more are dropped and counted "
                                                     "(default 10000)")
    e.add_argument("--webhook-batch", type=int, help="events per POST at most (default 100)")
    e.add_argument("--events", action="store_true", default=None,
                   help="store client, session and message events as records under $events/ (also on with --webhook)")
    lim = p.add_argument_group("limits (per gateway process; 0 = unlimited; docs/gateway.md \"Limits\")")
    lim.add_argument("--max-connections", type=int,
                     help="open client sockets at once; more get CONNACK 0x97 / 3.1.1 rc 3 (default 0)")
    lim.add_argument("--max-connections-per-address", type=int,
                     help="open sockets from one source IP; more get CONNACK 0x97 / rc 3 (default 0)")
    lim.add_argument("--connect-rate-per-address", type=float,
                     help="new connections per second from one source IP; faster get CONNACK 0x9F / rc 3 (default 0)")
    lim.add_argument("--connect-burst-per-address", type=int,
                     help="connections from one IP allowed at once before the rate applies (default 20)")
    lim.add_argument("--publish-rate-per-client", type=float,
                     help="PUBLISH packets per second per connection; over it the client is not read until "
                          "its budget is back (back-pressure, nothing lost; default 0)")
    lim.add_argument("--publish-burst-per-client", type=int, help="publishes allowed at once (default 1000)")
    lim.add_argument("--max-topic-length", type=int,
                     help="bytes of a topic name or filter; longer: DISCONNECT / SUBACK 0x8F (default 65535)")
    lim.add_argument("--max-topic-levels", type=int,
                     help="'/'-separated levels of a topic or filter; more: DISCONNECT / SUBACK 0x8F (default 0 = unlimited)")
    lim.add_argument("--max-subscriptions", type=int,
                     help="subscriptions per session; more get SUBACK 0x97 / 3.1.1 0x80 (default 1000, 0 = unlimited)")
    lim.add_argument("--max-offline-backlog", type=int,
                     help="messages per subscription a persistent session gets of what was stored while it was "
                          "away, the newest; the older are dropped (default 0 = all, up to the store's retention)")
    lim.add_argument("--max-qos0-backlog", type=int,
                     help="messages a QoS 0 subscription of a slow reader may fall behind (they wait in the "
                          "store); further behind the older are dropped and it keeps this many of the newest "
                          "(default 100000, 0 = skip to the end as soon as the client's socket is full)")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        file_values = load_toml(args.config) if args.config else {}
        overrides = {k: v for k, v in vars(args).items() if k != "config" and v is not None}
        cfg = build_config(file_values, overrides)
    except ConfigError as e:
        print(f"lmqtt serve: {e}", file=sys.stderr)
        return 2
    # every setting that cannot work is refused before anything is created on disk
    problem = check_startup(cfg) or check_worker_ports(cfg)
    if problem:
        print(f"lmqtt serve: {problem}", file=sys.stderr)
        return 2
    existed = os.path.exists(cfg.data_dir)
    problem = check_data_dir(cfg.data_dir)
    if problem:
        print(f"lmqtt serve: {problem}", file=sys.stderr)
        return 1
    if int(cfg.workers) > 1:
        # the store child takes the data dir's lock; asked here first, a data dir in use is named
        # before any process starts
        try:
            os.close(lock_data_dir(cfg.data_dir, "lmqtt serve"))
        except DataDirError as e:
            print(f"lmqtt serve: {e}", file=sys.stderr)
            return 1
        from lmqtt.gateway.app.workers import run  # serve --workers only
        argv = list(sys.argv[2:] if argv is None else argv)
        set_process_title("serve", argv)
        return run(cfg, argv, int(cfg.workers))
    try:
        lock = lock_data_dir(cfg.data_dir, "lmqtt serve")
    except DataDirError as e:
        print(f"lmqtt serve: {e}", file=sys.stderr)
        return 1
    set_process_title("serve", list(sys.argv[2:] if argv is None else argv))
    setup_logging(cfg.log_level)
    if cfg.switch_interval_ms:
        # process-wide, so set by the command, not by Gateway (tests may embed several gateways)
        sys.setswitchinterval(cfg.switch_interval_ms / 1000.0)
    raise_open_files_limit()
    loop_name = install_event_loop()
    rc = 0
    try:
        explicit = args.store_port is not None or "store_port" in file_values
        rc = asyncio.run(_serve(cfg, loop_name, store_port_explicit=explicit))
        return rc
    except KeyboardInterrupt:  # pragma: no cover - signal handler normally catches it
        return 0
    finally:
        if rc:          # _serve returns non-zero only for a refused start
            remove_refused_data_dir(cfg.data_dir, existed)
        os.close(lock)


def check_startup(cfg, store_protocol: bool = True) -> str | None:
    """None if the listeners, authentication and (`store_protocol`) the store protocol's settings
    can work, else why not; asked before the data dir is touched (a refused start creates nothing)."""
    try:
        build_security(cfg)
    except SecurityConfigError as e:
        return str(e)
    except UnicodeDecodeError:      # a binary file given as a password, keys or ACL file
        for flag in ("password_file", "hmac_keys", "acl_file", "jwt_public_key"):
            path = getattr(cfg, flag)
            try:
                if path:
                    with open(path, encoding="utf-8") as f:
                        f.read()
            except UnicodeDecodeError:
                return f"cannot read {path} (--{flag.replace('_', '-')}): not a text file (not UTF-8)"
            except OSError:
                pass
        return "a password, keys or ACL file is not a text file (not UTF-8)"
    if store_protocol and cfg.store_port and not is_loopback(cfg.store_host) and not cfg.token:
        return (f"refusing to serve the store protocol on non-loopback address {cfg.store_host!r} without an "
                f"auth token (--token or `token` in the config; --store-port 0 turns it off)")
    return None


def check_worker_ports(cfg) -> str | None:
    """`--workers N` gives worker i the metrics (console) port `metrics_port + i`; one of those that is
    another port of the same command (the store's, MQTT's ...) is refused here by name - it was a
    worker that ran without metrics and console, said only in its log."""
    n, m = int(cfg.workers or 1), int(cfg.metrics_port or 0)
    if n <= 1 or not m:
        return None
    taken = {int(v or 0): flag for v, flag in ((cfg.store_port, "--store-port"), (cfg.port, "--port"),
                                               (cfg.tls_port, "--tls-port"), (cfg.ws_port, "--ws-port"),
                                               (cfg.wss_port, "--wss-port"))}
    for i in range(1, n):
        if m + i in taken:
            return (f"--workers {n} serves worker i's metrics and console on --metrics-port + i "
                    f"({m}..{m + n - 1}), and {m + i} is the {taken[m + i]}: choose a --metrics-port whose "
                    f"{n} ports from it are free (or 0 = off)")
    return None


def tune_gc(cfg) -> None:
    """Shorter and rarer GC pauses on the event loop (see `gc_freeze` in gateway/app/config.py);
    each pause timed, the long ones logged (store/gc_pauses.py)."""
    gc_pauses.install()
    if cfg.gc_gen0_threshold:
        _g0, g1, g2 = gc.get_threshold()
        gc.set_threshold(int(cfg.gc_gen0_threshold), g1, g2)
    if cfg.gc_freeze:
        gc.collect()
        gc.freeze()


async def _serve(cfg, loop_name: str, store_port_explicit: bool = True) -> int:
    gw = Gateway(cfg)
    # signal handlers first: a SIGTERM that arrives while starting (the port may already accept
    # connections) becomes a clean stop right after startup, never Python's default death
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, gw.reload_security)   # a no-op until the broker exists
    try:
        await gw.start()
    except SecurityConfigError as e:
        print(f"lmqtt serve: {e}", file=sys.stderr)
        return 2
    except ListenerError as e:
        print(f"lmqtt serve: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if e.filename:     # a file of the data dir, not the socket
            print(f"lmqtt serve: cannot use {e.filename}: {e.strerror or e}", file=sys.stderr)
        else:
            print(f"lmqtt serve: cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    except Exception as e:
        print(f"lmqtt serve: startup failed: {type(e).__name__}: {e}", file=sys.stderr)
        log.exception("event=startup_failed")
        return 1
    store_srv = None
    store_url = "off"
    if cfg.store_port:
        try:        # the in-process store node's SDK port (store/node/embedded.py)
            store_srv = gw.embedded.sdk_server(cfg.data_dir, cfg.store_host, cfg.store_port, cfg.token)
            await store_srv.start()
        except ValueError as e:
            print(f"lmqtt serve: {e}", file=sys.stderr)
            await gw.stop()
            return 2
        except OSError as e:
            if e.filename:
                print(f"lmqtt serve: cannot use {e.filename}: {e.strerror or e}", file=sys.stderr)
                await gw.stop()
                return 1
            why = f"cannot listen on store port {cfg.store_host}:{cfg.store_port}: {e.strerror or e}"
            if store_port_explicit:
                print(f"lmqtt serve: {why}", file=sys.stderr)
                if store_srv is not None:
                    store_srv.meta.close()
                await gw.stop()
                return 1
            # the default port is taken (e.g. another lmqtt on this machine): MQTT still serves,
            # the banner and the log say why the SDK port is missing; pass --store-port to insist
            log.warning("event=store_listen_failed host=%s port=%s error=%s", cfg.store_host, cfg.store_port, e)
            if store_srv is not None:
                store_srv.meta.close()
            store_srv = None
            store_url = f"unavailable ({why}; set --store-port)"
        if store_srv is not None:
            sh, sp = store_srv.address
            store_url = f"lmqtt://{hostport(sh, sp)} (native protocol, SDK)"
    tune_gc(cfg)
    metrics_url = "off"
    console = None
    if cfg.metrics_port:
        mhost = cfg.metrics_host or cfg.host
        try:
            if cfg.console:     # the console's ASGI server serves /metrics (and /healthz, /readyz) too
                from lmqtt.gateway.app.console_web import ConsoleServer  # only with the console's port open
                console = ConsoleServer(gw, cfg, sdk=store_srv)
                h, p = await console.start(mhost, cfg.metrics_port)
                web = "https" if cfg.console_tls else "http"
                metrics_url = f"{web}://{hostport(h, p)}/metrics\n  console:    {web}://{hostport(h, p)}/console/"
            else:
                h, p = gw.metrics.start_http(mhost, cfg.metrics_port)
                metrics_url = f"http://{hostport(h, p)}/metrics"
        except OSError as e:
            log.error("event=metrics_listen_failed host=%s port=%s error=%s", mhost, cfg.metrics_port, e)
            metrics_url = metrics_unavailable(mhost, cfg.metrics_port, e)
    host, port = gw.address
    more = ""
    scheme = {"mqtts": "mqtts://{} (TLS)", "ws": "ws://{}/mqtt (WebSocket)",
              "wss": "wss://{}/mqtt (secure WebSocket)"}
    for name, (h, p) in gw.listeners.items():
        if name != "mqtt":
            more += "\n  listener:   " + scheme[name].format(hostport(h, p))
    if gw.auth is not None:
        kinds = ", ".join(gw.auth.names)
        auth_line = f"{kinds}; anonymous {'allowed' if cfg.allow_anonymous else 'refused'}"
    elif cfg.allow_anonymous:
        auth_line = "none: anonymous clients allowed (--allow-anonymous)"
    else:
        auth_line = "none: anonymous clients allowed on loopback only"
    if gw.acl is not None and cfg.acl_file:
        auth_line += f"; ACL {cfg.acl_file}"
    print(f"lmqtt serve: listening on mqtt://{hostport(host, port)} (MQTT 3.1.1 + 5.0, {loop_name})\n"
          f"  data dir:   {os.path.abspath(cfg.data_dir)}\n"
          f"  flush mode: {cfg.flush_mode}\n"
          f"  files:      {gw.files_line()}\n"
          f"  malloc:     {allocator.name()}\n"
          f"  metrics:    {metrics_url}\n"
          f"  store:      {store_url}{more}\n"
          f"  auth:       {auth_line}"
          + (f"\n  tier:       {cfg.tier} (sealed segments uploaded; lmqtt admin --tier)" if cfg.tier else ""),
          file=sys.stderr, flush=True)
    await stop.wait()
    log.info("event=shutdown_begin")
    if store_srv is not None:
        await store_srv.stop()
    if console is not None:
        await console.stop()
    await gw.stop()
    gw.metrics.stop_http()
    log.info("event=shutdown_complete")
    print("lmqtt serve: stopped cleanly", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
