"""The Spark source and sink over several store groups (option `store` with ';', docs/groups.md):
two real `lmqtt store` processes, every group read, its queues its own partitions."""

import pytest

from lmqtt.store.client import connect
from lmqtt.store.client.groups import rendezvous
from tests.support import LmqttStore, running


@pytest.fixture(scope="module")
def two_groups(tmp_path_factory):
    d = tmp_path_factory.mktemp("spark-groups")
    a = LmqttStore(str(d / "a"), log_path=str(d / "a.log"))
    b = LmqttStore(str(d / "b"), log_path=str(d / "b.log"))
    gens = [running(a), running(b)]
    for g in gens:
        next(g)
    try:
        yield a, b
    finally:
        for g in reversed(gens):
            next(g, None)


def test_a_read_covers_every_group_and_a_write_goes_to_each_topics_group(spark, two_groups):
    a, b = two_groups
    store = f"{a.address};{b.address}"
    c = connect(store)
    try:
        ta = next(f"sa{k}" for k in range(1000) if rendezvous(f"sa{k}", c.names) == 0)
        tb = next(f"sb{k}" for k in range(1000) if rendezvous(f"sb{k}", c.names) == 1)
        p = c.producer()
        sent = set()
        for i in range(30):
            for t in (ta, tb):
                p.send(f"{t}/d{i % 4}", b"%d" % i)
                sent.add((f"{t}/d{i % 4}", b"%d" % i))
    finally:
        c.close()
    df = spark.read.format("lmqtt").option("store", store).option("filter", "#").option(
        "recordsPerPartition", "20").load()
    assert df.rdd.getNumPartitions() >= 4          # each group's queue split into its own partitions
    rows = df.collect()
    got = [(r.topic, bytes(r.payload)) for r in rows if r.topic.split("/")[0] in (ta, tb)]
    assert len(got) == len(sent) and set(got) == sent          # every message once
    assert {r.queue for r in rows if r.topic.startswith(ta + "/")} == {f"{ta}:0"}

    # the writer: rows of both groups' topics, each stored in its topic's group
    out = spark.createDataFrame([(f"{ta}/w", b"wa"), (f"{tb}/w", b"wb"), (f"{ta}/w", b"wa2")], "topic string, payload binary")
    out.write.format("lmqtt").option("store", store).mode("append").save()
    for addr, t, want in ((a.address, ta, [b"wa", b"wa2"]), (b.address, tb, [b"wb"])):
        one = connect(addr)
        try:
            recs = one.pull(t, 0, 0, 1000).records
            # (the rows' partitions are written in parallel: no order between them)
            assert sorted(r.body for r in recs if r.topic == f"{t}/w") == want
        finally:
            one.close()


def test_a_stream_over_two_groups_reads_every_message_once_across_a_restart(spark, two_groups, tmp_path):
    """readStream over both groups with a group: two runs from one checkpoint (trigger once each),
    messages of both groups' topics in between: every message once, and the query's progress
    committed in each group (Spark commits a batch's offsets when it plans the next one)."""
    a, b = two_groups
    store = f"{a.address};{b.address}"
    c = connect(store)
    ta = next(f"st{k}" for k in range(1000) if rendezvous(f"st{k}", c.names) == 0)
    tb = next(f"su{k}" for k in range(1000) if rendezvous(f"su{k}", c.names) == 1)
    p = c.producer()
    seen: list[str] = []

    def sink(df, batch_id):
        seen.extend(r.v for r in df.collect())

    def run():
        q = (spark.readStream.format("lmqtt").option("store", store).option("filter", "+/s")
             .option("startingOffsets", "earliest").option("group", "stream-g").load()
             .selectExpr("cast(payload as string) as v").writeStream.foreachBatch(sink)
             .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(once=True).start())
        q.awaitTermination(120)
        assert q.exception() is None
    try:
        for i in range(10):
            p.send(f"{(ta, tb)[i % 2]}/s", b"%d" % i)
        run()
        for i in range(10, 16):
            p.send(f"{(ta, tb)[i % 2]}/s", b"%d" % i)
        run()
        assert sorted(seen, key=int) == [str(i) for i in range(16)]
        # the progress Spark committed (the batches before the last) is in each group
        lags = c.admin().lag("stream-g")
        assert {row["store_group"] for row in lags if row.get("topic") in (ta, tb)} == set(c.names)
    finally:
        c.close()
