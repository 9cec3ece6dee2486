"""Subscribing from the past, store side (lightqueue/replay.py): the plan (light queue or log +
seam), the history read from the ConsumeQueues, the seam under concurrent appends, retention."""
from __future__ import annotations

import threading
import time

import pytest

from lmqtt.lightqueue.replay import ReplayRefused
from lmqtt.store import Message
from tests.lightqueue.pairs import open_pair, publish


def read_all(lq, plan, max_count=7):
    """History of a log plan, then the light queue from the live offset (as the gateway reads)."""
    out = []
    if plan["source"] == "log":
        cur = plan["cursor"]
        for _ in range(10_000):
            msgs, cur, done = lq.replay_read(cur, max_count=max_count)
            out += [m.body for m in msgs]
            if done:
                break
        else:
            pytest.fail("history never done")
    return out


def live(lq, flt, off):
    out = []
    for _ in range(10_000):
        res = lq.pull(flt, off, 64)
        if not res.messages:
            return out
        out += [m.body for m in res.messages]
        off = res.next_offset
    pytest.fail("pull never ended")


def wait_until_after(ms: int) -> int:
    for _ in range(1000):
        now = int(time.time() * 1000)
        if now > ms:
            return now
        time.sleep(0.002)
    pytest.fail("clock did not move")


def test_never_subscribed_filter_is_read_from_the_log_up_to_the_seam(pair):
    st, lq = pair
    publish(st, lq, "s/old/t", b"too-old")
    since = wait_until_after(int(time.time() * 1000))
    for i in range(30):
        publish(st, lq, f"s/{i % 3}/t", f"h{i}".encode(), queue_id=i % 2)     # two ConsumeQueues of "s"
        publish(st, lq, f"s/{i % 3}/other", b"no")
        publish(st, lq, "x/1/t", b"other first level")
    lq.register_filter("s/+/t")                       # the SUBSCRIBE registers first
    plan = lq.replay_plan("s/+/t", since)
    assert plan["source"] == "log"
    for i in range(30, 40):                           # live, after the seam
        publish(st, lq, f"s/{i % 3}/t", f"h{i}".encode())
    got = read_all(lq, plan) + live(lq, "s/+/t", plan["live_offset"])
    assert got == [f"h{i}".encode() for i in range(40)]


def test_registered_filter_replays_from_its_light_queue(pair):
    st, lq = pair
    lq.register_filter("r/#")
    t0 = wait_until_after(lq.filter_epoch("r/#")[1])
    for i in range(10):
        publish(st, lq, "r/a", f"early{i}".encode())
    since = wait_until_after(int(time.time() * 1000))
    for i in range(10):
        publish(st, lq, "r/b", f"m{i}".encode())
    assert since > t0
    lq.register_filter("r/#")                          # a second subscriber
    plan = lq.replay_plan("r/#", since)
    assert plan["source"] == "queue"
    assert plan["live_offset"] == 10                   # binary search over the queue's entries
    assert live(lq, "r/#", plan["live_offset"]) == [f"m{i}".encode() for i in range(10)]


def test_filter_registered_after_since_joins_log_and_queue(pair):
    st, lq = pair
    since = int(time.time() * 1000)
    for i in range(5):
        publish(st, lq, "j/a", f"a{i}".encode())
    lq.register_filter("j/+")
    for i in range(5):
        publish(st, lq, "j/b", f"b{i}".encode())
    lq.register_filter("j/+")
    plan = lq.replay_plan("j/+", since)
    assert plan["source"] == "log"
    assert plan["live_offset"] == 0                    # the queue's entries since its epoch
    got = read_all(lq, plan) + live(lq, "j/+", plan["live_offset"])
    assert got == [f"a{i}".encode() for i in range(5)] + [f"b{i}".encode() for i in range(5)]


def test_exact_topic_replays_from_its_own_queue(pair):
    st, lq = pair
    publish(st, lq, "e/x", b"before")
    since = wait_until_after(int(time.time() * 1000))
    for i in range(5):
        publish(st, lq, "e/x", f"m{i}".encode())
    plan = lq.replay_plan("e/x", since)
    assert plan == {"source": "queue", "live_offset": 1}
    assert live(lq, "e/x", 1) == [f"m{i}".encode() for i in range(5)]


