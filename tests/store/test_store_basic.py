"""MessageStore round trips through the real files: append/read, batches, segment roll, ConsumeQueue,
message ids, the key index, visibility, listeners, reopen. Small segments so rolls happen."""
from __future__ import annotations

import asyncio
import os
import threading

import pytest

from lmqtt.store import (DispatchRequest, Message, MessageStore, NotVisible, StoreConfig, StoredMessage)


def cfg(tmp_path, **kw):
    base = dict(data_dir=str(tmp_path / "store"), segment_size=64 * 1024, max_message_size=16 * 1024,
                flush_mode="async", index_slots=128, index_entries=4096, cq_block_entries=100)
    base.update(kw)
    return StoreConfig(**base)


def visible(st, results):
    last = results[-1]
    assert st.wait_dispatched(last.phys_offset + last.size, 10)


@pytest.mark.parametrize("mode", ["sync", "async", "async+buffer"])
def test_roundtrip_every_field_in_each_flush_mode(tmp_path, mode):
    with MessageStore(cfg(tmp_path, flush_mode=mode)) as st:
        m = Message(topic="a/b/c", body=b"\x00hello\xff", queue_id=3, flags=0xDEADBEEF, props=b"\x01\x02",
                    keys=("order-1", "user-7"), born_ts=1_700_000_000_123, dispatch_queues=("a/b/c", "a/+/c"))
        r = st.append(m)
        assert r.durable.result(10) == r.phys_offset + r.size
        visible(st, [r])
        got = st.read(r.phys_offset)
        assert isinstance(got, StoredMessage)
        assert (got.topic, got.body, got.props, got.queue_id, got.flags, got.keys, got.dispatch_queues,
                got.born_ts) == ("a/b/c", b"\x00hello\xff", b"\x01\x02", 3, 0xDEADBEEF, ("order-1", "user-7"),
                                 ("a/b/c", "a/+/c"), 1_700_000_000_123)
        assert got.phys_offset == r.phys_offset and got.size == r.size and got.queue_offset == 0
        assert got.msg_id == r.msg_id and got.store_ts > 0
        assert st.read(r.phys_offset, r.size).body == m.body


def test_batch_rolls_segments_and_never_spans_two(tmp_path):
    c = cfg(tmp_path)
    with MessageStore(c) as st:
        msgs = [Message(topic=f"t/{i % 5}", body=os.urandom(200 + i % 700)) for i in range(2000)]
        rs = st.append_batch(msgs)
        visible(st, rs)
        assert len(rs) == 2000
        segs = sorted(os.listdir(os.path.join(c.data_dir, "commitlog")))
        assert len(segs) > 10
        assert all(len(s) == 20 and int(s) % c.segment_size == 0 for s in segs)
        for m, r in zip(msgs, rs):
            assert r.phys_offset // c.segment_size == (r.phys_offset + r.size - 1) // c.segment_size
            assert st.read(r.phys_offset).body == m.body
        # queue offsets are per first-level topic 't' and queue id 0: 0..1999 in order
        assert [r.queue_offset for r in rs] == list(range(2000))


def test_consume_queue_is_per_first_level_topic_and_queue_id(tmp_path):
    with MessageStore(cfg(tmp_path)) as st:
        rs = []
        for i in range(250):
            rs.append(st.append(Message(topic=f"dev/{i % 3}/temp", body=b"%d" % i, queue_id=i % 2)))
        rs.append(st.append(Message(topic="other", body=b"x")))
        visible(st, rs)
        q0 = st.read_consume_queue("dev/anything", 0, 0, 1000)
        q1 = st.read_consume_queue("dev", 1, 0, 1000)
        assert [m.body for m in q0] == [b"%d" % i for i in range(0, 250, 2)]
        assert [m.body for m in q1] == [b"%d" % i for i in range(1, 250, 2)]
        assert [m.queue_offset for m in q0] == list(range(125))
        # O(1) seek into the middle, across the 100-entry file boundary
        assert [m.body for m in st.read_consume_queue("dev", 0, 99, 3)] == [b"198", b"200", b"202"]
        assert st.consume_queue_offsets("dev", 0) == (0, 125)
        assert [m.body for m in st.read_consume_queue("other", 0, 0, 10)] == [b"x"]
        assert st.read_consume_queue("nothing", 0, 0, 10) == []


