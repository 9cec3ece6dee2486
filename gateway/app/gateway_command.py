"""`lmqtt gateway`: an MQTT gateway over a remote `lmqtt store` (the scale-out shape, docs/fleet.md).

    lmqtt gateway --store HOST:PORT[,HOST:PORT...] [--redis redis://HOST:6379/0] [--notify-mode native|broadcast|precise|poll]
                  [--host 127.0.0.1] [--port 1883] [--config lmqtt.toml] [--metrics-port 9883]
                  [--safety-poll-ms 1000] [--gateway-id ID] [TLS / WebSocket / auth flags of `lmqtt serve`]

Same flags and config keys as `lmqtt serve` where they apply (the TOML file's top level or its
`[gateway]`/`[serve]` table); no data dir: sessions, offsets, retained messages and wills live in
the store. The store's auth token comes from `--token` or the LMQTT_STORE_TOKEN environment
variable (the Helm chart's secret). The metrics port serves /metrics, /healthz (the process
answers) and /readyz (connected to the store and accepting MQTT clients), and this gateway's web
console at /console/ (docs/console.md; --no-console: those three only). SIGTERM/SIGINT: stop
accepting, close connections (MQTT 5: DISCONNECT 0x8B), persist sessions and offsets, exit 0.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from lmqtt.gateway.app.config import ConfigError, DefaultsSaid, build_config, hostport, load_toml
from lmqtt.gateway.app.gateway import Gateway, ListenerError, SecurityConfigError
from lmqtt.gateway.app.serve_command import add_listener_args, check_startup, tune_gc
from lmqtt.notify.reachable import unreachable_note
from lmqtt.store.client.errors import ConnectionLost, StoreClientError
from lmqtt.store.client.failover import parse_addresses
from lmqtt.store.node.process import (
    install_event_loop,
    metrics_unavailable,
    raise_open_files_limit,
    set_process_title,
    setup_logging,
)
from lmqtt.store.node.protocol import NodeMismatch

log = logging.getLogger("lmqtt.gateway.command")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmqtt gateway", description=__doc__.split("\n\n")[0], formatter_class=DefaultsSaid)
    p.add_argument("--store", dest="store_address",
                   help="HOST:PORT of the `lmqtt store` node (required); a store group: every member, "
                        "HOST:PORT,HOST:PORT,... (the gateway follows the primary, docs/fleet.md)")
    p.add_argument("--redis", help="Redis URL for notify events (redis://HOST:6379/0)")
    p.add_argument("--notify-mode", choices=("native", "broadcast", "precise", "poll"),
                   help="how new data is announced: native = pushed on the store connection (default "
                        "without --redis), broadcast/precise = Redis pub/sub (default broadcast with "
                        "--redis), poll = the safety poll only")
    p.add_argument("--safety-poll-ms", type=float,
                   help="re-check the queues served this often; bounds the delay a lost event causes (default 1000)")
    p.add_argument("--gateway-id", help="this gateway's id for filter registrations (default HOSTNAME:PORT)")
    p.add_argument("--token", help="the store's auth token (default: $LMQTT_STORE_TOKEN)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="MQTT port (default 1883; 0 = any free port)")
    p.add_argument("--config", help="TOML config file")
    p.add_argument("--metrics-port", type=int, help="/metrics, /healthz, /readyz port (default 9883, 0 = off)")
    p.add_argument("--max-inflight", type=int, help="cap on the outbound QoS 1/2 window (default 1000)")
    p.add_argument("--sys-interval", type=float,
                   help="seconds between $SYS/broker/... updates, Mosquitto's names (default 10, 0 = off)")
    p.add_argument("--reuse-port", action="store_true", default=None,
                   help="listen with SO_REUSEPORT, beside other processes on the same port (serve --workers)")
    add_listener_args(p)
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING (default INFO)")
    from lmqtt.gateway.app.console_web import add_console_args  # only with the console's port open
    add_console_args(p)         # this gateway's web console on the metrics port (docs/console.md)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        file_values = load_toml(args.config) if args.config else {}
        overrides = {k: v for k, v in vars(args).items() if k != "config" and v is not None}
        if "token" not in overrides and "token" not in file_values and os.environ.get("LMQTT_STORE_TOKEN"):
            overrides["token"] = os.environ["LMQTT_STORE_TOKEN"]
        cfg = build_config(file_values, overrides)
        if not cfg.store_address:
            raise ConfigError("--store HOST:PORT is required (the `lmqtt store` node to use; a store group: "
                              "every member, HOST:PORT,HOST:PORT,...)")
        if ";" in cfg.store_address and (cfg.redis or cfg.notify_mode in ("broadcast", "precise")):
            # several store groups (docs/groups.md "The gateway"): each group's store tells this
            # gateway of its new data itself; the Redis notify modes name queues of one store
            raise ConfigError(f"--store {cfg.store_address!r} lists several store groups (';'): this version "
                              f"takes their events from the stores (native notify), not --redis")
        try:
            for group in cfg.store_address.split(";"):
                parse_addresses(group)
        except ValueError as e:
            raise ConfigError(f"--store: {e}") from None
    except ConfigError as e:
        print(f"lmqtt gateway: {e}", file=sys.stderr)
        return 2
    problem = check_startup(cfg, store_protocol=False)     # the same refusals as `lmqtt serve`, first
    if problem:
        print(f"lmqtt gateway: {problem}", file=sys.stderr)
        return 2
    # `lmqtt serve --workers` names its gateway children (gateway/app/workers.py): `lmqtt-w0`, ...
    child = os.environ.pop("LMQTT_PROCESS_NAME", None)
    set_process_title("gateway", list(sys.argv[2:] if argv is None else argv), child or "lmqtt", bool(child))
    setup_logging(cfg.log_level)
    if cfg.switch_interval_ms:
        sys.setswitchinterval(cfg.switch_interval_ms / 1000.0)
    raise_open_files_limit()
    loop_name = install_event_loop()
    try:
        return asyncio.run(_serve(cfg, loop_name))
    except KeyboardInterrupt:  # pragma: no cover
        return 0


class _Health:
    """/metrics, /healthz and /readyz on one port (what the Helm chart's probes call)."""

    def __init__(self, gw) -> None:
        self.gw = gw
        self.http: ThreadingHTTPServer | None = None

    def ready(self) -> tuple[bool, str]:
        gw = self.gw
        if gw.broker is None or not gw.broker.accepting:
            return False, "not accepting MQTT clients"
        if gw.link is None or not gw.link.connected:
            return False, f"store {gw.cfg.store_address} unreachable: {gw.link.last_error if gw.link else 'closed'}"
        return True, "ready"

    def start(self, host: str, port: int) -> tuple[str, int]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest  # only with the metrics port open
        health = self
        registry = self.gw.metrics.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype, code = generate_latest(registry), CONTENT_TYPE_LATEST, 200
                elif path == "/healthz":
                    body, ctype, code = b"ok\n", "text/plain", 200
                elif path == "/readyz":
                    ok, why = health.ready()
                    body, ctype, code = (why + "\n").encode(), "text/plain", 200 if ok else 503
                else:
                    body, ctype, code = b"not found\n", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):  # no access log on stderr
                pass

        srv = ThreadingHTTPServer((host, port), Handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, name="lmqtt-gateway-http", daemon=True).start()
        self.http = srv
        return srv.server_address[0], srv.server_address[1]

    def stop(self) -> None:
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()


