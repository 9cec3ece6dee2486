"""Module by module, what test_layering.py checks package by package: no import cycle, no import
hidden in a function but for an optional dependency, no reaching into another module's privates.

* **No cycle between modules.** Imports inside functions count (a cycle an import in a function
  hides is still a cycle: the two modules can only be understood, tested and moved together);
  imports under `if TYPE_CHECKING:` do not (annotations, not dependencies).
* **An import inside a function only for an optional dependency**: a third-party package in
  `OPTIONAL` (an extra of pyproject.toml, or a library only a feature needs, which the start of
  `lmqtt serve` does not pay for), a module of ours that imports one at its top, or a module of
  ours in `FEATURES` (what only one process mode or a configured feature loads: the fleet
  gateway's store link, the embedded store, the console); with its reason beside it (a comment on
  the line, or the line above). Everything else is imported at the top, where a reader sees what
  a module depends on.
* **No module reads another class's `_private` attributes** (or imports another module's private
  name): the owner gets a method, or the code moves to the owner. A name is private to the module
  that defines it (`self._x = ...`, `def _x`, a class attribute, `__slots__`).

`PENDING` lists what is left in the session machine's two rooms (gateway/session, gateway/net)
and in the store engine files of the file/memory budget work, each with its reason: both works
were under way when these checks were written, and their follow-ups empty the list. Everything
else is checked for real, and the list only shrinks (a stale entry fails too).
"""
from __future__ import annotations

import ast
import sys
from collections import defaultdict

from tests.architecture.test_layering import _type_checking_lines, modules

# Third-party packages an import inside a function may load, and why each is loaded late.
OPTIONAL = {
    "pyspark": "the `spark` extra: only the Spark data source and the Spark jobs",
    "pyarrow": "the `spark` extra: the Spark reader's Arrow batches and the tier's Parquet copy",
    "pysyncobj": "the `ha` extra: only a replicated store group (lmqtt store --group)",
    "fsspec": "the `tier` extra: only a store with --tier",
    "s3fs": "the `tier` extra: s3:// tiers",
    "boto3": "the test/bench extras (moto's S3 server in bench tier)",
    "paho": "the `spark` and `bench` extras: MQTT clients of the examples and benches",
    "amqtt": "the `bench` extra: the amqtt broker bench compare starts",
    "psutil": "the `bench` extra: CPU and RSS probes of the benches",
    "matplotlib": "the `bench` extra: the plots of a bench compare report",
    "hiredis": "the `bench` extra: Redis Streams rows of bench sdk",
    "trustme": "the test extra: throwaway TLS certificates of bench compare --tls",
    "redis": "only a fleet with --redis (notify over Redis pub/sub): lmqtt serve never loads it",
    "jwt": "only JWT authentication, when configured",
    "starlette": "only the web console, when its port is open",
    "uvicorn": "only the web console, when its port is open",
    "wsproto": "only a WebSocket listener, when configured",
    "uvloop": "the event loop of the running processes; a library import does not choose a loop",
    "setproctitle": "only the processes `lmqtt serve --workers` starts name themselves",
    "prometheus_client": "only a process with its metrics port open",
    "aiohttp": "only HTTP authentication and the webhook, when configured",
    "rocksdict": "only a process that holds a store (lmqtt serve, lmqtt store): a fleet gateway never loads "
                 "RocksDB (tests/architecture/test_runtime_imports.py)",
}
# Standard-library modules a start does not pay for unless it needs them: imported late too (with
# the reason beside), though a module of ours importing one at its top is no gate for that.
LATE_STDLIB = {
    "ssl": "only TLS listeners and clients, when configured (a plain start does not load it)",
    "difflib": "only a mistyped command name (~6 ms of every start otherwise)",
    "importlib.metadata": "only `lmqtt --version` and the banners (~8 ms of every start otherwise)",
}


