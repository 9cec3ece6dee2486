"""A network of hosts made of Linux network namespaces, and the faults cut into it.

    with NetBed() as bed:
        m1 = bed.add_host("m1")                     # a namespace, eth0 = 10.77.0.11/24 on the switch
        bed.run("m1", ["lmqtt", "store", "--host", m1.addr, ...], log_path)
        with bed.inside("ctl"):                     # this thread's sockets are on host ctl
            ...
        f = bed.cut("m1", ["m2", "m3"])             # both ways; direction="out" / "in": one way only
        f.heal()

Every host is its own network namespace with a loopback and one `eth0`, the end of a veth pair
whose other end is a port of a bridge in a namespace of its own (the switch): nothing is added to
the namespace the bed is run from, so it never touches an interface, a route or a rule of the
machine. Names start with `lmqbed-<pid>-<random>-`, so beds of parallel runs never collide (and
their subnets may be the same: each bed is its own network). `close()` (and leaving the `with`)
stops the processes the bed started, by PID, and deletes its namespaces, which deletes their
links and rules with them, also when the body raised.

Faults (each a `Fault` with an idempotent `heal()`):
* `cut(a, b, direction)`: iptables DROP of what `a` sends to `b` (`out`), what it receives from
  `b` (`in`) or both, always on arrival (a drop on the way out fails the sender's call with
  EPERM at once: no real partition tells the sender). A one-way cut of TCP still stalls a
  connection both ways (one side's acknowledgements are lost) but the other side's data still
  arrives: a member that cannot send its Raft heartbeats still hears the leader.
* `loss(a, percent)`: iptables' `statistic` match drops that share of the packets `a` sends and
  of those it receives, each at random.
* `delay(a, ms)`: every packet `a` sends waits `ms` before it leaves: an NFQUEUE rule hands them
  to `nfdelay` (loadtest/chaos/nfdelay.py), a process in `a`'s namespace that releases them in
  order. Why not `tc qdisc netem`: kernels built without `sch_netem` (this project's CI machine's)
  refuse it, and NFQUEUE is part of every netfilter build that has iptables.

`available()` says why a bed cannot be made here (not root, no `ip` or `iptables`, namespaces
refused), or None.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.77.0"          # /24: hosts get .2 .. .254
_CLONE_NEWNET = 0x40000000
_PREFIX_RE = re.compile(r"^lmqbed-(\d+)-([0-9a-f]{6})-")
_libc = None


class NetBedError(RuntimeError):
    """A command of the bed failed; the message names it and what it printed."""


def _sh(argv: list[str], timeout: float = 20.0, check: bool = True) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise NetBedError(f"{' '.join(argv)}: no answer within {timeout:g} s") from e
    if check and r.returncode != 0:
        raise NetBedError(f"{' '.join(argv)}: exit {r.returncode}: {(r.stderr or r.stdout).strip()[:400]}")
    return r


def available() -> str | None:
    """None when a bed can be made here, else why not (one line)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool, pkg in (("ip", "iproute2"), ("iptables", "iptables")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install -y {pkg})"
    name = f"lmqbed-{os.getpid()}-{secrets.token_hex(3)}-probe"
    try:
        r = _sh(["ip", "netns", "add", name], check=False)
        if r.returncode != 0:
            return f"`ip netns add` refused: {(r.stderr or r.stdout).strip()[:200]}"
        r = _sh(["ip", "netns", "exec", name, "iptables", "-w", "-S"], check=False)
        if r.returncode != 0:
            return f"iptables does not work in a network namespace: {(r.stderr or r.stdout).strip()[:200]}"
    except (OSError, NetBedError) as e:
        return f"cannot make a network namespace: {e}"
    finally:
        _sh(["ip", "netns", "del", name], check=False)
    return None


