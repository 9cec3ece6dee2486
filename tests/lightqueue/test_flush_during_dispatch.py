"""The dispatch thread's periodic flush of the light-queue index (a RocksDB memtable flush:
milliseconds, up to hundreds on a busy disk) does not hold up dispatch (once a second it
delayed every delivery of a 5,000 msg/s run by the flush's duration). Real store, real RocksDB
index; the flush is held open by an event so that "during the flush" is a state, not a timing.
No timing assertions: the waits only bound a failure."""
from __future__ import annotations

import threading

from lmqtt.lightqueue import LightQueueStore
from lmqtt.store import Message, MessageStore, StoreConfig


def test_appends_are_dispatched_while_the_index_flushes(tmp_path):
    st = MessageStore(StoreConfig(data_dir=str(tmp_path / "s"), segment_size=16 << 20, flush_mode="async",
                                  dispatch_inline=True, dispatcher_flush_interval_ms=50))
    lq = LightQueueStore(st, str(tmp_path / "lq"))
    lq.register_filter("t/+")
    idx = lq.index
    real_flush = idx.flush
    in_flush, release = threading.Event(), threading.Event()
    flushed_on: set[str] = set()

    def held_flush():
        flushed_on.add(threading.current_thread().name)
        if threading.current_thread().name == "lmqtt-store-dispatch" and not release.is_set():
            in_flush.set()
            release.wait(60)      # the real flush, then, is what the test holds open
        real_flush()

    idx.flush = held_flush
    st.start()
    try:
        first = st.append(Message(topic="t/a", body=b"before", dispatch_queues=lq.queues_for_topic("t/a")))
        assert st.wait_dispatched(first.phys_offset + first.size, 10)
        assert in_flush.wait(30), "the dispatch thread never flushed the index"
        # the dispatch thread is inside the index's flush now: appends are still dispatched
        r = st.append(Message(topic="t/a", body=b"during", dispatch_queues=lq.queues_for_topic("t/a")))
        batch = st.append_batch([Message(topic=f"t/{i}", body=b"d%d" % i,
                                         dispatch_queues=lq.queues_for_topic(f"t/{i}")) for i in range(20)])
        end = max(r.phys_offset + r.size, *(b.phys_offset + b.size for b in batch))
        assert st.wait_dispatched(end, 10), "dispatch waited for the index's flush"
        assert not release.is_set()
        assert [m.body for m in lq.pull("t/a", 0).messages] == [b"before", b"during"]
        assert len(lq.pull("t/+", 0, max_count=100).messages) == 22
    finally:
        release.set()
    try:
        # once released, the flush completes and covers what was dispatched meanwhile at the next one
        assert st.wait_dispatched(st.max_offset, 10)
        assert "lmqtt-store-dispatch" in flushed_on
    finally:
        st.shutdown()
        lq.close()
    # a restart replays nothing lost: every entry is back from the index and the CommitLog
    st2 = MessageStore(StoreConfig(data_dir=str(tmp_path / "s"), segment_size=16 << 20, flush_mode="async"))
    lq2 = LightQueueStore(st2, str(tmp_path / "lq"))
    lq2.register_filter("t/+")
    st2.start()
    try:
        assert st2.wait_dispatched(st2.max_offset, 10)
        assert [m.body for m in lq2.pull("t/a", 0).messages] == [b"before", b"during"]
        assert len(lq2.pull("t/+", 0, max_count=100).messages) == 22
    finally:
        st2.shutdown()
        lq2.close()
