"""`lmqtt store`'s settings (`NodeConfig`), and the strict TOML loader every lmqtt command reads
its `--config` file with.

Why one dataclass, as the gateway's (`gateway/app/config.py`): every knob has one name, used in
the TOML file (top level or `[store]`), on the command line (`--flag-name`) and in code
(`cfg.flag_name`).

Adding a setting is one field below: `name: type = setting(default, "help")`. That field is then
a flag of `lmqtt store` (`--name-with-dashes`; `flag=False`: the config file only), a key of the
config file, checked against its annotation when read from a file (`int`, `float`, `str`, `bool`,
`X | None`); `choices=`, `low=` / `high=` (with `unit=`) are checked by `validate()` for flags and
keys alike; a rule between settings goes at the end of `validate()`.

The loader (`read_toml`, `line_of`, `unknown_key`, `check_type`, `kinds_of`) is shared with the
gateway's configuration (one lmqtt.toml may configure the whole fleet: the Helm chart mounts one
file into the store and gateway pods); this module imports nothing of lmqtt but the engine's
`min_segment_mb` and the tier's `check_tier`, when called, and passes them on to the gateway's
configuration (which may not import the engine), so both sides may import it (docs/internals.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from lmqtt.store.config import min_segment_mb as engine_min_segment_mb
from lmqtt.store.ha.peers import group_problem
from lmqtt.store.tier.config import check_tier as tier_check, parse_retention

FLUSH_MODES = ("sync", "async", "async+buffer")

# tables of a config file: [serve] and [gateway] are the gateway's; [store] is `lmqtt store`'s (one
# file may configure the whole fleet, as the Helm chart's lmqtt.toml does)
GATEWAY_TABLES = ("serve", "gateway")
STORE_TABLE = "store"


class ConfigError(ValueError):
    """A bad configuration value; the message names the key and what is allowed."""


def min_segment_mb() -> int:
    """The smallest CommitLog segment in MiB (the engine's `store/config.py min_segment_mb`): what
    `segment_mb` of `lmqtt serve` and `lmqtt store` is checked against before a data dir is touched."""
    return engine_min_segment_mb()


def retention_ms(text: str) -> int:
    """A `retention` setting (10m, 72h, 7d) -> milliseconds; ValueError naming the setting."""
    ms, size = parse_retention(text, "retention")
    if ms is None or size is not None or ms <= 0:
        raise ValueError(f"retention must be a duration such as 10m, 72h or 7d, got {text!r}")
    return ms


def check_tier(url: str, endpoint: str | None = None, local_retention: str | None = None,
               tier_retention: str | None = None, parquet: str | None = "auto") -> Any:
    """The tier flags checked before the store starts (store/tier/config.py `check_tier`): its
    TierConfig, or ValueError with one line naming the flag."""
    return tier_check(url, endpoint, local_retention, tier_retention, parquet)


# ------------------------------------------------------------------------------ the loader
def read_toml(path: str | Path) -> tuple[dict[str, Any], str]:
    """(document, text) of a TOML config file; every way it cannot be read is a ConfigError naming
    the file (and the line where that is known), never a traceback."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {p} is a directory, not a file") from None
    except PermissionError:
        raise ConfigError(f"cannot read config file {p}: permission denied") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"config file {p} is not a TOML text file: line {line} has a byte that is not "
                          f"UTF-8 (0x{raw[e.start]:02x} at byte offset {e.start}); is it a binary file?") from None
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p} is not valid TOML: {e}") from None


def line_of(text: str, key: str, table: str | None = None) -> int | None:
    """The line (1-based) where `key` (dashes or underscores) is set in `text`, in `[table]` when
    given, else before any table; None if not found (a dotted or quoted key: messages then go
    without a line)."""
    names = {key, key.replace("_", "-")}
    current = None
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        m = re.match(r"^\[\s*([A-Za-z0-9_.-]+)\s*\]", s)
        if m:
            current = m.group(1)
            continue
        m = re.match(r"^([A-Za-z0-9_-]+)\s*=", s)
        if m and m.group(1) in names and current == table:
            return n
    return None


def where(path: str | Path, text: str, key: str, table: str | None) -> str:
    """`FILE line N [table]`: where `key` is set, for a message."""
    n = line_of(text, key, table)
    return f"{path}" + (f" line {n}" if n else "") + (f" [{table}]" if table else "")


