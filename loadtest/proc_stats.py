"""What a running process costs, read from /proc: open files, memory maps, memory by kind,
threads, CPU; and a sampler that keeps the peaks while a benchmark or a test runs.

Used by `lmqtt bench topics` and `lmqtt bench soak` (and the end-to-end tests of a broker holding
many topics): each sample is one small read of /proc/PID/{fd,maps,status,stat}.
"""
from __future__ import annotations

import os
import threading


def open_files(pid: int) -> int:
    """Descriptors open in `pid` (what its RLIMIT_NOFILE bounds); 0 when it is gone."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def memory_maps(pid: int) -> int:
    """Memory maps of `pid` (what vm.max_map_count bounds)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def status(pid: int) -> dict[str, int]:
    """From /proc/PID/status: rss, rss_anon, rss_file (bytes) and threads."""
    out = {"rss": 0, "rss_anon": 0, "rss_file": 0, "threads": 0}
    keys = {"VmRSS:": "rss", "RssAnon:": "rss_anon", "RssFile:": "rss_file", "Threads:": "threads"}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k = keys.get(line.split(":", 1)[0] + ":")
                if k:
                    v = int(line.split()[1])
                    out[k] = v if k == "threads" else v * 1024
    except OSError:
        pass
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds `pid` used so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def disk_bytes(path: str) -> int:
    """Bytes allocated on disk under `path` (du: sparse and preallocated files count as they are)."""
    total = 0
    for dp, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dp, f)).st_blocks * 512
            except OSError:
                pass
    return total


def sample(pid: int) -> dict:
    """One sample of everything above but the disk."""
    return {"open_files": open_files(pid), "maps": memory_maps(pid), **status(pid), "cpu_s": cpu_seconds(pid)}


class PeakSampler:
    """Samples a process every `interval` seconds on a thread of its own and keeps the peaks of
    open files and maps (`peak`); `switch(pid)` follows a restarted process."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        self.pid = pid
        self.interval = interval
        self.peak = {"open_files": 0, "maps": 0, "rss": 0}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-sampler", daemon=True)

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def switch(self, pid: int) -> None:
        self.pid = pid

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            pid = self.pid
            self.samples += 1
            self.peak["open_files"] = max(self.peak["open_files"], open_files(pid))
            self.peak["maps"] = max(self.peak["maps"], memory_maps(pid))
            self.peak["rss"] = max(self.peak["rss"], status(pid)["rss"])

