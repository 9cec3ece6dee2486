"""The CommitLog prefault thread's wake-ups follow the write rate (at 5,000 msg/s it woke
200 times a second, each a GIL hand-off with the event loop, to find nothing to populate)."""
from __future__ import annotations

from lmqtt.store.prefault import Prefaulter


class _Log:
    wrote = 0


def test_wait_follows_the_write_rate():
    p = Prefaulter(_Log(), 2 << 20)
    i, top = p.interval, p.IDLE_INTERVAL_MAX
    assert p.next_wait(i, 1000, -1) == i                       # first check
    assert p.next_wait(i, 5000, 5000) == 2 * i                 # idle: doubles
    assert p.next_wait(top, 5000, 5000) == 2 * top             # idle for long: keeps doubling
    assert p.next_wait(p.QUIET_INTERVAL_MAX, 5000, 5000) == p.QUIET_INTERVAL_MAX   # up to this
    # 5,000 messages of ~150 bytes a second: 750 bytes in 1 ms -> the longest wait
    assert p.next_wait(i, 3750, 0) == top
    # 100 MB/s: a 256 KiB step's worth in ~2.6 ms -> checked every interval
    assert p.next_wait(i, 500_000, 0) == i
    # in between: about two checks per 256 KiB written
    w = p.next_wait(0.01, 100_000, 0)                          # 10 MB/s
    assert i < w < top and abs(w - (256 << 10) / 10_000_000 / 2) < 1e-9
    assert p.next_wait(i, 10, 5000) == i                       # the position went back (a cut log)


def test_a_real_store_still_populates_ahead(tmp_path):
    from lmqtt.store import Message, MessageStore, StoreConfig
    c = StoreConfig(data_dir=str(tmp_path), segment_size=8 << 20, flush_mode="async", prefault_bytes=1 << 20,
                    max_message_size=1 << 20)
    with MessageStore(c) as st:
        if not st.prefault.enabled:
            return
        for _ in range(50):
            st.append_batch([Message(topic="p/q", body=b"x" * 1000) for _ in range(100)])
        st.prefault.step()
        assert st.prefault.populated > 0 and st.prefault.done > st.max_offset
