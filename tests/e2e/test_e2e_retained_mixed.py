"""End-to-end: retained messages sent on SUBSCRIBE, when some are encoded as one run (plain ones)
and others one by one (MQTT 5 properties, message expiry): every one arrives once, with the
retain flag, its own QoS and properties, in the lookup's (topic) order, for a 3.1.1 and a 5
subscriber, at QoS 0 and 1. Against `lmqtt serve` and `lmqtt store` + `lmqtt gateway`."""
from __future__ import annotations

import pytest

from tests.support import Paho, both_kinds_fixtures, mixed_publish_props


shared_server, lmqtt_server = both_kinds_fixtures()


pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("version,sub_qos", [(4, 1), (5, 1), (5, 0)])
def test_mixed_retained_messages_arrive_each_with_its_own_parts(lmqtt_server, version, sub_qos):
    pfx = f"rm{version}{sub_qos}"
    pub = Paho(lmqtt_server, f"{pfx}-pub", version=5)
    want = {}
    for i in range(150):
        qos = 1 if i % 3 else 0
        props, up, _exp = mixed_publish_props(i, (13, 4), (11, 6))
        topic = f"{pfx}/{i:03d}"
        pub.publish(topic, f"r{i}".encode(), qos=qos, retain=True, properties=props)
        want[topic] = (f"r{i}", min(qos, sub_qos), up, props is not None and up is None)
    sub = Paho(lmqtt_server, f"{pfx}-sub", version=version)
    assert sub.subscribe(f"{pfx}/#", sub_qos) == [sub_qos]
    got = sub.get_n(len(want), timeout=30)
    assert [m.topic for m in got] == sorted(want)
    for m in got:
        payload, qos, up, expiry = want[m.topic]
        assert (m.payload.decode(), m.qos, m.retain) == (payload, qos, True)
        if version == 5:
            assert (getattr(m.properties, "UserProperty", None) or []) == ([up] if up else [])
            exp = getattr(m.properties, "MessageExpiryInterval", None)
            assert (exp is not None) == expiry and (exp is None or 3590 <= exp <= 3600)
    assert sub.drain(0.3) == []


def test_retained_messages_in_flight_at_a_disconnect_are_sent_again_with_dup(lmqtt_server):
    """A persistent session that got retained QoS 1 messages (sent as one run, each held in
    flight) and acknowledged none: on reconnect each comes again, same packet id, DUP set, retain
    flag kept; none twice after they are acknowledged."""
    from lmqtt.gateway.mqtt import packets as P
    from tests.support import RawMQTT
    pub = Paho(lmqtt_server, "rd-pub", version=4)
    for i in range(5):
        pub.publish(f"rd/{i}", b"v%d" % i, qos=1, retain=True)
    pub.disconnect()
    r = RawMQTT(lmqtt_server, version=4)
    assert r.connect("rd-keeper", clean=False).reason_code == 0
    r.send(P.Subscribe(1, [P.SubscriptionRequest("rd/#", 1)]))
    got = [r.recv(timeout=10) for _ in range(6)]
    first = [(g.topic, g.payload, g.packet_id, g.dup, g.retain) for g in got if isinstance(g, P.Publish)]
    assert [(t, b, d, rt) for t, b, _p, d, rt in first] == [(f"rd/{i}", b"v%d" % i, False, True) for i in range(5)]
    r.close()                                                   # nothing acknowledged
    r2 = RawMQTT(lmqtt_server, version=4)
    assert r2.connect("rd-keeper", clean=False).session_present
    again = [r2.recv(timeout=10) for _ in range(5)]
    assert [(g.topic, g.payload, g.packet_id, g.dup, g.retain) for g in again] == \
        [(t, b, p, True, True) for t, b, p, _d, _r in first]
    for g in again:
        r2.send(P.PubAck(g.packet_id))
    r2.send(P.PingReq())
    assert isinstance(r2.recv(timeout=10), P.PingResp)           # no third copy before the PINGRESP
    r2.close()
