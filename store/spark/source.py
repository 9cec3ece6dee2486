"""`LmqttDataSource`: the `lmqtt` format for spark.read / readStream / write / writeStream.

Everything goes through the store's SDK (`lmqtt.store.client`), so the same code runs in local
mode against `lmqtt serve --store-port` and on a cluster against `lmqtt store`: the driver plans
(offsets, time -> offset), executors pull their own offset ranges over their own connections.

Queues ("queue" column, and the keys of streaming offsets):
  * option `filter` (MQTT topic filter, wildcards allowed): every stored message whose topic
    matches it, whether or not the filter was ever subscribed (lightqueue/history.py): the
    ConsumeQueues of its first-level topic (every first-level topic for a filter starting with a
    wildcard), key `<first-level topic>:<queue id>`, each range read with the filter applied in
    the store (CALL filter_range: only matching records cross the wire). Reading registers
    nothing. (An older version read the filter's light queue, key `lq:<filter>`: only what was
    published while the filter was held.)
  * option `topic` (first-level topic): its ConsumeQueues, key `<topic>:<queue id>`.
"""
from __future__ import annotations

import json
import logging
import sys
from concurrent.futures import Future

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.types import StructType

from lmqtt.store import protocol as W
from lmqtt.store.client.admin import Admin
from lmqtt.store.client.connection import ConnectionLost, StoreClientError, check_reply, is_not_primary
from lmqtt.store.client.consumer import decode_messages, decode_reply, pull

from .columns import arrow_batch, split_body
from .options import lower as _lower, parse_time, store_connection
from .sink import LmqttStreamWriter, LmqttWriter

SCHEMA = ("topic string, payload binary, qos int, retain boolean, client_id string, "
          "user_properties map<string,string>, content_type string, born_ts timestamp, "
          "store_ts timestamp, msg_id string, queue string, offset long")

log = logging.getLogger("lmqtt.spark")

_PULL = 512                    # records per pull request (planning, streaming)
_RANGE_PULL = 16384            # records per pull when reading a partition's range (4 MiB cap)


