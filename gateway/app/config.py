"""Gateway / `lmqtt serve` configuration: defaults, TOML file, command-line overrides.

Why one dataclass: every knob has one name used in the TOML file (`[serve]` table or top level),
on the command line (`--flag-name`) and in code (`cfg.flag_name`), so a newcomer can grep one name.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmqtt.gateway.integrations import bridge_config

# the strict TOML loader is shared with `lmqtt store` (one lmqtt.toml may configure the fleet);
# its names stay importable from here
from lmqtt.store.node.config import (  # noqa: F401
    FLUSH_MODES,
    GATEWAY_TABLES,
    STORE_TABLE,
    ConfigError,
    NodeConfig,
    check_tier,
    check_type,
    kinds_of,
    line_of,
    min_segment_mb,
    read_toml,
    retention_ms,
    unknown_key,
    unknown_table,
    where,
)


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"           # loopback unless told otherwise (security default)
    port: int = 1883
    data_dir: str = "./lmqtt-data"
    flush_mode: str = "async"
    metrics_port: int = 9883          # 0 = no metrics endpoint
    metrics_host: str | None = None   # defaults to `host`
    # the web console on the metrics port (`lmqtt serve`; docs/console.md): off loopback (or with
    # console_login) it needs a login of a password_file user named in console_admins (actions)
    # or console_viewers (read-only); both are comma-separated user names
    console: bool = True
    console_login: bool = False
    console_admins: str | None = None
    console_viewers: str | None = None
    console_tls: bool = False         # the metrics port (console and /metrics) over HTTPS with cert/key
    segment_mb: int = 32              # CommitLog segment size of a new data dir (preallocated; docs/store.md)
    # how long the CommitLog keeps a sealed segment (without a tier; with one: local_retention)
    retention: str = "72h"
    # the store's share of the process's open files (store/file_budget.py); 0 = a quarter of the
    # process limit, at most 4096. Client sockets get the rest: past it CONNACK 0x97.
    max_open_files: int = 0
    # light-queue message cache shared by all sessions; a quarter of it again bounds the delivery
    # ring and another quarter the store's cache of just-appended records
    lq_cache_mb: int = 64
    metadata_sync: bool = False       # fsync every metadata write (power-loss safety for sessions)
    log_level: str = "INFO"
    # protocol limits
    max_packet_size: int = 4 << 20 | 1024   # store max message size + header room
    # cap on the client's Receive Maximum (outbound QoS 1/2 window; a 3.1.1 client has none). A
    # subscriber that acks in batches (every few ms) gets at most this many messages per batch, so
    # a small cap bounds its rate (100 per 10 ms between reads is 10,000 msg/s at most).
    max_inflight: int = 1000
    max_keepalive: int = 65535
    max_subscriptions: int = 1000     # per session; more get SUBACK 0x97 (quota exceeded) / 0x80; 0 = unlimited
    # a persistent session that reconnects gets at most this many of the messages stored for each
    # of its subscriptions while it was away, the newest (the older ones are counted as dropped);
    # 0 = all of them, as far back as the store's retention (Mosquitto's max_queued_messages, EMQX's
    # max_mqueue_len: a device back after a week is not flooded with a week of commands)
    max_offline_backlog: int = 0
    # a QoS 0 subscription whose client reads slower than its messages arrive (socket above
    # write_high_water) waits for it, the messages kept in the store, while it is at most this many
    # behind its queue's end; further behind, the older ones are skipped and it keeps this many of
    # the newest (counted as dropped, reason="qos0_backpressure"). 0 = skip to the end as soon as
    # the socket is full
    max_qos0_backlog: int = 100_000
    # limits that protect the broker (gateway/broker/limits.py, docs/gateway.md "Limits"); per gateway
    # process, 0 = unlimited (Mosquitto's defaults: no limit). Over a connection limit the socket's
    # CONNECT gets CONNACK 0x97 quota exceeded (connect rate: 0x9F; 3.1.1: return code 3).
    max_connections: int = 0          # open client sockets at once (Mosquitto max_connections)
    max_connections_per_address: int = 0   # open sockets from one source IP address
    connect_rate_per_address: float = 0.0  # new connections per second from one source IP (token bucket)
    connect_burst_per_address: int = 20    # ... of which this many at once
    # PUBLISH packets per second per connection; over it the gateway stops reading that client's
    # socket until its budget is back (back-pressure: nothing is refused or lost, TCP slows it down)
    publish_rate_per_client: float = 0.0
    publish_burst_per_client: int = 1000
    # topic names and filters: bytes and '/'-separated levels (0 = unlimited); a PUBLISH over it:
    # DISCONNECT 0x90 (3.1.1: closed), a SUBSCRIBE filter: SUBACK 0x8F (3.1.1: 0x80)
    max_topic_length: int = 65535
    max_topic_levels: int = 0
    # MQTT 5 (docs/gateway.md "MQTT 5"): topic aliases a client may use towards us (CONNACK Topic
    # Alias Maximum; more -> DISCONNECT 0x94) and the most we assign towards one client
    topic_alias_maximum: int = 100
    # inbound QoS 1/2 publishes an MQTT 5 client may have unacknowledged (CONNACK Receive Maximum,
    # sent when below 65535; more -> DISCONNECT 0x93)
    receive_maximum: int = 65535
    response_information: str | None = None   # CONNACK Response Information for clients that ask
    sys_interval: float = 10.0        # seconds between $SYS/broker/... updates (0 = none published)
    connect_timeout_s: float = 10.0   # time allowed between TCP accept and CONNECT
    # an idle connected client's socket leaves the event loop after this many seconds with no packet
    # in or out and nothing in flight (gateway/net/parking.py; docs/gateway.md "Idle connections"); 0 = never
    park_idle_after_s: float = 2.0
    max_session_expiry_s: int = 0xFFFFFFFF   # cap; 3.1.1 persistent sessions never expire unless capped
    # delivery / back-pressure
    notify_window_ms: float = 2.0     # coalescing window of the in-process bus
    pull_batch: int = 64              # messages per light-queue pull
    pull_max_bytes: int = 1 << 20
    write_high_water: int = 1 << 20   # bytes queued to a socket before we stop pulling for it
    write_low_water: int = 256 << 10
    # a connection whose client drains fast grows its marks up to this (gateway/net/write_buffers.py),
    # all connections' growth together within write_buffers_max; write_high_water_max <= write_high_water: off
    write_high_water_max: int = 16 << 20
    write_buffers_max: int = 64 << 20
    max_pending_publish: int = 1000   # inbound publishes awaiting the store before we stop reading
    offset_flush_ms: float = 100.0    # how often dirty persistent-session offsets go to metadata
    # GIL hand-off interval of the `lmqtt serve` process (sys.setswitchinterval; Python's default is
    # 5 ms): the store's dispatch thread and the event loop share one GIL, and on a busy loop every
    # message crosses that hand-off twice (append -> dispatch -> notify). 0 = leave Python's default.
    switch_interval_ms: float = 0.5
    # Garbage collector of the `lmqtt serve` process: after startup everything alive is frozen
    # (gc.freeze: modules, config, restored sessions are never scanned again), and the young
    # generation is collected every `gc_gen0_threshold` allocations (Python: 700). Measured: full
    # collections of 50-95 ms were the largest loop stalls at 5,000 msg/s QoS 1. 0 = Python's default.
    gc_freeze: bool = True
    # store: dispatch on the appending (event-loop) thread when the dispatch thread is idle
    # (StoreConfig.dispatch_inline, docs/store.md "Inline dispatch"). Then the new entries are
    # visible when the append returns: subscribers get them in the same loop callback, fed from the
    # batch in hand (no pull, no thread hop; docs/gateway.md "The QoS 1 hot path").
    dispatch_inline: bool = True
    gc_gen0_threshold: int = 10000
    # the store's native protocol (docs/protocol.md) served by `lmqtt serve` too, so the SDK works
    # against the embedded default; 0 = off. A non-loopback store_host requires `token`.
    store_port: int = 10911
    store_host: str = "127.0.0.1"
    token: str | None = None
    # `lmqtt serve --workers N` (gateway/app/workers.py): N gateway processes on one port over one store
    # process; `reuse_port` (SO_REUSEPORT) lets several processes listen on the same port
    workers: int = 1
    reuse_port: bool = False
    # listeners beside the plain MQTT `port`, all on `host`; 0 = off (docs/gateway.md "Security and listeners")
    tls_port: int = 0                 # MQTT over TLS (needs cert, key)
    ws_port: int = 0                  # MQTT over WebSocket, path /mqtt, subprotocol mqtt
    wss_port: int = 0                 # MQTT over secure WebSocket (same cert/key)
    cert: str | None = None           # server certificate chain (PEM)
    key: str | None = None            # its private key (PEM; default: in `cert`)
    cafile: str | None = None         # CA of client certificates (TLS peers may present one)
    require_certificate: bool = False  # TLS clients without a valid certificate fail the handshake
    # authentication and access control; with none of password_file/hmac_keys/jwt_*/cafile,
    # anonymous clients are accepted on loopback only (a non-loopback host needs allow_anonymous)
    password_file: str | None = None  # Mosquitto-compatible user:hash file (`lmqtt passwd`)
    hmac_keys: str | None = None      # access_key:secret_key lines (RocketMQ-MQTT signatures)
    jwt_secret: str | None = None     # HS256 secret: a JWT as the CONNECT password
    jwt_public_key: str | None = None  # RS256/ES256 public key file, instead of jwt_secret
    allow_anonymous: bool = False     # accept clients without credentials (non-loopback too)
    acl_file: str | None = None       # Mosquitto acl_file or lmqtt's allow/deny rules
    # integrations (docs/integrations.md): an EMQX-shaped HTTP auth/ACL service (POST URL/auth on
    # CONNECT, URL/acl on PUBLISH/SUBSCRIBE, decisions cached per client and topic), users and ACL
    # rules kept in the store and changed live (`lmqtt admin --user-add`, the console)
    auth_http: str | None = None
    auth_http_timeout_s: float = 2.0  # longer: the client is refused (server unavailable), never allowed
    auth_http_cache_s: float = 60.0   # how long an ACL decision of the service is used
    live_security: bool = False
    # client, session and message events: POSTed as JSON batches to `webhook` (retried with backoff
    # from a queue of `webhook_queue` events; beyond it, dropped and counted) and stored as records
    # under $events/... (with `webhook`, or `events` alone) for the SDK and Spark
    webhook: str | None = None
    webhook_queue: int = 10000
    webhook_batch: int = 100
    events: bool = False
    # bridges to other MQTT brokers: the TOML file's [[bridge]] tables (gateway/integrations/bridge_config.py)
    bridge: list = field(default_factory=list)
    # `lmqtt gateway` (docs/fleet.md): the store node it uses instead of an embedded store, and
    # how it hears about new data. notify_mode: "native" = EVENT frames pushed on the store
    # connection; "broadcast" / "precise" = Redis pub/sub at `redis` (notify/redis_bus.py);
    # "poll" = no events, the safety poll only. Events are hints: every `safety_poll_ms` the
    # gateway re-reads the max offsets of the queues it serves, so a lost event delays a delivery
    # by at most that long.
    store_address: str | None = None  # HOST:PORT of `lmqtt store`, or every member of a store group (a,b,c)
    redis: str | None = None          # redis://HOST:6379/0
    notify_mode: str | None = None    # default: broadcast with `redis`, else native
    safety_poll_ms: float = 1000.0
    gateway_id: str | None = None     # default: host name + MQTT port (filter registrations are held per id)
    # tiered storage of the embedded store (`lmqtt serve`; docs/store.md "Tiered storage")
    tier: str | None = None           # fsspec URL: file:///mnt/cold/x, s3://bucket/prefix
    tier_endpoint: str | None = None  # S3-compatible server (MinIO, Ceph ...)
    local_retention: str | None = None  # kept locally once uploaded: 24h, 20GB, 24h,20GB (default 24h)
    tier_retention: str | None = None   # kept in the tier: 60d, 1TB, forever (default 60d)
    tier_cache_mb: int = 256          # memory for segments read back from the tier
    tier_parquet: str = "auto"        # also write uploaded segments as Parquet for Spark: auto, on, off
    tier_parquet_file_mb: int = 128   # small Parquet files of a topic and day merged into files this big
    tier_parquet_merge_after_s: float = 60.0   # ... also fewer than 8 of them once the newest is this old
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> "GatewayConfig":
        if self.flush_mode not in FLUSH_MODES:
            raise ConfigError(f"flush_mode must be one of {', '.join(FLUSH_MODES)}, got {self.flush_mode!r}")
        if not (0 <= int(self.port) <= 65535):
            raise ConfigError(f"port must be 0..65535, got {self.port}")
        try:
            retention_ms(self.retention)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if int(self.max_open_files) < 0:
            raise ConfigError(f"max_open_files must be 0 (the default share) or more, got {self.max_open_files}")
        if int(self.segment_mb) < min_segment_mb():
            raise ConfigError(f"segment_mb must be at least {min_segment_mb()} (MiB: a CommitLog segment holds the "
                              f"largest message, 4 MiB), got {self.segment_mb}")
        if not (0 <= int(self.metrics_port) <= 65535):
            raise ConfigError(f"metrics_port must be 0..65535 (0 = off), got {self.metrics_port}")
        if self.tier:
            try:
                check_tier(self.tier, self.tier_endpoint, self.local_retention, self.tier_retention,
                           self.tier_parquet)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        elif self.tier_endpoint or self.local_retention or self.tier_retention or self.tier_parquet == "on":
            raise ConfigError("tier_endpoint / local_retention / tier_retention / tier_parquet are set but tier "
                              "is not (tiered storage: --tier URL)")
        if not (0 <= int(self.store_port) <= 65535):
            raise ConfigError(f"store_port must be 0..65535 (0 = off), got {self.store_port}")
        for name in ("tls_port", "ws_port", "wss_port"):
            if not (0 <= int(getattr(self, name)) <= 65535):
                raise ConfigError(f"{name} must be 0..65535 (0 = off), got {getattr(self, name)}")
        if (self.tls_port or self.wss_port) and not self.cert:
            raise ConfigError("tls_port / wss_port need cert (and key) (--cert FILE --key FILE)")
        if self.console_tls and not self.cert:
            raise ConfigError("console_tls needs cert (and key) (--cert FILE --key FILE): the listener's certificate")
        if self.require_certificate and not self.cafile:
            raise ConfigError("require_certificate needs cafile (the CA that signs client certificates)")
        if self.jwt_secret and self.jwt_public_key:
            raise ConfigError("give one of jwt_secret or jwt_public_key, not both")
        if not (1 <= int(self.max_inflight) <= 65535):
            raise ConfigError(f"max_inflight must be 1..65535, got {self.max_inflight}")
        if not (0 <= int(self.topic_alias_maximum) <= 65535):
            raise ConfigError(f"topic_alias_maximum must be 0..65535 (0 = no aliases), got {self.topic_alias_maximum}")
        if not (1 <= int(self.receive_maximum) <= 65535):
            raise ConfigError(f"receive_maximum must be 1..65535, got {self.receive_maximum}")
        if not (0 <= float(self.switch_interval_ms) <= 1000):
            raise ConfigError(f"switch_interval_ms must be 0..1000 (0 = Python's default), got {self.switch_interval_ms}")
        if self.notify_mode is not None and self.notify_mode not in ("native", "broadcast", "precise", "poll"):
            raise ConfigError(f"notify_mode must be native, broadcast, precise or poll, got {self.notify_mode!r}")
        if self.notify_mode in ("broadcast", "precise") and not self.redis:
            raise ConfigError(f"notify_mode {self.notify_mode} needs redis (--redis redis://HOST:6379/0)")
        if not (0 < float(self.safety_poll_ms) <= 3_600_000):
            raise ConfigError(f"safety_poll_ms must be > 0 and at most an hour, got {self.safety_poll_ms}")
        if not (1 <= int(self.max_topic_length) <= 65535):
            raise ConfigError(f"max_topic_length must be 1..65535, got {self.max_topic_length}")
        for name in ("max_connections", "max_connections_per_address", "max_subscriptions", "max_topic_levels",
                     "max_offline_backlog", "max_qos0_backlog"):
            if int(getattr(self, name)) < 0:
                raise ConfigError(f"{name} must be >= 0 (0 = unlimited), got {getattr(self, name)}")
        for name, burst in (("connect_rate_per_address", "connect_burst_per_address"),
                            ("publish_rate_per_client", "publish_burst_per_client")):
            if float(getattr(self, name)) < 0:
                raise ConfigError(f"{name} must be >= 0 (per second; 0 = unlimited), got {getattr(self, name)}")
            if int(getattr(self, burst)) < 1:
                raise ConfigError(f"{burst} must be >= 1, got {getattr(self, burst)}")
        if self.write_low_water > self.write_high_water:
            raise ConfigError("write_low_water must not exceed write_high_water")
        if self.auth_http and not str(self.auth_http).startswith(("http://", "https://")):
            raise ConfigError(f"auth_http must be an http:// or https:// URL (the service's base: URL/auth, "
                              f"URL/acl), got {self.auth_http!r}")
        if self.webhook and not str(self.webhook).startswith(("http://", "https://")):
            raise ConfigError(f"webhook must be an http:// or https:// URL, got {self.webhook!r}")
        if not (0 < float(self.auth_http_timeout_s) <= 60):
            raise ConfigError(f"auth_http_timeout_s must be > 0 and at most 60, got {self.auth_http_timeout_s}")
        if float(self.auth_http_cache_s) < 0:
            raise ConfigError(f"auth_http_cache_s must be >= 0, got {self.auth_http_cache_s}")
        if int(self.webhook_queue) < 1 or int(self.webhook_batch) < 1:
            raise ConfigError("webhook_queue and webhook_batch must be at least 1")
        if int(self.workers) < 1:
            raise ConfigError(f"workers must be at least 1 (1 = everything in one process), got {self.workers}")
        return self

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)} - {"extra"}


def field_kinds() -> dict[str, type]:
    """GatewayConfig key -> bool / int / float / str (from the annotations; `str | None` is str)."""
    return kinds_of(GatewayConfig)


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file of `lmqtt serve` / `lmqtt gateway`: keys at top level or under
    `[serve]` / `[gateway]`, dashes or underscores. Strict: an unknown key or table is refused by
    name (with the closest known key), a value of the wrong type too (ConfigError). Top-level keys
    only `lmqtt store` knows, and the `[store]` table, are the store's and skipped here."""
    store_keys = NodeConfig.keys()      # the fleet's shared file
    doc, text = read_toml(path)
    kinds = field_kinds()
    flat: dict[str, Any] = {}

    def take(k: str, v: Any, table: str | None) -> None:
        key = k.replace("-", "_")
        at = where(path, text, k, table)
        if key not in kinds:
            if table is None and key in store_keys:
                return                      # a setting of `lmqtt store` in a shared file
            raise unknown_key(key, kinds, at, "lmqtt serve / lmqtt gateway (keys are the long flag "
                                                 "names, docs/gateway.md)")
        flat[key] = check_type(key, v, kinds[key], at)

    for k, v in doc.items():
        if k == "bridge":                   # [[bridge]]: a list of tables
            try:
                flat["bridge"] = bridge_config.parse_bridges(v, str(path))
            except bridge_config.ConfigError as e:
                raise ConfigError(str(e)) from None
            continue
        if isinstance(v, dict) and k in GATEWAY_TABLES:
            for k2, v2 in v.items():
                take(k2, v2, k)
        elif isinstance(v, dict) and k == STORE_TABLE:
            continue
        elif isinstance(v, dict) and k.replace("-", "_") not in kinds:
            raise unknown_table(k, path, GATEWAY_TABLES + (STORE_TABLE,))
        else:
            take(k, v, None)
    return flat


