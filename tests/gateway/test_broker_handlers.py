"""The broker's packet handlers driven in-process: a real store and real light queues in a tmp
dir, `MQTTConnection` objects on a fake transport (no socket), packets in as bytes from the codec,
packets out decoded by a client-side codec. What goes wrong shows as the exact packet, not a
socket timeout."""
from __future__ import annotations

import asyncio

import pytest

from lmqtt.gateway.app.config import build_config
from lmqtt.gateway.net.connection import MQTTConnection
from lmqtt.gateway.mqtt import Decoder, ReasonCode, encode, packets as P
from lmqtt.gateway.app.gateway import Gateway
from tests.fakes import FakeTransport


class Client:
    """One fake-transport connection into the broker, speaking MQTT `version`."""

    def __init__(self, gw: Gateway, version: int = 5) -> None:
        self.version = version
        self.conn = MQTTConnection(gw.broker)
        self.transport = FakeTransport(self.conn)
        self.conn.connection_made(self.transport)
        self.decoder = Decoder(version, server_side=False)
        self.received: list = []

    def send(self, pkt) -> None:
        self.conn.data_received(encode(pkt, self.version))

    def send_raw(self, data: bytes) -> None:
        self.conn.data_received(data)

    def packets(self) -> list:
        self.received.extend(self.decoder.feed(self.transport.take()))
        return self.received

    async def wait_for(self, kind, n: int = 1) -> list:
        """The first `n` received packets of type `kind` (the store's durable ack comes from a
        flush thread, so the loop gets a bounded number of turns to deliver it)."""
        for _ in range(2000):
            got = [p for p in self.packets() if isinstance(p, kind)]
            if len(got) >= n:
                return got[:n]
            await asyncio.sleep(0.001)
        raise AssertionError(f"no {kind.__name__} after 2000 loop turns; got {self.received!r}")

    async def connect(self, client_id: str, clean: bool = True, **props) -> P.ConnAck:
        c = P.Connect(client_id=client_id, clean_start=clean, protocol_level=self.version)
        for k, v in props.items():
            setattr(c.properties, k, v)
        self.send(c)
        ack, = await self.wait_for(P.ConnAck)
        return ack


def run(tmp_path, body, **cfg_extra):
    """Start a Gateway on a free port with its data in tmp_path, run `body(gw)`, stop it."""
    async def main():
        cfg = build_config({}, {"host": "127.0.0.1", "port": 0, "metrics_port": 0,
                                "data_dir": str(tmp_path / "data"), "segment_mb": 16, **cfg_extra})
        gw = Gateway(cfg)
        await gw.start()
        try:
            return await body(gw)
        finally:
            await gw.stop()
    return asyncio.run(main())


def test_qos1_publish_is_acked_and_delivered_to_a_subscriber(tmp_path):
    async def body(gw):
        sub, pub = Client(gw), Client(gw, version=4)
        assert (await sub.connect("sub")).reason_code == 0
        assert (await pub.connect("pub")).reason_code == 0
        sub.send(P.Subscribe(1, [P.SubscriptionRequest("t/+", qos=1)]))
        assert (await sub.wait_for(P.SubAck))[0].reason_codes == [1]
        pub.send(P.Publish("t/1", b"one", qos=1, packet_id=7))
        pub.send(P.Publish("t/2", b"two", qos=1, packet_id=8))
        acks = await pub.wait_for(P.PubAck, 2)
        assert [a.packet_id for a in acks] == [7, 8]          # arrival order, both acked
        got = await sub.wait_for(P.Publish, 2)
        assert [(m.topic, m.payload, m.qos) for m in got] == [("t/1", b"one", 1), ("t/2", b"two", 1)]
        for m in got:
            sub.send(P.PubAck(m.packet_id))
        s = gw.broker.sessions["sub"]
        assert not s.inflight()                                 # the acks released the window
    run(tmp_path, body)


def test_enhanced_authentication_is_refused_with_a_v5_connack(tmp_path):
    async def body(gw):
        c = Client(gw)
        ack = await c.connect("x", authentication_method="SCRAM-SHA-256")
        assert ack.reason_code == ReasonCode.BAD_AUTHENTICATION_METHOD
        assert ack.properties.reason_string
        assert c.transport.closed
        await asyncio.sleep(0)
        assert "x" not in gw.broker.sessions and not c.conn.connected
    run(tmp_path, body)


def test_unsupported_protocol_level_gets_a_311_connack_return_code_1(tmp_path):
    async def body(gw):
        c = Client(gw, version=4)
        # CONNECT, protocol name MQTT, level 6, clean session, keepalive 60, client id "a"
        c.send_raw(bytes([0x10, 13, 0, 4]) + b"MQTT" + bytes([6, 2, 0, 60, 0, 1]) + b"a")
        assert c.transport.take() == encode(P.ConnAck(False, 1), 4)
        assert c.transport.closed
    run(tmp_path, body)


