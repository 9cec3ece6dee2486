"""End-to-end: QoS 0/1/2, retained, `$` topics, overlapping subscriptions, MQTT 5 properties,
against a real `lmqtt serve` process, with paho-mqtt (3.1.1 and 5) and amqtt's client."""
from __future__ import annotations

import asyncio

import pytest

from tests.support import SERVER_KINDS, Paho, RawMQTT, both_kinds_fixtures, serve_or_fleet


shared_server, lmqtt_server = both_kinds_fixtures()


@pytest.fixture(params=SERVER_KINDS)
def fresh_server(request, tmp_path):
    """A server of its own, for a test that subscribes to `#` (the shared one holds other tests'
    retained messages)."""
    yield from serve_or_fleet(request.param, tmp_path)


pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("version", [4, 5])
@pytest.mark.parametrize("qos", [0, 1, 2])
def test_paho_round_trip_each_qos(lmqtt_server, version, qos):
    sub = Paho(lmqtt_server, f"sub-{version}-{qos}", version=version)
    assert sub.subscribe("rt/+/x", qos) == [qos]
    pub = Paho(lmqtt_server, f"pub-{version}-{qos}", version=version)
    for i in range(20):
        pub.publish(f"rt/{i % 3}/x", f"m{i}".encode(), qos=qos)
    got = sub.get_n(20)
    assert [m.payload for m in got] == [f"m{i}".encode() for i in range(20)]   # order kept per publisher
    assert {m.qos for m in got} == {qos}
    assert [m.topic for m in got][:3] == ["rt/0/x", "rt/1/x", "rt/2/x"]
    assert sub.before_sentinel(pub, "rt/0/x") == []          # nothing twice
    sub.disconnect()
    pub.disconnect()


def test_delivered_qos_is_min_of_publish_and_subscription(lmqtt_server):
    sub = Paho(lmqtt_server, "minq", version=4)
    sub.subscribe("mq/a", 1)
    pub = Paho(lmqtt_server, "minq-pub", version=4)
    pub.publish("mq/a", b"two", qos=2)
    pub.publish("mq/a", b"zero", qos=0)
    got = sub.get_n(2)
    assert [(m.payload, m.qos) for m in got] == [(b"two", 1), (b"zero", 0)]


def test_amqtt_client_round_trip_qos_0_1_2(lmqtt_server):
    from amqtt.client import MQTTClient

    async def run():
        url = f"mqtt://{lmqtt_server.host}:{lmqtt_server.port}/"
        sub = MQTTClient(client_id="amqtt-sub")
        await sub.connect(url)
        granted = await sub.subscribe([("am/#", 2)])
        assert granted == [2]
        pub = MQTTClient(client_id="amqtt-pub")
        await pub.connect(url)
        for q in (0, 1, 2):
            await pub.publish(f"am/q{q}", f"payload-{q}".encode(), qos=q)
        got = []
        for _ in range(3):
            m = await sub.deliver_message(timeout_duration=5)
            assert m is not None
            got.append((m.topic, bytes(m.data), m.qos))
        await pub.disconnect()
        await sub.disconnect()
        return got

    got = asyncio.run(run())
    assert got == [("am/q0", b"payload-0", 0), ("am/q1", b"payload-1", 1), ("am/q2", b"payload-2", 2)]


def test_paho_and_amqtt_interoperate(lmqtt_server):
    """A message published by amqtt reaches a paho MQTT 5 subscriber and vice versa."""
    from amqtt.client import MQTTClient
    p5 = Paho(lmqtt_server, "interop-paho", version=5)
    p5.subscribe("interop/to-paho", 1)

    async def run():
        c = MQTTClient(client_id="interop-amqtt")
        await c.connect(f"mqtt://{lmqtt_server.host}:{lmqtt_server.port}/")
        await c.subscribe([("interop/to-amqtt", 1)])
        await c.publish("interop/to-paho", b"hello paho", qos=1)
        await asyncio.get_running_loop().run_in_executor(None, p5.publish, "interop/to-amqtt", b"hello amqtt", 1)
        m = await c.deliver_message(timeout_duration=5)
        await c.disconnect()
        return m.topic, bytes(m.data)

    assert asyncio.run(run()) == ("interop/to-amqtt", b"hello amqtt")
    m = p5.get()
    assert (m.topic, m.payload) == ("interop/to-paho", b"hello paho")


def test_retained_set_replace_clear_with_wildcards(lmqtt_server):
    pub = Paho(lmqtt_server, "ret-pub")
    pub.publish("ret/a/temp", b"20", qos=1, retain=True)
    pub.publish("ret/b/temp", b"30", qos=1, retain=True)
    pub.publish("ret/a/temp", b"21", qos=1, retain=True)    # replace
    pub.publish("ret/c/temp", b"40", qos=1, retain=True)
    pub.publish("ret/c/temp", b"", qos=1, retain=True)      # clear
    pub.publish("other/x", b"no", qos=1, retain=True)

    s1 = Paho(lmqtt_server, "ret-s1")
    s1.subscribe("ret/+/temp", 1)
    got = sorted((m.topic, m.payload, m.retain) for m in s1.get_n(2) + s1.drain(0.4))
    assert got == [("ret/a/temp", b"21", True), ("ret/b/temp", b"30", True)]

    s2 = Paho(lmqtt_server, "ret-s2", version=5)
    s2.subscribe("ret/#", 1)
    got = sorted((m.topic, m.payload) for m in s2.get_n(2) + s2.drain(0.4))
    assert got == [("ret/a/temp", b"21"), ("ret/b/temp", b"30")]

    # A live message on a retained topic reaches existing subscribers with retain = 0 (3.1.1 §3.3.1.3).
    pub.publish("ret/a/temp", b"22", qos=1, retain=True)
    m = s1.get()
    assert (m.topic, m.payload, m.retain) == ("ret/a/temp", b"22", False)


