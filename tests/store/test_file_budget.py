"""The store's files stay within its share of the open-files limit whatever the retention, and
running out of descriptors is an ordinary error (store/file_budget.py).

- A long retention keeps many CommitLog segments; only the budget's share of them stays mapped
  (each map holds a descriptor): idle sealed segments are unmapped and mapped again when read,
  a sealed segment keeps no descriptor of its own, and a restart maps only what it reads.
- EMFILE when a new segment or a new RocksDB table file is needed: the append is refused with a
  message naming the limit, nothing is left half-made, and once descriptors are free again the
  store appends, dispatch catches up and a restart reads everything back.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from lmqtt.store import Message, MessageStore, StoreConfig
from lmqtt.store.mapped_file import MappedFile


def _fds_under(path: str) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(path):
                n += 1
        except OSError:
            pass
    return n


def _fd_names(path: str) -> list[str]:
    """What this process holds open under `path` (a failed budget check names it)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(path):
            out.append(target[len(path):])
    return sorted(out)


def _held_fds_under(path: str, limit: int, timeout: float = 20.0) -> int:
    """The descriptors held under `path` once at most `limit`, or the count after `timeout`: the
    background service opens a checkpoint's temporary file and the directory itself to sync it
    (store/atomic_file.py) for a moment, which a single look may catch - a moment that lasted over
    5 s once in CI, the disk busy with the other workers' tests."""
    deadline = time.monotonic() + timeout
    while True:
        n = _fds_under(path)
        if n <= limit or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def _cfg(d, **kw) -> StoreConfig:
    base = dict(data_dir=str(d), segment_size=64 << 10, max_message_size=8 << 10, flush_mode="sync",
                index_slots=64, index_entries=1024, max_open_files=64)
    base.update(kw)
    return StoreConfig(**base)


def test_a_long_retention_keeps_only_the_budget_s_share_of_segments_mapped(tmp_path):
    st = MessageStore(_cfg(tmp_path / "s"))
    st.start()
    clog_dir = os.path.join(str(tmp_path / "s"), "commitlog")
    try:
        cap = st.budget.commitlog_maps
        rs = []
        for _ in range(100):                       # ~100 segments of 64 KiB
            rs += st.append_batch([Message(topic=f"t/{i}", body=os.urandom(600)) for i in range(100)])
        assert st.wait_dispatched(rs[-1].phys_offset + rs[-1].size, 20)
        rs[-1].durable.result(20)                  # flushed: the sealed segments' own descriptors closed
        segments = len(st.clog.mfq.files)
        assert segments > 3 * cap
        st.release_idle_maps()
        st.release_idle_maps()                     # a second chance: then unmapped
        assert st.clog.mfq.mapped_count() <= cap
        assert _held_fds_under(clog_dir, cap + 1) <= cap + 1
        # every message reads back: the segments are mapped again as they are read ...
        for r in rs[::50]:
            assert len(st.read(r.phys_offset).body) == 600
        assert len(st.read_consume_queue("t", 0, 0, 20_000)) == len(rs)
        # ... and unmapped again when idle
        st.release_idle_maps()
        st.release_idle_maps()
        assert st.clog.mfq.mapped_count() <= cap
        assert _held_fds_under(clog_dir, cap + 1) <= cap + 1
    finally:
        st.shutdown()
    assert _fds_under(clog_dir) == 0
    st = MessageStore(_cfg(tmp_path / "s"))
    st.start()
    try:                                           # a restart maps what recovery reads, not the log
        assert st.clog.mfq.mapped_count() <= 3
        assert len(st.read_consume_queue("t", 0, 0, 20_000)) == len(rs)
    finally:
        st.shutdown()


