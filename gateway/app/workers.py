"""`lmqtt serve --workers N`: every core of one machine, with the fleet's own pieces.

One Python process runs one event loop on one core. With `--workers N` the command becomes a
small supervisor that starts, on this host:

* one `lmqtt store` on `--store-port` (loopback; the SDK, the console tools and Spark use it as
  they use the embedded default), over the same `--data-dir` layout as `lmqtt serve`, so a data
  directory moves between `serve` and `serve --workers` unchanged;
* N `lmqtt gateway` processes on the same MQTT port (SO_REUSEPORT: the kernel spreads new
  connections over them), notified of new data by the store itself (EVENT frames on their store
  connection, no Redis);
* nothing else: persistent sessions live in the store, and the store relays each worker's client
  id claims to the others (gateway/fleet/sessions.py `StoreSessionDirectory`), so a client id connected
  twice, on two workers, is taken over as on one (MQTT 5 reason 0x8E).

A gateway that dies is restarted (its clients reconnect to the others meanwhile, their sessions
and wills are in the store); the store dying stops everything with its exit status. SIGTERM /
SIGINT stop the gateways first (they persist sessions and offsets), then the store. SIGHUP is
passed to the gateways (password file and ACL reload). If the supervisor itself is killed
(SIGKILL, OOM), every child gets SIGTERM from the kernel and stops (Linux), so nothing is left
holding the ports or the data directory.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time

from .config import hostport

# `lmqtt serve` flags that belong to the store (or to the supervisor) and not to the gateways;
# everything else on the command line (listeners, auth, --config, --max-inflight, ...) is passed
# to every gateway as given.
_NOT_FOR_GATEWAYS = {"--data-dir": True, "--flush-mode": True, "--segment-mb": True, "--store-port": True,
                     "--store-host": True, "--workers": True, "--metrics-port": True, "--token": True,
                     "--tier": True, "--tier-endpoint": True, "--local-retention": True, "--tier-retention": True,
                     "--tier-cache-mb": True, "--tier-parquet": True, "--tier-parquet-file-mb": True,
                     "--tier-parquet-merge-after-s": True, "--retention": True, "--max-open-files": True}
_RESTART_WINDOW_S = 60.0
_MAX_RESTARTS = 5


def _die_with_parent():
    """A `preexec_fn` that ties a child to this supervisor: on Linux the kernel sends the child
    SIGTERM when the supervisor dies, however it dies. Without it a `kill -9` of `lmqtt serve
    --workers N` (or the OOM killer) left the store and the gateways running in their own sessions,
    holding the MQTT port, the store port and the data directory, and the next `lmqtt serve`
    failed with "address in use". SIGTERM, not SIGKILL: each child still drains and flushes.
    libc is loaded here, in the parent; the child only calls prctl(2) (and exits at once if the
    supervisor died between the fork and that call). Elsewhere: None (no such call)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def tie() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
    return tie


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gateway_args(argv: list[str]) -> list[str]:
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
            continue
        name = tok.split("=", 1)[0]
        if name in _NOT_FOR_GATEWAYS:
            skip = "=" not in tok and _NOT_FOR_GATEWAYS[name]
            continue
        out.append(tok)
    return out


