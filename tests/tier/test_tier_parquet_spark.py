"""The cold tier in Parquet (store/spark/cold.py, --tier-parquet): `spark.read.parquet` on the tier
returns exactly the offloaded rows with the `lmqtt` source's schema and values, `read_history`
(cold Parquet + the hot tail through the source) returns every row once across the cut, a
kill -9 between a segment's object and its Parquet files leaves nothing half visible, and the
compaction merges a partition's small files into one, crash-safe (a kill -9 before or after the
manifest names the merged file: every row once, in the directory and in read_history)."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from lmqtt.store.client import connect  # noqa: E402
from tests.support import LmqttStore  # noqa: E402
from tests.tier.test_tier_node import SEG_MB, _offloaded, _tier, _wait  # noqa: E402

BODY = 8 << 10
COLS = ["topic", "payload", "qos", "retain", "client_id", "user_properties", "content_type", "born_ts",
        "store_ts", "msg_id", "queue", "offset"]


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    from lmqtt.store.spark import LmqttDataSource
    os.environ.setdefault("PYSPARK_PYTHON", __import__("sys").executable)
    s = (SparkSession.builder.master("local[2]").appName("lmqtt-tests")
         .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
         .config("spark.default.parallelism", "2").config("spark.sql.session.timeZone", "UTC")
         .config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.host", "127.0.0.1")
         .getOrCreate())
    s.sparkContext.setLogLevel("ERROR")
    s.dataSource.register(LmqttDataSource)
    yield s


def _produce(store, n: int, start: int = 0) -> list[tuple[str, bytes]]:
    """n messages: 4 in 5 to dev/<k>/t (two queue ids), 1 in 5 to other/<k> (another first level),
    with MQTT props (QoS, a user property, a content type) on some of them."""
    c = connect(store.address)
    try:
        p = c.producer()
        sent = []
        for i in range(start, start + n):
            topic = f"other/{i % 3}" if i % 5 == 4 else f"dev/{i % 4}/t"
            sent.append((topic, f"{i:06d}".encode() + os.urandom(BODY - 6)))
        for i in range(0, n, 100):
            chunk = sent[i:i + 100]
            if (start + i) % 200 == 0:
                p.send_batch(chunk)
            else:
                for t, b in chunk:
                    p.send(t, b, queue_id=(hash(t) & 1), qos=1, user_properties={"k": t[-1]}, content_type="x/y")
        return sent
    finally:
        c.close()


def _rows(df) -> list[tuple]:
    out = []
    for r in df.select(*COLS).collect():
        d = r.asDict()
        d["payload"] = bytes(d["payload"])
        d["user_properties"] = sorted((d["user_properties"] or {}).items())
        out.append(tuple(d[c] for c in COLS))
    return sorted(out, key=lambda x: (x[10], x[11]))


def _phys(msg_id: str) -> int:
    return int(msg_id[-16:], 16)


def _source(spark, store, **opts):
    r = spark.read.format("lmqtt").option("store", store.address)
    for k, v in opts.items():
        r = r.option(k, str(v))
    return r.load()


def _manifest(tier_dir) -> dict:
    return json.loads((tier_dir / "manifest.json").read_bytes())


def _keys(man: dict) -> list[str]:
    """The manifest's Parquet files, each once (a merged file is listed by each of its segments)."""
    return list(dict.fromkeys(k for e in man["segments"] for k in e["parquet"]))


def _on_disk(tier) -> list[str]:
    return sorted(str(p.relative_to(tier)) for p in (tier / "parquet").rglob("*") if p.is_file())


def _compacted(store, tier) -> dict:
    """The tier's stats once every partition's Parquet is one file (the merges done) and the
    directory holds exactly the manifest's files."""
    def done():
        s = _tier(store)
        if s["parquet_waiting_merges"] or s["uploading_segments"]:
            return None
        keys = _keys(_manifest(tier))
        if len(keys) != len({k.rsplit("/", 1)[0] for k in keys}) or _on_disk(tier) != sorted(keys):
            return None
        return s
    return _wait(done, 90, "each partition's Parquet merged into one file")


