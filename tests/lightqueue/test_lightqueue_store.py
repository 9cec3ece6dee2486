"""LightQueueStore over a real MessageStore: write once, readable from every matching queue."""
from __future__ import annotations

import random
import threading
import time

import pytest

from lmqtt.lightqueue import InvalidTopicName, LightQueueStore
from lmqtt.store import Message, MessageStore, StoreConfig
from tests.lightqueue.pairs import open_pair, publish


def test_one_publish_three_filters_four_queues_one_record(pair):
    st, lq = pair
    for f in ("sensors/+/temp", "sensors/#", "+/+/temp", "other/#"):
        lq.register_filter(f)
    before = st.max_offset
    r = publish(st, lq, "sensors/s1/temp", b"21.5")
    assert st.max_offset - before == r.size          # the CommitLog grew by exactly one record
    queues = ["sensors/s1/temp", "sensors/+/temp", "sensors/#", "+/+/temp"]
    assert sorted(lq.queues_for_topic("sensors/s1/temp")) == sorted(queues)
    for q in queues:
        res = lq.pull(q, 0)
        assert [(m.body, m.phys_offset, m.queue_offset) for m in res.messages] == [(b"21.5", r.phys_offset, 0)]
        assert (res.next_offset, res.min_offset, res.max_offset) == (1, 0, 1)
    assert lq.pull("other/#", 0).messages == []


def test_offsets_contiguous_per_queue_and_pull_limits(pair):
    st, lq = pair
    lq.register_filter("d/+")
    rnd = random.Random(1)
    sent: dict[str, list[bytes]] = {"d/+": []}
    for i in range(300):
        t = f"d/{rnd.randrange(5)}"
        body = f"m{i}".encode()
        st.append(Message(topic=t, body=body, dispatch_queues=lq.queues_for_topic(t)))
        sent.setdefault(t, []).append(body)
        sent["d/+"].append(body)
    assert st.wait_dispatched(st.max_offset, 10)
    for q, bodies in sent.items():
        got, off = [], 0
        while True:
            res = lq.pull(q, off, max_count=7)
            if not res.messages:
                break
            assert [m.queue_offset for m in res.messages] == list(range(off, off + len(res.messages)))
            got += [m.body for m in res.messages]
            off = res.next_offset
        assert got == bodies and lq.max_offset(q) == len(bodies)
    # byte limit: each record is ~90 bytes; 200 bytes allows 2, a tiny limit still returns one
    assert len(lq.pull("d/+", 0, max_count=100, max_bytes=200).messages) == 2
    assert len(lq.pull("d/+", 0, max_count=100, max_bytes=1).messages) == 1


def test_pull_raw_is_pull_as_record_bytes(pair):
    """`pull_raw` (what the store pushes to gateways as PUSH_RAW) gives the same entries as `pull`:
    decoded, the same messages and light-queue offsets, in runs of records adjacent in the log,
    within the same count and byte limits; nothing visible yet -> empty; an unknown queue too."""
    from lmqtt.gateway.storage.remote_entries import decode_raw_entries
    from lmqtt.store import protocol as W

    st, lq = pair
    lq.register_filter("r/+")
    for i in range(200):
        t = f"r/{i % 3}"
        st.append(Message(topic=t, body=b"m%d" % i, dispatch_queues=lq.queues_for_topic(t)))
    assert st.wait_dispatched(st.max_offset, 10)

    def same_as_pull(q, off, count, nbytes):
        first, runs, sizes = lq.pull_raw(q, off, count, nbytes)
        want = lq.pull(q, off, max_count=count, max_bytes=nbytes).messages
        body = b"".join(W.encode_push_raw([(q, 0, first, runs, sizes)]))
        [(_q, _mx, f, spans, sz)] = W.decode_push_raw(body)
        got = decode_raw_entries(memoryview(body), spans, sz, f, st.ident)
        assert first == off and [tuple(m) for m in got] == [tuple(m) for m in want]

    for q in ("r/+", "r/1"):
        for off, count, nbytes in ((0, 7, 1 << 20), (5, 100, 1 << 20), (0, 100, 200), (0, 100, 1), (3, 9, 0)):
            same_as_pull(q, off, count, nbytes)
        assert len(lq.pull_raw(q, 0, 100, 1 << 20)[1]) == (1 if q == "r/+" else 67)   # runs: adjacent records
    assert lq.pull_raw("r/+", 200, 10, 1 << 20) == (200, [], ())
    assert lq.pull_raw("no/such", 0, 10, 1 << 20) == (0, [], ())
    # the older entries written to RocksDB and let go from memory: those are read from RocksDB (and
    # on into what memory holds), the newer ones from memory, the same either way
    lq.index.tail_entries = 16
    lq.index.flush()
    for i in range(200, 260):
        t = f"r/{i % 3}"
        st.append(Message(topic=t, body=b"m%d" % i, dispatch_queues=lq.queues_for_topic(t)))
    assert st.wait_dispatched(st.max_offset, 10)
    assert lq.index.tail_piece("r/+", 0, 10) is None and lq.index.tail_piece("r/+", 250, 10) is not None
    for off, count, nbytes in ((0, 300, 1 << 20), (150, 100, 1 << 20), (230, 50, 1 << 20), (245, 20, 300)):
        same_as_pull("r/+", off, count, nbytes)