def test_key_index_files_beyond_the_budget_s_share_are_unmapped_and_still_answer(tmp_path):
    st = MessageStore(_cfg(tmp_path / "s", segment_size=1 << 20, max_message_size=64 << 10))
    st.start()
    index_dir = os.path.join(str(tmp_path / "s"), "index")
    try:
        rs = []
        for b in range(40):                        # 40 x 1024 keys: 40 full index files of 1024 entries
            rs += st.append_batch([Message(topic="k/a", body=b"v", keys=(f"key{b}-{i}",)) for i in range(1024)])
        assert st.wait_dispatched(rs[-1].phys_offset + rs[-1].size, 20)
        st.dispatch.flush_dispatchers()
        assert len(st.index.files) >= 40
        st.release_idle_maps()
        st.release_idle_maps()
        cap = st.budget.index_maps
        assert sum(1 for f in st.index.files if f.mf.mapped) <= cap
        assert _held_fds_under(index_dir, cap + 1) <= cap + 1, _fd_names(index_dir)
        for b in (0, 17, 39):                      # an old file is mapped again to answer
            got = st.query_by_key("k/a", f"key{b}-5", 0, 2 ** 62, 4)
            assert [m.body for m in got] == [b"v"]
    finally:
        st.shutdown()
    st = MessageStore(_cfg(tmp_path / "s", segment_size=1 << 20, max_message_size=64 << 10))
    st.start()
    try:                                           # a restart maps no index file until asked
        assert sum(1 for f in st.index.files if f.mf.mapped) <= 1
        assert [m.body for m in st.query_by_key("k/a", "key3-9", 0, 2 ** 62, 4)] == [b"v"]
    finally:
        st.shutdown()


def test_a_sealed_file_synced_again_keeps_no_descriptor_beside_its_map(tmp_path):
    # a background flush may sync a file just after it was sealed (an index file rolled by the
    # dispatcher meanwhile): the sync must not leave a descriptor open for the file's whole life
    path = str(tmp_path / "f")
    mf = MappedFile(path, 0, 1 << 16, create=True)
    try:
        mf.write(0, b"x" * 100)
        mf.close_fd()                              # sealed: the map keeps one descriptor of its own
        assert _fds_under(path) == 1
        mf.flush()
        mf.flush()
        assert _fds_under(path) == 1, _fd_names(path)
        assert mf.mm[:100] == b"x" * 100
    finally:
        mf.close()
    assert _fds_under(path) == 0


_EMFILE_CHILD = r'''
import os, resource, sys, time
from lmqtt.store import Message, MessageStore, StoreConfig
d = sys.argv[1]
st = MessageStore(StoreConfig(data_dir=d, segment_size=64 << 10, max_message_size=8 << 10, flush_mode="sync",
                              index_slots=64, index_entries=1024, max_open_files=64))
st.start()
acked = []
acked += st.append_batch([Message(topic=f"a{i}/x", body=b"x" * 500) for i in range(40)])
# take every descriptor left
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, 4096))
filler = []
try:
    while True:
        filler.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
refused = None
for i in range(400):                      # past the segment's end: a new segment is needed
    try:
        acked += st.append_batch([Message(topic=f"b{i}/x", body=b"y" * 500)])
    except Exception as e:
        refused = e
        break
print("REFUSED", repr(refused), flush=True)
assert st.wait_dispatched(acked[-1].phys_offset + acked[-1].size, 20)
try:
    st.dispatch.flush_dispatchers()       # RocksDB needs a new table file for the new entries
    print("FLUSHED-WITHOUT-FILES", flush=True)
except Exception as e:
    print("FLUSH-FAILED", repr(e)[:300], flush=True)
for fd in filler:
    os.close(fd)
acked += st.append_batch([Message(topic=f"c{i}/x", body=b"z" * 500) for i in range(200)])
assert st.wait_dispatched(acked[-1].phys_offset + acked[-1].size, 20), "dispatch did not catch up"
st.dispatch.flush_dispatchers()
st.shutdown()
st = MessageStore(StoreConfig(data_dir=d, segment_size=64 << 10, max_message_size=8 << 10, flush_mode="sync",
                              index_slots=64, index_entries=1024))
st.start()
missing = [r for r in acked if st.read(r.phys_offset).body[:1] not in (b"x", b"y", b"z")]
tops = {m.topic.split("/")[0] for m in [st.read(r.phys_offset) for r in acked]}
readable = sum(len(st.read_consume_queue(t, 0, 0, 10)) for t in tops)
print("ACKED", len(acked), "READABLE-BY-TOPIC", readable, "MISSING", len(missing), flush=True)
st.shutdown()
'''


