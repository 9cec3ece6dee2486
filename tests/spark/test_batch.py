"""Batch source against a real `lmqtt serve`: MQTT publishes (paho) -> spark.read.format("lmqtt")."""
import time

from tests.support import Paho


def _publish(server, items, version=5):
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
    p = Paho(server, client_id="dev-pub", version=version)
    try:
        for topic, payload, qos, up in items:
            props = None
            if up:
                props = Properties(PacketTypes.PUBLISH)
                props.UserProperty = list(up.items())
                props.ContentType = "application/json"
            p.publish(topic, payload, qos=qos, properties=props)
    finally:
        p.disconnect()


def _wait_rows(spark, n, **opts):
    deadline = time.monotonic() + 10
    while True:
        r = spark.read.format("lmqtt")
        for k, v in opts.items():
            r = r.option(k, v)
        rows = r.load().collect()
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def test_filter_read_returns_exactly_the_published_rows(spark, server):
    sub = Paho(server, client_id="reg", version=5)
    sub.subscribe("farm/+/temp", qos=1)          # registers the wildcard filter, like a subscriber
    items = [(f"farm/d{i}/temp", f'{{"t": {20 + i}}}'.encode(), i % 2, {"unit": "C", "n": str(i)})
             for i in range(6)]
    items.append(("farm/d0/humidity", b"55", 1, None))   # not matched by the filter
    _publish(server, items)
    assert len(sub.get_n(6)) == 6

    # (the subscriber stays: the last unsubscribe of a filter drops its light queue)
    rows = _wait_rows(spark, 6, store=server.store_address, filter="farm/+/temp")
    sub.disconnect()
    assert len(rows) == 6
    rows.sort(key=lambda r: r.offset)
    assert [r.topic for r in rows] == [t for t, *_ in items[:6]]
    assert [bytes(r.payload) for r in rows] == [p for _, p, *_ in items[:6]]
    assert [r.qos for r in rows] == [i % 2 for i in range(6)]
    assert all(r.retain is False and r.client_id == "dev-pub" for r in rows)
    assert [r.user_properties for r in rows] == [{"unit": "C", "n": str(i)} for i in range(6)]
    assert {r.content_type for r in rows} == {"application/json"}
    assert {r.queue for r in rows} == {"farm:0"}     # read from the first-level topic's queue
    assert [r.offset for r in rows] == sorted({r.offset for r in rows})
    assert all(r.store_ts >= r.born_ts for r in rows) and len({r.msg_id for r in rows}) == 6

    # the same data through the first-level ConsumeQueue: all 7 messages of "farm"
    rows = _wait_rows(spark, 7, store=server.store_address, topic="farm")
    assert sorted(r.topic for r in rows) == sorted(t for t, *_ in items)
    assert {r.queue for r in rows} == {"farm:0"}


def test_time_range_returns_exactly_the_rows_in_range(spark, server):
    from lmqtt.store.client import connect
    c = connect(server.store_address)
    c.cmd("subscribe", filter="tr/#")
    prod = c.producer()
    marks = []
    for i in range(9):
        if i % 3 == 0:
            time.sleep(0.05)
            marks.append(int(time.time() * 1000))
            time.sleep(0.05)
        prod.send(f"tr/x/{i}", str(i).encode())
    c.close()
    t1, t2 = marks[1], marks[2]                # messages 3,4,5 lie in [t1, t2)
    for opts in ({"filter": "tr/#"}, {"topic": "tr"}):
        rows = _wait_rows(spark, 3, store=server.store_address, startTime=str(t1), endTime=str(t2), **opts)
        assert sorted(bytes(r.payload) for r in rows) == [b"3", b"4", b"5"], opts
    import datetime as dt
    iso = dt.datetime.fromtimestamp(t2 / 1000, dt.timezone.utc).isoformat()
    rows = _wait_rows(spark, 3, store=server.store_address, filter="tr/#", startTime=iso)
    assert sorted(bytes(r.payload) for r in rows) == [b"6", b"7", b"8"]
    # many small partitions read in parallel give the same rows
    df = (spark.read.format("lmqtt").option("store", server.store_address).option("filter", "tr/#")
          .option("recordsPerPartition", "2").load())
    assert df.rdd.getNumPartitions() == 5
    assert sorted(bytes(r.payload) for r in df.collect()) == [str(i).encode() for i in range(9)]


def test_state_as_of_and_delivery_audit(spark, server):
    from lmqtt.store.client import connect
    from lmqtt.store.spark import delivery_audit, state_as_of
    c = connect(server.store_address)
    prod = c.producer()
    for i in range(3):
        prod.send("st/a", f"a{i}".encode())
        prod.send("st/b", f"b{i}".encode())
    time.sleep(0.05)
    past = int(time.time() * 1000)
    time.sleep(0.05)
    prod.send("st/a", b"a-later")
    rows = state_as_of(spark, past, topic="st", store=server.store_address).collect()
    assert sorted((r.topic, bytes(r.payload)) for r in rows) == [("st/a", b"a2"), ("st/b", b"b2")]

    cons = c.consumer("st", group="billing", start="earliest")
    cons.poll()
    cons.commit(4)                                   # 4 of the 7 records processed
    audit = delivery_audit(spark, "billing", store=server.store_address).collect()
    assert [(r.queue, r.committed, r.max_offset, r.lag) for r in audit] == [("st:0", 4, 7, 3)]
    c.close()
