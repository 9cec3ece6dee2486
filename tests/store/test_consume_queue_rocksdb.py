"""The ConsumeQueue kept in RocksDB (store/consume_queue.py) against a model: whatever mix of
dispatches, flushes, retention, cuts of the log, crashes and reopenings, every queue reads back
exactly the entries the model holds - from its in-memory tail, from stored blocks, or across both
- and a crash loses only what was not flushed, which the replay from the checkpoint brings back.

Real RocksDB in a temp dir; a crash is the database closed without the last flush (what a
kill -9 leaves: the WAL is off, an unflushed memtable is gone)."""
from __future__ import annotations

import errno
import os
import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmqtt.store.consume_queue import ENTRY, ConsumeQueueStore
from lmqtt.store.message import DispatchRequest

QUEUES = [("a", 0), ("b", 0), ("b", 1), ("long" * 30, 0), ("", 0)]
SIZE = 100


def _req(fl: str, qid: int, qoff: int, phys: int) -> DispatchRequest:
    topic = f"{fl}/x" if fl else "/x"
    return DispatchRequest(phys, SIZE, topic, qid, qoff, 0, 0, 0, qoff * 7 + qid, (), ())


class _FlushFails:
    """The real database, but its flush to disk fails as on a full disk (after the write)."""

    def __init__(self, db) -> None:
        self._real = db

    def __getattr__(self, name):
        return getattr(self._real, name)

    def flush(self, wait: bool = True) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


