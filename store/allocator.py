"""Run a store's process on jemalloc when asked (LMQTT_MALLOC=jemalloc), as RocksDB recommends.

Why an option: a broker that runs for months frees and allocates in RocksDB's flush and
compaction threads all day, and glibc's per-thread arenas keep what those threads free on pages
that still hold a live block (store/heap.py). jemalloc sorts blocks by size class and gives
unused pages back on a timer. Measured side by side in the soak (`lmqtt bench soak`, the same
hour; docs/store.md "Memory over months"), it did not hold less than glibc with the store's
periodic trim. So glibc stays the default and jemalloc is a choice for those who run RocksDB on
it elsewhere.

The allocator is chosen when the process starts, by the dynamic loader: `LD_PRELOAD`. So
`lmqtt serve`, `lmqtt store` and `lmqtt gateway` call `use_jemalloc()` before anything else; with
LMQTT_MALLOC=jemalloc and libjemalloc (Debian/Ubuntu: `libjemalloc2`) installed and not loaded
yet, the process executes itself again - the same PID, arguments and descriptors - with it
preloaded; missing, it says so and exits. Processes it starts (`serve --workers`) inherit the
setting. Unset or `libc`: the C library's malloc. The start-up banner says which is in use.
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
    return "C library malloc"


def use_jemalloc(prog: str) -> None:
    """With LMQTT_MALLOC=jemalloc, execute this process again with jemalloc preloaded; returns
    when nothing is to be done (not asked for, or already on it); AllocatorError when it cannot."""
    want = os.environ.get(ENV, "libc").strip().lower() or "libc"
    if want not in ("jemalloc", "libc"):
        raise AllocatorError(f"{ENV}={want!r}: expected jemalloc or libc")
    if want == "libc" or jemalloc_loaded():
        return
    if not sys.platform.startswith("linux"):
        raise AllocatorError(f"{ENV}=jemalloc: preloading it is done on Linux only")
    lib = find_jemalloc()
    if lib is None or os.environ.get(_EXECUTED):
        why = ("the dynamic loader did not preload it" if lib else
               "libjemalloc is not installed (Debian/Ubuntu: apt install libjemalloc2)")
        raise AllocatorError(f"{ENV}=jemalloc: {why}")
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


M_ARENA_MAX = -8                 # <malloc.h>


def one_arena() -> bool:
    """glibc: every thread of this process allocates from one arena, so what one thread frees
    serves the others (store/heap.py says why). Call before threads start: an arena made before
    stays, and glibc fixes its limit once a second arena was needed. False where the C library
    is not glibc or the process runs on jemalloc."""
    if jemalloc_loaded():
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):     # not glibc (musl, macOS)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return mallopt(M_ARENA_MAX, 1) == 1


def purge() -> bool:
    """Return the free pages of every jemalloc arena to the kernel now; False when this process
    does not run on jemalloc."""
    if not jemalloc_loaded():
        return False
    mallctl = ctypes.CDLL(None).mallctl
    mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return mallctl(f"arena.{MALLCTL_ARENAS_ALL}.purge".encode(), None, None, None, 0) == 0
