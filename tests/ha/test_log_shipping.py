"""The engine side of replication, in-process on real stores: a replica that writes the primary's
CommitLog bytes at the same offsets derives the same queues; the divergence point of two epoch
lists; cutting a log back and reopening it."""
from __future__ import annotations

import os

import pytest

from lmqtt.store import Message, MessageStore, StoreConfig
from lmqtt.store.errors import StoreError
from lmqtt.store.ha.epochs import EpochFile, divergence
from lmqtt.store.ha.truncate import apply_pending_cut, request_cut

SEG = 8 << 20


def _store(path, **kw) -> MessageStore:
    s = MessageStore(StoreConfig(data_dir=str(path), segment_size=SEG, flush_mode="async", **kw))
    s.start()
    return s


def _ship(primary: MessageStore, replica: MessageStore, step: int) -> None:
    """What the Shipper does: read the primary's maps from the replica's end, at most to a segment's end."""
    clog = primary.clog
    pos = replica.clog.wrote
    while pos < clog.committed:
        mf = clog.mfq.find(pos)
        n = min(clog.committed, mf.end_offset, pos + step) - pos
        rel = pos - mf.start_offset
        replica.clog.append_replicated(pos, bytes(mf.mm[rel:rel + n]))
        pos += n


def test_replica_written_from_shipped_bytes_has_the_same_log_and_queues(tmp_path):
    p = _store(tmp_path / "p")
    r = _store(tmp_path / "r")
    try:
        body = b"x" * 60_000
        for i in range(200):      # ~12 MB: crosses a segment end (blank filler + zeros shipped too)
            p.append(Message(topic=f"t/{i % 3}", body=body + str(i).encode(), keys=(f"k{i}",)))
        p.append_batch([Message(topic="u", body=b"small %d" % i) for i in range(500)])
        r.refuse_appends = "a replica"
        _ship(p, r, 777_777)      # odd chunk sizes: frames do not follow record boundaries
        assert r.clog.wrote == p.clog.wrote
        assert len(r.clog.mfq.files) == len(p.clog.mfq.files) >= 2
        r.dispatch.wake()
        assert r.wait_dispatched(r.clog.wrote, 20)
        for topic in ("t", "u"):
            assert r.consume_queue_offsets(topic, 0) == p.consume_queue_offsets(topic, 0)
            a = p.read_consume_queue(topic, 0, 0, 1000)
            b = r.read_consume_queue(topic, 0, 0, 1000)
            assert [(m.phys_offset, m.queue_offset, m.body, m.keys) for m in a] == \
                   [(m.phys_offset, m.queue_offset, m.body, m.keys) for m in b]
        assert [m.body for m in r.query_by_key("t/1", "k100", 0, 2**62, 5)] == [body + b"100"]
        # a replica refuses its own appends, and bytes that do not continue its log
        with pytest.raises(StoreError, match="a replica"):
            r.append(Message(topic="u", body=b"no"))
        with pytest.raises(StoreError, match="ends at"):
            r.clog.append_replicated(r.clog.wrote + 10, b"\0" * 10)
    finally:
        p.shutdown()
        r.shutdown()


def test_divergence_is_the_end_of_the_last_common_epoch():
    # same history: the replica continues where it is
    assert divergence([(1, 0), (2, 500)], 900, [(1, 0), (2, 500)], 700) == 700
    # the replica was primary of epoch 2 (from 500) that the new primary never saw; the new
    # primary took epoch 3 at 600: the replica keeps epoch 1's log up to 500 only
    assert divergence([(1, 0), (3, 600)], 900, [(1, 0), (2, 500)], 800) == 500
    # the old primary of epoch 1 wrote past where the new primary (epoch 2) began
    assert divergence([(1, 0), (2, 400)], 900, [(1, 0)], 650) == 400
    # nothing in common: from the start
    assert divergence([(5, 0)], 900, [(1, 0)], 300) == 0
    # epoch entries beyond the replica's end are not its history
    assert divergence([(1, 0), (2, 400)], 900, [(1, 0), (2, 400)], 300) == 300


def test_epoch_file_persists(tmp_path):
    f = EpochFile(str(tmp_path / "ha" / "epochs"))
    f.begin(1, 0)
    f.begin(3, 1234)
    assert EpochFile(str(tmp_path / "ha" / "epochs")).entries == [(1, 0), (3, 1234)]


def test_cut_then_reopen_cuts_the_queues_and_appends_continue_there(tmp_path, caplog):
    s = _store(tmp_path / "s")
    rs = s.append_batch([Message(topic="q", body=b"m%d" % i) for i in range(100)])
    cut_at = rs[60].phys_offset
    s.shutdown()
    ha = str(tmp_path / "ha")
    request_cut(ha, cut_at, "test: rejoining")
    assert apply_pending_cut(ha, str(tmp_path / "s")) [0] == cut_at
    assert apply_pending_cut(ha, str(tmp_path / "s")) is None       # done once
    s2 = MessageStore(StoreConfig(data_dir=str(tmp_path / "s"), segment_size=SEG, flush_mode="async"))
    s2.cut_reason = "test: rejoining"
    with caplog.at_level("WARNING", logger="lmqtt.store"):
        s2.start()
    try:
        assert s2.clog.wrote == cut_at
        assert s2.consume_queue_offsets("q", 0) == (0, 60)
        assert "cut at %d on purpose" % cut_at in caplog.text
        assert "lost" not in caplog.text.split("on purpose")[0][-200:]
        r = s2.append(Message(topic="q", body=b"new"))
        assert (r.phys_offset, r.queue_offset) == (cut_at, 60)
        s2.wait_dispatched(s2.clog.wrote, 10)
        assert [m.body for m in s2.read_consume_queue("q", 0, 58, 10)] == [b"m58", b"m59", b"new"]
    finally:
        s2.shutdown()
    assert not os.path.exists(os.path.join(ha, "cut"))


