"""A full disk under the store: refused cleanly, one log line, nothing corrupted, and
appends and dispatch resume by themselves once space returns. Each test mounts its own small tmpfs
(loadtest/chaos/disk.py SmallDisk: root needed) and fills it with a filler file."""
from __future__ import annotations

import logging
import os
import time

import pytest

from lmqtt.loadtest.chaos.disk import SmallDisk, can_mount_tmpfs
from lmqtt.store import DiskFull, Message, MessageStore, StoreConfig

pytestmark = pytest.mark.skipif(not can_mount_tmpfs(), reason="needs root to mount a tmpfs (mount -t tmpfs)")


@pytest.fixture
def disk(tmp_path):
    d = SmallDisk(str(tmp_path / "disk"), 16).mount()
    try:
        yield d
    finally:
        d.umount()


def test_small_disk_fills_to_what_is_asked_and_frees_it_again(tmp_path):
    """loadtest/chaos/disk.py, which the disk-full tests and the chaos bench use."""
    d = SmallDisk(str(tmp_path / "sd"), 8)
    with d:
        assert os.path.ismount(d.path) and d.free_bytes() == 8 << 20
        d.fill(64 << 10)
        assert d.free_bytes() == 64 << 10
        with pytest.raises(OSError) as e, open(os.path.join(d.path, "x"), "wb") as f:
            f.write(b"x" * (128 << 10))
            f.flush()
        assert e.value.errno == 28
        os.unlink(os.path.join(d.path, "x"))
        d.fill(0)                       # again: grows the filler
        assert d.free_bytes() == 0
        d.free()
        assert d.free_bytes() == 8 << 20
    assert not os.path.ismount(d.path)
    d.umount()                          # idempotent


def cfg(d, **kw):
    base = dict(data_dir=os.path.join(d, "store"), segment_size=1 << 20, max_message_size=64 * 1024,
                flush_mode="sync", index_slots=64, index_entries=1024, cq_block_entries=1000,
                disk_high_water=1.0, disk_check_interval_ms=50, dispatcher_flush_interval_ms=100)
    base.update(kw)
    return StoreConfig(**base)