def test_malformed_v5_connect_gets_connack_malformed(tmp_path):
    async def body(gw):
        c = Client(gw)
        good = encode(P.Connect(client_id="m", protocol_level=5), 5)
        bad = good[:9] + bytes([good[9] | 0x01]) + good[10:]     # reserved connect flag set
        c.send_raw(bad)
        ack, = await c.wait_for(P.ConnAck)
        assert ack.reason_code == ReasonCode.MALFORMED_PACKET
        assert c.transport.closed
    run(tmp_path, body)


def test_takeover_disconnects_the_old_connection_with_0x8e(tmp_path):
    async def body(gw):
        old, new = Client(gw), Client(gw)
        await old.connect("same", clean=False, session_expiry_interval=60)
        old.send(P.Subscribe(1, [P.SubscriptionRequest("k/#", qos=1)]))
        await old.wait_for(P.SubAck)
        ack = await new.connect("same", clean=False, session_expiry_interval=60)
        assert ack.session_present
        d, = await old.wait_for(P.Disconnect)
        assert d.reason_code == ReasonCode.SESSION_TAKEN_OVER
        assert old.transport.closed
        s = gw.broker.sessions["same"]
        assert s.conn is new.conn and "k/#" in s.subs
        await asyncio.sleep(0)                   # the old connection's connection_lost runs
        assert gw.broker.sessions["same"].conn is new.conn
    run(tmp_path, body)


def test_wildcard_filter_is_registered_while_any_session_uses_it(tmp_path):
    async def body(gw):
        registry = gw.lq.registry
        a, b = Client(gw), Client(gw)
        await a.connect("a")
        await b.connect("b")
        a.send(P.Subscribe(1, [P.SubscriptionRequest("w/+", qos=0)]))
        b.send(P.Subscribe(1, [P.SubscriptionRequest("$share/g/w/+", qos=0)]))
        await a.wait_for(P.SubAck)
        await b.wait_for(P.SubAck)
        assert registry.refcount("w/+") == 1     # one registration, however many local users
        a.send(P.Unsubscribe(2, ["w/+"]))
        await a.wait_for(P.UnsubAck)
        assert registry.refcount("w/+") == 1     # the shared group still reads it
        b.send(P.Disconnect())                   # non-persistent session ends
        for _ in range(100):
            if registry.refcount("w/+") == 0:
                break
            await asyncio.sleep(0.001)
        assert registry.refcount("w/+") == 0
    run(tmp_path, body)


def test_retained_message_reaches_a_later_subscriber_with_the_retain_flag(tmp_path):
    async def body(gw):
        pub, sub = Client(gw), Client(gw, version=4)
        await pub.connect("p")
        pub.send(P.Publish("r/x", b"kept", qos=1, retain=True, packet_id=1))
        await pub.wait_for(P.PubAck)
        await sub.connect("s")
        sub.send(P.Subscribe(3, [P.SubscriptionRequest("r/#", qos=1)]))
        m, = await sub.wait_for(P.Publish)
        assert (m.topic, m.payload, m.retain, m.qos) == ("r/x", b"kept", True, 1)
    run(tmp_path, body)


def test_packet_before_connect_closes_the_connection(tmp_path):
    async def body(gw):
        c = Client(gw, version=4)
        c.send_raw(encode(P.PingReq(), 4))
        assert c.transport.closed and c.transport.take() == b""
        assert not gw.broker.sessions
    run(tmp_path, body)


@pytest.mark.parametrize("version", [4, 5])
def test_qos2_inbound_flow_pubrec_pubrel_pubcomp(tmp_path, version):
    async def body(gw):
        c = Client(gw, version)
        await c.connect("q2")
        c.send(P.Publish("q/2", b"x", qos=2, packet_id=9))
        rec, = await c.wait_for(P.PubRec)
        assert rec.packet_id == 9
        c.send(P.Publish("q/2", b"x", qos=2, packet_id=9, dup=True))   # stored: only PUBREC again
        await c.wait_for(P.PubRec, 2)
        c.send(P.PubRel(9))
        comp, = await c.wait_for(P.PubComp)
        assert comp.packet_id == 9 and comp.reason_code == 0
        c.send(P.PubRel(9))                                            # unknown id now
        comps = await c.wait_for(P.PubComp, 2)
        assert comps[1].reason_code == (ReasonCode.PACKET_IDENTIFIER_NOT_FOUND if version == 5 else 0)
    run(tmp_path, body)


def test_will_is_published_when_the_connection_drops_without_disconnect(tmp_path):
    async def body(gw):
        watcher, dying = Client(gw, version=4), Client(gw)
        await watcher.connect("watcher")
        watcher.send(P.Subscribe(1, [P.SubscriptionRequest("wills/#", qos=1)]))
        await watcher.wait_for(P.SubAck)
        c = P.Connect(client_id="dying", protocol_level=5,
                      will=P.Will("wills/dying", b"gone", qos=1, retain=False))
        dying.send(c)
        await dying.wait_for(P.ConnAck)
        assert [cid for cid, _w in gw.broker.storage.wills.held().wait()] == ["dying"]   # kept for a crash
        dying.transport.close()                      # network loss: connection_lost, no DISCONNECT
        m, = await watcher.wait_for(P.Publish)
        assert (m.topic, m.payload) == ("wills/dying", b"gone")
        assert list(gw.broker.storage.wills.held().wait()) == []
    run(tmp_path, body)


