"""The zero-copy pull path (docs/lightqueue.md "Pull hot path"): real store, real RocksDB.

No timing assertions: these pin the behaviour the faster path must keep — shared immutable
messages, per-queue offsets, the in-memory index tail agreeing with RocksDB, single flight
without a per-message Event, and the tail's invalidation on truncate/drop.
"""
from __future__ import annotations

import threading

import pytest

from lmqtt.lightqueue import LightQueueStore
from lmqtt.lightqueue.cache import MessageCache
from lmqtt.store import Message, MessageStore, StoreConfig, StoredMessage


@pytest.fixture
def pair(tmp_path):
    st = MessageStore(StoreConfig(data_dir=str(tmp_path / "store"), segment_size=16 << 20,
                                  flush_mode="async"))
    lq = LightQueueStore(st, str(tmp_path / "lq"))
    st.start()
    yield st, lq
    st.shutdown()
    lq.close()


def publish(st, lq, topic, body, props=b""):
    r = st.append(Message(topic=topic, body=body, props=props,
                          dispatch_queues=lq.queues_for_topic(topic)))
    assert st.wait_dispatched(r.phys_offset + r.size, 10)
    return r


def test_stored_message_is_an_immutable_tuple_with_the_same_fields(pair):
    st, lq = pair
    r = publish(st, lq, "im/1", b"payload", b"props")
    m = st.read(r.phys_offset)
    assert isinstance(m, StoredMessage)
    assert (m.topic, m.body, m.props, m.phys_offset, m.size) == ("im/1", b"payload", b"props",
                                                                 r.phys_offset, r.size)
    assert m.msg_id == r.msg_id and m.dispatch_queues == ("im/1",)
    with pytest.raises(AttributeError):
        m.queue_offset = 5
    m2 = m.with_queue_offset(7)
    assert m2.queue_offset == 7 and m.queue_offset != 7
    assert m2.body is m.body and m2.topic is m.topic and m2.msg_id == m.msg_id
    assert m.with_queue_offset(m.queue_offset) is m


def test_pull_shares_cached_messages_and_sets_each_queues_offset(pair):
    st, lq = pair
    lq.register_filter("sh/+")
    for i in range(5):
        publish(st, lq, f"sh/{i % 2}", b"%d" % i)
    exact = lq.pull("sh/1", 0, max_count=10).messages      # records 1, 3
    wild = lq.pull("sh/+", 0, max_count=10).messages       # records 0..4
    assert [m.body for m in exact] == [b"1", b"3"] and [m.queue_offset for m in exact] == [0, 1]
    assert [m.body for m in wild] == [b"0", b"1", b"2", b"3", b"4"]
    assert [m.queue_offset for m in wild] == [0, 1, 2, 3, 4]
    assert wild[1].body is exact[0].body and wild[3].phys_offset == exact[1].phys_offset
    again = lq.pull("sh/+", 0, max_count=10).messages
    assert [m.queue_offset for m in again] == [0, 1, 2, 3, 4]
    assert all(a.body is b.body for a, b in zip(again, wild))


def test_tail_and_rocksdb_reads_agree(pair):
    """Entries served from the in-memory tail equal those read through RocksDB, at every
    offset and batch size, including offsets older than the tail."""
    st, lq = pair
    idx = lq.index
    old = idx.tail_entries
    idx.tail_entries = 8                       # force most offsets out of the tail
    try:
        for b in range(6):
            st.append_batch([Message(topic="t/a", body=b"%d-%d" % (b, i), dispatch_queues=("t/a",))
                             for i in range(5)])
        assert st.wait_dispatched(st.max_offset, 10)
        idx.flush()        # write the buffered entries: then only the newest 8 stay in memory
        assert idx.max_offset("t/a") == 30
        assert idx._tail[idx.qid("t/a")][0] == 22            # newest 8 entries in memory
        for off in range(0, 31):
            for n in (1, 3, 64):
                raw = idx.read_raw("t/a", off, n)
                ref = [(e.queue_offset, e.phys_offset, e.size) for e in idx.read("t/a", off, n)]
                assert raw == ref, (off, n)
        got = []
        off = 0
        while True:
            res = lq.pull("t/a", off, max_count=4)
            if not res.messages:
                break
            got += [m.body for m in res.messages]
            off = res.next_offset
        assert got == [b"%d-%d" % (b, i) for b in range(6) for i in range(5)]
    finally:
        idx.tail_entries = old


