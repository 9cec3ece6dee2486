"""Which package and which gateway room may import which: the rules are the table `MAY_IMPORT`
below, written once; docs/internals.md prints the same table (checked by
`test_the_docs_show_the_same_rules`). The check reads the source (ast), so a wrong import fails
here in CI, whatever code path would have run it.

Units are matched by the longest prefix: `lmqtt.store.node`, `lmqtt.store.client`,
`lmqtt.store.spark` are units of their own and `lmqtt.store` is the rest (the engine); every
room of the gateway (`lmqtt.gateway.broker`, ...) is a unit. Imports under `if TYPE_CHECKING:` are
annotations, not dependencies, and are not counted. `EXCEPTIONS` lists the imports that break a
rule today, each with why it still stands; the list only shrinks (a stale entry fails too).
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]

# folder -> package (pyproject.toml's package-dir)
FOLDERS = {"store": "lmqtt.store", "lightqueue": "lmqtt.lightqueue", "notify": "lmqtt.notify",
           "gateway": "lmqtt.gateway", "loadtest": "lmqtt.loadtest", "examples": "lmqtt.examples"}

UNITS = [
    "lmqtt.store", "lmqtt.store.server", "lmqtt.store.ha", "lmqtt.store.tier.parquet", "lmqtt.store.tier.objects",
    "lmqtt.store.tier.topics",
    "lmqtt.store.client", "lmqtt.store.client.props", "lmqtt.store.client.tools",
    "lmqtt.store.spark", "lmqtt.store.spark.columns",
    "lmqtt.store.node", "lmqtt.store.node.protocol", "lmqtt.store.node.wire", "lmqtt.store.node.config",
    "lmqtt.store.errors", "lmqtt.store.message", "lmqtt.store.protocol", "lmqtt.store.record", "lmqtt.store.accel",
    "lmqtt.store.produce", "lmqtt.store.loopback", "lmqtt.store.allocator", "lmqtt.store.gc_pauses",
    "lmqtt.lightqueue", "lmqtt.lightqueue.errors", "lmqtt.lightqueue.topics", "lmqtt.lightqueue.records",
    "lmqtt.notify",
    "lmqtt.gateway", "lmqtt.gateway.mqtt", "lmqtt.gateway.storage", "lmqtt.gateway.storage.facades",
    "lmqtt.gateway.storage.record_props",
    "lmqtt.gateway.net",
    "lmqtt.gateway.security", "lmqtt.gateway.session", "lmqtt.gateway.inbound", "lmqtt.gateway.delivery",
    "lmqtt.gateway.subscriptions", "lmqtt.gateway.clients", "lmqtt.gateway.broker",
    "lmqtt.gateway.fleet", "lmqtt.gateway.app", "lmqtt.gateway.app.config",
    "lmqtt.gateway.integrations", "lmqtt.gateway.integrations.bridge_config",
    "lmqtt.loadtest", "lmqtt.loadtest.chaos", "lmqtt.loadtest.chaos.checker", "lmqtt.loadtest.fleet_launcher", "lmqtt.examples",
]

# unit -> the units it may import (besides itself). The processes: `lmqtt store` is
# lmqtt.store.node, `lmqtt gateway` is lmqtt.gateway.app.gateway_command over the gateway's rooms,
# `lmqtt serve` is lmqtt.gateway.app.serve_command, which composes both in one process.
#
# store/ is sealed by role: the engine imports no network code (the server, replication, the SDK);
# the server is its own unit over the engine; the SDK imports only the store's vocabulary; Spark
# only the SDK, the vocabulary and the tier's Parquet format; the tier's Parquet writer lives with
# the tier; the gateway's connections to a store live in gateway/storage/; the produce, consume and
# admin tools live with the SDK.
MAY_IMPORT: dict[str, set[str]] = {
    # the engine: CommitLog, ConsumeQueue, index, timer, POP state, retention, the tier's segments
    "lmqtt.store": set(),
    # the store server: the engine served over the native protocol (docs/protocol.md)
    "lmqtt.store.server": {"lmqtt.store"},
    # a replicated store group (docs/ha.md): the engine's log shipped between members; its members
    # answer the server's CALLs (CallError); a replica's follower reconnects to its primary by the
    # one reconnect schedule of every connection to a store (the SDK's failover.Retry)
    "lmqtt.store.ha": {"lmqtt.store", "lmqtt.store.server", "lmqtt.store.client"},
    # the tier's objects and manifest topics: what the tier service and Spark's cold reader share
    "lmqtt.store.tier.objects": set(),
    "lmqtt.store.tier.topics": set(),
    # the tier's Parquet copy for Spark (--tier-parquet): the CommitLog's record layout in, the lmqtt
    # schema's Arrow columns (shared with the Spark reader) out; run by the tier service in the node
    "lmqtt.store.tier.parquet": {"lmqtt.store", "lmqtt.store.spark.columns"},
    # the engines' vocabulary (see VOCABULARY below): nothing of ours but each other
    "lmqtt.store.errors": set(),
    "lmqtt.store.message": set(),
    "lmqtt.store.protocol": set(),
    "lmqtt.store.accel": set(),
    "lmqtt.store.loopback": set(),      # is_loopback: the one listen-address rule of every process
    "lmqtt.store.allocator": set(),     # jemalloc for the long-running processes, chosen at their start
    "lmqtt.store.gc_pauses": set(),     # the garbage collector's long pauses logged, in every long-running process
    "lmqtt.store.record": {"lmqtt.store.errors", "lmqtt.store.message", "lmqtt.store.accel"},
    # the PRODUCE body's per-message codec (C: _produce): packed by gateways, unpacked by the server
    "lmqtt.store.produce": {"lmqtt.store.protocol", "lmqtt.store.message", "lmqtt.store.accel"},
    "lmqtt.lightqueue.errors": set(),
    "lmqtt.lightqueue.topics": {"lmqtt.lightqueue.errors"},
    "lmqtt.lightqueue.records": {"lmqtt.lightqueue.errors"},
    # the SDK: the native protocol's client side, over the store's vocabulary only
    "lmqtt.store.client": {"lmqtt.store.errors", "lmqtt.store.protocol", "lmqtt.store.record", "lmqtt.store.accel"},
    # the record props codec (MQTT metadata in a record's props, the retained value's expiry):
    # the SDK's vocabulary (see VOCABULARY), written by the gateway and by the store node
    "lmqtt.store.client.props": set(),
    # `lmqtt produce`, `consume`, `admin`: the SDK's tools; `admin --gateways` sends the node's typed
    # gw_* requests, `admin --sessions` reads session records (their expiry's "never")
    "lmqtt.store.client.tools": {"lmqtt.store.client", "lmqtt.store.node.protocol", "lmqtt.lightqueue.records",
                                 # admin --user-add / --acl-add: the password hashed and the rule parsed
                                 # as the gateway does, before they are sent
                                 "lmqtt.gateway.security"},
    # Spark: the SDK, the vocabulary, the lmqtt schema's Arrow columns; the cold reader reads the
    # tier's manifest and Parquet format
    "lmqtt.store.spark": {"lmqtt.store.client", "lmqtt.store.spark.columns", "lmqtt.store.tier.parquet",
                          "lmqtt.store.tier.objects", "lmqtt.store.tier.topics", "lmqtt.store.protocol",
                          "lmqtt.store.record", "lmqtt.store.errors", "lmqtt.store.accel"},
    # the lmqtt schema's Arrow columns (pyarrow; C: _columns), from pull replies or CommitLog records
    "lmqtt.store.spark.columns": {"lmqtt.store.protocol", "lmqtt.store.record", "lmqtt.store.accel",
                                  "lmqtt.store.client.props"},
    "lmqtt.lightqueue": {"lmqtt.store"},
    "lmqtt.notify": {"lmqtt.store", "lmqtt.lightqueue"},
    # `lmqtt store`: the engine, its server, replication, the tier's Parquet writer, light queues and
    # notify served to SDK clients and gateways (and, store/node/inprocess.py, the gateway's storage
    # facades it implements for `lmqtt serve`); a retained will it publishes keeps its expiry with
    # the record props codec; one lmqtt.toml configures the fleet, so the node knows the gateway's
    # setting names (`lmqtt.gateway.app.config`, a leaf) to tell them from typos at the file's top level
    "lmqtt.store.node": {"lmqtt.store", "lmqtt.store.server", "lmqtt.store.ha", "lmqtt.store.tier.parquet",
                         "lmqtt.lightqueue", "lmqtt.notify", "lmqtt.store.node.protocol",
                         "lmqtt.store.node.config", "lmqtt.gateway.storage.facades", "lmqtt.store.client.props",
                         "lmqtt.gateway.app.config"},
    # the gw_* commands' types, which the node and the gateway both import: their codec only
    "lmqtt.store.node.protocol": {"lmqtt.store.node.wire"},
    # the typed messages' codec (dataclass <-> JSON, every field checked) the protocol is written in: nothing of ours
    "lmqtt.store.node.wire": set(),
    # `lmqtt store`'s settings (NodeConfig) and the strict TOML loader every command reads its
    # --config with (the gateway's configuration imports it): the engine's min_segment_mb, the
    # tier's and the group's flag checks
    "lmqtt.store.node.config": {"lmqtt.store", "lmqtt.store.ha"},
    # the gateway, room by room, from the bottom up; no room (app/ included) imports the engine, the
    # light queues or RocksDB (test_no_gateway_module_imports_rocksdb): only their vocabulary
    # (errors, value types, topic rules, codecs, is_loopback)
    "lmqtt.gateway.mqtt": {"lmqtt.store.accel"},               # the C loader
    # the storage facades (one Protocol per concern): what both sides of the seam import; nothing of ours
    "lmqtt.gateway.storage.facades": set(),
    # what a record's props hold of an MQTT message (the SDK's props codec, MQTT's property types)
    "lmqtt.gateway.storage.record_props": {"lmqtt.gateway.mqtt", "lmqtt.store.client.props"},
    # their remote implementations and the gateway's connections to a store (store_link.py: the
    # SDK's protocol, handshake and member rules on the loop's selector; node_client.py: the node's
    # typed requests over it), the record codec
    "lmqtt.gateway.storage": {"lmqtt.store.client", "lmqtt.store.node.protocol", "lmqtt.gateway.storage.facades",
                              "lmqtt.store.errors", "lmqtt.store.message", "lmqtt.store.protocol",
                              "lmqtt.store.produce", "lmqtt.store.record", "lmqtt.lightqueue.records"},
    # the MQTT session machine (sans-IO, as the codec): the codec, nothing else of ours
    "lmqtt.gateway.session": {"lmqtt.gateway.mqtt", "lmqtt.store.accel"},   # accel: the C loader (session/_offer.c)
    "lmqtt.gateway.net": {"lmqtt.gateway.mqtt", "lmqtt.store.accel",    # accel: the C loader (net/_park.c)
                          "lmqtt.gateway.session"},  # a parked session's fold; session.rare, the RareField an MqttSession uses too
    "lmqtt.gateway.security": {"lmqtt.gateway.mqtt", "lmqtt.gateway.net"},
    # messages in: PUBLISH -> the store -> the ack
    "lmqtt.gateway.inbound": {"lmqtt.gateway.mqtt", "lmqtt.gateway.storage.record_props",
                              "lmqtt.gateway.storage.facades", "lmqtt.lightqueue.errors", "lmqtt.lightqueue.topics",
                              "lmqtt.store.errors", "lmqtt.store.message"},
    # messages out: the delivery engine offers what it reads to the session machine
    "lmqtt.gateway.delivery": {"lmqtt.gateway.mqtt", "lmqtt.gateway.session", "lmqtt.gateway.storage.record_props",
                               "lmqtt.gateway.storage.facades", "lmqtt.lightqueue.errors", "lmqtt.lightqueue.topics",
                               "lmqtt.store.errors", "lmqtt.store.message"},
    "lmqtt.gateway.subscriptions": {"lmqtt.gateway.mqtt", "lmqtt.gateway.session", "lmqtt.gateway.delivery",
                                    "lmqtt.gateway.storage.facades", "lmqtt.gateway.storage.record_props",
                                    "lmqtt.lightqueue.errors", "lmqtt.lightqueue.topics", "lmqtt.lightqueue.records"},
    "lmqtt.gateway.clients": {"lmqtt.gateway.mqtt", "lmqtt.gateway.session", "lmqtt.gateway.subscriptions",
                              "lmqtt.gateway.storage.facades", "lmqtt.gateway.storage.record_props",
                              "lmqtt.lightqueue.errors", "lmqtt.lightqueue.topics", "lmqtt.lightqueue.records"},
    "lmqtt.gateway.broker": {"lmqtt.gateway.mqtt", "lmqtt.gateway.session", "lmqtt.gateway.inbound",
                             "lmqtt.gateway.delivery", "lmqtt.gateway.subscriptions", "lmqtt.gateway.clients",
                             "lmqtt.gateway.storage.facades", "lmqtt.gateway.storage.record_props", "lmqtt.gateway.net", "lmqtt.gateway.security",
                             "lmqtt.lightqueue.errors", "lmqtt.lightqueue.topics", "lmqtt.lightqueue.records"},
    "lmqtt.gateway.fleet": {"lmqtt.gateway.session", "lmqtt.gateway.subscriptions", "lmqtt.gateway.clients",
                            "lmqtt.gateway.broker", "lmqtt.gateway.storage", "lmqtt.gateway.storage.facades",
                            "lmqtt.gateway.storage.record_props", "lmqtt.gateway.mqtt"},
    # the composition root: `lmqtt serve`'s store is an in-process store node (store/node/embedded.py),
    # reached through lmqtt.store.node and the facades; like the rooms below it, app/ imports the
    # engine's and the light queues' vocabulary only, never the engine, the light queues or RocksDB
    "lmqtt.gateway.app": {"lmqtt.gateway.mqtt", "lmqtt.gateway.session", "lmqtt.gateway.inbound", "lmqtt.gateway.delivery",
                          "lmqtt.gateway.subscriptions", "lmqtt.gateway.clients", "lmqtt.gateway.broker",
                          "lmqtt.gateway.storage.record_props",
                          "lmqtt.gateway.storage", "lmqtt.gateway.storage.facades", "lmqtt.gateway.net",
                          "lmqtt.gateway.security", "lmqtt.gateway.fleet", "lmqtt.store.client",
                          "lmqtt.store.node", "lmqtt.store.node.protocol",
                          "lmqtt.store.protocol", "lmqtt.store.loopback", "lmqtt.store.allocator",
                          "lmqtt.store.gc_pauses", "lmqtt.lightqueue.topics", "lmqtt.lightqueue.records",
                          "lmqtt.notify", "lmqtt.gateway.app.config", "lmqtt.gateway.integrations"},
    # the gateway's settings (GatewayConfig): a leaf that the store node reads too (the shared file);
    # the engine's limits (min_segment_mb, check_tier) come through the node's configuration; the
    # [[bridge]] tables are read by the bridges' own parser (a leaf)
    "lmqtt.gateway.app.config": {"lmqtt.store.node.config", "lmqtt.gateway.integrations.bridge_config"},
    # events, webhook and bridges beside the broker: the codec (a bridge's MQTT client), the
    # connection (a bridge's local side), security (the live rules' feed)
    "lmqtt.gateway.integrations": {"lmqtt.gateway.mqtt", "lmqtt.gateway.net", "lmqtt.gateway.security",
                                   "lmqtt.gateway.integrations.bridge_config"},
    "lmqtt.gateway.integrations.bridge_config": set(),
    # the `lmqtt` command: resolves every command lazily by module name; the long-running ones
    # start on jemalloc when LMQTT_MALLOC asks (executed again with it preloaded, before anything else)
    "lmqtt.gateway": {"lmqtt.gateway.mqtt", "lmqtt.store.allocator"},
    "lmqtt.examples": {"lmqtt.store.client", "lmqtt.store.spark"},
    "lmqtt.loadtest": {"lmqtt.gateway.mqtt", "lmqtt.store", "lmqtt.store.client", "lmqtt.store.spark",
                       "lmqtt.store.tier.parquet", "lmqtt.lightqueue", "lmqtt.examples", "lmqtt.loadtest.chaos.checker"},
    "lmqtt.loadtest.chaos": {"lmqtt.loadtest", "lmqtt.store", "lmqtt.store.client", "lmqtt.gateway.mqtt",
                             "lmqtt.loadtest.chaos.checker"},
    # the loss checker (lost, duplicated, reordered, never sent): the chaos bench's and the store
    # group's (bench ha, tests/ha); nothing of ours
    "lmqtt.loadtest.chaos.checker": set(),
    # `lmqtt serve --workers` with a port per gateway (bench compare's lmqtt-fleet): a load tool that
    # launches the product through its composition root (the supervisor and `lmqtt serve`'s flags)
    "lmqtt.loadtest.fleet_launcher": {"lmqtt.gateway.app", "lmqtt.gateway.app.config"},
}

# The engines' vocabulary: modules of lmqtt.store and lmqtt.lightqueue that import nothing of ours
# (or only each other), so a gateway room can name an error, a value type, a topic rule or a wire
# codec without importing the engine (which would start RocksDB, the CommitLog, ...): why they are
# units of their own rather than re-homed, since the store node and the SDK share them too. A unit
# that may import an engine may import its vocabulary (added below, so the table stays short).
VOCABULARY = {
    "lmqtt.store": {"lmqtt.store.errors", "lmqtt.store.message", "lmqtt.store.protocol", "lmqtt.store.record",
                    "lmqtt.store.accel", "lmqtt.store.produce", "lmqtt.store.loopback", "lmqtt.store.allocator", "lmqtt.store.gc_pauses",
                    "lmqtt.store.tier.objects",
                    "lmqtt.store.tier.topics"},
    "lmqtt.lightqueue": {"lmqtt.lightqueue.errors", "lmqtt.lightqueue.topics", "lmqtt.lightqueue.records"},
    "lmqtt.store.client": {"lmqtt.store.client.props"},
}
WRITTEN = {u: set(a) for u, a in MAY_IMPORT.items()}     # as written: what docs/internals.md prints
for _unit, _allowed in MAY_IMPORT.items():
    for _engine, _words in VOCABULARY.items():
        if _unit == _engine or _engine in _allowed:
            _allowed |= _words - {_unit}

# (importer, imported): imports that break a rule today, and why they still stand. Only shrinks.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def _module_of(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([FOLDERS[parts[0]], *parts[1:]])


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for folder in FOLDERS:
        for p in (ROOT / folder).rglob("*.py"):
            out[_module_of(p)] = p
    return out


def unit_of(module: str) -> str | None:
    best = None
    for u in UNITS:
        if module == u or module.startswith(u + "."):
            if best is None or len(u) > len(best):
                best = u
    return best


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            for b in n.body:
                lines.update(range(b.lineno, (b.end_lineno or b.lineno) + 1))
    return lines


def imports_of(module: str, source: str, known: set[str]) -> list[tuple[str, int]]:
    """(imported lmqtt module, line) of every import in `source`, TYPE_CHECKING blocks left out."""
    tree = ast.parse(source)
    skip = _type_checking_lines(tree)
    out = []
    for n in ast.walk(tree):
        if getattr(n, "lineno", None) in skip:
            continue
        if isinstance(n, ast.Import):
            out += [(a.name, n.lineno) for a in n.names if a.name.startswith("lmqtt.")]
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                base = module.split(".")
                base = base[: len(base) - n.level + (1 if _is_package(module) else 0)]
                mod = ".".join(base + ([n.module] if n.module else []))
            else:
                mod = n.module or ""
            if not mod.startswith("lmqtt."):
                continue
            for a in n.names:
                full = f"{mod}.{a.name}"
                out.append((full if full in known else mod, n.lineno))
    return out


_PACKAGES: set[str] = set()


def _is_package(module: str) -> bool:
    return module in _PACKAGES


def violations(mods: dict[str, pathlib.Path]) -> list[tuple[str, str, int]]:
    _PACKAGES.clear()
    _PACKAGES.update(m for m, p in mods.items() if p.name == "__init__.py")
    known = set(mods)
    bad = []
    for m, p in sorted(mods.items()):
        src_unit = unit_of(m)
        for imp, line in imports_of(m, p.read_text(), known):
            dst_unit = unit_of(imp)
            if dst_unit is None or dst_unit == src_unit:
                continue
            if dst_unit not in MAY_IMPORT.get(src_unit, set()):
                bad.append((m, imp, line))
    return bad


def test_every_module_belongs_to_a_unit_with_rules():
    mods = modules()
    assert len(mods) > 100
    homeless = sorted(m for m in mods if unit_of(m) not in MAY_IMPORT)
    assert homeless == []


def test_imports_follow_the_rules():
    bad = [(m, imp, line) for m, imp, line in violations(modules()) if (m, imp) not in EXCEPTIONS]
    assert bad == [], "imports against docs/internals.md's rules (importer, imported, line):\n" + \
        "\n".join(f"  {m} -> {imp}  (line {line}): {unit_of(m)} may not import {unit_of(imp)}" for m, imp, line in bad)


def test_the_exceptions_are_still_needed():
    found = {(m, imp) for m, imp, _ in violations(modules())}
    stale = sorted(set(EXCEPTIONS) - found)
    assert stale == [], f"these exceptions no longer happen: remove them from EXCEPTIONS: {stale}"


def test_the_checker_sees_a_wrong_import(tmp_path):
    """A check that sees nothing passes on anything: this one sees an engine import in a gateway
    room, a relative import of a sibling, a lazy import in a function, and skips TYPE_CHECKING."""
    src = ("from typing import TYPE_CHECKING\nfrom lmqtt.store.commitlog import CommitLog\n"
           "from . import broker\nimport lmqtt.lightqueue.index\n"
           "def f():\n    from lmqtt.store.node import command\n"
           "if TYPE_CHECKING:\n    from lmqtt.gateway.app.config import GatewayConfig\n")
    known = {"lmqtt.gateway.broker.broker", "lmqtt.store.node.command", "lmqtt.store.commitlog"}
    got = imports_of("lmqtt.gateway.broker.x", src, known)
    assert got == [("lmqtt.store.commitlog", 2), ("lmqtt.gateway.broker.broker", 3),
                   ("lmqtt.lightqueue.index", 4), ("lmqtt.store.node.command", 6)]
    p = tmp_path / "x.py"
    p.write_text(src)
    assert unit_of("lmqtt.store.node.command") == "lmqtt.store.node"
    assert unit_of("lmqtt.store.commitlog") == "lmqtt.store"


def test_a_gateway_room_may_name_the_vocabulary_but_not_the_engines():
    """Below app/, a room importing the light queues' store or the engine's package breaks a rule;
    their errors, value types and topic rules do not (VOCABULARY)."""
    src = ("from lmqtt.lightqueue.light_queue_store import LightQueueStore\n"
           "from lmqtt.lightqueue.topics import topic_matches\n"
           "from lmqtt.store import MessageStore\nfrom lmqtt.store.errors import DiskFull\n")
    known = {"lmqtt.lightqueue.light_queue_store", "lmqtt.lightqueue.topics", "lmqtt.store.errors"}
    for room in ("lmqtt.gateway.delivery", "lmqtt.gateway.broker", "lmqtt.gateway.storage", "lmqtt.gateway.fleet"):
        bad = [imp for imp, _ in imports_of(room + ".x", src, known) if unit_of(imp) not in MAY_IMPORT[room]]
        assert bad[:1] == ["lmqtt.lightqueue.light_queue_store"] and "lmqtt.store" in bad, (room, bad)
    ok = [imp for imp, _ in imports_of("lmqtt.gateway.delivery.x", src, known)
          if unit_of(imp) in MAY_IMPORT["lmqtt.gateway.delivery"]]
    assert ok == ["lmqtt.lightqueue.topics", "lmqtt.store.errors"]


# third-party modules only the engine side may import: RocksDB (the light queues' index and
# metadata, the store's SDK metadata). The gateway reaches what they hold through the facades.
ENGINE_ONLY = ("rocksdict",)


def third_party_imports(source: str, names: tuple[str, ...]) -> list[tuple[str, int]]:
    """(module, line) of every import of one of `names` (or a module under it) in `source`, lazy
    imports in functions and TYPE_CHECKING blocks included."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import):
            out += [(a.name, n.lineno) for a in n.names if a.name.split(".")[0] in names]
        elif isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] in names:
            out.append((n.module or "", n.lineno))
    return out


