"""A replicated store group, a fleet of gateways, Redis and clients, each on its own host of a
network bed (loadtest/chaos/netbed.py), and the partition faults cut between them.

Hosts (subnet 10.77.0.0/24 of the bed's own switch; every process listens on its host's address):

    ctl     .2         the observer: the runner's status calls and read-backs (never cut)
    redis   .5         redis-server (notify events of the store and the gateways)
    g1m1..3 .11-.13    the members of store group g1 (ports 10911, +1 Raft, +2 replication);
                       group gN's members at .(10N+1)...
    gw1 gw2 .61 .62    `lmqtt gateway --store <every member> --redis ...` (MQTT on 1883)
    c1      .81        MQTT clients (paho) of the gateways
    c2      .82        SDK clients (producer, consumer group, POP) of the group

`PartitionedFleet.groups` is a list (one group today) and a member's host is named after its group,
so fleets of several groups can be laid out the same way.

Faults (`FAULTS`: name -> how it is cut; `inject(fleet, kind, turn)` cuts it and returns the
Injected, whose `heal()` lifts it):

    primary-split   the primary cut from its replicas, both ways; its clients and gateways still
                    reach it (the case that must never give two primaries acknowledging)
    replica-cut     one replica cut from every other host
    gateway-store   one gateway cut from every store member
    gateway-redis   one gateway cut from Redis
    asym-out        what the primary sends to its replicas dropped; what they send it arrives
    asym-in         what the replicas send the primary dropped; what it sends them arrives
    loss            10 % of the packets the primary sends and receives dropped
    delay           every packet the primary sends 200 ms late
    flap            the primary's link to its replicas cut and healed in turns (cut 1-3 s,
                    healed 0.5-2 s) for the hold time
    primary-half    the primary cut from one replica only, every other time the Raft leader (a
                    partial partition: the group keeps a majority that the primary cannot reach)
"""
from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from lmqtt.store.client import connect

from .netbed import NetBed

STORE_PORT = 10911
MQTT_PORT = 1883
REDIS_PORT = 6379
SEGMENT_MB = 8


@dataclass
class FleetOptions:
    election_timeout: float = 2.5
    flush_mode: str = "async"
    ack_replicas: int | None = None
    token: str = "lmqtt-netbed"
    lmqtt_env: dict | None = None      # the environment of lmqtt's processes (None: this one's)


# ------------------------------------------------------------------------------------ the fleet
@dataclass
class Member:
    group: str
    node: int
    host: str
    addr: str
    data_dir: Path
    log: Path

    @property
    def address(self) -> str:
        return f"{self.addr}:{STORE_PORT}"


@dataclass
class Group:
    name: str
    members: list = field(default_factory=list)

    @property
    def peers(self) -> str:
        return ",".join(m.address for m in self.members)

    def member(self, node: int) -> Member:
        return self.members[node - 1]


def _lmqtt(*args: str) -> list[str]:
    return [sys.executable, "-m", "lmqtt.gateway.cli", *args]