# Modules of ours a process loads only when a feature or its mode asks for them, and why (a module
# of ours that imports an OPTIONAL package at its top may be imported late as well).
FEATURES = {
    "lmqtt.store.node.embedded": "`lmqtt serve`'s in-process store (the engine, RocksDB): a fleet gateway "
                                 "never loads it (tests/architecture/test_runtime_imports.py)",
    "lmqtt.gateway.storage.remote_store": "a fleet gateway's store link: `lmqtt serve` does not load it",
    "lmqtt.gateway.storage.remote_groups": "a fleet gateway's shared groups: `lmqtt serve` does not load them",
    "lmqtt.gateway.fleet": "what a fleet gateway adds: `lmqtt serve` does not load it",
    "lmqtt.gateway.storage.store_link": "a fleet gateway's link to its store: `lmqtt serve` does not load it",
    "lmqtt.gateway.app.console_web": "the web console (Starlette, uvicorn), when its port is open",
    "lmqtt.gateway.app.workers": "`lmqtt serve --workers` only",
    "lmqtt.gateway.security": "authentication and the ACL, when configured (a plain start loads neither)",
    "lmqtt.gateway.net.tls": "TLS listeners, when configured",
    "lmqtt.gateway.integrations": "events, the webhook and bridges, when configured",
    "lmqtt.store.node.security_service": "users and ACL rules managed live, when --live-security is on",
    "lmqtt.gateway.net.websocket": "a WebSocket listener, when configured",
    "lmqtt.gateway.storage.grouped_queues": "a gateway over several store groups: over one it is not loaded",
    "lmqtt.gateway.storage.grouped_metadata": "a gateway over several store groups: over one it is not loaded",
    "lmqtt.gateway.storage.topic_owners": "a gateway over several store groups: over one it is not loaded",
    "lmqtt.store.client.groups": "several store groups (the SDK's layer above its connections): a gateway "
                                 "over one group does not load it",
}


def optional(name: str, table: dict[str, str] | None = None) -> bool:
    """`name` (a module) is an OPTIONAL package (or a LATE_STDLIB module), or a module of one."""
    keys = table if table is not None else {**OPTIONAL, **LATE_STDLIB}
    return any(name == k or name.startswith(k + ".") for k in keys)


def feature(name: str) -> bool:
    """`name` (a module of ours) belongs to a FEATURE."""
    return any(name == k or name.startswith(k + ".") for k in FEATURES)

# (module, what it reaches: "import <module>" / "attr <_name>" / "cycle <m1> <m2> ..."): the one list
# of what still breaks the rules, each with why it stands. It holds only two groups of files, both
# being rewritten by other work right now, and shrinks to nothing as that work lands (a stale
# entry fails: test_pending_is_only_what_others_rewrite_and_still_needed).
#
# 1. The two rooms of the session machine (gateway/session/, gateway/net/: docs/session.md), which
#    landed while this list was written; its follow-up gives these owners their public members
#    (the Cursor's in-flight table, the RareField slot of a session or connection, the connection
#    state the keep-alive wheel and parking read) and empties this part.
ROOMS_BEING_REWRITTEN = ("lmqtt.gateway.session", "lmqtt.gateway.net")
_SESSION_MACHINE = "gateway/session|net: the session machine's follow-up gives the owner a public member"
# 2. The store engine files of the file/memory budget work (under way, then landed, while these
#    checks were written; their fix is a public member of the engine class they reach into,
#    written in that class's file).
ENGINE_BEING_REWRITTEN = ("lmqtt.store.consume_queue", "lmqtt.store.mapped_file", "lmqtt.store.mapped_file_queue",
                          "lmqtt.store.commitlog", "lmqtt.store.message_store", "lmqtt.store.dispatch",
                          "lmqtt.store.config", "lmqtt.store.node.command")
