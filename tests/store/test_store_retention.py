"""Retention deletes whole expired segments (and their index files), never one a dispatcher still
needs, never the active one; the store keeps working and restarts after it."""
from __future__ import annotations

import os
import time

import pytest

from lmqtt.store import Message, MessageStore, NotVisible, StoreConfig

SEG = 64 * 1024
FUTURE = int(time.time() * 1000) + 10 * 86400_000


def cfg(d, **kw):
    base = dict(data_dir=str(d), segment_size=SEG, max_message_size=8192, flush_mode="async",
                index_slots=64, index_entries=200, cq_block_entries=50, retention_ms=3600_000,
                retention_check_interval_ms=3600_000, dispatcher_flush_interval_ms=20)
    base.update(kw)
    return StoreConfig(**base)


class Held:
    """A dispatcher whose durable checkpoint only moves when the test says so."""
    name = "held"

    def __init__(self):
        self.ckpt = 0
        self.seen_end = 0

    def checkpoint(self): return self.ckpt
    def dispatch(self, batch, end): self.seen_end = end
    def flush(self): pass
    def truncate(self, offset): self.ckpt = min(self.ckpt, offset)
    def on_segments_deleted(self, m): self.deleted_to = m
    def close(self): pass


def fill(st, n=600):
    rs = st.append_batch([Message(topic="r/t", body=os.urandom(900), keys=(f"k{i}",)) for i in range(n)])
    assert st.wait_dispatched(rs[-1].phys_offset + rs[-1].size, 10)
    return rs


def wait_checkpoints(st, offset):
    deadline = time.monotonic() + 10
    while min(st.consume_queues.checkpoint(), st.index.checkpoint()) < offset:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_expired_segments_and_their_indexes_are_deleted(tmp_path):
    c = cfg(tmp_path / "s")
    with MessageStore(c) as st:
        rs = fill(st)
        wait_checkpoints(st, st.dispatched_offset)
        segs_before = os.listdir(os.path.join(c.data_dir, "commitlog"))
        assert st.delete_expired_segments() == 0  # nothing older than an hour yet
        n = st.delete_expired_segments(now_ms=FUTURE)
        segs_after = os.listdir(os.path.join(c.data_dir, "commitlog"))
        assert n == len(segs_before) - 1 and len(segs_after) == 1  # the active segment stays
        assert st.min_offset == int(segs_after[0])
        gone = [r for r in rs if r.phys_offset < st.min_offset]
        kept = [r for r in rs if r.phys_offset >= st.min_offset]
        assert gone and kept
        with pytest.raises(NotVisible):
            st.read(gone[0].phys_offset)
        assert st.read(kept[0].phys_offset).size == kept[0].size
        lo, hi = st.consume_queue_offsets("r", 0)
        assert 0 < lo <= kept[0].queue_offset and hi == 600
        got = st.read_consume_queue("r", 0, 0, 1000)
        assert got[-1].queue_offset == 599 and all(m.phys_offset >= st.min_offset for m in got)
        assert len(os.listdir(os.path.join(c.data_dir, "index"))) < 5
        assert st.query_by_key("r/t", "k599", 0, 2**62, 5)
    with MessageStore(c) as st:  # restart on a log that no longer starts at 0
        assert st.min_offset == int(segs_after[0])
        r = st.append(Message(topic="r/t", body=b"after"))
        assert r.queue_offset == 600
        assert st.wait_dispatched(r.phys_offset + r.size, 10)
        assert st.read(r.phys_offset).body == b"after"


def test_a_lagging_dispatcher_keeps_the_segments_it_needs(tmp_path):
    held = Held()
    st = MessageStore(cfg(tmp_path / "s"))
    st.add_dispatcher(held)
    st.start()
    try:
        rs = fill(st)
        wait_checkpoints(st, st.dispatched_offset)
        assert st.delete_expired_segments(now_ms=FUTURE) == 0  # held is at 0
        held.ckpt = 3 * SEG + 10  # durable up to the middle of the 4th segment
        assert st.delete_expired_segments(now_ms=FUTURE) == 3
        assert st.min_offset == 3 * SEG and held.deleted_to == 3 * SEG
        assert st.read(next(r for r in rs if r.phys_offset >= 3 * SEG).phys_offset)
        held.ckpt = st.dispatched_offset
        assert st.delete_expired_segments(now_ms=FUTURE) > 0
    finally:
        st.shutdown()