def test_msg_id_lookup_and_foreign_ids(tmp_path):
    with MessageStore(cfg(tmp_path)) as st:
        rs = st.append_batch([Message(topic="t", body=b"m%d" % i) for i in range(10)])
        visible(st, rs)
        for i, r in enumerate(rs):
            assert st.get_by_msg_id(r.msg_id).body == b"m%d" % i
        assert st.get_by_msg_id("0" * 32) is None              # another store's identity
        assert st.get_by_msg_id(rs[0].msg_id[:16] + "F" * 16) is None  # offset not in the log
        assert st.get_by_msg_id("not-an-id") is None


def test_key_index_compares_the_real_key_after_a_hash_hit(tmp_path):
    # one hash slot: every key collides, so only the real-key comparison separates them
    with MessageStore(cfg(tmp_path, index_slots=1)) as st:
        rs = []
        for i in range(50):
            rs.append(st.append(Message(topic="orders/eu", body=b"%d" % i, keys=(f"k{i % 5}",))))
        rs.append(st.append(Message(topic="orders/us", body=b"us", keys=("k1",))))
        visible(st, rs)
        got = st.query_by_key("orders/eu", "k1", 0, 2**62, 100)
        assert sorted(m.body for m in got) == sorted(b"%d" % i for i in range(1, 50, 5))
        assert [m.phys_offset for m in got] == sorted((m.phys_offset for m in got), reverse=True)  # newest first
        assert [m.body for m in st.query_by_key("orders/us", "k1", 0, 2**62, 100)] == [b"us"]
        assert st.query_by_key("orders/eu", "nope", 0, 2**62, 100) == []
        assert len(st.query_by_key("orders/eu", "k1", 0, 2**62, 3)) == 3


def test_key_index_time_range(tmp_path):
    with MessageStore(cfg(tmp_path)) as st:
        r = st.append(Message(topic="t", body=b"a", keys=("k",)))
        visible(st, [r])
        ts = st.read(r.phys_offset).store_ts
        assert len(st.query_by_key("t", "k", ts, ts, 10)) == 1
        assert st.query_by_key("t", "k", ts + 1, ts + 10_000, 10) == []
        assert st.query_by_key("t", "k", 0, ts - 1, 10) == []


def test_key_index_survives_restart_and_many_files(tmp_path):
    c = cfg(tmp_path, index_entries=64)
    with MessageStore(c) as st:
        rs = [st.append(Message(topic="t", body=b"%d" % i, keys=(f"k{i % 7}",))) for i in range(300)]
        visible(st, rs)
    assert len([n for n in os.listdir(os.path.join(c.data_dir, "index")) if n.isdigit()]) >= 5
    with MessageStore(c) as st:
        got = st.query_by_key("t", "k3", 0, 2**62, 1000)
        assert sorted(int(m.body) for m in got) == list(range(3, 300, 7))



def _gated_dispatcher(gate: threading.Event):
    """A dispatcher class that holds dispatch until `gate` is set: records stay invisible meanwhile."""
    class Slow:
        name = "slow"

        def checkpoint(self): return 0
        def dispatch(self, batch, end): gate.wait(10)
        def flush(self): pass
        def truncate(self, offset): pass
        def on_segments_deleted(self, m): pass
        def close(self): pass
    return Slow


def test_only_dispatched_offsets_are_served(tmp_path):
    gate = threading.Event()
    Slow = _gated_dispatcher(gate)

    st = MessageStore(cfg(tmp_path))
    st.add_dispatcher(Slow())
    st.start()
    try:
        r = st.append(Message(topic="t", body=b"x"))
        with pytest.raises(NotVisible):
            st.read(r.phys_offset)
        assert st.read_consume_queue("t", 0, 0, 10) == []  # CQ has it, but not every dispatcher yet
        assert st.get_by_msg_id(r.msg_id) is None
        gate.set()
        visible(st, [r])
        assert st.read(r.phys_offset).body == b"x"
        assert [m.body for m in st.read_consume_queue("t", 0, 0, 10)] == [b"x"]
    finally:
        gate.set()
        st.shutdown()