def test_persistent_session_and_its_wildcard_filter_survive_a_gateway_restart(tmp_path):
    async def first(gw):
        c = Client(gw)
        await c.connect("keeper", clean=False, session_expiry_interval=3600)
        c.send(P.Subscribe(1, [P.SubscriptionRequest("p/+", qos=1),
                               P.SubscriptionRequest("$share/g/p/+", qos=1)]))
        await c.wait_for(P.SubAck)
        c.send(P.Disconnect())
        await asyncio.sleep(0)

    async def second(gw):
        d = gw.broker.session_registry.dormant["keeper"]     # restored dormant: built when its client connects
        assert "keeper" not in gw.broker.sessions
        assert set(zip(d.subs[::2], d.subs[1::2])) == {("p/+", None), ("p/+", "g")}
        assert gw.lq.registry.refcount("p/+") == 1       # one registration for both users
        pub, c = Client(gw), Client(gw)
        await pub.connect("pub")
        pub.send(P.Publish("p/1", b"while away", qos=1, packet_id=1))
        await pub.wait_for(P.PubAck)
        ack = await c.connect("keeper", clean=False, session_expiry_interval=3600)
        assert ack.session_present
        got = await c.wait_for(P.Publish, 2)             # once per subscription: direct and shared
        assert sorted(m.payload for m in got) == [b"while away", b"while away"]
    run(tmp_path, first)
    run(tmp_path, second)


# ------------------------------------------------------------------------------------- MQTT 5 parts
def test_reconnect_resends_in_flight_with_its_subscription_identifier(tmp_path):
    async def body(gw):
        sub, pub = Client(gw), Client(gw)
        await sub.connect("sid-resend", clean=False, session_expiry_interval=60)
        sub.send(P.Subscribe(1, [P.SubscriptionRequest("r/#", qos=1)], P.Properties(subscription_identifier=[9])))
        await sub.wait_for(P.SubAck)
        await pub.connect("sid-pub")
        pub.send(P.Publish("r/a", b"x", qos=1, packet_id=1))
        first, = await sub.wait_for(P.Publish)
        assert first.properties.subscription_identifier == [9] and not first.dup
        again = Client(gw)                     # not acked: the new connection gets it again, DUP
        await again.connect("sid-resend", clean=False, session_expiry_interval=60)
        resent, = await again.wait_for(P.Publish)
        assert (resent.packet_id, resent.dup, resent.properties.subscription_identifier) == \
            (first.packet_id, True, [9])
    run(tmp_path, body)


def test_in_flight_message_over_the_new_connections_maximum_is_dropped_and_frees_the_window(tmp_path):
    async def body(gw):
        sub, pub = Client(gw), Client(gw)
        await sub.connect("maxp-resend", clean=False, session_expiry_interval=60)
        sub.send(P.Subscribe(1, [P.SubscriptionRequest("m/#", qos=1)]))
        await sub.wait_for(P.SubAck)
        await pub.connect("maxp-pub")
        pub.send(P.Publish("m/a", b"y" * 100, qos=1, packet_id=1))
        await sub.wait_for(P.Publish)
        small = Client(gw)
        await small.connect("maxp-resend", clean=False, session_expiry_interval=60, maximum_packet_size=50)
        s = gw.broker.sessions["maxp-resend"]
        assert not s.inflight() and s.dropped_too_large == 1   # not resent, released
        pub.send(P.Publish("m/b", b"small", qos=1, packet_id=2))
        got, = await small.wait_for(P.Publish)
        assert got.payload == b"small"
    run(tmp_path, body)


def test_expired_message_is_not_delivered_to_a_311_subscriber(tmp_path):
    async def body(gw):
        sub, pub = Client(gw, version=4), Client(gw)
        await sub.connect("exp-311", clean=False)
        sub.send(P.Subscribe(1, [P.SubscriptionRequest("e/t", qos=1)]))
        await sub.wait_for(P.SubAck)
        sub.conn.close()
        await asyncio.sleep(0)
        await pub.connect("exp-pub")
        pub.send(P.Publish("e/t", b"gone", qos=1, packet_id=1,
                           properties=P.Properties(message_expiry_interval=1)))
        pub.send(P.Publish("e/t", b"kept", qos=1, packet_id=2))
        await pub.wait_for(P.PubAck, 2)
        await asyncio.sleep(1.1)
        back = Client(gw, version=4)
        await back.connect("exp-311", clean=False)
        got, = await back.wait_for(P.Publish)
        await asyncio.sleep(0.05)
        assert [p.payload for p in back.packets() if isinstance(p, P.Publish)] == [b"kept"]
        assert got.payload == b"kept"
    run(tmp_path, body)


