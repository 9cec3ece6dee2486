"""The small files a store reads back at restart survive a power loss, not only a crash.

Each is written by `store.atomic_file.write_atomic`: temp file, fsync of its content, rename,
fsync of the directory. Checked on a real process with strace (the syscalls the kernel saw, in
order): a ConsumeQueue's `.topic` (the queue's name) was renamed without any fsync, the store id
file, the timer's fired.json and the tier manifest's local copy without the directory fsync.

And a `.topic` left empty by a power loss (an older version's file) no longer loads its queue under
the name '': the queue is named again from the CommitLog and its messages are readable by topic.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from lmqtt.store import Message, MessageStore, StoreConfig
from lmqtt.store.consume_queue import UNNAMED_MARK, ConsumeQueueStore

STRACE = shutil.which("strace")

_CHILD = r'''
import sys, time
from lmqtt.store import Message, MessageStore, StoreConfig
from lmqtt.store.consume_queue import UNNAMED_MARK, ConsumeQueueStore
from lmqtt.store.tier.config import TierConfig
st = MessageStore(StoreConfig(data_dir=sys.argv[1], segment_size=64 << 10, max_message_size=16 << 10,
                              preallocate=False))
st.enable_tier(TierConfig(url="file://" + sys.argv[2], local_retention_ms=0, upload_interval_ms=50,
                          timeout_s=5.0))
st.start()
st.enable_delayed()                                    # writes the timer's fired.json
rs = st.append_batch([Message(topic=f"fresh/{i}", body=b"x" * 1000) for i in range(200)])   # 3 segments
assert st.wait_dispatched(rs[-1].phys_offset + rs[-1].size, 10)
deadline = time.monotonic() + 30
while st.tier_stats()["tier_segments"] == 0:          # an upload writes the manifest's local copy
    assert time.monotonic() < deadline, "no segment uploaded"
    time.sleep(0.05)
st.shutdown()
'''

_CALL = re.compile(r'^(\d+)\s+(\w+)\((.*)')


def _events(trace: str) -> dict[str, list[tuple[str, list[str]]]]:
    """Per thread, (syscall, the paths named in its line) in the order strace saw them (-y: fds
    shown with their paths; a call that failed is left out)."""
    out: dict[str, list[tuple[str, list[str]]]] = {}
    for line in trace.splitlines():
        m = _CALL.match(line)
        if m and not re.search(r"= -1 [A-Z]", line):
            paths = [a or b for a, b in re.findall(r'"([^"]*)"|<(/[^>]*)>', m.group(3))]
            out.setdefault(m.group(1), []).append((m.group(2), paths))
    return out


def _assert_written_durably(threads, path: str, tmp: str | None = None) -> None:
    """On the thread that renames the temp file over `path`: the call before the rename is the
    fsync of the temp file, the two after it open and fsync `path`'s directory."""
    tmp, parent = tmp or path + ".tmp", os.path.dirname(path)
    seen = 0
    for events in threads.values():
        for i, (call, paths) in enumerate(events):
            if not (call.startswith("rename") and paths[:2] == [tmp, path]):
                continue
            seen += 1
            assert i > 0 and events[i - 1][0] in ("fsync", "fdatasync") and events[i - 1][1] == [tmp], \
                f"{tmp} renamed over {path} without an fsync of its content first (before: {events[i - 1:i]})"
            after = [(c, p[-1:]) for c, p in events[i + 1:i + 3]]
            assert after == [("openat", [parent]), ("fsync", [parent])], \
                f"{path}: its directory not fsynced after the rename (then: {after})"
    assert seen, f"no rename of {tmp} over {path}"


@pytest.mark.skipif(STRACE is None, reason="needs strace")
def test_the_small_files_read_back_at_restart_are_fsynced_before_the_rename_and_their_dir_after(tmp_path):
    data, tier = str(tmp_path / "data"), str(tmp_path / "tier")
    threads = _strace(tmp_path, sys.executable, "-c", _CHILD, data, tier)
    for path in [os.path.join(data, "consumequeue", "fresh", ".topic"), os.path.join(data, "identity"),
                 os.path.join(data, "timer", "fired.json"), os.path.join(data, "tier", "manifest.json")]:
        _assert_written_durably(threads, path)


