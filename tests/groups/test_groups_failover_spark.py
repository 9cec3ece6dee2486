"""Two store groups of three real members each (tests/ha/group.py) and two `lmqtt gateway`s over
both: an SDK producer routing by topic and an MQTT publisher keep sending while each group's
primary is killed with SIGKILL in turn; a `#` subscriber connected throughout and a persistent
`#` session offline throughout get every acknowledged message, once; afterwards `lmqtt consume
--filter '#' --from earliest` and a Spark read over both groups return every acknowledged message
exactly once, and which group owns each topic (kept by the first group) is the same after its
primary's death. The file name ends in `_spark.py` so that under xdist it runs with the other
Spark tests, in the one SparkSession (tests/conftest.py)."""
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
from tests.support import LmqttGateway, Paho, lmqtt_cli  # noqa: E402


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
    gws: list[LmqttGateway] = []
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
        gws = [LmqttGateway(store, log_path=str(tmp_path / f"gw{i}.log")).start() for i in range(2)]
        live = Paho(gws[0], "e2e-live")
        assert live.subscribe("#", 1) == [1]
        away = Paho(gws[1], "e2e-away", clean=False)
        assert away.subscribe("#", 1) == [1]
        away.disconnect()
        mq_acked: list[tuple[str, bytes]] = []

        def publish_mqtt() -> None:
            """MQTT 5 QoS 1 through the second gateway: acknowledged = PUBACK with a success code."""
            pub = Paho(gws[1], "e2e-pub", version=5)
            codes: dict[int, int] = {}
            pub.c.on_publish = lambda c, u, mid, rc, props: codes.__setitem__(mid, int(getattr(rc, "value", rc)))
            i = 0
            while not stop.is_set() and i < 20_000:
                t, body = f"{topics[i % 4]}/mq{i % 5}", b"q%06d" % i
                info = pub.c.publish(t, body, qos=1)
                info.wait_for_publish(10)
                if info.is_published() and codes.get(info.mid, 0x80) < 0x80:
                    mq_acked.append((t, body))
                else:
                    failed.append((t, body, f"PUBACK {codes.get(info.mid)}"))
                i += 1
            pub.disconnect()

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
        mq = threading.Thread(target=publish_mqtt, daemon=True)
        mq.start()
        _wait(lambda: len(acked) >= 300 and len(mq_acked) >= 50, 30, "300 + 50 acknowledged before the first kill")
        first_a.kill9()
        ga.wait_primary(exclude=(first_a.node,), timeout=30)
        n = len(acked)
        _wait(lambda: len(acked) >= n + 300, 60, "300 more acknowledged after group ga's failover")
        first_b.kill9()
        gb.wait_primary(exclude=(first_b.node,), timeout=30)
        n = len(acked)
        _wait(lambda: len(acked) >= n + 300, 60, "300 more acknowledged after group gb's failover")
        _wait(lambda: len(mq_acked) >= 100, 60, "MQTT publishes acknowledged across the failovers")
        stop.set()
        th.join(60)
        mq.join(60)
        assert not th.is_alive() and not mq.is_alive()

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
        acked += mq_acked
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

        def received(client, until: float) -> list[tuple[str, bytes]]:
            """What `client` gets until every acknowledged message is in, or `until` passes."""
            got: list[tuple[str, bytes]] = []
            while time.monotonic() < until and not set(sent_ok) <= set(got):
                got += [(m.topic, m.payload) for m in client.drain(0.2)]
            return got + [(m.topic, m.payload) for m in client.drain(0.5)]      # and nothing twice after

        judge(received(live, time.monotonic() + 60), "the '#' subscriber connected throughout")
        away = Paho(gws[0], "e2e-away", clean=False)     # resumed on the other gateway
        assert away.session_present
        judge(received(away, time.monotonic() + 60), "the '#' session offline throughout")

        r = lmqtt_cli("consume", "--store", store, "--filter", "#", "--from", "earliest", "--timeout", "3",
                      "--format", "json", timeout=120)
        assert r.returncode == 0, r.stderr
        judge([(d["topic"], d["payload"].encode()) for d in map(json.loads, r.stdout.splitlines())], "lmqtt consume")

        rows = spark.read.format("lmqtt").option("store", store).option("filter", "#").load().collect()
        judge([(row.topic, bytes(row.payload)) for row in rows], "spark")
        assert len(acked) >= 900 + 100
    finally:
        if c is not None:
            c.close()
        for gw in gws:
            gw.stop()
        ga.stop()
        gb.stop()
