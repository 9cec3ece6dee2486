"""The tier's Parquet copy of the CommitLog: what Spark scans natively (docs/spark.md, docs/store.md).

Writer (`segment_files`, `ColumnarWriter`): the tier service (store/tier/service.py) uploads a
sealed CommitLog segment, then hands its bytes to the node's columnar hook, which returns the
segment's records as Parquet files of the `lmqtt` source's schema (SCHEMA, props decoded as the
source decodes them) split by first-level topic and UTC day of store time:

    <tier>/parquet/first_level=<first-level topic>/date=<YYYY-MM-DD>/<20-digit segment start>.parquet

Each file holds exactly the segment's records of that first level and day, in CommitLog order
(so each queue's rows, and the row groups, are in offset order). The partition column is called
`first_level`, not `topic`: Spark gives a partition column the value of the path, and one named
like the data column `topic` would replace every full topic by its first level.

Why it lives with the tier: the tier service runs it inside the store node (`--tier-parquet`),
which must not import Spark; the Spark side (lmqtt.store.spark.cold `read_history`) reads the
format defined here. pyarrow (the spark extra) is imported when a file is written: a store without
it keeps its tier and writes no Parquet (`available`).
"""
from __future__ import annotations

import datetime as _dt
import json
import logging

from lmqtt.store.mapped_file import file_name
from lmqtt.store.record import HEADER, HEADER_SIZE, MSG_MAGIC

log = logging.getLogger("lmqtt.store.tier")

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
# Rows of a file are sorted by topic (a stable sort: each topic's rows stay in CommitLog order, so a
# topic's rows of a queue are in offset order): a filter that selects a few topics of a partition
# reads only the row groups holding them (Parquet min/max and dictionary filtering of the
# predicate read_history pushes down). The distinct topics of a file, when at most MAX_TOPICS_META,
# are in its footer's key-value metadata under TOPICS_KEY (a JSON list, sorted): read_history
# matches the filter against these names on the driver, not row by row.
TOPICS_KEY = "lmqtt.topics"
MAX_TOPICS_META = 4096
# a segment's files: small row groups, so a merge's topic-range passes (merge_files) decode only
# the row groups of each range (the merged file has full row groups of ROW_GROUP_ROWS)
SEGMENT_ROW_GROUP_ROWS = 1 << 15
# a merge sorts at most this many rows at a time (one range of topics), but one topic's rows are
# streamed whatever their number: memory is bounded by this, not by the file size
MERGE_PASS_ROWS = 1 << 20


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
    import pyarrow as pa  # optional: the spark extra

    # the lmqtt schema's Arrow columns, the Spark reader's too; they need pyarrow (optional: the spark extra)
    from lmqtt.store.spark.columns import COLUMNS, body_columns, props_dictionary
    count, gidx, groups, qidx, qkeys = _walk(buf, start)
    data = bytes(buf)
    (qo, _po, born, st, t_off, t_dat, p_off, p_dat, b_off, b_dat, m_off, m_dat) = body_columns(
        data, 0, count, ident, raw=True)
    n = count
    b = pa.py_buffer
    ts = pa.timestamp("us", tz="UTC")
    props = pa.Array.from_buffers(pa.binary(), n, [None, b(p_off), b(p_dat)])
    (qos_d, retain_d, cid_d, up_d, ct_d), idx = props_dictionary(props)
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


def _topics_meta(topics) -> dict:
    """The footer metadata naming a file's distinct topics (none past MAX_TOPICS_META)."""
    return {TOPICS_KEY: json.dumps(sorted(topics))} if len(topics) <= MAX_TOPICS_META else {}


def file_topics(metadata) -> list[str] | None:
    """The distinct topics a Parquet file's footer (pyarrow FileMetaData) names; None when it
    names none (a file written before the list, or one with more than MAX_TOPICS_META topics)."""
    kv = metadata.metadata or {}
    v = kv.get(TOPICS_KEY.encode())
    return None if v is None else json.loads(v)


MANY_TOPICS = "many"


def data_topics(data: bytes) -> list[str] | str:
    """The distinct topics of a Parquet file this module wrote (its bytes, in memory: no request),
    from its footer: the sorted list, or MANY_TOPICS when it has more than MAX_TOPICS_META (the
    writers here always list them up to that). What the tier's manifest records per file
    (`parquet_topics`), so read_history need not read the footers again."""
    import pyarrow as pa  # optional: the spark extra
    import pyarrow.parquet as pq  # optional: the spark extra
    names = file_topics(pq.read_metadata(pa.BufferReader(data)))
    return MANY_TOPICS if names is None else names


def _by_topic(table):
    """`table` sorted by topic, stable: each topic's rows keep their order (CommitLog order)."""
    import pyarrow.compute as pc  # optional: the spark extra
    return table.take(pc.sort_indices(table, sort_keys=[("topic", "ascending")]))


