"""The Spark source over a store group while the primary goes: a partition being read
when the primary stops answering and is replaced returns every row (its pulls are asked again of
the new primary), and a streaming query lmqtt -> lmqtt over the group's member list goes on through
a kill -9 of the primary with every message once. Real member processes (tests/ha/group.py); the
file name ends in `_spark.py` so that under xdist it runs with the other Spark tests, in the one
SparkSession (tests/conftest.py)."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("pyspark")

from lmqtt.store.client import connect  # noqa: E402
from tests.ha.group import StoreGroup  # noqa: E402
from tests.spark.conftest import spark  # noqa: E402,F401  (the session's one SparkSession)


def test_a_partition_read_while_the_primary_stops_and_is_replaced_returns_every_row(tmp_path):
    """The executor's read of one partition (SourceQueues.iter_batches, what each Spark task runs)
    keeps one pull in flight. The primary is SIGSTOPped between two pulls of a 3-pull range: the
    next pull goes to the stopped member over the open connection and gets no answer; the client
    learns of the new primary from the other members and drops that connection. Before the source
    followed the primary, that pull's ConnectionLost failed the task (local mode: the whole job); now it is asked again
    of the new primary, and every row comes, once, in order."""
    from lmqtt.store.spark.source import SourceQueues
    g = StoreGroup(str(tmp_path), 3, election_timeout=2.0).start()
    try:
        primary = g.wait_primary(in_sync=3)
        body = b"x" * 1000
        with connect(g.peers) as c:
            p = c.producer()
            for b in range(12):                  # 12,000 records of ~1 KB: pulls of 4 MiB -> 3+
                p.send_batch([("sf/a", b"%06d" % (b * 1000 + i) + body) for i in range(1000)])
        q = SourceQueues({"store": g.peers, "topic": "sf"})
        try:
            lo, hi = q.bounds("sf:0")
            assert (lo, hi) == (0, 12000)
            it = q.iter_batches("sf:0", lo, hi)
            batches = [next(it)]
            assert 0 < batches[0].num_rows < 6000        # more pulls to come
            primary.pause()
            batches += list(it)
            assert q.conn.failovers >= 1
        finally:
            q.conn.close()
            primary.kill9()
        got = [bytes(v)[:6] for b in batches for v in b.column("payload").to_pylist()]
        assert got == [b"%06d" % i for i in range(12000)]
    finally:
        g.stop()


def test_a_streaming_query_from_and_to_a_group_goes_on_through_a_kill9_of_the_primary(spark, tmp_path):
    """readStream lmqtt (topic `in`) -> writeStream lmqtt (topic `out`), both `store=` the group's
    three addresses, running while the primary is killed: the driver's offsets, the executors'
    reads and the sink's PRODUCEs (re-sent with their producer id + sequence) move to the new
    primary; `out` ends with every message of `in` exactly once."""
    (tmp_path / "g").mkdir()
    g = StoreGroup(str(tmp_path / "g"), 3, election_timeout=2.0).start()
    query = None
    try:
        primary = g.wait_primary(in_sync=3)
        c = connect(g.peers)
        p = c.producer()
        p.send_batch([("in/a", b"m%04d" % i) for i in range(200)])
        df = (spark.readStream.format("lmqtt").option("store", g.peers).option("topic", "in")
              .option("startingOffsets", "earliest").load()
              .selectExpr("concat('out/', substring(topic, 4)) as topic", "payload"))
        query = (df.writeStream.format("lmqtt").option("store", g.peers)
                 .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(processingTime="1 second")
                 .start())

        def out() -> list[bytes]:
            from tests.ha.group import read_all
            return [r.body for r in read_all(c, "out")]

        def wait_out(n: int, timeout: float = 120.0) -> list[bytes]:
            deadline = time.monotonic() + timeout
            got: list = []
            while time.monotonic() < deadline:
                assert query.exception() is None, query.exception()
                got = out()
                if len(got) >= n:
                    return got
                time.sleep(0.5)
            raise AssertionError(f"{len(got)} of {n} messages in out within {timeout}s")

        wait_out(200)
        primary.kill9()
        g.wait_primary(exclude=(primary.node,), timeout=60)
        p.send_batch([("in/a", b"m%04d" % i) for i in range(200, 400)])
        got = wait_out(400)
        time.sleep(3.0)                          # a few more triggers: nothing comes twice
        got = out()
        assert sorted(got) == [b"m%04d" % i for i in range(400)]
        c.close()
    finally:
        if query is not None:
            query.stop()
        g.stop()