# ... and the modules whose fix is such a member of one of them
ENGINE_READERS = ("lmqtt.store.encoding", "lmqtt.store.fastpath", "lmqtt.store.tier.service")
_BUDGET = "the store budget work rewrites the engine class this reaches into: a public member there"
PENDING: dict[tuple[str, str], str] = {
    # the session machine's rooms
    ("lmqtt.gateway.net.keepalive", "import lmqtt.gateway.net.parking"): _SESSION_MACHINE,
    ("lmqtt.gateway.net.parking", "import ctypes"): _SESSION_MACHINE,
    ("lmqtt.gateway.session.rare", "attr _rare"): _SESSION_MACHINE + " (the rare-field slot of a session or connection)",
    ("lmqtt.gateway.session.rare", "attr _RARE_CLASS"): _SESSION_MACHINE,
    ("lmqtt.gateway.session.machine", "attr _RARE_FIELDS"): _SESSION_MACHINE,
    ("lmqtt.gateway.net.connection", "attr _RARE_FIELDS"): _SESSION_MACHINE,
    ("lmqtt.gateway.session.outbound", "attr _inflight"): _SESSION_MACHINE + " (the Cursor's in-flight table, made when first used)",
    ("lmqtt.gateway.session.parked", "attr _inflight"): _SESSION_MACHINE,
    ("lmqtt.gateway.net.connection", "attr _handle"): _SESSION_MACHINE + " (the keep-alive wheel's timer handle)",
    ("lmqtt.gateway.net.connection_parking", "attr _connected"): _SESSION_MACHINE,
    ("lmqtt.gateway.net.connection_parking", "attr _update_table"): _SESSION_MACHINE,
    ("lmqtt.gateway.net.keepalive", "attr _keepalive"): _SESSION_MACHINE + " (the wheel reads the connection's state)",
    ("lmqtt.gateway.net.keepalive", "attr _ka_slot"): _SESSION_MACHINE,
    ("lmqtt.gateway.net.keepalive", "attr _auth_login"): _SESSION_MACHINE,
    ("lmqtt.gateway.net.keepalive", "attr _park"): _SESSION_MACHINE,
    # engine files of the budget work
    ("lmqtt.store.message_store", "import lmqtt.store.tier.service"): _BUDGET + " (a reason beside it)",
    ("lmqtt.store.message_store", "import lmqtt.store.delayed"): _BUDGET + " (at the top)",
    ("lmqtt.store.consume_queue", "import lmqtt.store.consume_queue_import"): _BUDGET + " (at the top)",
    ("lmqtt.store.message_store", "attr _result"): _BUDGET + " (concurrent.futures.Future's result, read without its lock)",
    ("lmqtt.store.mapped_file_queue", "import lmqtt.store.mapped_file._fsync_dir"): _BUDGET + " (fsync_dir, public)",
    ("lmqtt.store.encoding", "attr _topic_cache"): _BUDGET + " (CommitLog's encoder caches)",
    ("lmqtt.store.encoding", "attr _names_cache"): _BUDGET,
    ("lmqtt.store.encoding", "attr _tail_struct"): _BUDGET,
    ("lmqtt.store.encoding", "attr _topic_info"): _BUDGET,
    ("lmqtt.store.encoding", "attr _names"): _BUDGET,
    ("lmqtt.store.encoding", "attr _dq_info"): _BUDGET,
    ("lmqtt.store.fastpath", "attr _entries"): _BUDGET + " (consume_queue.py binds its own C loop)",
    ("lmqtt.store.tier.service", "attr _dispatchers"): _BUDGET + " (MessageStore's dispatchers, public)",
    ("lmqtt.store.node.command", "attr _actions"): _BUDGET + " (the --help formatter gateway/app/config.py uses)",
    ("lmqtt.store.node.command", "attr _redis"): _BUDGET + " (RedisEventPublisher.ping)",
    **{("lmqtt.store.node.command", f"import {m}"): _BUDGET + " (imports at the top, the optional ones with reasons)"
       for m in ("lmqtt.gateway.app.config", "lmqtt.store.loopback", "lmqtt.store.node.ha_member", "lmqtt.lightqueue",
                 "lmqtt.store.node.gateway_service", "lmqtt.store.client.props", "lmqtt.store.node.sdk_service",
                 "lmqtt.store", "lmqtt.store.server", "lmqtt.store.tier.config", "lmqtt.store.node.tier_parquet",
                 "lmqtt.notify.redis_bus", "lmqtt.notify.reachable", "threading",
                 "http.server")},
}

