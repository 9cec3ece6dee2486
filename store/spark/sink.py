"""The `lmqtt` format's sink: df.write / writeStream and `write_rows`, rows appended to the store
exactly once by the producer dedup (`_write_rows`).

Why a module of its own: source.py plans and pulls (offsets, time -> offset, partitions of a
range); writing shares none of that, only the connection helper and the default address. The
data source (source.py's `LmqttDataSource`) hands its writers out from here.
"""
from __future__ import annotations

import uuid

from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceStreamWriter, DataSourceWriter, WriterCommitMessage

from lmqtt.store import protocol as W
from lmqtt.store.client.producer import message_tuple

from .options import DEFAULT_STORE, store_connection

_CHUNK = 500                  # rows per PRODUCE batch
_SEQ_BITS = 24                # sequence = (batch id + 1) << 24 | chunk index


class _Commit(WriterCommitMessage):
    def __init__(self, partition: int, count: int) -> None:
        self.partition, self.count = partition, count


def _write_rows(opts: dict, query_id: str, batch_id: int, rows) -> _Commit:
    """Write one partition of one batch. Exactly once, by the store's producer dedup:

    producer id = "spark:<query id>:<partition id>", sequence = (batch id + 1) << 24 | chunk.
    Both are functions of (query, batch, partition, position of the chunk in the partition) only,
    never of the attempt. A retried task or a re-run of the same batch after a restart sends the
    same rows (Spark replays a batch from its checkpointed offsets; the rows of a partition are
    the same for a deterministic plan) as the same (producer id, sequence) pairs, and the store
    answers each with "duplicate" instead of appending it (`SdkMetadata.seen`: an exact match in
    the last 64 batches of the producer id, or any sequence below a full window). Sequences of a
    producer id grow with the batch id, so a new batch is never mistaken for an old one. Each
    chunk is one all-or-nothing append. Caveats: a plan whose partition contents differ between
    attempts (non-deterministic) is not covered, and the store's own limit applies (a crash of the
    store between the append and the dedup entry can store a retried chunk twice)."""
    ctx = TaskContext.get()
    part = ctx.partitionId() if ctx is not None else 0
    conn = store_connection(opts)
    prod = conn.producer(f"spark:{query_id}:{part}")
    default_qos = int(opts.get("qos", 1))
    chunk, n, count = [], 0, 0

    def flush():
        nonlocal chunk, n
        if chunk:
            seq = ((batch_id + 1) << _SEQ_BITS) | n
            prod.send_packed(len(chunk), W.encode_messages_for_produce(chunk), seq=seq)
            n += 1
            chunk = []
    try:
        for row in rows:
            d = row.asDict() if hasattr(row, "asDict") else dict(row)
            body = d.get("payload")
            if body is None:
                body = b""
            elif isinstance(body, str):
                body = body.encode()
            up = d.get("user_properties") or None
            kw = {"qos": int(d["qos"]) if d.get("qos") is not None else default_qos,
                  "retain": bool(d.get("retain") or False)}
            if up:
                kw["user_properties"] = dict(up)
            if d.get("content_type"):
                kw["content_type"] = d["content_type"]
            keys = (d["key"],) if d.get("key") else ()
            chunk.append(message_tuple(d["topic"], bytes(body), keys, **kw))
            count += 1
            if len(chunk) >= _CHUNK:
                flush()
        flush()
    finally:
        conn.close()
    return _Commit(part, count)


def write_rows(rows, *, query_id: str, batch_id: int, store: str = DEFAULT_STORE, token: str | None = None,
               qos: int = 1) -> int:
    """Write rows collected on the driver (e.g. a few alerts inside foreachBatch) with the sink's
    exactly-once rule: the same (query id, batch id) written again is answered "duplicate" by the
    store. Rows are sorted first so that a re-run of the batch chunks them the same way. Saves the
    Spark write job (a task per partition, a connection each) when the rows are few."""
    key = lambda r: (r["topic"], bytes(r["payload"] or b""))      # noqa: E731
    rows = sorted((r.asDict() if hasattr(r, "asDict") else dict(r) for r in rows), key=key)
    opts = {"store": store, "qos": qos}
    if token:
        opts["token"] = token
    return _write_rows(opts, query_id, batch_id, rows).count


class LmqttWriter(DataSourceWriter):
    """df.write: options `queryId` + `batchId` name the write for dedup (e.g. from foreachBatch);
    without them a random query id is drawn on the driver (retried tasks of this one write are
    still deduplicated, a second save() is a new write)."""

    def __init__(self, options: dict) -> None:
        self.options = options
        self.query_id = options.get("queryid") or uuid.uuid4().hex
        self.batch_id = int(options.get("batchid", 0))

    def write(self, iterator):
        return _write_rows(self.options, self.query_id, self.batch_id, iterator)


class LmqttStreamWriter(DataSourceStreamWriter):
    """df.writeStream: query id and batch id come from the task's local properties that Spark's
    micro-batch engine sets (`sql.streaming.queryId`: stable across restarts from the same
    checkpoint; `streaming.sql.batchId`)."""

    def __init__(self, options: dict) -> None:
        self.options = options

    def write(self, iterator):
        ctx = TaskContext.get()
        qid = self.options.get("queryid") or (ctx and ctx.getLocalProperty("sql.streaming.queryId"))
        bid = ctx and ctx.getLocalProperty("streaming.sql.batchId")
        if not qid or bid is None:
            raise RuntimeError("lmqtt sink: no streaming query/batch id in the task context")
        return _write_rows(self.options, qid, int(bid), iterator)

    def commit(self, messages, batchId: int) -> None:
        pass

    def abort(self, messages, batchId: int) -> None:
        pass
