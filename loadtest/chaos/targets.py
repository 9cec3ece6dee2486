"""The systems `lmqtt bench chaos` breaks, each started by its own command on free loopback ports,
with its data on a `SmallDisk` (a tmpfs of a fixed size) when the machine allows mounting one:

* `serve`: `lmqtt serve` (one process);
* `workers`: `lmqtt serve --workers 2` (a supervisor, an `lmqtt store` and two `lmqtt gateway`
  children on one SO_REUSEPORT port; the supervisor restarts a gateway that dies and stops
  everything when the store dies);
* `fleet`: `lmqtt store` + 2 x `lmqtt gateway --store ...` on ports of their own, notify over Redis
  when `redis-server` is installed (else the store's native events);
* `mosquitto`: Mosquitto with persistence in its data dir (MQTT paths only).

A target names its fault victims (`victims()`), finds a victim's PID (`pid()`), and after a kill -9
brings the victim back on the same ports and data dir (`recover()`), waiting until it listens
again. Every process is ours, started with its own session, stopped by PID.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from lmqtt.loadtest.brokers import free_port

HOST = "127.0.0.1"
SEGMENT_MB = 8          # small CommitLog segments (the smallest the store takes): disk full hits new ones


class TargetError(RuntimeError):
    """A process of the target did not start or come back; the message names it and its log."""


# ------------------------------------------------------------------------------ /proc helpers
def _listen_inodes(port: int) -> set[str]:
    out = set()
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(f) as fh:
                next(fh)
                for line in fh:
                    parts = line.split()
                    if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                        out.add(parts[9])
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return out


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(link[8:-1])
    except OSError:
        pass
    return out


def listens(pid: int, port: int) -> bool:
    """Does process `pid` hold a listening TCP socket on `port` (SO_REUSEPORT: each its own)?"""
    inodes = _listen_inodes(port)
    return bool(inodes and inodes & _socket_inodes(pid))


def children(pid: int) -> list[tuple[int, list[str]]]:
    """(pid, argv) of the live children of `pid`."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            state = stat[stat.rindex(")") + 2]
            if ppid != pid or state == "Z":
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
            out.append((int(d), argv))
        except (OSError, ValueError, IndexError):
            continue
    return out


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2] != "Z"
    except (OSError, ValueError, IndexError):
        return False


def port_open(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.3):
            return True
    except OSError:
        return False