def test_no_gateway_module_imports_rocksdb():
    """No module of the gateway (`lmqtt serve`'s composition root included) imports the
    store engine, the light queues (MAY_IMPORT above) or RocksDB (here)."""
    bad = [(m, imp, line) for m, p in sorted(modules().items()) if m.startswith("lmqtt.gateway")
           for imp, line in third_party_imports(p.read_text(), ENGINE_ONLY)]
    assert bad == [], "the gateway may not import RocksDB (the store node holds it; use the facades):\n" + \
        "\n".join(f"  {m} line {line}: import {imp}" for m, imp, line in bad)


def test_the_rocksdb_check_sees_an_import():
    src = ("import os\nimport rocksdict\nfrom rocksdict import Rdict\n"
           "def f():\n    import rocksdict.x as r\nfrom lmqtt.store import rocksdict_like\n")
    assert third_party_imports(src, ENGINE_ONLY) == [("rocksdict", 2), ("rocksdict", 3), ("rocksdict.x", 5)]


def test_one_is_loopback():
    """Every process (`lmqtt serve`, `lmqtt store`, `lmqtt gateway`, the console's login rule)
    asks one function whether a listen address is loopback: store/loopback.py, a vocabulary unit
    the gateway's rooms and the node may both import."""
    defined = sorted(m for m, p in modules().items() for n in ast.walk(ast.parse(p.read_text()))
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "is_loopback")
    assert defined == ["lmqtt.store.loopback"]