def test_unknown_queue_reads_empty_and_bad_topic_is_rejected(pair):
    st, lq = pair
    res = lq.pull("no/such/queue", 5)
    assert res.messages == [] and (res.min_offset, res.max_offset) == (0, 0)
    assert lq.max_offset("no/such/queue") == 0
    with pytest.raises(InvalidTopicName) as ei:
        lq.queues_for_topic("a/+")
    assert ei.value.reason_code == 0x90


def test_shared_cache_many_readers_one_store_read(pair):
    st, lq = pair
    lq.register_filter("bcast/#")
    for i in range(20):
        publish(st, lq, f"bcast/{i % 3}", b"x" * 100)
    lq.cache.clear()
    misses0 = lq.cache.misses
    results = []

    def reader():
        results.append([m.body for m in lq.pull("bcast/#", 0, max_count=100).messages])

    threads = [threading.Thread(target=reader) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(len(r) == 20 for r in results)
    assert lq.cache.misses - misses0 == 20        # 50 readers x 20 messages = 20 store reads
    # a reader of the exact-topic queue shares the same cached records
    lq.pull("bcast/1", 0, max_count=100)
    assert lq.cache.misses - misses0 == 20
    # each reader got its own queue offset, the payload object is shared (never copied)
    a = lq.pull("bcast/#", 1).messages[0]
    b = lq.pull("bcast/1", 0).messages[0]
    assert (a.queue_offset, b.queue_offset) == (1, 0) and a.body is b.body


def test_listener_and_wait_for_data(pair):
    st, lq = pair
    lq.register_filter("w/+")
    seen: list[set] = []
    lq.add_listener(seen.append)
    lq.add_listener(lambda qs: 1 / 0)           # a broken listener does not stop dispatch
    woke = []
    t = threading.Thread(target=lambda: woke.append(lq.wait_for_data("w/+", 0, 10)))
    t.start()
    publish(st, lq, "w/1", b"a")
    t.join(15)
    assert woke == [True]
    assert {"w/1", "w/+"} <= set().union(*seen)
    publish(st, lq, "w/2", b"b")
    assert any("w/2" in s for s in seen)
    assert lq.wait_for_data("w/+", 5, 0.05) is False


def test_everything_survives_restart(tmp_path):
    st, lq = open_pair(tmp_path)
    lq.register_filter("r/+")
    st.start()
    for i in range(10):
        publish(st, lq, f"r/{i % 2}", f"{i}".encode())
    lq.metadata.set_offsets("c", {"r/+": 4})
    st.shutdown()
    lq.close()

    st, lq = open_pair(tmp_path)
    st.start()
    try:
        assert lq.queues_for_topic("r/9") == ("r/9", "r/+")    # filter registry reloaded
        assert lq.max_offset("r/+") == 10 and lq.max_offset("r/0") == 5
        assert lq.metadata.get_offset("c", "r/+") == 4
        publish(st, lq, "r/0", b"new")
        res = lq.pull("r/+", 4, max_count=100)
        assert [m.body for m in res.messages] == [b"4", b"5", b"6", b"7", b"8", b"9", b"new"]
        assert [m.queue_offset for m in res.messages] == list(range(4, 11))
    finally:
        st.shutdown()
        lq.close()


def _until(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_wildcard_queue_let_go_by_its_last_holder_is_dropped_once_its_linger_ends(pair):
    st, lq = pair
    lq.filter_linger_s = 0.3
    assert lq.register_filter("u/+") == 1
    assert lq.register_filter("u/+") == 2
    publish(st, lq, "u/1", b"a")
    assert lq.unregister_filter("u/+") == 1
    assert lq.max_offset("u/+") == 1 and lq.pull("u/+", 0).messages   # still in use
    assert lq.unregister_filter("u/+") == 0
    assert lq.lingering() == ["u/+"]
    publish(st, lq, "u/2", b"b")                                        # still indexed meanwhile
    assert [m.body for m in lq.pull("u/+", 0).messages] == [b"a", b"b"]
    _until(lambda: not lq.lingering())
    assert lq.queues_for_topic("u/1") == ("u/1",)
    assert lq.pull("u/+", 0).messages == []
    assert lq.min_offset("u/+") == lq.max_offset("u/+") == 2           # numbering never restarts
    assert [m.body for m in lq.pull("u/1", 0).messages] == [b"a"]       # the topic queue is untouched
    assert lq.register_filter("u/+") == 1                               # back: from where it ended
    publish(st, lq, "u/3", b"c")
    assert [(m.queue_offset, m.body) for m in lq.pull("u/+", 0).messages] == [(2, b"c")]


def test_a_wildcard_filter_taken_back_while_it_lingers_keeps_its_queue_and_its_epoch(pair):
    # one holder lets go just before another registers (gateways starting together, each
    # reconciling its own holds): the entries of messages still in flight must stay readable
    st, lq = pair
    lq.filter_linger_s = 60
    assert lq.register_filter("w/#") == 1
    publish(st, lq, "w/1", b"a")
    epoch = lq.filter_epoch("w/#")
    assert lq.unregister_filter("w/#") == 0
    publish(st, lq, "w/2", b"b")
    assert lq.register_filter("w/#") == 1
    assert lq.lingering() == []
    assert [(m.queue_offset, m.body) for m in lq.pull("w/#", 0).messages] == [(0, b"a"), (1, b"b")]
    assert lq.filter_epoch("w/#") == epoch == lq.metadata.get_filter_epoch("w/#")
    assert lq.unregister_filter("w/#") == 0                             # and many at once
    lq.register_filters(["w/#", "w/#"])
    assert lq.registry.refcount("w/#") == 2 and lq.lingering() == []
    assert lq.metadata.get_filter_epoch("w/#") == epoch


def test_a_wildcard_filter_let_go_with_no_linger_is_dropped_at_once(pair):
    st, lq = pair                             # the default: one process holds every filter
    assert lq.register_filter("z/+") == 1
    publish(st, lq, "z/1", b"a")
    assert lq.unregister_filter("z/+") == 0
    assert lq.lingering() == [] and lq.queues_for_topic("z/1") == ("z/1",)
    assert lq.min_offset("z/+") == lq.max_offset("z/+") == 1


@pytest.mark.slow
def test_twenty_thousand_distinct_queues(tmp_path):
    """The CI-sized version of the million-queue scale run (lmqtt bench lightqueue --scale)."""
    st, lq = open_pair(tmp_path)
    st.start()
    try:
        n = 20_000
        for s in range(0, n, 1000):
            st.append_batch([Message(topic=f"dev/{i}", body=b"v%d" % i, dispatch_queues=(f"dev/{i}",))
                             for i in range(s, s + 1000)])
        assert st.wait_dispatched(st.max_offset, 30)
        assert lq.index.queue_count() == n
        for i in random.Random(3).sample(range(n), 300):
            res = lq.pull(f"dev/{i}", 0)
            assert [m.body for m in res.messages] == [b"v%d" % i] and res.max_offset == 1
    finally:
        st.shutdown()
        lq.close()


def test_retention_moves_min_offset_and_old_entries_read_as_gone(tmp_path):
    st = MessageStore(StoreConfig(data_dir=str(tmp_path / "store"), segment_size=1 << 16,
                                  max_message_size=4096, preallocate=False, retention_ms=1,
                                  dispatcher_flush_interval_ms=20))
    lq = LightQueueStore(st, str(tmp_path / "lq"))
    lq.register_filter("ret/+")
    st.start()
    try:
        for i in range(2000):                    # ~200 KB: several 64 KiB segments
            st.append(Message(topic=f"ret/{i % 2}", body=b"%06d" % i,
                              dispatch_queues=lq.queues_for_topic(f"ret/{i % 2}")))
        assert st.wait_dispatched(st.max_offset, 10)
        assert lq.pull("ret/+", 0).messages[0].body == b"000000"
        deleted = 0
        deadline = time.monotonic() + 10   # until every dispatcher's periodic flush passed the segments
        while deleted < 2 and time.monotonic() < deadline:
            deleted += st.delete_expired_segments(now_ms=2**62)
            time.sleep(0.05)
        assert deleted >= 2
        lq.index.retention.join(10)
        lo = lq.min_offset("ret/+")
        assert 0 < lo < 2000 and lq.max_offset("ret/+") == 2000
        res = lq.pull("ret/+", 0, max_count=5)    # below min: clamped, not an error
        assert [m.queue_offset for m in res.messages] == list(range(lo, lo + 5))
        assert res.messages[0].body == b"%06d" % lo
        assert all(m.phys_offset >= st.min_offset for m in res.messages)
        assert lq.index.min_phys == st.min_offset
        lo1 = lq.min_offset("ret/1")
        first = lq.pull("ret/1", 0, max_count=1).messages[0]
        assert first.queue_offset == lo1 > 0 and first.phys_offset >= st.min_offset
        below = lq.index.read("ret/1", lo1 - 1, 1)[0]   # swept, or still indexed but dead
        assert below.queue_offset == lo1 or below.phys_offset < st.min_offset
    finally:
        st.shutdown()
        lq.close()


def test_register_filters_bulk_and_metadata_errors_are_clear(pair):
    from lmqtt.lightqueue import MetadataError
    st, lq = pair
    lq.register_filters(["b/+", "b/#", "b/+"])
    assert lq.registry.refcount("b/+") == 2
    assert sorted(lq.queues_for_topic("b/1")) == ["b/#", "b/+", "b/1"]
    md = lq.metadata
    md.close()
    with pytest.raises(MetadataError, match="closed"):
        md.set_offsets("c", {"q": 1})


@pytest.mark.parametrize("bad", ["a/#/b", "a+", "", "a/b#", "+x"])
def test_invalid_filter_registration_rejected_and_nothing_persisted(pair, bad):
    from lmqtt.lightqueue import InvalidTopicFilter
    st, lq = pair
    lq.register_filter("ok/+")
    with pytest.raises(InvalidTopicFilter) as ei:
        lq.register_filter(bad)
    assert ei.value.reason_code == 0x8F
    assert lq.registry.filters() == {"ok/+": 1}
    assert lq.metadata.filters() == {"ok/+": 1}


def test_second_open_of_same_directory_fails_clearly(tmp_path):
    from lmqtt.lightqueue import LightQueueError
    st, lq = open_pair(tmp_path)
    st2 = MessageStore(StoreConfig(data_dir=str(tmp_path / "store2"), preallocate=False))
    try:
        with pytest.raises(LightQueueError, match="cannot open"):
            LightQueueStore(st2, str(tmp_path / "lq"))
        # the first instance is unaffected
        st.start()
        publish(st, lq, "still/works", b"1")
        assert lq.pull("still/works", 0).messages[0].body == b"1"
    finally:
        st.shutdown()
        lq.close()
        st2.shutdown()


def test_pulls_read_fresh_records_without_the_store_keeping_copies_of_them(pair):
    """A pull decodes its cache misses from the CommitLog in runs (`read_many`), so a reader at
    the head needs no copy of each appended record in memory: keeping them cost the appender
    ~0.5 us per record and a steady broker ~24 MiB, for reads that never looked there."""
    st, lq = pair
    publish(st, lq, "kr/1", b"a")
    assert [m.body for m in lq.pull("kr/1", 0).messages] == [b"a"]
    r = publish(st, lq, "kr/1", b"b")
    assert [(m.body, m.phys_offset) for m in lq.pull("kr/1", 1).messages] == [(b"b", r.phys_offset)]
    assert st.clog._recent_max_records == 0 and not st.clog._recent
    assert [m.body for m in lq.pull("kr/1", 0).messages] == [b"a", b"b"]


def test_columnar_runs_and_single_records_index_alike(pair):
    """Appends of one topic (runs of records sharing every field) and of many topics take
    different dispatch paths; both give every queue exactly its records, in order."""
    st, lq = pair
    lq.register_filter("run/+")
    topics = ["run/a"] * 5 + ["run/b"] * 3 + ["run/a"] + [f"run/{i}" for i in range(4)] + ["run/b"] * 2
    st.append_batch([Message(topic=t, body=b"%d" % i, dispatch_queues=lq.queues_for_topic(t))
                     for i, t in enumerate(topics)])
    st.append_batch([Message(topic="run/a", body=b"x%d" % i, dispatch_queues=lq.queues_for_topic("run/a"))
                     for i in range(4)])
    assert st.wait_dispatched(st.max_offset, 10)
    want = {q: [] for q in ["run/+"] + sorted(set(topics))}
    for i, t in enumerate(topics):
        want[t].append(b"%d" % i)
        want["run/+"].append(b"%d" % i)
    for i in range(4):
        want["run/a"].append(b"x%d" % i)
        want["run/+"].append(b"x%d" % i)
    for q, bodies in want.items():
        res = lq.pull(q, 0, max_count=100)
        assert [m.body for m in res.messages] == bodies, q
        assert [m.queue_offset for m in res.messages] == list(range(len(bodies)))
