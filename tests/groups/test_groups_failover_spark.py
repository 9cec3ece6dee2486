"""Two store groups of three real members each (tests/ha/group.py): an SDK producer routing by
topic keeps sending while each group's primary is killed with SIGKILL in turn; afterwards
`lmqtt consume --filter '#' --from earliest` and a Spark read over both groups return every
acknowledged message exactly once, and which group owns each topic (kept by the first group) is
the same after its primary's death. The file name ends in `_spark.py` so that under xdist it runs
with the other Spark tests, in the one SparkSession (tests/conftest.py)."""
from __future__ import annotations

import collections
import json
import threading
import time

import pytest

pytest.importorskip("pyspark")

from lmqtt.store.client import connect  # noqa: E402
from lmqtt.store.client.groups import rendezvous  # noqa: E402
from tests.ha.group import StoreGroup  # noqa: E402
from tests.spark.conftest import spark  # noqa: E402,F401  (the session's one SparkSession)
from tests.support import lmqtt_cli  # noqa: E402


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def test_every_acknowledged_message_once_across_a_kill9_of_each_groups_primary(spark, tmp_path):  # noqa: F811
    (tmp_path / "ga").mkdir()
    (tmp_path / "gb").mkdir()
    ga = StoreGroup(str(tmp_path / "ga"), 3, name="ga", election_timeout=2.0).start()
    gb = StoreGroup(str(tmp_path / "gb"), 3, name="gb", election_timeout=2.0).start()
    c = None
    try:
        first_a, first_b = ga.wait_primary(in_sync=3), gb.wait_primary(in_sync=3)
        store = f"{ga.peers};{gb.peers}"
        c = connect(store)
        assert c.names == ["ga", "gb"]
        # two first-level topics per group
        topics = [next(t for t in (f"{p}{k}" for k in range(10_000)) if rendezvous(t, c.names) == g)
                  for p, g in (("w", 0), ("x", 0), ("y", 1), ("z", 1))]
        acked: list[tuple[str, bytes]] = []
        failed: list[tuple[str, bytes, str]] = []
        stop = threading.Event()

        def produce() -> None:
            p = c.producer()
            i = 0
            while not stop.is_set() and i < 20_000:
                t, body = f"{topics[i % 4]}/dev{i % 7}", b"m%06d" % i
                try:
                    p.send(t, body)
                    acked.append((t, body))
                except Exception as e:  # noqa: BLE001 - not acknowledged: may be stored at most once
                    failed.append((t, body, repr(e)))
                i += 1

        th = threading.Thread(target=produce, daemon=True)
        th.start()
        _wait(lambda: len(acked) >= 300, 30, "300 acknowledged before the first kill")
        first_a.kill9()
        ga.wait_primary(exclude=(first_a.node,), timeout=30)
        n = len(acked)
        _wait(lambda: len(acked) >= n + 300, 60, "300 more acknowledged after group ga's failover")
        first_b.kill9()
        gb.wait_primary(exclude=(first_b.node,), timeout=30)
        n = len(acked)
        _wait(lambda: len(acked) >= n + 300, 60, "300 more acknowledged after group gb's failover")
        stop.set()
        th.join(60)
        assert not th.is_alive()

        # the topic table outlived the death of the first group's primary, and still takes claims
        other = connect(store)
        try:
            owners = other.owners()
            assert {t: owners[t] for t in topics} == {topics[0]: "ga", topics[1]: "ga", topics[2]: "gb",
                                                       topics[3]: "gb"}
            late = next(t for t in (f"late{k}" for k in range(10_000)) if rendezvous(t, other.names) == 1)
            other.producer().send(f"{late}/x", b"late")
            assert other.owners()[late] == "gb"
        finally:
            other.close()

        mine = set(topics)
        sent_ok = collections.Counter(acked)
        maybe = collections.Counter((t, b) for t, b, _e in failed)

        def judge(got: list[tuple[str, bytes]], who: str) -> None:
            got_c = collections.Counter(x for x in got if x[0].split("/")[0] in mine)
            lost = [x for x in sent_ok if got_c[x] == 0]
            twice = [x for x, k in got_c.items() if k > 1]
            strange = [x for x in got_c if x not in sent_ok and x not in maybe]
            assert not lost, f"{who}: {len(lost)} acknowledged messages missing, e.g. {lost[:3]}"
            assert not twice, f"{who}: stored twice: {twice[:3]}"
            assert not strange, f"{who}: never sent: {strange[:3]}"

        r = lmqtt_cli("consume", "--store", store, "--filter", "#", "--from", "earliest", "--timeout", "3",
                      "--format", "json", timeout=120)
        assert r.returncode == 0, r.stderr
        judge([(d["topic"], d["payload"].encode()) for d in map(json.loads, r.stdout.splitlines())], "lmqtt consume")

        rows = spark.read.format("lmqtt").option("store", store).option("filter", "#").load().collect()
        judge([(row.topic, bytes(row.payload)) for row in rows], "spark")
        assert len(acked) >= 900
    finally:
        if c is not None:
            c.close()
        ga.stop()
        gb.stop()
