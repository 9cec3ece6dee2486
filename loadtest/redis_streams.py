"""Redis Streams as the yardstick for `lmqtt bench sdk`: what a Python backend team would pick for
"append messages, consume them in a group, acknowledge" if lmqtt did not exist.

A real `redis-server` is started on a free loopback port for the run (no persistence by default,
or `appendfsync everysec` with `aof="everysec"`, the closest to lmqtt's `async` flush mode), and
driven with redis-py the way its documentation recommends for throughput: pipelined `XADD`
(`transaction=False`), and `XREADGROUP` with a large `COUNT` followed by one pipelined `XACK` per
read. Rates count messages acknowledged by the server (XADD replied / XACK replied), the same
accounting as the lmqtt rows. One client process, like the lmqtt rows. redis-py parses replies
with hiredis when it is installed (the `bench` extra installs it, as a team tuning for throughput
would); each row names the parser it used.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

from lmqtt.loadtest.brokers import free_port  # below the ephemeral range: a restart finds its port free


class RedisUnavailable(RuntimeError):
    """redis-server is not installed (Debian: `apt-get install redis-server`) or did not start."""



class RedisServer:
    """A throw-away `redis-server` on loopback; `stop()` ends exactly the process it started."""

    def __init__(self, aof: str = "no", port: int | None = None) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RedisUnavailable("redis-server not found on PATH (Debian: apt-get install redis-server)")
        self.dir = tempfile.mkdtemp(prefix="lmqtt-bench-redis-")
        self.port = port or free_port()
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir", self.dir,
                "--daemonize", "no", "--protected-mode", "yes"]
        if aof == "no":
            args += ["--appendonly", "no"]
        else:
            args += ["--appendonly", "yes", "--appendfsync", aof]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RedisUnavailable(f"redis-server exited with {self.proc.returncode} at start")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RedisUnavailable("redis-server did not listen within 10 s")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cpu_seconds(self) -> float:
        """CPU time the server process used so far (utime + stime from /proc)."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


def parser() -> str:
    """Which reply parser redis-py uses here: "hiredis" (C) or "python"."""
    try:
        from redis.utils import HIREDIS_AVAILABLE  # only with --redis: lmqtt serve never loads it
    except ImportError:  # pragma: no cover - older redis-py
        return "unknown"
    return "hiredis" if HIREDIS_AVAILABLE else "python"


def xadd(server: RedisServer, size: int, duration: float, pipeline: int = 256,
         max_messages: int = 50_000_000) -> dict:
    """Pipelined XADD of `size`-byte payloads for `duration` seconds (bounded by `max_messages`)."""
    import redis  # only with --redis: lmqtt serve never loads it
    r = redis.Redis.from_url(server.url)
    r.delete("bench")
    body = os.urandom(size)
    fields = {b"p": body}
    n = 0
    cpu0 = server.cpu_seconds()
    t0 = time.perf_counter()
    end = t0 + duration
    while time.perf_counter() < end and n < max_messages:
        p = r.pipeline(transaction=False)
        for _ in range(pipeline):
            p.xadd("bench", fields)
        n += len(p.execute())
    el = time.perf_counter() - t0
    out = {"case": "redis-xadd", "size": size, "msgs_per_s": n / el, "messages": n, "seconds": el,
           "pipeline": pipeline, "parser": parser(), "server_cpu_s": server.cpu_seconds() - cpu0}
    r.close()
    return out


def xreadgroup(server: RedisServer, size: int, duration: float, count: int = 1000,
               prefill: int = 2_000_000) -> dict:
    """XREADGROUP COUNT `count` + one pipelined XACK per read, over a stream filled beforehand.

    The stream is filled with up to `prefill` messages (or what `duration` seconds of pipelined
    XADD manage) so that consumption is measured on its own, as the lmqtt pull/POP rows are.
    """
    import redis  # only with --redis: lmqtt serve never loads it
    r = redis.Redis.from_url(server.url)
    r.delete("bench")
    body = os.urandom(size)
    filled = 0
    t_fill_end = time.perf_counter() + max(duration, 2.0)
    while filled < prefill and time.perf_counter() < t_fill_end:
        p = r.pipeline(transaction=False)
        for _ in range(1000):
            p.xadd("bench", {b"p": body})
        filled += len(p.execute())
    r.xgroup_create("bench", "g", id="0")
    n = 0
    cpu0 = server.cpu_seconds()
    t0 = time.perf_counter()
    end = t0 + duration
    while time.perf_counter() < end and n < filled:
        resp = r.xreadgroup("g", "c1", {"bench": ">"}, count=count)
        if not resp:
            break
        ids = [mid for mid, _fields in resp[0][1]]
        r.xack("bench", "g", *ids)
        n += len(ids)
    el = time.perf_counter() - t0
    out = {"case": "redis-xreadgroup", "size": size, "msgs_per_s": n / el, "messages": n, "seconds": el,
           "count": count, "parser": parser(), "server_cpu_s": server.cpu_seconds() - cpu0, "prefilled": filled}
    r.close()
    return out
