"""kill -9 during fan-out load: the light-queue index is rebuilt exactly from the CommitLog.

The index writes with the RocksDB WAL off; its checkpoint rides in the same WriteBatch as the
entries. After a crash, whatever survived (nothing, or some flushed prefix) is consistent, and
the store's re-dispatch from that checkpoint must leave every queue holding exactly the records
the CommitLog holds for it: same order, no gaps, no duplicates.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from lmqtt.lightqueue import LightQueueStore
from lmqtt.store import MessageStore, StoreConfig

from tests.support import ROOT

LOADER = r"""
import sys, random
from lmqtt.store import Message, MessageStore, StoreConfig
from lmqtt.lightqueue import LightQueueStore
d, seed, flush_every, max_q = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
write_records = int(sys.argv[5])
st = MessageStore(StoreConfig(data_dir=d + "/store", segment_size=1 << 22, max_message_size=1 << 16, preallocate=False,
                              dispatcher_flush_interval_ms=10**9))
lq = LightQueueStore(st, d + "/lq")
lq.index.max_queues_per_write = max_q   # small: dispatch batches are cut into many writes
lq.index.write_records = write_records  # small: tails written between flushes
for f in ("a/+", "a/#", "+/+", "+/x/#"):
    lq.register_filter(f)
st.start()
rnd = random.Random(seed)
i = 0
while True:
    msgs = []
    for _ in range(50):
        t = rnd.choice(["a/%d" % rnd.randrange(20), "b/x/%d" % rnd.randrange(5), "a/x/y", "c"])
        msgs.append(Message(topic=t, body=b"%d" % i, dispatch_queues=lq.queues_for_topic(t)))
        i += 1
    st.append_batch(msgs)
    if flush_every and (i // 50) % flush_every == 0:
        st.wait_dispatched(st.max_offset, 5)
        lq.index.flush()        # a durable index prefix: the crash lands somewhere after it
    print(i, flush=True)
"""


def commitlog_records(st):
    """Every record in the CommitLog, in order, walked record by record through the store API."""
    out = []
    for first in ("a", "b", "c"):
        cq_max = st.consume_queue_offsets(first, 0)[1]
        off = 0
        while off < cq_max:
            batch = st.read_consume_queue(first, 0, off, 1000)
            if not batch:
                break
            out += batch
            off += len(batch)
    out.sort(key=lambda m: m.phys_offset)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("flush_every,max_q,write_records,pure_python",
                         [(0, 2048, 32768, False), (7, 2048, 32768, False), (7, 6, 32768, False),
                          (7, 2048, 120, False), (7, 2048, 120, True)])
def test_kill_9_during_fanout_rebuilds_index_exactly(tmp_path, flush_every, max_q, write_records, pure_python):
    """pure_python: the loader runs the Python encoder and index loop (the fallback without the C
    modules) and the rebuild here runs whatever this process has, C when built."""
    d = str(tmp_path)
    env = dict(os.environ, LMQTT_PURE_PYTHON="1" if pure_python else "0")
    proc = subprocess.Popen([sys.executable, "-c", LOADER, d, "5", str(flush_every), str(max_q),
                             str(write_records)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    count = 0
    deadline = time.monotonic() + 60
    try:
        for line in proc.stdout:
            count = int(line)
            if count >= 20_000 or time.monotonic() > deadline:
                break
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert count >= 1000, "the loader made no progress"

    st = MessageStore(StoreConfig(data_dir=d + "/store", segment_size=1 << 22, max_message_size=1 << 16, preallocate=False))
    lq = LightQueueStore(st, d + "/lq")
    st.start()
    try:
        records = commitlog_records(st)
        assert len(records) >= count          # async flush: a process crash loses nothing written
        expected: dict[str, list[int]] = {}
        for m in records:
            assert m.dispatch_queues == lq.queues_for_topic(m.topic)
            for q in m.dispatch_queues:
                expected.setdefault(q, []).append(m.phys_offset)
        assert {"a/+", "a/#", "+/+", "+/x/#", "c"} <= set(expected)
        for q, phys in expected.items():
            got, off = [], 0
            while True:
                res = lq.pull(q, off, max_count=500, max_bytes=1 << 30)
                if not res.messages:
                    break
                assert [m.queue_offset for m in res.messages] == list(range(off, res.next_offset))
                got += [m.phys_offset for m in res.messages]
                off = res.next_offset
            assert got == phys, f"queue {q}: {len(got)} entries, CommitLog has {len(phys)}"
            assert lq.max_offset(q) == len(phys)
        assert lq.index.queue_count() == len(expected)
    finally:
        st.shutdown()
        lq.close()