# Private names of the standard library's own public API (named tuples: `_replace`, `_fields`, ...).
STDLIB_PUBLIC = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


class Imp:
    __slots__ = ("target", "line", "lazy", "reason")

    def __init__(self, target: str, line: int, lazy: bool, reason: bool) -> None:
        self.target, self.line, self.lazy, self.reason = target, line, lazy, reason


def _resolve(module: str, node: ast.AST, known: set[str], packages: set[str]) -> list[str]:
    """The modules `node` imports: a name that is a module is that module, else the module it is in."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if module in packages else 0)]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    return [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]


def imports(module: str, source: str, known: set[str], packages: set[str]) -> list[Imp]:
    """Every import of `source` (ours resolved to the nearest known module, others by their name),
    whether it is inside a function, and whether a comment beside it gives a reason."""
    tree = ast.parse(source)
    lines = source.splitlines()
    skip = _type_checking_lines(tree)
    out: list[Imp] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, (ast.Import, ast.ImportFrom)) and ch.lineno not in skip:
                text = lines[ch.lineno - 1]
                above = lines[ch.lineno - 2].strip() if ch.lineno > 1 else ""
                reason = "#" in text.split("import", 1)[1] or above.startswith("#")
                for t in _resolve(module, ch, known, packages):
                    if t.startswith("lmqtt."):
                        while t not in known and "." in t:
                            t = t.rsplit(".", 1)[0]
                    out.append(Imp(t, ch.lineno, in_function, reason))
            visit(ch, in_function or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    visit(tree, False)
    return out


def _tree():
    mods = modules()
    packages = {m for m, p in mods.items() if p.name == "__init__.py"}
    return mods, packages


def import_graph() -> tuple[dict[str, set[str]], dict[str, list[Imp]]]:
    mods, packages = _tree()
    known = set(mods)
    graph: dict[str, set[str]] = defaultdict(set)
    every: dict[str, list[Imp]] = {}
    for m, p in mods.items():
        every[m] = imports(m, p.read_text(), known, packages)
        graph[m] |= {i.target for i in every[m] if i.target in known and i.target != m}
    return graph, every


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def _cycle_path(graph: dict[str, set[str]], comp: list[str]) -> str:
    """One cycle through the component's first module, for the message."""
    start, members = comp[0], set(comp)
    path, seen = [start], {start}
    while True:
        nxt = sorted(graph[path[-1]] & members)
        back = [n for n in nxt if n == start]
        if back and len(path) > 1:
            return " -> ".join(path + [start])
        fresh = [n for n in nxt if n not in seen]
        if not fresh:
            return " <-> ".join(comp)
        path.append(fresh[0])
        seen.add(fresh[0])


def _pending(module: str, what: str) -> bool:
    return (module, what) in PENDING


def cycle_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for comp in cycles(graph):
        if _pending(comp[0], "cycle " + " ".join(comp)):
            continue
        bad.append(_cycle_path(graph, comp))
    return bad


def test_no_import_cycle_between_modules():
    graph, _ = import_graph()
    bad = cycle_violations(graph)
    assert bad == [], "import cycles (imports in functions count; move the shared part down, or " \
        "merge what cannot be understood apart):\n" + "\n".join(f"  {c}" for c in bad)


def _gates_an_optional_dependency(graph_every: dict[str, list[Imp]]) -> set[str]:
    """Our modules that import an OPTIONAL package at their top, or another such module of ours."""
    direct = {m for m, imps in graph_every.items()
              if any(not i.lazy and optional(i.target, OPTIONAL) for i in imps)}
    gates = set(direct)
    changed = True
    while changed:
        changed = False
        for m, imps in graph_every.items():
            if m not in gates and any(not i.lazy and i.target in gates for i in imps):
                gates.add(m)
                changed = True
    return gates


