"""The gateway's layering rules, checked on the source so a change that breaks one fails here and
not in a review months later:

* every MQTT wire byte is built in `gateway/mqtt/` (the codec, sans-IO like h11): no module of
  `gateway/*.py` holds a packet's first byte as a bytes literal, packs one from an integer, sets
  or tests flags of a first byte it took out of a packet (`head[0] | 0x08`: the DUP bit), builds
  one from an expression with a packet flag (`bytes((first | 0x08,))`) or writes a packet id
  (`pid.to_bytes(2, "big")`, `pack(">H", pid)`); and none reaches past the codec's package into
  its byte-level modules (`wire`: variable byte integers, `properties`: property blocks,
  `encoder`, `decoder`), the tools for taking packets apart and putting them together;
* the Broker is a decision table that nothing reaches back into: its collaborators (delivery,
  publishing, sessions, subscriptions, connection, replay, fleet, ...) get narrow callables, so no
  gateway module imports `broker` except the composition root `app/gateway.py`, which constructs it;
* the store is reached only through the storage facades (`storage/facades.py`): the embedded
  store's objects are built by the composition roots (`app/gateway.py`, `app/serve_command.py`; the store node's is `store/node/command.py`)
  and used behind that interface, never by the broker or its collaborators.
"""
from __future__ import annotations

import ast
import pathlib

GATEWAY = pathlib.Path(__file__).resolve().parents[2] / "gateway"

# first bytes of MQTT control packets (type << 4 | the flags the spec fixes; PUBLISH: any flags)
FIRST_BYTES = {0x10, 0x20, 0x40, 0x50, 0x62, 0x70, 0x82, 0x90, 0xA2, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0} | set(range(0x30, 0x40))


def _modules():
    """Every module of the gateway outside the codec (gateway/mqtt/), by its path under gateway/."""
    return sorted(p for p in GATEWAY.rglob("*.py") if p.relative_to(GATEWAY).parts[0] != "mqtt")


def _name(p: pathlib.Path) -> str:
    return p.relative_to(GATEWAY).as_posix()


def _tree(path: pathlib.Path) -> ast.AST:
    return ast.parse(path.read_text(), filename=str(path))


def _int_const(node) -> int | None:
    return node.value if isinstance(node, ast.Constant) and type(node.value) is int else None


# bits of a first byte (the fixed header): RETAIN 0x01, QoS 0x02/0x04/0x06, DUP 0x08, and the
# flags and type nibbles
PACKET_FLAGS = {0x01, 0x02, 0x04, 0x06, 0x08, 0x0F, 0xF0}
_BIT_OPS = (ast.BitOr, ast.BitAnd, ast.BitXor)
# names a packet identifier goes by
PACKET_ID_NAMES = {"pid", "packet_id", "packet_identifier", "mid"}


def _first_of(node) -> bool:
    """`x[0]`: the first byte of a bytes object (a packet's fixed header, when it is one)."""
    return isinstance(node, ast.Subscript) and _int_const(node.slice) == 0


def _byte_const(node) -> bool:
    v = _int_const(node)
    return v is not None and 0 <= v <= 0xFF


def _flag_expr(node) -> bool:
    """An expression that combines something with a packet flag or first byte (`first | 0x08`)."""
    return isinstance(node, ast.BinOp) and isinstance(node.op, _BIT_OPS) and any(
        _int_const(side) in PACKET_FLAGS or _int_const(side) in FIRST_BYTES for side in (node.left, node.right))


def _packet_id(node) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name in PACKET_ID_NAMES


def _packet_bytes(tree: ast.AST) -> list[int]:
    """Line numbers where a packet's bytes are written down or patched outside the codec."""
    hits = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, bytes) and n.value:
            text = all(32 <= b < 127 or b in (9, 10, 13) for b in n.value)
            if n.value[0] in FIRST_BYTES and not text:
                hits.append(n.lineno)
        elif isinstance(n, ast.BinOp) and isinstance(n.op, _BIT_OPS):
            # head[0] | 0x08, data[0] & 0xF0: flags of a packet's first byte set or read
            if (_first_of(n.left) and _byte_const(n.right)) or (_first_of(n.right) and _byte_const(n.left)):
                hits.append(n.lineno)
        elif isinstance(n, ast.AugAssign) and isinstance(n.op, _BIT_OPS):
            if _first_of(n.target) and _byte_const(n.value):          # buf[0] |= 0x08
                hits.append(n.lineno)
        elif isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("bytes", "bytearray") and n.args and isinstance(n.args[0], (ast.Tuple, ast.List)):
                elts = n.args[0].elts
                if elts and (_int_const(elts[0]) in FIRST_BYTES or _flag_expr(elts[0])):
                    hits.append(n.lineno)
            elif name in ("pack", "pack_into"):
                args = n.args
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "struct":
                    args = args[1:]                                  # struct.pack(fmt, ...)
                elif isinstance(f, ast.Name) and args and isinstance(args[0], ast.Constant) \
                        and isinstance(args[0].value, str):
                    args = args[1:]                                  # from struct import pack; pack(fmt, ...)
                if name == "pack_into":
                    args = args[2:]                                  # (buffer, offset, ...)
                if args and (_int_const(args[0]) in FIRST_BYTES or _flag_expr(args[0])
                             or any(_packet_id(a) for a in args)):
                    hits.append(n.lineno)
            elif name == "to_bytes" and isinstance(f, ast.Attribute):
                # a packet id (two bytes, big-endian) written by hand: pid.to_bytes(2, "big")
                length = n.args[0] if n.args else next((k.value for k in n.keywords if k.arg == "length"), None)
                if _int_const(length) == 2 or _packet_id(f.value):
                    hits.append(n.lineno)
    return sorted(set(hits))


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


