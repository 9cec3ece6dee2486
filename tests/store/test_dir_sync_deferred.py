"""Creating a file on the append path (a new topic's ConsumeQueue file with inline dispatch, a new
CommitLog segment) does not fsync its directory there - that was a 2-28 ms stall on the gateway's
event loop - and the directory entries are still durable before the data that needs them: the
flush fsyncs them (the file's directory and every directory created for it) before it fdatasyncs
the data and before the ConsumeQueue checkpoint says the entries are durable.

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


def test_new_consume_queue_file_dir_synced_by_the_flush_not_the_appender(tmp_path, monkeypatch):
    with _store(tmp_path, segment_size=8 << 20, max_message_size=1 << 20) as st:
        st.append_batch([Message(topic="warm/up", body=b"x")])
        st.consume_queues.flush()
        syncs = _Syncs(monkeypatch)
        r = st.append_batch([Message(topic="brand-new/topic", body=b"y")])[0]
        cq_root = os.path.join(st.cfg.data_dir, "consumequeue")
        created = [os.path.join(dp, d) for dp, ds, _ in os.walk(cq_root) for d in ds if "brand-new" in d]
        assert created, "the new topic's ConsumeQueue directory"
        assert st.dispatch.dispatched >= r.phys_offset + r.size       # dispatched inline, here
        assert syncs.dirs(on_main=True) == []                          # no directory fsync here
        st.consume_queues.flush()                                      # what the background thread runs
        synced = syncs.dirs()
        topic_dir = created[0]
        leaf = os.path.dirname(next(os.path.join(dp, f) for dp, _, fs in os.walk(topic_dir) for f in fs))
        # the file's directory, and the entries of the directories created for it
        assert {leaf, topic_dir, cq_root} <= set(synced), synced
        ck = syncs.index(lambda c: c[0] == "fsync" and c[1].endswith("checkpoint.tmp"))
        assert all(syncs.index(lambda c, d=d: c[0] == "fsync" and c[1] == d) < ck
                   for d in (leaf, topic_dir, cq_root))                # before the checkpoint
        n = len(syncs.calls)
        st.consume_queues.flush()
        assert len(syncs.calls) == n                                   # nothing left to sync


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
