"""Inline dispatch (StoreConfig.dispatch_inline, docs/store.md "Inline dispatch"): real store,
real light-queue RocksDB index, several appending threads. No timing assertions."""
from __future__ import annotations

import threading

from lmqtt.lightqueue import LightQueueStore
from lmqtt.store import Message, MessageStore, StoreConfig


def _pair(tmp_path, **kw):
    st = MessageStore(StoreConfig(data_dir=str(tmp_path / "s"), segment_size=16 << 20,
                                  flush_mode="async", dispatch_inline=True, **kw))
    lq = LightQueueStore(st, str(tmp_path / "lq"))
    return st, lq


def test_inline_dispatch_runs_on_the_appender_and_keeps_queues_exact(tmp_path):
    st, lq = _pair(tmp_path)
    lq.register_filter("in/+")
    seen_threads: set[str] = set()
    names: list[set] = []
    lq.add_listener(lambda qs: (seen_threads.add(threading.current_thread().name), names.append(qs)))
    st.start()
    try:
        r = st.append(Message(topic="in/0", body=b"first", dispatch_queues=lq.queues_for_topic("in/0")))
        # the append itself dispatched it (the thread was idle): visible without waiting
        assert st.dispatched_offset >= r.phys_offset + r.size
        assert lq.pull("in/0", 0).messages[0].body == b"first"
        assert threading.current_thread().name in seen_threads

        def writer(w):
            for i in range(200):
                t = f"in/{w}"
                if i % 10 == 0:
                    st.append_batch([Message(topic=t, body=b"%d-%d-%d" % (w, i, j),
                                             dispatch_queues=lq.queues_for_topic(t)) for j in range(5)])
                else:
                    st.append(Message(topic=t, body=b"%d-%d" % (w, i), dispatch_queues=lq.queues_for_topic(t)))

        ts = [threading.Thread(target=writer, args=(w,)) for w in range(1, 5)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert st.wait_dispatched(st.max_offset, 10)
        for w in range(1, 5):
            res = lq.pull(f"in/{w}", 0, max_count=10_000, max_bytes=1 << 30)
            want = []
            for i in range(200):
                want += [b"%d-%d-%d" % (w, i, j) for j in range(5)] if i % 10 == 0 else [b"%d-%d" % (w, i)]
            assert [m.body for m in res.messages] == want
            assert [m.queue_offset for m in res.messages] == list(range(len(want)))
        wild = lq.pull("in/+", 0, max_count=10_000, max_bytes=1 << 30).messages
        assert len(wild) == 1 + 4 * (180 + 20 * 5)
        assert [m.queue_offset for m in wild] == list(range(len(wild)))
        phys = [m.phys_offset for m in wild]
        assert phys == sorted(phys)                       # CommitLog order, no gap, no duplicate
        assert {"in/1", "in/+"} <= set().union(*names)
    finally:
        st.shutdown()
        lq.close()


def test_a_failing_dispatcher_does_not_fail_the_inline_append(tmp_path):
    class FailsOnce:
        name = "fails-once"
        flush_thread_safe = True

        def __init__(self):
            self.failed = False
            self.seen = []

        def checkpoint(self): return 0
        def dispatch(self, batch, end):
            if not self.failed:
                self.failed = True
                raise OSError("transient")
            self.seen += [r.phys_offset for r in batch]
        def flush(self): pass
        def truncate(self, offset): pass
        def on_segments_deleted(self, m): pass
        def close(self): pass

    d = FailsOnce()
    st = MessageStore(StoreConfig(data_dir=str(tmp_path / "s"), segment_size=16 << 20,
                                  flush_mode="async", dispatch_inline=True))
    st.add_dispatcher(d)
    st.start()
    try:
        r = st.append(Message(topic="f", body=b"x"))      # the inline attempt fails: no exception here
        assert st.wait_dispatched(r.phys_offset + r.size, 10)   # the dispatch thread retried
        assert d.seen == [r.phys_offset]
        assert st.read(r.phys_offset).body == b"x"
    finally:
        st.shutdown()


def test_inline_and_thread_survive_reopen(tmp_path):
    st, lq = _pair(tmp_path)
    st.start()
    for i in range(50):
        st.append(Message(topic="re/1", body=b"%d" % i, dispatch_queues=("re/1",)))
    st.shutdown()
    lq.close()
    st, lq = _pair(tmp_path)
    st.start()
    try:
        st.append(Message(topic="re/1", body=b"50", dispatch_queues=("re/1",)))
        assert st.wait_dispatched(st.max_offset, 10)
        res = lq.pull("re/1", 0, max_count=100)
        assert [m.body for m in res.messages] == [b"%d" % i for i in range(51)]
    finally:
        st.shutdown()
        lq.close()


def test_an_append_left_undispatched_is_readable_once_dispatch_appended_runs(tmp_path):
    """The MQTT publish path appends with dispatch=False, writes its PUBACKs, then dispatches: the
    records are durable (their future done) before they are in any light queue, and in them, in
    order, right after `dispatch_appended` returns."""
    st, lq = _pair(tmp_path)
    lq.register_filter("late/+")
    heard: list = []
    lq.add_listener(heard.append)
    st.start()
    try:
        one = st.append_batch([Message(topic="late/a", body=b"a1", dispatch_queues=lq.queues_for_topic("late/a"))],
                              dispatch=False)
        two = st.append_batch([Message(topic="late/a", body=b"a%d" % i, dispatch_queues=lq.queues_for_topic("late/a"))
                               for i in (2, 3)], dispatch=False)
        assert one[-1].durable.done() and two[-1].durable.done()
        assert st.dispatched_offset < st.max_offset and lq.max_offset("late/a") == 0 and not heard
        st.dispatch_appended()
        assert st.dispatched_offset == st.max_offset
        assert [m.body for m in lq.pull("late/a", 0).messages] == [b"a1", b"a2", b"a3"]
        assert [m.body for m in lq.pull("late/+", 0).messages] == [b"a1", b"a2", b"a3"]
        assert {"late/a", "late/+"} <= set().union(*heard)
    finally:
        lq.close()
        st.shutdown()
