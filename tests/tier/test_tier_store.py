"""Tiered storage on a real MessageStore (store/tier): sealed segments go to a real tier (`file://`
and an S3 API over HTTP: moto's server process), local files go once the tier holds them, and
every read by offset of an offloaded range is served from the tier, byte-identical."""
from __future__ import annotations

import json
import logging
import os
import time

import pytest

from lmqtt.store import MessageStore, StoreConfig
from lmqtt.store.delayed import DelayedMessages
from lmqtt.store.errors import CorruptRecord
from lmqtt.store.message import Message
from lmqtt.store.tier.config import TierConfig, parse_retention
from lmqtt.store.tier.reads import TierReadError

SEG = 64 << 10


def _wait(cond, timeout: float = 30.0, what: str = "condition"):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _tier_url(kind: str, tmp_path, moto_s3=None, endpoint=None):
    if kind == "file":
        return f"file://{tmp_path / 'tier'}", None
    bucket = moto_s3.new_bucket()
    return f"s3://{bucket}/node1", endpoint or moto_s3.endpoint


def _plain_store(data_dir) -> MessageStore:
    """A MessageStore of small segments, not started, without a tier."""
    return MessageStore(StoreConfig(data_dir=str(data_dir), segment_size=SEG, max_message_size=16 << 10,
                                    preallocate=False))


def _store(data_dir, url, endpoint, **tier_kw) -> MessageStore:
    st = _plain_store(data_dir)
    kw = {"local_retention_ms": 0, "upload_interval_ms": 50, "timeout_s": 5.0}
    kw.update(tier_kw)
    st.enable_tier(TierConfig(url=url, endpoint=endpoint, **kw))
    st.start()
    return st


def _append(st, n: int, tag: str = "m"):
    msgs = [Message(topic=f"plant/{i % 4}/t", body=(f"{tag}{i}:".encode() + os.urandom(40) + b"." * 400),
                    props=bytes([i % 251]) * (i % 7), keys=(f"k{i}",) if i % 50 == 0 else ())
            for i in range(n)]
    rs = st.append_batch(msgs)
    st.clog.flush()
    st.wait_dispatched(st.max_offset, 10)
    return msgs, rs


def _offloaded(st, keep: int = 1):
    def done():
        st.delete_expired_segments()
        s = st.tier_stats()
        return s if s["uploading_segments"] == 0 and s["local_segments"] <= keep and s["tier_segments"] else None
    return _wait(done, 30, "segments moved to the tier")


def _same(got, want):
    assert (got.topic, bytes(got.body), bytes(got.props), tuple(got.keys)) == \
           (want.topic, bytes(want.body), bytes(want.props), tuple(want.keys))


def _tier_keys(kind, tmp_path, moto_s3, url):
    if kind == "file":
        root = tmp_path / "tier"
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    bucket, prefix = url[len("s3://"):].split("/", 1)
    return [k[len(prefix) + 1:] for k in moto_s3.keys(bucket, prefix + "/")]


def _manifest(kind, tmp_path, moto_s3, url) -> dict:
    if kind == "file":
        return json.loads((tmp_path / "tier" / "manifest.json").read_bytes())
    bucket, prefix = url[len("s3://"):].split("/", 1)
    return json.loads(moto_s3.client().get_object(Bucket=bucket, Key=f"{prefix}/manifest.json")["Body"].read())


@pytest.fixture(params=["file", "s3"])
def kind(request):
    return request.param


@pytest.fixture
def s3(kind, request):
    return request.getfixturevalue("moto_s3") if kind == "s3" else None