def lazy_violations(every: dict[str, list[Imp]]) -> list[str]:
    gates = _gates_an_optional_dependency(every)
    bad = []
    for m, imps in sorted(every.items()):
        for i in imps:
            if not i.lazy:
                continue
            ours = i.target.startswith("lmqtt.")
            allowed = (i.target in gates or feature(i.target)) if ours else optional(i.target)
            if allowed and i.reason:
                continue
            if _pending(m, f"import {i.target}"):
                continue
            why = ("no reason beside it" if allowed else
                   "not an optional dependency: import it at the top" if not ours else
                   "a module of ours that loads no optional dependency: import it at the top")
            bad.append(f"{m} line {i.line}: import {i.target} in a function ({why})")
    return bad


def test_imports_in_functions_are_for_optional_dependencies_with_their_reason():
    _, every = import_graph()
    bad = lazy_violations(every)
    assert bad == [], "imports in functions:\n" + "\n".join(f"  {b}" for b in bad)


def defined_privates(tree: ast.AST) -> set[str]:
    """The `_names` a module defines: functions, classes, attributes it assigns on `self`/`cls` or
    on a class of its own, module and class attributes, `__slots__` entries."""
    names: set[str] = set()
    classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
              and (n.value.id in ("self", "cls") or n.value.id in classes)):
            names.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in n.targets):
            names |= {c.value for c in ast.walk(n.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return {x for x in names if x.startswith("_") and not x.startswith("__")}


def private_reads(module: str, source: str) -> list[tuple[int, str]]:
    """(line, expression) of every `x._name` whose `x` is not `self`/`cls`/`super()` and whose
    `_name` this module does not define: another module's private attribute."""
    tree = ast.parse(source)
    own = defined_privates(tree)
    out = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")):
            continue
        v = n.value
        if isinstance(v, ast.Name) and v.id in ("self", "cls"):
            continue
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
            continue
        if n.attr in own or n.attr in STDLIB_PUBLIC:
            continue
        out.append((n.lineno, ast.unparse(n)))
    return out


def private_imports(module: str, source: str, known: set[str], packages: set[str]) -> list[tuple[int, str]]:
    """(line, name): `from lmqtt.x import _name` of another module's private name (a compiled
    module such as `_append` is a module, not a name)."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.ImportFrom):
            for a in n.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    base = _base(module, n, packages) if n.level else n.module or ""
                    if f"{base}.{a.name}" not in known:
                        out.append((n.lineno, f"{base}.{a.name}"))
    return out


def _base(module: str, node: ast.ImportFrom, packages: set[str]) -> str:
    parts = module.split(".")
    parts = parts[: len(parts) - node.level + (1 if module in packages else 0)]
    return ".".join(parts + ([node.module] if node.module else []))


def private_violations() -> list[str]:
    mods, _packages = _tree()
    known = set(mods)
    bad = []
    for m, p in sorted(mods.items()):
        src = p.read_text()
        for line, expr in private_reads(m, src):
            name = expr.rsplit(".", 1)[1]
            if not _pending(m, f"attr {name}"):
                bad.append(f"{m} line {line}: {expr}")
        for line, name in private_imports(m, src, known, _packages):
            if not _pending(m, f"import {name}"):
                bad.append(f"{m} line {line}: imports the private {name}")
    return bad


def test_no_module_reads_another_modules_private_names():
    bad = private_violations()
    assert bad == [], "private attributes or names of another module (give the owner a method, or " \
        "move the code to it):\n" + "\n".join(f"  {b}" for b in bad)


def test_pending_is_only_what_others_rewrite_and_still_needed():
    """The pending list names only the session machine's rooms and the budget work's engine files
    (and the readers of those), and only what still happens."""
    assert all(m.startswith(ROOMS_BEING_REWRITTEN) or m in ENGINE_BEING_REWRITTEN + ENGINE_READERS
               for m, _ in PENDING), sorted(PENDING)
    graph, every = import_graph()
    found = set()
    for comp in cycles(graph):
        found.add((comp[0], "cycle " + " ".join(comp)))
    gates = _gates_an_optional_dependency(every)
    for m, imps in every.items():
        for i in imps:
            if i.lazy and not (((i.target in gates or feature(i.target)) if i.target.startswith("lmqtt.")
                                else optional(i.target)) and i.reason):
                found.add((m, f"import {i.target}"))
    mods, packages = _tree()
    for m, p in mods.items():
        src = p.read_text()
        found |= {(m, "attr " + e.rsplit(".", 1)[1]) for _, e in private_reads(m, src)}
        found |= {(m, "import " + n) for _, n in private_imports(m, src, set(mods), packages)}
    assert sorted(set(PENDING) - found) == [], "no longer happens: remove from PENDING"


# -- the checks see what they should ---------------------------------------------------------------

def test_the_cycle_check_sees_a_cycle_hidden_in_a_function():
    known = {"lmqtt.a", "lmqtt.b", "lmqtt.c"}
    srcs = {"lmqtt.a": "from lmqtt import b\n",
            "lmqtt.b": "def f():\n    from lmqtt.c import x\n",
            "lmqtt.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lmqtt.b import y\n"
                       "def g():\n    import lmqtt.a\n"}
    graph = {m: {i.target for i in imports(m, s, known, set()) if i.target in known} for m, s in srcs.items()}
    assert cycles(graph) == [["lmqtt.a", "lmqtt.b", "lmqtt.c"]]
    assert _cycle_path(graph, ["lmqtt.a", "lmqtt.b", "lmqtt.c"]) == "lmqtt.a -> lmqtt.b -> lmqtt.c -> lmqtt.a"
    srcs["lmqtt.c"] = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import lmqtt.a\n"
    graph = {m: {i.target for i in imports(m, s, known, set()) if i.target in known} for m, s in srcs.items()}
    assert cycles(graph) == []


def test_the_lazy_import_check_sees_a_plain_one_and_one_without_reason():
    known = {"lmqtt.x", "lmqtt.spark", "lmqtt.y"}
    every = {
        "lmqtt.spark": imports("lmqtt.spark", "import pyspark\n", known, set()),
        "lmqtt.y": imports("lmqtt.y", "import json\n", known, set()),
        "lmqtt.x": imports("lmqtt.x", "def f():\n    import lmqtt.y\n"
                                      "def g():\n    import pyarrow  # the spark extra\n"
                                      "def h():\n    import pyarrow\n"
                                      "def i():\n    # only a Spark job\n    from lmqtt import spark\n"
                                      "def j():\n    import json  # cheap\n", known, set()),
    }
    assert lazy_violations(every) == [
        "lmqtt.x line 2: import lmqtt.y in a function (a module of ours that loads no optional "
        "dependency: import it at the top)",
        "lmqtt.x line 6: import pyarrow in a function (no reason beside it)",
        "lmqtt.x line 11: import json in a function (not an optional dependency: import it at the top)"]


def test_the_private_check_sees_a_read_of_another_modules_private():
    src = ("class A:\n    def __init__(self):\n        self._mine = 1\n"
           "    def f(self, other, index):\n        return other._mine, index._db, self._mine, p._replace(x=1)\n")
    assert private_reads("lmqtt.x", src) == [(5, "index._db")]


def test_the_private_import_check_sees_a_private_name():
    src = "from lmqtt.store.node.gateway_service import _HOLD\nfrom lmqtt.store import _append\n"
    assert private_imports("lmqtt.x", src, {"lmqtt.store._append"}, set()) == [
        (1, "lmqtt.store.node.gateway_service._HOLD")]


if __name__ == "__main__":  # print the violations: python3 -m tests.architecture.test_modules
    g, e = import_graph()
    print("\n".join(cycle_violations(g) + lazy_violations(e) + private_violations()))
    sys.exit(0)

