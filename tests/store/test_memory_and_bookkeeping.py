"""What keeps a long-running store's memory and disk level: freed heap pages go back to the
kernel (store/heap.py), and RocksDB's own LOG and MANIFEST stay bounded although the ConsumeQueue
and the light-queue index flush a memtable at every checkpoint (store/rocksdb_options.py)."""
from __future__ import annotations

import os

import pytest
from rocksdict import Rdict, WriteOptions

from lmqtt.store import heap
from lmqtt.store.rocksdb_options import (BLOCK_CACHE_BYTES, LOG_FILE_BYTES, LOG_FILES_KEPT, MANIFEST_BYTES, MEMTABLE_BYTES, TABLE_FILE_BYTES,
                                         rocksdb_options)


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")


def _flushed_per_checkpoint(path: str) -> tuple[Rdict, WriteOptions]:
    """A database written as the ConsumeQueue and the light-queue index write theirs: no
    write-ahead log, a memtable flush at every checkpoint."""
    wo = WriteOptions()
    wo.disable_wal = True
    return Rdict(path, rocksdb_options(64)), wo

@pytest.mark.skipif(not heap.tune(), reason="the C library is not glibc")
def test_trim_returns_freed_heap_pages_that_a_live_block_above_them_pins():
    # 1 KiB blocks come from malloc's heap, not from mappings of their own; the last one, kept
    # alive, sits above the rest, so freeing them cannot shrink the heap from the top
    blocks = [bytes(1024) + bytes([i % 251]) for i in range(150_000)]
    pin = blocks[-1]
    del blocks[-1]
    before = _rss_anon_kib()
    blocks.clear()
    freed = _rss_anon_kib()
    heap.trim()
    after = _rss_anon_kib()
    assert pin[-1] == (149_999 % 251)
    assert freed - after > 100_000, (before, freed, after)   # most of the ~150 MiB went back


def test_rocksdb_log_and_manifest_stay_bounded_with_a_flush_per_checkpoint(tmp_path):
    path = str(tmp_path / "db")
    db, wo = _flushed_per_checkpoint(path)
    try:
        for i in range(2_500):          # a checkpoint a second: ~40 minutes of a busy store
            db.put(b"Q%08d" % (i % 97), os.urandom(64), wo)
            db.flush(True)
    finally:
        db.close()
    names = os.listdir(path)
    logs = [n for n in names if n == "LOG" or n.startswith("LOG.old")]
    manifests = [n for n in names if n.startswith("MANIFEST-")]
    assert len(logs) <= LOG_FILES_KEPT + 1, logs
    assert len(manifests) == 1, manifests
    sizes = {n: os.path.getsize(os.path.join(path, n)) for n in logs + manifests}
    assert all(sizes[n] <= LOG_FILE_BYTES + 64 * 1024 for n in logs), sizes
    assert sizes[manifests[0]] <= MANIFEST_BYTES + 64 * 1024, sizes
    assert sum(os.path.getsize(os.path.join(path, n)) for n in logs) > LOG_FILE_BYTES, sizes  # it did roll


def test_compaction_writes_small_tables(tmp_path):
    """A compaction holds one output table's filter and index in memory: the tables stay small."""
    path = str(tmp_path / "db")
    db, wo = _flushed_per_checkpoint(path)
    try:
        for sec in range(40):                       # ~20 MiB over 2,000 queues, a flush a "second"
            for q in range(2_000):
                db.put(b"R" + q.to_bytes(4, "big") + sec.to_bytes(8, "big"), os.urandom(200), wo)
            db.flush(True)
        db.compact_range(None, None)
    finally:
        db.close()
    tables = [os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".sst")]
    assert sum(tables) > 4 * TABLE_FILE_BYTES, tables
    assert max(tables) <= TABLE_FILE_BYTES * 5 // 4, tables