def test_segments_move_to_the_tier_and_reads_by_offset_come_back_byte_identical(kind, s3, tmp_path):
    url, ep = _tier_url(kind, tmp_path, s3)
    st = _store(tmp_path / "data", url, ep)
    try:
        msgs, rs = _append(st, 3000)
        s = _offloaded(st)
        # local files went, only the active segment is left; the tier holds the rest
        assert sorted(os.listdir(tmp_path / "data" / "commitlog")) == [f"{st.clog.mfq.min_offset:020d}"]
        assert s["tier_min_offset"] == 0 and s["tier_end_offset"] == st.clog.mfq.min_offset
        assert st.min_offset == 0 and rs[0].phys_offset < st.clog.mfq.min_offset
        keys = _tier_keys(kind, tmp_path, s3, url)
        man = _manifest(kind, tmp_path, s3, url)
        assert keys == sorted(["manifest.json"] + [e["key"] for e in man["segments"]])
        assert all(k.endswith(".zst") for k in keys if k != "manifest.json")          # zstd-compressed
        assert s["tier_stored_bytes"] < s["tier_raw_bytes"]
        # every read path by offset: read, read_many, the ConsumeQueue, the key index, msg id
        for i in (0, 1, 777, 2999):
            _same(st.read(rs[i].phys_offset), msgs[i])
        got = st.read_many([(r.phys_offset, r.size) for r in rs])
        for g, m in zip(got, msgs):
            _same(g, m)
        cq = [m for q in range(1) for m in st.read_consume_queue("plant", q, 0, 10_000)]
        assert len(cq) == 3000
        for g, m in zip(cq, msgs):
            _same(g, m)
        _same(st.get_by_msg_id(rs[50].msg_id), msgs[50])
        assert [m.body for m in st.query_by_key("plant/2/t", "k50", 0, 2 ** 62, 5)] == [msgs[50].body]
        assert st.tier_stats()["cache_misses"] >= 1
    finally:
        st.shutdown()
    # a new process: nothing cached, the local manifest copy and the tier serve the old range
    st = _store(tmp_path / "data", url, ep)
    try:
        got = st.read_many([(r.phys_offset, r.size) for r in rs])
        for g, m in zip(got, msgs):
            _same(g, m)
    finally:
        st.shutdown()


