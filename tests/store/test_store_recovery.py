"""Recovery on open: torn tails are cut at every possible byte, flipped bytes are detected and never
served, corrupt records in the middle are reported and skipped, indexes are replayed exactly."""
from __future__ import annotations

import os
import shutil

import pytest

from lmqtt.store import CorruptRecord, Message, MessageStore, NotVisible, StoreConfig

SEG = 64 * 1024


def cfg(d, **kw):
    base = dict(data_dir=str(d), segment_size=SEG, max_message_size=8192, flush_mode="sync",
                index_slots=64, index_entries=1024, cq_block_entries=64)
    base.update(kw)
    return StoreConfig(**base)


def seg_path(data_dir, phys):
    return os.path.join(data_dir, "commitlog", f"{phys - phys % SEG:020d}")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A store with 20 small records (the last one alone in the tail), cleanly shut down."""
    d = tmp_path_factory.mktemp("pristine") / "s"
    with MessageStore(cfg(d)) as st:
        rs = st.append_batch([Message(topic="t/x", body=b"rec%02d" % i, keys=("k",), props=b"p")
                              for i in range(20)])
        rs[-1].durable.result(10)
    return d, rs


def reopen_copy(src, dst, mutate):
    shutil.copytree(src, dst)
    mutate(str(dst))
    return MessageStore(cfg(dst))


def test_torn_write_at_every_byte_of_the_last_record(pristine, tmp_path):
    src, rs = pristine
    last = rs[-1]
    for cut in range(last.phys_offset, last.phys_offset + last.size):
        def mutate(d):
            os.truncate(seg_path(d, cut), cut % SEG)
        st = reopen_copy(src, tmp_path / f"c{cut}", mutate)
        st.start()
        try:
            assert st.dispatched_offset == last.phys_offset, cut
            assert st.max_offset == last.phys_offset
            for i, r in enumerate(rs[:-1]):
                assert st.read(r.phys_offset).body == b"rec%02d" % i
            with pytest.raises(NotVisible):
                st.read(last.phys_offset)
            assert [m.body for m in st.read_consume_queue("t", 0, 0, 100)] == [b"rec%02d" % i for i in range(19)]
            assert len(st.query_by_key("t/x", "k", 0, 2**62, 100)) == 19
            # the log continues right where the valid data ends, queue offsets without a gap
            r = st.append(Message(topic="t/x", body=b"new"))
            assert (r.phys_offset, r.queue_offset) == (last.phys_offset, 19)
            r.durable.result(10)
        finally:
            st.shutdown()
        shutil.rmtree(tmp_path / f"c{cut}")


def test_flipped_byte_anywhere_in_a_record_is_never_served(pristine, tmp_path):
    src, rs = pristine
    victim = rs[7]
    for pos in range(victim.phys_offset, victim.phys_offset + victim.size):
        def mutate(d):
            with open(seg_path(d, pos), "r+b") as f:
                f.seek(pos % SEG)
                b = f.read(1)
                f.seek(pos % SEG)
                f.write(bytes([b[0] ^ 0x20]))
        st = reopen_copy(src, tmp_path / f"f{pos}", mutate)
        st.start()
        try:
            with pytest.raises(CorruptRecord):
                st.read(victim.phys_offset)
            others = [(i, r) for i, r in enumerate(rs) if r is not victim]
            for i, r in others:
                assert st.read(r.phys_offset).body == b"rec%02d" % i
            assert [m.body for m in st.read_consume_queue("t", 0, 0, 100)] == [b"rec%02d" % i for i, _ in others]
            with pytest.raises(CorruptRecord):
                st.get_by_msg_id(victim.msg_id)
        finally:
            st.shutdown()
        shutil.rmtree(tmp_path / f"f{pos}")


def test_corrupt_record_in_the_middle_is_reported_and_skipped_by_recovery(pristine, tmp_path):
    """Index checkpoints lost, so recovery scans the whole log with CRC; the record is below the
    flushed-offset checkpoint (it was fsynced), so a bad one there is corruption, not a torn tail."""
    src, rs = pristine
    victim = rs[5]
    for where in (victim.phys_offset + 1, victim.phys_offset + 30, victim.phys_offset + victim.size - 1):
        def mutate(d):
            for p in ("consumequeue-db", "index"):
                full = os.path.join(d, p)
                shutil.rmtree(full) if os.path.isdir(full) else os.unlink(full)
            with open(seg_path(d, where), "r+b") as f:
                f.seek(where % SEG)
                f.write(b"\xff")
        st = reopen_copy(src, tmp_path / f"m{where}", mutate)
        st.start()
        try:
            assert st.dispatched_offset == rs[-1].phys_offset + rs[-1].size
            got = [m.body for m in st.read_consume_queue("t", 0, 0, 100)]
            assert got == [b"rec%02d" % i for i in range(20) if i != 5]
            with pytest.raises(CorruptRecord):
                st.read(victim.phys_offset)
            assert len(st.query_by_key("t/x", "k", 0, 2**62, 100)) == 19
            r = st.append(Message(topic="t/x", body=b"new"))
            assert r.phys_offset == rs[-1].phys_offset + rs[-1].size
        finally:
            st.shutdown()


def test_corrupt_range_is_logged(pristine, tmp_path, caplog):
    src, rs = pristine
    victim = rs[3]

    def mutate(d):
        for p in ("consumequeue-db", "index"):
            shutil.rmtree(os.path.join(d, p))
        with open(seg_path(d, victim.phys_offset), "r+b") as f:
            f.seek(victim.phys_offset % SEG + 45)  # inside store_ts
            f.write(b"\xff\xff")
    st = reopen_copy(src, tmp_path / "log", mutate)
    with caplog.at_level("ERROR", logger="lmqtt.store"):
        st.start()
    st.shutdown()
    assert f"corrupt data at offsets [{victim.phys_offset}, {victim.phys_offset + victim.size})" in caplog.text


def test_indexes_rebuilt_exactly_when_lost(pristine, tmp_path):
    """ConsumeQueue and key index deleted (or stale): replay from the CommitLog restores them with no
    duplicates and no gaps."""
    src, rs = pristine

    def mutate(d):
        shutil.rmtree(os.path.join(d, "consumequeue-db"))
        shutil.rmtree(os.path.join(d, "index"))
    st = reopen_copy(src, tmp_path / "r", mutate)
    st.start()
    try:
        ms = st.read_consume_queue("t", 0, 0, 100)
        assert [m.queue_offset for m in ms] == list(range(20))
        assert [m.phys_offset for m in ms] == [r.phys_offset for r in rs]
        assert len(st.query_by_key("t/x", "k", 0, 2**62, 100)) == 20
    finally:
        st.shutdown()


def test_stale_index_beyond_a_cut_log_is_truncated(pristine, tmp_path):
    """Dispatcher checkpoints past the end of the log (async mode + power loss): entries for records
    that are gone are dropped, so the index never points at missing data."""
    src, rs = pristine
    keep = rs[12]

    def mutate(d):
        os.truncate(seg_path(d, keep.phys_offset), keep.phys_offset % SEG)
    st = reopen_copy(src, tmp_path / "s", mutate)
    st.start()
    try:
        assert [m.queue_offset for m in st.read_consume_queue("t", 0, 0, 100)] == list(range(12))
        assert st.consume_queue_offsets("t", 0) == (0, 12)
        assert len(st.query_by_key("t/x", "k", 0, 2**62, 100)) == 12
        r = st.append(Message(topic="t/y", body=b"again", keys=("k",)))
        assert r.queue_offset == 12
        assert st.wait_dispatched(r.phys_offset + r.size, 10)
        assert [m.body for m in st.read_consume_queue("t", 0, 11, 5)] == [b"rec11", b"again"]
    finally:
        st.shutdown()


def test_hole_in_the_unflushed_tail_ends_the_log(pristine, tmp_path):
    """A crash inside the copy of the last batch can leave a hole *before* some of its records
    (memcpy order, page write-back order). Above the flushed checkpoint that is the torn tail: the
    log ends at the hole and the valid-looking records after it are dropped, never half a batch."""
    src, rs = pristine
    hole = rs[15]

    def mutate(d):
        from lmqtt.store.checkpoint import OffsetCheckpoint
        OffsetCheckpoint(os.path.join(d, "commitlog.checkpoint")).save(rs[14].phys_offset)
        for p in ("consumequeue-db", "index"):
            shutil.rmtree(os.path.join(d, p))
        with open(seg_path(d, hole.phys_offset), "r+b") as f:
            f.seek(hole.phys_offset % SEG + 20)
            f.write(bytes(hole.size - 20))
    st = reopen_copy(src, tmp_path / "h", mutate)
    st.start()
    try:
        assert st.max_offset == hole.phys_offset and st.corrupt_ranges == []
        assert [m.queue_offset for m in st.read_consume_queue("t", 0, 0, 100)] == list(range(15))
        r = st.append(Message(topic="t/x", body=b"next"))
        assert (r.phys_offset, r.queue_offset) == (hole.phys_offset, 15)
    finally:
        st.shutdown()
