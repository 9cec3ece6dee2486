"""Give memory the process has freed back to the system (glibc only; elsewhere a no-op).

Why: a broker runs for months, and what it allocates and frees every second - RocksDB memtables
flushed every checkpoint, payload buffers, per-connection objects of devices that reconnect - is
freed into glibc's heaps, not returned to the kernel. Two things then hold it:

* glibc's *dynamic* mmap threshold: after a large block that was mmap()ed is freed, blocks of that
  size are carved from the heap instead, where a small live allocation above them keeps the heap
  from shrinking. Fixing the threshold keeps large, short-lived blocks (a memtable's arena blocks)
  in mappings of their own that go back to the kernel when freed. Blocks below it stay in the
  heaps, where a hot path reuses them without a system call.
* free pages inside a heap are returned only by `malloc_trim`. The background service calls
  `trim()` with retention. It returns whole free pages only: a page that still holds one live
  block among freed ones stays (fragmentation; docs/store.md "Memory over months").

* glibc's per-thread arenas: a thread gets an arena of its own and keeps it, and what it frees
  there serves only the threads tied to it. In the soak the light-queue sweep's thread (from the
  first segment deletion, ~10 minutes in) grew an arena of its own from 12 to 24 MiB while the
  main heap held 28 MiB of free blocks it could not use. So the store's processes keep one arena
  (M_ARENA_MAX=1, store/allocator.py `one_arena`): every thread reuses the same free blocks. What
  it costs - threads wait for one lock - is small here: small blocks come from each thread's
  cache (tcache) without the lock, and the Python threads hold the GIL around most of their
  allocations anyway. `lmqtt serve/store/gateway` set it first thing, beside the allocator's
  choice, before RocksDB's threads start; `tune()` sets it too, for a store opened in a process
  of its own (a benchmark).

A 2-hour soak before this showed the main heap growing ~8.5 MiB an hour while the memory in use
stayed level (mallinfo2: half of the heap free).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

from . import allocator

log = logging.getLogger("lmqtt.store")

M_MMAP_THRESHOLD = -3           # <malloc.h>
# blocks from 1 MiB up get mappings of their own: the memtables' arena blocks of the ConsumeQueue
# and the light-queue index (2 and 8 MiB). Not lower: at 256 KiB the light queues' dispatch paid a
# mapping, a page fault per page and an unmapping for each of its buffers of a few hundred KiB
# (`lmqtt bench lightqueue` fan-out 16: 0.73x of glibc's dynamic threshold; 1 MiB: 1.32x of 256 KiB)
MMAP_THRESHOLD = 1 << 20

_libc: ctypes.CDLL | None = None
_tuned = False


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name or "libc.so.6")
            lib.malloc_trim.argtypes = [ctypes.c_size_t]
            lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        except (OSError, AttributeError):   # not glibc (musl, macOS): nothing to tune
            return None
        _libc = lib
    return _libc


def tune() -> bool:
    """Fix the mmap threshold and keep one arena (once per process); False where the C library
    is not glibc. Arenas made before the call stay; hence called first thing at start-up."""
    global _tuned
    lib = _glibc()
    if lib is None:
        return False
    if not _tuned:
        if lib.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
            log.debug("mallopt(M_MMAP_THRESHOLD) refused; freed memory is still trimmed")
        if not allocator.one_arena():
            log.debug("mallopt(M_ARENA_MAX) refused; threads may keep arenas of their own")
        _tuned = True
    return True


def trim() -> bool:
    """Return the free pages of every heap to the kernel; True when some were returned. On
    jemalloc (store/allocator.py) its arenas are purged instead: glibc's heaps are then unused."""
    if allocator.jemalloc_loaded():
        return allocator.purge()
    lib = _glibc()
    return bool(lib is not None and lib.malloc_trim(0))