def test_publish_bytes_without_per_subscriber_parts_is_the_shared_template():
    """The fast path (shared template variant) and MqttSession.publish_bytes agree byte for byte when
    there is nothing per subscriber, so choosing either cannot change what a client receives."""
    from lmqtt.gateway.storage.record_props import RecordMeta
    from lmqtt.gateway.session import OutboundMessage, MqttSession
    rec = RecordMeta(qos=1, content_type="text/plain", user_property=[("k", "v")])
    for version in (4, 5):
        s = MqttSession("c")
        s.connect(version, None, None, None, 0, 1000)
        for qos, retain, pid in ((0, False, None), (1, True, 5), (2, False, 65535)):
            it = OutboundMessage("a/b", b"payload", rec, store_ts=1)
            assert s.publish_bytes(it, qos, retain, pid) == it.encode(qos, retain, version, pid)


def test_no_reason_string_on_a_negative_puback_when_problem_information_is_off(tmp_path):
    async def body(gw):
        quiet, loud = Client(gw), Client(gw)
        await quiet.connect("quiet", request_problem_information=0)
        await loud.connect("loud")
        too_big = b"x" * ((4 << 20) + 100)        # over the store's 4 MiB record limit, under the packet limit
        quiet.send(P.Publish("big/t", too_big, qos=1, packet_id=1))
        loud.send(P.Publish("big/t", too_big, qos=1, packet_id=1))
        q, = await quiet.wait_for(P.PubAck)
        lo, = await loud.wait_for(P.PubAck)
        assert q.reason_code == lo.reason_code == ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR
        assert q.properties.reason_string is None
        assert "store error" in lo.properties.reason_string
    run(tmp_path, body)


def test_shared_expiry_variant_equals_the_per_subscriber_encoding():
    """A message with an expiry fanned out to plain MQTT 5 subscribers shares one encoding per
    second left (`encode_with_expiry`); it must equal the general per-subscriber build."""
    from lmqtt.gateway.mqtt import encode_publish_v5_parts, message_expiry_prop
    from lmqtt.gateway.storage.record_props import RecordMeta
    from lmqtt.gateway.session import OutboundMessage
    for rec in (RecordMeta(qos=2, message_expiry_interval=60),
                RecordMeta(qos=2, message_expiry_interval=60, content_type="c", user_property=[("k", "v")])):
        it = OutboundMessage("a/b", b"p" * 300, rec, store_ts=1)
        for left in (60, 59):
            for qos, retain, pid, dup in ((0, False, None, False), (1, True, 7, False), (2, False, 65535, True),
                                          (1, False, 300, True)):
                want = encode_publish_v5_parts("a/b", it.payload, qos, retain, dup, pid,
                                               it.properties_body() + message_expiry_prop(left))
                assert it.encode_with_expiry(qos, retain, pid, dup, left) == want


def test_outbound_topic_aliases_always_resolve_to_the_sent_topic():
    """Random topic sequences, random client limits, some messages too large for the client: a
    client that resolves aliases exactly as MQTT 5 says (§3.3.2.3.4) always reads the topic that
    was meant, never sees an alias above its maximum, and never sees an empty topic with an alias
    it was not told."""
    import random
    from lmqtt.gateway.mqtt import Decoder
    from lmqtt.gateway.storage.record_props import RecordMeta
    from lmqtt.gateway.session import OutboundMessage, MqttSession
    rnd = random.Random(2026)
    for _ in range(200):
        s = MqttSession("c")
        alias_max = rnd.randint(1, 6)
        s.connect(5, None, rnd.choice([0, 60, 80]), alias_max, 100, 1000)
        client: dict[int, str] = {}
        dec = Decoder(version=5, server_side=False)
        for _ in range(60):
            topic = f"t/{rnd.randint(0, 9)}"
            it = OutboundMessage(topic, b"x" * rnd.choice([1, 30, 70]), RecordMeta(qos=1))
            data = s.publish_bytes(it, 1, False, 1)
            if type(data) is not bytes:
                continue                      # dropped for this client: it learnt nothing
            p, = dec.feed(data)
            alias = p.properties.topic_alias
            if alias is not None:
                assert 1 <= alias <= alias_max
                if p.topic:
                    client[alias] = p.topic
                else:
                    assert alias in client
            got = p.topic or client[alias]
            assert got == topic