def _strace(tmp_path, *argv) -> dict:
    out = str(tmp_path / "trace")
    p = subprocess.run([STRACE, "-f", "-y", "-qq", "-e", "signal=none", "-e",
                        "trace=openat,fsync,fdatasync,rename,renameat,renameat2", "-o", out, *argv],
                       capture_output=True, text=True, timeout=120)
    if p.returncode != 0 and "ptrace" in p.stderr:
        pytest.skip(f"strace cannot trace here: {p.stderr.strip()[:200]}")
    assert p.returncode == 0, p.stderr[-3000:]
    with open(out) as f:
        return _events(f.read())


@pytest.mark.skipif(STRACE is None, reason="needs strace")
def test_the_gateway_password_file_is_written_as_durably(tmp_path):
    """gateway/security/auth.py cannot import the store (layering): its own four steps."""
    path = str(tmp_path / "passwd")
    code = ("import os, sys; from lmqtt.gateway.security.auth import write_password_file; "
            "print(os.getpid(), flush=True); write_password_file(sys.argv[1], {'u': 'x'})")
    threads = _strace(tmp_path, sys.executable, "-c", code, path)
    tmps = {p[0] for evs in threads.values() for c, p in evs if c.startswith("rename") and p[1:2] == [path]}
    assert len(tmps) == 1, tmps
    _assert_written_durably(threads, path, tmps.pop())


def _cfg(d, **kw) -> StoreConfig:
    base = dict(data_dir=str(d), segment_size=1 << 20, max_message_size=64 * 1024, flush_mode="sync",
                index_slots=64, index_entries=1024, cq_entries_per_file=1000, dispatcher_flush_interval_ms=100)
    base.update(kw)
    return StoreConfig(**base)


def _wait(pred, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _fill(st, topics, n):
    rs = st.append_batch([Message(topic=f"{topics[i % len(topics)]}/{i}", body=b"m%d" % i) for i in range(n)])
    assert st.wait_dispatched(rs[-1].phys_offset + rs[-1].size, 10)
    return rs


LONG = "L" * 250     # a first level whose directory name is a hash (not the quoted name)


@pytest.mark.parametrize("lost,damage", [("lost", "empty"), ("lost", "missing"), ("lost", "torn"),
                                         (LONG, "empty"), (LONG, "torn")],
                         ids=["empty", "missing", "torn", "hashed-dir-empty", "hashed-dir-torn"])
def test_a_queue_whose_topic_file_was_lost_is_named_again(tmp_path, caplog, lost, damage):
    """From its directory name when that is the quoted topic, else from the CommitLog (a replay
    from the queue's last entry, whose record names the topic)."""
    d = tmp_path / "s"
    st = MessageStore(_cfg(d))
    st.start()
    try:
        _fill(st, [lost, "kept"], 40)
        st.dispatch.flush_dispatchers()         # the checkpoint covers every entry
        _fill(st, ["kept"], 5)                  # records after the last of the lost queue's
        tdir = os.path.dirname(st.consume_queues.get(lost, 0).mfq.dir)
    finally:
        st.shutdown()
    tfile = os.path.join(tdir, ".topic")
    if damage == "empty":                       # what a power loss made of a .topic written without fsync
        open(tfile, "wb").close()
    elif damage == "missing":
        os.unlink(tfile)
    else:
        with open(tfile, "wb") as f:
            f.write(lost[:2].encode())
    caplog.set_level(logging.INFO, logger="lmqtt.store")
    st = MessageStore(_cfg(d))
    st.start()
    try:
        assert {k[0] for k in st.consume_queues.queues} == {lost, "kept"}
        assert [m.body for m in st.read_consume_queue(lost, 0, 0, 100)] == [b"m%d" % i for i in range(0, 40, 2)]
        assert [m.body for m in st.read_consume_queue("kept", 0, 0, 100)] == \
               [b"m%d" % i for i in range(1, 40, 2)] + [b"m%d" % i for i in range(5)]
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and tdir in r.getMessage()]
        how = "from the directory name" if lost == "lost" else "replays the CommitLog from offset"
        assert len(warned) >= 1 and f".topic is {damage if damage != 'torn' else ''}" in warned[0] \
            and how in warned[0], warned
        r = st.append(Message(topic=f"{lost}/new", body=b"after"))
        assert st.wait_dispatched(r.phys_offset + r.size, 10)
    finally:
        st.shutdown()
    with open(tfile) as f:
        assert f.read() == lost                 # written again
    st = MessageStore(_cfg(d))                  # and it stays named
    st.start()
    try:
        assert [m.body for m in st.read_consume_queue(lost, 0, 0, 100)][-2:] == [b"m38", b"after"]
        assert not st.consume_queues.unnamed
    finally:
        st.shutdown()


