"""End-to-end: a history that mixes what the replay pump sends as one encoded run (plain QoS 0)
with what it sends message by message (QoS 1, MQTT 5 properties, message expiry, the publisher's
own messages under No Local) arrives complete, in the history's order, each message with its own
QoS, retain flag and properties. Against `lmqtt serve` and `lmqtt store` + `lmqtt gateway`."""
from __future__ import annotations

import pytest

from tests.support import Paho, both_kinds_fixtures, mixed_publish_props
from tests.e2e.test_e2e_replay import after, now_ms, subscribe_since


shared_server, lmqtt_server = both_kinds_fixtures()


pytestmark = pytest.mark.timeout(90)


def publish_mixed(pub: Paho, prefix: str, n: int) -> list[tuple]:
    """n messages on prefix/{a,b}/x: runs of plain QoS 0 broken by QoS 1, user properties and a
    message expiry. Returns what each should arrive as: (payload, qos published, user property)."""
    sent = []
    for i in range(n):
        qos = 1 if i % 17 == 5 else 0
        props, up, _exp = mixed_publish_props(i, (23, 7), (29, 11))
        pub.publish(f"{prefix}/{'ab'[i % 2]}/x", f"m{i}".encode(), qos=qos, properties=props)
        sent.append((f"m{i}", qos, up))
    return sent


@pytest.mark.parametrize("sub_qos", [0, 1])
def test_a_mixed_history_arrives_in_order_with_each_messages_own_parts(lmqtt_server, sub_qos):
    pfx = f"mx{sub_qos}"
    pub = Paho(lmqtt_server, f"{pfx}-pub", version=5)
    since = after(now_ms())
    sent = publish_mixed(pub, pfx, 300)
    sub = Paho(lmqtt_server, f"{pfx}-sub", version=5)
    codes, _ = subscribe_since(sub, f"{pfx}/+/x", sub_qos, since)
    assert codes == [sub_qos]
    got = sub.get_n(len(sent), timeout=30)
    assert [m.payload.decode() for m in got] == [s[0] for s in sent]
    assert [m.qos for m in got] == [min(sub_qos, s[1]) for s in sent]
    for m, (_, _, up) in zip(got, sent):
        ups = getattr(m.properties, "UserProperty", None) or []
        assert ups == ([up] if up else [])
        exp = getattr(m.properties, "MessageExpiryInterval", None)
        assert exp is None or 3590 <= exp <= 3600
    assert sum(1 for m in got if getattr(m.properties, "MessageExpiryInterval", None)) == \
        sum(1 for i in range(300) if i % 23 != 7 and i % 29 == 11)
    pub.publish(f"{pfx}/a/x", b"live", qos=1)
    assert [m.payload for m in sub.get_n(1)] == [b"live"]
    assert sub.drain(0.3) == []


def test_no_local_skips_the_subscribers_own_history_messages(lmqtt_server):
    """Subscribed at QoS 0: the others' messages go out as one run, the own ones are left out."""
    both = Paho(lmqtt_server, "nl-both", version=5)
    other = Paho(lmqtt_server, "nl-other", version=5)
    since = after(now_ms())
    for i in range(60):
        # QoS 1: each is stored before the next is sent (two connections: a defined order)
        (both if i % 3 == 0 else other).publish(f"nl/{i % 2}/x", f"m{i}".encode(), qos=1)
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
    from paho.mqtt.subscribeoptions import SubscribeOptions
    props = Properties(PacketTypes.SUBSCRIBE)
    props.UserProperty = ("since", str(since))
    res, _mid = both.c.subscribe("nl/+/x", options=SubscribeOptions(qos=0, noLocal=True), properties=props)
    assert res == 0
    want = [f"m{i}" for i in range(60) if i % 3]
    got = both.get_n(len(want), timeout=20)
    assert [m.payload.decode() for m in got] == want
    assert both.drain(0.3) == []