# ------------------------------------------------------------------------------ one process
class Proc:
    """A process we start with `argv`, output appended to `log`, ready when `ready()` says so."""

    def __init__(self, name: str, argv: list[str], log: Path, ready, env: dict | None = None,
                 cwd: Path | None = None) -> None:
        self.name, self.argv, self.log, self.ready, self.env, self.cwd = name, argv, log, ready, env, cwd
        self.p: subprocess.Popen | None = None
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return self.p.pid if self.p is not None and self.p.poll() is None else None

    def alive(self) -> bool:
        return self.p is not None and self.p.poll() is None

    def start(self, timeout: float = 60.0) -> float:
        t0 = time.monotonic()
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(self.log, "ab") as log:
            log.write(f"--- chaos: starting {self.name} (start {self.starts + 1}) ---\n".encode())
            log.flush()
            self.p = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      cwd=str(self.cwd) if self.cwd else None, start_new_session=True)
        self.starts += 1
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise TargetError(f"{self.name} exited with status {self.p.returncode} while starting; "
                                  f"log {self.log}:\n{self.log_tail()}")
            if self.ready():
                return time.monotonic() - t0
            time.sleep(0.05)
        raise TargetError(f"{self.name} not ready after {timeout:g} s; log {self.log}:\n{self.log_tail()}")

    def wait_exit(self, timeout: float) -> bool:
        if self.p is None:
            return True
        try:
            self.p.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.kill(self.p.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGCONT (in case it was stopped), SIGTERM, then SIGKILL after `timeout`."""
        if self.p is None:
            return None
        if self.p.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            if not self.wait_exit(timeout):
                self.signal(signal.SIGKILL)
                self.wait_exit(10)
        return self.p.returncode

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _lmqtt(*args: str) -> list[str]:
    return [sys.executable, "-m", "lmqtt.gateway.cli", *args]


def lmqtt_env(lmqtt_src: str | None, workdir: Path) -> dict | None:
    """The environment of lmqtt's processes: run from the source tree `lmqtt_src` (a snapshot, C
    modules built in place) when given, so edits to the working tree during a long run do not
    reach the processes it restarts; else the installed lmqtt (None: this environment).

    The tree's top-level packages (pyproject.toml's package-dir `"lmqtt.X" = "folder"`) get
    symlinks in `workdir/lmqtt-src/lmqtt/`, which goes first on PYTHONPATH."""
    if not lmqtt_src:
        return None
    src = Path(lmqtt_src).resolve()
    pyproject = src / "pyproject.toml"
    if not (src / "gateway" / "cli.py").exists() or not pyproject.exists():
        raise TargetError(f"--lmqtt-src {lmqtt_src}: not an lmqtt source tree (no gateway/cli.py, pyproject.toml)")
    dirs = dict(re.findall(r'^"lmqtt\.(\w+)"\s*=\s*"([^"/]+)"\s*$', pyproject.read_text(), re.M))
    if dirs.get("gateway") != "gateway":
        raise TargetError(f"--lmqtt-src {lmqtt_src}: its pyproject.toml does not map lmqtt.gateway to gateway/")
    root = Path(workdir) / "lmqtt-src" / "lmqtt"
    root.mkdir(parents=True, exist_ok=True)
    for pkg, folder in dirs.items():
        link = root / pkg
        if not link.exists() and (src / folder).is_dir():
            link.symlink_to(src / folder, target_is_directory=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root.parent) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# ------------------------------------------------------------------------------ targets
class Target:
    name = ""
    lmqtt = True               # an lmqtt target (the run's exit code counts its verdicts)

    def __init__(self, workdir: Path, data_root: Path, flush_mode: str = "async",
                 lmqtt_src: str | None = None) -> None:
        self.workdir = Path(workdir)
        self.env = lmqtt_env(lmqtt_src, self.workdir) if self.lmqtt else None
        self.data_root = Path(data_root)         # on the SmallDisk when there is one
        self.flush_mode = flush_mode
        self.version = ""
        self.mqtt_ports: list[int] = []
        self.store_address: str | None = None
        self.procs: dict[str, Proc] = {}
        self.unexpected_exits: list[dict] = []   # processes found dead without a kill -9 of ours

    # the ones every target has
    def victims(self) -> list[str]:
        return list(self.procs)

    def pid(self, victim: str) -> int | None:
        return self.procs[victim].pid

    def start(self) -> None:
        for p in self.procs.values():
            p.start()

    def stop(self) -> dict:
        return {name: p.stop() for name, p in reversed(list(self.procs.items()))}

    def recover(self, victim: str, timeout: float = 90.0) -> float:
        """After a kill -9 of `victim`: start it again (same argv, ports, data); seconds until ready."""
        p = self.procs[victim]
        p.wait_exit(10)
        return p.start(timeout)

    def check(self) -> list[str]:
        """Restart whatever died without a kill of ours (counted in `unexpected_exits`); names them."""
        out = []
        for name, p in self.procs.items():
            if p.p is not None and not p.alive():
                self.unexpected_exits.append({"victim": name, "status": p.p.returncode,
                                              "log_tail": p.log_tail(8)})
                p.start()
                out.append(f"{name} (exit status {p.p.returncode})")
        return out

    def logs(self) -> list[str]:
        return sorted({str(p.log) for p in self.procs.values()})


class ServeTarget(Target):
    name = "serve"

    def __init__(self, workdir: Path, data_root: Path, flush_mode: str = "async",
                 lmqtt_src: str | None = None) -> None:
        super().__init__(workdir, data_root, flush_mode, lmqtt_src)
        port, sport = free_port(), free_port()
        self.mqtt_ports = [port]
        self.store_address = f"{HOST}:{sport}"
        self.version = "lmqtt serve"
        argv = _lmqtt("serve", "--host", HOST, "--port", str(port), "--store-port", str(sport),
                      "--data-dir", str(self.data_root / "serve-data"), "--metrics-port", "0",
                      "--segment-mb", str(SEGMENT_MB), "--flush-mode", flush_mode)
        self.procs["serve"] = Proc("lmqtt serve", argv, self.workdir / "serve.log",
                                   lambda: port_open(port) and port_open(sport), env=self.env)


class WorkersTarget(Target):
    """`lmqtt serve --workers 2`; victims are the supervisor's children: `store`, `worker0`, `worker1`."""
    name = "workers"

    def __init__(self, workdir: Path, data_root: Path, flush_mode: str = "async",
                 lmqtt_src: str | None = None) -> None:
        super().__init__(workdir, data_root, flush_mode, lmqtt_src)
        self.port, self.sport = free_port(), free_port()
        self.mqtt_ports = [self.port]
        self.store_address = f"{HOST}:{self.sport}"
        self.version = "lmqtt serve --workers 2"
        argv = _lmqtt("serve", "--workers", "2", "--host", HOST, "--port", str(self.port),
                      "--store-port", str(self.sport), "--data-dir", str(self.data_root / "workers-data"),
                      "--metrics-port", "0", "--segment-mb", str(SEGMENT_MB), "--flush-mode", flush_mode)
        self.sup = Proc("lmqtt serve --workers 2", argv, self.workdir / "workers.log", self._ready, env=self.env)
        self.procs = {"supervisor": self.sup}

    def _kids(self) -> dict[str, int]:
        pid = self.sup.pid
        if pid is None:
            return {}
        out = {}
        for cpid, argv in children(pid):
            if "store" in argv[3:4]:
                out["store"] = cpid
            elif "gateway" in argv[3:4]:
                gid = argv[argv.index("--gateway-id") + 1] if "--gateway-id" in argv else ""
                out["worker" + gid.rsplit(":w", 1)[-1]] = cpid
        return out

    def _ready(self) -> bool:
        k = self._kids()
        return ("store" in k and listens(k["store"], self.sport)
                and all(f"worker{i}" in k and listens(k[f"worker{i}"], self.port) for i in (0, 1)))

    def victims(self) -> list[str]:
        return ["store", "worker0", "worker1"]

    def pid(self, victim: str) -> int | None:
        return self._kids().get(victim)

    def recover(self, victim: str, timeout: float = 90.0) -> float:
        t0 = time.monotonic()
        if victim.startswith("worker"):
            # the supervisor restarts a gateway that died; wait for the new one to listen
            deadline = t0 + timeout
            while time.monotonic() < deadline:
                if not self.sup.alive():
                    break                       # it gave up (too many restarts): start it again below
                if self._ready():
                    return time.monotonic() - t0
                time.sleep(0.05)
            else:
                raise TargetError(f"workers: {victim} not back after {timeout:g} s; log:\n{self.sup.log_tail()}")
        # the store died: the supervisor stops the gateways and exits 1; start the whole again
        old = [p for p in self._kids().values()]
        if not self.sup.wait_exit(60):
            self.sup.signal(signal.SIGKILL)
            self.sup.wait_exit(10)
        deadline = time.monotonic() + 30
        while any(pid_alive(p) for p in old) and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in old:                           # children outliving the supervisor: ours to end
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
        self.sup.start(timeout)
        return time.monotonic() - t0

    def check(self) -> list[str]:
        if self.sup.p is not None and not self.sup.alive():
            self.unexpected_exits.append({"victim": "supervisor", "status": self.sup.p.returncode,
                                          "log_tail": self.sup.log_tail(8)})
            self.recover("store")
            return [f"lmqtt serve --workers 2 (exit status {self.sup.p.returncode})"]
        if not self._ready():                   # a worker restarting: give it time
            deadline = time.monotonic() + 30
            while not self._ready() and time.monotonic() < deadline:
                time.sleep(0.05)
        return []