def test_a_new_topic_s_name_is_written_by_the_flush_and_a_crash_before_it_is_replayed(tmp_path):
    """kill -9 after dispatch, before the flush that writes the new queue's `.topic`: the restart
    names the queue from the records it replays (their entries were not checkpointed either)."""
    d = str(tmp_path / "s")
    child = (f"import os\nfrom lmqtt.store import Message, MessageStore, StoreConfig\n"
             f"st = MessageStore(StoreConfig(data_dir={d!r}, segment_size=1 << 20, max_message_size=65536, "
             f"flush_mode='sync', index_slots=64, index_entries=1024, cq_entries_per_file=1000, "
             f"dispatcher_flush_interval_ms=3_600_000, flush_interval_ms=3_600_000))\n"
             f"st.start()\n"
             f"rs = st.append_batch([Message(topic='born/%d' % i, body=b'b%d' % i) for i in range(7)])\n"
             f"assert st.wait_dispatched(rs[-1].phys_offset + rs[-1].size, 10)\n"
             f"print(os.path.exists({d!r} + '/consumequeue/born/.topic'), flush=True)\n"
             f"os.kill(os.getpid(), 9)\n")
    p = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert p.returncode == -9, p.stderr[-2000:]
    assert p.stdout.strip() == "False"          # not written on the appending thread
    st = MessageStore(_cfg(d))
    st.start()
    try:
        assert [m.body for m in st.read_consume_queue("born", 0, 0, 100)] == [b"b%d" % i for i in range(7)]
        st.dispatch.flush_dispatchers()
        with open(os.path.join(d, "consumequeue", "born", ".topic")) as f:
            assert f.read() == "born"
    finally:
        st.shutdown()


def test_a_nameless_queue_with_none_of_its_records_left_locally_is_set_aside(tmp_path, caplog):
    """A hashed directory name and no record of the queue left in the local CommitLog (retention,
    the tier; here: the log said to start past them): the queue is set aside, never loaded under ''."""
    d = tmp_path / "s"
    st = MessageStore(_cfg(d))
    st.start()
    try:
        _fill(st, [LONG], 6)
        tdir = os.path.dirname(st.consume_queues.get(LONG, 0).mfq.dir)
    finally:
        st.shutdown()
    open(os.path.join(tdir, ".topic"), "wb").close()
    caplog.set_level(logging.INFO, logger="lmqtt.store")
    cqs = ConsumeQueueStore(str(d / "consumequeue"), 1000)
    cqs.load(log_min=1 << 40)
    try:
        assert not cqs.queues and not cqs.unnamed
        assert not os.path.exists(tdir) and os.path.isdir(tdir + UNNAMED_MARK)
        assert any("set aside" in r.getMessage() and tdir in r.getMessage() for r in caplog.records
                   if r.levelno == logging.WARNING)
    finally:
        cqs.close()
    cqs = ConsumeQueueStore(str(d / "consumequeue"), 1000)
    cqs.load()                                  # not a queue any more
    assert not cqs.queues and not cqs.unnamed
    cqs.close()


@pytest.mark.parametrize("layout", ["now", "older"])
def test_topics_starting_with_a_slash_are_readable_by_topic_after_a_restart(tmp_path, layout, caplog):
    """First level '' (MQTT `/a/b`): its queues sat in the ConsumeQueue root itself and were not
    loaded after a restart (and a `.topic`-less directory at load now means a lost name). They have
    their own directory now; an older data dir's are moved there at start."""
    d = tmp_path / "s"
    st = MessageStore(_cfg(d))
    st.start()
    try:
        _fill(st, ["", "kept"], 10)            # topics "/0", "kept/1", "/2", ...
    finally:
        st.shutdown()
    root = d / "consumequeue"
    if layout == "older":                       # where the version before put them
        (root / "%empty" / "0").rename(root / "0")
        (root / "%empty" / ".topic").rename(root / ".topic")
        (root / "%empty").rmdir()
    caplog.set_level(logging.INFO, logger="lmqtt.store")
    for _ in range(2):
        st = MessageStore(_cfg(d))
        st.start()
        try:
            assert [m.body for m in st.read_consume_queue("/x", 0, 0, 100)] == [b"m%d" % i for i in range(0, 10, 2)]
            assert [m.body for m in st.read_consume_queue("kept", 0, 0, 100)] == [b"m%d" % i for i in range(1, 10, 2)]
        finally:
            st.shutdown()
    assert sorted(os.listdir(root)) == ["%empty", "checkpoint", "kept"]
    assert any("moved into" in r.getMessage() for r in caplog.records) == (layout == "older")
