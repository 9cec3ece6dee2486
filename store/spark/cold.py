"""The cold tier in Parquet: what Spark scans natively, and `read_history`, cold Parquet + hot tail.

Writer (`segment_files`, `ColumnarWriter`): the tier service (store/tier/service.py) uploads a
sealed CommitLog segment, then hands its bytes to the node's columnar hook, which returns the
segment's records as Parquet files of the `lmqtt` source's schema (SCHEMA, props decoded as the
source decodes them) split by first-level topic and UTC day of store time:

    <tier>/parquet/first_level=<first-level topic>/date=<YYYY-MM-DD>/<20-digit segment start>.parquet

Each file holds exactly the segment's records of that first level and day, in CommitLog order
(so each queue's rows, and the row groups, are in offset order). The partition column is called
`first_level`, not `topic`: Spark gives a partition column the value of the path, and one named
like the data column `topic` would replace every full topic by its first level.

`read_history(spark, store=..., tier=..., filter=... | topic=..., startTime=, endTime=)`: one
DataFrame of a filter's (or a first-level topic's) history = the Parquet files of the manifest's
segments below a cut (one CommitLog offset, read once from the manifest) UNION the hot tail read
through the `lmqtt` source from that same CommitLog offset (its `fromPosition` option). Every
record has one CommitLog offset, below the cut or not: each row comes once (docs/spark.md).
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import re

from lmqtt.store.mapped_file import file_name
from lmqtt.store.record import HEADER, HEADER_SIZE, MSG_MAGIC

log = logging.getLogger("lmqtt.spark")

PARQUET_DIR = "parquet"
ROW_GROUP_ROWS = 1 << 17
# zstd: half the bytes of snappy for the same read speed in Spark (BENCHMARKS.md, Spark over the cold tier)
COMPRESSION = "zstd"
DAY_MS = 86_400_000
# Dictionary encoding only where values repeat (topics, payloads, properties, the queue): on a column
# whose values are all or nearly all distinct (msg_id, offset, the two timestamps) pyarrow writes a
# dictionary page and then falls back to plain pages within each column chunk (Spark's own writer
# drops the dictionary there), and Spark's reader paid ~0.5-0.7 CPU-s more per 10M rows for it
# than for plain Parquet of the same rows; without it the cold copy needs less CPU than plain
# Parquet and is ~45% smaller (52 -> 29 MB per 10M rows). BENCHMARKS.md, Spark over the cold tier.
DICTIONARY_COLUMNS = ["topic", "payload", "qos", "client_id", "user_properties.key_value.key",
                      "user_properties.key_value.value", "content_type", "queue"]
# characters Spark/Hive escape in a partition value (ExternalCatalogUtils.escapePathName), as %XX
_ESCAPE = set('"#%\'*/:=?\\\x7f{[]^') | {chr(c) for c in range(0x20)}
PARTITION_COLUMNS = "first_level string, date string"


def escape_value(v: str) -> str:
    return "".join(f"%{ord(c):02X}" if c in _ESCAPE else c for c in v)


def parquet_key(first_level: str, day: int, start: int) -> str:
    date = (_dt.datetime(1970, 1, 1) + _dt.timedelta(days=day)).date().isoformat()
    return f"{PARQUET_DIR}/first_level={escape_value(first_level)}/date={date}/{file_name(start)}.parquet"


def _walk(buf, start: int):
    """(count, per-record group index, groups [(first level, day)], per-record queue index,
    queue keys) of the records of segment bytes `buf` (stops at the blank filler or zeros)."""
    unpack = HEADER.unpack_from
    n = len(buf)
    pos = 0
    gidx: list[int] = []
    qidx: list[int] = []
    groups: dict = {}
    queues: dict = {}
    while pos + HEADER_SIZE <= n:
        (total, magic, _crc, qid, _f, _qo, phys, _b, sts, _t, bl, pl, tl, kl, dl) = unpack(buf, pos)
        if magic != MSG_MAGIC:
            break
        if phys != start + pos or total != HEADER_SIZE + tl + kl + dl + pl + bl or pos + total > n:
            raise ValueError(f"segment {start}: no valid record at offset {start + pos}")
        topic = bytes(buf[pos + HEADER_SIZE:pos + HEADER_SIZE + tl])
        i = topic.find(b"/")
        fl = topic if i < 0 else topic[:i]
        g = (fl, sts // DAY_MS)
        gi = groups.get(g)
        if gi is None:
            gi = groups[g] = len(groups)
        gidx.append(gi)
        qk = (fl, qid)
        qi = queues.get(qk)
        if qi is None:
            qi = queues[qk] = len(queues)
        qidx.append(qi)
        pos += total
    return (len(gidx), gidx, [(fl.decode("utf-8", "replace"), d) for fl, d in groups],
            qidx, [f"{fl.decode('utf-8', 'replace')}:{q}" for fl, q in queues])


def segment_table(buf, start: int, ident: str):
    """(pyarrow Table in the source's schema, per-row group index, groups) of one segment."""
    import pyarrow as pa

    from .columns import COLUMNS, _props_dictionary, body_columns
    count, gidx, groups, qidx, qkeys = _walk(buf, start)
    data = bytes(buf)
    (qo, _po, born, st, t_off, t_dat, p_off, p_dat, b_off, b_dat, m_off, m_dat) = body_columns(
        data, 0, count, ident, raw=True)
    n = count
    b = pa.py_buffer
    ts = pa.timestamp("us", tz="UTC")
    props = pa.Array.from_buffers(pa.binary(), n, [None, b(p_off), b(p_dat)])
    (qos_d, retain_d, cid_d, up_d, ct_d), idx = _props_dictionary(props)
    qidx_a = pa.array(qidx, pa.int32())
    table = pa.Table.from_arrays([
        pa.Array.from_buffers(pa.string(), n, [None, b(t_off), b(t_dat)]),
        pa.Array.from_buffers(pa.binary(), n, [None, b(b_off), b(b_dat)]),
        qos_d.take(idx), retain_d.take(idx), cid_d.take(idx), up_d.take(idx), ct_d.take(idx),
        pa.Array.from_buffers(ts, n, [None, b(born)]),
        pa.Array.from_buffers(ts, n, [None, b(st)]),
        pa.Array.from_buffers(pa.string(), n, [None, b(m_off), b(m_dat)]),
        pa.array(qkeys, pa.string()).take(qidx_a),
        pa.Array.from_buffers(pa.int64(), n, [None, b(qo)]),
    ], names=COLUMNS)
    return table, gidx, groups


def segment_files(buf, start: int, ident: str, row_group_rows: int = ROW_GROUP_ROWS) -> list[tuple[str, bytes]]:
    """The Parquet files (key under the tier root, bytes) of the sealed segment `buf` starting at
    CommitLog offset `start`: one per (first-level topic, UTC day of store time), rows in
    CommitLog order, zstd, dictionary-encoded only in DICTIONARY_COLUMNS. [] for a segment without
    records."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    table, gidx, groups = segment_table(buf, start, ident)
    if table.num_rows == 0:
        return []
    out = []
    g_arr = pa.array(gidx, pa.int32()) if len(groups) > 1 else None
    for gi, (fl, day) in enumerate(groups):
        part = table if g_arr is None else table.filter(pc.equal(g_arr, gi))
        sink = pa.BufferOutputStream()
        pq.write_table(part, sink, compression=COMPRESSION, row_group_size=row_group_rows,
                       use_dictionary=DICTIONARY_COLUMNS)
        out.append((parquet_key(fl, day, start), sink.getvalue().to_pybytes()))
    return sorted(out)


def merge_files(sources, row_group_rows: int = ROW_GROUP_ROWS) -> tuple[bytes, int]:
    """One Parquet file (bytes, rows) of the rows of the Parquet files `sources` (an iterable of
    their bytes, taken one at a time), in that order, in full row groups of `row_group_rows` (the
    last one the rest), zstd: the compaction of a partition's small files (the tier service's
    TierService.compact_parquet). Memory: one input file and one row group at a time, plus the
    output."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    sink = pa.BufferOutputStream()
    writer = None
    schema = None
    pending: list = []
    held = rows = 0

    def flush(n: int) -> None:
        nonlocal pending, held
        t = pa.Table.from_batches(pending, schema=schema).combine_chunks()
        writer.write_table(t.slice(0, n), row_group_size=row_group_rows)
        rest = t.slice(n)
        pending = rest.to_batches() if rest.num_rows else []
        held = rest.num_rows

    for data in sources:
        pf = pq.ParquetFile(pa.BufferReader(data))
        if writer is None:
            schema = pf.schema_arrow
            writer = pq.ParquetWriter(sink, schema, compression=COMPRESSION, use_dictionary=DICTIONARY_COLUMNS)
        for b in pf.iter_batches(batch_size=row_group_rows):
            if b.schema != schema:
                b = pa.Table.from_batches([b]).cast(schema).combine_chunks().to_batches()[0]
            pending.append(b)
            held += b.num_rows
            rows += b.num_rows
            while held >= row_group_rows:
                flush(row_group_rows)
    if writer is None:
        raise ValueError("merge_files: no input files")
    if held:
        flush(held)
    writer.close()
    return sink.getvalue().to_pybytes(), rows