def unknown_key(key: str, known: Iterable[str], where: str, what: str) -> ConfigError:
    """`unknown key 'tls_prot' in FILE line 3 (did you mean 'tls_port'?)`: the closest known key by
    difflib, else where the keys are listed."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else f"not a setting of {what}"
    return ConfigError(f"unknown key {key!r} in {where} ({hint})")


def unknown_table(name: str, path: str | Path, tables: tuple[str, ...]) -> ConfigError:
    close = difflib.get_close_matches(name, tables, n=1, cutoff=0.6)
    hint = f"did you mean [{close[0]}]?" if close else \
        "the tables are " + ", ".join(f"[{t}]" for t in tables[:-1]) + f" and [{tables[-1]}]"
    return ConfigError(f"unknown table [{name}] in {path} ({hint})")


_KIND_NAMES = {bool: "true or false (a TOML boolean, without quotes)", int: "an integer",
               float: "a number", str: "a string (in quotes)"}


def check_type(key: str, value: Any, kind: type, where: str = "", expected: str | None = None) -> Any:
    """`value` as `kind` if it is one in TOML's types, else a ConfigError naming the key and the
    type. No conversion between types: `allow_anonymous = "false"` is a string, not a boolean (a
    conversion made it true), `port = "1883"` a string, not a port; an integer is a number."""
    ok = (isinstance(value, bool) if kind is bool else
          isinstance(value, int) and not isinstance(value, bool) if kind is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
          isinstance(value, str))
    if ok:
        return float(value) if kind is float else value
    got = f"{value!r} (a string)" if isinstance(value, str) else \
        f"{str(value).lower()} (a boolean)" if isinstance(value, bool) else \
        f"{value!r} (a {type(value).__name__})" if not isinstance(value, (dict, list)) else \
        f"a {'table' if isinstance(value, dict) else 'list'}"
    hint = ""
    if isinstance(value, str) and kind is not str:
        bare = value.strip().lower() if kind is bool else value.strip()
        try:
            if kind is bool and bare in ("true", "false"):
                hint = f"; write {key} = {bare}, without quotes"
            elif kind in (int, float):
                kind(bare)
                hint = f"; write {key} = {bare}, without quotes"
        except ValueError:
            pass
    loc = f" ({where})" if where else ""
    raise ConfigError(f"{key} must be {expected or _KIND_NAMES[kind]}, got {got}{loc}{hint}")


def kinds_of(cls) -> dict[str, type]:
    """A settings dataclass's key -> bool / int / float / str, from the annotations (`str | None`
    is str); fields of other types (the gateway's `extra` dict) are not settings."""
    kinds = {"bool": bool, "int": int, "float": float, "str": str}
    out = {}
    for f in dataclasses.fields(cls):
        base = str(f.type).replace(" | None", "").strip()
        if base in kinds:
            out[f.name] = kinds[base]
    return out


# ------------------------------------------------------------------------------ the settings
def setting(default: Any, help: str, *, flag: bool = True, choices: tuple[str, ...] | None = None,
            low: float | None = None, high: float | None = None, unit: str | None = None) -> Any:
    """A NodeConfig field: its default, its one-line doc (the flag's help), and what `validate()`
    checks. `flag=False`: a key of the config file only."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices, "low": low,
                                            "high": high, "unit": unit})


@dataclass
class NodeConfig:
    """Every setting of `lmqtt store`: a flag `--name-with-dashes` and a config-file key `name`."""
    host: str = setting("127.0.0.1", "listen address (default 127.0.0.1)")
    port: int = setting(10911, "port (default 10911; 0 = any free port)", low=0, high=65535)
    data_dir: str = setting("./lmqtt-data", "data directory (default ./lmqtt-data)")
    token: str | None = setting(None, "auth token clients send in the handshake (required off loopback; "
                                      "default $LMQTT_STORE_TOKEN)")
    flush_mode: str = setting("async", "store flush mode (default async)", choices=FLUSH_MODES)
    segment_mb: int = setting(32, "CommitLog segment size in MiB of a new data dir (default 32, preallocated; an "
                                  "existing data dir keeps its own; a busy server: 256)")
    retention: str = setting("72h", "how long sealed CommitLog segments are kept: 10m, 72h, 7d (default 72h; with "
                                    "--tier: --local-retention)")
    max_open_files: int = setting(0, "the store's share of the open-files limit: RocksDB table files, mapped "
                                     "CommitLog segments (default 0: half the process limit, at most 4096)", low=0)
    max_frame_mb: int = setting(64, "largest accepted frame in MiB (default 64)", low=1, unit="MiB")
    redis: str | None = setting(None, "also publish new-data events to Redis pub/sub (gateways with --redis)")
    notify_mode: str = setting("broadcast", "Redis notify mode (default broadcast)", choices=("broadcast", "precise"))
    notify_window_ms: float = setting(2.0, "events for one queue within this window merge (default 2)")
    metrics_port: int = setting(0, "HTTP /metrics, /healthz, /readyz port (default 0 = off)", low=0, high=65535)
    metrics_host: str | None = setting(None, "address of the metrics listener (default: host)", flag=False)
    will_grace_s: float = setting(5.0, "publish the wills of a gateway whose store connection stays gone this "
                                       "long (default 5)", low=0.0, high=86400.0, unit="seconds")
    filter_linger_s: float = setting(60.0, "a wildcard filter its last holder let go of stays indexed this long, "
                                           "its queue whole for a holder taking it back (default 60; 0: dropped "
                                           "at once)", low=0.0, high=86400.0, unit="seconds")
    session_sweep_s: float = setting(60.0, "check this often for sessions whose gateway is gone for good: expired "
                                           "ones end (default 60)", low=0.1, high=86400.0, unit="seconds")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING (default INFO)")
    dispatch_inline: bool = setting(True, "dispatch on the appending thread when the dispatch thread is idle "
                                          "(docs/store.md \"Inline dispatch\")", flag=False)
    # tiered storage (store/tier, docs/store.md "Tiered storage")
    tier: str | None = setting(None, "upload sealed CommitLog segments to this fsspec URL (file:///mnt/cold/x, "
                                     "s3://bucket/prefix) and read offloaded ranges back from it")
    tier_endpoint: str | None = setting(None, "with --tier s3://...: the endpoint of an S3-compatible server "
                                              "(MinIO, Ceph ...); credentials from AWS_ACCESS_KEY_ID/_SECRET_ACCESS_KEY")
    local_retention: str | None = setting(None, "with --tier: kept on the local disk once in the tier: a time "
                                                "(24h), a size (20GB) or both (24h,20GB) (default 24h)")
    tier_retention: str | None = setting(None, "with --tier: kept in the tier: 60d, 1TB, forever (default 60d)")
    # a replicated store group (store/ha, store/node/ha_member.py, docs/ha.md)
    group: str | None = setting(None, "run as a member of this replicated store group (with --node-id, --peers)")
    node_id: int = setting(0, "this member's position in --peers (1-based)", low=0, high=255)
    peers: str | None = setting(None, "every group member's HOST:PORT, the same list on every member; a member "
                                      "also uses PORT+1 (Raft) and PORT+2 (replication)")
    join: str | None = setting(None, "join a running group: any of its members' HOST:PORT (comma-separated); "
                                     "this store waits until `lmqtt admin --add-member` adds it (instead of "
                                     "--peers/--node-id)")
    ack_replicas: int | None = setting(None, "replicas that must have a record before it is acknowledged "
                                             "(default: a majority of the group counting the primary)")
    election_timeout_s: float = setting(2.5, "a group's primary silent this long is replaced (default 2.5)",
                                        low=0.5, high=60.0, unit="seconds")
    tier_cache_mb: int = setting(256, "with --tier: memory for segments read back from the tier (default 256)",
                                 low=1, unit="MiB")
    tier_parquet: str = setting("auto", "with --tier: also write each uploaded segment's records as Parquet files "
                                        "for Spark (docs/spark.md): auto (when pyarrow is importable), on, off "
                                        "(default auto)", choices=("auto", "on", "off"))
    tier_parquet_file_mb: int = setting(128, "with --tier-parquet: merge a topic's and day's small Parquet files into "
                                             "files of up to this size (default 128)", low=1, unit="MiB")
    tier_parquet_merge_after_s: float = setting(60.0, "with --tier-parquet: merge a topic's and day's small Parquet "
                                                      "files once the newest is this old, fewer than 8 too (default 60)",
                                                low=0.0, high=86400.0, unit="seconds")

    @classmethod
    def keys(cls) -> dict[str, type]:
        """key -> type of every setting (what a config file may set)."""
        return kinds_of(cls)

    # ------------------------------------------------------------------ command line
    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        """One flag per setting with `flag=True`; a flag not given is None (the file or the default
        then holds)."""
        kinds = cls.keys()
        for f in dataclasses.fields(cls):
            md = f.metadata
            if not md.get("flag"):
                continue
            name = "--" + f.name.replace("_", "-")
            kind = kinds[f.name]
            if kind is bool:
                p.add_argument(name, action=argparse.BooleanOptionalAction, default=None, help=md["help"])
            else:
                kw: dict[str, Any] = {} if kind is str else {"type": kind}
                p.add_argument(name, choices=md.get("choices"), help=md["help"], **kw)

    # ------------------------------------------------------------------ config file
    @classmethod
    def from_file(cls, path: str | Path, gateway_keys: Iterable[str] = ()) -> dict[str, Any]:
        """The settings of `lmqtt store` in a TOML file, by key: keys at top level or under
        `[store]`, dashes or underscores. Strict: an unknown key or table is refused by name with
        the closest known one, a value of the wrong type too (ConfigError). A top-level key of
        `gateway_keys` (the gateway's settings) and the `[serve]` / `[gateway]` tables belong to the
        gateway in a file shared by the fleet, and are skipped."""
        doc, text = read_toml(path)
        kinds = cls.keys()
        gateway_keys = set(gateway_keys)
        for k, v in doc.items():
            if isinstance(v, dict) and k not in (STORE_TABLE,) + GATEWAY_TABLES and k.replace("-", "_") not in kinds:
                raise unknown_table(k, path, (STORE_TABLE,) + GATEWAY_TABLES)
        raw_table = doc.get(STORE_TABLE)
        table: dict[str, Any] = raw_table if isinstance(raw_table, dict) else {}
        top = {k: v for k, v in doc.items() if not (isinstance(v, dict) and k in (STORE_TABLE,) + GATEWAY_TABLES)}
        out: dict[str, Any] = {}
        for source, tbl in ((top, None), (table, STORE_TABLE)):
            for k, v in source.items():
                key = k.replace("-", "_")
                at = where(path, text, k, tbl)
                if key not in kinds:
                    if tbl is None and key in gateway_keys:
                        continue
                    # at the top level a key may be the gateway's: the closest of either is suggested
                    known = set(kinds) | (gateway_keys if tbl is None else set())
                    raise unknown_key(key, known, at, "lmqtt store (known: " + ", ".join(sorted(kinds)) + ")")
                out[key] = check_type(key, v, kinds[key], at, cls._expected(key))
        return out

    @classmethod
    def _expected(cls, key: str) -> str | None:
        unit = cls.__dataclass_fields__[key].metadata.get("unit")
        return f"a number of {unit}" if unit == "seconds" else None

    @classmethod
    def build(cls, file_values: dict[str, Any] | None = None, flags: dict[str, Any] | None = None,
              env: dict[str, str] | None = None) -> "NodeConfig":
        """Defaults < config file < $LMQTT_STORE_TOKEN (when no token is set yet) < flags given
        (None: not given); then `validate()`."""
        cfg = cls()
        kinds = cls.keys()
        for k, v in (file_values or {}).items():
            setattr(cfg, k, v)
        environ: Mapping[str, str] = os.environ if env is None else env
        if not cfg.token and environ.get("LMQTT_STORE_TOKEN"):
            cfg.token = environ["LMQTT_STORE_TOKEN"]
        for k, v in (flags or {}).items():
            if v is None:
                continue
            if k not in kinds:
                raise unknown_key(k, kinds, "the configuration", "lmqtt store")
            setattr(cfg, k, v)
        return cfg.validate()

    def validate(self) -> "NodeConfig":
        """Every setting's choices and bounds (from its field), then the rules between settings;
        a ConfigError naming the first that fails."""
        for f in dataclasses.fields(self):
            md, v = f.metadata, getattr(self, f.name)
            if md.get("choices") and v not in md["choices"]:
                raise ConfigError(f"{f.name} must be one of {', '.join(md['choices'])}, got {v!r}")
            low, high, unit = md.get("low"), md.get("high"), md.get("unit")
            if low is None and high is None:
                continue
            try:
                n = float(v)
            except (TypeError, ValueError):
                raise ConfigError(f"{f.name} must be {'a number of ' + unit if unit else 'a number'}, "
                                  f"got {v!r}") from None
            if (low is not None and n < low) or (high is not None and n > high):
                if high is None:
                    raise ConfigError(f"{f.name} must be at least {low:g}" + (f" ({unit})" if unit else "") +
                                      f", got {v}")
                raise ConfigError(f"{f.name} must be {low:g}..{high:g}" + (f" {unit}" if unit else "") + f", got {v}")
            if kinds_of(type(self))[f.name] is float:
                setattr(self, f.name, n)
        try:
            retention_ms(self.retention)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if int(self.segment_mb) < min_segment_mb():
            raise ConfigError(f"segment_mb must be at least {min_segment_mb()} (MiB: a CommitLog segment holds the "
                              f"largest message, 4 MiB), got {self.segment_mb}")
        if self.tier:
            try:
                check_tier(self.tier, self.tier_endpoint, self.local_retention, self.tier_retention,
                           self.tier_parquet)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        else:
            given = [n for n in ("tier_endpoint", "local_retention", "tier_retention") if getattr(self, n)]
            given += ["tier_parquet"] if self.tier_parquet == "on" else []
            if given:
                raise ConfigError(f"{given[0]} is set but tier is not (tiered storage: --tier URL)")
        problem = group_problem(self)
        if problem:
            raise ConfigError(problem)
        return self