def test_retained_survives_restart(lmqtt_server):
    pub = Paho(lmqtt_server, "ret-restart-pub")
    pub.publish("keep/me", b"persisted", qos=1, retain=True)
    pub.disconnect()
    lmqtt_server.restart()
    s = Paho(lmqtt_server, "ret-restart-sub")
    s.subscribe("keep/#", 0)
    m = s.get()
    assert (m.topic, m.payload, m.retain) == ("keep/me", b"persisted", True)


def test_dollar_topics_not_matched_by_leading_wildcards(fresh_server):
    lmqtt_server = fresh_server
    all_ = Paho(lmqtt_server, "dollar-hash")
    all_.subscribe("#", 0)
    plus = Paho(lmqtt_server, "dollar-plus")
    plus.subscribe("+/x", 0)
    dollar = Paho(lmqtt_server, "dollar-app")
    dollar.subscribe("$app/#", 0)          # $SYS is the broker's own (clients may not publish there)
    pub = Paho(lmqtt_server, "dollar-pub")
    pub.publish("$app/x", b"app", qos=1)
    pub.publish("a/x", b"normal", qos=1)
    assert dollar.get().payload == b"app"
    assert [m.topic for m in all_.get_n(1) + all_.drain(0.4)] == ["a/x"]
    assert [m.topic for m in plus.get_n(1) + plus.drain(0.4)] == ["a/x"]


@pytest.mark.parametrize("version", [4, 5])
def test_overlapping_subscriptions_deliver_once_with_max_qos(lmqtt_server, version):
    s = Paho(lmqtt_server, f"overlap-{version}", version=version)
    s.subscribe("ov/+", 0)
    s.subscribe("ov/#", 1)
    s.subscribe("ov/a", 0)
    pub = Paho(lmqtt_server, f"overlap-pub-{version}")
    for i in range(5):
        pub.publish("ov/a", f"{i}".encode(), qos=1)
    got = s.get_n(5) + s.drain(0.5)
    assert [(m.payload, m.qos) for m in got] == [(f"{i}".encode(), 1) for i in range(5)]


def test_unsubscribe_stops_delivery(lmqtt_server):
    s = Paho(lmqtt_server, "unsub", version=5)
    s.subscribe("us/#", 1)
    pub = Paho(lmqtt_server, "unsub-pub")
    pub.publish("us/1", b"before", qos=1)
    assert s.get().payload == b"before"
    rcs = s.unsubscribe("us/#")
    assert [int(getattr(r, "value", r)) for r in rcs] == [0]
    pub.publish("us/1", b"after", qos=1)
    assert s.drain(0.5) == []


def test_mqtt5_user_properties_and_app_properties_forwarded(lmqtt_server):
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
    s = Paho(lmqtt_server, "props-sub", version=5)
    s.subscribe("props/t", 1)
    pub = Paho(lmqtt_server, "props-pub", version=5)
    pp = Properties(PacketTypes.PUBLISH)
    pp.UserProperty = [("k1", "v1"), ("k2", "v2")]
    pp.ContentType = "application/json"
    pp.ResponseTopic = "props/reply"
    pp.CorrelationData = b"\x01\x02"
    pp.PayloadFormatIndicator = 1
    pub.publish("props/t", b'{"a":1}', qos=1, properties=pp)
    m = s.get()
    p = m.properties
    assert p.UserProperty == [("k1", "v1"), ("k2", "v2")]
    assert p.ContentType == "application/json"
    assert p.ResponseTopic == "props/reply"
    assert p.CorrelationData == b"\x01\x02"
    assert p.PayloadFormatIndicator == 1


@pytest.mark.parametrize("version,fail_code", [(4, 0x80), (5, 0x8F)])
def test_invalid_filter_gets_failure_code_others_granted(lmqtt_server, version, fail_code):
    # paho refuses to send bad filters, so this uses the raw codec client
    from lmqtt.gateway.mqtt import packets as P
    c = RawMQTT(lmqtt_server, version=version)
    assert c.connect(f"badfilter{version}").reason_code == 0
    c.send(P.Subscribe(7, [P.SubscriptionRequest("ok/+", 1), P.SubscriptionRequest("bad/#/x", 1),
                           P.SubscriptionRequest("bad+/x", 2), P.SubscriptionRequest("$share//x", 0),
                           P.SubscriptionRequest("fine/#", 2)]))
    ack = c.recv()
    assert isinstance(ack, P.SubAck) and ack.packet_id == 7
    assert ack.reason_codes == [1, fail_code, fail_code, fail_code, 2]
    c.close()


def test_mqtt5_assigned_client_identifier(lmqtt_server):
    c = Paho(lmqtt_server, "", version=5)
    assigned = c.connack_props.AssignedClientIdentifier
    assert assigned.startswith("lmqtt-")
    c.subscribe("assigned/t", 1)
    c.publish("assigned/t", b"me", qos=1)
    assert c.get().payload == b"me"


def test_mqtt31_client(lmqtt_server):
    import paho.mqtt.client as mqtt
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="old-timer", protocol=mqtt.MQTTv31)
    got = []
    c.on_message = lambda c, u, m: got.append(m.payload)
    c.connect(lmqtt_server.host, lmqtt_server.port)
    c.loop_start()
    try:
        r, mid = c.subscribe("v31/t", 1)
        import time
        deadline = time.monotonic() + 5
        c.publish("v31/t", b"3.1", qos=1).wait_for_publish(5)
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got == [b"3.1"]
    finally:
        c.disconnect()
        c.loop_stop()
