"""Keep the CommitLog's next pages mapped writable before the appender reaches them.

The first write to each 4 KiB page of a memory-mapped segment is a page fault (the kernel finds or
allocates the page-cache page, zeroes it, maps it). The appender takes that fault while holding
the GIL: for 100-byte messages it was ~0.3 us per message, about a tenth of the whole append
path. This thread asks the kernel to do those faults ahead of the write position with
`madvise(MADV_POPULATE_WRITE)` (Linux >= 5.14) called through ctypes, which releases the GIL for
the call: the work moves to the other core instead of the appender's.

It never changes file contents (populating a page is not writing to it), so racing with the
appender is harmless; it only touches the segment holding the write position, which is never
unmapped while the store runs (retention deletes only older segments; MessageStore stops this
thread before closing the files). Pages populated ahead are dirty zeros: a flush in between
writes them back as zeros (what the preallocated extent reads as anyway), at most `ahead` bytes
per flush. With `preallocate=False` populating a hole allocates its blocks a little early; on a
full disk the call fails with EFAULT (never SIGBUS) and is retried later. Off when the platform
lacks the call: appends then fault as before.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import sys
import threading

log = logging.getLogger("lmqtt.store")

MADV_POPULATE_WRITE = 23  # linux/mman.h
PAGE = 4096


def _load_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        return ctypes, fn
    except (OSError, AttributeError, ImportError):
        return None


def _address(ctypes, mm) -> int:
    """Start address of a writable mmap (the temporary buffer export is released at once, so
    mmap.close() keeps working)."""
    buf = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(buf)
    finally:
        del buf


class Prefaulter:
    def __init__(self, clog, ahead: int, interval_s: float = 0.005) -> None:
        self.clog = clog
        self.ahead = max(0, int(ahead)) // PAGE * PAGE
        self.interval = interval_s
        self._stop = threading.Event()
        self._wake = threading.Event()    # kick(): records arrive after a quiet spell
        self._thread: threading.Thread | None = None
        self._lib = _load_madvise() if self.ahead else None
        self._addr: dict[int, tuple] = {}   # segment start offset -> (its map, the map's address)
        self.done = 0                     # populated up to this CommitLog offset
        self.populated = 0                # bytes, for tests and stats

    @property
    def enabled(self) -> bool:
        return self._lib is not None

    def start(self) -> None:
        if self._lib is None:
            return
        self._thread = threading.Thread(target=self._run, name="lmqtt-store-prefault", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join()
            self._thread = None

    # a writing appender: the wait between checks stays at most this (next_wait)
    IDLE_INTERVAL_MAX = 0.08
    # an idle one: the wait doubles up to this (a burst after a pause starts with the `ahead` bytes
    # populated at the last check, and the dispatch service kicks this thread on the first records
    # after a quiet spell, `kick`), so an idle store does not wake this thread 200 times a second
    QUIET_INTERVAL_MAX = 10.0

    def kick(self) -> None:
        """Records arrive after a quiet spell: check now, then at the writing pace."""
        self._wake.set()

    def _run(self) -> None:
        wait, last = self.interval, -1
        while True:
            if self._wake.wait(wait):
                self._wake.clear()
                wait = self.interval
            if self._stop.is_set():
                return
            try:
                wrote = self.clog.wrote
                if not self.step():
                    return
                wait = self.next_wait(wait, wrote, last)
                last = wrote
            except Exception as e:  # noqa: BLE001 - an optimisation: never take the store down
                log.warning("commitlog prefault stopped: %s", e)
                return

    def next_wait(self, wait: float, wrote: int, last: int) -> float:
        """The wait before the next check, after one of `wait` seconds in which the write position
        went from `last` to `wrote` (-1: the first check). Idle: doubles up to QUIET_INTERVAL_MAX.
        Writing: about two checks per step's worth of bytes (`step` populates nothing for less) at
        the rate just seen, between `interval` and IDLE_INTERVAL_MAX: at 5,000 small messages a
        second (~0.75 MB/s) the thread wakes ~12 times a second instead of 200, each wake a GIL
        hand-off with the event loop; a writer fast enough to need it is still checked every
        `interval`, and `ahead` bytes (2 MiB) cover a jump in rate until the next check."""
        if wrote == last:
            return min(wait * 2, self.QUIET_INTERVAL_MAX)
        if last < 0 or wrote < last:
            return self.interval
        rate = (wrote - last) / wait
        w = min(self.ahead, 256 << 10) / rate / 2
        return self.interval if w <= self.interval else min(w, self.IDLE_INTERVAL_MAX)

    def step(self) -> bool:
        """Populate up to `ahead` bytes past the write position. False = unsupported, stop."""
        clog = self.clog
        w = clog.wrote
        mf = clog.mfq.find(w)
        if mf is None or mf.closed:
            return True
        base = mf.start_offset
        start = max(self.done, w) - base
        if start < 0:
            start = 0
        start -= start % PAGE
        end = min(w - base + self.ahead, mf.size)
        if end - start < min(self.ahead, 256 << 10) and end < mf.size:
            return True  # little to do yet: wait for the appender to use more
        if end <= start:
            return True
        ctypes, madvise = self._lib
        mm = mf.mm
        cached = self._addr.get(base)
        if cached is None or cached[0] is not mm:
            # the segment written now only (holding its map keeps it mapped; a map released and
            # made again is at another address, so the address is the map's, not the segment's)
            self._addr.clear()
            cached = self._addr[base] = (mm, _address(ctypes, mm))
        addr = cached[1]
        if self._stop.is_set() or mf.closed:
            return False
        if madvise(addr + start, end - start, MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOSYS, errno.EPERM):   # kernel < 5.14 or not allowed
                log.info("commitlog prefault off: madvise(MADV_POPULATE_WRITE) failed, errno %d", err)
                self._lib = None
                return False
            # EFAULT/ENOMEM (e.g. no disk space for a sparse segment's pages): the appender will
            # meet the same condition itself; try again later
            self._stop.wait(1.0)
            return True
        self.populated += end - start
        self.done = base + end
        return True
