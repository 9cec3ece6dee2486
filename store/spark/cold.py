"""`read_history`: a filter's (or a first-level topic's) history from the cold tier's Parquet plus the
hot tail through the `lmqtt` source, for Spark; `ColdTier`: the tier's manifest and its Parquet
files as Spark reads them (the files' layout and writer: lmqtt.store.tier.parquet).

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

from lmqtt.store.tier.objects import ObjectStore
from lmqtt.store.tier.parquet import DAY_MS, MANY_TOPICS, PARQUET_DIR, PARTITION_COLUMNS, file_topics
from lmqtt.store.tier.topics import decode

from .options import DEFAULT_STORE, parse_time

log = logging.getLogger("lmqtt.spark")


class ColdTier:
    """What the tier's manifest says Spark may read as Parquet: the files of its segments from the
    first one up to the first without Parquet (`cut`: the CommitLog offset where they end)."""

    def __init__(self, url: str, manifest: dict) -> None:
        self.url = url.rstrip("/")
        # key -> the file's distinct topics (or MANY_TOPICS) as the manifest lists them (none for a
        # file an older version wrote: its footer is read)
        self.topics: dict = decode(manifest)
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
    def open(cls, url: str, endpoint: str | None = None, storage_options: dict | None = None,
             missing_ok: bool = True) -> "ColdTier":
        """The tier at `url` as its manifest says; no manifest there: an empty tier, or with
        `missing_ok=False` FileNotFoundError naming the URL (a typo'd URL is not an empty tier)."""
        objs = ObjectStore(url, endpoint, storage_options)
        try:
            raw = objs.get("manifest.json")
        except FileNotFoundError:
            if not missing_ok:
                raise FileNotFoundError(
                    f"no tier manifest at {url} (manifest.json): is it the store's --tier URL? (a store that "
                    f"has not uploaded a segment yet has none: read_history(tier=None) reads everything "
                    f"through the store)") from None
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
        return [f"{base}/{k}" for k in self.file_keys(first_levels, days)]

    def matching_topics(self, keys: list[str], flt: str, endpoint: str | None = None,
                        storage_options: dict | None = None) -> tuple[list[str], bool] | None:
        """(the distinct topics of the files `keys` that MQTT filter `flt` matches, whether that is
        every topic they hold), from the names the manifest lists for each file (`parquet_topics`,
        read with the manifest: no request per file); for a file the manifest has no list for (a
        tier written by an older version) from its footer (TOPICS_KEY; one footer read on the
        driver). None when a file has no list (too many topics, or written before the lists)."""
        rx = re.compile(filter_regex(flt), re.S)
        out: set = set()
        every = True
        objs = None
        for k in keys:
            names = self.topics.get(k)
            if names is None:
                import pyarrow.parquet as pq  # optional: the spark extra

                if objs is None:
                    objs = ObjectStore(self.url, endpoint, storage_options)
                with objs.fs.open(objs.path(k), "rb") as fh:
                    names = file_topics(pq.read_metadata(fh))
            if names is None or names == MANY_TOPICS:
                return None
            hit = [t for t in names if rx.match(t)]
            every = every and len(hit) == len(names)
            out.update(hit)
        return sorted(out), every

    def file_keys(self, first_levels=None, days: tuple[int | None, int | None] = (None, None)) -> list[str]:
        """The keys (under the tier root) of the files `files` returns."""
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
            out.append(k)
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


def _topic_in(col, names: list[str]):
    """`col IN names` as Spark pushes it to Parquet row-group filtering exactly: an IN of up to 10
    values (spark.sql.parquet.pushdown.inFilterThreshold) is pushed as equalities, a longer one
    only as its min..max range, so up to IN_AS_EQUALITIES names are a balanced OR of IN lists of
    10 (each pushed exactly); more than that: one IN (pushed as the range)."""
    if len(names) <= 10 or len(names) > IN_AS_EQUALITIES:
        return col.isin(names)
    terms = [col.isin(names[i:i + 10]) for i in range(0, len(names), 10)]
    while len(terms) > 1:
        terms = [terms[i] | terms[i + 1] if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return terms[0]


IN_AS_EQUALITIES = 1000


def read_history(spark, *, store: str | None = None, tier: str | None, filter: str | None = None,  # noqa: A002
                 topic: str | None = None, startTime=None, endTime=None, token: str | None = None,
                 endpoint: str | None = None, storage_options: dict | None = None,
                 recordsPerPartition: int | None = None):
    """A DataFrame in the `lmqtt` source's schema: every stored message matching `filter` (an MQTT
    topic filter) or of first-level `topic`, store time in [startTime, endTime) (epoch ms or ISO
    8601, None: open), each exactly once: the tier's Parquet files below the manifest's cut
    (Spark's native Parquet reader) UNION the rest read through the `lmqtt` source from the cut.
    `tier` is the store's --tier URL (the manifest is read once, here, on the driver); no manifest
    there raises FileNotFoundError naming the URL (as spark.read.parquet does for a missing path);
    None: no cold side, everything read through the store."""
    from pyspark.sql import functions as F  # optional: a Spark job only

    from .source import SCHEMA, LmqttDataSource  # it needs pyspark (a Spark job only)
    if bool(filter) == bool(topic):
        raise ValueError("read_history: give exactly one of filter= (MQTT topic filter) or topic= "
                         "(first-level topic)")
    t0, t1 = parse_time(startTime), parse_time(endTime)
    cold_tier = ColdTier.open(tier, endpoint, storage_options, missing_ok=False) if tier is not None else ColdTier("", {})
    if filter:
        first = filter.split("/", 1)[0]
        fls = None if first in ("+", "#") else {first}
    else:
        fls = {topic}
    days = (None if t0 is None else t0 // DAY_MS, None if t1 is None else t1 // DAY_MS)
    keys = cold_tier.file_keys(fls, days)
    cols = [c.split()[0] for c in SCHEMA.split(", ")]
    names = None
    if keys and filter and (fls is None or filter != f"{first}/#"):
        # the filter matched on the files' topic lists: `topic IN (names)`, which Spark pushes down to
        # the Parquet reader (row groups of other topics skipped by min/max and dictionary: the
        # files are sorted by topic); exact, as every row's topic is in its file's list
        matched = cold_tier.matching_topics(keys, filter, endpoint, storage_options)
        if matched is not None:
            names = matched[0]
            if not names:
                keys = []               # no cold file holds a matching topic
            elif matched[1]:
                names = []              # every row of these files matches: no predicate
    files = [f"{cold_tier.spark_url()}/{k}" for k in keys]
    if files:
        cold = (spark.read.schema(f"{SCHEMA}, {PARTITION_COLUMNS}")
                .option("basePath", f"{cold_tier.spark_url()}/{PARQUET_DIR}").parquet(*files))
        if names:
            cold = cold.where(_topic_in(F.col("topic"), names))
        elif names is None and filter and (fls is None or filter != f"{first}/#"):
            # a file without its topic list: the filter's regular expression, row by row
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
