"""The store's recent-record read path (MessageStore.keep_recent, docs/store.md "Reading the
head of the log"): real CommitLog files, no mocks, no timing assertions.

What it must keep: a record served from memory is field-for-field the record decoded from the
CommitLog; visibility (only dispatched offsets), retention and size checks are unchanged; only
immutable bodies are kept; memory stays within both bounds.
"""
from __future__ import annotations

import pytest

from lmqtt.store import Message, MessageStore, NotVisible, StoreConfig


def _store(tmp_path, **kw):
    cfg = dict(data_dir=str(tmp_path / "s"), segment_size=16 << 20, flush_mode="async")
    cfg.update(kw)
    st = MessageStore(StoreConfig(**cfg))
    return st


def _msgs(n, prefix="r"):
    return [Message(topic=f"{prefix}/{i % 3}", body=b"body-%d" % i, queue_id=i % 2, flags=i,
                    props=b"p%d" % i if i % 2 else b"", keys=("k%d" % i,) if i % 3 else (),
                    born_ts=1000 + i, dispatch_queues=(f"{prefix}/{i % 3}", f"{prefix}/+") if i % 4 else ())
            for i in range(n)]


@pytest.mark.parametrize("mode", ["sync", "async", "async+buffer"])
def test_recent_read_equals_commitlog_decode(tmp_path, mode):
    st = _store(tmp_path, flush_mode=mode)
    st.keep_recent(1 << 20, 10_000)
    st.start()
    try:
        rs = st.append_batch(_msgs(50))
        rs += [st.append(m) for m in _msgs(7, "one")]
        assert st.wait_dispatched(rs[-1].phys_offset + rs[-1].size, 10)
        for r in rs:
            hot = st.read(r.phys_offset)
            assert st.clog._recent.get(r.phys_offset) is not None
            saved, st.clog._recent = st.clog._recent, {}
            try:
                cold = st.read(r.phys_offset)
            finally:
                st.clog._recent = saved
            assert tuple(hot) == tuple(cold)
            assert st.read(r.phys_offset, r.size) == hot
            assert hot.msg_id == r.msg_id
    finally:
        st.shutdown()


def test_recent_records_still_obey_visibility_and_size(tmp_path):
    st = _store(tmp_path, flush_mode="async+buffer", commit_interval_ms=60_000)
    st.keep_recent(1 << 20, 10_000)
    st.start()
    try:
        r = st.append(Message(topic="v/1", body=b"x"))
        assert st.clog._recent.get(r.phys_offset) is not None
        with pytest.raises(NotVisible):      # buffered, not committed, not dispatched
            st.read(r.phys_offset)
    finally:
        st.shutdown()
    st2 = _store(tmp_path)
    st2.keep_recent(1 << 20, 10_000)
    st2.start()
    try:
        assert st2.read(r.phys_offset).body == b"x"          # survived the clean shutdown
        r2 = st2.append(Message(topic="v/1", body=b"yy"))
        assert st2.wait_dispatched(r2.phys_offset + r2.size, 10)
        # a size that does not match the kept record goes to the CommitLog path
        assert st2.read(r2.phys_offset, r2.size + 1).body == b"yy"
    finally:
        st2.shutdown()


def test_only_bytes_are_kept_and_memory_is_bounded(tmp_path):
    st = _store(tmp_path)
    st.keep_recent(4096, 20)
    st.start()
    try:
        body = bytearray(b"mutable")
        r = st.append(Message(topic="b/1", body=body))
        assert st.clog._recent.get(r.phys_offset) is None    # a bytearray could change later
        body[:] = b"CHANGED"
        assert st.wait_dispatched(r.phys_offset + r.size, 10)
        assert st.read(r.phys_offset).body == b"mutable"     # what was appended
        rs = []
        for _ in range(10):
            rs += st.append_batch([Message(topic="b/2", body=b"z" * 100) for _ in range(7)])
        assert len(st.clog._recent) <= 20 and st.clog._recent_bytes <= 4096 + 7 * 200
        assert st.wait_dispatched(rs[-1].phys_offset + rs[-1].size, 10)
        assert [st.read(x.phys_offset).body for x in rs] == [b"z" * 100] * 70   # evicted: from the log
        st.keep_recent(0, 0)
        assert not st.clog._recent
        assert st.read(rs[-1].phys_offset).body == b"z" * 100
    finally:
        st.shutdown()
