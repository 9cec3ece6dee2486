"""End-to-end: persistent sessions (incl. restart of `lmqtt serve` by SIGTERM and kill -9), session
expiry, takeover, keepalive timeout, will messages."""
from __future__ import annotations

import socket
import time

import pytest

from tests.support import SERVER_KINDS, Paho, RawMQTT, per_test, serve_or_fleet, shared_serve_or_fleet
from lmqtt.gateway.mqtt import packets as P


@pytest.fixture(scope="module", params=SERVER_KINDS)
def shared_server(request, tmp_path_factory):
    """One server per kind for the module: the embedded `lmqtt serve` and `lmqtt store` +
    `lmqtt gateway` (the remote store seam). Tests use their own client ids and topics."""
    yield from shared_serve_or_fleet(request.param, tmp_path_factory)


@pytest.fixture
def lmqtt_server(shared_server):
    """Every test here runs against both kinds; the server is up when the test starts (restarted if
    an earlier test left it down) and the test's clients are disconnected when it ends."""
    yield from per_test(shared_server)


pytestmark = pytest.mark.timeout(90)


def _persistent(server, cid, version):
    if version == 5:
        return Paho(server, cid, version=5, clean=False, expiry=3600)
    return Paho(server, cid, version=4, clean=False)


@pytest.mark.parametrize("version", [4, 5])
def test_persistent_session_gets_messages_published_while_offline(lmqtt_server, version):
    s = _persistent(lmqtt_server, f"offline-{version}", version)
    s.subscribe("off/#", 1)
    s.disconnect()
    pub = Paho(lmqtt_server, f"offline-pub-{version}")
    for i in range(30):
        pub.publish(f"off/{i % 2}", f"{i}".encode(), qos=1)
    s = _persistent(lmqtt_server, f"offline-{version}", version)
    assert s.session_present
    got = s.get_n(30)
    assert [m.payload for m in got] == [f"{i}".encode() for i in range(30)]
    assert s.before_sentinel(pub, "off/0") == []          # nothing more, nothing twice


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "kill9"])
@pytest.mark.parametrize("version", [4, 5])
def test_persistent_qos1_survives_server_restart(lmqtt_server, kill, version):
    """Subscribe, go offline, QoS 1 messages acknowledged by the server, restart the server
    (clean stop or kill -9), reconnect: every acknowledged message arrives, in publish order."""
    cid = f"restart-{version}-{int(kill)}"
    s = _persistent(lmqtt_server, cid, version)
    s.subscribe("rs/+/data", 1)
    s.disconnect()
    pubs = [Paho(lmqtt_server, f"rs-pub{k}") for k in range(2)]
    n = 50
    for i in range(n):
        for k, p in enumerate(pubs):
            p.publish(f"rs/{k}/data", f"{k}:{i}".encode(), qos=1)   # returns after PUBACK
    for p in pubs:
        p.disconnect()
    lmqtt_server.restart(kill=kill)
    s = _persistent(lmqtt_server, cid, version)
    assert s.session_present
    got = s.get_n(2 * n, timeout=20)
    got += s.before_sentinel(Paho(lmqtt_server, f"{cid}-sentinel"), "rs/0/data")   # and nothing twice
    by_pub: dict[str, list[int]] = {"0": [], "1": []}
    for m in got:
        k, i = m.payload.decode().split(":")
        by_pub[k].append(int(i))
    assert by_pub["0"] == list(range(n))     # none lost, order kept per publisher
    assert by_pub["1"] == list(range(n))


def test_unacked_inflight_redelivered_after_kill9_of_server(lmqtt_server):
    """Messages sent but never PUBACKed by the subscriber (raw client that does not ack) come
    back after a kill -9 of the server: the offset only moves on PUBACK."""
    raw = RawMQTT(lmqtt_server, version=4)
    assert raw.connect("noack", clean=False).reason_code == 0
    raw.send(P.Subscribe(1, [P.SubscriptionRequest("na/t", 1)]))
    assert isinstance(raw.recv(), P.SubAck)
    pub = Paho(lmqtt_server, "noack-pub")
    for i in range(5):
        pub.publish("na/t", f"{i}".encode(), qos=1)
    first = [raw.recv() for _ in range(5)]
    assert [p.payload for p in first] == [f"{i}".encode() for i in range(5)]
    raw.send(P.PubAck(first[0].packet_id))      # ack only the first
    time.sleep(0.5)                             # offsets are flushed every 100 ms
    raw.close()
    pub.disconnect()
    lmqtt_server.restart(kill=True)
    s = Paho(lmqtt_server, "noack", clean=False)
    got = [m.payload for m in s.get_n(4) + s.before_sentinel(Paho(lmqtt_server, "noack-sentinel"), "na/t")]
    assert got == [b"1", b"2", b"3", b"4"]