@pytest.mark.parametrize("store_answer", ["ok", "failed"])
def test_a_connection_waiting_for_the_store_writes_and_reads_nothing_until_it_answered(tmp_path, store_answer):
    """`wait_for_store` (a fleet gateway's session write in flight): the answers already queued
    and the packets read meanwhile wait, the socket is not read, and everything goes out in order
    once the store answered; a failed answer (logged by its writer) releases the same way."""
    async def body(gw):
        c = Client(gw, version=4)
        assert (await c.connect("waiting")).reason_code == 0
        before = len(c.packets())
        store_write = asyncio.get_running_loop().create_future()
        c.conn.wait_for_store(store_write)
        c.send(P.PingReq())                       # an answer to this would be queued behind the write
        c.send(P.Subscribe(3, [P.SubscriptionRequest("w/+", qos=1)]))
        await asyncio.sleep(0.01)
        assert len(c.packets()) == before and c.transport.take() == b""
        assert c.transport.reading is False and c.conn.write_blocked
        if store_answer == "ok":
            store_write.set_result(None)
        else:
            store_write.set_exception(ConnectionError("store gone"))
            store_write.exception()
        await c.wait_for(P.PingResp)
        suback = await c.wait_for(P.SubAck)
        got = c.packets()[before:]
        assert [type(p) for p in got] == [P.PingResp, P.SubAck] and suback[0].reason_codes == [1]
        assert c.transport.reading is True and not c.conn.write_blocked
    run(tmp_path, body)


def test_qos0_messages_for_a_client_waiting_for_the_store_wait_with_it_and_are_not_dropped(tmp_path):
    """A client whose answer waits for the store is not a slow reader: its QoS 0 messages are
    held back (its cursor stays), none is counted as dropped for back-pressure, and all of them
    arrive, in order, once the store answered."""
    async def body(gw):
        sub, pub = Client(gw, version=4), Client(gw, version=4)
        assert (await sub.connect("q0-sub")).reason_code == 0
        assert (await pub.connect("q0-pub")).reason_code == 0
        sub.send(P.Subscribe(1, [P.SubscriptionRequest("q0/t", qos=0)]))
        await sub.wait_for(P.SubAck)
        dropped = gw.broker.metrics.dropped_qos0_backpressure._value.get()
        store_write = asyncio.get_running_loop().create_future()
        sub.conn.wait_for_store(store_write)
        for i in range(20):
            pub.send(P.Publish("q0/t", b"m%d" % i, qos=0))
        await asyncio.sleep(0.05)
        assert not [p for p in sub.packets() if isinstance(p, P.Publish)]
        store_write.set_result(None)
        got = await sub.wait_for(P.Publish, 20)
        assert [p.payload for p in got] == [b"m%d" % i for i in range(20)]
        assert gw.broker.metrics.dropped_qos0_backpressure._value.get() == dropped
    run(tmp_path, body)


# ------------------------------------------------------------------------------- connection deadlines
def test_the_sweep_closes_a_silent_connection_with_keep_alive_timeout(tmp_path):
    """Silent for more than 1.5 x its keep alive: DISCONNECT 0x8D (MQTT 5), then closed; a
    connection heard from within it stays."""
    async def body(gw):
        quiet, talking = Client(gw), Client(gw)
        for c, cid in ((quiet, "ka-quiet"), (talking, "ka-talking")):
            pkt = P.Connect(client_id=cid, protocol_level=5, keepalive=10)
            c.send(pkt)
            await c.wait_for(P.ConnAck)
        now = asyncio.get_running_loop().time()
        quiet.conn.last_rx = now - 16                 # > 15 s = 1.5 x 10 s
        talking.conn.last_rx = now - 14
        gw.broker.sweep.sweep()
        d, = await quiet.wait_for(P.Disconnect)
        assert d.reason_code == ReasonCode.KEEP_ALIVE_TIMEOUT and quiet.transport.closed
        assert not talking.transport.closed
        assert not [p for p in talking.packets() if isinstance(p, P.Disconnect)]
    run(tmp_path, body)


def test_the_sweep_closes_a_socket_without_connect_after_connect_timeout(tmp_path):
    async def body(gw):
        idle = Client(gw)
        gw.broker.sweep.sweep()
        assert not idle.transport.closed               # within connect_timeout_s
        idle.conn.accepted_at -= gw.cfg.connect_timeout_s + 1
        gw.broker.sweep.sweep()
        assert idle.transport.closed and idle.transport.take() == b""    # nothing to answer
    run(tmp_path, body)


def test_a_stalled_reauthentication_is_ended_by_the_sweep_with_disconnect_0x87(tmp_path, caplog):
    import logging

    from lmqtt.gateway.security.scram import ScramClient
    from tests.gateway.test_scram_broker import _auth, _scram_login, run as run_scram

    async def body(gw):
        c = Client(gw)
        assert (await _scram_login(c, "reauth-stall", "alice", "s3cret"))[1].reason_code == 0
        c.send(_auth(ReasonCode.RE_AUTHENTICATE, ScramClient("alice", "s3cret").first()))
        await c.wait_for(P.Auth, 2)                    # the challenge ... never answered
        c.conn.auth_login.started_at -= gw.cfg.connect_timeout_s + 1
        with caplog.at_level(logging.INFO, logger="lmqtt.gateway"):
            gw.broker.sweep.sweep()
        d, = await c.wait_for(P.Disconnect)
        assert d.reason_code == ReasonCode.NOT_AUTHORIZED and c.transport.closed
        assert c.conn.auth_login is None
        assert "re-authentication did not complete within connect_timeout_s" in caplog.text
    run_scram(tmp_path, body)


