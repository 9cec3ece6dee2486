"""A CommitLog that recovery finds shorter than its checkpoints recorded: the newest
segment cut inside a record, truncated to 0 bytes, or missing. Recovery must say so loudly, cut every
queue back to the log, and bring every consumer offset beyond its queue's new end back to it
(persistent sessions and shared groups in the light-queue metadata, SDK group offsets on
ConsumeQueues and light queues, POP state), so that the messages appended afterwards reach them
all, none skipped.

Real parts: a MessageStore with its light queues, the SDK metadata (RocksDB) and POP manager the
store server uses; the damage is done to the real segment files between two runs."""
from __future__ import annotations

import logging
import os

import pytest

from lmqtt.store.consume_queue import DB_DIR as CQ_DB_DIR, ConsumeQueueStore

from lmqtt.lightqueue import LightQueueStore
from lmqtt.store import Message, MessageStore, StoreConfig
from lmqtt.store.pop import PopManager
from lmqtt.store.sdk_meta import SdkMetadata, cq_key, lq_key

SEG = 64 * 1024


def _cfg(d) -> StoreConfig:
    return StoreConfig(data_dir=os.path.join(d, "store"), segment_size=SEG, max_message_size=8192,
                       flush_mode="sync", cq_block_entries=64, index_slots=64, index_entries=1024)


class Node:
    """A store with its light queues, as `lmqtt store` / `lmqtt serve` open them."""

    def __init__(self, d, sdk: bool = True) -> None:
        self.d = str(d)
        self.store = MessageStore(_cfg(self.d))
        self.lq = LightQueueStore(self.store, os.path.join(self.d, "lightqueue"))
        self.store.start()
        self.meta = self.pop = None
        if sdk:
            self.open_sdk()

    def open_sdk(self) -> None:
        self.meta = SdkMetadata(os.path.join(self.d, "sdk-meta"))
        self.pop = PopManager(self.store, self.meta)     # the StoreServer makes one when it starts

    def publish(self, bodies, topic="t/a"):
        rs = self.store.append_batch([Message(topic, b, dispatch_queues=tuple(self.lq.queues_for_topic(topic)))
                                      for b in bodies])
        rs[-1].durable.result(10)
        assert self.store.wait_dispatched(self.store.max_offset, 10)
        return rs

    def close(self) -> None:
        if self.pop is not None:
            self.pop.persist()
            self.meta.close()
        self.store.shutdown()
        self.lq.close()


def _consume_ten(d):
    """Ten messages on t/a, every kind of consumer at offset 10 (all consumed), clean shutdown.
    Returns the append results."""
    n = Node(d)
    n.lq.register_filter("t/#")
    rs = n.publish([f"m-{i}".encode() for i in range(1, 11)])
    md = n.lq.metadata
    md.set_offsets("sess", {"t/#": 10})                 # an MQTT persistent session
    md.set_offsets("$share/g", {"t/#": 10})             # an MQTT shared group
    n.meta.commit("cg", cq_key("t", 0), 10)            # SDK PullConsumer group
    n.meta.commit("fg", lq_key("t/#"), 10)             # SDK FilterConsumer group
    popped, _att, _dead = n.pop.pop("pg", "t", 0, 10, 60_000, 16)
    assert len(popped) == 10
    n.pop.ack("pg", "t", 0, [m.queue_offset for m in popped[:7]])   # 7, 8, 9 still in flight
    n.close()
    return rs


def _segment(d, phys):
    return os.path.join(d, "store", "commitlog", f"{phys - phys % SEG:020d}")


def _lines(caplog, level):
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