def wait(pred, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def disk_full_lines(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == "lmqtt.store" and r.levelno >= logging.ERROR and "disk full" in r.getMessage()]


def test_no_space_for_a_segment_refuses_with_one_log_line_and_recovers_without_restart(disk, caplog):
    caplog.set_level(logging.INFO, logger="lmqtt.store")
    st = MessageStore(cfg(disk.path))
    st.start()
    written = []
    try:
        for i in range(20):
            r = st.append(Message(topic="t/a", body=b"%d" % i + os.urandom(1000)))
            written.append(r)
        # room for the dispatcher's small writes (checkpoints), none for a 1 MiB segment: the cause
        # under test is the segment alone (a disk filled to its last byte also stops dispatch's
        # checkpoint first, under load: then the refusals are dispatch's, a cause of its own test)
        disk.fill(256 << 10)
        # the current segment is preallocated: records go on into it until it is full, then the
        # next segment cannot be created
        err = None
        for i in range(2000):       # bounded: a 1 MiB segment holds ~1000 of these
            try:
                r = st.append(Message(topic="t/a", body=os.urandom(1000)))
            except DiskFull as e:
                err = e
                break
            written.append(r)
        assert err is not None, "the segment never filled up"
        text = str(err)
        assert "disk full" in text and st.cfg.data_dir in text and "free" in text, text
        before = st.max_offset
        for _ in range(200):        # a flood of refused appends ...
            with pytest.raises(DiskFull):
                st.append_batch([Message(topic="t/a", body=os.urandom(1000)) for _ in range(3)])
        assert st.max_offset == before                     # ... writes nothing
        assert len(disk_full_lines(caplog)) == 1, disk_full_lines(caplog)   # ... and logs once
        s = st.stats()
        assert s["disk_full"] and s["disk_full_causes"] == ["segment"] and s["disk_full_refused"] >= 601
        # reads go on
        assert st.wait_dispatched(before, 10)
        assert st.read(written[-1].phys_offset).phys_offset == written[-1].phys_offset

        disk.free()
        # at once, no restart: the batch refused above needs the new segment, and gets it
        rs = st.append_batch([Message(topic="t/a", body=os.urandom(1000)) for _ in range(3)])
        r = st.append(Message(topic="t/a", body=b"after free"))
        written += rs + [r]
        r.durable.result(10)
        assert not st.stats()["disk_full"]
        assert any("disk space is back" in m.getMessage() for m in caplog.records)
        assert st.wait_dispatched(st.max_offset, 10)
        assert len(st.read_consume_queue("t/a", 0, 0, 100_000)) == len(written)
    finally:
        st.shutdown()
    st = MessageStore(cfg(disk.path))
    st.start()
    try:
        assert not st.corrupt_ranges
        got = st.read_consume_queue("t/a", 0, 0, 100_000)
        assert [m.phys_offset for m in got] == [r.phys_offset for r in written]
        assert got[-1].body == b"after free"
    finally:
        st.shutdown()


def test_dispatch_without_space_for_an_index_file_stops_visibility_refuses_appends_and_resumes(disk, caplog):
    """The key index needs a new file and the disk is full: what was appended stays durable but
    invisible, new appends are refused (DiskFull naming dispatch), and after free() dispatch goes on
    by itself - every key indexed exactly once (the retried batch does not add keys twice)."""
    caplog.set_level(logging.INFO, logger="lmqtt.store")
    st = MessageStore(cfg(disk.path, index_entries=8))
    st.start()
    try:
        r0 = st.append(Message(topic="k/a", body=b"first", keys=("k0",)))
        assert st.wait_dispatched(r0.phys_offset + r0.size, 10)
        disk.fill(0)
        # fits the preallocated segment; its keys need a second and third index file
        rs = st.append_batch([Message(topic="k/a", body=b"m%d" % i, keys=(f"k{i + 1}",)) for i in range(20)])
        end = rs[-1].phys_offset + rs[-1].size
        rs[-1].durable.result(10)
        wait(lambda: st.stats()["disk_full_causes"], what="the store to report the full disk")
        assert not st.wait_dispatched(end, 0.3)            # not visible ...
        with pytest.raises(DiskFull, match="dispatch cannot write the key index"):
            st.append(Message(topic="k/a", body=b"refused"))
        time.sleep(1.2)                                     # a few retries of dispatch meanwhile
        assert len(disk_full_lines(caplog)) == 1, disk_full_lines(caplog)

        disk.free()
        assert st.wait_dispatched(end, 15)                  # ... until space returns
        wait(lambda: not st.stats()["disk_full"], what="appends accepted again")
        r = st.append(Message(topic="k/a", body=b"after", keys=("after",)))
        assert st.wait_dispatched(r.phys_offset + r.size, 10)
        for i in range(21):
            hits = st.query_by_key("k/a", f"k{i}", 0, 2 ** 62, 10)
            assert len(hits) == 1, (i, hits)
        assert len(st.read_consume_queue("k/a", 0, 0, 1000)) == 22
    finally:
        st.shutdown()
    st = MessageStore(cfg(disk.path, index_entries=8))
    st.start()
    try:
        assert len(st.read_consume_queue("k/a", 0, 0, 1000)) == 22
        assert [len(st.query_by_key("k/a", f"k{i}", 0, 2 ** 62, 10)) for i in range(21)] == [1] * 21
    finally:
        st.shutdown()


def test_a_topic_first_seen_on_a_full_disk_is_readable_after_free_and_after_restart(disk):
    """Its ConsumeQueue is first written by a flush on a full disk (RocksDB fails to write its
    table file): the flush is retried once there is room, and the queue is readable by its name
    then and after a restart, never under another name."""
    st = MessageStore(cfg(disk.path))
    st.start()
    try:
        r = st.append(Message(topic="old/t", body=b"x"))
        assert st.wait_dispatched(r.phys_offset + r.size, 10)
        disk.fill(0)
        r = st.append(Message(topic="fresh/t", body=b"born on a full disk"))
        r.durable.result(10)
        wait(lambda: st.stats()["disk_full_causes"], what="the store to report the full disk")
        disk.free()
        assert st.wait_dispatched(r.phys_offset + r.size, 15)
        assert [m.body for m in st.read_consume_queue("fresh/t", 0, 0, 10)] == [b"born on a full disk"]
    finally:
        st.shutdown()
    st = MessageStore(cfg(disk.path))
    st.start()
    try:
        assert [m.body for m in st.read_consume_queue("fresh/t", 0, 0, 10)] == [b"born on a full disk"]
        assert ("", 0) not in st.consume_queues.queues
    finally:
        st.shutdown()


_DELAYED_CHILD = r'''
import sys, time
from lmqtt.store import DiskFull, Message, MessageStore, StoreConfig
sys.path.insert(0, sys.argv[2])
from lmqtt.loadtest.chaos.disk import SmallDisk
disk = SmallDisk(sys.argv[1], 1)          # mounted by the test: fill/free only
st = MessageStore(StoreConfig(data_dir=sys.argv[1] + "/store", segment_size=1 << 20, max_message_size=64 * 1024,
                              cq_block_entries=100_000, index_slots=64, index_entries=100_000,
                              disk_high_water=1.0, timer_precision_ms=100))
st.start()
dm = st.enable_delayed()
now = int(time.time() * 1000)
r = dm.schedule(Message(topic="d/x", body=b"first"), now + 60_000)
assert st.wait_dispatched(r.phys_offset + r.size, 10)     # its ConsumeQueue file exists
disk.fill(0)
acked = 1
for i in range(5000):                      # a TimerLog reservation holds ~1365 timers
    try:
        dm.schedule(Message(topic="d/x", body=b"%d" % i), now + 60_000)
    except DiskFull as e:
        print("REFUSED", e, flush=True)
        break
    acked += 1
else:
    print("NEVER REFUSED", flush=True)
disk.free()
deadline = time.time() + 15
while True:                                  # accepted again (the disk check runs every second)
    try:
        dm.schedule(Message(topic="d/x", body=b"soon"), int(time.time() * 1000) + 200)
        break
    except DiskFull:
        assert time.time() < deadline, "delayed messages still refused after free()"
        time.sleep(0.1)
acked += 1
deadline = time.time() + 15
while time.time() < deadline and not st.read_consume_queue("d/x", 0, 0, 10):
    time.sleep(0.05)
print("FIRED", [m.body for m in st.read_consume_queue("d/x", 0, 0, 10)], "PENDING", dm.wheel.pending, "ACKED", acked)
st.shutdown()
'''


def test_a_delayed_publish_on_a_full_disk_is_refused_not_a_sigbus(tmp_path):
    """The TimerLog's files are sparse and written through a memory map: on a full disk the write
    of a timer into a hole was SIGBUS (the process died). Now its blocks are allocated ahead and a
    delayed message that does not fit is refused with DiskFull before its parked record is
    appended; after free() delayed messages are accepted and fire."""
    import subprocess
    import sys
    disk = SmallDisk(str(tmp_path / "disk"), 16).mount()
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        p = subprocess.run([sys.executable, "-c", _DELAYED_CHILD, disk.path, root], capture_output=True, text=True,
                           timeout=120)
    finally:
        disk.umount()
    assert p.returncode == 0, f"exit {p.returncode} (SIGBUS is -7): {p.stdout[-2000:]} {p.stderr[-2000:]}"
    assert "REFUSED disk full" in p.stdout and "TimerLog" in p.stdout, p.stdout
    fired = [ln for ln in p.stdout.splitlines() if ln.startswith("FIRED")]
    assert fired and "[b'soon']" in fired[0], p.stdout
    n_pending = int(fired[0].split("PENDING ")[1].split()[0])
    n_acked = int(fired[0].split("ACKED ")[1])
    assert n_pending == n_acked - 1, fired        # every accepted timer is there, the refused one not
