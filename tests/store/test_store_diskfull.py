"""A full disk: appends fail with DiskFull, what was written stays intact and readable, the store
keeps serving reads. Uses a real 4 MiB tmpfs mounted for the test (root), or a loop device."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from lmqtt.store import DiskFull, Message, MessageStore, StoreConfig


def _try(cmd):
    return subprocess.run(cmd, capture_output=True, text=True).returncode == 0


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB filesystem of its own: tmpfs if mount is permitted, else ext4 on a loop device."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    how = None
    if _try(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)]):
        how = "tmpfs"
    else:
        img = tmp_path / "fs.img"
        with open(img, "wb") as f:
            f.truncate(4 << 20)
        if _try(["mkfs.ext4", "-q", "-F", str(img)]) and _try(["mount", "-o", "loop", str(img), str(mnt)]):
            how = "loop"
    if how is None:
        pytest.skip("cannot mount a small filesystem here (needs root: mount -t tmpfs or a loop device)")
    try:
        yield str(mnt)
    finally:
        if not _try(["umount", str(mnt)]):
            _try(["umount", "-l", str(mnt)])


def cfg(d, **kw):
    base = dict(data_dir=os.path.join(d, "store"), segment_size=1 << 20, max_message_size=64 * 1024,
                flush_mode="sync", index_slots=64, index_entries=1024, cq_block_entries=1000,
                disk_high_water=1.0, disk_check_interval_ms=50)
    base.update(kw)
    return StoreConfig(**base)


def test_disk_full_fails_appends_cleanly_and_keeps_data(small_fs):
    st = MessageStore(cfg(small_fs))
    st.start()
    written = []
    err = None
    try:
        for i in range(1000):  # bounded: 4 MiB cannot hold 1000 x 16 KiB
            bodies = [os.urandom(16 * 1024) for _ in range(4)]
            try:
                rs = st.append_batch([Message(topic="full/t", body=b, keys=(f"k{i}",)) for b in bodies])
            except DiskFull as e:
                err = e
                break
            rs[-1].durable.result(10)
            written.extend(zip(rs, bodies))
        assert err is not None, "the disk never filled up"
        assert "no space" in str(err)
        assert len(written) > 50
        # smaller appends still fit in the current segment until it is full; then they fail too
        for _ in range(100):
            b = os.urandom(16 * 1024)
            before = st.max_offset
            try:
                r = st.append(Message(topic="full/t", body=b, keys=("last",)))
            except DiskFull:
                assert st.max_offset == before  # nothing half-written
                break
            r.durable.result(10)
            written.append((r, b))
        else:
            pytest.fail("single appends never hit DiskFull")
        end = st.max_offset
        with pytest.raises(DiskFull):
            st.append(Message(topic="full/t", body=os.urandom(16 * 1024)))
        assert st.max_offset == end
        assert st.wait_dispatched(end, 10)
        for r, b in written:
            assert st.read(r.phys_offset).body == b
        assert len(st.read_consume_queue("full", 0, 0, 10_000)) == len(written)
        assert st.query_by_key("full/t", "k3", 0, 2**62, 10)
    finally:
        st.shutdown()
    # and after a restart on the still-full disk
    st = MessageStore(cfg(small_fs))
    st.start()
    try:
        for r, b in written:
            assert st.read(r.phys_offset).body == b
    finally:
        st.shutdown()


def test_high_water_mark_refuses_appends_until_space_is_freed(small_fs):
    ballast = os.path.join(small_fs, "ballast")
    with open(ballast, "wb") as f:
        f.write(os.urandom(3 << 20))  # 75% of the filesystem
    st = MessageStore(cfg(small_fs, segment_size=256 * 1024, disk_high_water=0.5))
    st.start()
    try:
        with pytest.raises(DiskFull, match="high-water mark 50%"):
            st.append(Message(topic="t", body=b"x"))
        os.unlink(ballast)
        deadline = time.monotonic() + 10
        while True:  # the background service re-checks disk usage every 50 ms
            try:
                r = st.append(Message(topic="t", body=b"back"))
                break
            except DiskFull:
                assert time.monotonic() < deadline, "appends still refused after space was freed"
                time.sleep(0.05)
        assert st.wait_dispatched(r.phys_offset + r.size, 10)
        assert st.read(r.phys_offset).body == b"back"
    finally:
        st.shutdown()
