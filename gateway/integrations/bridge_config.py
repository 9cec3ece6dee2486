"""The `[[bridge]]` tables of the TOML file: a bridge's remote broker, credentials, TLS, and its
`topics` lines in Mosquitto's bridge syntax.

    [[bridge]]
    name = "cloud"                         # default bridge-1, bridge-2 ... (names the local client)
    address = "mqtt.example.com:8883"      # HOST:PORT of the remote broker (port default 1883)
    client_id = "edge-7"                   # on the remote (default lmqtt-bridge-NAME)
    username = "edge-7"                    # optional, with password
    password = "secret"
    protocol = 5                           # 5 (default: No Local and a loop marker) or 4 (3.1.1)
    tls = true                             # optional: cafile, certfile, keyfile, insecure (no hostname check)
    cafile = "/etc/ssl/certs/ca.pem"
    keepalive = 60
    reconnect_max_s = 30                   # the backoff between reconnects grows to this
    topics = ["sensors/# out 1", "cmd/# in 1 edge/ cloud/edge-7/", "chat/# both 0"]

A `topics` line is `pattern [out | in | both] [qos] [local-prefix remote-prefix]` (Mosquitto's
`topic` line): `out` forwards local messages whose topic is `local-prefix` + a topic matching
`pattern` to the remote as `remote-prefix` + that topic, `in` the reverse, `both` both; qos (0,
1, 2; default 0) is the highest QoS of the subscriptions on either side. `""` stands for an empty
prefix (`"# in 1 \\"\\" cloud/"`). Every mistake is a ConfigError naming the bridge and the line.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field



class ConfigError(ValueError):
    """A `[[bridge]]` table that cannot work (the configuration loader reports it as its own)."""

DIRECTIONS = ("out", "in", "both")
KEYS = {"name": str, "address": str, "client_id": str, "username": str, "password": str, "protocol": int,
        "tls": bool, "cafile": str, "certfile": str, "keyfile": str, "insecure": bool, "keepalive": int,
        "reconnect_max_s": (int, float), "topics": list, "local_receive_maximum": int}


@dataclass(frozen=True)
class TopicLine:
    pattern: str
    direction: str = "out"
    qos: int = 0
    local_prefix: str = ""
    remote_prefix: str = ""

    @property
    def local_filter(self) -> str:
        return self.local_prefix + self.pattern

    @property
    def remote_filter(self) -> str:
        return self.remote_prefix + self.pattern

    def outbound(self) -> bool:
        return self.direction in ("out", "both")

    def inbound(self) -> bool:
        return self.direction in ("in", "both")


@dataclass(frozen=True)
class BridgeConfig:
    name: str
    host: str
    port: int
    client_id: str
    topics: tuple[TopicLine, ...]
    username: str | None = None
    password: str | None = None
    protocol: int = 5
    tls: bool = False
    cafile: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    insecure: bool = False
    keepalive: int = 60
    reconnect_max_s: float = 30.0
    local_receive_maximum: int = 256
    extra: dict = field(default_factory=dict)


def parse_topic_line(text: str, where: str) -> TopicLine:
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise ConfigError(f"{where}: topics line {text!r}: {e}") from None
    if not words:
        raise ConfigError(f"{where}: an empty topics line")
    pattern, rest = words[0], words[1:]
    direction, qos = "out", 0
    if rest:
        if rest[0] not in DIRECTIONS:
            raise ConfigError(f"{where}: topics line {text!r}: direction must be out, in or both, got {rest[0]!r}")
        direction, rest = rest[0], rest[1:]
    if rest:
        if rest[0] not in ("0", "1", "2"):
            raise ConfigError(f"{where}: topics line {text!r}: qos must be 0, 1 or 2, got {rest[0]!r}")
        qos, rest = int(rest[0]), rest[1:]
    lp = rp = ""
    if rest:
        if len(rest) != 2:
            raise ConfigError(f"{where}: topics line {text!r}: give both prefixes, local then remote (\"\" for none)")
        lp, rp = rest
    line = TopicLine(pattern, direction, qos, lp, rp)
    for flt in (line.local_filter, line.remote_filter):
        _check_filter(flt, where, text)
    return line


def _check_filter(flt: str, where: str, text: str) -> None:
    lv = flt.split("/")
    bad = not flt or any(("#" in x and (x != "#" or i != len(lv) - 1)) or ("+" in x and x != "+")
                         for i, x in enumerate(lv))
    if bad:
        raise ConfigError(f"{where}: topics line {text!r}: {flt!r} is not a valid topic filter "
                          f"(prefixes are added before the pattern)")


def parse_bridges(value, path: str) -> list[BridgeConfig]:
    """The `[[bridge]]` array of tables of `path`; ConfigError naming the bridge and what is wrong."""
    if not isinstance(value, list) or not all(isinstance(b, dict) for b in value):
        raise ConfigError(f"{path}: bridge must be an array of tables ([[bridge]])")
    out: list[BridgeConfig] = []
    names: set[str] = set()
    for i, b in enumerate(value, 1):
        name = b.get("name") or f"bridge-{i}"
        where = f"{path}: [[bridge]] {name!r}"
        for k, v in b.items():
            kind = KEYS.get(k.replace("-", "_"))
            if kind is None:
                import difflib  # only a mistyped key
                close = difflib.get_close_matches(k, list(KEYS), n=1)
                raise ConfigError(f"{where}: unknown key {k!r}" + (f" (did you mean {close[0]!r}?)" if close else
                                                                   f" (known: {', '.join(KEYS)})"))
            if kind is not bool and isinstance(v, bool) or not isinstance(v, kind):
                raise ConfigError(f"{where}: {k} has the wrong type ({type(v).__name__})")
        b = {k.replace("-", "_"): v for k, v in b.items()}
        if name in names:
            raise ConfigError(f"{where}: two bridges are named {name!r}")
        names.add(name)
        addr = b.get("address")
        if not addr:
            raise ConfigError(f"{where}: address = \"HOST:PORT\" of the remote broker is required")
        host, sep, port_s = addr.rpartition(":")
        if not sep:
            host, port_s = addr, "1883"
        if not port_s.isdigit() or not 0 < int(port_s) < 65536:
            raise ConfigError(f"{where}: address {addr!r}: {port_s!r} is not a port number")
        topics = b.get("topics") or []
        if not topics:
            raise ConfigError(f"{where}: topics = [\"pattern [out|in|both] [qos] [local-prefix remote-prefix]\", ...] "
                              "is required")
        lines = tuple(parse_topic_line(t, where) if isinstance(t, str) else
                      _raise(ConfigError(f"{where}: each topics entry is a string")) for t in topics)
        protocol = int(b.get("protocol", 5))
        if protocol not in (4, 5):
            raise ConfigError(f"{where}: protocol must be 4 (MQTT 3.1.1) or 5, got {protocol}")
        if (b.get("certfile") is None) != (b.get("keyfile") is None):
            raise ConfigError(f"{where}: certfile and keyfile go together (a client certificate)")
        out.append(BridgeConfig(
            name=name, host=host.strip("[]") or "127.0.0.1", port=int(port_s),
            client_id=b.get("client_id") or f"lmqtt-bridge-{name}", topics=lines, username=b.get("username"),
            password=b.get("password"), protocol=protocol, tls=bool(b.get("tls", False) or b.get("cafile")),
            cafile=b.get("cafile"), certfile=b.get("certfile"), keyfile=b.get("keyfile"),
            insecure=bool(b.get("insecure", False)), keepalive=int(b.get("keepalive", 60)),
            reconnect_max_s=float(b.get("reconnect_max_s", 30.0)),
            local_receive_maximum=int(b.get("local_receive_maximum", 256))))
    return out


def _raise(e: Exception):
    raise e
