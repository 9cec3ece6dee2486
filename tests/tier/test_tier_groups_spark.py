"""`read_history` over several store groups (docs/groups.md), each with its own file:// tier: every
group's offloaded rows (its tier's Parquet) and hot tail (through the source), each message once."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from lmqtt.store.client import connect  # noqa: E402
from lmqtt.store.client.groups import rendezvous  # noqa: E402
from lmqtt.store.spark.cold import read_history  # noqa: E402
from tests.spark.conftest import spark  # noqa: E402,F401  (the session's one SparkSession)
from tests.support import LmqttStore  # noqa: E402
from tests.tier.test_tier_node import SEG_MB, _offloaded  # noqa: E402

BODY = 8 << 10


def test_read_history_unites_every_groups_tier_and_hot_tail(spark, tmp_path):  # noqa: F811
    stores, tiers = [], []
    for x in ("a", "b"):
        (tmp_path / x).mkdir()
        tiers.append(tmp_path / f"tier-{x}")
        stores.append(LmqttStore(str(tmp_path / x), ("--segment-mb", str(SEG_MB), "--tier", f"file://{tiers[-1]}",
                                                     "--local-retention", "0", "--tier-parquet-file-mb", "64",
                                                     "--tier-parquet-merge-after-s", "0"),
                                 log_path=str(tmp_path / f"{x}.log")).start())
    try:
        address = ";".join(s.address for s in stores)
        c = connect(address)
        try:
            topics = [next(t for t in (f"h{g}{k}" for k in range(1000)) if rendezvous(t, c.names) == g)
                      for g in (0, 1)]
            p = c.producer()
            sent = []

            def produce(n, start):
                for i in range(start, start + n, 50):
                    batch = [(f"{topics[j % 2]}/d{j % 3}", b"%06d" % j + os.urandom(BODY - 6))
                             for j in range(i, i + 50)]
                    p.send_batch(batch)
                    sent.extend(batch)
            produce(3000, 0)                       # ~12 MB a group: its first segments sealed
            for s in stores:
                _offloaded(s, 2)
            produce(200, 3000)                     # the hot tail of each
        finally:
            c.close()
        tier_arg = ";".join(f"file://{t}" for t in tiers)
        df = read_history(spark, store=address, tier=tier_arg, filter="#")
        # each group's offloaded rows come from its own tier's Parquet files
        files = df.inputFiles()
        assert all(any(f"/tier-{x}/parquet/" in f for f in files) for x in ("a", "b")), files
        got = sorted((r.topic, bytes(r.payload)) for r in df.select("topic", "payload").collect())
        assert got == sorted(sent)
        with pytest.raises(ValueError, match="2 store groups but 1 tiers"):
            read_history(spark, store=address, tier=f"file://{tiers[0]}", filter="#")
    finally:
        for s in stores:
            s.stop()