def test_inflight_resent_with_dup_on_reconnect(lmqtt_server):
    raw = RawMQTT(lmqtt_server, version=4)
    raw.connect("dupper", clean=False)
    raw.send(P.Subscribe(1, [P.SubscriptionRequest("dup/t", 1)]))
    raw.recv()
    pub = Paho(lmqtt_server, "dup-pub")
    pub.publish("dup/t", b"x", qos=1)
    first = raw.recv()
    assert first.dup is False
    raw.close()                                  # no PUBACK
    raw = RawMQTT(lmqtt_server, version=4)
    ack = raw.connect("dupper", clean=False)
    assert ack.session_present
    again = raw.recv()
    assert isinstance(again, P.Publish)
    assert (again.payload, again.dup, again.packet_id) == (b"x", True, first.packet_id)
    raw.send(P.PubAck(again.packet_id))
    raw.close()


def test_clean_session_discards_state(lmqtt_server):
    s = Paho(lmqtt_server, "cleaner", clean=False)
    s.subscribe("cl/t", 1)
    s.disconnect()
    s = Paho(lmqtt_server, "cleaner", clean=True)
    assert not s.session_present
    pub = Paho(lmqtt_server, "cleaner-pub")
    pub.publish("cl/t", b"x", qos=1)
    assert s.drain(0.5) == []


def test_mqtt5_session_expiry(lmqtt_server):
    s = Paho(lmqtt_server, "expiring", version=5, clean=False, expiry=1)
    s.subscribe("exp/t", 1)
    s.disconnect()
    time.sleep(2.0)
    s = Paho(lmqtt_server, "expiring", version=5, clean=False, expiry=60)
    assert not s.session_present


def test_mqtt5_zero_expiry_session_ends_at_disconnect(lmqtt_server):
    s = Paho(lmqtt_server, "zero-exp", version=5, clean=False, expiry=0)
    s.subscribe("ze/t", 1)
    s.disconnect()
    s = Paho(lmqtt_server, "zero-exp", version=5, clean=False, expiry=0)
    assert not s.session_present


def test_takeover_closes_first_connection_mqtt5_reason(lmqtt_server):
    first = RawMQTT(lmqtt_server, version=5)
    assert first.connect("twin").reason_code == 0
    second = Paho(lmqtt_server, "twin", version=5)
    d = first.recv()
    assert isinstance(d, P.Disconnect) and d.reason_code == 0x8E
    assert first.recv() is None                 # then the socket is closed
    second.subscribe("tw/t", 0)
    second.publish("tw/t", b"alive", qos=1)
    assert second.get().payload == b"alive"


def test_takeover_mqtt311_keeps_persistent_subscriptions(lmqtt_server):
    a = Paho(lmqtt_server, "twin4", clean=False)
    a.subscribe("tw4/t", 1)
    b = Paho(lmqtt_server, "twin4", clean=False)
    assert b.session_present
    a.c.loop_stop()
    pub = Paho(lmqtt_server, "twin4-pub")
    pub.publish("tw4/t", b"to-b", qos=1)
    assert b.get().payload == b"to-b"


def test_empty_client_id_rules_mqtt311(lmqtt_server):
    raw = RawMQTT(lmqtt_server, version=4)
    ack = raw.connect("", clean=False)
    assert ack.reason_code == 0x02              # identifier rejected
    assert raw.recv() is None
    raw = RawMQTT(lmqtt_server, version=4)
    assert raw.connect("", clean=True).reason_code == 0


def test_keepalive_timeout_closes_and_sends_will(lmqtt_server):
    watcher = Paho(lmqtt_server, "ka-watch")
    watcher.subscribe("will/ka", 1)
    raw = RawMQTT(lmqtt_server, version=5)
    ack = raw.connect("ka-client", keepalive=1, will=P.Will("will/ka", b"gone", 1, False))
    assert ack.reason_code == 0
    d = raw.recv(timeout=6)                      # silent client: closed after 1.5 x keepalive
    assert isinstance(d, P.Disconnect) and d.reason_code == 0x8D
    assert watcher.get().payload == b"gone"


