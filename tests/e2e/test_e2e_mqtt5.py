"""MQTT 5 features end to end, against a real `lmqtt serve`: paho-mqtt 5 where the library shows the
behaviour, raw packets on the gateway's codec where a library hides it (topic aliases, the exact
PUBLISH bytes, limits that make the server disconnect).

One server serves the module (limits set in a TOML file so each can be hit with small packets);
each test uses its own topics and client ids. Persistence across a restart has its own server.
Every test runs against both shapes: the embedded `lmqtt serve` (in-process storage) and `lmqtt store`
+ `lmqtt gateway` (RemoteStore), so the MQTT 5 state (subscription identifiers in session records,
retained expiry deadlines) goes through both store seams.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
import shutil
import subprocess
import time
import urllib.request

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from lmqtt.gateway.mqtt import packets as P
from tests.support import ROOT, SERVER_KINDS, LmqttFleet, LmqttServer, Paho, RawMQTT, running, serve_or_fleet

TOPIC_ALIAS_MAX = 10
RECEIVE_MAX = 20
MAX_PACKET = 65536
MAX_KEEPALIVE = 30
RESPONSE_INFO = "lmqtt/responses/"


@pytest.fixture(scope="module", params=SERVER_KINDS)
def server(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("mqtt5")
    conf = d / "lmqtt.toml"
    conf.write_text(f'topic_alias_maximum = {TOPIC_ALIAS_MAX}\nreceive_maximum = {RECEIVE_MAX}\n'
                    f'max_packet_size = {MAX_PACKET}\nmax_keepalive = {MAX_KEEPALIVE}\n'
                    f'response_information = "{RESPONSE_INFO}"\n')
    if request.param == "serve":
        srv = LmqttServer(str(d / "data"), ("--config", str(conf)), log_path=str(d / "serve.log"))
    else:
        srv = LmqttFleet(str(d / "store-data"), ("--config", str(conf)), log_dir=str(d))
    yield from running(srv)


def _pub_props(**kw) -> Properties:
    p = Properties(PacketTypes.PUBLISH)
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def _sub_props(sid: int) -> Properties:
    p = Properties(PacketTypes.SUBSCRIBE)
    p.SubscriptionIdentifier = sid
    return p


def _subscribe(c: Paho, topic: str, qos: int = 1, sid: int | None = None, **opts) -> list:
    """paho subscribe with options and an optional subscription identifier; returns the SUBACK codes."""
    from paho.mqtt.subscribeoptions import SubscribeOptions
    res, mid = c.c.subscribe(topic, options=SubscribeOptions(qos=qos, **opts),
                             properties=_sub_props(sid) if sid else None)
    assert res == 0
    deadline = time.monotonic() + 5
    with c._sub_ev:
        while mid not in c._subacks:
            assert time.monotonic() < deadline, f"no SUBACK for {topic!r}"
            c._sub_ev.wait(0.1)
        return [int(getattr(r, "value", r)) for r in c._subacks.pop(mid)]


def _raw_v5(server, cid: str, **connect_props) -> tuple[RawMQTT, P.ConnAck]:
    raw = RawMQTT(server, version=5)
    ack = raw.connect(cid, props=P.Properties(**connect_props))
    assert isinstance(ack, P.ConnAck) and ack.reason_code == 0, ack
    return raw, ack


def _raw_subscribe(raw: RawMQTT, flt: str, qos: int = 0, pid: int = 1, **opts) -> P.SubAck:
    props = P.Properties()
    if "sid" in opts:
        props.subscription_identifier = [opts.pop("sid")]
    raw.send(P.Subscribe(pid, [P.SubscriptionRequest(flt, qos, **opts)], props))
    ack = raw.recv()
    assert isinstance(ack, P.SubAck), ack
    return ack


def _publish_retained_seen(server, pub: Paho, topic: str, payload: bytes, **kw) -> None:
    """Publish a retained message and return once a subscriber that was there before got it.

    Why: the PUBACK says durable, not yet indexed. In the fleet shape the store dispatches after
    the ack, so a SUBSCRIBE right after it could start its live cursor before the entry and get the
    message twice (retained + live). Tests of what a later SUBSCRIBE gets wait for the entry."""
    probe = Paho(server, f"probe-{topic}", version=5)
    probe.subscribe(topic, 1)
    probe.drain(0.05)
    pub.publish(topic, payload, 1, retain=True, **kw)
    m = probe.get()
    assert m.payload == payload
    probe.disconnect()


def _metric(server, name: str) -> float:
    body = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{") and line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ------------------------------------------------------------------------------------------ CONNACK
def test_connack_advertises_limits_and_answers_response_information(server):
    raw, ack = _raw_v5(server, "m5-connack", request_response_information=1)
    ap = ack.properties
    assert ap.topic_alias_maximum == TOPIC_ALIAS_MAX
    assert ap.receive_maximum == RECEIVE_MAX
    assert ap.maximum_packet_size == MAX_PACKET
    assert ap.subscription_identifier_available is None      # absent = available
    assert ap.response_information == RESPONSE_INFO
    raw.close()
    raw, ack = _raw_v5(server, "m5-connack2")                 # not asked: not sent
    assert ack.properties.response_information is None
    raw.close()


def test_server_keep_alive_caps_the_clients(server):
    raw = RawMQTT(server, version=5)
    ack = raw.connect("m5-keepalive", keepalive=600)
    assert ack.properties.server_keep_alive == MAX_KEEPALIVE
    raw.close()


# ------------------------------------------------------------------------------------ topic aliases
def test_inbound_topic_alias_sets_then_replaces_the_topic(server):
    sub = Paho(server, "m5-alias-sub", version=5)
    sub.subscribe("alias/in/#", 1)
    raw, _ = _raw_v5(server, "m5-alias-pub")
    raw.send(P.Publish("alias/in/a", b"first", 1, packet_id=1, properties=P.Properties(topic_alias=3)))
    raw.send(P.Publish("", b"second", 1, packet_id=2, properties=P.Properties(topic_alias=3)))
    raw.send(P.Publish("alias/in/b", b"third", 1, packet_id=3, properties=P.Properties(topic_alias=3)))
    raw.send(P.Publish("", b"fourth", 1, packet_id=4, properties=P.Properties(topic_alias=3)))
    acks = [raw.recv() for _ in range(4)]
    assert [a.packet_id for a in acks] == [1, 2, 3, 4] and all(a.reason_code == 0 for a in acks)
    got = [(m.topic, m.payload) for m in sub.get_n(4)]
    assert got == [("alias/in/a", b"first"), ("alias/in/a", b"second"),
                   ("alias/in/b", b"third"), ("alias/in/b", b"fourth")]
    raw.close()
    sub.disconnect()


def test_inbound_unknown_alias_is_a_protocol_error(server):
    raw, _ = _raw_v5(server, "m5-alias-unknown")
    raw.send(P.Publish("", b"x", 0, properties=P.Properties(topic_alias=4)))
    d = raw.recv()
    assert isinstance(d, P.Disconnect) and d.reason_code == 0x82
    assert "never set" in d.properties.reason_string


def test_inbound_alias_above_maximum_is_0x94(server):
    raw, _ = _raw_v5(server, "m5-alias-over")
    raw.send(P.Publish("alias/over", b"x", 0, properties=P.Properties(topic_alias=TOPIC_ALIAS_MAX + 1)))
    d = raw.recv()
    assert isinstance(d, P.Disconnect) and d.reason_code == 0x94


def test_outbound_topic_alias_replaces_repeated_topics(server):
    raw, _ = _raw_v5(server, "m5-alias-out", topic_alias_maximum=2)
    _raw_subscribe(raw, "alias/out/#")
    pub = Paho(server, "m5-alias-out-pub", version=5)
    for t in ("alias/out/a", "alias/out/a", "alias/out/b", "alias/out/c", "alias/out/c", "alias/out/b"):
        pub.publish(t, t.encode(), 1)
    got = [raw.recv() for _ in range(6)]
    wire = [(p.topic, p.properties.topic_alias, p.payload) for p in got]
    assert wire == [
        ("alias/out/a", 1, b"alias/out/a"),     # first time: topic and the alias it gets
        ("", 1, b"alias/out/a"),                # afterwards: empty topic, alias only
        ("alias/out/b", 2, b"alias/out/b"),
        ("alias/out/c", 1, b"alias/out/c"),     # the client allows 2: the least recently used
        ("", 1, b"alias/out/c"),                # alias (a's) is re-mapped to c
        ("", 2, b"alias/out/b"),
    ]
    raw.close()
    pub.disconnect()


def test_no_outbound_alias_without_the_clients_maximum(server):
    raw, _ = _raw_v5(server, "m5-alias-none")
    _raw_subscribe(raw, "alias/none")
    pub = Paho(server, "m5-alias-none-pub", version=5)
    pub.publish("alias/none", b"1", 0)
    pub.publish("alias/none", b"2", 0)
    got = [raw.recv(), raw.recv()]
    assert [(p.topic, p.properties.topic_alias) for p in got] == [("alias/none", None)] * 2
    raw.close()
    pub.disconnect()


# ---------------------------------------------------------------------------- subscription identifiers
def test_subscription_identifiers_of_all_matching_subscriptions(server):
    sub = Paho(server, "m5-sid", version=5)
    assert _subscribe(sub, "sid/+", 1, sid=7) == [1]
    assert _subscribe(sub, "sid/#", 0, sid=300) == [0]
    assert _subscribe(sub, "sid/plain/x", 1) == [1]
    pub = Paho(server, "m5-sid-pub", version=5)
    pub.publish("sid/a", b"both", 1)
    m = sub.get()
    assert (m.topic, m.payload, m.qos) == ("sid/a", b"both", 1)        # once, at the highest QoS
    assert sorted(m.properties.SubscriptionIdentifier) == [7, 300]
    pub.publish("sid/a/b", b"deep", 1)
    m = sub.get()
    assert m.payload == b"deep" and m.properties.SubscriptionIdentifier == [300]
    pub.publish("sid/plain/x", b"plain", 1)                              # sid/# (300) and one without
    m = sub.get()
    assert m.payload == b"plain" and m.properties.SubscriptionIdentifier == [300]
    assert sub.drain(0.3) == []
    sub.disconnect()
    pub.disconnect()


def test_subscription_identifier_on_retained_and_shared(server):
    pub = Paho(server, "m5-sid-ret-pub", version=5)
    _publish_retained_seen(server, pub, "sidret/t", b"kept")
    sub = Paho(server, "m5-sid-ret", version=5)
    _subscribe(sub, "sidret/t", 1, sid=11)
    m = sub.get()
    assert m.retain and m.properties.SubscriptionIdentifier == [11]
    _subscribe(sub, "$share/g/sidshared/t", 1, sid=12)
    pub.publish("sidshared/t", b"s", 1)
    m = sub.get()
    assert m.payload == b"s" and m.properties.SubscriptionIdentifier == [12]
    pub.publish("sidret/t", b"", 1, retain=True)
    sub.disconnect()
    pub.disconnect()


def test_resubscribe_without_identifier_drops_it(server):
    sub = Paho(server, "m5-sid-drop", version=5)
    _subscribe(sub, "siddrop/t", 1, sid=5)
    _subscribe(sub, "siddrop/t", 1)
    pub = Paho(server, "m5-sid-drop-pub", version=5)
    pub.publish("siddrop/t", b"x", 1)
    m = sub.get()
    assert m.properties is None or not getattr(m.properties, "SubscriptionIdentifier", None)
    sub.disconnect()
    pub.disconnect()


# ------------------------------------------------------------------------------- subscription options
def test_no_local_skips_own_publishes_only(server):
    c = Paho(server, "m5-nolocal", version=5)
    _subscribe(c, "nolocal/t", 1, noLocal=True)
    other = Paho(server, "m5-nolocal-other", version=5)
    c.publish("nolocal/t", b"mine", 1)
    other.publish("nolocal/t", b"theirs", 1)
    got = [m.payload for m in c.get_n(1)] + [m.payload for m in c.drain(0.3)]
    assert got == [b"theirs"]
    c.disconnect()
    other.disconnect()


def test_no_local_on_shared_subscription_is_a_protocol_error(server):
    raw, _ = _raw_v5(server, "m5-nolocal-shared")
    raw.send(P.Subscribe(1, [P.SubscriptionRequest("$share/g/nl/t", 1, no_local=True)]))
    d = raw.recv()
    assert isinstance(d, P.Disconnect) and d.reason_code == 0x82


def test_retain_as_published(server):
    keep = Paho(server, "m5-rap-keep", version=5)
    clear = Paho(server, "m5-rap-clear", version=5)
    _subscribe(keep, "rap/t", 1, retainAsPublished=True)
    _subscribe(clear, "rap/t", 1, retainAsPublished=False)
    pub = Paho(server, "m5-rap-pub", version=5)
    pub.publish("rap/t", b"r", 1, retain=True)
    pub.publish("rap/t", b"n", 1)
    assert [(m.payload, m.retain) for m in keep.get_n(2)] == [(b"r", True), (b"n", False)]
    assert [(m.payload, m.retain) for m in clear.get_n(2)] == [(b"r", False), (b"n", False)]
    late = Paho(server, "m5-rap-late", version=5)          # sent because of the subscribe: retain 1 always
    _subscribe(late, "rap/t", 1, retainAsPublished=False)
    m = late.get()
    assert (m.payload, m.retain) == (b"r", True)
    pub.publish("rap/t", b"", 1, retain=True)
    for c in (keep, clear, late, pub):
        c.disconnect()


@pytest.mark.parametrize("handling,expected", [(0, [b"v", b"v"]), (1, [b"v"]), (2, [])])
def test_retain_handling(server, handling, expected):
    topic = f"rh{handling}/t"
    pub = Paho(server, f"m5-rh{handling}-pub", version=5)
    _publish_retained_seen(server, pub, topic, b"v")
    c = Paho(server, f"m5-rh{handling}", version=5)
    _subscribe(c, topic, 1, retainHandling=handling)
    _subscribe(c, topic, 1, retainHandling=handling)        # the same subscription again
    got = [m.payload for m in c.drain(0.6)]
    assert got == expected
    pub.publish(topic, b"", 1, retain=True)
    c.disconnect()
    pub.disconnect()


# ------------------------------------------------------------------------------------ message expiry
def test_expiry_forwarded_as_remaining_interval(server):
    sub = Paho(server, "m5-exp-live", version=5)
    sub.subscribe("exp/live", 1)
    pub = Paho(server, "m5-exp-live-pub", version=5)
    pub.publish("exp/live", b"x", 1, properties=_pub_props(MessageExpiryInterval=120))
    m = sub.get()
    assert 119 <= m.properties.MessageExpiryInterval <= 120
    sub.disconnect()
    pub.disconnect()


def test_expired_messages_not_delivered_from_offline_backlog(server):
    sub = Paho(server, "m5-exp-offline", version=5, clean=False, expiry=300)
    sub.subscribe("exp/off", 1)
    sub.disconnect()
    pub = Paho(server, "m5-exp-offline-pub", version=5)
    pub.publish("exp/off", b"short", 1, properties=_pub_props(MessageExpiryInterval=1))
    pub.publish("exp/off", b"long", 1, properties=_pub_props(MessageExpiryInterval=100))
    pub.publish("exp/off", b"never", 1)
    time.sleep(2.2)
    back = Paho(server, "m5-exp-offline", version=5, clean=False, expiry=300)
    got = back.get_n(2) + back.drain(0.3)
    assert [m.payload for m in got] == [b"long", b"never"]
    assert 96 <= got[0].properties.MessageExpiryInterval <= 98      # ~2 s waited in the store
    assert _metric(server, 'lmqtt_dropped_messages_total{reason="expired"}') >= 1
    back.disconnect()
    pub.disconnect()


def test_expired_retained_message_is_not_sent(server):
    pub = Paho(server, "m5-exp-ret-pub", version=5)
    pub.publish("exp/ret/short", b"s", 1, retain=True, properties=_pub_props(MessageExpiryInterval=1))
    pub.publish("exp/ret/long", b"l", 1, retain=True, properties=_pub_props(MessageExpiryInterval=100))
    time.sleep(2.2)
    c = Paho(server, "m5-exp-ret", version=5)
    c.subscribe("exp/ret/#", 1)
    got = c.drain(0.6)
    assert [(m.topic, m.retain) for m in got] == [("exp/ret/long", True)]
    assert 96 <= got[0].properties.MessageExpiryInterval <= 98
    from lmqtt.store.client import connect
    if isinstance(server, LmqttFleet):
        with connect(server.store_address) as sdk:    # the expired one found is deleted from the store
            deadline = time.monotonic() + 10
            while sdk.cmd("gw_retained_matching", filter="exp/ret/short")["retained"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sdk.cmd("gw_retained_matching", filter="exp/ret/short")["retained"] == []
    pub.publish("exp/ret/long", b"", 1, retain=True)
    c.disconnect()
    pub.disconnect()


# ------------------------------------------------------------------------------ maximum packet size
def test_message_over_clients_maximum_packet_size_is_dropped_for_it(server):
    raw, _ = _raw_v5(server, "m5-maxp", maximum_packet_size=200)
    _raw_subscribe(raw, "maxp/t", 1)
    big_sub = Paho(server, "m5-maxp-big", version=5)
    big_sub.subscribe("maxp/t", 1)
    before = _metric(server, 'lmqtt_dropped_messages_total{reason="packet_too_large"}')
    pub = Paho(server, "m5-maxp-pub", version=5)
    pub.publish("maxp/t", b"a" * 150, 1)
    pub.publish("maxp/t", b"b" * 300, 1)          # over 200 bytes as a PUBLISH: not for the raw client
    pub.publish("maxp/t", b"c" * 10, 1)
    got = []
    for _ in range(2):
        p = raw.recv()
        got.append(p.payload)
        raw.send(P.PubAck(p.packet_id))
    assert got == [b"a" * 150, b"c" * 10]
    assert [len(m.payload) for m in big_sub.get_n(3)] == [150, 300, 10]   # the others get it
    assert _metric(server, 'lmqtt_dropped_messages_total{reason="packet_too_large"}') == before + 1
    raw.close()
    big_sub.disconnect()
    pub.disconnect()


def test_disconnect_reason_string_left_out_when_it_would_not_fit(server):
    raw, _ = _raw_v5(server, "m5-maxp-disc", maximum_packet_size=16)
    raw.send(P.Publish("", b"x", 0, properties=P.Properties(topic_alias=4)))     # alias never set
    data = raw.sock.recv(1024)
    assert data == bytes((0xE0, 1, 0x82))          # DISCONNECT 0x82, no reason string: 3 bytes
    with_room, _ = _raw_v5(server, "m5-maxp-disc2", maximum_packet_size=200)
    with_room.send(P.Publish("", b"x", 0, properties=P.Properties(topic_alias=4)))
    d = with_room.recv()
    assert d.reason_code == 0x82 and "never set" in d.properties.reason_string


def test_packet_over_servers_maximum_is_refused_with_0x95(server):
    raw, ack = _raw_v5(server, "m5-maxp-in")
    raw.send(P.Publish("maxp/in", b"x" * (ack.properties.maximum_packet_size + 1), 0))
    d = raw.recv()
    assert isinstance(d, P.Disconnect) and d.reason_code == 0x95


# ------------------------------------------------------------------------------ receive maximum in
def test_inbound_receive_maximum_exceeded_is_0x93(server):
    raw, ack = _raw_v5(server, "m5-recvmax")
    n = ack.properties.receive_maximum
    for pid in range(1, n + 1):              # QoS 2 without PUBREL: each stays unacknowledged
        raw.send(P.Publish("recvmax/t", b"x", 2, packet_id=pid))
    recs = [raw.recv() for _ in range(n)]
    assert all(isinstance(r, P.PubRec) for r in recs)
    raw.send(P.Publish("recvmax/t", b"x", 2, packet_id=n + 1))
    d = raw.recv()
    assert isinstance(d, P.Disconnect) and d.reason_code == 0x93


def test_receive_maximum_counts_only_unacknowledged(server):
    raw, ack = _raw_v5(server, "m5-recvmax-ok")
    for pid in range(1, 3 * ack.properties.receive_maximum):
        raw.send(P.Publish("recvmax/ok", b"x", 2, packet_id=pid))
        assert isinstance(raw.recv(), P.PubRec)
        raw.send(P.PubRel(pid))
        assert isinstance(raw.recv(), P.PubComp)
    raw.close()


# ------------------------------------------------------------------------ application properties
def test_application_properties_pass_through_unchanged(server):
    sub = Paho(server, "m5-props", version=5)
    sub.subscribe("props/t", 1)
    pub = Paho(server, "m5-props-pub", version=5)
    props = _pub_props(PayloadFormatIndicator=1, ContentType="application/json", ResponseTopic="props/reply",
                       CorrelationData=b"\x00\x01corr\xff", UserProperty=[("a", "1"), ("a", "2"), ("b", "")])
    pub.publish("props/t", b'{"x": 1}', 1, properties=props)
    m = sub.get()
    mp = m.properties
    assert mp.PayloadFormatIndicator == 1
    assert mp.ContentType == "application/json"
    assert mp.ResponseTopic == "props/reply"
    assert mp.CorrelationData == b"\x00\x01corr\xff"
    assert mp.UserProperty == [("a", "1"), ("a", "2"), ("b", "")]
    sub.disconnect()
    pub.disconnect()


def test_will_properties_pass_through_with_remaining_expiry(server):
    sub = Paho(server, "m5-will-sub", version=5)
    sub.subscribe("will5/t", 1)
    raw = RawMQTT(server, version=5)
    will = P.Will("will5/t", b"gone", 1, False,
                  P.Properties(content_type="text/plain", message_expiry_interval=50, response_topic="will5/r",
                               correlation_data=b"cd", user_property=[("why", "test")]))
    ack = raw.connect("m5-will", will=will)
    assert ack.reason_code == 0
    raw.sock.close()                       # no DISCONNECT: the will goes out
    m = sub.get()
    mp = m.properties
    assert (m.payload, mp.ContentType, mp.ResponseTopic, mp.CorrelationData, mp.UserProperty) == \
        (b"gone", "text/plain", "will5/r", b"cd", [("why", "test")])
    assert 49 <= mp.MessageExpiryInterval <= 50
    sub.disconnect()


# ---------------------------------------------------------------------------------- persistence
@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_subscription_identifiers_and_options_survive_restart(tmp_path, kind):
    with contextmanager(serve_or_fleet)(kind, tmp_path) as srv:
        c = Paho(srv, "m5-persist", version=5, clean=False, expiry=600)
        _subscribe(c, "persist/+", 1, sid=42, noLocal=True, retainAsPublished=True)
        _subscribe(c, "persist/#", 1, sid=43, retainAsPublished=True)
        c.disconnect()
        p = Paho(srv, "m5-persist-ret", version=5)
        p.publish("persistexp/short", b"s", 1, retain=True, properties=_pub_props(MessageExpiryInterval=1))
        p.publish("persistexp/long", b"l", 1, retain=True, properties=_pub_props(MessageExpiryInterval=300))
        p.disconnect()
        t_published = time.monotonic()
        srv.restart(kill=True)          # kill -9: the session record was written before SUBACK
        c = Paho(srv, "m5-persist", version=5, clean=False, expiry=600)
        assert c.session_present
        other = Paho(srv, "m5-persist-other", version=5)
        other.publish("persist/a", b"from-other", 1, retain=True)
        m = c.get()
        assert m.payload == b"from-other" and m.retain               # Retain As Published kept
        assert sorted(m.properties.SubscriptionIdentifier) == [42, 43]
        c.publish("persist/a", b"own", 1)                             # No Local on persist/+ kept;
        m = c.get()                                                   # persist/# has no No Local
        assert m.payload == b"own" and m.properties.SubscriptionIdentifier == [43]
        assert c.drain(0.3) == []
        other.publish("persist/a", b"", 1, retain=True)
        time.sleep(max(0.0, 1.2 - (time.monotonic() - t_published)))
        late = Paho(srv, "m5-persist-late", version=5)      # retained expiry deadlines survive too
        late.subscribe("persistexp/#", 1)
        got = late.drain(0.6)
        assert [m.topic for m in got] == ["persistexp/long"]
        assert 290 <= got[0].properties.MessageExpiryInterval <= 299
        c.disconnect()
        other.disconnect()
        late.disconnect()


# ------------------------------------------------------------------------ MQTT.js, a second client
JS = os.path.join(ROOT, "tests", "js")
NODE = shutil.which("node")
needs_mqttjs = pytest.mark.skipif(
    NODE is None or not os.path.isdir(os.path.join(JS, "node_modules", "mqtt")),
    reason="MQTT.js not installed (node + `npm ci --prefix tests/js`)")


class JsSub:
    """`node mqttjs_mqtt5.mjs sub ...` in the background (topic alias maximum 10); JSON lines."""

    def __init__(self, server, flt: str, count: int, options: dict, timeout_ms: int = 15000) -> None:
        self.p = subprocess.Popen([NODE, os.path.join(JS, "mqttjs_mqtt5.mjs"), "sub", f"mqtt://127.0.0.1:{server.port}",
                                   flt, str(count), str(timeout_ms), json.dumps(options)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=JS)
        self.early = []
        while True:
            ev = json.loads(self.p.stdout.readline() or '{"event": "eof"}')
            if ev["event"] in ("message", "wire"):
                self.early.append(ev)
                continue
            assert ev["event"] == "subscribed", (ev, self.p.stderr.read() if ev["event"] == "eof" else "")
            break

    def events(self, timeout: float = 30) -> list:
        out, _err = self.p.communicate(timeout=timeout)
        return self.early + [json.loads(line) for line in out.splitlines() if line.strip()]


@needs_mqttjs
def test_mqttjs_resolves_our_topic_aliases_and_reads_subscription_identifiers(server):
    js = JsSub(server, "jsalias/#", 4, {"qos": 1, "sid": 77})
    pub = Paho(server, "m5-js-alias-pub", version=5)
    for t in ("jsalias/a", "jsalias/a", "jsalias/b"):
        pub.publish(t, t.encode(), 1)
    pub.publish("jsalias/a", b"last", 1, properties=_pub_props(MessageExpiryInterval=100))
    ev = js.events()
    wire = [(e["topic"], e["topicAlias"]) for e in ev if e["event"] == "wire"]
    assert wire == [("jsalias/a", 1), ("", 1), ("jsalias/b", 2), ("", 1)]
    msgs = [e for e in ev if e["event"] == "message"]
    assert [(m["topic"], m["payload"]) for m in msgs] == [
        ("jsalias/a", "jsalias/a"), ("jsalias/a", "jsalias/a"), ("jsalias/b", "jsalias/b"), ("jsalias/a", "last")]
    assert [m["subscriptionIdentifier"] for m in msgs] == [[77]] * 4
    assert 99 <= msgs[-1]["messageExpiryInterval"] <= 100
    pub.disconnect()


@needs_mqttjs
def test_mqttjs_follows_our_alias_remapping_once_all_its_aliases_are_in_use(server):
    """More topics than the client's Topic Alias Maximum (MQTT.js: 10): the least recently used
    alias is re-mapped (topic and alias in one PUBLISH), and MQTT.js, an independent client,
    reads every message under the topic it was published to."""
    topics = [f"jsremap/{i % 13}" for i in range(39)]
    js = JsSub(server, "jsremap/#", len(topics), {"qos": 1})
    pub = Paho(server, "m5-js-remap-pub", version=5)
    for i, t in enumerate(topics):
        pub.publish(t, str(i).encode(), 1)
    ev = js.events()
    msgs = [(e["topic"], e["payload"]) for e in ev if e["event"] == "message"]
    assert msgs == [(t, str(i)) for i, t in enumerate(topics)]
    wire = [(e["topic"], e["topicAlias"]) for e in ev if e["event"] == "wire"]
    assert all(1 <= a <= 10 for _t, a in wire)
    named: dict[int, str] = {}
    remapped = 0
    for t, a in wire:
        if t:
            remapped += a in named and named[a] != t
            named[a] = t
    assert remapped > 0
    pub.disconnect()


@needs_mqttjs
def test_mqttjs_topic_aliases_towards_the_server(server):
    sub = Paho(server, "m5-js-pub-sub", version=5)
    sub.subscribe("jspub/#", 1)
    msgs = [{"topic": t, "payload": str(i), "qos": 1} for i, t in enumerate(["jspub/x", "jspub/x", "jspub/y", "jspub/x"])]
    r = subprocess.run([NODE, os.path.join(JS, "mqttjs_mqtt5.mjs"), "pub", f"mqtt://127.0.0.1:{server.port}",
                        json.dumps(msgs)], capture_output=True, text=True, timeout=30, cwd=JS)
    assert r.returncode == 0, r.stdout + r.stderr
    done = json.loads(r.stdout.splitlines()[-1])
    assert done == {"event": "published", "count": 4, "topicAliasMaximum": TOPIC_ALIAS_MAX}   # it used aliases
    assert [(m.topic, m.payload) for m in sub.get_n(4)] == [
        ("jspub/x", b"0"), ("jspub/x", b"1"), ("jspub/y", b"2"), ("jspub/x", b"3")]
    sub.disconnect()


@needs_mqttjs
def test_mqttjs_retain_handling_2_and_retain_as_published(server):
    pub = Paho(server, "m5-js-rh-pub", version=5)
    _publish_retained_seen(server, pub, "jsrh/t", b"old")
    js = JsSub(server, "jsrh/t", 1, {"qos": 1, "rh": 2, "rap": True}, timeout_ms=8000)
    pub.publish("jsrh/t", b"new", 1, retain=True)
    msgs = [e for e in js.events() if e["event"] == "message"]
    assert [(m["payload"], m["retain"]) for m in msgs] == [("new", True)]    # no retained on subscribe; flag kept
    pub.publish("jsrh/t", b"", 1, retain=True)
    pub.disconnect()
