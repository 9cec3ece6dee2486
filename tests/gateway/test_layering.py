"""The gateway's layering rules, checked on the source so a change that breaks one fails here and
not in a review months later:

* every MQTT wire byte is built in `gateway/mqtt/` (the codec, sans-IO like h11): no module of
  `gateway/*.py` holds a packet's first byte as a bytes literal or packs one from an integer;
* the Broker is a decision table that nothing reaches back into: its collaborators (delivery,
  publishing, sessions, subscriptions, connection, replay, fleet, ...) get narrow callables, so no
  gateway module imports `broker` except the composition root `server.py`, which constructs it;
* the store is reached only through the narrow storage interface (`store_api.py`): the embedded
  store's objects are built by the composition roots (`server.py`, `store_serve.py`, `serve.py`)
  and used behind that interface, never by the broker or its collaborators.
"""
from __future__ import annotations

import ast
import pathlib

GATEWAY = pathlib.Path(__file__).resolve().parents[2] / "gateway"

# first bytes of MQTT control packets (type << 4 | the flags the spec fixes; PUBLISH: any flags)
FIRST_BYTES = {0x10, 0x20, 0x40, 0x50, 0x62, 0x70, 0x82, 0x90, 0xA2, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0} | set(range(0x30, 0x40))


def _modules():
    return sorted(p for p in GATEWAY.glob("*.py"))


def _tree(path: pathlib.Path) -> ast.AST:
    return ast.parse(path.read_text(), filename=str(path))


def _int_const(node) -> int | None:
    return node.value if isinstance(node, ast.Constant) and type(node.value) is int else None


def _packet_bytes(tree: ast.AST) -> list[int]:
    """Line numbers where a packet's first byte is written down outside the codec."""
    hits = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, bytes) and n.value:
            text = all(32 <= b < 127 or b in (9, 10, 13) for b in n.value)
            if n.value[0] in FIRST_BYTES and not text:
                hits.append(n.lineno)
        elif isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("bytes", "bytearray") and n.args and isinstance(n.args[0], (ast.Tuple, ast.List)):
                elts = n.args[0].elts
                if elts and _int_const(elts[0]) in FIRST_BYTES:
                    hits.append(n.lineno)
            elif name in ("pack", "pack_into"):
                args = n.args
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "struct":
                    args = args[1:]                                  # struct.pack(fmt, ...)
                if name == "pack_into":
                    args = args[2:]                                  # (buffer, offset, ...)
                if args and _int_const(args[0]) in FIRST_BYTES:
                    hits.append(n.lineno)
    return hits


def _imports(tree: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            mod = ("." * n.level) + (n.module or "")
            out.add(mod)
            out.update(f"{mod}{a.name}" if mod.endswith(".") else f"{mod}.{a.name}" for a in n.names)
    return out


def test_the_checker_sees_packet_bytes_and_broker_imports():
    """The rules below would pass on anything if the checks saw nothing: they see these."""
    src = ("import struct\nfrom lmqtt.gateway.broker import Broker\nfrom . import broker\n"
           "A = b'\\x40\\x02'\nB = bytes((0xE0, 0))\nC = struct.pack('>BB', 0x30, 5)\nD = HDR.pack(0x82, 1)\n"
           "OK = b'0' + b'\\x00\\x04MQTT'\n")
    tree = ast.parse(src)
    assert _packet_bytes(tree) == [4, 5, 6, 7]
    assert _broker_imports(tree)


def _broker_imports(tree: ast.AST) -> set[str]:
    return {m for m in _imports(tree) if m in ("lmqtt.gateway.broker", ".broker")
            or m.startswith(("lmqtt.gateway.broker.", ".broker."))}


def test_no_wire_bytes_outside_the_codec():
    found = {p.name: lines for p in _modules() if (lines := _packet_bytes(_tree(p)))}
    assert found == {}, f"MQTT packet bytes built outside gateway/mqtt/ (move them into the codec): {found}"


def test_only_the_composition_root_imports_the_broker():
    importers = {p.name for p in _modules() if p.name != "broker.py" and _broker_imports(_tree(p))}
    assert importers == {"server.py"}, importers


def test_only_the_composition_roots_hold_the_store_objects():
    """The embedded store's objects (MessageStore, LightQueueStore, the store server) are built by
    the composition roots; every other module works through the storage interface (`store_api.py`,
    which `RemoteStore` also implements over the store protocol for `lmqtt gateway`). Value types,
    topic helpers and errors of the store (records, `Message`, `InvalidTopicName`) are shared
    vocabulary and may be imported anywhere."""
    roots = {"server.py", "store_serve.py", "serve.py"}
    engine = ("MessageStore", "StoreConfig", "LightQueueStore", "StoreServer", "lmqtt.store.server",
              "lmqtt.store.message_store", "lmqtt.store.commitlog", "lmqtt.store.consume_queue",
              "lmqtt.lightqueue.light_queue_store", "lmqtt.lightqueue.index", "lmqtt.lightqueue.service",
              "lmqtt.lightqueue.gateway_service")
    reaching = {}
    for p in _modules():
        if p.name in roots:
            continue
        mods = sorted(m for m in _imports(_tree(p)) if m.startswith(("lmqtt.store", "lmqtt.lightqueue"))
                      and any(m == e or m.startswith(e + ".") or m.endswith("." + e) for e in engine))
        if mods:
            reaching[p.name] = mods
    assert reaching == {}, reaching