# ------------------------------------------------------------------------------- outbound QoS 2
async def _qos2_delivered(gw, sub: Client, topic: str, payload: bytes, pub: Client) -> P.Publish:
    """`pub` publishes `payload` at QoS 2 (its own exchange completed); `sub` receives it."""
    seen = len([p for p in sub.packets() if isinstance(p, P.Publish)])
    pid = 100 + seen
    pub.send(P.Publish(topic, payload, qos=2, packet_id=pid))
    rec = (await pub.wait_for(P.PubRec, seen + 1))[-1]
    assert rec.packet_id == pid and rec.reason_code == 0
    pub.send(P.PubRel(pid))
    return (await sub.wait_for(P.Publish, seen + 1))[-1]


@pytest.mark.parametrize("version", [4, 5])
def test_qos2_outbound_flow_pubrec_pubrel_pubcomp(tmp_path, version):
    async def body(gw):
        sub, pub = Client(gw, version), Client(gw)
        await sub.connect("o2-sub")
        await pub.connect("o2-pub")
        sub.send(P.Subscribe(1, [P.SubscriptionRequest("o2/t", qos=2)]))
        await sub.wait_for(P.SubAck)
        m = await _qos2_delivered(gw, sub, "o2/t", b"x", pub)
        assert (m.qos, m.payload) == (2, b"x")
        s = gw.broker.sessions["o2-sub"]
        sub.send(P.PubRec(m.packet_id))
        rel, = await sub.wait_for(P.PubRel)
        assert (rel.packet_id, rel.reason_code) == (m.packet_id, 0)
        assert m.packet_id in [inf.pid for inf in s.inflight()]      # released only by PUBCOMP
        sub.send(P.PubComp(m.packet_id))
        await asyncio.sleep(0)
        assert not s.inflight()
        assert all(not c.busy() for c in s.cursors.values())
        sub.send(P.PubRec(m.packet_id))                  # an id no longer in flight
        rels = await sub.wait_for(P.PubRel, 2)
        assert rels[1].reason_code == (ReasonCode.PACKET_IDENTIFIER_NOT_FOUND if version == 5 else 0)
    run(tmp_path, body)


def test_a_pubrec_with_an_error_code_drops_the_message_and_frees_the_window(tmp_path):
    """MQTT 5: PUBREC >= 0x80 ends the exchange (no PUBREL); with a Receive Maximum of 1 the next
    message waits for exactly that."""
    async def body(gw):
        sub, pub = Client(gw), Client(gw)
        await sub.connect("o2e-sub", receive_maximum=1)
        await pub.connect("o2e-pub")
        sub.send(P.Subscribe(1, [P.SubscriptionRequest("o2e/t", qos=2)]))
        await sub.wait_for(P.SubAck)
        first = await _qos2_delivered(gw, sub, "o2e/t", b"first", pub)
        pub.send(P.Publish("o2e/t", b"second", qos=1, packet_id=1))
        await pub.wait_for(P.PubAck)
        await asyncio.sleep(0.02)
        assert [p.payload for p in sub.packets() if isinstance(p, P.Publish)] == [b"first"]   # window full
        sub.send(P.PubRec(first.packet_id, ReasonCode.UNSPECIFIED_ERROR))
        got = await sub.wait_for(P.Publish, 2)
        assert got[1].payload == b"second"
        assert not [p for p in sub.packets() if isinstance(p, P.PubRel)]
        assert first.packet_id not in [inf.pid for inf in gw.broker.sessions["o2e-sub"].inflight()]
    run(tmp_path, body)


# ------------------------------------------------------------------------------- DISCONNECT
def test_disconnect_setting_session_expiry_to_zero_ends_the_session(tmp_path):
    async def body(gw):
        c = Client(gw)
        await c.connect("dx-end", clean=False, session_expiry_interval=60)
        c.send(P.Subscribe(1, [P.SubscriptionRequest("dx/+", qos=1)]))
        await c.wait_for(P.SubAck)
        assert gw.broker.storage.sessions.get("dx-end").wait() is not None
        c.send(P.Disconnect(0, P.Properties(session_expiry_interval=0)))
        assert c.transport.closed
        await asyncio.sleep(0)                           # connection_lost
        assert "dx-end" not in gw.broker.sessions
        assert gw.broker.storage.sessions.get("dx-end").wait() is None
        assert gw.lq.registry.refcount("dx/+") == 0
    run(tmp_path, body)