def sweep_stale(log=None) -> list[str]:
    """Delete the namespaces of beds whose process died without closing them (a SIGKILLed run);
    only those with no process left inside (an orphan that still runs is reported, not ended:
    it is not ours). Returns the names deleted."""
    done = []
    r = _sh(["ip", "netns", "list"], check=False)
    for line in (r.stdout or "").splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _PREFIX_RE.match(name)
        if not m or _pid_alive(int(m.group(1))):
            continue
        pids = _sh(["ip", "netns", "pids", name], check=False).stdout.split()
        if pids:
            if log:
                log(f"stale namespace {name} of a dead bed still has processes {pids}: left alone")
            continue
        _sh(["ip", "netns", "del", name], check=False)
        done.append(name)
    return done


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _setns(fd: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetBedError(f"setns: {os.strerror(err)}")


@dataclass
class Host:
    name: str
    ns: str            # the namespace's name (ip netns)
    addr: str

    def __str__(self) -> str:
        return f"{self.name}({self.addr})"


@dataclass
class Fault:
    """Rules (and helper processes) that make one fault; `heal()` removes exactly them."""
    bed: "NetBed"
    what: str
    rules: list = field(default_factory=list)        # (namespace, [iptables rule spec])
    procs: list = field(default_factory=list)        # helper Popen objects (nfdelay)
    healed: bool = False

    def heal(self) -> None:
        if self.healed:
            return
        self.healed = True
        errors = []
        for ns, spec in reversed(self.rules):
            r = _sh(["ip", "netns", "exec", ns, "iptables", "-w", "-D", *spec], check=False)
            if r.returncode != 0 and "does not exist" not in (r.stderr or "") and "No chain" not in (r.stderr or ""):
                errors.append(f"{ns}: iptables -D {' '.join(spec)}: {(r.stderr or '').strip()[:200]}")
        for p in self.procs:       # after the rules: nothing is queued to it any more
            self.bed._end(p, timeout=5.0)
        if self in self.bed.faults:
            self.bed.faults.remove(self)
        if errors:
            raise NetBedError("; ".join(errors))

    def __str__(self) -> str:
        return self.what


class NetBed:
    """Hosts on one switch, processes on them, faults between them (module docstring)."""

    def __init__(self, subnet: str = SUBNET, workdir: str | os.PathLike | None = None, log=None) -> None:
        why = available()
        if why:
            raise NetBedError(f"no network bed here: {why}")
        self.subnet = subnet
        self.prefix = f"lmqbed-{os.getpid()}-{secrets.token_hex(3)}"
        self.workdir = Path(workdir) if workdir else None
        self.log = log or (lambda m: None)
        self.hosts: dict[str, Host] = {}
        self.faults: list[Fault] = []
        self.procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._next = 2
        self._closed = False
        self.switch = f"{self.prefix}-switch"
        sweep_stale(self.log)
        _sh(["ip", "netns", "add", self.switch])
        try:
            _sh(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            _sh(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ hosts
    def __enter__(self) -> "NetBed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add_host(self, name: str, last_octet: int | None = None) -> Host:
        """A new host `name` (letters, digits, dashes; at most 12) on the switch."""
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,11}", name) or name in self.hosts:
            raise ValueError(f"host name {name!r}: a new name of 1-12 of [a-z0-9-], starting with a letter")
        with self._lock:
            octet = last_octet if last_octet is not None else self._next
            if any(h.addr == f"{self.subnet}.{octet}" for h in self.hosts.values()) or not 2 <= octet <= 254:
                raise ValueError(f"address {self.subnet}.{octet} taken or outside .2-.254")
            self._next = max(self._next, octet + 1)
        ns = f"{self.prefix}-{name}"
        host = Host(name, ns, f"{self.subnet}.{octet}")
        _sh(["ip", "netns", "add", ns])
        self.hosts[name] = host            # from here on close() deletes it
        port = f"p-{name}"
        for argv in (["ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                      "netns", ns],
                     ["ip", "-n", self.switch, "link", "set", port, "master", "br0"],
                     ["ip", "-n", self.switch, "link", "set", port, "up"],
                     ["ip", "-n", ns, "addr", "add", f"{host.addr}/24", "dev", "eth0"],
                     ["ip", "-n", ns, "link", "set", "eth0", "up"],
                     ["ip", "-n", ns, "link", "set", "lo", "up"]):
            _sh(argv)
        return host

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def addr(self, name: str) -> str:
        return self.hosts[name].addr

    # ------------------------------------------------------------------ processes
    def run(self, host: str, argv: list[str], log_path: str | os.PathLike, env: dict | None = None,
            cwd: str | os.PathLike | None = None) -> subprocess.Popen:
        """Start `argv` on `host` (`ip netns exec`, which execs it: the PID is the program's), its
        output appended to `log_path`. The bed stops it at close() if it still runs."""
        ns = self.hosts[host].ns
        e = dict(os.environ if env is None else env)
        e.setdefault("PYTHONUNBUFFERED", "1")
        with open(log_path, "ab") as log:
            p = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=log, stderr=subprocess.STDOUT, env=e,
                                 cwd=str(cwd) if cwd else None, start_new_session=True)
        self.procs.append(p)
        return p

    def popen(self, host: str, argv: list[str], **kw) -> subprocess.Popen:
        """Like `run` with Popen's own keywords (pipes); the bed stops it at close()."""
        p = subprocess.Popen(["ip", "netns", "exec", self.hosts[host].ns, *argv], start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def _end(self, p: subprocess.Popen, timeout: float = 20.0) -> int | None:
        """SIGCONT + SIGTERM, then SIGKILL after `timeout`: a process of ours, by its PID."""
        if p.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGTERM):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, sig)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
        with contextlib.suppress(ValueError):
            self.procs.remove(p)
        return p.returncode

    def stop(self, p: subprocess.Popen, timeout: float = 20.0) -> int | None:
        return self._end(p, timeout)

    @contextlib.contextmanager
    def inside(self, host: str):
        """Run this block's network calls on `host`: the calling thread enters its namespace
        (setns works per thread) and goes back after. Threads started inside stay on `host`."""
        orig = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        fd = os.open(f"/run/netns/{self.hosts[host].ns}", os.O_RDONLY)
        try:
            _setns(fd)
            try:
                yield self.hosts[host]
            finally:
                _setns(orig)
        finally:
            os.close(fd)
            os.close(orig)

    def enter(self, host: str) -> None:
        """Put the calling thread on `host` for good (a thread the bed's user owns and ends)."""
        fd = os.open(f"/run/netns/{self.hosts[host].ns}", os.O_RDONLY)
        try:
            _setns(fd)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ faults
    def _rule(self, fault: Fault, host: str, chain: str, match: list[str], target: list[str]) -> None:
        """Insert one rule (first in `chain`, in `host`'s namespace) and note it in `fault`."""
        ns = self.hosts[host].ns
        spec = [chain, *match, "-m", "comment", "--comment", self.prefix, "-j", *target]
        _sh(["ip", "netns", "exec", ns, "iptables", "-w", "-I", chain, "1", *spec[1:]])
        fault.rules.append((ns, spec))

    def _fault(self, what: str) -> Fault:
        f = Fault(self, what)
        self.faults.append(f)
        return f

    def cut(self, a: str | list[str], b: str | list[str], direction: str = "both") -> Fault:
        """Drop what hosts `a` send to (`out`), receive from (`in`) or exchange with (`both`) hosts
        `b`. Returns the Fault (heal() lifts it).

        Every rule drops on arrival (INPUT of the receiving host): a packet dropped on its way
        out would fail the sender's send with EPERM at once, which no real partition does."""
        if direction not in ("both", "out", "in"):
            raise ValueError("direction: both, out or in")
        aa = [a] if isinstance(a, str) else list(a)
        bb = [b] if isinstance(b, str) else list(b)
        arrow = {"both": "<->", "out": "->", "in": "<-"}[direction]
        f = self._fault(f"cut {','.join(aa)} {arrow} {','.join(bb)}")
        try:
            for x in aa:
                for y in bb:
                    if x == y:
                        continue
                    if direction in ("both", "out"):
                        self._rule(f, y, "INPUT", ["-s", self.hosts[x].addr], ["DROP"])
                    if direction in ("both", "in"):
                        self._rule(f, x, "INPUT", ["-s", self.hosts[y].addr], ["DROP"])
        except BaseException:
            f.heal()
            raise
        return f

    def isolate(self, a: str, direction: str = "both") -> Fault:
        """Cut `a` from every other host of the bed."""
        return self.cut(a, [h for h in self.hosts if h != a], direction)

    def loss(self, a: str, percent: float) -> Fault:
        """Drop `percent` % of the packets `a` sends and of those it receives (each at random, on
        arrival: in `a` for what it receives, in every other host for what `a` sends)."""
        if not 0 < percent <= 100:
            raise ValueError("loss: 0 < percent <= 100")
        p = f"{percent / 100:.4f}"
        f = self._fault(f"loss {percent:g}% on {a}")
        rnd = ["-m", "statistic", "--mode", "random", "--probability", p]
        try:
            self._rule(f, a, "INPUT", ["-i", "eth0", *rnd], ["DROP"])
            for y in self.hosts:
                if y != a:
                    self._rule(f, y, "INPUT", ["-s", self.hosts[a].addr, *rnd], ["DROP"])
        except BaseException:
            f.heal()
            raise
        return f

    def delay(self, a: str, ms: float, queue: int = 7, timeout: float = 10.0) -> Fault:
        """Every packet `a` sends leaves `ms` later (in order). One delay per host at a time."""
        f = self._fault(f"delay {ms:g} ms on {a}")
        try:
            p = self.popen(a, [sys.executable, "-m", "lmqtt.loadtest.chaos.nfdelay", "--queue", str(queue),
                               "--delay-ms", str(ms)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            f.procs.append(p)
            line = _readline(p, timeout)
            if not line.startswith("bound"):
                raise NetBedError(f"nfdelay on {a} did not start: {line!r}")
            self._rule(f, a, "OUTPUT", ["-o", "eth0"], ["NFQUEUE", "--queue-num", str(queue), "--queue-bypass"])
        except BaseException:
            f.heal()
            raise
        return f

    def heal_all(self) -> None:
        errors = []
        for f in list(self.faults):
            try:
                f.heal()
            except NetBedError as e:
                errors.append(str(e))
        if errors:
            raise NetBedError("; ".join(errors))

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        """Stop our processes (by PID), delete every namespace of the bed. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for f in list(self.faults):
            with contextlib.suppress(Exception):
                f.heal()
        for p in list(self.procs):
            with contextlib.suppress(Exception):
                self._end(p)
        for h in list(self.hosts.values()):
            _sh(["ip", "netns", "del", h.ns], check=False)
        _sh(["ip", "netns", "del", self.switch], check=False)
        self.hosts.clear()

    def namespaces(self) -> list[str]:
        """This bed's namespaces that exist now (for tests of the clean-up)."""
        r = _sh(["ip", "netns", "list"], check=False)
        return [ln.split()[0] for ln in (r.stdout or "").splitlines() if ln.startswith(self.prefix + "-")]


def _readline(p: subprocess.Popen, timeout: float) -> str:
    """The first line `p` prints, within `timeout` (a thread reads it: a pipe has no timeout)."""
    out: list[str] = []
    assert p.stdout is not None
    stdout = p.stdout
    t = threading.Thread(target=lambda: out.append(stdout.readline().decode(errors="replace").strip()), daemon=True)
    t.start()
    t.join(timeout)
    return out[0] if out else f"(nothing within {timeout:g} s)"