class SourceQueues:
    """The queues one read covers, with offsets, time lookups and range pulls (driver or executor)."""

    def __init__(self, opts: dict, conn=None) -> None:
        self.opts = opts
        self.filter = opts.get("filter")
        self.topic = opts.get("topic")
        if bool(self.filter) == bool(self.topic):
            raise ValueError("lmqtt: set exactly one of the options 'filter' (MQTT topic filter) or "
                             "'topic' (first-level topic)")
        self.conn = conn or store_connection(opts)

    def keys(self) -> list[str]:
        if self.filter:
            r = self.conn.cmd("filter_sources", filter=self.filter)
            return [f"{fl}:{qid}" for fl, qid, _lo, _hi in r["sources"]]
        qids = sorted({q["queue_id"] for q in Admin(self.conn).topics() if q["topic"] == self.topic}) or [0]
        return [f"{self.topic}:{q}" for q in qids]

    @staticmethod
    def _split(key: str) -> tuple[str, int]:
        name, _, qid = key.rpartition(":")
        return name, int(qid)

    def bounds(self, key: str) -> tuple[int, int]:
        """(min, max) offsets; max = next offset to be written."""
        if key.startswith("lq:"):
            info = self.conn.cmd("subscribe", filter=key[3:])     # registers, like SUBSCRIBE
            return info["min_offset"], info["max_offset"]
        name, qid = self._split(key)
        r = self.conn.cmd("offsets", topic=name, queue_id=qid)
        return r["min_offset"], r["max_offset"]

    def offset_for_time(self, key: str, ts: int) -> int:
        """First offset whose store time is >= ts. ConsumeQueues: the store's time index
        (Admin.offset_for_time). Light queues: binary search over the queue by offsets (store
        times grow with queue offsets), O(log n) one-record pulls, no scan."""
        lo, hi = self.bounds(key)
        if not key.startswith("lq:"):
            name, qid = self._split(key)
            off = self.conn.cmd("offset_for_time", topic=name, queue_id=qid, ts=ts)["offset"]
            return min(max(off, lo), hi)
        while lo < hi:
            mid = (lo + hi) // 2
            recs = self.pull(key, mid, mid + 1)
            if not recs:                       # expired hole: search above it
                lo = mid + 1
            elif recs[0].store_ts < ts:
                lo = recs[0].queue_offset + 1
            else:
                hi = mid
        return lo

    def offsets_at(self, position: int) -> dict:
        """{queue key: the queue offset of its first entry at/after CommitLog offset `position`}
        (read_history's cut between the tier's Parquet files and this source)."""
        flt = self.filter or f"{self.topic}/#"
        r = self.conn.cmd("filter_sources", filter=flt, position=int(position))
        return {f"{fl}:{qid}": at for fl, qid, _lo, _hi, at in r["sources"]}

    def pull(self, key: str, start: int, end: int, max_count: int = _PULL):
        """Records with start <= queue offset < end (one request, up to max_count)."""
        n = max(1, min(max_count, end - start))
        if self.filter and not key.startswith("lq:"):
            _op, flags, body = self.conn.call(W.OP_CALL, self._range_args(key, start, end, n), retry=True)
            _h, recs = decode_reply(self.conn.ident, body, flags)
        elif key.startswith("lq:"):
            _op, _f, body = self.conn.call(W.OP_PULL_FILTER, W.encode_pull(key[3:], 0, start, n, 4 << 20),
                                           retry=True)
            _h, recs = decode_messages(self.conn.ident, body)
        else:
            name, qid = self._split(key)
            recs = pull(self.conn, name, qid, start, n).records
        return [r for r in recs if start <= r.queue_offset < end]

    def _range_args(self, key: str, start: int, end: int, n: int) -> bytes:
        name, qid = self._split(key)
        return json.dumps({"cmd": "filter_range", "filter": self.filter, "topic": name, "queue_id": qid,
                           "start": start, "end": end, "max_count": n, "max_bytes": 4 << 20}).encode()

    def _range_request(self, key: str, start: int, end: int) -> tuple[int, bytes, int]:
        """(opcode, body, flags) of one pull of [start, end) (up to _RANGE_PULL records / 4 MiB).
        With a filter, the range's records whose topic matches it (the store looks at every entry)."""
        n = max(1, min(_RANGE_PULL, end - start))
        if self.filter and not key.startswith("lq:"):
            return W.OP_CALL, self._range_args(key, start, end, max(n, _RANGE_PULL)), 0
        if key.startswith("lq:"):
            return W.OP_PULL_FILTER, W.encode_pull(key[3:], 0, start, n, 4 << 20), 0
        name, qid = self._split(key)
        # F_RAW_OK: the store may answer with its CommitLog records as stored (no re-encoding)
        return W.OP_PULL, W.encode_pull(name, qid, start, n, 4 << 20), W.F_RAW_OK

    def _request(self, key: str, start: int, end: int):
        """One pull of [start, end) sent now; a future (`_answer` reads it). A send that fails with
        the connection is not raised here: `_answer` asks again."""
        op, body, flags = self._range_request(key, start, end)
        try:
            return self.conn.request(op, body, flags)
        except ConnectionLost as e:
            fut: Future = Future()
            fut.set_exception(e)
            return fut

    def _answer(self, fut, key: str, start: int, end: int):
        """The reply to the pull `_request(key, start, end)` sent as `fut`. One lost with its
        connection or refused by a member that is no longer primary (a store group's failover: the
        primary was killed, or stopped answering and the group elected another) is asked again of
        the primary the connection finds (`Connection.call`'s retry, up to its failover timeout): a
        pull changes nothing, so a partition being read when the primary goes returns all its rows
        (docs/ha.md "Clients")."""
        try:
            return check_reply(fut.result(self.conn.timeout))
        except ConnectionLost:
            pass
        except StoreClientError as e:
            if not is_not_primary(e):
                raise
            self.conn.not_primary(e)
        op, body, flags = self._range_request(key, start, end)
        return self.conn.call(op, body, retry=True, flags=flags)

    def from_light_queue(self, flt: str, offset: int) -> dict:
        """A streaming checkpoint written by an older version (which read the light queue) keeps the filter's light-queue offset
        (key `lq:<filter>`): the same point as each source ConsumeQueue's offset (the first entry
        at/after the CommitLog position of that light-queue entry), so the query goes on where it
        stopped instead of reading the queues from their start."""
        pos = self.conn.cmd("filter_position", filter=flt, lq_offset=int(offset))["position"]
        r = self.conn.cmd("filter_sources", filter=flt, position=pos)
        return {f"{fl}:{qid}": at for fl, qid, _lo, _hi, at in r["sources"]}

    def entries_per_partition(self, key: str, start: int, end: int, rows: int) -> int:
        """Queue entries per partition for about `rows` rows each. A `filter` read returns only the
        matching entries of its ConsumeQueues: the share that matches is sampled (one range read
        of up to 65,536 entries in the middle of [start, end)) and the partitions are widened by its
        inverse (at most 100x), so a filter matching 1 message in 10 gets partitions of 10x the
        entries, not ten times as many partitions of a tenth of the rows. Such a widened size is an
        estimate: the reader makes the nearest whole number of partitions of it, not the ceiling
        (`_split_ranges`' `estimated`)."""
        if not self.filter or key.startswith("lq:") or end - start <= rows:
            return rows

        mid = start + (end - start) // 2
        n = min(65536, end - mid)
        _op, _flags, body = self.conn.call(W.OP_CALL, self._range_args(key, mid, mid + n, n), retry=True)
        header, _pos, count = split_body(body)
        scanned = max(1, int(header.get("next_offset", mid + n)) - mid)
        share = max(count / scanned, 0.01)
        return max(rows, int(rows / share))

    def iter_batches(self, key: str, start: int, end: int):
        """Arrow batches of the records with start <= queue offset < end, one pull always in flight
        ahead of the one being converted (the store reads while this process builds columns)."""
        ident = self.conn.ident or ""
        pos = start
        nxt = None                  # (position it was asked for, future)
        while pos < end:
            fut = nxt[1] if nxt is not None and nxt[0] == pos else self._request(key, pos, end)
            nxt = None
            _op, flags, body = self._answer(fut, key, pos, end)
            batch, header, new_pos = arrow_batch(key, ident, body, start, end, raw=bool(flags & W.F_RAW))
            if self.filter:         # records are the matching ones: the store says where it got to
                new_pos = header.get("next_offset")
            if new_pos is None or new_pos <= pos:
                lo = header.get("min_offset", pos)
                if pos < lo:                # expired head: go on from the queue's first entry
                    pos = lo
                    continue
                break                       # nothing beyond pos
            if new_pos < end:
                nxt = (new_pos, self._request(key, new_pos, end))
            if batch.num_rows:
                yield batch
            pos = new_pos

    def iter_range(self, key: str, start: int, end: int):
        pos = start
        while pos < end:
            recs = self.pull(key, pos, end)
            if not recs:
                # nothing at pos: expired head or a hole; stop if the queue has nothing beyond
                lo, hi = self.bounds(key)
                if pos < lo:
                    pos = lo
                    continue
                break
            yield recs
            pos = recs[-1].queue_offset + 1