class ConsumeQueueModel(RuleBasedStateMachine):
    """The log is a list of records (phys, queue, qoff); the model's queues are derived from it:
    every record at/after the retention floor and below the log's end, as dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="cq-model-")
        self.path = os.path.join(self.dir, "consumequeue-db")
        self.cqs = ConsumeQueueStore(self.path, block_entries=7)
        self.cqs.load()
        self.log: list[tuple[int, tuple[str, int], int]] = []    # (phys, queue, qoff), in log order
        self.next_qoff: dict[tuple[str, int], int] = {}
        self.dispatched = 0           # records handed to the store
        self.floor = 0                # retention: records with phys below are gone
        self.end = 0                  # the log's end (phys)

    def teardown(self) -> None:
        self.cqs.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---------------------------------------------------------------- the log and dispatch
    @rule(picks=st.lists(st.sampled_from(range(len(QUEUES))), min_size=1, max_size=12))
    def append_and_dispatch(self, picks):
        batch = []
        for i in picks:
            q = QUEUES[i]
            qoff = self.next_qoff.get(q, 0)
            self.next_qoff[q] = qoff + 1
            self.log.append((self.end, q, qoff))
            batch.append(_req(q[0], q[1], qoff, self.end))
            self.end += SIZE
        self.cqs.dispatch(batch, self.end)
        self.dispatched = len(self.log)

    @rule()
    def flush(self):
        self.cqs.flush()

    @rule()
    def flush_that_writes_but_fails_to_reach_the_disk(self):
        """A full disk: RocksDB takes the batch (the memtable) and then fails to flush it. The
        tails stay and the next flush writes them again, over what the failed one did write."""
        db = self.cqs._db
        self.cqs._db = _FlushFails(db)
        try:
            self.cqs.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
        finally:
            self.cqs._db = db

    @precondition(lambda self: self.log)
    @rule(frac=st.floats(0, 1))
    def retention(self, frac):
        """Segments below a point deleted: blocks wholly below it go (a block partly below stays)."""
        floor = int(self.end * frac) // SIZE * SIZE
        self.cqs.on_segments_deleted(floor)
        self.floor = max(self.floor, floor)

    @precondition(lambda self: self.log)
    @rule(frac=st.floats(0, 1))
    def cut_the_log(self, frac):
        """The log cut back (a torn tail, a replica's divergent tail): entries at/after it go, and the
        appender's queue offsets continue from each queue's new end."""
        cut = int(self.end * frac) // SIZE * SIZE
        cut = max(cut, self.floor)
        self.cqs.truncate(cut)
        self.log = [r for r in self.log if r[0] < cut]
        self.end = cut
        self.dispatched = len(self.log)
        self.next_qoff = self.cqs.max_offsets()

    @rule()
    def crash_and_replay(self):
        """kill -9: what was not flushed is gone; the replay from the checkpoint dispatches it again."""
        ckpt = self.cqs.checkpoint()
        self.cqs._db.close()              # no flush: the memtable is lost
        self.cqs._db = None
        self.cqs = ConsumeQueueStore(self.path, block_entries=7)
        self.cqs.load()
        # further on when a flush that failed had written its batch (entries and checkpoint are
        # one atomic batch: what it covers is there)
        assert self.cqs.checkpoint() >= ckpt
        ckpt = self.cqs.checkpoint()
        replay = [_req(q[0], q[1], qoff, phys) for phys, q, qoff in self.log if phys >= ckpt]
        if replay:
            self.cqs.dispatch(replay, self.end)
        if self.floor:
            self.cqs.on_segments_deleted(self.floor)
        # (a queue cut back to nothing and a queue never written both end at 0)
        assert {q: n for q, n in self.cqs.max_offsets().items() if n} == \
            {q: n for q, n in self.next_qoff.items() if n}

    @rule()
    def clean_reopen(self):
        self.cqs.flush()
        self.cqs.close()
        self.cqs = ConsumeQueueStore(self.path, block_entries=7)
        self.cqs.load()

    # ---------------------------------------------------------------- what readers see
    def _expected(self, q) -> list[tuple[int, int]]:
        return [(qoff, phys) for phys, qq, qoff in self.log if qq == q]

    @invariant()
    def every_queue_reads_back_what_the_model_holds(self):
        ends = self.cqs.max_offsets()
        for q in QUEUES:
            want = self._expected(q)
            cq = self.cqs.get(q[0] + "/x" if q[0] else "/x", q[1])
            if not want and (cq is None or cq.max_offset == cq.min_offset):
                continue
            assert cq is not None, q
            assert cq.max_offset == self.next_qoff[q] == ends.get(q, 0)
            got = [(qoff, phys) for qoff, phys, size, _tags in cq.range(0, 10_000)]
            # retention keeps a block that is partly above the floor: reads may start earlier
            assert [g for g in got if g[1] >= self.floor] == [w for w in want if w[1] >= self.floor], q
            assert got == [w for w in want if w[0] >= cq.min_offset], q
            if got:
                qoff, phys = got[len(got) // 2]
                assert cq.entry(qoff)[0] == phys
                assert cq.first_at_or_after(phys) == qoff
                # pieces from any offset: the same entries, whatever the block boundaries
                start = got[0][0] + len(got) // 3
                raw = b"".join(p for _, p in cq.pieces(start, 10_000))
                assert [e[0] for e in ENTRY.iter_unpack(raw) if e[1]] == [p for o, p in got if o >= start]


ConsumeQueueModel.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow])
TestConsumeQueueModel = ConsumeQueueModel.TestCase


def test_a_quiet_topic_costs_a_few_keys_not_a_file(tmp_path):
    """20,000 queues of one entry each: one database, tens of bytes a queue on disk, no file per
    queue; their offsets continue after a reopen."""
    cqs = ConsumeQueueStore(str(tmp_path / "db"))
    cqs.load()
    n = 20_000
    cqs.dispatch([_req(f"dev{i}", 0, 0, i * SIZE) for i in range(n)], n * SIZE)
    cqs.flush()
    cqs.close()
    files = os.listdir(tmp_path / "db")
    size = sum(os.path.getsize(tmp_path / "db" / f) for f in files)
    assert len(files) < 20 and size < 80 * n, (len(files), size)
    cqs = ConsumeQueueStore(str(tmp_path / "db"))
    cqs.load()
    try:
        assert len(cqs.queues) == 0                # nothing loaded until used
        ends = cqs.max_offsets()
        assert len(ends) == n and set(ends.values()) == {1}
        assert cqs.get("dev777/x", 0).range(0, 10) == [(0, 777 * SIZE, SIZE, 7 * 0 + 0)]
    finally:
        cqs.close()


def test_a_busy_queue_is_stored_in_blocks_and_a_small_last_block_grows(tmp_path):
    cqs = ConsumeQueueStore(str(tmp_path / "db"), block_entries=1000)
    cqs.load()
    try:
        phys = 0
        for rnd in range(40):                       # 40 flushes of 3 entries: merged, not 40 keys
            cqs.dispatch([_req("t", 0, rnd * 3 + k, phys + k * SIZE) for k in range(3)], phys + 3 * SIZE)
            phys += 3 * SIZE
            cqs.flush()
        keys = [k for k, _ in cqs._scan(b"E")]
        assert len(keys) <= 5, len(keys)
        cqs.dispatch([_req("t", 0, 120 + k, phys + k * SIZE) for k in range(2500)], phys + 2500 * SIZE)
        cqs.flush()
        assert [e[0] for e in cqs.get("t/x", 0).range(0, 5000)] == list(range(2620))
        assert max(len(v) for _, v in cqs._scan(b"E")) <= 1000 * 20
    finally:
        cqs.close()