def _rules_table() -> str:
    rows = ["| unit | may import |", "| --- | --- |"]
    for u in UNITS:
        allowed = ", ".join(f"`{a}`" for a in sorted(WRITTEN[u])) or "nothing of ours"
        rows.append(f"| `{u}` | {allowed} |")
    return "\n".join(rows)


def test_the_docs_show_the_same_rules():
    doc = (ROOT / "docs" / "internals.md").read_text()
    assert _rules_table() in doc, "docs/internals.md must contain this table (print it with " \
        "`python3 -c 'from tests.architecture.test_layering import _rules_table as t; print(t())'`):\n" + _rules_table()


def private_imports(mods: dict[str, pathlib.Path]) -> list[tuple[str, str, int]]:
    """(importer, imported name, line): a `_name` imported from a module of another unit."""
    _PACKAGES.clear()
    _PACKAGES.update(m for m, p in mods.items() if p.name == "__init__.py")
    out = []
    for m, p in sorted(mods.items()):
        tree = ast.parse(p.read_text())
        for n in ast.walk(tree):
            if not isinstance(n, ast.ImportFrom) or n.level:
                continue
            mod = n.module or ""
            if not mod.startswith("lmqtt.") or unit_of(mod) == unit_of(m):
                continue
            for a in n.names:
                private = a.name.startswith("_") or any(part.startswith("_") and not part.startswith("__")
                                                        for part in mod.split("."))
                if private and f"{mod}.{a.name}" not in mods:      # a C module (_append) is a module, not a name
                    out.append((m, f"{mod}.{a.name}", n.lineno))
    return out


# (importer, imported private name): still there, and why. Only shrinks.
PRIVATE_EXCEPTIONS: dict[tuple[str, str], str] = {}


def test_the_private_exceptions_are_still_needed():
    found = {(m, name) for m, name, _ in private_imports(modules())}
    assert sorted(set(PRIVATE_EXCEPTIONS) - found) == []


def test_no_private_name_is_imported_across_units():
    bad = [(m, name, line) for m, name, line in private_imports(modules()) if (m, name) not in PRIVATE_EXCEPTIONS]
    assert bad == [], "private names imported from another package or room (make them public, or move the code):\n" + \
        "\n".join(f"  {m} line {line}: {name}" for m, name, line in bad)