CODEC_INTERNALS = ("wire", "properties", "encoder", "decoder", "_run")


def _codec_internals(tree: ast.AST) -> set[str]:
    """Imports of the codec's byte-level modules (the package `lmqtt.gateway.mqtt` is the interface)."""
    out = set()
    for m in _imports(tree):
        for inner in CODEC_INTERNALS:
            for mod in (f"lmqtt.gateway.mqtt.{inner}", f".mqtt.{inner}"):
                if m == mod or m.startswith(mod + "."):
                    out.add(m)
    return out


def test_the_checker_sees_packet_bytes_and_broker_imports():
    """The rules below would pass on anything if the checks saw nothing: they see these."""
    src = ("import struct\nfrom lmqtt.gateway.broker.broker import Broker\nfrom . import broker\n"
           "A = b'\\x40\\x02'\nB = bytes((0xE0, 0))\nC = struct.pack('>BB', 0x30, 5)\nD = HDR.pack(0x82, 1)\n"
           "OK = b'0' + b'\\x00\\x04MQTT'\n"
           # a DUP flag set on a PUBLISH's first byte, and its packet id written in by hand
           "E = bytes((head[0] | 0x08,)) + head[1:]\nF = pid.to_bytes(2, 'big')\nG = bytes((first | 0x08,))\n"
           "H = t[0][0] & 0x06\nI = 0x01 | data[0]\nbuf[0] |= 0x08\nJ = n.to_bytes(length=2, byteorder='big')\n"
           "K = U16.pack(packet_id)\nL = struct.pack('>H', s.pid)\nM = bytes((0x30 | flags, rl))\n"
           "OK2 = len(x).to_bytes(8, 'big') + bytes((RETAINED,)) + (n | 1).to_bytes(4, 'big') + x[1] | 0x08\n")
    tree = ast.parse(src)
    assert _packet_bytes(tree) == [4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    assert _broker_imports(tree)
    internals = ("from lmqtt.gateway.mqtt.wire import encode_varint, read_varint\n"
                 "from lmqtt.gateway.mqtt.properties import encode_properties\nimport lmqtt.gateway.mqtt.encoder\n"
                 "from lmqtt.gateway.mqtt import encoder\n"
                 "from lmqtt.gateway.mqtt import PublishTemplate, packets as P\nfrom lmqtt.gateway.storage import record_props\n")
    assert _codec_internals(ast.parse(internals)) == {
        "lmqtt.gateway.mqtt.wire", "lmqtt.gateway.mqtt.wire.encode_varint", "lmqtt.gateway.mqtt.wire.read_varint",
        "lmqtt.gateway.mqtt.properties", "lmqtt.gateway.mqtt.properties.encode_properties",
        "lmqtt.gateway.mqtt.encoder"}


def _broker_imports(tree: ast.AST) -> set[str]:
    return {m for m in _imports(tree) if m in ("lmqtt.gateway.broker.broker", ".broker")
            or m.startswith(("lmqtt.gateway.broker.broker.", ".broker."))}


def test_no_wire_bytes_outside_the_codec():
    found = {_name(p): lines for p in _modules() if (lines := _packet_bytes(_tree(p)))}
    assert found == {}, f"MQTT packet bytes built outside gateway/mqtt/ (move them into the codec): {found}"


def test_the_codec_is_used_through_its_package():
    found = {_name(p): sorted(mods) for p in _modules() if (mods := _codec_internals(_tree(p)))}
    assert found == {}, f"byte-level codec modules imported outside gateway/mqtt/ (ask the codec instead): {found}"


def test_only_the_composition_root_imports_the_broker():
    importers = {_name(p) for p in _modules() if _name(p) != "broker/broker.py" and _broker_imports(_tree(p))}
    assert importers == {"app/gateway.py"}, importers


def test_only_the_composition_roots_hold_the_store_objects():
    """The embedded store's objects (MessageStore, LightQueueStore, the store server) are built by
    the composition roots; every other module works through the storage facades (`storage/facades.py`,
    which `RemoteStore` and its metadata facades also implement over the store protocol for `lmqtt gateway`). Value types,
    topic helpers and errors of the store (records, `Message`, `InvalidTopicName`) are shared
    vocabulary and may be imported anywhere."""
    roots = {"app/gateway.py", "app/serve_command.py"}
    engine = ("MessageStore", "StoreConfig", "LightQueueStore", "StoreServer", "lmqtt.store.server",
              "lmqtt.store.message_store", "lmqtt.store.commitlog", "lmqtt.store.consume_queue",
              "lmqtt.lightqueue.light_queue_store", "lmqtt.lightqueue.index", "lmqtt.store.node.sdk_service",
              "lmqtt.store.node.gateway_service", "lmqtt.lightqueue.take")
    reaching = {}
    for p in _modules():
        if _name(p) in roots:
            continue
        mods = sorted(m for m in _imports(_tree(p)) if m.startswith(("lmqtt.store", "lmqtt.lightqueue"))
                      and any(m == e or m.startswith(e + ".") or m.endswith("." + e) for e in engine))
        if mods:
            reaching[_name(p)] = mods
    assert reaching == {}, reaching