def test_a_database_never_flushed_by_lmqtt_keeps_a_small_memtable_and_log(tmp_path):
    """The metadata databases are written with their log and flushed only by RocksDB: rewriting
    the same records (sessions of reconnecting devices) must not gather in memory and on disk."""
    path = str(tmp_path / "db")
    db = Rdict(path, rocksdb_options(64))
    try:
        for i in range(60_000):                      # ~24 MiB of rewrites of 2,000 records
            db.put(b"S%06d" % (i % 2_000), os.urandom(400))
        mem = db.property_int_value("rocksdb.cur-size-all-mem-tables")
        logs = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".log"))
    finally:
        db.close()
    assert mem <= 2 * MEMTABLE_BYTES, mem
    assert logs <= 3 * MEMTABLE_BYTES, logs


def test_every_database_shares_one_small_block_cache_that_reads_cannot_grow_past(tmp_path):
    """The ConsumeQueue database, the light-queue index and metadata and the SDK's metadata share
    one block cache of BLOCK_CACHE_BYTES: RocksDB's own default is a 32 MiB cache per database,
    which reads filled a few MiB an hour in the soak and never gave back."""
    from lmqtt.lightqueue import LightQueueIndex
    from lmqtt.lightqueue.metadata import MetadataStore
    from lmqtt.store.consume_queue import ConsumeQueueStore
    from lmqtt.store.sdk_meta import SdkMetadata

    cqs = ConsumeQueueStore(str(tmp_path / "cq"))
    cqs.load()
    idx = LightQueueIndex(str(tmp_path / "ix"))
    meta = MetadataStore(str(tmp_path / "meta"))
    sdk = SdkMetadata(str(tmp_path / "sdk"))
    dbs = [cqs._db, idx.db, meta._db, sdk._db]
    try:
        for db in dbs:
            assert db.property_int_value("rocksdb.block-cache-capacity") == BLOCK_CACHE_BYTES
        # ~48 MiB of tables read back whole: the cache stays at its capacity, shared by all
        db = meta._db
        for i in range(12_000):
            db.put(b"R%06d" % i, os.urandom(4000))
        db.flush(True)
        for _ in range(2):
            for i in range(0, 12_000, 3):
                assert db.get(b"R%06d" % i) is not None
        usage = [d.property_int_value("rocksdb.block-cache-usage") for d in dbs]
        assert len(set(usage)) == 1 and usage[0] <= BLOCK_CACHE_BYTES * 1.1, usage
    finally:
        cqs.close()
        idx.close()
        meta.close()
        sdk.close()


_ARENAS_SCRIPT = r"""
import ctypes, os, sys, tempfile, threading
from lmqtt.store import heap
if sys.argv[1] == "tuned":
    assert heap.tune()

def churn():
    # blocks of 100 KB (below both mmap thresholds: from a heap), made and freed in a loop
    for _ in range(2_000):
        blocks = [bytearray(100_000) for _ in range(8)]
        del blocks

threads = [threading.Thread(target=churn) for _ in range(6)]
for t in threads:
    t.start()
for t in threads:
    t.join()
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
path = os.path.join(tempfile.mkdtemp(), "malloc_info.xml")
f = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, f)
libc.fclose(f)
print(open(path).read().count("<heap nr="))
"""


@pytest.mark.skipif(not heap.tune(), reason="the C library is not glibc")
@pytest.mark.parametrize("mode", ["tuned", "default"])
def test_threads_that_allocate_at_once_share_one_malloc_arena(mode, tmp_path):
    """A thread's own arena keeps what it frees from every other thread: the store's processes
    keep one (store/heap.py). Without the setting the same threads make several, which shows the
    measure can see them."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _ARENAS_SCRIPT, mode], capture_output=True, text=True, timeout=120, check=True)
    heaps = int(out.stdout.strip())
    if mode == "tuned":
        assert heaps == 1, out.stdout
    else:
        assert heaps > 1, out.stdout