def _assert_all_back_at(n: Node, end: int, caplog):
    """Every consumer kind was reset to `end` with its WARNING; then six new messages reach each."""
    warned = "\n".join(_lines(caplog, logging.WARNING))
    lost = 10 - end
    for who, queue in (("sess", "t/#"), ("$share/g", "t/#"), ("group cg", "t:0"), ("group fg", "t/#"),
                       ("group pg (POP)", "t:0")):
        assert (f"consumer {who}: offset 10 of queue {queue} beyond its end {end} after recovery: reset to {end} "
                f"({lost} entries lost from the log)") in warned, who
    md = n.lq.metadata
    assert md.get_offsets("sess") == {"t/#": end}
    assert md.get_offsets("$share/g") == {"t/#": end}
    assert n.meta.committed("cg", cq_key("t", 0)) == end
    assert n.meta.committed("fg", lq_key("t/#")) == end
    assert n.pop.info("pg", "t", 0) == {"next": end, "inflight": 0, "backlog": 0}
    assert n.store.stats()["consumer_offsets_reset"] == 5
    # the queues themselves end where the log does
    assert n.lq.max_offset("t/#") == end
    assert n.lq.max_offset("t/a") == end
    assert n.store.consume_queue_offsets("t", 0)[1] == end
    # new messages: every consumer gets all six, from where it was reset to
    n.publish([f"new-{i}".encode() for i in range(1, 7)])
    new = [f"new-{i}".encode() for i in range(1, 7)]
    for consumer in ("sess", "$share/g"):
        got = n.lq.pull("t/#", md.get_offsets(consumer)["t/#"], max_count=100)
        assert [m.body for m in got.messages] == new, consumer
    assert [m.body for m in n.store.read_consume_queue("t", 0, n.meta.committed("cg", cq_key("t", 0)), 100)] == new
    assert [m.body for m in n.lq.pull("t/#", n.meta.committed("fg", lq_key("t/#")), 100).messages] == new
    popped, _a, _d = n.pop.pop("pg", "t", 0, 100, 60_000, 16)
    assert [m.body for m in popped] == new


def test_newest_segment_cut_inside_a_record(tmp_path, caplog):
    rs = _consume_ten(tmp_path)
    sixth = rs[5]
    os.truncate(_segment(tmp_path, sixth.phys_offset), sixth.phys_offset % SEG + 7)
    caplog.set_level(logging.INFO)
    n = Node(tmp_path)
    try:
        recorded = rs[-1].phys_offset + rs[-1].size
        errors = "\n".join(_lines(caplog, logging.ERROR))
        assert (f"the checkpoints recorded {recorded} bytes of CommitLog (flushed offset {recorded}; " in errors)
        assert f"but only {sixth.phys_offset} were found: {recorded - sixth.phys_offset} bytes" in errors
        assert "acknowledged are lost" in errors
        st = n.store.stats()
        assert st["recovery_lost_bytes"] == recorded - sixth.phys_offset and st["recoveries"] == 1
        _assert_all_back_at(n, 5, caplog)
    finally:
        n.close()


def test_newest_segment_truncated_to_zero_bytes(tmp_path, caplog):
    rs = _consume_ten(tmp_path)
    os.truncate(_segment(tmp_path, rs[0].phys_offset), 0)
    caplog.set_level(logging.INFO)
    n = Node(tmp_path)
    try:
        recorded = rs[-1].phys_offset + rs[-1].size
        errors = "\n".join(_lines(caplog, logging.ERROR))
        assert f"the checkpoints recorded {recorded} bytes of CommitLog" in errors
        assert f"but only 0 were found: {recorded} bytes" in errors
        _assert_all_back_at(n, 0, caplog)
    finally:
        n.close()


def test_newest_segment_missing(tmp_path, caplog):
    """Eleven records fill the first segment, the ten consumed ones go to the second; the second
    segment file is deleted."""
    n = Node(tmp_path)
    n.lq.register_filter("t/#")
    big = n.publish([b"x" * 6000 for _ in range(10)], topic="big")
    overhead = big[0].size - 6000
    # one more, leaving 50 bytes: too few for the next record, which starts the second segment
    big += n.publish([b"y" * (SEG - n.store.max_offset - overhead - 50)], topic="big")
    assert n.store.max_offset == SEG - 50
    n.close()
    rs = _consume_ten(tmp_path)
    assert rs[0].phys_offset >= SEG           # all ten in the second segment
    os.unlink(_segment(tmp_path, rs[0].phys_offset))
    caplog.set_level(logging.INFO)
    n = Node(tmp_path)
    try:
        errors = "\n".join(_lines(caplog, logging.ERROR))
        assert f"but only {SEG} were found" in errors
        assert f"the segment file {_segment(tmp_path, SEG)} holding offset" in errors and "is missing" in errors
        _assert_all_back_at(n, 0, caplog)
        assert n.store.consume_queue_offsets("big", 0)[1] == 11      # the first segment's queue is whole
    finally:
        n.close()


