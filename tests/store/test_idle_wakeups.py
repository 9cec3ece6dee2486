"""An idle store costs ~nothing: its threads sleep until there is work, and keep every promise when
work comes back (the timer fires on time after a long sleep, an append after idle is flushed and
indexed on the flush schedule). Real MessageStore, real threads, real files; wake-ups are the
kernel's context-switch counts of each thread (/proc/self/task/TID/status), bounds generous."""
from __future__ import annotations

import os
import threading
import time

import pytest

from lmqtt.store import Message, MessageStore, StoreConfig
from lmqtt.store.checkpoint import OffsetCheckpoint
from lmqtt.store.timer import TimerWheel


def _switches(thread: threading.Thread) -> int:
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        return sum(int(line.split()[1]) for line in f
                   if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")))


def _until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _cfg(tmp_path, **kw) -> StoreConfig:
    return StoreConfig(data_dir=str(tmp_path / "s"), segment_size=8 << 20, max_message_size=1 << 20, flush_mode="async", **kw)


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")


@needs_proc
def test_idle_store_threads_sleep(tmp_path):
    """Each background thread of an idle store wakes at most a few times in 3 s (before: the
    dispatch thread ~10/s, the background ~10/s, the prefaulter ~12/s)."""
    with MessageStore(_cfg(tmp_path)) as st:
        st.append_batch([Message(topic="a/b", body=b"x")])
        st.clog.flush()          # (unflushed data keeps the background thread at the flush interval)
        time.sleep(2.5)          # the first flushes, then every schedule stretches out
        threads = {"dispatch": st.dispatch._thread, "background": st.background._thread}
        if st.prefault._thread is not None:
            threads["prefault"] = st.prefault._thread
        before = {k: _switches(t) for k, t in threads.items()}
        time.sleep(3.0)
        woke = {k: _switches(t) - before[k] for k, t in threads.items()}
    assert all(n <= 8 for n in woke.values()), woke     # before: 30-40 each


@needs_proc
def test_idle_timer_wheel_sleeps_and_a_timer_scheduled_then_fires_on_time(tmp_path):
    fired: list[tuple[float, int]] = []
    w = TimerWheel(str(tmp_path / "t"), lambda ts: fired.extend((time.time(), t.ref_offset) for t in ts),
                   precision_ms=100, wheel_ticks=4096)
    w.start()
    try:
        time.sleep(0.5)
        before = _switches(w._thread)
        time.sleep(2.0)
        assert _switches(w._thread) - before <= 4       # before: 20 scans a second
        # the thread now sleeps up to IDLE_WAIT_MAX_S: a timer due soon must wake it
        t0 = time.time()
        w.schedule(int((t0 + 0.3) * 1000), 1, 1)        # inside the thread's sleep
        w.schedule(int((t0 + 1.25) * 1000), 2, 1)       # a later tick, no further kick
        assert _until(lambda: len(fired) == 2, 6.0), fired
        by_ref = {ref: at for at, ref in fired}
        assert t0 + 0.3 - 0.01 <= by_ref[1] < t0 + 0.3 + 2.0
        assert t0 + 1.25 - 0.01 <= by_ref[2] < t0 + 1.25 + 2.0
    finally:
        w.close()


@pytest.mark.parametrize("inline", [False, True])
def test_an_append_after_idle_is_flushed_and_indexed_on_schedule(tmp_path, inline):
    """After the threads went to their long sleeps: a small append is fsynced within the thorough
    flush interval and its ConsumeQueue checkpoint within the dispatcher flush interval (the
    promise of `async` mode), whether dispatched by the thread or inline by the appender."""
    cfg = _cfg(tmp_path, flush_interval_ms=200, flush_thorough_interval_ms=1000,
               dispatcher_flush_interval_ms=500, dispatch_inline=inline)
    with MessageStore(cfg) as st:
        st.append_batch([Message(topic="a/b", body=b"x")])
        time.sleep(3.0)                                  # idle: every thread in its long sleep
        assert st.dispatch._quiet and st.background._sleeping
        res = st.append_batch([Message(topic="a/b", body=b"after idle")])[0]
        end = res.phys_offset + res.size
        t0 = time.monotonic()
        assert _until(lambda: st.clog.flushed >= end, 5.0), (st.clog.flushed, end)
        assert time.monotonic() - t0 < 1.0 + 2.0        # the thorough interval, with room
        cq = st.consume_queues
        assert _until(lambda: cq._ckpt >= end, 5.0)


def test_checkpoint_not_rewritten_when_unchanged(tmp_path):
    """An unchanged offset is not written again (before: temp file, fsync, rename, directory
    fsync once a second on an idle store)."""
    p = str(tmp_path / "ck")
    ck = OffsetCheckpoint(p)
    ck.save(42)
    ino = os.stat(p).st_ino
    ck.save(42)
    assert os.stat(p).st_ino == ino                    # not replaced
    ck.save(43)
    assert os.stat(p).st_ino != ino and OffsetCheckpoint(p).load() == 43
    again = OffsetCheckpoint(p)
    assert again.load() == 43
    ino = os.stat(p).st_ino
    again.save(43)
    assert os.stat(p).st_ino == ino
