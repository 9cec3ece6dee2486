"""A replica dispatches what it was shipped by parsing its CommitLog (no live hand-off there): the
records come to its dispatchers as runs (store.message's columnar chunk: one DispatchRequest per
run of records that continue each other, a size per record), and the requests they stand for are
exactly those of the record-by-record parse (the reference below), whatever mix was appended."""
from __future__ import annotations

from lmqtt.store import Message, MessageStore, StoreConfig
from lmqtt.store.message import DispatchBatch, DispatchRequest
from lmqtt.store.record import BLANK_MAGIC, HEADER, HEADER_SIZE, MSG_MAGIC, PREFIX, SEP

from .test_log_shipping import SEG, _ship


def _store(path) -> MessageStore:
    s = MessageStore(StoreConfig(data_dir=str(path), segment_size=SEG, flush_mode="async"))
    s.start()
    return s


def _reference(clog, end: int) -> list:
    """The DispatchRequest of every record below `end`, one header at a time."""
    out = []
    pos = 0
    while pos < end:
        mf = clog.mfq.find(pos)
        rel, mm = pos - mf.start_offset, mf.mm
        if rel + HEADER_SIZE > mf.size or PREFIX.unpack_from(mm, rel)[1] == BLANK_MAGIC:
            pos = mf.end_offset
            continue
        (total, magic, _crc, qid, flags, qoff, phys, born, sts, tags, _bl, _pl, tlen, klen,
         dlen) = HEADER.unpack_from(mm, rel)
        assert magic == MSG_MAGIC
        p = rel + HEADER_SIZE
        topic = bytes(mm[p:p + tlen]).decode()
        p += tlen
        keys = tuple(bytes(mm[p:p + klen]).decode().split(SEP)) if klen else ()
        p += klen
        dq = tuple(bytes(mm[p:p + dlen]).decode().split(SEP)) if dlen else ()
        out.append(DispatchRequest(phys, total, topic, qid, qoff, flags, born, sts, tags, keys, dq))
        pos += total
    return out


class _Capture:
    name = "capture"

    def __init__(self) -> None:
        self.batches: list = []

    def dispatch(self, batch, end_offset: int) -> None:
        self.batches.append(batch)

    def flush(self) -> None:
        pass


def test_a_replica_dispatches_runs_equal_to_the_record_by_record_parse(tmp_path):
    p = _store(tmp_path / "p")
    r = _store(tmp_path / "r")
    try:
        r.refuse_appends = "a replica"
        cap = _Capture()
        r.dispatch.dispatchers.append(cap)
        big = b"y" * 50_000
        p.append_batch([Message(topic="a/1", body=b"m%d" % i) for i in range(3000)])     # one long run
        p.append_batch([Message(topic=f"b/{i % 3}", body=b"n%d" % i) for i in range(300)])  # topics alternate
        p.append_batch([Message(topic="c", body=b"k%d" % i, keys=(f"k{i}",)) for i in range(50)])  # keyed
        p.append_batch([Message(topic="d", body=b"q%d" % i, dispatch_queues=("lq/1", "lq/2") if i % 7 else ())
                        for i in range(200)])             # dispatch queues, some records without
        p.append_batch([Message(topic="e", body=b"f%d" % i, queue_id=i % 2, flags=i % 3) for i in range(200)])
        for i in range(200):      # ~10 MB: crosses a segment end (its blank filler is skipped)
            p.append(Message(topic="a/1", body=big + str(i).encode()))
        p.append_batch([Message(topic="a/1", body=b"after %d" % i) for i in range(500)])
        _ship(p, r, 333_333)
        r.dispatch.wake()
        assert r.wait_dispatched(r.clog.wrote, 20)
        got = [req for b in cap.batches for req in b]
        assert got == _reference(r.clog, r.clog.wrote)
        assert len(got) == 3000 + 300 + 50 + 200 + 200 + 200 + 500
        # and they came as runs: the 3000 records of the first batch are far fewer requests built
        runs = [b for b in cap.batches if isinstance(b, DispatchBatch)]
        assert runs and sum(len(c[2]) for b in runs for c in b.chunks) < len(got) // 2
        # what the replica's own dispatchers derived from them is the primary's
        for topic in ("a", "b", "c", "d", "e"):
            for qid in (0, 1):
                assert r.consume_queue_offsets(topic, qid) == p.consume_queue_offsets(topic, qid)
                assert [(m.phys_offset, m.queue_offset, m.body) for m in r.read_consume_queue(topic, qid, 0, 5000)] \
                    == [(m.phys_offset, m.queue_offset, m.body) for m in p.read_consume_queue(topic, qid, 0, 5000)]
        assert [m.body for m in r.query_by_key("c", "k7", 0, 2**62, 5)] == [b"k7"]
    finally:
        p.shutdown()
        r.shutdown()