def test_offsets_of_a_holder_opened_later_are_checked_against_the_queue_end_at_the_cut(tmp_path, caplog):
    """The SDK metadata is not opened by the run whose recovery cut the log (`lmqtt serve` without
    its store port, say), new messages are appended, the store restarts cleanly; when the SDK
    metadata is opened at last, its group offsets are still reset to the queue's end *at the cut*
    (5), not to its end now (11), and the messages appended since are all read."""
    rs = _consume_ten(tmp_path)
    os.truncate(_segment(tmp_path, rs[5].phys_offset), rs[5].phys_offset % SEG + 7)
    n = Node(tmp_path, sdk=False)
    n.publish([f"new-{i}".encode() for i in range(1, 7)])
    n.close()
    caplog.set_level(logging.INFO)
    caplog.clear()
    n = Node(tmp_path, sdk=False)          # a clean restart: nothing cut, nothing to say
    try:
        assert not _lines(caplog, logging.WARNING)
        assert n.store.recovery is None and n.store.stats()["recovery_lost_bytes"] == 0
        n.open_sdk()
        warned = "\n".join(_lines(caplog, logging.WARNING))
        assert ("consumer group cg: offset 10 of queue t:0 beyond its end 5 after recovery: reset to 5 "
                "(5 entries lost from the log)") in warned
        assert "consumer group fg: offset 10 of queue t/# beyond its end 5" in warned
        assert "consumer group pg (POP): offset 10 of queue t:0 beyond its end 5" in warned
        new = [f"new-{i}".encode() for i in range(1, 7)]
        assert [m.body for m in n.store.read_consume_queue("t", 0, n.meta.committed("cg", cq_key("t", 0)), 100)] == new
        assert [m.body for m in n.lq.pull("t/#", n.meta.committed("fg", lq_key("t/#")), 100).messages] == new
        assert [m.body for m in n.pop.pop("pg", "t", 0, 100, 60_000, 16)[0]] == new
        # checked once: opening it again resets nothing (offsets past the cut are legitimate now)
        n.meta.commit("cg", cq_key("t", 0), 11)
        n.pop.persist()
        n.meta.close()
        caplog.clear()
        n.open_sdk()
        assert n.meta.committed("cg", cq_key("t", 0)) == 11
        assert not _lines(caplog, logging.WARNING)
    finally:
        n.close()


def test_a_clean_restart_touches_no_offset(tmp_path, caplog):
    rs = _consume_ten(tmp_path)
    caplog.set_level(logging.WARNING)
    n = Node(tmp_path)
    try:
        assert not _lines(caplog, logging.WARNING)
        assert n.lq.metadata.get_offsets("sess") == {"t/#": 10}
        assert n.meta.committed("cg", cq_key("t", 0)) == 10
        assert n.store.recovered_end == rs[-1].phys_offset + rs[-1].size
        assert n.store.stats()["recoveries"] == 0
    finally:
        n.close()


@pytest.mark.parametrize("ahead", ["consumequeue", "lightqueue"])
def test_a_dispatch_checkpoint_ahead_of_the_log_is_reported_and_its_queue_cut(tmp_path, caplog, ahead):
    """Only a dispatcher's checkpoint is ahead of the recovered end (its data was dispatched, then
    the log lost it without the flushed checkpoint covering it, as after a power loss in async
    mode): a WARNING says so, that queue is cut back and the offsets reset."""
    rs = _consume_ten(tmp_path)
    recorded = rs[-1].phys_offset + rs[-1].size
    cut = rs[5].phys_offset
    # the CommitLog's flushed checkpoint says the log ended at the 6th record: the data after it
    # "was never fsynced"; zero it as a power loss would have lost it
    from lmqtt.store.checkpoint import OffsetCheckpoint
    OffsetCheckpoint(os.path.join(tmp_path, "store", "commitlog.checkpoint")).save(cut)
    with open(_segment(tmp_path, cut), "r+b") as f:
        f.seek(cut % SEG)
        f.write(bytes(recorded - cut))
    if ahead == "lightqueue":     # the ConsumeQueue too holds only what is before the cut: only the index is ahead
        cqs = ConsumeQueueStore(os.path.join(tmp_path, "store", CQ_DB_DIR))
        cqs.load()
        cqs.truncate(cut)
        cqs.close()
    caplog.set_level(logging.INFO)
    n = Node(tmp_path)
    try:
        warned = "\n".join(_lines(caplog, logging.WARNING))
        assert f"the dispatch checkpoints recorded {recorded} bytes of CommitLog" in warned
        assert f"flushed offset {cut}) but only {cut} were found" in warned
        assert not _lines(caplog, logging.ERROR)
        _assert_all_back_at(n, 5, caplog)
    finally:
        n.close()
