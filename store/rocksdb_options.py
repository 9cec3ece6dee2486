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
"""
from __future__ import annotations

from rocksdict import Options

LOG_FILE_BYTES = 1 << 20
LOG_FILES_KEPT = 2
MANIFEST_BYTES = 4 << 20
TABLE_FILE_BYTES = 4 << 20


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
    return opts