MERGE_NOW = ("--tier-parquet-file-mb", "64", "--tier-parquet-merge-after-s", "0")
NO_MERGE = ("--tier-parquet-merge-after-s", "3600")


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    """A store whose first segments are in a file:// tier with their Parquet files, and a hot tail."""
    d = tmp_path_factory.mktemp("parquet")
    (d / "data").mkdir()
    tier = d / "tier"
    store = LmqttStore(str(d / "data"), ("--segment-mb", str(SEG_MB), "--tier", f"file://{tier}",
                                         "--local-retention", "0", *MERGE_NOW))
    store.start()
    try:
        sent = _produce(store, 2000)
        _offloaded(store, 3)
        s = _compacted(store, tier)
        sent += _produce(store, 300, start=2000)          # the hot tail: in the open segment
        yield store, tier, sent, s
    finally:
        store.stop()


def test_spark_read_parquet_on_the_tier_is_exactly_the_offloaded_rows(spark, offloaded):
    store, tier, sent, s = offloaded
    man = _manifest(tier)
    assert s["parquet_segments"] == len(man["segments"]) >= 3 and s["parquet_error"] is None
    end = man["segments"][-1]["end"]
    files = _keys(man)
    assert {k.split("/")[1] for k in files} == {"first_level=dev", "first_level=other"}
    assert all(k.startswith("parquet/first_level=") and "/date=" in k for k in files)

    cold = spark.read.parquet(f"file://{tier}/parquet")
    want = [r for r in _rows(_source(spark, store, topic="dev")) + _rows(_source(spark, store, topic="other"))
            if _phys(r[9]) < end]
    got = _rows(cold)
    assert got == sorted(want, key=lambda x: (x[10], x[11]))        # every column's values
    assert 1500 < len(got) < 2000                                   # the offloaded part only
    types = {f.name: f.dataType.simpleString() for f in cold.schema.fields}
    src = {f.name: f.dataType.simpleString() for f in _source(spark, store, topic="dev").schema.fields}
    assert {c: types[c] for c in COLS} == src
    assert got[0][2] in (0, 1) and any(r[5] == [("k", "t")] for r in got) and any(r[6] == "x/y" for r in got)
    # each file sorted by topic, each topic's rows of a queue in increasing offsets (docs/spark.md)
    import pyarrow.parquet as pq
    for k in files:
        t = pq.read_table(tier / k).to_pydict()
        assert t["topic"] == sorted(t["topic"])
        per: dict = {}
        for tp, q, o in zip(t["topic"], t["queue"], t["offset"]):
            per.setdefault((tp, q), []).append(o)
        assert all(v == sorted(v) for v in per.values())


def test_compaction_leaves_one_file_per_partition_in_full_row_groups(offloaded):
    """The segments' small files (one per segment, first level and day) merged: each partition
    directory holds one file, which every segment it covers lists, whose row groups are full but
    the last, rows sorted by topic and each topic's rows in CommitLog order, the distinct topics
    named in the footer; the small files are gone."""
    import pyarrow.parquet as pq

    from lmqtt.store.tier.parquet import ROW_GROUP_ROWS, file_topics
    store, tier, _sent, s = offloaded
    man = _manifest(tier)
    keys = _keys(man)
    dirs = {k.rsplit("/", 1)[0] for k in keys}
    assert {d.split("/")[1] for d in dirs} == {"first_level=dev", "first_level=other"}
    assert len(keys) == len(dirs) and _on_disk(tier) == sorted(keys)
    assert all("-" in k.rsplit("/", 1)[1] for k in keys), keys            # <first start>-<last start>
    assert s["parquet_merges"] >= len(dirs) and s["parquet_merged_files"] >= 2 * len(dirs)
    assert s["parquet_files"] == len(keys) and s["parquet_segments"] == len(man["segments"])
    for e in man["segments"]:
        assert e["parquet"] and set(e["parquet"]) <= set(keys)
    for k in keys:
        f = pq.ParquetFile(tier / k)
        sizes = [f.metadata.row_group(i).num_rows for i in range(f.num_row_groups)]
        assert all(n == ROW_GROUP_ROWS for n in sizes[:-1]), sizes
        t = f.read(columns=["topic", "msg_id"]).to_pydict()
        rows = [(tp, _phys(m)) for tp, m in zip(t["topic"], t["msg_id"])]
        assert rows == sorted(rows)                     # by topic, then CommitLog order across the merge
        assert file_topics(f.metadata) == sorted(set(t["topic"]))
        _dictionary_only_where_values_repeat(f)


