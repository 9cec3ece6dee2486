"""`DiskSpace`: the store's one "disk full" state, what refuses appends while it lasts and ends it.

Three causes, each with its own start and end (docs/store.md "Disk full"):

* ``segment``: no space to preallocate the next CommitLog segment (store/mapped_file.py). Appends
  that need the new segment are refused with DiskFull; a record that still fits the current
  segment is written (its space was preallocated with the segment). While it lasts, an append
  that needs a segment asks the filesystem for the free space (statvfs) and only tries to
  preallocate again when a segment fits, so a flood of refused publishes is not a flood of
  fallocate calls; the background service checks every `disk_check_interval_ms` too.
* ``dispatch``: dispatch cannot write an index (a ConsumeQueue or key-index file, RocksDB) for
  lack of space. What was appended is durable in the CommitLog but no longer becomes visible, so
  every append is refused until dispatch gets through again (it retries every 0.5 s; RocksDB
  resumes by itself once space returns, see lightqueue/index.py).
* ``high-water``: usage of the filesystem above `StoreConfig.disk_high_water`; every append is
  refused until usage is under the mark again.

Writes that do not refuse appends fail too while the disk is full (a dispatcher's checkpoint, a
RocksDB flush, the CommitLog checkpoint); they are retried, and a checkpoint that stays behind only
means a longer replay after a restart. They are causes of the episode as well (``write:<what>``).

One episode, however many causes and refused appends, logs ONE error line when it starts (naming
the data directory and the free space) and one warning line when the last cause ends; causes
joining or ending in between are logged at info level. `stats()` counts the refused messages.
Refusals read one attribute on the append path (`CommitLog.disk_full_reason`, set here).
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time

from .errors import DiskFull

log = logging.getLogger("lmqtt.store")

SEGMENT = "segment"
DISPATCH = "dispatch"
HIGH_WATER = "high-water"

# dispatcher name -> what a log line calls its files
_INDEX_NAMES = {"consumequeue": "ConsumeQueue", "index": "key index", "lightqueue": "light-queue index (RocksDB)"}


def size_text(n: int | None) -> str:
    """Bytes for a log line or a reason string: '512 B', '3.2 MiB', '1.0 GiB'."""
    if n is None:
        return "unknown"
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if v < 1024 or unit == "TiB":
            return f"{int(v)} B" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{n} B"   # pragma: no cover


class DiskSpace:
    def __init__(self, clog, data_dir: str, segment_size: int, high_water: float) -> None:
        self.clog = clog
        self.data_dir = os.path.abspath(data_dir)
        self.segment_size = segment_size
        self.high_water = high_water
        self._lock = threading.Lock()
        self._reasons: dict[str, str] = {}
        self._since: dict[str, float] = {}
        self._refused_at_start: dict[str, int] = {}
        self.refused = 0        # messages refused with DiskFull (a caller that retries counts again)
        self.episodes = 0       # times a cause started

    # ---------------------------------------------------------------- measures
    def free_bytes(self) -> int | None:
        """Bytes an unprivileged writer can still use on the filesystem of the data directory."""
        try:
            st = os.statvfs(self.data_dir)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def usage(self) -> float | None:
        try:
            u = shutil.disk_usage(self.data_dir)
        except OSError:
            return None
        return (u.total - u.free) / u.total if u.total else None

    # ---------------------------------------------------------------- state
    @property
    def reason(self) -> str | None:
        """The reason appends are refused now (any cause), or None."""
        r = self._reasons
        return r.get(HIGH_WATER) or r.get(DISPATCH) or r.get(SEGMENT) or next(iter(r.values()), None)

    def active(self, cause: str) -> bool:
        return cause in self._reasons

    def set(self, cause: str, reason: str) -> None:
        """`cause` starts or goes on (then only its reason is updated). The first cause of an
        episode is logged as an error; a further one while the disk is still full at info level:
        one error line per full disk, however many parts of the store notice it."""
        with self._lock:
            new = cause not in self._reasons
            first = not self._reasons
            self._reasons[cause] = reason
            if new:
                self._since[cause] = time.monotonic()
                self._refused_at_start[cause] = self.refused
                if first:
                    self.episodes += 1
            self._publish()
        if new:
            if first:
                log.error("store: %s", reason)
            else:
                log.info("store: also %s", reason)

    def clear(self, cause: str, what: str) -> None:
        """`cause` ended: `what` works again. The end of the episode (no cause left) is one
        warning line with how long it lasted; the end of one cause among others, info."""
        with self._lock:
            if cause not in self._reasons:
                return
            del self._reasons[cause]
            took = time.monotonic() - self._since.pop(cause, time.monotonic())
            refused = self.refused - self._refused_at_start.pop(cause, self.refused)
            last = not self._reasons
            self._publish()
        if last:
            log.warning("store: disk space is back in %s (%s free): %s after %.1f s; %d message(s) were "
                        "refused meanwhile", self.data_dir, size_text(self.free_bytes()), what, took, refused)
        else:
            log.info("store: %s after %.1f s (the disk is still short of space: %s)", what, took,
                     ", ".join(sorted(self._reasons)))

    def write_failed(self, what: str, err: BaseException,
                     then: str = "retried (a checkpoint left behind only means a longer replay after a restart)",
                     key: str | None = None) -> None:
        """A write that does not refuse appends failed for lack of space (a checkpoint, a dispatcher's
        flush): part of the episode (logged once, as `set`), ended by `write_ok(key)`. `what`
        names it in the log line, `then` says what happens meanwhile; `key` (default `what`)
        identifies it, when what fails may differ from one attempt to the next."""
        key = "write:" + (key or what)
        if key in self._reasons:
            return
        detail = str(err).replace("\n", " ")
        if len(detail) > 160:
            detail = detail[:157] + "..."
        self.set(key, f"disk full: {what} failed in {self.data_dir} ({size_text(self.free_bytes())} free; "
                      f"{detail}); {then}")

    def write_refused(self, what: str, err: BaseException, count: int, then: str) -> DiskFull:
        """`write_failed`, for a write whose failure refuses `count` messages: counted, and the
        DiskFull to raise (with the episode's reason for it)."""
        self.write_failed(what, err, then)
        self.refused += count
        return DiskFull(self._reasons.get("write:" + what) or str(err))

    def write_ok(self, key: str) -> None:
        if "write:" + key in self._reasons:
            self.clear("write:" + key, f"{key} works again")

    def _publish(self) -> None:
        """Under the lock: what the append path reads. `segment` refuses only appends that need a
        new segment (CommitLog._new_segment asks `segment_blocked`)."""
        r = self._reasons
        self.clog.disk_full_reason = r.get(HIGH_WATER) or r.get(DISPATCH)

    def refuse(self, count: int, reason: str | None = None) -> DiskFull:
        """Count `count` refused messages; the DiskFull to raise."""
        self.refused += count
        return DiskFull(reason or self.reason or f"disk full in {self.data_dir}")

    # ---------------------------------------------------------------- causes
    def segment_failed(self, err: BaseException) -> DiskFull:
        """Preallocating a new CommitLog segment failed for lack of space."""
        free = self.free_bytes()
        self.set(SEGMENT, f"disk full: no space for a new {size_text(self.segment_size)} CommitLog segment in "
                          f"{self.data_dir} ({size_text(free)} free); messages are refused until space is freed")
        return DiskFull(self._reasons.get(SEGMENT) or str(err))

    def segment_blocked(self) -> str | None:
        """While `segment` lasts: its reason if a segment still does not fit (then the caller
        refuses without trying), else None (try to preallocate again)."""
        reason = self._reasons.get(SEGMENT)
        if reason is None:
            return None
        free = self.free_bytes()
        if free is not None and free >= self.segment_size:
            return None
        return reason

    def segment_created(self) -> None:
        if SEGMENT in self._reasons:
            self.clear(SEGMENT, "new CommitLog segments are created again")

    def dispatch_failed(self, name: str, offset: int, err: BaseException) -> None:
        """Dispatch could not write index `name` for lack of space (it retries)."""
        if DISPATCH in self._reasons:
            return
        detail = str(err).replace("\n", " ")
        if len(detail) > 160:
            detail = detail[:157] + "..."
        self.set(DISPATCH, f"disk full: dispatch cannot write the {_INDEX_NAMES.get(name, name)} in {self.data_dir} "
                           f"({size_text(self.free_bytes())} free; {detail}); messages are refused "
                           f"until space is freed, visibility waits at offset {offset}")

    def dispatch_resumed(self, offset: int) -> None:
        if DISPATCH in self._reasons:
            self.clear(DISPATCH, f"dispatch resumed (visible up to offset {offset})")

    def check(self) -> None:
        """The background service's periodic check: the high-water mark, and whether a segment
        fits again (so `segment` ends without waiting for the next append to try)."""
        used = self.usage()
        if used is not None:
            if used > self.high_water:
                self.set(HIGH_WATER, self.high_water_reason(used))
            elif HIGH_WATER in self._reasons:
                self.clear(HIGH_WATER, f"usage {used:.1%} is back under the high-water mark "
                                       f"{self.high_water:.0%}")
        if SEGMENT in self._reasons:
            free = self.free_bytes()
            if free is not None and free >= self.segment_size:
                self.clear(SEGMENT, "a new CommitLog segment fits again")

    def check_high_water(self) -> None:
        """Before creating a segment: refuse (and start `high-water`) above the mark."""
        used = self.usage()
        if used is not None and used > self.high_water:
            reason = self.high_water_reason(used)
            self.set(HIGH_WATER, reason)
            raise DiskFull(reason)

    def high_water_reason(self, used: float) -> str:
        return (f"disk full: disk usage {used:.1%} of the filesystem holding {self.data_dir} "
                f"({size_text(self.free_bytes())} free) is above the high-water mark {self.high_water:.0%}; "
                f"appends refused until space is freed")

    def stats(self) -> dict:
        r = self._reasons
        refusing = HIGH_WATER in r or DISPATCH in r or SEGMENT in r
        return {"disk_full": refusing, "disk_full_reason": self.reason, "disk_full_causes": sorted(r),
                "disk_full_refused": self.refused, "disk_full_episodes": self.episodes,
                "disk_free_bytes": self.free_bytes()}
