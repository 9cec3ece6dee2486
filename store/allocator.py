"""Run a store's process on jemalloc when the system has it, as RocksDB recommends.

Why: a broker that runs for months frees and allocates in RocksDB's flush and compaction threads
all day. glibc gives each thread an arena of its own, and what those threads free comes back
scattered: in the 2-hour soak (`lmqtt bench soak`) the arenas of the RocksDB threads grew for the
first hour to ~90 MiB with ~30 MiB in use, the rest free but on pages that still held a live block,
which `malloc_trim` cannot return (store/heap.py). jemalloc sorts blocks by size class into runs
and gives unused pages back on a timer (its "decay"), so fragmented free memory does not pile up.

The allocator is chosen when the process starts, by the dynamic loader: `LD_PRELOAD`. So
`lmqtt serve`, `lmqtt store` and `lmqtt gateway` call `use_jemalloc()` before anything else; when
libjemalloc (Debian/Ubuntu: `libjemalloc2`) is installed and not loaded yet, the process executes
itself again - the same PID, arguments and descriptors - with it preloaded. Processes it starts
(`serve --workers`) inherit the setting. Without the library it runs on the C library's malloc.

`LMQTT_MALLOC=libc` keeps the C library's malloc; `LMQTT_MALLOC=jemalloc` insists (an error
when the library is missing); unset or `auto`: jemalloc where installed. The start-up banner says
which is in use.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

ENV = "LMQTT_MALLOC"
_EXECUTED = "LMQTT_MALLOC_EXECUTED"       # set before the re-execution: never loops
# jemalloc's own settings unless the user gave theirs: a background thread returns freed pages on
# its timer also while the broker is idle (without it, only the next allocations do)
DEFAULT_CONF = "background_thread:true"
MALLCTL_ARENAS_ALL = 4096                # jemalloc's "all arenas" index in mallctl names


class AllocatorError(RuntimeError):
    pass


@functools.cache
def jemalloc_loaded() -> bool:
    """True when this process's malloc is jemalloc (its `mallctl` is a global symbol)."""
    try:
        return hasattr(ctypes.CDLL(None), "mallctl")
    except OSError:
        return False


def find_jemalloc() -> str | None:
    """The file name the loader finds jemalloc under, or None."""
    return ctypes.util.find_library("jemalloc")


def name() -> str:
    """What the banner prints: the allocator of this process."""
    if jemalloc_loaded():
        return "jemalloc"
    return "C library malloc" + (" (LMQTT_MALLOC=libc)" if os.environ.get(ENV) == "libc" else
                                 "" if find_jemalloc() else " (install libjemalloc2 for jemalloc)")


def use_jemalloc(prog: str) -> None:
    """Execute this process again with jemalloc preloaded when it is installed and wanted; returns
    when nothing is to be done (already on jemalloc, not wanted, not installed, not Linux)."""
    want = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if want not in ("auto", "jemalloc", "libc"):
        raise AllocatorError(f"{ENV}={want!r}: expected auto, jemalloc or libc")
    if want == "libc" or not sys.platform.startswith("linux") or jemalloc_loaded():
        return
    lib = find_jemalloc()
    if lib is None or os.environ.get(_EXECUTED):
        if want == "jemalloc":
            why = ("the dynamic loader did not preload it" if lib else
                   "libjemalloc is not installed (Debian/Ubuntu: apt install libjemalloc2)")
            raise AllocatorError(f"{ENV}=jemalloc: {why}")
        return
    argv = list(getattr(sys, "orig_argv", []))
    if not argv:           # an embedded interpreter: no command line to run again
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env.setdefault("MALLOC_CONF", DEFAULT_CONF)
    env[_EXECUTED] = prog
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)


def purge() -> bool:
    """Return the free pages of every jemalloc arena to the kernel now; False when this process
    does not run on jemalloc."""
    if not jemalloc_loaded():
        return False
    mallctl = ctypes.CDLL(None).mallctl
    mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return mallctl(f"arena.{MALLCTL_ARENAS_ALL}.purge".encode(), None, None, None, 0) == 0
