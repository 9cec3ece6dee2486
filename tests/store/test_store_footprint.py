"""The data dir's footprint (docs/store.md "Data dir footprint"): a fresh store with the default
sizes holding a few messages takes tens of MB, not hundreds, while every file stays preallocated;
and a data dir keeps the file sizes it was created with, so a changed default (or segment size)
never makes an existing data dir unreadable."""
from __future__ import annotations

import os
import time

from lmqtt.store import Message, MessageStore, StoreConfig
from tests.support import disk_usage


def visible(st, results):
    last = results[-1]
    assert st.wait_dispatched(last.phys_offset + last.size, 10)


def test_fresh_store_with_default_sizes_stays_small_and_preallocated(tmp_path):
    cfg = StoreConfig(data_dir=str(tmp_path / "store"))
    with MessageStore(cfg) as st:
        # three first-level topics (in the ConsumeQueue database) and keys (a key index file)
        rs = st.append_batch([Message(topic=f"t{i % 3}/x", body=b"m" * 100, keys=(f"k{i}",)) for i in range(10)])
        visible(st, rs)
        st.index.flush()
        used = disk_usage(cfg.data_dir)
        assert used < 48 << 20, f"a fresh data dir with 10 messages takes {used / 2**20:.1f} MiB"
        # still preallocated (a full disk is refused when a file is created, never SIGBUS later):
        # every mapped file has its whole size allocated on disk
        mapped = [os.path.join(cfg.data_dir, "commitlog", n) for n in os.listdir(os.path.join(cfg.data_dir, "commitlog"))]
        mapped += [os.path.join(cfg.data_dir, "index", n) for n in os.listdir(os.path.join(cfg.data_dir, "index"))
                   if n.isdigit()]
        assert len(mapped) == 2
        for p in mapped:
            s = os.stat(p)
            assert s.st_blocks * 512 >= s.st_size, f"{p} is sparse"
        assert st.query_by_key("t1/x", "k4", 0, int(time.time() * 1000) + 1000, 4)[0].body == b"m" * 100


def test_existing_data_dir_keeps_its_file_sizes(tmp_path):
    """Created with 64 KiB segments and a 128-slot key index, then opened with the defaults
    (larger segments, a smaller key index than that one's): every old message reads back, new
    ones roll into files of the old sizes."""
    d = str(tmp_path / "store")
    old = StoreConfig(data_dir=d, segment_size=64 << 10, max_message_size=16 << 10, cq_block_entries=100,
                      index_slots=128, index_entries=100_000)
    with MessageStore(old) as st:
        rs = st.append_batch([Message(topic="t/a", body=os.urandom(500), keys=(f"k{i}",)) for i in range(300)])
        visible(st, rs)
        bodies = [st.read(r.phys_offset).body for r in rs]
    assert len(os.listdir(os.path.join(d, "commitlog"))) >= 2
    new = StoreConfig(data_dir=d, max_message_size=16 << 10, index_entries=1024)
    with MessageStore(new) as st:
        assert [m.body for m in st.read_consume_queue("t", 0, 0, 1000)] == bodies
        now = int(time.time() * 1000)
        assert st.query_by_key("t/a", "k7", 0, now + 1000, 4)[0].body == bodies[7]
        rs2 = st.append_batch([Message(topic="t/a", body=os.urandom(500), keys=(f"n{i}",)) for i in range(300)])
        visible(st, rs2)
        assert st.query_by_key("t/a", "n299", 0, now + 60_000, 4)[0].body is not None
        got = st.read_consume_queue("t", 0, 0, 1000)
        assert [m.body for m in got[:300]] == bodies and len(got) == 600
    assert new.segment_size == 64 << 10
    segs = sorted(os.listdir(os.path.join(d, "commitlog")))
    assert all(os.path.getsize(os.path.join(d, "commitlog", s)) == 64 << 10 for s in segs)
