"""The publish hot path takes no Condition it does not need (CPU per message).

A resolved durable future (async flush modes) answers done()/exception()/result() without its
condition, and a dispatch batch notifies the light queues' condition only when a thread waits in
`wait_for_data`. Shown by holding those conditions in another thread: the calls must not block.
"""
from __future__ import annotations

import threading

from lmqtt.lightqueue import LightQueueStore
from lmqtt.store import Message, MessageStore, StoreConfig
from lmqtt.store.message import ResolvedFuture


def _held(cond):
    """Hold `cond` in another thread until the returned event is set."""
    taken, release = threading.Event(), threading.Event()

    def hold():
        with cond:
            taken.set()
            release.wait(30)
    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert taken.wait(10)
    return release, t


def _finishes(fn, timeout=5.0):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    return out


def test_resolved_future_answers_without_its_condition():
    fut = ResolvedFuture(None)
    fut._result = 123
    release, holder = _held(fut._condition)
    try:
        assert _finishes(lambda: (fut.done(), fut.cancelled(), fut.running(), fut.exception(), fut.result())) \
            == [(True, False, False, None, 123)]
    finally:
        release.set()
        holder.join(10)
    seen = []
    fut.add_done_callback(lambda f: seen.append(f.result()))   # a finished future calls back at once
    assert seen == [123]


def test_dispatch_without_a_data_waiter_does_not_take_the_condition(tmp_path):
    st = MessageStore(StoreConfig(data_dir=str(tmp_path / "store"), segment_size=1 << 24, preallocate=False))
    lq = LightQueueStore(st, str(tmp_path / "lq"))
    st.start()
    try:
        lq.register_filter("h/+")
        told = threading.Event()          # the light queues' listeners run after the notify
        lq.add_listener(lambda queues: told.set())
        release, holder = _held(lq._cond)
        try:
            def publish():
                r = st.append(Message(topic="h/1", body=b"x", dispatch_queues=lq.queues_for_topic("h/1")))
                return st.wait_dispatched(r.phys_offset + r.size, 10)
            assert _finishes(publish) == [True]
            assert told.wait(5), "the dispatch batch waited for the light queues' condition"
            assert lq.index.max_offset("h/+") == 1
        finally:
            release.set()
            holder.join(10)
        # a waiter is still woken by the next dispatch
        woke = []
        t = threading.Thread(target=lambda: woke.append(lq.wait_for_data("h/+", 1, 10)))
        t.start()
        r = st.append(Message(topic="h/2", body=b"y", dispatch_queues=lq.queues_for_topic("h/2")))
        assert st.wait_dispatched(r.phys_offset + r.size, 10)
        t.join(15)
        assert woke == [True]
    finally:
        st.shutdown()
        lq.close()