class PartitionedFleet:
    """Lays the hosts out on `bed` and runs the processes (module docstring). Every call that
    needs the network runs on host `ctl` (NetBed.inside)."""

    def __init__(self, bed: NetBed, workdir: str | os.PathLike, opts: FleetOptions | None = None,
                 groups: int = 1, members: int = 3, gateways: int = 2, log=print) -> None:
        self.bed, self.opts, self.log = bed, opts or FleetOptions(), log
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        bed.add_host("ctl", 2)
        self.groups: list[Group] = []
        for g in range(groups):
            grp = Group(f"g{g + 1}")
            for i in range(members):
                name = f"{grp.name}m{i + 1}"
                h = bed.add_host(name, 11 + 10 * g + i)
                grp.members.append(Member(grp.name, i + 1, name, h.addr, self.workdir / name, self.workdir / f"{name}.log"))
            self.groups.append(grp)
        self.redis_addr = bed.add_host("redis", 5).addr
        self.gateways = [f"gw{i + 1}" for i in range(gateways)]
        for i, gw in enumerate(self.gateways):
            bed.add_host(gw, 61 + i)
        bed.add_host("c1", 81)
        bed.add_host("c2", 82)
        self.procs: dict[str, subprocess.Popen] = {}
        self.died: list[dict] = []

    # -------------------------------------------------------------- addresses
    @property
    def group(self) -> Group:
        return self.groups[0]

    @property
    def store_address(self) -> str:
        """What clients and gateways are given: every group's members (`;` between groups)."""
        return ";".join(g.peers for g in self.groups)

    @property
    def redis_url(self) -> str:
        return f"redis://{self.redis_addr}:{REDIS_PORT}/0"

    def mqtt_address(self, gateway: str) -> tuple[str, int]:
        return self.bed.addr(gateway), MQTT_PORT

    def env(self) -> dict:
        e = dict(os.environ if self.opts.lmqtt_env is None else self.opts.lmqtt_env)
        e["LMQTT_STORE_TOKEN"] = self.opts.token
        return e

    # -------------------------------------------------------------- processes
    def _argv(self, name: str) -> list[str]:
        o = self.opts
        for g in self.groups:
            for m in g.members:
                if m.host == name:
                    a = _lmqtt("store", "--group", g.name, "--node-id", str(m.node), "--peers", g.peers,
                               "--host", m.addr, "--port", str(STORE_PORT), "--data-dir", str(m.data_dir),
                               "--segment-mb", str(SEGMENT_MB), "--flush-mode", o.flush_mode,
                               "--election-timeout-s", str(o.election_timeout), "--redis", self.redis_url)
                    if o.ack_replicas is not None:
                        a += ["--ack-replicas", str(o.ack_replicas)]
                    return a
        if name in self.gateways:
            return _lmqtt("gateway", "--store", self.store_address, "--redis", self.redis_url, "--host",
                          self.bed.addr(name), "--port", str(MQTT_PORT), "--gateway-id", f"bed-{name}",
                          "--metrics-port", "0", "--allow-anonymous")
        raise KeyError(name)

    def start_process(self, name: str) -> None:
        if name == "redis":
            exe = shutil.which("redis-server")
            if exe is None:
                raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
            argv = [exe, "--bind", self.redis_addr, "--port", str(REDIS_PORT), "--save", "", "--appendonly", "no",
                    "--protected-mode", "no"]
            self.procs[name] = self.bed.run("redis", argv, self.workdir / "redis.log", cwd=self.workdir)
        else:
            self.procs[name] = self.bed.run(name, self._argv(name), self.workdir / f"{name}.log", env=self.env(),
                                            cwd=self.workdir)

    def start(self, timeout: float = 90.0) -> "PartitionedFleet":
        t0 = time.monotonic()
        self.start_process("redis")
        self._wait_port("redis", self.redis_addr, REDIS_PORT, t0 + timeout)
        for g in self.groups:
            for m in g.members:
                self.start_process(m.host)
        for g in self.groups:
            self.wait_healthy(g, max(1.0, t0 + timeout - time.monotonic()))
        for gw in self.gateways:
            self.start_process(gw)
        for gw in self.gateways:
            self._wait_port(gw, self.bed.addr(gw), MQTT_PORT, t0 + timeout)
        self.log(f"fleet up in {time.monotonic() - t0:.1f} s: {len(self.groups)} group(s) of "
                 f"{len(self.group.members)}, {len(self.gateways)} gateways, redis")
        return self

    def _wait_port(self, name: str, addr: str, port: int, deadline: float) -> None:
        while time.monotonic() < deadline:
            p = self.procs.get(name)
            if p is not None and p.poll() is not None:
                raise RuntimeError(f"{name} exited with status {p.returncode} while starting; log "
                                   f"{self.workdir / (name + '.log')}:\n{self.log_tail(name)}")
            with self.bed.inside("ctl"):
                s = socket.socket()
            s.settimeout(0.5)
            try:
                s.connect((addr, port))
                return
            except OSError:
                time.sleep(0.1)
            finally:
                s.close()
        raise RuntimeError(f"{name} not listening on {addr}:{port} in time; log:\n{self.log_tail(name)}")

    def log_tail(self, name: str, n: int = 20) -> str:
        try:
            return "\n".join((self.workdir / f"{name}.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def check_alive(self) -> list[str]:
        """Processes found dead (no fault of ours kills any): noted in `died`, started again."""
        out = []
        for name, p in list(self.procs.items()):
            if p.poll() is not None:
                self.died.append({"process": name, "status": p.returncode, "log_tail": self.log_tail(name, 8)})
                out.append(f"{name} (exit status {p.returncode})")
                self.start_process(name)
        return out

    def stop(self) -> None:
        for name in [*self.gateways, *(m.host for g in self.groups for m in g.members), "redis"]:
            p = self.procs.get(name)
            if p is not None:
                self.bed.stop(p, 30)

    # -------------------------------------------------------------- the group's state
    def store_connection(self, address: str, timeout: float = 2.0):
        return connect(address, token=self.opts.token, timeout=timeout, connect_timeout=timeout,
                       reconnect_attempts=1, client_name="lmqtt-bed")

    def status(self, m: Member, timeout: float = 2.0) -> dict | None:
        """The member's `ha_status`, asked from host ctl; None when it does not answer."""
        with self.bed.inside("ctl"):
            try:
                c = self.store_connection(m.address, timeout)
            except Exception:  # noqa: BLE001 - down, cut, restarting
                return None
            try:
                return c.cmd("ha_status")
            except Exception:  # noqa: BLE001
                return None
            finally:
                c.close()

    def statuses(self, g: Group | None = None) -> dict[int, dict | None]:
        g = g or self.group
        out: dict[int, dict | None] = {}
        threads = [threading.Thread(target=lambda m=m: out.__setitem__(m.node, self.status(m))) for m in g.members]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        # a copy: a thread still asking (a slow member) must not change what the caller iterates
        got = dict(out)
        return {m.node: got.get(m.node) for m in g.members}

    def primary(self, g: Group | None = None) -> Member | None:
        """The member that says it is primary with its lease held (None when none does)."""
        g = g or self.group
        for n, st in self.statuses(g).items():
            if st and st["role"] == "primary" and st.get("lease_ok"):
                return g.member(n)
        return None

    def health(self, g: Group | None = None) -> tuple[bool, str, dict]:
        """Is the group whole: every member answers, one primary with its lease, every member in the
        same epoch following it, all in the in-sync set, the same epoch list, and their CommitLogs
        equal up to the shortest one's end. -> (ok, why not, statuses)."""
        g = g or self.group
        answers = self.statuses(g)
        missing = [n for n, st in answers.items() if st is None]
        if missing:
            return False, f"members {missing} do not answer", answers
        sts: dict[int, dict] = {n: st for n, st in answers.items() if st is not None}
        prim = [n for n, st in sts.items() if st["role"] == "primary" and st.get("lease_ok")]
        if len(prim) != 1:
            return False, f"primaries with a lease: {prim}", sts
        p = prim[0]
        epochs = {n: st["epoch"] for n, st in sts.items()}
        if len(set(epochs.values())) != 1:
            return False, f"epochs differ: {epochs}", sts
        lagging = [n for n, st in sts.items() if n != p and (st["role"] != "replica" or st.get("follow_error"))]
        if lagging:
            return False, f"members {lagging} not following the primary", sts
        isr = set(sts[p]["in_sync"])
        if isr != {m.node for m in g.members}:
            return False, f"in-sync set {sorted(isr)}", sts
        lists = {n: tuple(map(tuple, st["epochs"])) for n, st in sts.items()}
        if len(set(lists.values())) != 1:
            return False, f"epoch lists differ: {lists}", sts
        return True, "", sts

    def wait_healthy(self, g: Group | None = None, timeout: float = 90.0, logs: "LogCompare | None" = None
                     ) -> tuple[bool, str]:
        """Until health() holds and (with `logs`) the members' logs compare equal. -> (ok, last reason)."""
        g = g or self.group
        deadline = time.monotonic() + timeout
        why = ""
        while time.monotonic() < deadline:
            ok, why, sts = self.health(g)
            if ok and logs is not None:
                ok, why = logs.compare({n: st["log_end"] for n, st in sts.items()})
            if ok:
                return True, ""
            time.sleep(0.2)
        return False, why


class LogCompare:
    """The members' CommitLog bytes compared, read from their segment files: equal up to the
    shortest log's end. What was found equal is not read again (`verified`), less a margin: a
    new primary may cut a last record that every member held only the start of."""

    MARGIN = 1 << 20
    CHUNK = 1 << 20

    def __init__(self, group: Group) -> None:
        self.group = group
        self.verified = 0
        self.crc = 0                  # crc32 of bytes [0, verified) (every member's: they are equal)
        self.upto = 0                 # the last compare found every member equal up to here
        self.upto_crc = 0             # crc32 of bytes [0, upto)

    def _segments(self, m: Member) -> list[tuple[int, Path]]:
        d = m.data_dir / "store" / "commitlog"
        try:
            return sorted((int(n), d / n) for n in os.listdir(d) if len(n) == 20 and n.isdigit())
        except FileNotFoundError:
            return []

    def _read(self, segs, off: int, n: int) -> bytes:
        out = b""
        for start, path in reversed(segs):
            if start <= off:
                try:
                    with open(path, "rb") as f:
                        f.seek(off - start)
                        out = f.read(n)
                except OSError:
                    return b""
                break
        return out

    def compare(self, ends: dict[int, int]) -> tuple[bool, str]:
        end = min(ends.values())
        if end < self.verified:                  # a cut below what was compared: compare again from 0
            self.verified, self.crc = 0, 0
        segs = {m.node: self._segments(m) for m in self.group.members}
        off = self.verified
        crc = run = self.crc
        while off < end:
            n = min(self.CHUNK, end - off)
            # stop at a segment's end: a read never spans two files
            ref: bytes | None = None
            for m in self.group.members:
                chunk = self._read(segs[m.node], off, n)
                if ref is None:
                    ref = chunk
                    n = len(chunk)
                    if n == 0:
                        return False, f"member {m.node}: nothing to read at {off}"
                elif chunk[:n] != ref[:n]:
                    at = off + next((i for i in range(min(len(chunk), n)) if chunk[i] != ref[i]), len(chunk))
                    return False, f"members' CommitLogs differ at offset {at} (compared up to {end})"
            assert ref is not None
            run = zlib.crc32(ref[:n], run)
            if off + n <= end - self.MARGIN:
                crc = zlib.crc32(ref[:n], crc)
                self.verified, self.crc = off + n, crc
            off += n
        self.upto, self.upto_crc = end, run
        return True, ""


# ------------------------------------------------------------------------------------ faults
@dataclass
class Injected:
    kind: str
    victim: str
    what: str
    faults: list
    hold: float

    def heal(self) -> None:
        for f in self.faults:
            f.heal()


class Flapper:
    """Cuts with `cut()` and heals in turns (cut `on` s, healed `off` s, each uniform in its
    range) on its own thread until heal()."""

    def __init__(self, cut, on: tuple[float, float], off: tuple[float, float], rng: random.Random) -> None:
        self._cut, self.on, self.off, self.rng = cut, on, off, rng
        self._stop = threading.Event()
        self.cycles = 0
        self.cut_times: list[float] = []      # time.monotonic() of each cut
        self.errors: list[str] = []
        self._t = threading.Thread(target=self._run, name="bed-flap", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                f = self._cut()
            except Exception as e:  # noqa: BLE001 - reported with the fault
                self.errors.append(str(e))
                return
            self.cycles += 1
            self.cut_times.append(time.monotonic())
            self._stop.wait(self.rng.uniform(*self.on))
            f.heal()
            self._stop.wait(self.rng.uniform(*self.off))

    def heal(self) -> None:
        self._stop.set()
        self._t.join(30)


def _primary_and_replicas(fleet: PartitionedFleet):
    p = fleet.primary()
    if p is None:
        raise RuntimeError("no primary to cut")
    return p, [m for m in fleet.group.members if m is not p]


def _cut_primary(direction: str):
    def f(fleet, turn, rng):
        p, reps = _primary_and_replicas(fleet)
        return p.host, [fleet.bed.cut(p.host, [r.host for r in reps], direction)]
    return f


def _primary_half(fleet, turn, rng):
    """The primary cut from one replica: every other time the Raft leader when a replica leads
    (the primary's heartbeats then have no way to the leader while the group keeps a majority)."""
    p, reps = _primary_and_replicas(fleet)
    leader = (fleet.status(p) or {}).get("raft_leader") or ""
    lead = [r for r in reps if leader.startswith(r.addr + ":")]
    r = lead[0] if lead and turn % 2 == 0 else reps[turn % len(reps)]
    return f"{p.host}<->{r.host}", [fleet.bed.cut(p.host, r.host)]


def _replica_cut(fleet, turn, rng):
    _p, reps = _primary_and_replicas(fleet)
    r = reps[turn % len(reps)]
    return r.host, [fleet.bed.isolate(r.host)]


def _gateway_store(fleet, turn, rng):
    g = fleet.gateways[turn % len(fleet.gateways)]
    return g, [fleet.bed.cut(g, [m.host for grp in fleet.groups for m in grp.members])]


def _gateway_redis(fleet, turn, rng):
    g = fleet.gateways[turn % len(fleet.gateways)]
    return g, [fleet.bed.cut(g, "redis")]


def _loss(fleet, turn, rng):
    p, _ = _primary_and_replicas(fleet)
    return p.host, [fleet.bed.loss(p.host, 10)]


def _delay(fleet, turn, rng):
    p, _ = _primary_and_replicas(fleet)
    return p.host, [fleet.bed.delay(p.host, 200)]


def _flap(fleet, turn, rng):
    p, reps = _primary_and_replicas(fleet)
    hosts = [r.host for r in reps]
    return p.host, [Flapper(lambda: fleet.bed.cut(p.host, hosts), (1.0, 3.0), (0.5, 2.0), rng)]


# name -> (cut(fleet, turn, rng) -> (victim, faults), hold seconds, what it is)
FAULTS = {
    "primary-split": (_cut_primary("both"), 8.0, "the primary cut from its replicas (not from its clients)"),
    "replica-cut": (_replica_cut, 6.0, "a replica cut from every host"),
    "primary-half": (_primary_half, 8.0, "the primary cut from one replica (every other time the Raft leader)"),
    "gateway-store": (_gateway_store, 8.0, "a gateway cut from every store member"),
    "gateway-redis": (_gateway_redis, 5.0, "a gateway cut from Redis"),
    "asym-out": (_cut_primary("out"), 8.0, "the primary's packets to its replicas dropped (theirs arrive)"),
    "asym-in": (_cut_primary("in"), 8.0, "the replicas' packets to the primary dropped (its arrive)"),
    "loss": (_loss, 10.0, "10 % packet loss on the primary's link"),
    "delay": (_delay, 10.0, "200 ms delay on every packet the primary sends"),
    "flap": (_flap, 12.0, "the primary's link to its replicas cut and healed in turns"),
}
KINDS = tuple(FAULTS)


def inject(fleet: PartitionedFleet, kind: str, turn: int, rng: random.Random) -> Injected:
    cut, hold, what = FAULTS[kind]
    victim, faults = cut(fleet, turn, rng)
    return Injected(kind, victim, what, faults, hold)
