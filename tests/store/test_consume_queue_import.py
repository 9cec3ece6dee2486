"""A data dir of the file-per-queue ConsumeQueue layout opens unchanged: its queues are imported
into the RocksDB ConsumeQueue once (store/consume_queue_import.py), every message stays readable
by its topic, and the old directory is gone afterwards.

The old layout is written here from a real store's queues, byte for byte as that version wrote
it: `consumequeue/<%-quoted first level>/<queue id>/<20-digit byte offset>` files of 20-byte
entries (unwritten ones zero), a `.topic` per topic directory, `consumequeue/checkpoint`."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
from urllib.parse import quote

from lmqtt.store import Message, MessageStore, StoreConfig
from lmqtt.store.checkpoint import OffsetCheckpoint
from lmqtt.store.consume_queue import DB_DIR, ENTRY_SIZE, ConsumeQueueStore, queue_key
from rocksdict import Options, Rdict

PER_FILE = 16       # entries per old file: the queues below span several files


def _cfg(d) -> StoreConfig:
    return StoreConfig(data_dir=str(d), segment_size=1 << 20, max_message_size=64 * 1024, flush_mode="sync",
                       index_slots=64, index_entries=1024, dispatcher_flush_interval_ms=100)


def _old_dir_name(fl: str) -> str:
    if not fl:
        return "%empty"
    name = quote(fl, safe="")
    if name.startswith("."):
        name = "%2E" + name[1:]
    return "h_" + hashlib.sha1(fl.encode()).hexdigest() if len(name) > 200 else name


def _write_old_layout(d, *, name_file=lambda fl: fl.encode(), root_level_empty: bool = False) -> dict:
    """Turn a stopped store's ConsumeQueues into the old layout (and remove the database); ->
    {(fl, qid): bodies} read before."""
    st = MessageStore(_cfg(d))
    st.start()
    try:
        before = {k: [m.body for m in st.read_consume_queue(k[0], k[1], 0, 10_000)]
                  for k in st.consume_queues.max_offsets()}
        queues = {k: st.consume_queues.get(*k) for k in before}
        root = os.path.join(str(d), "consumequeue")
        for (fl, qid), cq in queues.items():
            raw = b"".join(p for _, p in cq.pieces(cq.min_offset, cq.max_offset))
            tdir = os.path.join(root, _old_dir_name(fl))
            in_root = root_level_empty and fl == ""
            qdir = os.path.join(root if in_root else tdir, str(qid))
            os.makedirs(qdir, exist_ok=True)
            if not in_root:
                with open(os.path.join(tdir, ".topic"), "wb") as f:
                    f.write(name_file(fl))
            size = PER_FILE * ENTRY_SIZE
            start = cq.min_offset * ENTRY_SIZE
            for off in range(start - start % size, cq.max_offset * ENTRY_SIZE, size):
                block = bytearray(size)
                lo = max(off, start)
                hi = min(off + size, cq.max_offset * ENTRY_SIZE)
                block[lo - off:hi - off] = raw[lo - start:hi - start]
                with open(os.path.join(qdir, f"{off:020d}"), "wb") as f:
                    f.write(block)
        ckpt = st.consume_queues.checkpoint()
    finally:
        st.shutdown()
    OffsetCheckpoint(os.path.join(root, "checkpoint")).save(ckpt)
    shutil.rmtree(os.path.join(str(d), DB_DIR))
    return before


def _fill(st, topics, n):
    rs = st.append_batch([Message(topic=f"{topics[i % len(topics)]}/{i}", body=b"m%d" % i) for i in range(n)])
    assert st.wait_dispatched(rs[-1].phys_offset + rs[-1].size, 10)
    st.dispatch.flush_dispatchers()
    return rs


def _read_all(d, keys):
    st = MessageStore(_cfg(d))
    st.start()
    try:
        return {k: [m.body for m in st.read_consume_queue(k[0], k[1], 0, 10_000)] for k in keys}, \
            sorted(st.consume_queues.max_offsets())
    finally:
        st.shutdown()


LONG = "L" * 250     # a first level whose old directory name is a hash


def test_named_queues_are_imported_and_the_old_directory_removed(tmp_path, caplog):
    d = tmp_path / "s"
    st = MessageStore(_cfg(d))
    st.start()
    try:
        _fill(st, ["a", "", ".dot", "sp ace", LONG], 200)      # 40 each: three old files per queue
    finally:
        st.shutdown()
    before = _write_old_layout(d)
    assert all(len(v) == 40 for v in before.values()) and len(before) == 5
    caplog.set_level(logging.INFO, logger="lmqtt.store")
    for _ in range(2):           # imported once; the second start opens the database only
        got, keys = _read_all(d, before)
        assert got == before and keys == sorted(before)
        assert not os.path.exists(d / "consumequeue")
    assert sum("imported from the file-per-queue layout" in r.getMessage() for r in caplog.records) == 1
    st = MessageStore(_cfg(d))
    st.start()
    try:                          # new messages continue each queue's offsets
        r = st.append(Message(topic="a/new", body=b"after"))
        assert st.wait_dispatched(r.phys_offset + r.size, 10)
        assert r.queue_offset == 40
        assert [m.body for m in st.read_consume_queue("a", 0, 0, 100)][-2:] == [before[("a", 0)][-1], b"after"]
    finally:
        st.shutdown()


def test_the_queues_of_the_empty_first_level_kept_in_the_root_by_an_older_version_are_imported(tmp_path):
    d = tmp_path / "s"
    st = MessageStore(_cfg(d))
    st.start()
    try:
        _fill(st, ["", "kept"], 20)                            # topics "/0", "kept/1", ...
    finally:
        st.shutdown()
    before = _write_old_layout(d, root_level_empty=True)
    assert os.path.isdir(d / "consumequeue" / "0")
    got, _ = _read_all(d, before)
    assert got == before and got[("", 0)] == [b"m%d" % i for i in range(0, 20, 2)]


def test_a_queue_whose_name_is_lost_is_rebuilt_from_the_commitlog(tmp_path, caplog):
    """A hashed directory whose `.topic` a power loss left empty: the name is only in the records,
    so the ConsumeQueue dispatch replays the log from the queue's first entry."""
    d = tmp_path / "s"
    st = MessageStore(_cfg(d))
    st.start()
    try:
        _fill(st, [LONG, "kept"], 40)
        _fill(st, ["kept"], 5)
    finally:
        st.shutdown()
    before = _write_old_layout(d, name_file=lambda fl: b"" if fl == LONG else fl.encode())
    caplog.set_level(logging.INFO, logger="lmqtt.store")
    got, keys = _read_all(d, before)
    assert got == before and keys == sorted(before)
    assert any("has no name left" in r.getMessage() and "rebuilt from the CommitLog" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)