class FleetTarget(Target):
    """`lmqtt store` + 2 x `lmqtt gateway`; Redis carries the notify events when redis-server exists
    (`notify="auto"`), else the store's native events."""
    name = "fleet"

    def __init__(self, workdir: Path, data_root: Path, flush_mode: str = "async",
                 lmqtt_src: str | None = None, notify: str = "auto") -> None:
        super().__init__(workdir, data_root, flush_mode, lmqtt_src)
        sport = free_port()
        self.store_address = f"{HOST}:{sport}"
        self.mqtt_ports = [free_port(), free_port()]
        redis_exe = shutil.which("redis-server")
        if notify == "redis" and not redis_exe:
            raise TargetError("fleet: --notify redis but redis-server is not installed")
        self.notify = "redis" if notify == "redis" or (notify == "auto" and redis_exe) else "native"
        redis = []
        if self.notify == "redis":
            rport = free_port()
            self.procs["redis"] = Proc("redis-server", [redis_exe, "--port", str(rport), "--bind", HOST,
                                                        "--save", "", "--appendonly", "no"],
                                       self.workdir / "redis.log", lambda: port_open(rport), cwd=self.workdir)
            redis = ["--redis", f"redis://{HOST}:{rport}/0"]
        self.procs["store"] = Proc("lmqtt store", _lmqtt("store", "--host", HOST, "--port", str(sport),
                                                          "--data-dir", str(self.data_root / "fleet-store"),
                                                          "--segment-mb", str(SEGMENT_MB), "--flush-mode",
                                                          flush_mode, *redis),
                                   self.workdir / "store.log", lambda: port_open(sport), env=self.env)
        for i, port in enumerate(self.mqtt_ports):
            self.procs[f"gateway{i}"] = Proc(
                f"lmqtt gateway {i}", _lmqtt("gateway", "--store", self.store_address, "--host", HOST, "--port",
                                             str(port), "--gateway-id", f"chaos-gw{i}", "--metrics-port", "0",
                                             *redis),
                self.workdir / f"gateway{i}.log", lambda port=port: port_open(port), env=self.env)
        self.version = f"lmqtt store + 2 gateways (notify {self.notify})"

    def victims(self) -> list[str]:
        return ["store", "gateway0", "gateway1"]


