"""The options every RocksDB database of lmqtt opens with.

Why a module: the ConsumeQueue database and the light-queue index flush their memtable at every
checkpoint (about once a second under traffic), and RocksDB writes ~10 lines of its info LOG and
a MANIFEST edit per flush. Unbounded, that was ~20 MiB an hour per database - most of a 2-hour
soak's disk growth at a fixed retention. Here the LOG rolls at 1 MiB with two old files kept and
the MANIFEST is rewritten past 4 MiB, so each database's bookkeeping stays under ~7 MiB.

Compactions write tables of at most 4 MiB (RocksDB's default is 64 MiB). A small database whose
memtable is flushed every second is compacted from level 0 into its last level every few
seconds, rewriting all of it; building one big table holds its whole filter and index in memory,
a transient ~6-13 MiB on every such compaction in the soak (measured in the compaction thread's
heap). With 4 MiB tables the same compaction holds ~1-2 MiB at a time.

Every database shares one block cache of 8 MiB. Without one, RocksDB gives each database its own
32 MiB LRU cache, which reads fill slowly and never give back: under a 2-hour soak (sessions
reconnecting and reading their queues below the in-memory tails) the caches grew by a few MiB an
hour, the slow climb of the broker's anonymous memory that was left once the rest was flat. The
operating system's page cache keeps the table files anyway (file-backed memory, not the
process's own), so a small cache costs reads little.

The memtable is 2 MiB unless a database asks for more (RocksDB's default is 64 MiB). The metadata
databases (sessions, retained messages, SDK offsets) are written with a write-ahead log and never
flushed by lmqtt: with 64 MiB, every session record a reconnecting device rewrites stayed in memory
and in the log until 64 MiB of them had gathered - hours of slow growth of memory and disk in the
soak (the light-queue metadata's log grew ~6 MiB an hour) before the first flush. At 4 MiB the
soak's session rewrites still filled it in ~35 minutes, a saw of 4 MiB in the broker's memory;
at 2 MiB it flushes every ~17 minutes (a small table each time). The ConsumeQueue and the
light-queue index, flushed at every checkpoint, set their own.
"""
from __future__ import annotations

from rocksdict import BlockBasedOptions, Cache, Options

LOG_FILE_BYTES = 1 << 20
LOG_FILES_KEPT = 2
MANIFEST_BYTES = 4 << 20
TABLE_FILE_BYTES = 4 << 20
MEMTABLE_BYTES = 2 << 20
BLOCK_CACHE_BYTES = 8 << 20

_block_cache: Cache | None = None


def shared_block_cache() -> Cache:
    """The one block cache of every lmqtt database in this process."""
    global _block_cache
    if _block_cache is None:
        _block_cache = Cache(BLOCK_CACHE_BYTES)
    return _block_cache


def table_options() -> BlockBasedOptions:
    """Table options with the shared block cache (a database that sets its own table options,
    the light-queue index's bloom filters, starts from these)."""
    bbo = BlockBasedOptions()
    bbo.set_block_cache(shared_block_cache())
    return bbo


def rocksdb_options(max_open_files: int = -1) -> Options:
    """Raw-mode options that create the database if missing; `max_open_files`: RocksDB's table
    files open at once (-1: no bound; a store passes its budget's share, store/file_budget.py)."""
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.set_max_open_files(max_open_files)
    opts.set_max_log_file_size(LOG_FILE_BYTES)
    opts.set_keep_log_file_num(LOG_FILES_KEPT)
    opts.set_max_manifest_file_size(MANIFEST_BYTES)
    opts.set_target_file_size_base(TABLE_FILE_BYTES)
    opts.set_write_buffer_size(MEMTABLE_BYTES)
    opts.set_block_based_table_factory(table_options())
    return opts
