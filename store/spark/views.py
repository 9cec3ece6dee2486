"""Readers of the same source beyond what a broker offers (docs/spark.md):

  * `state_as_of`: device state at a past time = the last message per topic stored before `ts`.
  * `delivery_audit`: per consumer group and queue, committed offset vs queue end (Admin.lag).
"""
from __future__ import annotations

from pyspark.sql import Window, functions as F

from .options import parse_time, store_connection


def state_as_of(spark, ts, *, filter: str | None = None, topic: str | None = None,
                store: str | None = None, token: str | None = None, since=None):
    """DataFrame of the last message per MQTT topic with store_ts < ts (the `lmqtt` batch source
    with endTime=ts; `since` bounds how far back to look). Columns: the source schema."""
    r = spark.read.format("lmqtt").option("endTime", str(parse_time(ts)))
    for k, v in (("filter", filter), ("topic", topic), ("store", store), ("token", token)):
        if v:
            r = r.option(k, v)
    if since is not None:
        r = r.option("startTime", str(parse_time(since)))
    df = r.load()
    w = Window.partitionBy("topic").orderBy(F.col("store_ts").desc(), F.col("offset").desc())
    return df.withColumn("_rn", F.row_number().over(w)).where("_rn = 1").drop("_rn")


def delivery_audit(spark, group: str, *, store: str | None = None, token: str | None = None):
    """DataFrame(group, queue, committed, max_offset, lag) for `group` from the store (Admin.lag):
    how far each consumer group (an SDK consumer, a Spark query with option `group`) is behind."""
    opts = {"store": store, "token": token}
    conn = store_connection(opts)
    try:
        rows = conn.admin().lag(group)
    finally:
        conn.close()
    out = []
    for q in rows:
        name = f"lq:{q['filter']}" if "filter" in q else f"{q['topic']}:{q.get('queue_id', 0)}"
        out.append((group, name, q.get("committed"), q.get("max_offset"), q.get("lag")))
    return spark.createDataFrame(out, "group string, queue string, committed long, max_offset long, lag long")
