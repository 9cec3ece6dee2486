"""The Spark source's `filter` option reads a filter's history: every stored message
matching it, whether or not the filter was ever held. Real `lmqtt serve`, paho publishers, one
local SparkSession for the test session (tests/spark/conftest.py's fixture; these tests share the
Spark tests' xdist group, tests/conftest.py)."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("pyspark")

from tests.spark.conftest import spark  # noqa: E402,F401  (the session's one SparkSession)
from tests.support import LmqttServer, Paho  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = LmqttServer(str(tmp_path_factory.mktemp("history-spark"))).start()
    yield srv
    srv.stop()


def publish(srv, items, client_id="spark-hist-pub"):
    p = Paho(srv, client_id=client_id)
    try:
        for topic, body in items:
            p.publish(topic, body, qos=1)
    finally:
        p.disconnect()


def read(spark, srv, **opts):
    r = spark.read.format("lmqtt").option("store", srv.store_address)
    for k, v in opts.items():
        r = r.option(k, v)
    return [(x.topic, x.payload.decode()) for x in r.load().orderBy("store_ts", "offset").collect()]


def test_batch_by_filter_and_time_range_never_subscribed(spark, server):
    """1,000 messages to `sparkchk/devN/t` (and other sub-topics, another first level) with no
    subscriber of the filter ever: the batch read by filter returns exactly the 1,000, a time range
    exactly the half inside it. Before: 0 rows (the filter's light queue was read)."""
    def batch(lo, hi):
        out = []
        for i in range(lo, hi):
            out.append((f"sparkchk/dev{i % 10}/t", f"v-{i}".encode()))
            if i % 4 == 0:
                out.append((f"sparkchk/dev{i % 10}/hum", b"h"))
                out.append((f"sparkcheck/dev{i % 10}/t", b"other"))
        return out
    publish(server, batch(0, 500))
    time.sleep(0.05)
    t0 = int(time.time() * 1000)
    publish(server, batch(500, 1000))
    time.sleep(0.05)
    t1 = int(time.time() * 1000)
    time.sleep(0.05)
    publish(server, batch(1000, 1100))
    rows = read(spark, server, filter="sparkchk/+/t")
    assert sorted(b for _t, b in rows) == sorted(f"v-{i}" for i in range(1100))
    assert all(t.startswith("sparkchk/dev") and t.endswith("/t") for t, _b in rows)
    ranged = read(spark, server, filter="sparkchk/+/t", startTime=str(t0), endTime=str(t1))
    assert sorted(b for _t, b in ranged) == sorted(f"v-{i}" for i in range(500, 1000))
    # small partitions: each row once whatever the split
    again = read(spark, server, filter="sparkchk/#", startTime=str(t0), endTime=str(t1),
                 recordsPerPartition="97")
    assert sorted(b for _t, b in again) == sorted([f"v-{i}" for i in range(500, 1000)] +
                                                  ["h"] * len(range(500, 1000, 4)))
    exact = read(spark, server, filter="sparkchk/dev3/t")
    assert [b for _t, b in exact] == [f"v-{i}" for i in range(3, 1100, 10)]


def test_batch_after_the_last_subscriber_left(spark, server):
    sub = Paho(server, client_id="sp-sub")
    sub.subscribe("sw2x/+/t", qos=1)
    publish(server, [(f"sw2x/d{i % 4}/t", f"w-{i}".encode()) for i in range(300)])
    assert len(sub.get_n(300)) == 300
    sub.unsubscribe("sw2x/+/t")
    sub.disconnect()
    rows = read(spark, server, filter="sw2x/+/t")
    assert sorted(b for _t, b in rows) == sorted(f"w-{i}" for i in range(300))


def test_stream_history_then_live_no_gap_no_duplicate(spark, server, tmp_path):
    """A streaming query by filter from earliest: the history (published before, no subscriber),
    then live messages published while it runs, and after a restart from its checkpoint: every
    matching message once."""
    publish(server, [(f"sl/n{i % 3}/v", f"h-{i}".encode()) for i in range(200)] + [("sl/n1/x", b"no")])
    seen = []

    def sink(df, _batch_id):
        seen.extend(r.v for r in df.selectExpr("cast(payload as string) as v").collect())

    def run():
        return (spark.readStream.format("lmqtt").option("store", server.store_address)
                .option("filter", "sl/+/v").option("startingOffsets", "earliest").load()
                .writeStream.foreachBatch(sink).option("checkpointLocation", str(tmp_path / "ckpt")).start())
    q = run()
    q.processAllAvailable()
    publish(server, [(f"sl/n{i % 3}/v", f"l-{i}".encode()) for i in range(100)])
    q.processAllAvailable()
    q.stop()
    publish(server, [(f"sl/n{i % 3}/v", f"r-{i}".encode()) for i in range(50)] + [("sl/n2/x", b"no")])
    q = run()
    q.processAllAvailable()
    q.stop()
    want = [f"h-{i}" for i in range(200)] + [f"l-{i}" for i in range(100)] + [f"r-{i}" for i in range(50)]
    assert sorted(seen) == sorted(want) and len(seen) == len(want)


def test_stream_checkpoint_of_the_light_queue_goes_on_where_it_stopped(server):
    """A streaming checkpoint written by an older version (which read the light queue) holds the filter's light-queue offset (key
    `lq:<filter>`); the reader goes on from the same point in the source ConsumeQueues: the
    messages after it, once, none of those before (it read them from the start before)."""
    from lmqtt.store.client import connect
    from lmqtt.store.spark.source import LmqttStreamReader
    with connect(server.store_address) as c:
        c.cmd("subscribe", filter="up/+/t")             # the old source registered the filter
        c.producer().send_batch([(f"up/d{i % 3}/t", f"u-{i}".encode()) for i in range(30)] + [("up/d0/x", b"no")])
        deadline = time.monotonic() + 10
        while c.cmd("filter_offsets", filter="up/+/t")["max_offset"] < 30 and time.monotonic() < deadline:
            time.sleep(0.02)
    opts = {"store": server.store_address, "filter": "up/+/t"}
    reader = LmqttStreamReader(opts)
    try:
        end = reader.latestOffset()
        assert list(end) == ["up:0"]
        got = [bytes(x).decode() for p in reader.partitions({"lq:up/+/t": 10}, end)
               for b in reader.read(p) for x in b.column("payload").to_pylist()]
        assert sorted(got, key=lambda v: int(v[2:])) == [f"u-{i}" for i in range(10, 30)]
        limited = LmqttStreamReader({**opts, "maxrecordspertrigger": "5"})
        limited.commit({"lq:up/+/t": 25})               # a restart: Spark commits the restored offsets
        nxt = limited.latestOffset()
        got = [bytes(x).decode() for p in limited.partitions({"lq:up/+/t": 25}, nxt)
               for b in limited.read(p) for x in b.column("payload").to_pylist()]
        assert sorted(got, key=lambda v: int(v[2:])) == [f"u-{i}" for i in range(25, 30)]
        limited.stop()
    finally:
        reader.stop()


def test_a_range_is_split_into_partitions_of_equal_size(server):
    """The batch plan splits a queue's range into as few partitions of at most recordsPerPartition
    entries as it takes, all about the same size: 1,000 entries at 400 a partition are 333/333/334,
    not 400/400/200 (on 2 cores a stub partition costs a round of its own: filter-history bench)."""
    from lmqtt.store.client import connect
    from lmqtt.store.spark.source import LmqttReader
    with connect(server.store_address) as c:
        c.producer().send_batch([("eqsplit/a", b"x")] * 1000)
    parts = LmqttReader({"store": server.store_address, "topic": "eqsplit", "recordsperpartition": "400"}).partitions()
    sizes = [p.end - p.start for p in parts if p.key == "eqsplit:0"]
    assert sum(sizes) == 1000 and len(sizes) == 3 and max(sizes) - min(sizes) <= 1, sizes


def test_a_filter_range_gets_the_nearest_partition_count_not_one_more(server):
    """A filter read sizes its partitions by the sampled share of matching entries; the count is the
    nearest whole number, not the ceiling: 2,000 entries with 1 in 10 matching (and one more in the
    sampled half: a share a hair above 1/10) at 50 rows a partition are 4 partitions of 500 entries,
    not 5 of 400 (the filter-history bench: 5 partitions of 10M entries, 3 rounds on 2 cores).
    Each matching row is still read once."""
    from lmqtt.store.client import connect
    from lmqtt.store.spark.source import LmqttReader, _read_partition
    items = [(f"fround/d{i % 7}/{'temp' if i % 10 == 0 or i == 1501 else 'hum'}", f"v{i}".encode())
             for i in range(2000)]
    with connect(server.store_address) as c:
        c.producer().send_batch(items)
    opts = {"store": server.store_address, "filter": "fround/+/temp", "recordsperpartition": "50"}
    parts = [p for p in LmqttReader(opts).partitions() if p.key == "fround:0"]
    sizes = [p.end - p.start for p in parts]
    assert len(sizes) == 4 and sum(sizes) == 2000 and max(sizes) - min(sizes) <= 1, sizes
    got = [bytes(v).decode() for p in parts for b in _read_partition(opts, p) for v in b.column("payload").to_pylist()]
    assert sorted(got) == sorted(b.decode() for t, b in items if t.endswith("/temp"))
