"""The light-queue index (RocksDB) on a full disk: its memtable flush fails and RocksDB goes into
its read-only background-error state, so its next write fails too. Dispatch must not die: the store
refuses appends (DiskFull naming the light-queue index), visibility waits, and once space returns
RocksDB resumes by itself (its out-of-space auto-recovery: it needs at least its write buffer free,
1 MiB here) and dispatch goes on - every entry once, in order, also after a reopen."""
from __future__ import annotations

import logging
import os
import time

import pytest

from lmqtt.lightqueue.index import LightQueueIndex
from lmqtt.loadtest.chaos.disk import SmallDisk, can_mount_tmpfs
from lmqtt.store import DiskFull, Message, MessageStore, StoreConfig

pytestmark = pytest.mark.skipif(not can_mount_tmpfs(), reason="needs root to mount a tmpfs (mount -t tmpfs)")


def cfg(d):
    return StoreConfig(data_dir=os.path.join(d, "store"), segment_size=1 << 20, max_message_size=64 * 1024,
                       flush_mode="sync", index_slots=64, index_entries=1024, cq_block_entries=10_000,
                       disk_high_water=1.0, disk_check_interval_ms=50, dispatcher_flush_interval_ms=100)


def open_store(d):
    st = MessageStore(cfg(d))
    idx = LightQueueIndex(os.path.join(d, "lq"), write_buffer_mb=1)
    idx.write_records = 16          # a RocksDB write every 16 records (not 32768)
    st.add_dispatcher(idx)
    st.start()
    return st, idx


def wait(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_light_queue_index_out_of_space_stops_dispatch_refuses_appends_and_resumes_by_itself(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lmqtt.store")
    disk = SmallDisk(str(tmp_path / "disk"), 16).mount()
    try:
        st, idx = open_store(disk.path)
        bodies = []
        try:
            for i in range(20):
                b = b"before %d" % i
                r = st.append(Message(topic="q/a", body=b, dispatch_queues=("q/a",)))
                bodies.append(b)
            assert st.wait_dispatched(r.phys_offset + r.size, 10)
            disk.fill(0)
            # appends go on into the preallocated segment until the index's RocksDB, unable to
            # flush, refuses a write: then dispatch reports the full disk and appends are refused
            refused = None
            for i in range(5000):          # bounded; each append gives dispatch a moment
                try:
                    r = st.append(Message(topic="q/a", body=b"full %d" % i, dispatch_queues=("q/a",)))
                except DiskFull as e:
                    refused = e
                    break
                bodies.append(b"full %d" % i)
                time.sleep(0.002)
            assert refused is not None, "appends never refused"
            wait(lambda: "dispatch" in st.stats()["disk_full_causes"], 15, "dispatch to report the full disk")
            with pytest.raises(DiskFull, match="light-queue index"):
                st.append(Message(topic="q/a", body=b"refused", dispatch_queues=("q/a",)))
            end = st.max_offset
            errors = [m.getMessage() for m in caplog.records if m.levelno >= logging.ERROR]
            assert len(errors) == 1 and "disk full" in errors[0], errors
            assert not [m for m in caplog.records if m.exc_info], "a traceback for a full disk"

            disk.free()
            assert st.wait_dispatched(end, 30), "dispatch did not resume after free()"
            wait(lambda: not st.stats()["disk_full"], 10, "appends accepted again")
            r = st.append(Message(topic="q/a", body=b"after", dispatch_queues=("q/a",)))
            bodies.append(b"after")
            assert st.wait_dispatched(r.phys_offset + r.size, 10)
            got = [st.read(e.phys_offset, e.size).body for e in idx.read("q/a", 0, 100_000)]
            assert got == bodies
        finally:
            st.shutdown()
        st, idx = open_store(disk.path)
        try:
            got = [st.read(e.phys_offset, e.size).body for e in idx.read("q/a", 0, 100_000)]
            assert got == bodies
        finally:
            st.shutdown()
    finally:
        disk.umount()