def test_a_corrupted_tier_object_is_detected_by_its_checksum_and_not_served(kind, s3, tmp_path, caplog):
    url, ep = _tier_url(kind, tmp_path, s3)
    st = _store(tmp_path / "data", url, ep)
    try:
        msgs, rs = _append(st, 600)
        _offloaded(st)
        man = _manifest(kind, tmp_path, s3, url)
        key = man["segments"][0]["key"]
        if kind == "file":
            p = tmp_path / "tier" / key
            b = bytearray(p.read_bytes())
            b[len(b) // 2] ^= 0xFF
            p.write_bytes(bytes(b))
        else:
            bucket, prefix = url[len("s3://"):].split("/", 1)
            c = s3.client()
            b = bytearray(c.get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read())
            b[len(b) // 2] ^= 0xFF
            c.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=bytes(b))
        caplog.set_level(logging.ERROR, "lmqtt.store")
        with pytest.raises(CorruptRecord, match="sha256"):
            st.read(rs[0].phys_offset)
        got = st.read_many([(r.phys_offset, r.size) for r in rs[:5]])
        assert all(isinstance(g, CorruptRecord) for g in got)
        assert st.tier_stats()["corrupt_objects"] == 1
        assert any("is corrupt" in r.getMessage() and key in r.getMessage() for r in caplog.records)
        # the other segments are served
        last_seg = man["segments"][-1]
        later = [(r, m) for r, m in zip(rs, msgs) if r.phys_offset >= last_seg["start"]]
        _same(st.read(later[0][0].phys_offset), later[0][1])
    finally:
        st.shutdown()


def test_the_tier_unreachable_the_store_keeps_serving_keeps_local_files_and_catches_up(moto_s3, s3_proxy, tmp_path):
    bucket = moto_s3.new_bucket()
    url = f"s3://{bucket}/n"
    st = _store(tmp_path / "data", url, s3_proxy.endpoint)
    try:
        msgs1, rs1 = _append(st, 500, "a")
        _offloaded(st)
        s3_proxy.down()
        msgs2, rs2 = _append(st, 1500, "b")
        sealed = len(st.clog.mfq.files) - 1
        assert sealed >= 5
        _wait(lambda: st.tier_stats()["error"], 30, "the uploader to notice")
        for _ in range(3):
            st.delete_expired_segments()
        s = st.tier_stats()
        assert s["error"] and "failed" in s["error"]
        assert s["uploading_segments"] == sealed and len(st.clog.mfq.files) == sealed + 1   # nothing deleted
        # the store keeps serving: appends, reads of local data
        msgs3, rs3 = _append(st, 10, "c")
        _same(st.read(rs2[0].phys_offset), msgs2[0])
        # a read of the offloaded range fails loudly while the tier is away (nothing skipped)
        st.tier.cache.clear()
        st.tier.cache_bytes = 0
        with pytest.raises(TierReadError, match="retry"):
            st.read(rs1[0].phys_offset)
        s3_proxy.up()
        _offloaded(st)
        _wait(lambda: st.tier_stats()["error"] is None and st.tier_stats()["reachable"], 30, "the tier reachable")
        got = st.read_many([(r.phys_offset, r.size) for r in rs1 + rs2 + rs3])
        for g, m in zip(got, msgs1 + msgs2 + msgs3):
            _same(g, m)
        man = json.loads(moto_s3.client().get_object(Bucket=bucket, Key="n/manifest.json")["Body"].read())
        assert [e["start"] for e in man["segments"]] == [i * SEG for i in range(len(man["segments"]))]
    finally:
        s3_proxy.up() if s3_proxy._srv is None else None
        st.shutdown()


def test_local_files_stay_until_uploaded_and_local_retention_allows(tmp_path):
    url = f"file://{tmp_path / 'tier'}"
    st = _store(tmp_path / "data", url, None, local_retention_ms=3600_000, local_retention_bytes=4 * SEG)
    try:
        _append(st, 2000)
        _wait(lambda: st.tier_stats()["uploading_segments"] == 0 and st.tier_stats()["tier_segments"] > 4, 30,
              "uploads")
        # the size limit keeps 4 segments' worth locally (the hour has not passed); once the
        # dispatchers' checkpoints are past them (flushed every second)
        _wait(lambda: st.delete_expired_segments() is not None and len(st.clog.mfq.files) <= 4, 10, "local deletes")
        time.sleep(0.3)
        st.delete_expired_segments()
        assert len(st.clog.mfq.files) == 4
        st.delete_expired_segments(now_ms=int(time.time() * 1000) + 3700_000)
        assert len(st.clog.mfq.files) == 1
    finally:
        st.shutdown()


def test_tier_retention_drops_old_segments_from_the_tier_then_the_queues(tmp_path):
    url = f"file://{tmp_path / 'tier'}"
    st = _store(tmp_path / "data", url, None, tier_retention_ms=3600_000)
    try:
        msgs, rs = _append(st, 2000)
        s = _offloaded(st)
        n = s["tier_segments"]
        st.delete_expired_segments(now_ms=int(time.time() * 1000) + 3700_000)
        s = st.tier_stats()
        assert s["tier_segments"] == 0 and s["tier_deleted"] == n
        assert st.min_offset == st.clog.mfq.min_offset
        assert sorted(os.listdir(tmp_path / "tier" / "commitlog")) == []
        assert len(st.read_consume_queue("plant", 0, 0, 10_000)) < 2000
    finally:
        st.shutdown()


def test_a_delayed_message_due_after_local_retention_is_released_from_the_tier(tmp_path):
    """https://github.com/apache/rocketmq/issues/9006: a delayed message whose parked record's segment left the local disk
    before its due time was lost. Here the parked record is read back from the tier."""
    from tests.store.test_timer import Clock
    url = f"file://{tmp_path / 'tier'}"
    st = _store(tmp_path / "data", url, None)
    try:
        clock = Clock(time.time())
        d = DelayedMessages(st, str(tmp_path / "timer"), clock=clock, precision_ms=100, wheel_ticks=64)
        t0 = clock.t
        r = d.schedule(Message("cmd/valve", b"open-later", props=b"\x07"), int((t0 + 60) * 1000))
        r.durable.result(5)
        _append(st, 2000)
        _offloaded(st)
        assert r.phys_offset < st.clog.mfq.min_offset          # its segment is gone from the disk
        clock.t = t0 + 61
        d.wheel.fire_due()
        st.wait_dispatched(st.max_offset, 10)
        got = [m for m in st.read_consume_queue("cmd", 0, 0, 100) if m.topic == "cmd/valve"]
        assert [(bytes(m.body), bytes(m.props)) for m in got] == [(b"open-later", b"\x07")]
        d.close()
    finally:
        st.shutdown()


def test_retention_flags_parse_and_bad_urls_are_refused(tmp_path):
    assert parse_retention("72h", "x") == (72 * 3600_000, None)
    assert parse_retention("20GB,30d", "x") == (30 * 86_400_000, 20 * 10 ** 9)
    assert parse_retention("0", "x") == (0, None)
    with pytest.raises(ValueError, match="--local-retention: 'abc'"):
        TierConfig.from_flags("file:///tmp/x", local_retention="abc")
    with pytest.raises(ValueError, match="--tier must be a URL"):
        TierConfig.from_flags("/tmp/x")
    assert TierConfig.from_flags("file:///x", tier_retention="forever").tier_retention_ms is None


def test_a_tier_of_another_store_is_refused(tmp_path):
    url = f"file://{tmp_path / 'tier'}"
    st = _store(tmp_path / "a", url, None)
    try:
        _append(st, 600)
        _offloaded(st)
    finally:
        st.shutdown()
    st = _store(tmp_path / "b", url, None)
    try:
        _append(st, 600)
        err = _wait(lambda: st.tier_stats()["error"], 20, "the mismatch")
        assert "own --tier prefix" in err
        st.delete_expired_segments()
        assert len(st.clog.mfq.files) > 1                     # nothing deleted locally
    finally:
        st.shutdown()


def test_the_read_cache_stays_within_its_bound(tmp_path):
    url = f"file://{tmp_path / 'tier'}"
    st = _store(tmp_path / "data", url, None, cache_bytes=2 * SEG)
    try:
        msgs, rs = _append(st, 3000)
        s = _offloaded(st)
        assert s["tier_segments"] > 4
        for _ in range(2):
            got = st.read_many([(r.phys_offset, r.size) for r in rs])
            assert [bytes(g.body) for g in got] == [m.body for m in msgs]
            assert st.tier.cache_bytes <= 2 * SEG and len(st.tier.cache) <= 2
        s = st.tier_stats()
        assert s["cache_misses"] == 2 * s["tier_segments"] and s["cache_bytes"] <= 2 * SEG
    finally:
        st.shutdown()


def test_a_missing_bucket_is_one_clear_error_and_nothing_local_goes(moto_s3, tmp_path):
    st = _store(tmp_path / "data", "s3://no-such-bucket-here/x", moto_s3.endpoint)
    try:
        msgs, rs = _append(st, 1000)
        err = _wait(lambda: st.tier_stats()["error"], 20, "the error")
        assert "the bucket 'no-such-bucket-here' does not exist" in err
        st.delete_expired_segments()
        assert len(st.clog.mfq.files) > 5 and st.tier_stats()["uploading_segments"] == len(st.clog.mfq.files) - 1
        _same(st.read(rs[0].phys_offset), msgs[0])
    finally:
        st.shutdown()


def test_a_merged_parquet_file_stays_until_the_last_segment_it_holds_rows_of_is_dropped(tmp_path):
    """Parquet compaction under tier retention: the small files of many segments are merged into
    one, which every segment it covers lists; retention dropping the first segments keeps it (the
    later ones still need it), dropping the last one deletes it."""
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from lmqtt.store.tier.parquet import ColumnarWriter
    st = _plain_store(tmp_path / "data")
    st.enable_tier(TierConfig(url=f"file://{tmp_path / 'tier'}", local_retention_ms=0, upload_interval_ms=50,
                              timeout_s=5.0, parquet_merge_after_ms=0, tier_retention_ms=None))
    st.tier.columnar = ColumnarWriter(st)
    st.start()
    try:
        _append(st, 2000)
        _offloaded(st)
        tier = tmp_path / "tier"

        def one_file():
            keys = {k for e in json.loads((tier / "manifest.json").read_bytes())["segments"] for k in e["parquet"]}
            on_disk = {str(p.relative_to(tier)) for p in (tier / "parquet").rglob("*") if p.is_file()}
            return keys if len(keys) == 1 and keys == on_disk and not st.tier_stats()["parquet_waiting_merges"] else None
        (key,) = _wait(one_file, 30, "the segments' Parquet merged into one file")
        segs = json.loads((tier / "manifest.json").read_bytes())["segments"]
        assert len(segs) > 3 and all(e["parquet"] == [key] for e in segs)
        rows = pq.ParquetFile(tier / key).metadata.num_rows
        # retention drops the first two segments: the merged file stays (the others hold rows of it)
        st.tier.cfg.tier_retention_bytes = sum(e["stored"] for e in segs[2:])
        st.tier.housekeep()
        man = json.loads((tier / "manifest.json").read_bytes())
        assert [e["start"] for e in man["segments"]] == [e["start"] for e in segs[2:]]
        assert (tier / key).exists() and pq.ParquetFile(tier / key).metadata.num_rows == rows
        assert all(e["parquet"] == [key] for e in man["segments"])
        # ... and the last of them: the file goes
        st.tier.cfg.tier_retention_bytes = 0
        st.tier.housekeep()
        assert json.loads((tier / "manifest.json").read_bytes())["segments"] == []
        assert not [p for p in (tier / "parquet").rglob("*") if p.is_file()]
    finally:
        st.shutdown()


def test_a_segments_parquet_files_have_no_dictionary_on_their_distinct_columns(tmp_path):
    """The per-segment Parquet files (before any merge) are dictionary-encoded only on the columns
    whose values repeat: msg_id, offset and the timestamps are plain (a dictionary page and then
    plain fallback pages there cost Spark's reader more than plain Parquet: BENCHMARKS.md)."""
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmqtt.store.tier.parquet import segment_files
    st = _plain_store(tmp_path / "data")
    st.start()
    try:
        _append(st, 2000)
        mf = st.clog.mfq.files[0]
        files = segment_files(bytes(mf.mm), mf.start_offset, st.ident)
        assert files
        for _key, data in files:
            f = pq.ParquetFile(pa.BufferReader(data))
            assert f.metadata.num_rows > 0
            rg = f.metadata.row_group(0)
            enc = {rg.column(c).path_in_schema: set(rg.column(c).encodings) for c in range(rg.num_columns)}
            for c in ("msg_id", "offset", "born_ts", "store_ts"):
                assert not enc[c] & {"RLE_DICTIONARY", "PLAIN_DICTIONARY"}, (c, enc[c])
            assert "RLE_DICTIONARY" in enc["topic"] and "RLE_DICTIONARY" in enc["queue"]
    finally:
        st.shutdown()


def test_segment_files_and_their_merge_are_sorted_by_topic_each_topic_in_commitlog_order(tmp_path):
    """A segment's Parquet files and the merge of a partition's files (compaction) hold their rows
    sorted by topic, each topic's rows in CommitLog order (so in offset order within a queue), in
    full row groups, the distinct topics named in the footer; a merge sorting one range of topics
    at a time (a bounded pass) writes the same file as one sorting everything at once."""
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmqtt.store.tier.parquet import file_topics, merge_files, segment_files
    st = _plain_store(tmp_path / "data")
    st.start()
    try:
        _append(st, 2000)
        sealed = st.clog.mfq.files[:-1]
        assert len(sealed) >= 5
        inputs, every = [], []
        for mf in sealed:
            files = segment_files(bytes(mf.mm), mf.start_offset, st.ident)
            assert len(files) == 1                      # one first level, one day
            data = files[0][1]
            t = pq.read_table(pa.BufferReader(data)).to_pydict()
            rows = [(tp, int(m[-16:], 16), q, o) for tp, m, q, o in zip(t["topic"], t["msg_id"], t["queue"], t["offset"])]
            assert rows == sorted(rows) and len({r[1] for r in rows}) == len(rows)
            assert file_topics(pq.read_metadata(pa.BufferReader(data))) == sorted(set(t["topic"]))
            inputs.append(data)
            every += rows
        want = sorted(every)                             # (topic, CommitLog offset)
        merged = []
        for pass_rows in (1 << 30, 1, 700):              # all at once, one topic a pass, ranges of topics
            data, n = merge_files(iter(inputs), row_group_rows=128, pass_rows=pass_rows)
            f = pq.ParquetFile(pa.BufferReader(data))
            t = f.read().to_pydict()
            got = [(tp, int(m[-16:], 16), q, o) for tp, m, q, o in zip(t["topic"], t["msg_id"], t["queue"], t["offset"])]
            assert n == len(want) and got == want, pass_rows
            per_queue: dict = {}
            for tp, _p, q, o in got:
                per_queue.setdefault((tp, q), []).append(o)
            assert all(v == sorted(v) for v in per_queue.values())
            sizes = [f.metadata.row_group(i).num_rows for i in range(f.num_row_groups)]
            assert all(x == 128 for x in sizes[:-1]) and sum(sizes) == n, sizes
            assert file_topics(f.metadata) == ["plant/0/t", "plant/1/t", "plant/2/t", "plant/3/t"]
            merged.append(f.read())
        assert merged[0].equals(merged[1]) and merged[0].equals(merged[2])
    finally:
        st.shutdown()


def test_a_filters_history_in_the_tier_is_read_by_the_raw_scan_and_equals_a_decoded_read(tmp_path):
    """A wildcard filter's history whose records are offloaded: `read_from` scans the tier's cached
    segments as it scans local ones (records as stored, `Got.chunks`; it decoded every record, up
    to 65,536 per read of 256), and returns exactly the records a decoding read of the queue finds,
    in CommitLog order, page after page."""
    import struct

    from lmqtt.lightqueue import history as H
    from lmqtt.lightqueue.topics import topic_matches
    from lmqtt.store import protocol as W
    from lmqtt.store.client.consumer import decode_reply
    st = _store(tmp_path / "data", f"file://{tmp_path / 'tier'}", None)
    try:
        msgs, _rs = _append(st, 3000)
        st.append_batch([Message(topic="filler/x", body=b"f" * 8000) for _ in range(2 * SEG // 8000 + 4)])
        st.clog.flush()
        st.wait_dispatched(st.max_offset, 10)
        _offloaded(st)
        flt = "plant/+/t"
        want = [m for m in st.read_consume_queue("plant", 0, 0, 10_000) if topic_matches(flt, m.topic)]
        assert len(want) == 3000 and want[0].phys_offset < st.clog.mfq.min_offset       # in the tier
        got, pos, raw_pages = [], st.min_offset, 0
        for _ in range(1000):
            g, nxt, _h = H.read_from(st, None, flt, pos, max_count=256)
            if g.msgs is None:
                raw_pages += 1
                data = b"".join(bytes(c) for c in g.chunks)
                got += decode_reply("", struct.pack(">I", 2) + b"{}" + struct.pack(">I", g.count) + data, W.F_RAW)[1]
            else:
                got += [m for m in g.msgs]
            if nxt == pos:
                break
            pos = nxt
        assert raw_pages >= 3000 // 256, raw_pages
        offsets = [getattr(r, "offset", None) if hasattr(r, "offset") else r.phys_offset for r in got]
        assert offsets == [m.phys_offset for m in want]
        assert [r.body for r in got] == [m.body for m in want]
    finally:
        st.shutdown()
