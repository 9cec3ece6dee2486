"""kill -9 at random moments while a child process appends: everything acknowledged survives.

sync: the ack comes after the group-commit fsync. async: the ack comes after the write into the
memory map; a process crash keeps the page cache, so nothing acknowledged may be lost either.
After every kill the store is reopened here and checked: each acknowledged record is readable with
the exact bytes, and the ConsumeQueue is exact (contiguous offsets, no duplicate, every record).
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from lmqtt.store import MessageStore
from tests.store.store_kill_writer import config

WRITER = os.path.join(os.path.dirname(__file__), "store_kill_writer.py")


def run_and_kill(data_dir: str, mode: str, seed: int, rng: random.Random) -> list[str]:
    env = dict(os.environ)
    p = subprocess.Popen([sys.executable, WRITER, data_dir, mode, str(seed)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    lines: list[str] = []
    ready = threading.Event()

    def reader():
        buf = b""
        while True:
            chunk = p.stdout.read1(65536)
            if not chunk:
                break
            buf += chunk
            *complete, buf = buf.split(b"\n")
            for ln in complete:
                if ln == b"ready":
                    ready.set()
                else:
                    lines.append(ln.decode())
        # a partial last line (killed mid-write) is ignored

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        assert ready.wait(60), p.stderr.read1(10000).decode() if p.poll() is not None else "writer not ready"
        time.sleep(rng.uniform(0.02, 0.5))
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
        t.join(30)
        p.stdout.close()
        p.stderr.close()
    return lines


def check(data_dir: str, mode: str, acked: dict[int, tuple[int, str]], fresh=None) -> None:
    """Reopen the store: every acknowledged record is readable with the exact bytes, and the
    ConsumeQueue is exact (contiguous offsets, no duplicate, every acknowledged record with its
    size). `fresh` (the records acknowledged since the last check; None = all) are read by
    offset with `read` and their bytes compared; with `fresh=None` every record of the
    ConsumeQueue is also read back from the CommitLog (CRC-checked) and compared. The rounds
    between pass the new records: re-decoding every earlier round's records each round made the
    test quadratic, and a later round that damaged an earlier record would still be caught by the
    final full check (nothing ever rewrites a record back to its acknowledged bytes)."""
    import hashlib
    st = MessageStore(config(data_dir, mode))
    st.start()
    try:
        for phys in (acked if fresh is None else fresh):
            size, digest = acked[phys]
            m = st.read(phys)
            assert m.size == size and hashlib.sha1(m.body).hexdigest() == digest, phys
        lo, hi = st.consume_queue_offsets("k", 0)
        cq = st.consume_queues.get("k", 0)
        entries = [] if cq is None else cq.range(lo, hi - lo + 10)
        assert [e[0] for e in entries] == list(range(lo, hi))
        phys_list = [e[1] for e in entries]
        assert phys_list == sorted(set(phys_list))
        size_of = {e[1]: e[2] for e in entries}
        assert set(acked) <= set(size_of)
        for phys, (size, _digest) in acked.items():
            assert size_of[phys] == size, phys
        if fresh is None:                              # every record's bytes, read through the CQ
            ms = st.read_consume_queue("k", 0, lo, hi - lo + 10)
            assert [m.phys_offset for m in ms] == phys_list
            for m in ms:
                want = acked.get(m.phys_offset)
                if want is not None:
                    assert m.size == want[0] and hashlib.sha1(m.body).hexdigest() == want[1], m.phys_offset
        assert hi > 0 or not acked
    finally:
        st.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_9_loses_nothing_acknowledged(tmp_path, mode):
    data_dir = str(tmp_path / "store")
    rng = random.Random(1234 if mode == "sync" else 4321)
    acked: dict[int, tuple[int, str]] = {}
    kills = 0
    for seed in range(20):
        lines = run_and_kill(data_dir, mode, seed, rng)
        kills += 1
        fresh = []
        for ln in lines:
            phys, size, digest, _key = ln.split()
            acked[int(phys)] = (int(size), digest)
            fresh.append(int(phys))
        check(data_dir, mode, acked, fresh)
    check(data_dir, mode, acked)                       # and once more, every record's bytes
    assert kills == 20
    assert len(acked) > 100, "the writer acknowledged too little to prove anything"
