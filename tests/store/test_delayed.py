"""Delayed messages on a real store (store/delayed.py): parked under `$timer`, appended under the
real topic at the due time with the original properties, cancellable by msg id, and fired once
even when a crash lands between firing and the timer checkpoint."""
from __future__ import annotations

import os
import time

import pytest

from lmqtt.store import Message, MessageStore, StoreConfig
from lmqtt.store.delayed import PARK_TOPIC, DelayedMessages, DelayError
from tests.store.test_timer import Clock


@pytest.fixture
def store(tmp_path):
    st = MessageStore(StoreConfig(data_dir=str(tmp_path / "store"), segment_size=1 << 22, max_message_size=1 << 16, preallocate=False))
    st.start()
    yield st
    st.shutdown()


def _topic_msgs(st, topic):
    st.wait_dispatched(st.max_offset, timeout=5)
    return [m for m in st.read_consume_queue(topic, 0, 0, 1000) if m.topic == topic]


def test_a_delayed_message_appears_under_its_topic_at_its_due_time_once(tmp_path, store):
    clock = Clock(time.time())           # fired copies carry real store timestamps
    routed = []

    def route(m):
        routed.append(m.topic)
        return m

    d = DelayedMessages(store, str(tmp_path / "timer"), route=route, clock=clock, precision_ms=100, wheel_ticks=64)
    t0 = clock.t
    r = d.schedule(Message("cmd/valve", b"open", flags=1, props=b"\x01\x02", keys=("k1",)), int((t0 + 2) * 1000))
    r.durable.result(5)
    store.wait_dispatched(store.max_offset, timeout=5)
    assert store.get_by_msg_id(r.msg_id).topic == PARK_TOPIC
    clock.t = t0 + 1.5
    d.wheel.fire_due()
    assert _topic_msgs(store, "cmd/valve") == []                      # not before its time
    clock.t = t0 + 2.2
    d.wheel.fire_due()
    got = _topic_msgs(store, "cmd/valve")
    assert [(m.body, m.flags, bytes(m.props)) for m in got] == [(b"open", 1, b"\x01\x02")]
    assert "k1" in got[0].keys and routed == ["cmd/valve"]
    clock.t = t0 + 5
    d.wheel.fire_due()
    assert len(_topic_msgs(store, "cmd/valve")) == 1
    d.close()


def test_cancel_by_msg_id_and_refusals(tmp_path, store):
    clock = Clock(time.time())           # fired copies carry real store timestamps
    d = DelayedMessages(store, str(tmp_path / "timer"), clock=clock, precision_ms=100, wheel_ticks=64)
    t0 = clock.t
    keep = d.schedule(Message("a/b", b"keep"), int((t0 + 1) * 1000))
    drop = d.schedule(Message("a/b", b"drop"), int((t0 + 1) * 1000))
    store.wait_dispatched(store.max_offset, timeout=5)
    assert d.cancel(drop.msg_id) is True
    assert d.cancel("0" * 32) is False
    clock.t = t0 + 2
    d.wheel.fire_due()
    assert [m.body for m in _topic_msgs(store, "a/b")] == [b"keep"]
    assert d.cancel(keep.msg_id) is False                             # already fired
    with pytest.raises(DelayError, match="need a real topic"):
        d.schedule(Message("$SYS/x", b""), int((t0 + 5) * 1000))
    with pytest.raises(DelayError, match="exceeds the maximum"):
        d.schedule(Message("a/b", b""), int((t0 + 41 * 86400) * 1000))
    d.close()