def test_disconnect_raising_session_expiry_keeps_the_session_that_long(tmp_path):
    async def body(gw):
        c = Client(gw)
        await c.connect("dx-longer", clean=False, session_expiry_interval=10)
        c.send(P.Disconnect(0, P.Properties(session_expiry_interval=120)))
        await asyncio.sleep(0)                           # connection_lost
        await asyncio.sleep(0)                           # its record: written at the end of that tick
        s = gw.broker.sessions["dx-longer"]
        assert not s.online and s.expiry_interval == 120
        assert gw.broker.storage.sessions.get("dx-longer").wait().expiry_interval == 120
    run(tmp_path, body)


def test_disconnect_setting_session_expiry_after_a_connect_with_zero_is_a_protocol_error(tmp_path):
    async def body(gw):
        c = Client(gw)
        await c.connect("dx-zero")                       # session expiry 0
        c.send(P.Disconnect(0, P.Properties(session_expiry_interval=30)))
        d, = await c.wait_for(P.Disconnect)
        assert d.reason_code == ReasonCode.PROTOCOL_ERROR and c.transport.closed
        await asyncio.sleep(0)
        assert "dx-zero" not in gw.broker.sessions
    run(tmp_path, body)


@pytest.mark.parametrize("reason, will_sent", [(0x04, True), (0x00, False)])
def test_disconnect_with_will_message_sends_the_will_and_a_normal_one_does_not(tmp_path, reason, will_sent):
    async def body(gw):
        watcher, leaving = Client(gw, version=4), Client(gw)
        await watcher.connect("dw-watcher")
        watcher.send(P.Subscribe(1, [P.SubscriptionRequest("dwills/#", qos=1)]))
        await watcher.wait_for(P.SubAck)
        leaving.send(P.Connect(client_id="dw-leaving", protocol_level=5,
                               will=P.Will("dwills/leaving", b"bye", qos=1, retain=False)))
        await leaving.wait_for(P.ConnAck)
        leaving.send(P.Disconnect(reason))
        assert leaving.transport.closed
        if will_sent:
            m, = await watcher.wait_for(P.Publish)
            assert (m.topic, m.payload) == ("dwills/leaving", b"bye")
        else:
            await asyncio.sleep(0.05)
            assert not [p for p in watcher.packets() if isinstance(p, P.Publish)]
        assert list(gw.broker.storage.wills.held().wait()) == []
    run(tmp_path, body)


# ------------------------------------------------------------------------------- inbound limits
def test_inbound_topic_alias_is_set_then_used(tmp_path):
    async def body(gw):
        sub, pub = Client(gw, version=4), Client(gw)
        await sub.connect("ta-sub")
        ack = await pub.connect("ta-pub")
        assert ack.properties.topic_alias_maximum == 5
        sub.send(P.Subscribe(1, [P.SubscriptionRequest("ta/#", qos=1)]))
        await sub.wait_for(P.SubAck)
        pub.send(P.Publish("ta/one", b"1", qos=1, packet_id=1, properties=P.Properties(topic_alias=3)))
        pub.send(P.Publish("", b"2", qos=1, packet_id=2, properties=P.Properties(topic_alias=3)))
        pub.send(P.Publish("ta/two", b"3", qos=1, packet_id=3, properties=P.Properties(topic_alias=3)))
        pub.send(P.Publish("", b"4", qos=1, packet_id=4, properties=P.Properties(topic_alias=3)))
        assert [a.reason_code for a in await pub.wait_for(P.PubAck, 4)] == [0, 0, 0, 0]
        got = await sub.wait_for(P.Publish, 4)
        assert [(m.topic, m.payload) for m in got] == [("ta/one", b"1"), ("ta/one", b"2"),
                                                       ("ta/two", b"3"), ("ta/two", b"4")]
    run(tmp_path, body, topic_alias_maximum=5)


@pytest.mark.parametrize("topic, alias, code", [
    ("ta/x", 6, ReasonCode.TOPIC_ALIAS_INVALID),          # above the Topic Alias Maximum in CONNACK
    ("", 2, ReasonCode.PROTOCOL_ERROR),                   # never set on this connection
])
def test_an_invalid_inbound_topic_alias_disconnects(tmp_path, topic, alias, code):
    async def body(gw):
        pub = Client(gw)
        await pub.connect("ta-bad")
        pub.send(P.Publish(topic, b"x", qos=1, packet_id=1, properties=P.Properties(topic_alias=alias)))
        d, = await pub.wait_for(P.Disconnect)
        assert d.reason_code == code and pub.transport.closed
        assert not [p for p in pub.packets() if isinstance(p, P.PubAck)]
    run(tmp_path, body, topic_alias_maximum=5)


def test_more_unacknowledged_qos2_publishes_than_receive_maximum_disconnects_with_0x93(tmp_path):
    async def body(gw):
        c = Client(gw)
        ack = await c.connect("rm-pub")
        assert ack.properties.receive_maximum == 2
        for pid in (1, 2):                               # PUBREC'd, never PUBREL'd: still counted
            c.send(P.Publish("rm/t", b"x", qos=2, packet_id=pid))
        await c.wait_for(P.PubRec, 2)
        c.send(P.Publish("rm/t", b"x", qos=2, packet_id=3))
        d, = await c.wait_for(P.Disconnect)
        assert d.reason_code == ReasonCode.RECEIVE_MAXIMUM_EXCEEDED and c.transport.closed
        assert len([p for p in c.packets() if isinstance(p, P.PubRec)]) == 2
    run(tmp_path, body, receive_maximum=2)