def test_dispatchers_and_listeners_see_every_record_in_order(tmp_path):
    seen: list[DispatchRequest] = []
    progress: list[int] = []

    class Rec:
        name = "rec"

        def checkpoint(self): return 0
        def dispatch(self, batch, end): seen.extend(batch)
        def flush(self): pass
        def truncate(self, offset): pass
        def on_segments_deleted(self, m): pass
        def close(self): pass

    st = MessageStore(cfg(tmp_path))
    st.add_dispatcher(Rec())
    st.add_dispatch_listener(progress.append)
    st.start()
    try:
        rs = st.append_batch([Message(topic=f"x/{i}", body=b"b" * i, keys=("k",) if i % 2 else (),
                                      dispatch_queues=(f"x/{i}", "x/#")) for i in range(500)])
        visible(st, rs)
    finally:
        st.shutdown()
    assert [d.phys_offset for d in seen] == [r.phys_offset for r in rs]
    assert [d.size for d in seen] == [r.size for r in rs]
    assert seen[3].topic == "x/3" and seen[3].dispatch_queues == ("x/3", "x/#") and seen[3].keys == ("k",)
    assert seen[4].keys == ()
    assert progress == sorted(progress) and progress[-1] >= rs[-1].phys_offset + rs[-1].size


def test_reopen_keeps_data_and_continues_queue_offsets(tmp_path):
    c = cfg(tmp_path)
    with MessageStore(c) as st:
        rs = st.append_batch([Message(topic="t/a", body=b"%d" % i) for i in range(120)])
        ident = rs[0].msg_id[:16]
    with MessageStore(c) as st:
        assert st.dispatched_offset == rs[-1].phys_offset + rs[-1].size
        assert st.read(rs[57].phys_offset).body == b"57"
        r = st.append(Message(topic="t/b", body=b"next"))
        assert r.queue_offset == 120 and r.msg_id[:16] == ident
        visible(st, [r])
        assert [m.body for m in st.read_consume_queue("t", 0, 119, 5)] == [b"119", b"next"]


def test_asyncio_wrappers(tmp_path):
    async def main():
        with MessageStore(cfg(tmp_path, flush_mode="sync")) as st:
            rs = await asyncio.gather(*[st.append_async(Message(topic="t", body=b"%d" % i)) for i in range(64)])
            assert rs[-1].durable.done() and st.flushed_offset >= max(r.phys_offset + r.size for r in rs)
            rb = await st.append_batch_async([Message(topic="t", body=b"b")] * 3)
            assert rb[-1].durable.result() == rb[-1].phys_offset + rb[-1].size
    asyncio.run(main())


@pytest.mark.parametrize("mode", ["sync", "async", "async+buffer"])
def test_live_dispatch_equals_replay_from_the_commitlog(tmp_path, mode):
    """Records handed to dispatchers live (in-memory hand-off from the appender) are exactly what a
    replay parsed from the CommitLog produces: same fields, same order, across segment rolls."""
    class Rec:
        name = "rec"

        def __init__(self):
            self.seen = []

        def checkpoint(self): return 0  # never durable: every start replays everything
        def dispatch(self, batch, end): self.seen.extend(tuple(r) for r in batch)
        def flush(self): pass
        def truncate(self, offset): pass
        def on_segments_deleted(self, m): pass
        def close(self): pass

    c = cfg(tmp_path, flush_mode=mode)
    live = Rec()
    st = MessageStore(c)
    st.add_dispatcher(live)
    st.start()
    try:
        rs = []
        for i in range(40):
            rs += st.append_batch([Message(topic=f"lv/{j % 4}/x", body=os.urandom(j * 37 % 900), queue_id=j % 3,
                                           flags=j, props=b"p" * (j % 3), keys=(f"k{j}",) if j % 2 else (),
                                           born_ts=1000 + j, dispatch_queues=("q1", "q2") if j % 3 else ())
                                   for j in range(i * 7, i * 7 + 7)])
        rs.append(st.append(Message(topic="single", body=b"s")))
        visible(st, rs)
    finally:
        st.shutdown()
    replay = Rec()
    st = MessageStore(c)
    st.add_dispatcher(replay)
    st.start()
    st.shutdown()
    assert len(live.seen) == len(rs) == 281
    assert live.seen == replay.seen


def test_dispatch_reads_the_commitlog_when_memory_hand_off_is_off(tmp_path):
    c = cfg(tmp_path, dispatch_from_memory=False)
    with MessageStore(c) as st:
        rs = st.append_batch([Message(topic="t", body=b"%d" % i, keys=("k",)) for i in range(500)])
        visible(st, rs)
        assert [m.body for m in st.read_consume_queue("t", 0, 0, 1000)] == [b"%d" % i for i in range(500)]
        assert len(st.query_by_key("t", "k", 0, 2**62, 1000)) == 500