async def _serve(cfg, loop_name: str) -> int:
    gw = Gateway(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, gw.reload_security)
    try:
        await gw.start()
    except SecurityConfigError as e:
        print(f"lmqtt gateway: {e}", file=sys.stderr)
        return 2
    except ConnectionLost as e:          # names the address already
        print(f"lmqtt gateway: {e}", file=sys.stderr)
        return 1
    except NodeMismatch as e:            # another version, or an embedded `lmqtt serve`: names both
        print(f"lmqtt gateway: {e}", file=sys.stderr)
        return 1
    except StoreClientError as e:        # e.g. a wrong token
        print(f"lmqtt gateway: the store at {cfg.store_address} refused the connection: {e}", file=sys.stderr)
        return 1
    except ListenerError as e:
        print(f"lmqtt gateway: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"lmqtt gateway: cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - named, logged, clean exit
        print(f"lmqtt gateway: startup failed: {type(e).__name__}: {e}", file=sys.stderr)
        log.exception("event=startup_failed")
        return 1
    tune_gc(cfg)
    health = _Health(gw)
    console = None
    metrics_url = "off"
    if cfg.metrics_port:
        mhost = cfg.metrics_host or cfg.host
        try:
            if cfg.console:     # the console's ASGI server serves /metrics, /healthz, /readyz too
                from lmqtt.gateway.app.console_web import ConsoleServer  # only with the console's port open
                console = ConsoleServer(gw, cfg, ready=health.ready)
                h, p = await console.start(mhost, cfg.metrics_port)
                web = "https" if cfg.console_tls else "http"
                metrics_url = f"{web}://{hostport(h, p)}/metrics (/healthz, /readyz)\n  console:    {web}://{hostport(h, p)}/console/"
            else:
                h, p = health.start(mhost, cfg.metrics_port)
                metrics_url = f"http://{hostport(h, p)}/metrics (/healthz, /readyz)"
        except OSError as e:
            log.error("event=metrics_listen_failed host=%s port=%s error=%s", mhost, cfg.metrics_port, e)
            metrics_url = metrics_unavailable(mhost, cfg.metrics_port, e)
    host, port = gw.address
    if gw.auth is not None:
        auth_line = (f"{', '.join(gw.auth.names)}; anonymous "
                     f"{'allowed' if cfg.allow_anonymous else 'refused'}")
    elif cfg.allow_anonymous:
        auth_line = "none: anonymous clients allowed (--allow-anonymous)"
    else:
        auth_line = "none: anonymous clients allowed on loopback only"
    if gw.acl is not None and cfg.acl_file:    # live rules or an HTTP service also make an ACL (no file)
        auth_line += f"; ACL {cfg.acl_file}"
    mode = cfg.notify_mode or ("broadcast" if cfg.redis else "native")
    redis_note = ""
    ev = gw.redis_events
    if ev is not None:
        # a Redis that is not there was said nowhere (its subscriber retries quietly): the banner
        # and the log say it, once; the gateway runs on, on the safety poll, until Redis answers
        redis_note = await unreachable_note(cfg.redis, ev.connected.wait(),
                                            "messages published on other gateways arrive by the safety poll")
    print(f"lmqtt gateway: listening on mqtt://{hostport(host, port)} (MQTT 3.1.1 + 5.0, {loop_name})\n"
          f"  store:      lmqtt://{cfg.store_address} (id {gw.storage.gateway_id})\n"
          f"  notify:     {mode}{' via ' + cfg.redis if cfg.redis and mode in ('broadcast', 'precise') else ''}; "
          f"safety poll every {cfg.safety_poll_ms:g} ms{redis_note}\n"
          f"  metrics:    {metrics_url}\n"
          f"  auth:       {auth_line}",
          file=sys.stderr, flush=True)
    await stop.wait()
    log.info("event=shutdown_begin")
    if console is not None:
        await console.stop()
    await gw.stop()
    health.stop()
    print("lmqtt gateway: stopped cleanly", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