# ------------------------------------------------------------------------------- ACL
ACL_RULES = """default deny
allow anonymous publish ok/#
allow anonymous subscribe ok/#
allow anonymous subscribe denied/#
"""


@pytest.mark.parametrize("version", [4, 5])
def test_an_acl_denied_publish_is_refused_and_not_stored(tmp_path, version):
    """MQTT 5: PUBACK / PUBREC 0x87; 3.1.1 has no negative ack: acknowledged (QoS 2: to PUBCOMP)
    and dropped. A subscriber allowed to read the topic gets nothing; an allowed publish goes
    through on the same connection."""
    acl = tmp_path / "acl"
    acl.write_text(ACL_RULES)

    async def body(gw):
        sub, pub = Client(gw), Client(gw, version)
        await sub.connect("acl-sub")
        await pub.connect("acl-pub")
        sub.send(P.Subscribe(1, [P.SubscriptionRequest("denied/#", qos=1), P.SubscriptionRequest("ok/#", qos=1)]))
        assert (await sub.wait_for(P.SubAck))[0].reason_codes == [1, 1]
        refused = ReasonCode.NOT_AUTHORIZED if version == 5 else 0
        pub.send(P.Publish("denied/x", b"no", qos=1, packet_id=1))
        ack, = await pub.wait_for(P.PubAck)
        assert (ack.packet_id, ack.reason_code) == (1, refused)
        pub.send(P.Publish("denied/x", b"no", qos=2, packet_id=2))
        rec, = await pub.wait_for(P.PubRec)
        assert (rec.packet_id, rec.reason_code) == (2, refused)
        if version == 4:
            pub.send(P.PubRel(2))
            comp, = await pub.wait_for(P.PubComp)
            assert (comp.packet_id, comp.reason_code) == (2, 0)
        pub.send(P.Publish("ok/x", b"yes", qos=1, packet_id=3))
        assert (await pub.wait_for(P.PubAck, 2))[1].reason_code == 0
        m, = await sub.wait_for(P.Publish)
        await asyncio.sleep(0.02)
        assert [p.payload for p in sub.packets() if isinstance(p, P.Publish)] == [b"yes"] and m.topic == "ok/x"
        assert not pub.transport.closed
    run(tmp_path, body, acl_file=str(acl))


def test_reloaded_acl_rules_apply_to_live_connections(tmp_path, caplog):
    """SIGHUP (`reload_security`): a topic a connection was allowed to publish is asked again, and
    a subscription the new rules no longer allow is checked per message; a file that fails to
    parse keeps the rules in force."""
    import logging
    acl = tmp_path / "acl"
    acl.write_text(ACL_RULES)

    async def body(gw):
        sub, pub = Client(gw), Client(gw)
        await sub.connect("rl-sub")
        await pub.connect("rl-pub")
        sub.send(P.Subscribe(1, [P.SubscriptionRequest("ok/#", qos=1)]))
        await sub.wait_for(P.SubAck)
        pub.send(P.Publish("ok/a", b"1", qos=1, packet_id=1))
        assert (await pub.wait_for(P.PubAck))[0].reason_code == 0
        await sub.wait_for(P.Publish)
        assert sub.conn.read_checks is None and "ok/a" in pub.conn.acl_publish_ok
        acl.write_text("default deny\nallow anonymous publish ok/a\nallow anonymous subscribe ok/b/#\n")
        with caplog.at_level(logging.INFO, logger="lmqtt.gateway"):
            gw.reload_security()
        assert "event=reloaded what=acl" in caplog.text
        assert sub.conn.read_checks == {"ok/#"} and not pub.conn.acl_publish_ok
        pub.send(P.Publish("ok/a", b"2", qos=1, packet_id=2))      # still allowed, not readable
        pub.send(P.Publish("ok/c", b"3", qos=1, packet_id=3))      # no longer allowed
        acks = await pub.wait_for(P.PubAck, 3)          # (a refusal goes out before a store ack)
        assert sorted((a.packet_id, a.reason_code) for a in acks[1:]) == [(2, 0), (3, ReasonCode.NOT_AUTHORIZED)]
        await asyncio.sleep(0.02)
        assert [p.payload for p in sub.packets() if isinstance(p, P.Publish)] == [b"1"]
        acl.write_text("this is not an acl\n")
        with caplog.at_level(logging.INFO, logger="lmqtt.gateway"):
            gw.reload_security()
        assert "event=reload_failed what=acl" in caplog.text
        assert sub.conn.read_checks == {"ok/#"}                     # the rules in force stay
    run(tmp_path, body, acl_file=str(acl))