def merged_key(first_key: str, last_start: int) -> str:
    """The key of a merge of a partition's files from `first_key` (`<start>.parquet` or a merge's
    `<start>-<last>.parquet`) to the file of the segment at `last_start`: `<start>-<last start>.parquet`."""
    d, name = first_key.rsplit("/", 1)
    return f"{d}/{name.split('.', 1)[0].split('-', 1)[0]}-{file_name(last_start)}.parquet"


class ColumnarWriter:
    """The tier service's columnar hook (TierService.columnar): segment bytes, start -> files;
    `merge`: several of a partition's files -> one (compaction)."""

    def __init__(self, store) -> None:
        self.store = store

    def __call__(self, buf, start: int) -> list[tuple[str, bytes]]:
        return segment_files(buf, start, self.store.ident)

    @staticmethod
    def merge(sources) -> tuple[bytes, int]:
        return merge_files(sources)

    merged_key = staticmethod(merged_key)


def available() -> str | None:
    """None when Parquet files can be written here, else why not (one line)."""
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError as e:
        return f"pyarrow is not importable ({e}): pip install 'lmqtt[spark]'"
    return None


# ------------------------------------------------------------------------------------ reading
class ColdTier:
    """What the tier's manifest says Spark may read as Parquet: the files of its segments from the
    first one up to the first without Parquet (`cut`: the CommitLog offset where they end)."""

    def __init__(self, url: str, manifest: dict) -> None:
        self.url = url.rstrip("/")
        segs = sorted(manifest.get("segments", []), key=lambda s: s["start"])
        self.start = segs[0]["start"] if segs else None
        self.cut = self.start
        self.keys: list[str] = []
        seen: set = set()
        for s in segs:
            if "parquet" not in s or (self.cut is not None and s["start"] != self.cut):
                break
            # a merged file (compaction) is listed by every segment whose rows it holds: once here
            self.keys += [k for k in s["parquet"] if k not in seen]
            seen.update(s["parquet"])
            self.cut = s["end"]

    @classmethod
    def open(cls, url: str, endpoint: str | None = None, storage_options: dict | None = None) -> "ColdTier":
        from lmqtt.store.tier.objects import ObjectStore
        objs = ObjectStore(url, endpoint, storage_options)
        try:
            raw = objs.get("manifest.json")
        except FileNotFoundError:
            return cls(url, {})
        return cls(url, json.loads(raw))

    def spark_url(self) -> str:
        """The tier URL for Spark's Hadoop file systems (s3:// is s3a:// there)."""
        u = self.url
        return "s3a://" + u.split("://", 1)[1] if u.startswith("s3://") else u

    def files(self, first_levels=None, days: tuple[int | None, int | None] = (None, None)) -> list[str]:
        """Spark paths of the cold files of these first-level topics (None: every one not starting
        with `$`, like a wildcard filter) whose day lies in [days[0], days[1]] (None: open)."""
        base = self.spark_url()
        out = []
        for k in self.keys:
            m = re.match(rf"{PARQUET_DIR}/first_level=([^/]*)/date=(\d{{4}}-\d\d-\d\d)/", k)
            if m is None:
                continue
            fl = re.sub(r"%([0-9A-F]{2})", lambda x: chr(int(x.group(1), 16)), m.group(1))
            if first_levels is None:
                if fl.startswith("$"):
                    continue
            elif fl not in first_levels:
                continue
            day = (_dt.date.fromisoformat(m.group(2)) - _dt.date(1970, 1, 1)).days
            if (days[0] is not None and day < days[0]) or (days[1] is not None and day > days[1]):
                continue
            out.append(f"{base}/{k}")
        return out