def test_running_out_of_descriptors_refuses_appends_cleanly_and_the_store_recovers(tmp_path):
    p = subprocess.run([sys.executable, "-c", _EMFILE_CHILD, str(tmp_path / "s")], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    out = p.stdout
    refused = next(ln for ln in out.splitlines() if ln.startswith("REFUSED"))
    assert "too many open files" in refused and "ulimit -n" in refused, refused
    flush = next(ln for ln in out.splitlines() if ln.startswith("FLUSH"))
    assert flush.startswith("FLUSH-FAILED") and "Too many open files" in flush, flush
    last = out.strip().splitlines()[-1].split()
    acked, readable, missing = int(last[1]), int(last[3]), int(last[5])
    assert missing == 0 and readable == acked, out
    leftovers = [f for f in os.listdir(tmp_path / "s" / "commitlog") if os.path.getsize(tmp_path / "s" / "commitlog" / f)
                 != 64 << 10]
    assert leftovers == []                      # no half-made segment


_LQ_EMFILE_CHILD = r'''
import os, resource, sys
from lmqtt.lightqueue import LightQueueStore
from lmqtt.store import Message, MessageStore, StoreConfig
d = sys.argv[1]
def open_node():
    st = MessageStore(StoreConfig(data_dir=d + "/store", segment_size=8 << 20, max_message_size=8 << 10,
                                  flush_mode="sync", index_slots=64, index_entries=1024, max_open_files=64))
    lq = LightQueueStore(st, d + "/lq")
    st.start()
    return st, lq
st, lq = open_node()
acked = st.append_batch([Message(topic=f"a{i}/x", body=b"x", dispatch_queues=lq.queues_for_topic(f"a{i}/x")) for i in range(300)])
assert st.wait_dispatched(acked[-1].phys_offset + acked[-1].size, 20)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, 4096))
filler = []
try:
    while True:
        filler.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
acked += st.append_batch([Message(topic=f"b{i}/x", body=b"y", dispatch_queues=lq.queues_for_topic(f"b{i}/x")) for i in range(300)])   # same segment
try:
    st.dispatch.flush_dispatchers()       # both RocksDB flushes need a new table file
    print("FLUSHED-WITHOUT-FILES", flush=True)
except Exception as e:
    print("FLUSH-FAILED", repr(e)[:200], flush=True)
for fd in filler:
    os.close(fd)
acked += st.append_batch([Message(topic=f"c{i}/x", body=b"z", dispatch_queues=lq.queues_for_topic(f"c{i}/x")) for i in range(300)])
assert st.wait_dispatched(acked[-1].phys_offset + acked[-1].size, 20), "dispatch did not catch up"
st.dispatch.flush_dispatchers()
topics = [f"{p}{i}/x" for p in "abc" for i in range(300)]
live = sum(lq.pull(t, 0, 4).messages and 1 or 0 for t in topics)
lq.close()
st.shutdown()
st, lq = open_node()
after = sum(lq.pull(t, 0, 4).messages and 1 or 0 for t in topics)
print("TOPICS", len(topics), "LIVE", live, "AFTER-RESTART", after, flush=True)
lq.close()
st.shutdown()
'''


def test_the_light_queues_come_back_after_running_out_of_descriptors(tmp_path):
    """The light-queue index's RocksDB refuses every write after a failed flush until it is opened
    again: it is, its unflushed writes replayed, and dispatch catches up without a restart."""
    p = subprocess.run([sys.executable, "-c", _LQ_EMFILE_CHILD, str(tmp_path / "n")], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    flush = next(ln for ln in p.stdout.splitlines() if ln.startswith("FLUSH"))
    assert flush.startswith("FLUSH-FAILED") and "Too many open files" in flush, flush
    last = p.stdout.strip().splitlines()[-1].split()
    assert last[1] == last[3] == last[5] == "900", p.stdout