def test_leading_wildcard_reads_every_first_level_topic_in_log_order(pair):
    st, lq = pair
    since = int(time.time() * 1000)
    expect = []
    for i in range(20):
        t = f"l{i % 4}/v"
        publish(st, lq, t, f"m{i}".encode())
        expect.append(f"m{i}".encode())
    publish(st, lq, "$app/v", b"dollar topics are not matched by +")
    lq.register_filter("+/v")
    plan = lq.replay_plan("+/v", since)
    assert read_all(lq, plan, max_count=3) == expect


def test_seam_under_concurrent_appends_no_gap_no_duplicate(pair):
    """A thread appends numbered messages while the filter is registered and planned: history +
    live is exactly every message since `since`, once each, in order. The producer routes and
    appends in one step with respect to the registration (the lock), as the gateway's loop and the
    store server's loop do: that is the seam's contract."""
    st, lq = pair
    since = int(time.time() * 1000)
    stop = threading.Event()
    step = threading.Lock()
    sent = []

    def producer():
        i = 0
        while not stop.is_set() and i < 20_000:
            topic = f"c/{i % 5}/v"
            with step:
                st.append(Message(topic=topic, body=str(i).encode(), dispatch_queues=lq.queues_for_topic(topic)))
            sent.append(i)
            i += 1

    th = threading.Thread(target=producer)
    th.start()
    try:
        for _ in range(1000):
            if len(sent) > 500:
                break
            time.sleep(0.002)
        with step:
            lq.register_filter("c/+/v")
        plan = lq.replay_plan("c/+/v", since)
        for _ in range(1000):
            if len(sent) > 1500:
                break
            time.sleep(0.002)
    finally:
        stop.set()
        th.join(10)
    assert st.wait_dispatched(st.max_offset, 10)
    got = [int(b) for b in read_all(lq, plan, max_count=100) + live(lq, "c/+/v", plan["live_offset"])]
    assert got == sent


def test_outside_retention_is_refused_with_the_reason(tmp_path):
    st, lq = open_pair(tmp_path, segment_size=1 << 16, max_message_size=8192)
    st.start()
    try:
        lq.register_filter("old/#")
        for i in range(400):
            publish(st, lq, "old/a", b"x" * 1000)
        for d in st._dispatchers:                     # every dispatcher's checkpoint past the old segments
            d.flush()
        deleted = st.delete_expired_segments(now_ms=int(time.time() * 1000) + 100 * 3600 * 1000)
        assert deleted > 0 and st.min_offset > 0
        oldest = st.read(st.min_offset).store_ts
        with pytest.raises(ReplayRefused, match="outside retention"):
            lq.replay_plan("old/#", oldest - 1)
        plan = lq.replay_plan("old/#", oldest)       # the oldest kept message on: served
        assert plan["source"] == "queue"            # registered before all of it
        assert 0 < len(live(lq, "old/#", plan["live_offset"])) < 400
    finally:
        st.shutdown()
        lq.close()


def test_a_log_never_trimmed_answers_any_since(pair):
    st, lq = pair
    publish(st, lq, "n/a", b"first")
    lq.register_filter("n/#")
    plan = lq.replay_plan("n/#", 0)
    assert read_all(lq, plan) == [b"first"]


def test_a_record_routed_before_the_registration_and_appended_after_is_delivered_once(pair):
    """An appender that routes outside the append step (the seam's contract is that none does):
    the record lands after the seam without the filter, and is read from the log, once."""
    st, lq = pair
    since = int(time.time() * 1000)
    publish(st, lq, "g/a", b"before")
    routed_early = lq.queues_for_topic("g/b")          # no g/+ yet
    lq.register_filter("g/+")
    r = st.append(Message(topic="g/b", body=b"straggler", dispatch_queues=routed_early))
    assert st.wait_dispatched(r.phys_offset + r.size, 10)
    publish(st, lq, "g/c", b"live")
    plan = lq.replay_plan("g/+", since)
    assert plan["source"] == "log"
    assert read_all(lq, plan) + live(lq, "g/+", plan["live_offset"]) == [b"before", b"straggler", b"live"]
