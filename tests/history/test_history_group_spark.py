"""The Spark source over a replicated store group: `store="a:p,b:p,c:p"` (every member,
in any order) reads from the primary, by filter and by topic, and after a kill -9 of the primary
the same read follows the new one and returns the same rows (acknowledged writes are replicated).
Real member processes (tests/ha/group.py), the session's SparkSession."""
from __future__ import annotations

import pytest

pytest.importorskip("pyspark")

from lmqtt.store.client import connect  # noqa: E402
from tests.ha.group import StoreGroup  # noqa: E402
from tests.spark.conftest import spark  # noqa: E402,F401  (the session's one SparkSession)


def _read(spark, store: str, **opts) -> list[tuple[str, bytes]]:
    r = spark.read.format("lmqtt").option("store", store)
    for k, v in opts.items():
        r = r.option(k, str(v))
    return sorted((x.topic, bytes(x.payload)) for x in r.load().select("topic", "payload").collect())


def test_spark_reads_a_store_group_by_its_member_list_and_follows_the_primary(spark, tmp_path):
    g = StoreGroup(str(tmp_path), 3).start()
    try:
        primary = g.wait_primary(in_sync=2)
        sent = [(f"grp/d{i % 7}/{'t' if i % 3 else 'h'}", f"m-{i:05d}".encode()) for i in range(900)]
        with connect(g.peers) as c:
            p = c.producer()
            for i in range(0, len(sent), 100):
                p.send_batch(sent[i:i + 100])
        # the primary listed last: a client that took the first address would read a follower
        others = [m.address for m in g.members if m is not primary]
        store = ",".join(others + [primary.address])
        want_t = sorted(x for x in sent if x[0].endswith("/t"))
        assert _read(spark, store, filter="grp/+/t") == want_t
        assert _read(spark, store, topic="grp") == sorted(sent)
        primary.kill9()
        g.wait_primary(exclude=(primary.node,), timeout=60)
        assert _read(spark, store, filter="grp/+/t") == want_t
        assert _read(spark, store, topic="grp") == sorted(sent)
    finally:
        g.stop()