from .columns import COLUMNS  # noqa: E402,F401  (the schema's column order, re-exported)


class RangePartition(InputPartition):
    def __init__(self, key: str, start: int, end: int) -> None:
        super().__init__((key, start, end))
        self.key, self.start, self.end = key, start, end


def _read_partition(opts: dict, p: RangePartition):
    if p.start >= p.end:
        return
    q = SourceQueues(opts)
    try:
        yield from q.iter_batches(p.key, p.start, p.end)
    finally:
        q.conn.close()


def _split_ranges(key: str, start: int, end: int, per: int, estimated: bool = False) -> list[RangePartition]:
    """[start, end) in as few partitions of at most `per` entries as it takes, all of about the same
    size (no small last one: on 2 cores, 4 equal partitions finish in 2 rounds where 4 full ones and
    a stub took 3). `estimated` (a filter read's size widened by a sampled share): the nearest whole
    number of partitions of `per`, not the ceiling - a sample a hair above 1 in 10 made 5
    partitions of 10M entries at 250,000 rows a partition (3 rounds on 2 cores, the last with one
    core idle) where 4 were asked (lmqtt bench spark --cases filter-history)."""
    if end <= start:
        return []
    total = end - start
    per = max(1, per)
    n = max(1, int(total / per + 0.5)) if estimated else -(-total // per)
    cuts = [start + total * i // n for i in range(n + 1)]
    return [RangePartition(key, a, b) for a, b in zip(cuts, cuts[1:])]


# ------------------------------------------------------------------------------------ batch read
class LmqttReader(DataSourceReader):
    def __init__(self, options: dict) -> None:
        self.options = options
        self.per = int(options.get("recordsperpartition", 20000))

    def partitions(self):
        q = SourceQueues(self.options)
        try:
            t0, t1 = parse_time(self.options.get("starttime")), parse_time(self.options.get("endtime"))
            parts = []
            # fromPosition (read_history): only entries at/after this CommitLog offset
            fp = self.options.get("fromposition")
            at = q.offsets_at(int(fp)) if fp not in (None, "") else {}
            for key in q.keys():
                lo, hi = q.bounds(key)
                s = lo if t0 is None else q.offset_for_time(key, t0)
                s = max(s, at.get(key, s))
                e = hi if t1 is None else q.offset_for_time(key, t1)
                per = q.entries_per_partition(key, s, e, self.per)
                parts += _split_ranges(key, s, e, per, estimated=per > self.per)
        finally:
            q.conn.close()
        return parts or [RangePartition("", 0, 0)]

    def read(self, partition):
        yield from _read_partition(self.options, partition)


# ------------------------------------------------------------------------------------ streaming read
class LmqttStreamReader(DataSourceStreamReader):
    """Offsets are {queue key: next offset}; Spark keeps them in the query's checkpoint (offset
    log + commit log), so a restarted query re-reads an unfinished batch with the same range and
    continues after the last committed one: every message once, no gap.

    maxRecordsPerTrigger: the reader remembers where the last planned batch ended. A restarted
    reader learns it from Spark before the first new range is asked for: Spark commits the restored
    offsets again (`commit`) or re-plans the unfinished batch (`partitions`), so the limit holds
    from the first trigger after a restart (tests/spark/test_sink_stream.py).

    Offsets read from the query's checkpoint (those Spark commits again or re-plans at a restart)
    that lie beyond their queue's end are brought back to it, with a WARNING: the store lost the
    entries there in a recovery (a cut CommitLog, docs/store.md "Recovery"), and the messages
    appended since take those offsets again; reading on from the old offset would skip them. It
    can only see what is beyond the end when it reads: messages published between the store's
    recovery and the query's restart fill the gap first (the store's log names the cut)."""

    def __init__(self, options: dict) -> None:
        self.options = options
        self.limit = int(options["maxrecordspertrigger"]) if options.get("maxrecordspertrigger") else None
        self.per = int(options.get("recordsperpartition", 20000))
        self._pos: dict | None = None
        self._q = None
        self._reset: dict[str, tuple[int, int]] = {}   # key -> (checkpoint's offset, where read from)

    def _checked(self, offsets: dict, ends: dict | None = None) -> dict:
        """`offsets` (from Spark's checkpoint) with each one beyond its queue's end brought back to
        the end (remembered, so that a batch Spark plans from the old offset reads from the end).
        With `ends` (a batch's planned ends, no further than the queues' ends then), only an offset
        above its planned end is looked at."""
        q = self._queues()
        out = {}
        for key, off in offsets.items():
            if key.startswith("lq:") and q.filter and not (ends and key in ends):
                out[key] = off               # a pre-issue-28 checkpoint: converted below
                continue
            r = self._reset.get(key)
            if r is not None and r[0] == off:
                out[key] = r[1]
                continue
            if ends is not None and off <= ends.get(key, off):
                out[key] = off
                continue
            hi = q.bounds(key)[1]
            if off > hi:
                log.warning("lmqtt spark source: offset %d of queue %s in the query's checkpoint is beyond the "
                            "queue's end %d (the store lost entries in a recovery): reading from %d (%d entries "
                            "lost from the log)", off, key, hi, hi, off - hi)
                self._reset[key] = (off, hi)
                off = hi
            out[key] = off
        return self._from_light_queues(out, ends)

    def _from_light_queues(self, offsets: dict, ends: dict | None = None) -> dict:
        """`offsets` with a pre-issue-28 checkpoint's `lq:<filter>` offset replaced by the source
        ConsumeQueues' offsets of the same point (`SourceQueues.from_light_queue`); kept where `ends`
        has the same key (a batch planned before the upgrade is re-read as it was planned)."""
        q = self._queues()
        legacy = {k: v for k, v in offsets.items() if k.startswith("lq:") and not (ends and k in ends)}
        if not legacy or not q.filter:
            return offsets
        out = {k: v for k, v in offsets.items() if k not in legacy}
        for key, off in legacy.items():
            out.update(q.from_light_queue(key[3:], off))
        return out

    def _queues(self) -> SourceQueues:
        if self._q is None:
            self._q = SourceQueues(self.options)
        return self._q

    def initialOffset(self) -> dict:
        q = self._queues()
        so = str(self.options.get("startingoffsets", "latest")).strip().lower()
        out = {}
        for key in q.keys():
            lo, hi = q.bounds(key)
            if so == "earliest":
                out[key] = lo
            elif so == "latest":
                out[key] = hi
            else:
                out[key] = q.offset_for_time(key, parse_time(self.options["startingoffsets"]))
        self._pos = dict(out)
        return out

    def latestOffset(self) -> dict:
        q = self._queues()
        latest = {}
        for key in q.keys():
            latest[key] = q.bounds(key)[1]
        if self.limit is None or self._pos is None:
            return latest
        self._pos = self._from_light_queues(self._pos)
        # share the limit over the queues in key order, from where the last batch ended
        left, out = self.limit, {}
        for key, hi in latest.items():
            s = self._pos.get(key, q.bounds(key)[0])
            take = max(0, min(hi - s, left))
            out[key] = s + take
            left -= take
        return out

    def partitions(self, start: dict, end: dict):
        self._pos = dict(end)
        q = self._queues()
        start = self._checked(start, end)
        self._reset.clear()              # used by this batch; later ones start where it ends
        parts = []
        for key, e in end.items():
            s = start.get(key)
            if s is None:                    # a queue that appeared after the start: from its min
                s = q.bounds(key)[0]
            parts += _split_ranges(key, s, e, self.per)
        return parts or [RangePartition("", 0, 0)]

    def read(self, partition):
        yield from _read_partition(self.options, partition)

    def commit(self, end: dict) -> None:
        if self._pos is None:           # a restart: Spark commits the checkpoint's offsets again
            self._pos = self._checked(end)
        group = self.options.get("group")
        if group:   # optional: make the query's progress visible to Admin.lag / delivery_audit
            q = self._queues()
            for key, off in end.items():
                if key.startswith("lq:"):
                    q.conn.cmd("commit", group=group, filter=key[3:], offset=off)
                else:
                    name, qid = q._split(key)
                    q.conn.cmd("commit", group=group, topic=name, queue_id=qid, offset=off)

    def stop(self) -> None:
        if self._q is not None:
            self._q.conn.close()
            self._q = None
        _quiet_when_spark_hung_up()


def _quiet_when_spark_hung_up() -> None:
    """A query stops by the JVM closing the socket of the Python process that runs this reader's
    driver side (pyspark.sql.streaming.python_streaming_source_runner), which calls stop() while
    the EOFError of that hang-up unwinds. When the JVM has not destroyed the process yet, the
    runner then reports the EOFError to the closed socket and its unguarded flush dies with a
    BrokenPipeError traceback on the application's stderr (PySpark 4.3.0; every second Ctrl-C
    of `lmqtt spark-iot`, tests/e2e/test_docs_walk.py). Nothing is lost or wrong at that point:
    in exactly that case (the runner process, an EOFError in flight) the hang-up's tracebacks
    are not printed; any other exception still is."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if (not isinstance(sys.exc_info()[1], EOFError) or spec is None
            or not spec.name.endswith("python_streaming_source_runner")):
        return
    previous = sys.excepthook

    def hook(kind, value, tb) -> None:
        if issubclass(kind, (EOFError, BrokenPipeError, ConnectionResetError)):
            return
        previous(kind, value, tb)
    sys.excepthook = hook


# ------------------------------------------------------------------------------------ the source
class LmqttDataSource(DataSource):
    """Format `lmqtt`. Options: store (HOST:PORT, default 127.0.0.1:10911; a store group: every
    member, HOST:PORT,HOST:PORT,..., read from the primary wherever it is), token, filter | topic,
    startTime/endTime (batch; epoch ms or ISO 8601, on store time, end exclusive), fromPosition
    (batch: only entries at/after this CommitLog offset; read_history's cut),
    startingOffsets (stream: earliest | latest | a time), maxRecordsPerTrigger, recordsPerPartition,
    group (stream: commit progress to this consumer group too), qos (sink default), queryId/batchId
    (batch sink dedup). Schema: SCHEMA (docs/spark.md)."""

    @classmethod
    def name(cls) -> str:
        return "lmqtt"

    def schema(self):
        return SCHEMA

    def reader(self, schema: StructType):
        return LmqttReader(_lower(self.options))

    def streamReader(self, schema: StructType):
        return LmqttStreamReader(_lower(self.options))

    def writer(self, schema: StructType, overwrite: bool):
        return LmqttWriter(_lower(self.options))

    def streamWriter(self, schema: StructType, overwrite: bool):
        return LmqttStreamWriter(_lower(self.options))