def build_config(file_values: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None) -> GatewayConfig:
    """Defaults <- config file <- command-line flags (only flags the user gave). Every key must be
    a setting and every value of the setting's type (`check_type`)."""
    cfg = GatewayConfig()
    kinds = field_kinds()
    for source in (file_values or {}, overrides or {}):
        for k, v in source.items():
            if v is None:
                continue
            if k == "bridge":               # already checked by load_toml
                cfg.bridge = list(v)
                continue
            if k not in kinds:
                raise unknown_key(k, kinds, "the configuration", "lmqtt serve / lmqtt gateway")
            setattr(cfg, k, check_type(k, v, kinds[k]))
    return cfg.validate()


class DefaultsSaid(argparse.HelpFormatter):
    """The --help of `lmqtt serve` and `lmqtt gateway`: every option that takes a value and whose
    help does not give a default says one: `0 = off` becomes `default 0 = off`, the others (files,
    URLs, names: nothing unless given) get `(default: none)`, so each command's --help says every
    default. (`_get_help_string` is argparse's hook for this, the one its
    ArgumentDefaultsHelpFormatter uses.)"""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        h = action.help
        if (action.nargs == 0 or action.required or not h or h == argparse.SUPPRESS or action.dest == "help"
                or "default" in h.lower()):
            return h
        return h.replace("0 = off", "default 0 = off") if "0 = off" in h else f"{h} (default: none)"


def hostport(host: str, port: int) -> str:
    """HOST:PORT for a URL in a banner: an IPv6 address in brackets (`[::1]:1883`)."""
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
