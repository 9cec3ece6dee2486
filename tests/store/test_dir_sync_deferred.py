"""The append path does no fsync (a 2-28 ms stall on the gateway's event loop each): a new
CommitLog segment's directory entry is made durable by the flush, before it fdatasyncs the data
that needs it, and a new topic's ConsumeQueue (with inline dispatch, on the appender's thread)
creates no file at all - it is written to its database by the background flush.

Real store, real files, real fsyncs: os.fsync / os.fdatasync are wrapped only to record which
thread synced which file, in which order."""
from __future__ import annotations

import os
import threading

from lmqtt.store import Message, MessageStore, StoreConfig


class _Syncs:
    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[str, str, bool]] = []     # (what, path, on the test's thread)
        main = threading.current_thread()
        for name in ("fsync", "fdatasync"):
            real = getattr(os, name)

            def spy(fd, real=real, name=name):
                try:
                    path = os.readlink(f"/proc/self/fd/{fd}")
                except OSError:
                    path = "?"
                self.calls.append((name, path, threading.current_thread() is main))
                return real(fd)
            monkeypatch.setattr(os, name, spy)

    def dirs(self, on_main: bool | None = None) -> list[str]:
        return [p for n, p, m in self.calls if n == "fsync" and os.path.isdir(p)
                and (on_main is None or m == on_main)]

    def index(self, pred) -> int:
        return next(i for i, c in enumerate(self.calls) if pred(c))


def _store(tmp_path, **kw) -> MessageStore:
    # long intervals: only the explicit flushes below flush
    cfg = StoreConfig(data_dir=str(tmp_path / "s"), flush_mode="async", flush_interval_ms=60_000,
                      flush_thorough_interval_ms=60_000, dispatcher_flush_interval_ms=60_000,
                      dispatch_inline=True, **kw)
    return MessageStore(cfg)


def test_a_new_topic_s_consume_queue_creates_no_file_and_syncs_nothing_on_the_appender(tmp_path, monkeypatch):
    with _store(tmp_path, segment_size=8 << 20, max_message_size=1 << 20) as st:
        st.append_batch([Message(topic="warm/up", body=b"x")])
        st.consume_queues.flush()
        before = {os.path.join(dp, f) for dp, _, fs in os.walk(st.cfg.data_dir) for f in fs}
        syncs = _Syncs(monkeypatch)
        r = st.append_batch([Message(topic="brand-new/topic", body=b"y")])[0]
        assert st.dispatch.dispatched >= r.phys_offset + r.size       # dispatched inline, here
        assert [m.body for m in st.read_consume_queue("brand-new", 0, 0, 10)] == [b"y"]
        after = {os.path.join(dp, f) for dp, _, fs in os.walk(st.cfg.data_dir) for f in fs}
        assert after == before                                         # no file for the new topic
        assert [c for c in syncs.calls if c[2]] == []                  # no fsync here
        st.consume_queues.flush()                                      # what the background thread runs
        assert st.consume_queues.checkpoint() >= r.phys_offset + r.size


def test_new_commitlog_segment_dir_synced_by_the_flush(tmp_path, monkeypatch):
    with _store(tmp_path, segment_size=64 << 10, max_message_size=8 << 10) as st:
        st.append_batch([Message(topic="a/b", body=b"x")])
        st.clog.flush()
        syncs = _Syncs(monkeypatch)
        segs = len(st.clog.mfq.files)
        while len(st.clog.mfq.files) == segs:                         # roll to a new segment
            st.append_batch([Message(topic="a/b", body=b"z" * 4000)])
        clog_dir = st.clog.mfq.dir
        assert clog_dir not in syncs.dirs(on_main=True)                # not on the appender
        st.clog.flush()
        d = syncs.index(lambda c: c[0] == "fsync" and c[1] == clog_dir)
        data = syncs.index(lambda c: c[0] == "fdatasync" and c[1].startswith(clog_dir + os.sep))
        assert d < data                     # the new segment's entry before its data counts as durable