def _dictionary_only_where_values_repeat(f) -> None:
    """The columns whose values are (nearly) all distinct are written without a dictionary (a
    dictionary page then plain fallback pages cost Spark's reader ~20% more CPU than plain Parquet
    of the same rows: lmqtt bench spark --cases cold-parquet); the repeating ones keep it."""
    for g in range(f.num_row_groups):
        rg = f.metadata.row_group(g)
        enc = {rg.column(c).path_in_schema: set(rg.column(c).encodings) for c in range(rg.num_columns)}
        for c in ("msg_id", "offset", "born_ts", "store_ts"):
            assert not enc[c] & {"RLE_DICTIONARY", "PLAIN_DICTIONARY"}, (c, enc[c])
        for c in ("topic", "queue", "client_id"):
            assert "RLE_DICTIONARY" in enc[c], (c, enc[c])


def test_read_history_returns_every_row_once_across_the_cut(spark, offloaded):
    from lmqtt.store.spark import read_history
    store, tier, sent, _s = offloaded
    cut = _manifest(tier)["segments"][-1]["end"]
    for kw, match in (({"filter": "dev/+/t"}, lambda t: t.startswith("dev/")),
                      ({"filter": "#"}, lambda t: True),
                      ({"filter": "other/1"}, lambda t: t == "other/1"),
                      ({"topic": "other"}, lambda t: t.startswith("other/"))):
        df = read_history(spark, store=store.address, tier=f"file://{tier}", **kw)
        rows = df.select("topic", "payload", "msg_id").collect()
        got = sorted((r.topic, bytes(r.payload)) for r in rows)
        assert got == sorted(x for x in sent if match(x[0])), kw
        phys = [_phys(r.msg_id) for r in rows]
        assert min(phys) < cut <= max(phys), kw                      # both sides of the cut
    # a time range: the same rows as the source's own read of that range
    allrows = _rows(_source(spark, store, filter="dev/+/t"))
    ts = sorted(r[8] for r in allrows)
    t0, t1 = ts[len(ts) // 4], ts[-50]
    ms = [int(t.timestamp() * 1000) for t in (t0, t1)]
    got = _rows(read_history(spark, store=store.address, tier=f"file://{tier}", filter="dev/+/t",
                             startTime=ms[0], endTime=ms[1]))
    want = _rows(_source(spark, store, filter="dev/+/t", startTime=ms[0], endTime=ms[1]))
    assert got == want and len(got) > 100


def _pushed(df) -> str:
    """The Parquet scan's pushed filters in the executed plan of `df` (not truncated)."""
    spark = df.sparkSession
    old = spark.conf.get("spark.sql.maxMetadataStringLength")
    spark.conf.set("spark.sql.maxMetadataStringLength", "100000")
    try:
        plan = df._jdf.queryExecution().executedPlan().toString()
    finally:
        spark.conf.set("spark.sql.maxMetadataStringLength", old)
    return " ".join(line.split("PushedFilters:", 1)[1].split("ReadSchema:")[0]
                    for line in plan.splitlines() if "PushedFilters" in line)


def test_read_history_by_filter_pushes_the_matching_topics_down_and_returns_the_stores_rows(spark, offloaded):
    """read_history(filter=...): the filter is matched on the topics the cold files' footers name
    and the cold side is `topic IN (those)`, pushed to Spark's Parquet reader (row groups of other
    topics are skipped); the rows are exactly the store's own filter read (the source), every
    column, cold and hot, with and without a time range; a filter no cold topic matches reads no
    file, one whose every topic matches no predicate."""
    from lmqtt.store.spark import read_history
    store, tier, _sent, _s = offloaded
    cut = _manifest(tier)["segments"][-1]["end"]
    ts = sorted(r[8] for r in _rows(_source(spark, store, filter="dev/+/t")))
    ms = [int(t.timestamp() * 1000) for t in (ts[len(ts) // 5], ts[-40])]
    # (filter, the topics pushed down; None: every topic of the files read matches, no predicate)
    for flt, pushed in (("dev/1/t", ["dev/1/t"]), ("dev/+/t", None), ("+/1/#", ["dev/1/t", "other/1"]),
                        ("+/+", ["other/0", "other/1", "other/2"]), ("dev/7/t", None), ("#", None)):
        for rng in ({}, {"startTime": ms[0], "endTime": ms[1]}):
            df = read_history(spark, store=store.address, tier=f"file://{tier}", filter=flt, **rng)
            got = _rows(df)
            assert got == _rows(_source(spark, store, filter=flt, **rng)), (flt, rng)
            if flt != "dev/7/t":
                phys = [_phys(r[9]) for r in got]
                assert min(phys) < cut <= max(phys), (flt, rng)          # both sides of the cut
            plan = _pushed(df)
            if pushed:
                want = f"EqualTo(topic,{pushed[0]})" if len(pushed) == 1 else f"In(topic, [{','.join(pushed)}])"
                assert want in plan, plan
            elif flt == "dev/7/t":
                assert plan == "", plan                                   # no cold file read at all
            else:
                assert plan and "(topic" not in plan, plan                # every row matches: no predicate


def test_kill9_between_the_segment_and_its_parquet_leaves_nothing_half_visible(spark, tmp_path, monkeypatch):
    from lmqtt.store.spark import read_history
    tier = tmp_path / "tier"
    marker = tmp_path / "paused"
    monkeypatch.setenv("LMQTT_TIER_PAUSE", "parquet")
    monkeypatch.setenv("LMQTT_TIER_PAUSE_FILE", str(marker))
    (tmp_path / "data").mkdir()
    store = LmqttStore(str(tmp_path / "data"), ("--segment-mb", str(SEG_MB), "--tier", f"file://{tier}",
                                                "--local-retention", "0", *NO_MERGE))
    store.start()
    try:
        sent = _produce(store, 2000)
        _wait(marker.exists, 60, "the uploader to reach the pause point")
        store.kill9()
        left = sorted(str(p.relative_to(tier)) for p in tier.rglob("*") if p.is_file())
        assert any(k.endswith(".zst") for k in left) and "manifest.json" not in left, left
        assert not [k for k in left if "parquet" in k], left          # no Parquet file at all yet
        monkeypatch.delenv("LMQTT_TIER_PAUSE")
        store.start()
        s = _offloaded(store, 3)
        man = _manifest(tier)
        assert s["parquet_segments"] == len(man["segments"])
        left = sorted(str(p.relative_to(tier)) for p in tier.rglob("*") if p.is_file())
        assert left == sorted(["manifest.json"] + [e["key"] for e in man["segments"]]
                              + [k for e in man["segments"] for k in e["parquet"]])
        cold = spark.read.parquet(f"file://{tier}/parquet").select("topic", "payload").collect()
        assert len(cold) == len({(r.topic, bytes(r.payload)) for r in cold}) > 1000
        got = read_history(spark, store=store.address, tier=f"file://{tier}", filter="#").collect()
        assert sorted((r.topic, bytes(r.payload)) for r in got) == sorted(sent)
    finally:
        store.stop()


def test_a_kill9_after_the_parquet_files_before_the_manifest_rewrites_them_once(tmp_path, monkeypatch):
    """Killed after the segments' objects and Parquet files were in place but before the manifest
    named them: the restart removes what no manifest names and writes them again, once."""
    tier = tmp_path / "tier"
    marker = tmp_path / "paused"
    monkeypatch.setenv("LMQTT_TIER_PAUSE", "manifest")
    monkeypatch.setenv("LMQTT_TIER_PAUSE_FILE", str(marker))
    (tmp_path / "data").mkdir()
    store = LmqttStore(str(tmp_path / "data"), ("--segment-mb", str(SEG_MB), "--tier", f"file://{tier}",
                                                "--local-retention", "0", *NO_MERGE))
    store.start()
    try:
        _produce(store, 2000)
        _wait(marker.exists, 60, "the uploader to reach the pause point")
        store.kill9()
        before = sorted(str(p.relative_to(tier)) for p in (tier / "parquet").rglob("*.parquet"))
        assert before and "manifest.json" not in os.listdir(tier)
        monkeypatch.delenv("LMQTT_TIER_PAUSE")
        store.start()
        _offloaded(store, 3)
        man = _manifest(tier)
        after = sorted(str(p.relative_to(tier)) for p in (tier / "parquet").rglob("*") if p.is_file())
        assert after == sorted(k for e in man["segments"] for k in e["parquet"])
        assert set(before) <= set(after)
        assert _tier(store)["parquet_segments"] == len(man["segments"])
    finally:
        store.stop()


@pytest.mark.parametrize("point", ["parquet-merge", "parquet-merged"])
def test_kill9_in_a_merge_leaves_every_row_once(point, spark, tmp_path, monkeypatch):
    """`parquet-merge`: killed after the merged file's put, before the manifest names it (the
    directory holds it and the small files it merges); `parquet-merged`: after the manifest names
    it, before the small files are deleted. The restart removes what no manifest names, the
    compaction finishes, and the directory and read_history return every row once."""
    from lmqtt.store.spark import read_history
    tier = tmp_path / "tier"
    marker = tmp_path / "paused"
    monkeypatch.setenv("LMQTT_TIER_PAUSE", point)
    monkeypatch.setenv("LMQTT_TIER_PAUSE_FILE", str(marker))
    (tmp_path / "data").mkdir()
    store = LmqttStore(str(tmp_path / "data"), ("--segment-mb", str(SEG_MB), "--tier", f"file://{tier}",
                                                "--local-retention", "0", *MERGE_NOW))
    store.start()
    try:
        sent = _produce(store, 2000)
        _wait(marker.exists, 60, "the compaction to reach the pause point")
        store.kill9()
        keys = _keys(_manifest(tier))
        disk = _on_disk(tier)
        merged = [k for k in disk if "-" in k.rsplit("/", 1)[1]]
        assert len(merged) == 1, disk
        if point == "parquet-merge":
            assert merged[0] not in keys and set(keys) <= set(disk)       # the small files still named
        else:
            assert merged[0] in keys and set(disk) - set(keys)            # small files no manifest names
        monkeypatch.delenv("LMQTT_TIER_PAUSE")
        store.start()
        _offloaded(store, 3)
        _compacted(store, tier)
        man = _manifest(tier)
        cut = man["segments"][-1]["end"]
        cold = spark.read.parquet(f"file://{tier}/parquet").select("topic", "payload", "msg_id").collect()
        got = sorted((r.topic, bytes(r.payload)) for r in cold)
        assert len(got) == len(set(got)) > 1000 and all(_phys(r.msg_id) < cut for r in cold)
        assert set(got) <= set(sent)
        hist = read_history(spark, store=store.address, tier=f"file://{tier}", filter="#").collect()
        assert sorted((r.topic, bytes(r.payload)) for r in hist) == sorted(sent)
    finally:
        store.stop()


# ------------------------------------------------------------- the files' topic lists in the manifest
def _file_topics_on_disk(tier, key: str):
    """The distinct topics of a tier Parquet file, read from its rows (not its footer)."""
    import pyarrow.parquet as pq
    return sorted(set(pq.read_table(tier / key, columns=["topic"]).column("topic").to_pylist()))


def _listed(man: dict) -> dict:
    """key -> the topic list (or "many") the manifest records for that Parquet file."""
    pt = man["parquet_topics"]
    return {k: v if v == "many" else pt["lists"][v] for k, v in pt["files"].items()}


def _produce_many_topics(store, n: int) -> None:
    """n small messages, each to a topic of its own (many/<i>), in one batch."""
    c = connect(store.address)
    try:
        c.producer().send_batch([(f"many/{i}", b"x") for i in range(n)])
    finally:
        c.close()


def test_the_manifest_lists_each_parquet_files_topics_after_upload_and_after_a_merge(tmp_path):
    """Uploaded: the manifest names each Parquet file's distinct topics (the rows' own, sorted), or
    "many" for a file of more than 4,096; merged (a restart with the compaction on): each merged
    file's list is the union of its inputs' ("many" stays "many"), and the lists name exactly the
    files the segments name (the merged-away ones gone)."""
    tier = tmp_path / "tier"
    (tmp_path / "data").mkdir()
    args = ("--segment-mb", str(SEG_MB), "--tier", f"file://{tier}", "--local-retention", "0")
    store = LmqttStore(str(tmp_path / "data"), (*args, *NO_MERGE))
    store.start()
    try:
        _produce_many_topics(store, 4200)
        _produce(store, 2000)
        _offloaded(store, 3)
        man = _manifest(tier)
        keys = _keys(man)
        listed = _listed(man)
        assert sorted(listed) == sorted(keys) and len(keys) > 3
        many = [k for k in keys if "first_level=many/" in k]
        assert listed[many[0]] == "many" and len(_file_topics_on_disk(tier, many[0])) > 4096
        for k in keys:
            if listed[k] != "many":
                assert listed[k] == _file_topics_on_disk(tier, k), k
        assert not [k for k in keys if "-" in k.rsplit("/", 1)[1]]        # no merge yet
        before = listed
        small: dict = {}
        for k in keys:
            small.setdefault(k.rsplit("/", 1)[0], []).append(k)
    finally:
        store.stop()
    store = LmqttStore(str(tmp_path / "data"), (*args, *MERGE_NOW))
    store.start()
    try:
        _offloaded(store, 3)
        _compacted(store, tier)
        man = _manifest(tier)
        keys = _keys(man)
        listed = _listed(man)
        assert sorted(listed) == sorted(keys)
        merged = [k for k in keys if "-" in k.rsplit("/", 1)[1]]
        assert [k for k in merged if "first_level=dev/" in k] and [k for k in merged if "first_level=other/" in k]
        for k in keys:
            inputs = small[k.rsplit("/", 1)[0]]
            if any(before[f] == "many" for f in inputs):
                assert listed[k] == "many", k
            else:
                assert listed[k] == sorted({t for f in inputs for t in before[f]}) == _file_topics_on_disk(tier, k), k
    finally:
        store.stop()


@pytest.fixture
def footer_reads(monkeypatch):
    """The paths of the tier's *.parquet files this process opens through fsspec (where read_history
    reads a footer on the driver; Spark's own reads are in the JVM and not counted)."""
    from fsspec.implementations.local import LocalFileSystem
    opened: list[str] = []
    real = LocalFileSystem._open

    def counting(self, path, *a, **kw):
        if str(path).endswith(".parquet"):
            opened.append(str(path))
        return real(self, path, *a, **kw)
    monkeypatch.setattr(LocalFileSystem, "_open", counting)
    return opened


FILTERS = ("dev/1/t", "+/1/#", "+/+", "dev/7/t", "dev/+/t")


def test_read_history_by_filter_reads_no_footer_when_the_manifest_lists_the_topics(spark, offloaded, footer_reads):
    """The filter is matched against the manifest's lists (one manifest read): no Parquet file is
    opened on the driver, and the rows are exactly the store's own filter read."""
    from lmqtt.store.spark import read_history
    store, tier, _sent, _s = offloaded
    assert set(_listed(_manifest(tier))) == set(_keys(_manifest(tier)))
    for flt in FILTERS:
        df = read_history(spark, store=store.address, tier=f"file://{tier}", filter=flt)
        assert footer_reads == [], (flt, footer_reads)
        assert _rows(df) == _rows(_source(spark, store, filter=flt)), flt


def test_read_history_over_a_manifest_without_lists_reads_the_footers(spark, offloaded, footer_reads, tmp_path):
    """A tier an older version wrote (its manifest has no `parquet_topics`): the footers are read
    (one per cold file of the filter's first levels) and the rows are the same; a manifest listing
    only some files reads only the others' footers."""
    import shutil

    from lmqtt.store.spark import read_history
    store, tier, _sent, _s = offloaded
    man = _manifest(tier)
    keys = _keys(man)
    old = tmp_path / "old-tier"
    shutil.copytree(tier, old)
    old_man = {k: v for k, v in man.items() if k != "parquet_topics"}
    (old / "manifest.json").write_text(json.dumps(old_man))
    for flt in FILTERS:
        footer_reads.clear()
        df = read_history(spark, store=store.address, tier=f"file://{old}", filter=flt)
        assert footer_reads, flt
        assert _rows(df) == _rows(_source(spark, store, filter=flt)), flt
    # only the dev/ file listed: only the other/ files' footers are read
    dev = [k for k in keys if "first_level=dev/" in k]
    part = dict(old_man, parquet_topics={"lists": [_listed(man)[dev[0]]], "files": {dev[0]: 0}})
    (old / "manifest.json").write_text(json.dumps(part))
    footer_reads.clear()
    df = read_history(spark, store=store.address, tier=f"file://{old}", filter="+/1/#")
    assert footer_reads and not [p for p in footer_reads if "first_level=dev/" in p], footer_reads
    assert _rows(df) == _rows(_source(spark, store, filter="+/1/#"))