def segment_files(buf, start: int, ident: str, row_group_rows: int = SEGMENT_ROW_GROUP_ROWS) -> list[tuple[str, bytes]]:
    """The Parquet files (key under the tier root, bytes) of the sealed segment `buf` starting at
    CommitLog offset `start`: one per (first-level topic, UTC day of store time), rows sorted by
    topic and each topic's rows in CommitLog order, the distinct topics in the footer (TOPICS_KEY),
    zstd, dictionary-encoded only in DICTIONARY_COLUMNS. [] for a segment without records."""
    import pyarrow as pa  # optional: the spark extra
    import pyarrow.compute as pc  # optional: the spark extra
    import pyarrow.parquet as pq  # optional: the spark extra
    table, gidx, groups = segment_table(buf, start, ident)
    if table.num_rows == 0:
        return []
    out = []
    g_arr = pa.array(gidx, pa.int32()) if len(groups) > 1 else None
    for gi, (fl, day) in enumerate(groups):
        part = _by_topic(table if g_arr is None else table.filter(pc.equal(g_arr, gi)))
        part = part.replace_schema_metadata(_topics_meta(pc.unique(part["topic"]).to_pylist()))
        sink = pa.BufferOutputStream()
        pq.write_table(part, sink, compression=COMPRESSION, row_group_size=row_group_rows,
                       use_dictionary=DICTIONARY_COLUMNS)
        out.append((parquet_key(fl, day, start), sink.getvalue().to_pybytes()))
    return sorted(out)


def merge_files(sources, row_group_rows: int = ROW_GROUP_ROWS, pass_rows: int = MERGE_PASS_ROWS) -> tuple[bytes, int]:
    """One Parquet file (bytes, rows) of the rows of the Parquet files `sources` (an iterable of
    their bytes, in CommitLog order), sorted by topic with each topic's rows in CommitLog order
    (a stable sort: the inputs' order, then each input's own), the distinct topics in the footer,
    in full row groups of `row_group_rows` (the last one the rest), zstd: the compaction of a
    partition's small files (the tier service's TierService.compact_parquet).

    Memory: the inputs' (compressed) bytes, the output, and one range of topics of at most
    `pass_rows` decoded rows at a time: the topics' row counts are read first (the topic column
    only), then each range of consecutive topics is gathered from every input (only the row
    groups whose topic min/max overlap it), sorted and written; a single topic's rows are streamed
    row group by row group, however many."""
    import pyarrow as pa  # optional: the spark extra
    import pyarrow.compute as pc  # optional: the spark extra
    import pyarrow.parquet as pq  # optional: the spark extra
    files = [pq.ParquetFile(pa.BufferReader(d)) for d in sources]
    if not files:
        raise ValueError("merge_files: no input files")
    schema = files[0].schema_arrow.remove_metadata()
    counts: dict = {}
    for f in files:
        vc = pc.value_counts(f.read(columns=["topic"]).column("topic"))
        for t, n in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()):
            counts[t] = counts.get(t, 0) + n
    topics = sorted(counts)            # code point order = UTF-8 byte order = Arrow's and Parquet's
    ranges: list[list[str]] = []
    n = 0
    for t in topics:
        if not ranges or n + counts[t] > pass_rows:
            ranges.append([])
            n = 0
        ranges[-1].append(t)
        n += counts[t]
    sink = pa.BufferOutputStream()
    writer = pq.ParquetWriter(sink, schema.with_metadata(_topics_meta(topics)), compression=COMPRESSION,
                              use_dictionary=DICTIONARY_COLUMNS)
    pending: list = []
    held = rows = 0

    def push(t) -> None:
        nonlocal pending, held, rows
        if not t.num_rows:
            return
        pending.append(t)
        held += t.num_rows
        rows += t.num_rows
        while held >= row_group_rows:
            flush(row_group_rows)

    def flush(k: int) -> None:
        nonlocal pending, held
        t = pa.concat_tables(pending).combine_chunks()
        writer.write_table(t.slice(0, k), row_group_size=row_group_rows)
        rest = t.slice(k)
        pending = [rest] if rest.num_rows else []
        held = rest.num_rows

    def topic_stats(f):
        md = f.metadata
        col = next(i for i in range(md.num_columns) if md.row_group(0).column(i).path_in_schema == "topic")
        out = []
        for g in range(md.num_row_groups):
            st = md.row_group(g).column(col).statistics
            out.append((st.min, st.max) if st is not None and st.has_min_max else None)
        return out

    stats = [topic_stats(f) if f.metadata.num_row_groups else [] for f in files]
    for rng in ranges:
        lo, hi = rng[0], rng[-1]
        parts = []
        for f, fst in zip(files, stats):
            for g, mm in enumerate(fst):
                if mm is not None and (mm[1] < lo or mm[0] > hi):
                    continue
                t = f.read_row_group(g)
                if not t.schema.equals(schema):
                    t = t.cast(schema)
                if len(ranges) > 1:
                    t = t.filter(pc.and_(pc.greater_equal(t["topic"], lo), pc.less_equal(t["topic"], hi)))
                if len(rng) == 1:
                    push(t.replace_schema_metadata(None))      # one topic: already in order
                elif t.num_rows:
                    parts.append(t.replace_schema_metadata(None))
        if parts:
            push(_by_topic(pa.concat_tables(parts).combine_chunks()))
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

    topics = staticmethod(data_topics)

    merged_key = staticmethod(merged_key)


def available() -> str | None:
    """None when Parquet files can be written here, else why not (one line)."""
    try:
        import pyarrow.parquet  # noqa: F401 - optional (the spark extra): is it installed?
    except ImportError as e:
        return f"pyarrow is not importable ({e}): pip install 'lmqtt[spark]'"
    return None


# ------------------------------------------------------------------------------------ reading