def _wait_port(host: str, port: int, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


class Supervisor:
    """`ports`: give gateway i its own MQTT port `ports[i]` instead of sharing `cfg.port` (what a
    fleet behind a load balancer looks like; `lmqtt bench compare`'s `lmqtt-fleet` runs this)."""

    def __init__(self, cfg, argv: list[str], workers: int, ports: list[int] | None = None) -> None:
        self.cfg = cfg
        self.argv = argv
        self.n = workers
        if ports is not None and len(ports) != workers:
            raise ValueError(f"{workers} workers need {workers} ports, got {ports}")
        self.ports = ports
        self.store: subprocess.Popen | None = None
        self.gateways: list[subprocess.Popen | None] = [None] * workers
        self.restarts: list[list[float]] = [[] for _ in range(workers)]
        self.stopping = False
        self.store_port = int(cfg.store_port) or _free_port()

    # ------------------------------------------------------------------------------ children
    def _cmd(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "lmqtt.gateway.cli", *args]

    def _start_store(self) -> None:
        cfg = self.cfg
        args = ["store", "--host", cfg.store_host or "127.0.0.1", "--port", str(self.store_port),
                "--data-dir", cfg.data_dir, "--flush-mode", cfg.flush_mode, "--segment-mb", str(cfg.segment_mb),
                "--retention", cfg.retention, "--max-open-files", str(cfg.max_open_files), "--log-level", cfg.log_level]
        if getattr(cfg, "token", None):
            args += ["--token", cfg.token]
        if getattr(cfg, "tier", None):       # tiered storage is the store's
            args += ["--tier", cfg.tier, "--tier-cache-mb", str(cfg.tier_cache_mb),
                     "--tier-parquet", getattr(cfg, "tier_parquet", None) or "auto",
                     "--tier-parquet-file-mb", str(getattr(cfg, "tier_parquet_file_mb", 128)),
                     "--tier-parquet-merge-after-s", str(getattr(cfg, "tier_parquet_merge_after_s", 60.0))]
            for flag, v in (("--tier-endpoint", cfg.tier_endpoint), ("--local-retention", cfg.local_retention),
                            ("--tier-retention", cfg.tier_retention)):
                if v:
                    args += [flag, v]
        # ps / pidof tell the children apart (store/node/process.py `set_process_title`):
        # only the supervisor is named `lmqtt`, so `kill -HUP $(pidof -s lmqtt)` reaches it
        env = dict(os.environ, LMQTT_PROCESS_NAME="lmqtt-store")
        self.store = subprocess.Popen(self._cmd(*args), env=env, start_new_session=True,
                                      preexec_fn=_die_with_parent())
        if not _wait_port("127.0.0.1" if (cfg.store_host or "127.0.0.1") in ("0.0.0.0", "::") else
                          (cfg.store_host or "127.0.0.1"), self.store_port, self.store, 60):
            raise RuntimeError(f"the store did not start on port {self.store_port} (exit status "
                               f"{self.store.poll()}; its messages are above)")

    def _start_gateway(self, i: int) -> None:
        cfg = self.cfg
        port = self.ports[i] if self.ports else cfg.port
        args = ["gateway", "--store", f"127.0.0.1:{self.store_port}",
                "--gateway-id", f"{socket.gethostname()}:{port}:w{i}", "--notify-mode", "native",
                "--metrics-port", str(int(cfg.metrics_port) + i if cfg.metrics_port else 0)]
        tail = ["--port", str(port)] if self.ports else ["--reuse-port"]
        env = dict(os.environ, LMQTT_PROCESS_NAME=f"lmqtt-w{i}")
        if getattr(cfg, "token", None):
            env["LMQTT_STORE_TOKEN"] = cfg.token
        self.gateways[i] = subprocess.Popen(self._cmd(*args, *_gateway_args(self.argv), *tail), env=env,
                                            start_new_session=True, preexec_fn=_die_with_parent())

    # ------------------------------------------------------------------------------ lifecycle
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        try:
            self._start_store()
            for i in range(self.n):
                self._start_gateway(i)
            host, port = self.cfg.host, self.cfg.port
            ports = self.ports or [port] * self.n
            if not all(_wait_port("127.0.0.1" if host in ("0.0.0.0", "::") else host, p, g, 60)
                       for p, g in zip(ports, self.gateways) if g is not None):
                raise RuntimeError("a gateway did not start (its messages are above)")
            # an IPv6 host in brackets: mqtt://[::1]:1883
            where = (f"on mqtt://{hostport(host, port)} (SO_REUSEPORT)" if not self.ports else
                     "on " + ", ".join(f"mqtt://{hostport(host, p)}" for p in ports))
            print(f"lmqtt serve: {self.n} workers {where}, store "
                  f"lmqtt://127.0.0.1:{self.store_port} (pid {self.store.pid}), data {self.cfg.data_dir}",
                  file=sys.stderr, flush=True)
            return self._supervise()
        except RuntimeError as e:
            print(f"lmqtt serve: {e}", file=sys.stderr, flush=True)
            self._stop_all()
            return 1

    def _supervise(self) -> int:
        while not self.stopping:
            time.sleep(0.2)
            if self.store.poll() is not None:
                code = self.store.returncode
                print(f"lmqtt serve: the store exited with status {code}; stopping the workers",
                      file=sys.stderr, flush=True)
                self._stop_all()
                return 1
            for i, g in enumerate(self.gateways):
                if g is not None and g.poll() is not None and not self.stopping:
                    now = time.monotonic()
                    recent = [t for t in self.restarts[i] if now - t < _RESTART_WINDOW_S]
                    if len(recent) >= _MAX_RESTARTS:
                        print(f"lmqtt serve: worker {i} exited {_MAX_RESTARTS} times within "
                              f"{_RESTART_WINDOW_S:g} s (last status {g.returncode}); stopping",
                              file=sys.stderr, flush=True)
                        self._stop_all()
                        return 1
                    print(f"lmqtt serve: worker {i} (pid {g.pid}) exited with status {g.returncode}; "
                          f"restarting it", file=sys.stderr, flush=True)
                    self.restarts[i] = recent + [now]
                    self._start_gateway(i)
        self._stop_all()
        return 0

    def _on_stop(self, signum, frame) -> None:
        self.stopping = True

    def _on_hup(self, signum, frame) -> None:
        for g in self.gateways:
            if g is not None and g.poll() is None:
                g.send_signal(signal.SIGHUP)

    def _stop_all(self) -> None:
        self.stopping = True
        live = [g for g in self.gateways if g is not None and g.poll() is None]
        for g in live:
            g.send_signal(signal.SIGTERM)
        for g in live:
            try:
                g.wait(20)
            except subprocess.TimeoutExpired:
                g.kill()
        p = self.store
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def run(cfg, argv: list[str], workers: int, ports: list[int] | None = None) -> int:
    return Supervisor(cfg, argv, workers, ports).run()