def filter_regex(flt: str) -> str:
    """A regular expression (Java and Python) matching exactly the topics MQTT filter `flt` matches
    (a filter starting with a wildcard does not match topics starting with `$`)."""
    rx = []
    for i, p in enumerate(flt.split("/")):
        if p == "#":
            return r"^[^$].*$" if i == 0 else "^" + "/".join(rx) + "(/.*)?$"
        if p == "+":
            rx.append("([^$/][^/]*)?" if i == 0 else "[^/]*")
        else:
            rx.append(re.escape(p))
    return "^" + "/".join(rx) + "$"


def read_history(spark, *, store: str | None = None, tier: str, filter: str | None = None,  # noqa: A002
                 topic: str | None = None, startTime=None, endTime=None, token: str | None = None,
                 endpoint: str | None = None, storage_options: dict | None = None,
                 recordsPerPartition: int | None = None):
    """A DataFrame in the `lmqtt` source's schema: every stored message matching `filter` (an MQTT
    topic filter) or of first-level `topic`, store time in [startTime, endTime) (epoch ms or ISO
    8601, None: open), each exactly once: the tier's Parquet files below the manifest's cut
    (Spark's native Parquet reader) UNION the rest read through the `lmqtt` source from the cut.
    `tier` is the store's --tier URL (the manifest is read once, here, on the driver)."""
    from pyspark.sql import functions as F

    from .source import DEFAULT_STORE, SCHEMA, LmqttDataSource, parse_time
    if bool(filter) == bool(topic):
        raise ValueError("read_history: give exactly one of filter= (MQTT topic filter) or topic= "
                         "(first-level topic)")
    t0, t1 = parse_time(startTime), parse_time(endTime)
    cold_tier = ColdTier.open(tier, endpoint, storage_options)
    if filter:
        first = filter.split("/", 1)[0]
        fls = None if first in ("+", "#") else {first}
    else:
        fls = {topic}
    days = (None if t0 is None else t0 // DAY_MS, None if t1 is None else t1 // DAY_MS)
    files = cold_tier.files(fls, days)
    cols = [c.split()[0] for c in SCHEMA.split(", ")]
    if files:
        cold = (spark.read.schema(f"{SCHEMA}, {PARTITION_COLUMNS}")
                .option("basePath", f"{cold_tier.spark_url()}/{PARQUET_DIR}").parquet(*files))
        if filter and (fls is None or filter not in (f"{first}/#",)):
            cold = cold.where(F.col("topic").rlike(filter_regex(filter)))
        if t0 is not None:
            cold = cold.where(F.col("store_ts") >= F.timestamp_micros(F.lit(t0 * 1000)))
        if t1 is not None:
            cold = cold.where(F.col("store_ts") < F.timestamp_micros(F.lit(t1 * 1000)))
        cold = cold.select(*cols)
    else:
        cold = spark.createDataFrame([], SCHEMA)
    spark.dataSource.register(LmqttDataSource)
    r = spark.read.format("lmqtt").option("store", store or DEFAULT_STORE)
    r = r.option("filter", filter) if filter else r.option("topic", topic)
    for k, v in (("token", token), ("startTime", t0), ("endTime", t1), ("recordsPerPartition", recordsPerPartition),
                 ("fromPosition", cold_tier.cut)):
        if v is not None:
            r = r.option(k, str(v))
    return cold.unionByName(r.load())