def test_keepalive_respected_while_client_pings(lmqtt_server):
    raw = RawMQTT(lmqtt_server, version=4)
    raw.connect("pinger", keepalive=1)
    for _ in range(4):
        time.sleep(0.6)
        raw.send(P.PingReq())
        assert isinstance(raw.recv(), P.PingResp)


@pytest.mark.parametrize("version", [4, 5])
def test_will_on_abnormal_close_not_on_disconnect(lmqtt_server, version):
    watcher = Paho(lmqtt_server, f"will-watch-{version}")
    watcher.subscribe("will/#", 1)
    # abnormal: the client's socket is killed without DISCONNECT
    raw = RawMQTT(lmqtt_server, version=version)
    raw.connect(f"dies-{version}", will=P.Will(f"will/dies{version}", b"died", 1, False))
    raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    raw.close()                                  # RST
    m = watcher.get()
    assert (m.topic, m.payload) == (f"will/dies{version}", b"died")
    # clean: DISCONNECT (0x00) discards the will
    raw = RawMQTT(lmqtt_server, version=version)
    raw.connect(f"polite-{version}", will=P.Will(f"will/polite{version}", b"never", 1, False))
    raw.send(P.Disconnect(0))
    assert raw.recv() is None
    assert watcher.drain(0.7) == []


def test_mqtt5_disconnect_with_will_message_sends_will(lmqtt_server):
    watcher = Paho(lmqtt_server, "w04-watch")
    watcher.subscribe("will/w04", 1)
    raw = RawMQTT(lmqtt_server, version=5)
    raw.connect("w04", will=P.Will("will/w04", b"asked", 1, False))
    raw.send(P.Disconnect(0x04))
    assert watcher.get().payload == b"asked"


def test_mqtt5_will_delay_cancelled_by_reconnect(lmqtt_server):
    watcher = Paho(lmqtt_server, "wd-watch")
    watcher.subscribe("will/delay", 1)
    props = P.Properties(session_expiry_interval=60)
    wprops = P.Properties(will_delay_interval=1)
    raw = RawMQTT(lmqtt_server, version=5)
    raw.connect("wd", clean=False, will=P.Will("will/delay", b"late", 1, False, wprops), props=props)
    raw.close()
    raw = RawMQTT(lmqtt_server, version=5)       # back within the delay: no will
    assert raw.connect("wd", clean=False, props=props).session_present
    assert watcher.drain(1.6) == []
    raw.close()                                  # gone for good (no will this time: not set)
    # and a delayed will that is not cancelled arrives after the delay
    raw = RawMQTT(lmqtt_server, version=5)
    raw.connect("wd2", clean=False, will=P.Will("will/delay", b"late2", 1, False, wprops), props=props)
    raw.close()
    assert watcher.drain(0.5) == []
    assert watcher.get(timeout=3).payload == b"late2"


def test_will_published_by_takeover(lmqtt_server):
    watcher = Paho(lmqtt_server, "tw-watch")
    watcher.subscribe("will/takeover", 1)
    raw = RawMQTT(lmqtt_server, version=4)
    raw.connect("tk", will=P.Will("will/takeover", b"replaced", 1, False))
    Paho(lmqtt_server, "tk")
    assert watcher.get().payload == b"replaced"


def test_session_expiry_counts_while_server_is_down(lmqtt_server):
    s = Paho(lmqtt_server, "exp-restart", version=5, clean=False, expiry=2)
    s.subscribe("expr/t", 1)
    keep = Paho(lmqtt_server, "exp-keep", version=5, clean=False, expiry=3600)
    keep.subscribe("expr/t", 1)
    s.disconnect()
    keep.disconnect()
    lmqtt_server.stop()
    time.sleep(2.5)
    lmqtt_server.start()
    s = Paho(lmqtt_server, "exp-restart", version=5, clean=False, expiry=60)
    assert not s.session_present            # expired while the server was down
    keep = Paho(lmqtt_server, "exp-keep", version=5, clean=False, expiry=3600)
    assert keep.session_present
