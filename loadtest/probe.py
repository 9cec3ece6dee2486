"""What a benchmark reads of the broker it measures: its CPU seconds and RSS (the process and its
children: a fleet's store and gateways under one launcher), per process where it has several, and
the PID of the process listening on a port. psutil is the bench extra's; without it the figures
are None and the benchmarks report no broker CPU."""
from __future__ import annotations

import os


class BrokerProbe:
    """CPU seconds and RSS of the broker process (and its children), if we know its PID."""

    def __init__(self, pid: int | None) -> None:
        self.proc = None
        if pid:
            try:
                import psutil  # optional: the bench extra
                self.proc = psutil.Process(pid)
            except Exception:  # noqa: BLE001 - psutil missing or process gone: no broker figures
                self.proc = None

    def _procs(self):
        out = [self.proc]
        try:
            out += self.proc.children(recursive=True)
        except Exception:  # noqa: BLE001
            pass
        return out

    def cpu(self) -> float | None:
        if self.proc is None:
            return None
        total = 0.0
        for p in self._procs():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except Exception:  # noqa: BLE001 - a child may exit between listing and reading
                pass
        return total

    @staticmethod
    def _label(p) -> str:
        """A short name for a broker process: its lmqtt subcommand (and gateway id), else its exe."""
        try:
            cmd = p.cmdline()
        except Exception:  # noqa: BLE001
            return f"pid {p.pid}"
        for sub in ("store", "gateway", "serve"):
            if sub in cmd[1:4] or (len(cmd) > 3 and cmd[3] == sub):
                if sub == "gateway" and "--gateway-id" in cmd:
                    return "gateway " + cmd[cmd.index("--gateway-id") + 1].rsplit(":", 1)[-1]
                return sub
        if any("fleet_launcher" in c for c in cmd):
            return "launcher"
        try:
            return p.name()                 # e.g. redis-server (which rewrites its command line)
        except Exception:  # noqa: BLE001
            return f"pid {p.pid}"

    def cpu_by_process(self) -> dict[str, float]:
        """CPU seconds per process of the broker (label -> seconds), for multi-process brokers."""
        out: dict[str, float] = {}
        if self.proc is None:
            return out
        for p in self._procs():
            try:
                t = p.cpu_times()
                k = self._label(p)
                out[k] = out.get(k, 0.0) + t.user + t.system
            except Exception:  # noqa: BLE001
                pass
        return out

    def sched(self) -> tuple[float, float] | None:
        """Seconds on a CPU and seconds runnable but waiting for one (the run queue), summed over
        the broker's threads (/proc/PID/task/TID/schedstat). On a machine shared with other jobs
        a broker short of a core shows it here: on-CPU + waiting near 1.0 core per thread that
        wanted to run is a saturated broker, whatever share of a core it was given."""
        if self.proc is None:
            return None
        run = wait = 0
        for p in self._procs():
            try:
                tids = os.listdir(f"/proc/{p.pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{p.pid}/task/{tid}/schedstat") as f:
                        r, w, _ = f.read().split()
                except (OSError, ValueError):
                    continue
                run += int(r)
                wait += int(w)
        return run / 1e9, wait / 1e9

    def rss(self) -> int | None:
        if self.proc is None:
            return None
        total = 0
        for p in self._procs():
            try:
                total += p.memory_info().rss
            except Exception:  # noqa: BLE001
                pass
        return total


def find_broker_pid(port: int) -> int | None:
    """PID of the process listening on ``port`` on loopback (our own processes only)."""
    try:
        import psutil  # optional: the bench extra
        for c in psutil.net_connections("tcp"):
            if c.status == "LISTEN" and c.laddr and c.laddr.port == port and c.pid:
                return c.pid
    except Exception:  # noqa: BLE001 - no permission / psutil missing
        return None
    return None
