"""Shared pytest fixtures. Each helper section is marked; keep fixtures generic and real."""
from __future__ import annotations

import socket

import pytest


def free_port() -> int:
    """A free TCP port on loopback (bind to 0, read it back, release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def port() -> int:
    return free_port()


# ---------------------------------------------------------------------------------------------
# gateway helper section: a real `lmqtt serve` subprocess on a free loopback port
# ---------------------------------------------------------------------------------------------
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402


class LmqttServer:
    """One `lmqtt serve` process: tmp data dir, free ports, SIGTERM (or SIGKILL) and restart.

    Unpacks as `(host, port, data_dir)`; `.restart(kill=True)` simulates a crash (kill -9) and
    starts a new process on the same port and data dir.
    """

    def __init__(self, data_dir: str, extra_args: tuple[str, ...] = (), log_path: str | None = None) -> None:
        self.host = "127.0.0.1"
        self.port = free_port()
        self.metrics_port = free_port()
        self.data_dir = str(data_dir)
        self.extra_args = tuple(extra_args)
        self.log_path = log_path or os.path.join(self.data_dir, "..", f"lmqtt-serve-{self.port}.log")
        self.proc: subprocess.Popen | None = None

    def __iter__(self):
        return iter((self.host, self.port, self.data_dir))

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def start(self, timeout: float = 20.0) -> "LmqttServer":
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--host", self.host, "--port", str(self.port),
               "--data-dir", self.data_dir, "--metrics-port", str(self.metrics_port), "--segment-mb", "16",
               *self.extra_args]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmqtt serve exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"lmqtt serve did not listen within {timeout}s: {self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.proc = None
        self._log.close()
        return p.returncode

    def kill9(self) -> int | None:
        return self.stop(signal.SIGKILL)

    def restart(self, kill: bool = False) -> "LmqttServer":
        rc = self.stop(signal.SIGKILL if kill else signal.SIGTERM)
        if not kill:
            assert rc == 0, f"lmqtt serve exit code {rc} on SIGTERM: {self.log_tail()}"
        return self.start()

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return "<no log>"


@pytest.fixture
def lmqtt_server(tmp_path):
    """A running `lmqtt serve` (tmp data dir, free loopback port); SIGTERM at teardown."""
    srv = LmqttServer(str(tmp_path / "data"), log_path=str(tmp_path / "lmqtt-serve.log")).start()
    try:
        yield srv
    finally:
        srv.stop()
