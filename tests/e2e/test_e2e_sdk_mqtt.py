"""Both directions meet: SDK producers/consumers against the store protocol of a real `lmqtt serve`
(its --store-port), MQTT clients (paho) against its MQTT port."""
from __future__ import annotations

import time


from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from lmqtt.store.client import connect
from tests.support import Paho, both_kinds_fixtures, poll_n


shared_server, lmqtt_server = both_kinds_fixtures()


def test_sdk_send_reaches_mqtt_wildcard_subscriber_with_properties(lmqtt_server):
    sub = Paho(lmqtt_server, "sub-sdk", version=5)
    sub.subscribe("sensors/+/temp", qos=1)
    with connect(lmqtt_server.store_address) as c:
        p = c.producer()
        p.send("sensors/a/temp", b"21.5", qos=1, content_type="text/plain", response_topic="reply/a",
               correlation_data=b"\x01\x02", user_properties=[("unit", "C"), ("src", "sdk")])
        p.send("sensors/a/hum", b"40")                       # not matched by the filter
        p.send_batch([("sensors/b/temp", b"b%d" % i) for i in range(20)])
    msgs = sub.get_n(21)
    assert [m.topic for m in msgs] == ["sensors/a/temp"] + ["sensors/b/temp"] * 20
    first = msgs[0]
    assert first.payload == b"21.5" and first.qos == 1
    props = first.properties
    assert props.ContentType == "text/plain" and props.ResponseTopic == "reply/a"
    assert props.CorrelationData == b"\x01\x02"
    assert props.UserProperty == [("unit", "C"), ("src", "sdk")]
    assert [m.payload for m in msgs[1:]] == [b"b%d" % i for i in range(20)]
    assert sub.before_sentinel(sub, "sensors/z/temp") == []      # nothing more (not sensors/a/hum)
    sub.disconnect()


def test_sdk_and_mqtt_appends_interleaved_all_reach_subscriber(lmqtt_server):
    """The gateway keeps a ring of the records it appended itself; appends by the SDK into the same
    embedded store (other light-queue offsets in between) must still be delivered, in order."""
    sub = Paho(lmqtt_server, "sub-mix", version=4)
    sub.subscribe("mix/#", qos=1)
    pub = Paho(lmqtt_server, "pub-mix", version=4)
    with connect(lmqtt_server.store_address) as c:
        p = c.producer()
        expect = []
        for i in range(30):
            if i % 3 == 0:
                p.send("mix/sdk", b"s%d" % i)
                expect.append(b"s%d" % i)
            else:
                pub.publish("mix/mqtt", b"m%d" % i, qos=1)
                expect.append(b"m%d" % i)
    got = sub.get_n(30)
    assert [m.payload for m in got] == expect
    sub.disconnect()
    pub.disconnect()


def test_mqtt_publish_consumed_by_sdk_filter_and_topic_consumers(lmqtt_server):
    with connect(lmqtt_server.store_address) as c:
        fc = c.filter_consumer("plant/+/temp")     # registered before the publishes, like SUBSCRIBE
        allc = c.filter_consumer("plant/#")
        pub = Paho(lmqtt_server, "pub-5", version=5)
        pp = Properties(PacketTypes.PUBLISH)
        pp.ContentType = "application/json"
        pp.ResponseTopic = "plant/replies"
        pp.CorrelationData = b"corr"
        pp.UserProperty = [("line", "3")]
        pub.publish("plant/7/temp", b'{"t":1}', qos=1, properties=pp)
        pub.publish("plant/7/pressure", b"2bar", qos=0)
        pub.publish("plant/8/temp", b"x", qos=1, retain=True)
        recs = poll_n(fc, 2)
        assert [(r.topic, r.body) for r in recs] == [("plant/7/temp", b'{"t":1}'), ("plant/8/temp", b"x")]
        m = recs[0].mqtt
        assert (m.qos, m.content_type, m.response_topic, m.correlation_data, m.user_properties) == \
            (1, "application/json", "plant/replies", b"corr", [("line", "3")])
        assert m.client_id == "pub-5"
        assert recs[1].mqtt.retain is True and recs[1].mqtt.qos == 1
        assert [r.topic for r in poll_n(allc, 3)] == ["plant/7/temp", "plant/7/pressure", "plant/8/temp"]
        # the same records by first-level topic over the ConsumeQueue
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(c.pull("plant", 0, 0).records) < 3:
            time.sleep(0.05)
        assert [r.body for r in c.pull("plant", 0, 0).records] == [b'{"t":1}', b"2bar", b"x"]
        # and round-trip: what the SDK read, re-sent by the SDK, reaches an MQTT subscriber unchanged
        sub = Paho(lmqtt_server, "sub-rt", version=5)
        sub.subscribe("echo/#", qos=1)
        r0 = recs[0]
        c.producer().send("echo/" + r0.topic, r0.body, qos=m.qos, content_type=m.content_type,
                          response_topic=m.response_topic, correlation_data=m.correlation_data,
                          user_properties=m.user_properties)
        e = sub.get()
        assert e.topic == "echo/plant/7/temp" and e.payload == b'{"t":1}' and e.qos == 1
        assert (e.properties.ContentType, e.properties.ResponseTopic, e.properties.CorrelationData,
                e.properties.UserProperty) == ("application/json", "plant/replies", b"corr", [("line", "3")])
        sub.disconnect()
        pub.disconnect()


def test_props_codec_matches_gateway():
    """store/client/props.py is the gateway's record_props encoding without the MQTT classes: both must
    write the same bytes and read each other's."""
    from lmqtt.gateway.storage import record_props as G
    from lmqtt.gateway.mqtt import packets as P
    from lmqtt.store.client import props as S

    gp = P.Properties(payload_format_indicator=1, message_expiry_interval=60, content_type="ct",
                      response_topic="rt", correlation_data=b"cd", user_property=[("a", "1"), ("b", "2")])
    g = G.encode(2, True, "cid", gp)
    s = S.encode(S.MessageProperties(2, True, "cid", 1, 60, "ct", "rt", b"cd", [("a", "1"), ("b", "2")]))
    assert g == s
    d = S.decode(g)
    assert (d.qos, d.retain, d.client_id, d.user_properties) == (2, True, "cid", [("a", "1"), ("b", "2")])
    assert G.decode(s).content_type == "ct"
    assert S.encode(S.MessageProperties(1)) == G.encode(1, False, "")
