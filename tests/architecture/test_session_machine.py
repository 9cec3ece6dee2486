"""The MQTT session machine (gateway/session/) alone owns a session's flow state: packet ids, the
in-flight window, inbound QoS 2, topic aliases, the client's limits. Its drivers - the connection,
the broker, delivery, the backlog/retained/history runs, persistence, parking, the fleet - call it
and read its answers; none of them reads or writes that state. Checked on the source (ast), so a
module that starts allocating packet ids or touching the window again fails here, whatever code
path would have run it.

* `next_pid` (where the allocator's search starts) is named nowhere in gateway/ but the machine:
  the `grep -rn next_pid gateway` of the issue that made the machine;
* no module outside gateway/session/ reads or writes one of the machine's private fields (its
  underscored slots and rare fields, a cursor's in-flight table), makes an `InFlight`, or holds or
  releases an offset of a session's cursor (a shared group holds and releases its own cursor's);
* the machine is sans-IO: it imports no asyncio, socket, selectors or uvloop, and nothing of the
  store or the light queues (tests/architecture/test_layering.py: it may import the codec only).
"""
from __future__ import annotations

import ast
import pathlib

from lmqtt.gateway.session import MqttSession

GATEWAY = pathlib.Path(__file__).resolve().parents[2] / "gateway"
MACHINE = GATEWAY / "session"

# the machine's private state: its underscored slots and rare fields (`_rare` is the rare-field
# holder every compact owner has, the connection too), a cursor's in-flight table, `next_pid`
PRIVATE = ({n for n in MqttSession.__slots__ if n.startswith("_") and n != "_rare"}
           | {f.name for f in MqttSession._RARE_FIELDS if f.name.startswith("_")}
           | {"_inflight", "next_pid"})
IO_MODULES = {"asyncio", "socket", "selectors", "uvloop", "ssl"}


def _outside() -> list[pathlib.Path]:
    return sorted(p for p in GATEWAY.rglob("*.py") if MACHINE not in p.parents)


def _cursor_names(fn: ast.AST) -> set[str]:
    """Names a function binds to something read through `.cursors` (a session's cursors)."""
    out = set()
    for n in ast.walk(fn):
        targets = []
        if isinstance(n, ast.Assign):
            targets, value = n.targets, n.value
        elif isinstance(n, (ast.For, ast.comprehension)):
            targets, value = [n.target], n.iter
        else:
            continue
        if any(isinstance(a, ast.Attribute) and a.attr == "cursors" for a in ast.walk(value)):
            for t in targets:
                out |= {x.id for x in ast.walk(t) if isinstance(x, ast.Name)}
    return out


def violations(source: str) -> list[tuple[int, str]]:
    """(line, what) of every touch of the machine's state in `source` (a module outside it)."""
    tree = ast.parse(source)
    bad = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr in PRIVATE:
            bad.append((n.lineno, f"reads or writes the session machine's `{n.attr}`"))
        elif isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Attribute) and f.attr == "of" and isinstance(f.value, ast.Name) \
                    and f.value.id == "InFlight":
                bad.append((n.lineno, "makes an InFlight"))
            elif any(isinstance(a, ast.Name) and a.id == "InFlight" for a in n.args):
                bad.append((n.lineno, "makes an InFlight"))
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        names = _cursor_names(fn)
        for n in ast.walk(fn):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("hold", "release"):
                recv = n.func.value
                if (isinstance(recv, ast.Name) and recv.id in names) or any(
                        isinstance(a, ast.Attribute) and a.attr == "cursors" for a in ast.walk(recv)):
                    bad.append((n.lineno, f"{n.func.attr}s an offset of a session's cursor"))
    return sorted(set(bad))


def test_next_pid_is_named_only_in_the_machine():
    found = []
    for p in sorted(GATEWAY.rglob("*")):
        if p.is_file() and p.suffix in (".py", ".c", ".h", ".pyx", ".md") and MACHINE not in p.parents:
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
                if "next_pid" in line:
                    found.append(f"{p.relative_to(GATEWAY.parent)}:{i}: {line.strip()}")
    assert found == [], "only gateway/session/ allocates packet ids:\n" + "\n".join(found)
    assert any("next_pid" in p.read_text() for p in MACHINE.glob("*.py"))


def test_no_driver_touches_the_machines_state():
    bad = [f"{p.relative_to(GATEWAY.parent)}:{line}: {what}"
           for p in _outside() for line, what in violations(p.read_text())]
    assert bad == [], ("the session machine's state is its own (call it; docs/session.md):\n" + "\n".join(bad))


def test_the_machine_imports_no_io_and_nothing_of_the_store():
    bad = []
    for p in sorted(MACHINE.glob("*.py")):
        for n in ast.walk(ast.parse(p.read_text())):
            names = []
            if isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and not n.level:
                names = [n.module or ""]
            for m in names:
                top = m.split(".")[0]
                # lmqtt.store.accel, the C loader (it imports nothing of ours and does no I/O), loads
                # the machine's compiled offer (session/_offer.c)
                if top in IO_MODULES or (m.startswith(("lmqtt.store", "lmqtt.lightqueue", "lmqtt.notify"))
                                         and m != "lmqtt.store.accel"):
                    bad.append(f"{p.name}:{n.lineno}: import {m}")
    assert bad == []


def test_the_checks_see_a_driver_that_touches_the_state():
    """A check that sees nothing passes on anything."""
    src = ("def ack(s, pid, it):\n"
           "    s._window.pop(pid)\n"
           "    s.next_pid = pid + 1\n"
           "    s._window[pid] = InFlight.of(pid, 1, False, None, None, None, None, it)\n"
           "    cur = s.cursors['q']\n"
           "    cur.release(5)\n"
           "    s.cursors['q'].hold(6, pid)\n"
           "    g.cursor.hold(7, s)\n"          # a shared group's own cursor: allowed
           "    conn.release()\n"
           "    x = tuple.__new__(InFlight, (1,))\n"
           "    return s._in2, s._aliases_in, cur._inflight\n")
    got = violations(src)
    lines = [line for line, _ in got]
    assert lines == [2, 3, 4, 4, 6, 7, 10, 11, 11, 11], got
    assert "_in2" in PRIVATE and "_window" in PRIVATE and "_in_keys" in PRIVATE
