"""`StoreConfig`: every tunable of the store in one place, validated once at construction."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

FLUSH_MODES = ("sync", "async", "async+buffer")

# Sizes of the preallocated files, laptop-sized (docs/store.md "Data dir footprint"): a fresh data
# dir holding a few messages is one CommitLog segment, the ConsumeQueue and light-queue databases
# (RocksDB: tens of bytes per topic) and, once a message carries keys, one key index file. Every
# mapped file stays preallocated (a full disk is a DiskFull when a file is created, never SIGBUS on
# a mapped write); a busy server gives a larger `segment_size` (`--segment-mb`, the Helm chart: 256).
SEGMENT_SIZE = 32 << 20            # CommitLog segment
CQ_BLOCK_ENTRIES = 4096            # ConsumeQueue entries per RocksDB value at most (x 20 B = 80 KiB)
INDEX_SLOTS = 65_536               # key index file: 256 KiB of slots ...
INDEX_ENTRIES = 262_144            # ... and 5 MiB of 20-byte entries (4 entries per slot, as before)

log = logging.getLogger("lmqtt.store")


@dataclass
class StoreConfig:
    """Configuration of a `MessageStore`.

    Defaults follow RocketMQ's message store: async flush every 500 ms or when >= 4 pages are
    dirty, a thorough flush every 10 s, buffer commit every 200 ms. Tests shrink segment sizes.

    The segment size is a property of the data dir, fixed when it is created: opening a data dir
    that already holds CommitLog segments keeps their size (`segment_size` is set from the files,
    logged when it differs from what was asked), so changing a default or `--segment-mb` never
    makes an existing data dir unreadable.
    """

    data_dir: str
    segment_size: int = SEGMENT_SIZE
    flush_mode: str = "async"
    max_message_size: int = 4 << 20
    max_topic_bytes: int = 4096
    # async flush (RocketMQ's flushIntervalCommitLog / flushCommitLogLeastPages /
    # flushCommitLogThoroughInterval)
    flush_interval_ms: int = 500
    flush_least_pages: int = 4
    flush_thorough_interval_ms: int = 10_000
    # async+buffer: commit the in-memory write buffer to the mapped file this often, or when it
    # holds more than commit_buffer_max bytes (then the appender commits inline: back-pressure).
    commit_interval_ms: int = 200
    commit_buffer_max: int = 64 << 20
    # sync: after an fsync round, wait up to this long for as many writers as the last round served
    # before the next fsync (they are usually re-appending at that moment); 0 disables
    group_commit_gather_ms: float = 2.0
    # dispatch
    dispatch_chunk_bytes: int = 4 << 20
    # records handed to the dispatchers per delivery (visibility moves after each): bounds lag
    dispatch_max_batch: int = 2048
    # live hand-off: the appender also builds each record's DispatchRequest (it has every field in
    # hand) and queues it; the dispatch thread delivers those instead of re-parsing the CommitLog
    # while it is caught up. Replay after a restart, and any time the queue overflows
    # (dispatch_memory_max_records), reads the CommitLog. False = always read the CommitLog.
    dispatch_from_memory: bool = True
    dispatch_memory_max_records: int = 131_072
    # flow control: when committed-but-not-dispatched data exceeds this, an append waits (at most
    # dispatch_backpressure_max_wait_ms) for dispatch to catch up, so producers cannot outrun the
    # indexes and visibility lag stays bounded. Both threads share one GIL; without this the
    # appender wins and the backlog grows without limit. 0 disables.
    dispatch_backpressure_bytes: int = 512 << 10
    dispatch_backpressure_max_wait_ms: int = 100
    dispatcher_flush_interval_ms: int = 1_000
    # inline dispatch: when the dispatch thread is idle, an append dispatches what it just
    # committed on the appender's own thread (then listeners run there too). Saves the hand-off
    # to the dispatch thread, which under one GIL waits for a busy event loop to let go (up to
    # the 5 ms switch interval). Off by default: listeners may then run on the caller's thread.
    dispatch_inline: bool = False
    # ConsumeQueue (store/consume_queue.py: RocksDB): entries per stored block at most, and the
    # table files its database keeps open (part of the store's file budget, store/file_budget.py)
    cq_block_entries: int = CQ_BLOCK_ENTRIES
    # the store's share of the process's open files (store/file_budget.py: RocksDB table files,
    # mapped CommitLog segments); 0 = the default share of the process limit
    max_open_files: int = 0
    # key index (IndexFile): slots and entries per file of a new file (RocketMQ: 5M slots, 20M
    # entries); an existing file keeps the geometry in its header
    index_slots: int = INDEX_SLOTS
    index_entries: int = INDEX_ENTRIES
    # retention: whole segments older than this are deleted once every dispatcher is past them
    retention_ms: int = 72 * 3600 * 1000
    retention_check_interval_ms: int = 10_000
    # refuse appends while the filesystem holding data_dir is used above this fraction
    disk_high_water: float = 0.95
    disk_check_interval_ms: int = 1_000
    preallocate: bool = True
    # keep this many bytes after the CommitLog write position mapped writable from a helper thread
    # (madvise MADV_POPULATE_WRITE, GIL released), so the appender does not take the first-write
    # page fault of every page itself (~10 % of a 100-byte append). Linux >= 5.14; 0 disables.
    # See store/prefault.py.
    prefault_bytes: int = 2 << 20
    # delayed messages (store/delayed.py, store/timer.py; on once `MessageStore.enable_delayed` is
    # called): the timer wheel's tick (10 ms .. 60 s; a message fires at most one tick plus a 50 ms
    # scan after its due time) and the longest delay accepted
    timer_precision_ms: int = 1000
    timer_max_delay_ms: int = 40 * 24 * 3600 * 1000

    def __post_init__(self) -> None:
        self._keep_existing_sizes()
        if self.flush_mode not in FLUSH_MODES:
            raise ValueError(f"flush_mode must be one of {FLUSH_MODES}, got {self.flush_mode!r}")
        if self.segment_size < 4096 or self.segment_size % 4096:
            raise ValueError(f"segment_size must be a multiple of 4096 (>= 4096), got {self.segment_size}")
        if self.max_message_size + 16 > self.segment_size:
            kept = " (the size of the data dir's segments)" if self._kept_segment else ""
            raise ValueError(
                f"max_message_size ({self.max_message_size}) must be smaller than segment_size "
                f"({self.segment_size}{kept}) so that any record fits in one segment")
        if self.segment_size >= 1 << 62:
            raise ValueError("segment_size too large")
        if not 0.0 < self.disk_high_water <= 1.0:
            raise ValueError("disk_high_water must be in (0, 1]")
        if self.cq_block_entries <= 0 or self.index_slots <= 0 or self.index_entries <= 0:
            raise ValueError("cq_block_entries, index_slots and index_entries must be positive")

    def _keep_existing_sizes(self) -> None:
        """An existing data dir keeps the file sizes it was created with (see the class docstring)."""
        seg = _existing_file_size(os.path.join(self.data_dir, "commitlog"), 4096)
        self._kept_segment = seg is not None and seg != self.segment_size
        if self._kept_segment:
            log.info("event=segment_size_kept data_dir=%s segment_size=%d asked=%d reason=\"the data dir's "
                     "CommitLog segments have this size\"", self.data_dir, seg, self.segment_size)
            self.segment_size = seg


def _existing_file_size(directory: str, unit: int) -> int | None:
    """The file size of a MappedFileQueue directory that holds files (None: no usable file).

    Files are named by their start offset, so two names give the size exactly; a single file gives
    it by its length (all files are created at full size; an empty or odd-sized one, as a crash
    inside the file's creation could leave, tells nothing)."""
    try:
        names = sorted(n for n in os.listdir(directory) if len(n) == 20 and n.isdigit())
    except OSError:
        return None
    if len(names) >= 2:
        size = int(names[1]) - int(names[0])
        return size if size > 0 and size % unit == 0 else None
    if not names:
        return None
    try:
        size = os.path.getsize(os.path.join(directory, names[0]))
    except OSError:
        return None
    if size <= 0 or size % unit or int(names[0]) % size:
        return None
    return size


def min_segment_mb(max_message_size: int = StoreConfig.max_message_size) -> int:
    """The smallest CommitLog segment, in MiB, that holds the largest record (a record never spans two
    segments; `StoreConfig` refuses a smaller one): what `--segment-mb` is checked against before a
    process touches its data dir."""
    return ((max_message_size + 16 - 1) >> 20) + 1