def test_a_nameless_queue_with_no_record_left_locally_is_not_imported(tmp_path, caplog):
    d = tmp_path / "s"
    st = MessageStore(_cfg(d))
    st.start()
    try:
        _fill(st, [LONG, "kept"], 10)
    finally:
        st.shutdown()
    _write_old_layout(d, name_file=lambda fl: b"" if fl == LONG else fl.encode())
    (d / "consumequeue" / "x%unnamed").mkdir()                 # set aside by an older version: ignored
    caplog.set_level(logging.INFO, logger="lmqtt.store")
    cqs = ConsumeQueueStore(str(d / DB_DIR))
    cqs.load(log_min=1 << 40)          # the log starts past every record (retention, the tier)
    try:
        assert sorted(cqs.max_offsets()) == [("kept", 0)]
        assert any("none of its records is left in the local CommitLog" in r.getMessage()
                   for r in caplog.records if r.levelno == logging.WARNING)
        assert not os.path.exists(d / "consumequeue")
    finally:
        cqs.close()


def test_an_import_cut_short_by_a_crash_starts_again_from_nothing(tmp_path):
    """The database is marked imported only after the import; a start that finds it unmarked
    beside the old directory clears it and imports again (no entry twice, none missing)."""
    d = tmp_path / "s"
    st = MessageStore(_cfg(d))
    st.start()
    try:
        _fill(st, ["a", "b"], 60)
    finally:
        st.shutdown()
    before = _write_old_layout(d)
    opts = Options(raw_mode=True)                 # half an import: some keys, no version mark
    opts.create_if_missing(True)
    db = Rdict(str(d / DB_DIR), opts)
    db.put(b"E" + queue_key("a", 0) + bytes(8), bytes(7 * ENTRY_SIZE))
    db.put(b"Q" + queue_key("a", 0), bytes(8) + (7).to_bytes(8, "big"))
    db.close()
    got, keys = _read_all(d, before)
    assert got == before and keys == sorted(before)