def test_a_metadata_change_is_shipped_only_after_the_log_bytes_before_it(tmp_path):
    """The primary's Shipper, in-process, to a replica played by a socket: a dedup marker made at
    log position P goes out before the bytes from P on; a batch's results (made after its append,
    at its end E) only after the bytes up to E. Shipped the other way round, a replica could hold
    "batch stored" without the batch, and answer a retry with it after a failover (a lost message
    in `lmqtt bench ha`; fails before: the results went out first)."""
    import json
    import socket
    from lmqtt.store.ha.epochs import EpochFile
    from lmqtt.store.ha.replication import FrameReader, MetaLog, Shipper, jframe
    from tests.support import free_port
    p = _store(tmp_path / "p")
    meta = MetaLog()
    epochs = EpochFile(str(tmp_path / "ha" / "epochs"))
    epochs.begin(1, 0)
    port = free_port()
    sh = Shipper(p, "127.0.0.1", port, 1, 1, epochs, meta, lambda: None, "g")
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        s.sendall(jframe(b"H", {"node": 2, "epoch": 1, "end": 0, "epochs": [[1, 0]], "segment_size": SEG}))
        rd = FrameReader(s)
        kind, _ = rd.read_one(10)
        assert kind == b"S"
        meta.add(p.clog.wrote, {"k": "remember", "what": "marker"})          # before the append
        rs = p.append_batch([Message(topic="m", body=b"b%d" % i) for i in range(50)])
        end = rs[-1].phys_offset + rs[-1].size
        meta.add(end, {"k": "remember", "what": "results"})                   # after it
        sh.wake()
        order, shipped = [], 0
        s.settimeout(10)
        while len([o for o in order if o[0] == "M"]) < 2:
            for k, payload in rd.feed(s.recv(1 << 20)):
                if k == b"D":
                    shipped = int.from_bytes(payload[:8], "big") + len(payload) - 8
                    order.append(("D", shipped))
                elif k == b"M":
                    order.append(("M", json.loads(payload)["what"], shipped))
        ms = [o for o in order if o[0] == "M"]
        assert ms[0] == ("M", "marker", 0)                  # before any of the batch's bytes
        assert ms[1][1] == "results" and ms[1][2] >= end    # only once the bytes up to its end went
    finally:
        s.close()
        sh.stop()
        p.shutdown()


def test_every_batch_marker_reaches_the_replica_before_the_batch_bytes(tmp_path):
    """Several batches appended (each: dedup marker at its start, results at its end) before the
    Shipper streams them - a busy primary, many small batches in flight (the asyncio SDK's 16
    concurrent senders): every marker must go out before any byte of its batch, every result
    only after its batch's last byte. Before: one DATA frame carried all the batches after the
    first marker, their markers behind it; a kill -9 of the primary between the two left a
    replica with batches it did not know were stored, and the retries were stored twice (the
    asyncio test's duplicates)."""
    import json
    import socket
    from lmqtt.store.ha.epochs import EpochFile
    from lmqtt.store.ha.replication import FrameReader, MetaLog, Shipper, jframe
    from tests.support import free_port
    p = _store(tmp_path / "p")
    meta = MetaLog()
    epochs = EpochFile(str(tmp_path / "ha" / "epochs"))
    epochs.begin(1, 0)
    spans = []
    for b in range(20):                  # all made before the replica connects: shipped as one backlog
        start = p.clog.wrote
        meta.add(start, {"k": "remember", "what": "marker", "b": b})
        rs = p.append_batch([Message(topic="m", body=b"b%d-%d" % (b, i)) for i in range(1 + b % 3)])
        end = rs[-1].phys_offset + rs[-1].size
        meta.add(end, {"k": "remember", "what": "results", "b": b})
        spans.append((rs[0].phys_offset, end))
    port = free_port()
    sh = Shipper(p, "127.0.0.1", port, 1, 1, epochs, meta, lambda: None, "g")
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        s.sendall(jframe(b"H", {"node": 2, "epoch": 1, "end": 0, "epochs": [[1, 0]], "segment_size": SEG}))
        rd = FrameReader(s)
        kind, _ = rd.read_one(10)
        assert kind == b"S"
        shipped, seen = 0, []
        s.settimeout(10)
        while len(seen) < 40:
            for k, payload in rd.feed(s.recv(1 << 20)):
                if k == b"D":
                    off = int.from_bytes(payload[:8], "big")
                    assert off == shipped
                    shipped = off + len(payload) - 8
                elif k == b"M":
                    op = json.loads(payload)
                    seen.append((op["what"], op["b"], shipped))
        for what, b, at in seen:
            start, end = spans[b]
            if what == "marker":
                assert at <= start, (b, at, start)       # none of its batch's bytes went first
            else:
                assert at >= end, (b, at, end)           # all of them went first
    finally:
        s.close()
        sh.stop()
        p.shutdown()
