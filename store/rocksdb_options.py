"""The options every RocksDB database of lmqtt opens with.

Why a module: the ConsumeQueue database and the light-queue index flush their memtable at every
checkpoint (about once a second under traffic), and RocksDB writes ~10 lines of its info LOG and
a MANIFEST edit per flush. Unbounded, that was ~20 MiB an hour per database - most of a 2-hour
soak's disk growth at a fixed retention. Here the LOG rolls at 1 MiB with two old files kept and
the MANIFEST is rewritten past 4 MiB, so each database's bookkeeping stays under ~7 MiB.
"""
from __future__ import annotations

from rocksdict import Options

LOG_FILE_BYTES = 1 << 20
LOG_FILES_KEPT = 2
MANIFEST_BYTES = 4 << 20


def rocksdb_options(max_open_files: int = -1) -> Options:
    """Raw-mode options that create the database if missing; `max_open_files`: RocksDB's table
    files open at once (-1: no bound; a store passes its budget's share, store/file_budget.py)."""
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.set_max_open_files(max_open_files)
    opts.set_max_log_file_size(LOG_FILE_BYTES)
    opts.set_keep_log_file_num(LOG_FILES_KEPT)
    opts.set_max_manifest_file_size(MANIFEST_BYTES)
    return opts