def test_memory_hand_off_overflow_falls_back_to_the_commitlog(tmp_path):
    gate = threading.Event()
    Slow = _gated_dispatcher(gate)

    c = cfg(tmp_path, dispatch_memory_max_records=50, dispatch_backpressure_bytes=0)
    st = MessageStore(c)
    st.add_dispatcher(Slow())
    st.start()
    try:
        rs = []
        for i in range(30):
            rs += st.append_batch([Message(topic="o", body=b"%d" % (i * 10 + j)) for j in range(10)])
        gate.set()
        visible(st, rs)
        got = st.read_consume_queue("o", 0, 0, 1000)
        assert [m.body for m in got] == [b"%d" % i for i in range(300)]
        assert [m.queue_offset for m in got] == list(range(300))
    finally:
        gate.set()
        st.shutdown()


def test_sync_group_commit_acks_only_durable_data_and_shares_fsyncs(tmp_path):
    """16 threads append concurrently in sync mode: every ack comes after an fsync that covers the
    record, and fsyncs are shared (group commit), far fewer than appends."""
    st = MessageStore(cfg(tmp_path, flush_mode="sync"))
    st.start()
    bad: list = []

    def writer(w):
        for i in range(50):
            r = st.append(Message(topic="g", body=b"%d-%d" % (w, i)))
            end = r.durable.result(30)
            if end < r.phys_offset + r.size or st.flushed_offset < r.phys_offset + r.size:
                bad.append(r)

    try:
        ts = [threading.Thread(target=writer, args=(w,)) for w in range(16)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not bad
        stats = st.stats()
        assert stats["flushed_offset"] == stats["max_offset"]
        assert 0 < stats["group_commit_rounds"] < 800
    finally:
        st.shutdown()
    with MessageStore(cfg(tmp_path, flush_mode="sync")) as st:
        assert len(st.read_consume_queue("g", 0, 0, 1000)) == 800


@pytest.mark.parametrize("mode", ["sync", "async+buffer"])
def test_single_appends_across_many_segments(tmp_path, mode):
    c = cfg(tmp_path, flush_mode=mode, segment_size=8192, max_message_size=4096)
    with MessageStore(c) as st:
        rs = [st.append(Message(topic="s/x", body=os.urandom(i * 37 % 3000), keys=("k",) if i % 5 == 0 else ()))
              for i in range(300)]
        visible(st, rs)
        assert len(os.listdir(os.path.join(c.data_dir, "commitlog"))) > 20
        for r in rs:
            assert r.phys_offset // 8192 == (r.phys_offset + r.size - 1) // 8192
        assert [m.phys_offset for m in st.read_consume_queue("s", 0, 0, 1000)] == [r.phys_offset for r in rs]
        assert len(st.query_by_key("s/x", "k", 0, 2**62, 1000)) == 60


def test_a_failing_dispatcher_stalls_visibility_then_recovers_without_duplicates(tmp_path):
    """A dispatcher that raises: nothing new becomes visible (never a record missing from an index),
    the error is exposed in stats(); once it works again everything is delivered exactly once."""
    state = {"fail": True, "seen": []}

    class Flaky:
        name = "flaky"

        def checkpoint(self): return 0
        def dispatch(self, batch, end):
            if state["fail"]:
                raise RuntimeError("index backend down")
            state["seen"].extend(r.phys_offset for r in batch)
        def flush(self): pass
        def truncate(self, offset): pass
        def on_segments_deleted(self, m): pass
        def close(self): pass

    st = MessageStore(cfg(tmp_path, dispatch_backpressure_bytes=0))
    st.add_dispatcher(Flaky())
    st.start()
    try:
        rs = [st.append(Message(topic="f", body=b"%d" % i, keys=("k",))) for i in range(20)]
        assert not st.wait_dispatched(rs[-1].phys_offset + rs[-1].size, 1.0)
        assert st.dispatched_offset <= rs[0].phys_offset
        assert "index backend down" in st.stats()["dispatch_error"]
        state["fail"] = False
        visible(st, rs)
        assert state["seen"] == [r.phys_offset for r in rs]
        assert len(st.read_consume_queue("f", 0, 0, 100)) == 20
        assert len(st.query_by_key("f", "k", 0, 2**62, 100)) == 20  # no duplicate index entries
    finally:
        state["fail"] = False
        st.shutdown()
