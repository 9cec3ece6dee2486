"""Retention's sweep over the light-queue index reads every run once: it must not fill RocksDB's
block cache. When it did, a broker's memory grew by the cache's size at the first segment
deletion (minutes or hours after start-up), which a soak's flat-memory check reads as a leak."""
import pytest
from lmqtt.lightqueue.index import LightQueueIndex
from lmqtt.lightqueue.index_reads import RUN_KEY
from lmqtt.lightqueue.take import ENTRY
from rocksdict import WriteBatch, WriteOptions


def _fill(index: LightQueueIndex, queues: int, runs: int, per_run: int) -> None:
    phys = 0
    for q in range(1, queues + 1):
        wb = WriteBatch(raw_mode=True)
        for r in range(runs):
            v = b"".join(ENTRY.pack(phys + i * 100, 100, 0) for i in range(per_run))
            wb.put(RUN_KEY.pack(q, r * per_run), v)
            phys += per_run * 100
        index.db.write(wb, WriteOptions())
    index.db.flush(True)


def _cache_bytes(index: LightQueueIndex) -> int:
    return index.db.property_int_value("rocksdb.block-cache-usage")


@pytest.fixture
def fresh_block_cache(monkeypatch):
    """Every database of a process shares one block cache (store/rocksdb_options.py): one that
    earlier tests in this process filled to its bound would show no growth for any read, so the
    index here opens with a cache of its own."""
    from lmqtt.store import rocksdb_options
    monkeypatch.setattr(rocksdb_options, "_block_cache", None)


def test_a_sweep_over_the_whole_index_leaves_the_block_cache_empty(tmp_path, fresh_block_cache):
    index = LightQueueIndex(str(tmp_path / "index"))
    try:
        _fill(index, queues=200, runs=20, per_run=64)      # ~5 MB of runs: hundreds of blocks
        before = _cache_bytes(index)
        below = list(index.runs_below(1 << 62))
        assert len(below) == 200 * 20                      # the sweep saw every run ...
        assert _cache_bytes(index) - before < 64 * 1024    # ... and cached (almost) none of them
        # a reader's lookups do fill it: the measure above would have seen a filling scan
        for q in range(1, 201):
            assert index.db.get(RUN_KEY.pack(q, 0)) is not None
        assert _cache_bytes(index) - before > 256 * 1024
    finally:
        index.close()
