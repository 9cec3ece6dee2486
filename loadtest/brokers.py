"""Start and stop the brokers under comparison, each by its own command, on a free loopback port.

Each broker runs as a child process we own: we know its PID (for psutil CPU/RSS sampling and for
stopping it) and nothing else on the machine is touched. A broker that cannot be started (binary
missing, gateway not built yet, port never opens) is reported as *not available* with the reason
and the tail of its log instead of failing the whole comparison.

* ``mosquitto``: Debian's ``mosquitto`` binary with a generated config (loopback listener,
  anonymous, unlimited connections, raised queue/inflight limits so a benchmark measures the
  broker, not its default back-pressure of 1000 queued messages; see ``mosquitto_conf``).
* ``amqtt``: the ``amqtt`` console script of this Python (3.1.1 only), anonymous auth plugin only
  (the default config also loads packet/event loggers, which would benchmark logging).
* ``lmqtt``: ``lmqtt serve`` (embedded mode: gateway + store + notify in one process).
* ``lmqtt-workers``: ``lmqtt serve --workers 2`` (a store process and two gateway processes
  sharing the MQTT port with SO_REUSEPORT; gateway/app/workers.py).
* ``lmqtt-auth-http``: ``lmqtt serve`` whose logins and ACL go to an HTTP auth service
  (``--auth-http``; loadtest/auth_service.py, its own process, not counted as the broker's) instead
  of the password file: with ``--password``, the cost of HTTP authentication and of its cached ACL
  decisions next to ``lmqtt`` with the password file, in the same run.
* ``lmqtt-fleet``: ``lmqtt store`` + two ``lmqtt gateway`` on their own ports, no Redis
  (loadtest/fleet_launcher.py); the bench client puts subscribers on the other gateway than
  their publishers (ScenarioConfig.ports), so every message crosses gateways.

The multi-process brokers are measured as one: the probe sums CPU and RSS over the started process
and all its children, and reports each process's share (probe.py `BrokerProbe`).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from importlib.metadata import version as _v
from pathlib import Path

KNOWN = ("lmqtt", "mosquitto", "amqtt", "lmqtt-workers", "lmqtt-fleet", "lmqtt-auth-http", "floor", "floor-store")


class BrokerUnavailable(RuntimeError):
    """The broker cannot be run here; the message says why (shown as 'not available')."""


class PortTaken(BrokerUnavailable):
    """Another process holds the port the broker was to listen on (`start` tries another)."""


_handed_out: set[int] = set()


def free_port() -> int:
    """A free loopback port for a broker, not handed out before by this process.

    Chosen below the kernel's ephemeral range, never with bind(0): a broker restarted on its port
    after kill -9 must find it free, and a port from the ephemeral range can meanwhile be taken as
    the local port of any outgoing connection on the machine (a store restart failed with 'address
    already in use' so). Successive calls give distinct ports; the kernel's bind(0) may offer a
    just-released one again."""
    return free_ports(1)


def free_port_pair() -> int:
    """A port p with p and p + 1 both free on loopback (the gateways' metrics ports base + i).
    Below the ephemeral range too: after a storm of client connections most ports in that range
    are held by sockets in TIME_WAIT, and 50 tries of two neighbours there all failed."""
    return free_ports(2)


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_range(n: int) -> tuple[int, int]:
    """[low, high) of the ports free_ports picks from: the upper half below the ephemeral range;
    under pytest-xdist, worker k of K its k-th slice (processes it starts inherit the worker's
    variables), so that two test processes never pick the same port and race to bind it."""
    top = max(2000, _ephemeral_start() - n)
    low = max(1024, top // 2)
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1:
        k, size = int(worker[2:]) % int(count), (top - low) // int(count)
        low, top = low + k * size, low + (k + 1) * size
    return low, top


def free_ports(n: int) -> int:
    """The first of n consecutive loopback ports that bind now, below the ephemeral range and not
    handed out before."""
    low, top = _port_range(n)
    for _ in range(200):
        p = random.randrange(low, top - n + 1)      # p + n - 1 inside the range too
        if any(p + i in _handed_out for i in range(n)):
            continue
        socks = []
        try:
            for i in range(n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", p + i))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        _handed_out.update(p + i for i in range(n))
        return p
    raise BrokerUnavailable(f"no {n} consecutive free loopback port(s) below the ephemeral range in 200 tries")


def raise_nofile() -> int:
    """Raise the soft open-files limit to the hard limit (10,000 connections need it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return soft
    return hard


def wait_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds the TCP socket listening on `port`; None when it cannot be
    told (no psutil, the bench extra; or the process is gone)."""
    try:
        import psutil  # optional: the bench extra
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except Exception:  # noqa: BLE001 - no psutil, or the process is gone: unknown
        return None
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns)


@dataclass
class RunningBroker:
    name: str
    host: str
    port: int
    proc: subprocess.Popen
    workdir: Path
    log_path: Path
    version: str = ""
    argv: list[str] = field(default_factory=list)
    extra_ports: list[int] = field(default_factory=list)    # further gateways (lmqtt-fleet)
    metrics_ports: list[int] = field(default_factory=list)  # the gateways' /metrics (multi-process)
    helpers: list = field(default_factory=list)             # processes it uses (lmqtt-auth-http's service)

    def store_reads(self) -> int | None:
        """Light-queue pulls the gateways sent to the store so far (`lmqtt_remote_pulls`), summed
        over the gateways; None for a broker without remote gateways."""
        if not self.metrics_ports:
            return None
        total = 0
        for p in self.metrics_ports:
            try:
                with urllib.request.urlopen(f"http://{self.host}:{p}/metrics", timeout=5) as r:
                    text = r.read().decode()
            except OSError:
                return None
            for line in text.splitlines():
                if line.startswith("lmqtt_remote_pulls_total "):
                    total += int(float(line.split()[1]))
        return total

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM our child by PID, then SIGKILL if it does not exit in ``timeout`` (a supervisor
        of several processes gets longer: it stops its children first)."""
        if timeout is None:
            timeout = 60.0 if self.extra_ports or self.name == "lmqtt-workers" else 10.0
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
            except ProcessLookupError:
                pass
        for h in self.helpers:          # after the broker: its last requests are answered
            if h.poll() is None:
                h.kill()
                h.wait(5)
        return self.proc.returncode


@dataclass
class Security:
    """`bench compare --tls/--password`: every broker gets the same listener security. TLS: the
    measured port is a TLS listener with `cert`/`key` (clients trust `ca`); password: clients must
    log in with `username`/`password`, checked against `password_file` (written by
    mosquitto_passwd, which both brokers read). `lmqtt_args`: further `lmqtt serve` flags (e.g.
    `--acl-file`)."""
    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    password_file: str | None = None
    username: str | None = None
    password: str | None = None
    lmqtt_args: tuple = ()
    auth_http: str | None = None      # lmqtt-auth-http: the URL of the service `start` runs


def mosquitto_conf(port: int, workdir: Path, security: Security | None = None, persist: bool = False) -> Path:
    """`persist`: Mosquitto keeps its sessions in `workdir/mosquitto.db` (written at shutdown, read
    at start), for `lmqtt bench restart`; else in memory only, as the other scenarios run it."""
    conf = workdir / "mosquitto.conf"
    sec = security or Security()
    lines = [
        f"listener {port} 127.0.0.1",
        *([f"certfile {sec.cert}", f"keyfile {sec.key}"] if sec.cert else []),
        *(["allow_anonymous false", f"password_file {sec.password_file}"] if sec.password_file
          else ["allow_anonymous true"]),
        "max_connections -1",
        # 0 = unlimited in-flight QoS 1/2 per client: with a finite limit, Mosquitto 2.0.11 stops
        # delivering to a client for good once ~max_queued_messages have passed through its queue
        # (seen here: a fan-in subscriber stalled at exactly 100,000 + 1,000 messages; with the
        # limits at 5,000 / 1,000 it stalled at ~8,000 with "Outgoing messages are being dropped").
        "max_inflight_messages 0",
        "max_queued_messages 1000000",  # persistent-session backlog scenario
        "max_queued_bytes 0",
        *(["persistence true", f"persistence_location {workdir}/", "autosave_interval 0"] if persist
          else ["persistence false"]),
        # lmqtt and amqtt (asyncio) set TCP_NODELAY on every client socket; Mosquitto only with
        # this option. Without it Nagle's algorithm holds Mosquitto's small PUBACKs and
        # deliveries until the generator's delayed ACK (40 ms): QoS 1 pairs topped out at ~22k
        # msg/s with Mosquitto at 0.3 cores, ~54k at 0.9 cores with it.
        "set_tcp_nodelay true",
        "log_dest stderr",
        "log_type error",
        "log_type warning",
    ]
    if os.geteuid() == 0:
        lines.append("user root")  # otherwise 2.x drops to user 'mosquitto' and may lose the log
    conf.write_text("\n".join(lines) + "\n")
    return conf


def _amqtt_conf(port: int, workdir: Path) -> Path:
    conf = workdir / "amqtt.yaml"
    conf.write_text(
        "listeners:\n"
        "  default:\n"
        "    type: tcp\n"
        f"    bind: 127.0.0.1:{port}\n"
        "    max_connections: 0\n"
        "plugins:\n"
        "  amqtt.plugins.authentication.AnonymousAuthPlugin:\n"
        "    allow_anonymous: true\n"
    )
    return conf


def _amqtt_script() -> str:
    beside = Path(sys.executable).with_name("amqtt")
    if beside.exists():
        return str(beside)
    found = shutil.which("amqtt")
    if not found:
        raise BrokerUnavailable("amqtt console script not found (pip install amqtt==0.12.1)")
    return found


# where each installed package lives in a source tree (pyproject.toml's package-dir)
_NAMESPACE_DIRS = {"store": "store", "lightqueue": "lightqueue", "notify": "notify", "gateway": "gateway",
                   "loadtest": "loadtest", "examples": "examples"}


def source_path(lmqtt_src: str, workdir: Path) -> tuple[str, str]:
    """(PYTHONPATH entry, module to run with -m) for running lmqtt from a source tree such as a
    `git archive` snapshot (C modules built in place with `python3 setup.py build_ext --inplace`).

    A tree of the `lmqtt` namespace layout (pyproject maps `lmqtt.store` -> `store/`, ...) gets a
    directory `workdir/lmqtt-src/lmqtt/` of symlinks to its package folders, so `lmqtt.gateway.cli`
    imports from the tree and not from the installed package; an older tree (top-level `gateway`,
    `store`, ...) runs as `gateway.cli` with the tree itself on the path."""
    src = Path(lmqtt_src).resolve()
    # `lmqtt serve`'s module: gateway/app/serve_command.py since the layout by role, gateway/serve.py before
    if not any((src / "gateway" / p).exists() for p in ("app/serve_command.py", "serve.py")):
        raise BrokerUnavailable(f"--lmqtt-src {lmqtt_src}: no lmqtt tree there (no gateway/app/serve_command.py "
                                "nor gateway/serve.py)")
    pyproject = src / "pyproject.toml"
    if pyproject.exists() and '"lmqtt.gateway" = "gateway"' in pyproject.read_text():
        ns = Path(workdir) / "lmqtt-src"
        root = ns / "lmqtt"
        root.mkdir(parents=True, exist_ok=True)
        for pkg, folder in _NAMESPACE_DIRS.items():
            link = root / pkg
            if not link.exists() and (src / folder).is_dir():
                link.symlink_to(src / folder, target_is_directory=True)
        return str(ns), "lmqtt.gateway.cli"
    return str(src), "gateway.cli"


# lmqtt runs with the per-client in-flight cap as Mosquitto is configured here: unlimited
# (`max_inflight_messages 0`, which Mosquitto 2.0.11 needs, docs/loadtest.md). lmqtt's default cap
# of 1,000 QoS 1/2 messages in flight per client (`max_inflight`) limited the fan-in subscriber to
# 50k msg/s against Mosquitto's uncapped 65k; the comparison is of the brokers, not of one's
# default against the other's tuning. `--lmqtt-args "--max-inflight N"` overrides it.
LMQTT_MATCH_MOSQUITTO = ["--max-inflight", "65535"]


def command_for(name: str, port: int, workdir: Path, lmqtt_src: str | None = None,
                extra_ports: list[int] | None = None, metrics_base: int | None = None,
                security: Security | None = None, persist: bool = False) -> tuple[list[str], str]:
    """argv to start broker ``name`` and a version string; raises BrokerUnavailable."""
    if security is not None and (security.cert or security.password_file or security.lmqtt_args):
        if name not in ("mosquitto", "lmqtt", "lmqtt-auth-http"):
            raise BrokerUnavailable(f"{name}: --tls / --password / --lmqtt-args are supported for lmqtt and mosquitto")
    if name == "mosquitto":
        exe = shutil.which("mosquitto") or ("/usr/sbin/mosquitto"
                                           if os.path.exists("/usr/sbin/mosquitto") else None)
        if not exe:
            raise BrokerUnavailable("mosquitto binary not found (apt-get install mosquitto)")
        try:
            out = subprocess.run([exe, "-h"], capture_output=True, text=True, timeout=5).stdout
            version = out.splitlines()[0].strip() if out else "mosquitto"
        except (OSError, subprocess.TimeoutExpired):
            version = "mosquitto"
        return [exe, "-c", str(mosquitto_conf(port, workdir, security, persist))], version
    if name in ("floor", "floor-store"):     # loadtest/floor_broker.py: the floor of a Python broker
        module = "lmqtt.loadtest.floor_broker"
        if lmqtt_src:
            module = source_path(lmqtt_src, workdir)[1].replace("gateway.cli", "loadtest.floor_broker")
        argv = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port)]
        if name == "floor-store":
            return [*argv, "--store", str(workdir / "floor-data")], "floor broker (Python, uvloop) + lmqtt's store"
        return argv, "floor broker (Python, uvloop)"
    if name == "amqtt":
        try:
            version = f"amqtt {_v('amqtt')}"
        except Exception:  # noqa: BLE001 - metadata is only decoration
            version = "amqtt"
        return [_amqtt_script(), "-c", str(_amqtt_conf(port, workdir))], version
    if name in ("lmqtt-workers", "lmqtt-fleet"):
        cli, launcher = "lmqtt.gateway.cli", "lmqtt.loadtest.fleet_launcher"
        if lmqtt_src:       # the tree's own modules (its directory goes first on PYTHONPATH, `start`)
            cli = source_path(lmqtt_src, workdir)[1]
            launcher = cli.replace("gateway.cli", "loadtest.fleet_launcher")
        elif importlib.util.find_spec("lmqtt.gateway.app.workers") is None:
            raise BrokerUnavailable(f"{name}: lmqtt.gateway.app.workers is not in this lmqtt")
        data = workdir / "lmqtt-data"
        data.mkdir(exist_ok=True)
        common = ["--host", "127.0.0.1", "--data-dir", str(data), "--metrics-port",
                  str(metrics_base or 0), "--store-port", str(free_port()), *LMQTT_MATCH_MOSQUITTO]
        if name == "lmqtt-workers":
            return [sys.executable, "-m", cli, "serve", "--workers", "2", "--port", str(port),
                    *common], "lmqtt (serve --workers 2)"
        ports = f"{port},{extra_ports[0] if extra_ports else free_port()}"
        return [sys.executable, "-m", launcher, "--ports", ports, *common], \
            "lmqtt (store + 2 gateways" + (f", source {lmqtt_src})" if lmqtt_src else ")")
    if name == "lmqtt-auth-http":
        sec = security or Security()
        if not sec.password_file or sec.auth_http is None:
            raise BrokerUnavailable("lmqtt-auth-http: needs --password (the service checks the bench user's login)")
        argv, version = command_for("lmqtt", port, workdir, lmqtt_src,
                                    security=Security(cert=sec.cert, key=sec.key, ca=sec.ca,
                                                      lmqtt_args=(*sec.lmqtt_args, "--auth-http", sec.auth_http)))
        return argv, version.replace("(embedded", "(embedded, --auth-http")
    if name == "lmqtt":
        module = "lmqtt.gateway.cli"
        if lmqtt_src:
            module = source_path(lmqtt_src, workdir)[1]
        elif importlib.util.find_spec("lmqtt.gateway.app.serve_command") is None:
            raise BrokerUnavailable("lmqtt.gateway.app.serve_command is not built yet (lmqtt serve missing)")
        data = workdir / "lmqtt-data"
        data.mkdir(exist_ok=True)
        sec = security or Security()
        listen = ["--port", str(port)]
        if sec.cert:      # the measured port is the TLS listener; plain MQTT on another free port
            listen = ["--port", str(free_port()), "--tls-port", str(port), "--cert", sec.cert, "--key", sec.key]
        if sec.password_file:
            listen += ["--password-file", sec.password_file]
        # a free store port, not the default 10911: the user's own `lmqtt serve` (README) or
        # another comparison may hold that one, and an SDK client of it must not reach this store
        return [sys.executable, "-m", module, "serve", "--host", "127.0.0.1",
                *listen, "--data-dir", str(data), "--metrics-port", "0",
                "--store-port", str(free_port()), *LMQTT_MATCH_MOSQUITTO,
                *sec.lmqtt_args], \
            "lmqtt (embedded" + (f", source {lmqtt_src})" if lmqtt_src else ")")
    raise BrokerUnavailable(f"unknown broker {name!r}; known: {', '.join(KNOWN)}")


def start(name: str, workdir: Path, *, host: str = "127.0.0.1", port: int | None = None,
          ready_timeout: float = 20.0, lmqtt_src: str | None = None,
          security: Security | None = None, persist: bool = False) -> RunningBroker:
    """Start broker ``name`` and wait until its port accepts TCP connections.

    ``lmqtt_src``: run lmqtt from that source tree (its directory first on PYTHONPATH), so a
    long comparison is not disturbed by edits to the working tree while it runs. ``persist``:
    Mosquitto keeps its sessions across a restart in ``workdir`` (lmqtt always does).
    """
    if name == "mosquitto" and port is None:
        # between free_port() and Mosquitto's bind another process (a parallel test's broker)
        # may take the port: Mosquitto exits, but a check of the port alone finds the other
        # process listening there, and a run would measure that process. Another port.
        for _ in range(2):
            try:
                return start(name, workdir, host=host, port=free_port(), ready_timeout=ready_timeout,
                             security=security, persist=persist)
            except PortTaken:
                continue
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    multi = name in ("lmqtt-workers", "lmqtt-fleet")
    extra = [free_port()] if name == "lmqtt-fleet" else []
    mbase = free_port_pair() if multi else None
    opts = {k: v for k, v in (("security", security), ("persist", persist)) if v}   # only what is set
    if multi:
        opts.update(extra_ports=extra, metrics_base=mbase)
    if lmqtt_src:
        opts["lmqtt_src"] = lmqtt_src
    helpers: list = []
    if name == "lmqtt-auth-http" and security is not None and security.password_file:
        svc_port = free_port()
        svc = subprocess.Popen([sys.executable, "-m", "lmqtt.loadtest.auth_service", "--port", str(svc_port),
                                "--user", security.username or "", "--password", security.password or ""],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        helpers.append(svc)
        if not wait_port(host, svc_port, ready_timeout, svc):
            svc.kill()
            raise BrokerUnavailable("lmqtt-auth-http: the auth service did not start")
        opts["security"] = dataclasses.replace(security, auth_http=f"http://{host}:{svc_port}")
    try:
        argv, version = command_for(name, port, workdir, **opts)
    except BrokerUnavailable:
        for h in helpers:
            h.kill()
        raise
    log_path = workdir / f"{name}.log"
    log = open(log_path, "wb")
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if name.startswith(("lmqtt", "floor")) and lmqtt_src:
        src = source_path(lmqtt_src, workdir)[0]
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=str(workdir),
                                env=env, preexec_fn=raise_nofile, start_new_session=True)
    except OSError as e:
        log.close()
        for h in helpers:
            h.kill()
        raise BrokerUnavailable(f"{name}: cannot execute {argv[0]}: {e}") from e
    log.close()
    rb = RunningBroker(name, host, port, proc, workdir, log_path, version, argv, extra,
                       [mbase, mbase + 1] if mbase else [], helpers)
    if name in ("lmqtt-workers", "lmqtt-fleet"):
        ready_timeout = max(ready_timeout, 60.0)     # a store and two gateways start in turn
    if not all(wait_port(host, p, ready_timeout, proc) for p in [port, *extra]):
        rc = proc.poll()
        rb.stop()
        why = f"exited with code {rc}" if rc is not None else f"port {port} not open after {ready_timeout}s"
        tail = rb.log_tail()
        if name == "mosquitto" and "Address already in use" in tail:
            raise PortTaken(f"mosquitto: port {port} is another process's ({why}); log tail:\n{tail}")
        raise BrokerUnavailable(f"{name}: {why}; log tail:\n{tail}")
    if name == "mosquitto":
        # the port accepting is not proof enough (above): it must be Mosquitto's socket
        deadline = time.monotonic() + ready_timeout
        while (mine := listens_on(proc.pid, port)) is False and rb.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if mine is False:
            rc = proc.poll()
            rb.stop()
            raise PortTaken(f"mosquitto: port {port} is another process's"
                            + (f" (mosquitto exited with code {rc})" if rc is not None else "")
                            + f"; log tail:\n{rb.log_tail()}")
    if name in ("lmqtt", "lmqtt-auth-http"):
        # the port accepting is not proof enough: between free_port() and serve's bind another
        # process (a parallel test's) may have taken it; serve then exits naming it, and its banner
        # (printed once all its ports are its own) is what says this broker is the one listening
        deadline = time.monotonic() + ready_timeout
        while not (up := "lmqtt serve: listening on" in rb.log_tail(60)) and rb.alive() \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        if not up:
            rc = proc.poll()
            rb.stop()
            raise BrokerUnavailable(f"{name}: " + (f"exited with code {rc}" if rc is not None else
                                                   f"no banner after {ready_timeout}s") + f"; log tail:\n{rb.log_tail()}")
    if name in ("lmqtt-workers", "lmqtt-fleet"):
        # the port opens with the first gateway: wait for the supervisor's banner (all are up),
        # else the kernel would give every early connection to the first one
        deadline = time.monotonic() + ready_timeout
        while " workers on " not in rb.log_tail(50) and rb.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if " workers on " not in rb.log_tail(50):
            rb.stop()
            raise BrokerUnavailable(f"{name}: not all gateways started; log tail:\n{rb.log_tail()}")
        # each gateway opens its /metrics just after its MQTT port
        if not all(wait_port(host, p, ready_timeout, proc) for p in rb.metrics_ports):
            rb.stop()
            raise BrokerUnavailable(f"{name}: a gateway's metrics port {rb.metrics_ports} did not open; "
                                    f"log tail:\n{rb.log_tail()}")
    return rb