def test_tail_is_bounded_by_queue_count(pair):
    st, lq = pair
    idx = lq.index
    old = idx.tail_queues
    idx.tail_queues = 10
    try:
        st.append_batch([Message(topic=f"many/{i}", body=b"x", dispatch_queues=(f"many/{i}",))
                         for i in range(50)])
        assert st.wait_dispatched(st.max_offset, 10)
        assert len(idx._tail) <= 10
        for i in range(50):                   # evicted queues are read from RocksDB
            assert [m.body for m in lq.pull(f"many/{i}", 0).messages] == [b"x"]
    finally:
        idx.tail_queues = old


def test_dropped_queue_forgets_its_tail(pair):
    st, lq = pair
    lq.register_filter("dq/+")
    publish(st, lq, "dq/1", b"a")
    q = lq.index.qid("dq/+")
    assert q in lq.index._tail
    assert lq.unregister_filter("dq/+") == 0
    assert q not in lq.index._tail
    assert lq.pull("dq/+", 0).messages == []
    lq.register_filter("dq/+")
    publish(st, lq, "dq/2", b"b")
    res = lq.pull("dq/+", 0)
    assert [m.body for m in res.messages] == [b"b"] and res.messages[0].queue_offset == 1


def test_cache_single_flight_without_per_message_events(tmp_path):
    """Concurrent misses on the same offsets cost one load each; a failing load is not cached."""
    cache = MessageCache()
    loads = []
    gate = threading.Event()

    def load(p, size):
        gate.wait(5)
        loads.append(p)
        return ("msg", p)

    out = []
    threads = [threading.Thread(target=lambda: out.append([cache.get(p, 10, load) for p in range(20)]))
               for _ in range(8)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(10)
    assert sorted(loads) == list(range(20)) and cache.misses == 20
    assert all(r == [("msg", p) for p in range(20)] for r in out) and len(out) == 8

    def bad(p, size):
        raise OSError("gone")

    with pytest.raises(OSError):
        cache.get(100, 10, bad)
    assert cache.get_many([100]) == [None]
    got = cache.load_many([(100, 10), (101, 10)], lambda p, s: ("ok", p) if p == 101 else bad(p, s))
    assert isinstance(got[0], OSError) and got[1] == ("ok", 101)


def test_cache_evicts_by_bytes_and_items():
    cache = MessageCache(max_bytes=100, max_items=5)
    for p in range(10):
        cache.get(p, 30, lambda p, s: p)
    assert len(cache) == 3 and cache._bytes == 90
    assert cache.get_many([9, 8, 7, 0]) == [9, 8, 7, None]
    cache2 = MessageCache(max_bytes=1 << 20, max_items=5)
    cache2.load_many([(p, 1) for p in range(10)], lambda p, s: p)
    assert len(cache2) == 5 and cache2.get_many([5, 9, 4]) == [5, 9, None]


def test_cache_batch_load_is_the_per_item_load():
    """load_many with a batch loader (MessageStore.read_many) loads only the misses, in one call,
    caches what loaded and hands back the exceptions in place, exactly as the per-item loader."""
    calls = []

    def one(p, size):
        if p % 5 == 0:
            raise OSError(f"gone {p}")
        return ("m", p, size)

    def batch(wanted):
        calls.append(list(wanted))
        out = []
        for p, size in wanted:
            try:
                out.append(one(p, size))
            except OSError as e:
                out.append(e)
        return out

    wanted = [(p, 10 + p) for p in range(1, 30)]
    a, b = MessageCache(), MessageCache()
    for c in (a, b):
        c.load_many([(3, 13), (7, 17)], one)       # already cached: not loaded again
    got_a = a.load_many(wanted, one)
    got_b = b.load_many(wanted, one, batch)
    assert calls == [[w for w in wanted if w[0] not in (3, 7)]]
    norm = [str(x) if isinstance(x, OSError) else x for x in got_a]
    assert norm == [str(x) if isinstance(x, OSError) else x for x in got_b]
    assert a.get_many(range(30)) == b.get_many(range(30))
    assert b.get_many([5, 6]) == [None, ("m", 6, 16)]


def _scan(cache, start: int, n: int, batch: int = 64) -> list:
    """One reader reading records [start, start + n) once, `batch` per pull, as LightQueueStore.pull
    does (hits first, then the misses loaded in one call)."""
    out = []
    for lo in range(start, start + n, batch):
        offs = list(range(lo, min(lo + batch, start + n)))
        got = cache.get_many(offs)
        miss = [(p, 10) for p, m in zip(offs, got) if m is None]
        loaded = iter(cache.load_many(miss, None, lambda w: [("m", p) for p, _ in w]))
        out += [m if m is not None else next(loaded) for m in got]
    return out


def test_cache_stops_caching_a_scan_nobody_reads_again_and_keeps_what_readers_share():
    """A reader far behind that nobody follows reads each record once: after one window the cache
    caches only a sample of its loads, and the entries other readers share stay cached."""
    from lmqtt.lightqueue.cache import ADMIT_WINDOW, SCAN_SAMPLE
    cache = MessageCache(max_bytes=1 << 30, max_items=50_000)
    hot = list(range(10_000_000, 10_001_000))
    assert _scan(cache, hot[0], len(hot)) == [("m", p) for p in hot]
    n = 4 * ADMIT_WINDOW
    got = _scan(cache, 0, n)
    assert got == [("m", p) for p in range(n)]          # served in full, in order, cached or not
    assert not cache.admitting
    # the first window was cached whole, then one batch in SCAN_SAMPLE: the hot entries survive
    assert len(cache) < len(hot) + ADMIT_WINDOW + n // SCAN_SAMPLE + 64
    assert None not in cache.get_many(hot)
    assert cache.misses == len(hot) + n


def test_cache_caches_every_load_again_once_readers_share_records():
    """After a scan turned full caching off, readers following one another over the same records
    (a broadcast topic's subscribers catching up) hit the sampled batches, and the next judgement
    caches every load again: the followers then read from the cache, not the store."""
    from lmqtt.lightqueue.cache import ADMIT_WINDOW
    cache = MessageCache(max_bytes=1 << 30, max_items=1_000_000)
    _scan(cache, 0, 2 * ADMIT_WINDOW)
    assert not cache.admitting
    base = 10 * ADMIT_WINDOW
    for step in range(0, 2 * ADMIT_WINDOW, 1024):     # 4 readers, each 1,024 records behind the one before
        for r in range(4):
            lo = base + step - r * 1024
            if lo >= base:
                assert _scan(cache, lo, 1024) == [("m", p) for p in range(lo, lo + 1024)]
    assert cache.admitting
    misses = cache.misses
    _scan(cache, base + 2 * ADMIT_WINDOW - 1024, 1024)   # the last block, cached since full admission
    assert cache.misses == misses


def test_cache_counts_a_record_named_twice_in_one_load_once():
    cache = MessageCache(max_bytes=1 << 20, max_items=100)
    cache.load_many([(7, 100), (7, 100), (8, 50)], lambda p, s: ("m", p))
    assert len(cache) == 2 and cache._bytes == 150
    cache.clear()
    assert cache._bytes == 0