def test_a_crash_after_firing_but_before_the_checkpoint_fires_nothing_twice(tmp_path, store):
    clock = Clock(time.time())           # fired copies carry real store timestamps
    tdir = str(tmp_path / "timer")
    d = DelayedMessages(store, tdir, clock=clock, precision_ms=100, wheel_ticks=64)
    t0 = clock.t
    for i in range(20):
        d.schedule(Message("dev/x", b"%d" % i), int((t0 + 0.5 + i * 0.05) * 1000))
    store.wait_dispatched(store.max_offset, timeout=5)
    saved = open(os.path.join(tdir, "fired.json")).read()
    clock.t = t0 + 1.0
    d.wheel.fire_due()                                                # some fired and are durable ...
    fired_before = len(_topic_msgs(store, "dev/x"))
    assert 0 < fired_before < 20
    d.wheel._stop.set()
    with open(os.path.join(tdir, "fired.json"), "w") as f:            # ... the checkpoint never got there
        f.write(saved)
    d2 = DelayedMessages(store, tdir, clock=clock, precision_ms=100, wheel_ticks=64)
    clock.t = t0 + 3
    d2.wheel.fire_due()
    bodies = sorted(int(m.body) for m in _topic_msgs(store, "dev/x"))
    assert bodies == list(range(20)), "fired twice or lost across the crash"
    d2.close()


def test_schedule_batch_parks_all_and_fires_each_at_its_time(tmp_path, store):
    clock = Clock(time.time())
    d = DelayedMessages(store, str(tmp_path / "timer"), clock=clock, precision_ms=100, wheel_ticks=64)
    t0 = clock.t
    msgs = [Message(f"b/{i % 3}", b"%d" % i) for i in range(30)]
    dues = [int((t0 + 0.5 + (i % 10) * 0.3) * 1000) for i in range(30)]
    rs = d.schedule_batch(msgs, dues)
    assert len(rs) == 30 and d.wheel.pending == 30
    with pytest.raises(DelayError):
        d.schedule_batch([Message("ok", b""), Message("$bad", b"")], [dues[0], dues[0]])
    assert d.wheel.pending == 30                                        # all or none
    clock.t = t0 + 1.35                     # due <= t0+1.1 have fired (their tick has passed), t0+1.4 not
    d.wheel.fire_due()
    fired = sorted(int(m.body) for t in ("b/0", "b/1", "b/2") for m in _topic_msgs(store, t))
    assert fired == sorted(i for i in range(30) if i % 10 <= 2)
    d.close()


def _level(st, first_level):
    st.wait_dispatched(st.max_offset, timeout=5)
    return st.read_consume_queue(first_level, 0, 0, 1000)


def test_park_arm_and_rearm_of_a_retried_batch_fire_each_message_once(tmp_path, store):
    """The store server's path (PRODUCE with F_DELAYED): `park` + one append + `arm`. A retried
    PRODUCE whose first attempt died after its append finds the batch in the log and `rearm`s its
    timers: written again when they were lost, fired once when they were not (one per ref)."""
    clock = Clock(time.time())
    d = DelayedMessages(store, str(tmp_path / "timer"), clock=clock, precision_ms=100, wheel_ticks=64)
    t0 = clock.t
    due = int((t0 + 0.5) * 1000)
    msgs = [Message("rt/plain", b"now"), Message("rt/a", b"armed"), Message("rt/b", b"lost")]
    out, idx = d.park(msgs, [0, due, due])
    assert idx == [1, 2] and out[0] is msgs[0] and out[1].topic == PARK_TOPIC
    rs = store.append_batch(out)
    d.arm(rs, [1], [0, due, due])                  # the crash: the timer of message 2 never written
    assert d.wheel.pending == 1
    assert d.rearm([r.phys_offset for r in rs], idx, [0, due, due]) == 2   # both pending: both scheduled
    assert d.wheel.pending == 3                    # message 1's timer now twice
    with pytest.raises(DelayError):
        d.park([Message("rt/x", b"")], [int((t0 + 50 * 86400) * 1000)])
    clock.t = t0 + 1.0
    d.wheel.fire_due()
    assert [m.body for m in _level(store, "rt")] == [b"now", b"armed", b"lost"]
    assert d.wheel.pending == 0
    assert d.rearm([r.phys_offset for r in rs], idx, [0, due, due]) == 0   # fired: not again
    clock.t = t0 + 2.0
    d.wheel.fire_due()
    assert len(_level(store, "rt")) == 3
    d.close()