MOSQUITTO_AUTOSAVE = ("autosave_on_changes true", "autosave_interval 1")


class MosquittoTarget(Target):
    """Mosquitto with persistence (its db in the data dir, saved after every change: the most
    durable it can be configured; it has no synchronous write of each message)."""
    name = "mosquitto"
    lmqtt = False

    def __init__(self, workdir: Path, data_root: Path, flush_mode: str = "async",
                 lmqtt_src: str | None = None) -> None:
        super().__init__(workdir, data_root, flush_mode, lmqtt_src)
        exe = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto") else None)
        if not exe:
            raise TargetError("mosquitto: binary not found (apt-get install mosquitto)")
        port = free_port()
        self.mqtt_ports = [port]
        data = self.data_root / "mosquitto-data"
        data.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "mosquitto.conf"
        lines = [f"listener {port} {HOST}", "allow_anonymous true", "max_inflight_messages 0",
                 "max_queued_messages 1000000", "max_queued_bytes 0", "persistence true",
                 f"persistence_location {data}/", *MOSQUITTO_AUTOSAVE, "set_tcp_nodelay true",
                 "log_dest stderr", "log_type error", "log_type warning"]
        if os.geteuid() == 0:
            lines.append("user root")
        conf.write_text("\n".join(lines) + "\n")
        try:
            out = subprocess.run([exe, "-h"], capture_output=True, text=True, timeout=5).stdout
            self.version = out.splitlines()[0].strip() if out else "mosquitto"
        except (OSError, subprocess.TimeoutExpired):
            self.version = "mosquitto"
        self.procs["mosquitto"] = Proc("mosquitto", [exe, "-c", str(conf)], self.workdir / "mosquitto.log",
                                       lambda: port_open(port))


TARGETS = {"serve": ServeTarget, "workers": WorkersTarget, "fleet": FleetTarget, "mosquitto": MosquittoTarget}
