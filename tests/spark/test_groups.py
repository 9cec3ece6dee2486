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
            assert [r.body for r in recs if r.topic == f"{t}/w"] == want
        finally:
            one.close()
