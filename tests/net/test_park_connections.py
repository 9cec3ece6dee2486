"""Parking idle connections (gateway/net/parking.py) on a real `lmqtt serve`
(`park_idle_after_s = 0.3`), real sockets: a parked client is still connected for everyone and
behaves as if never parked: its PINGREQ is answered (by the parker, not the loop), a message
published to its topic reaches it (QoS 0 and 1: the delivery wakes it), a takeover of it works,
one silent past 1.5 x keep alive is closed and its will fires, and no descriptor leaks."""
from __future__ import annotations

import os
import time

import pytest

from lmqtt.gateway.mqtt import packets as P
from tests.support import LmqttServer, RawMQTT, metric

PARK_AFTER = 0.3


def parking_server(tmp_path_factory, name: str, park_after: float) -> LmqttServer:
    """A started `lmqtt serve` with `park_idle_after_s = park_after`, its /metrics answering (the
    parked-connection gauge is what these tests read). Used by the other tests/net/test_park_*."""
    d = tmp_path_factory.mktemp(name)
    cfg = d / "park.toml"
    cfg.write_text(f"park_idle_after_s = {park_after}\n")
    (d / "data").mkdir()
    s = LmqttServer(str(d / "data"), extra_args=("--config", str(cfg))).start()
    deadline = time.monotonic() + 20
    while True:                                      # /metrics comes up just after the listeners
        try:
            parked(s)
            return s
        except OSError:
            if time.monotonic() > deadline:
                s.stop()
                raise
            time.sleep(0.1)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = parking_server(tmp_path_factory, "park", PARK_AFTER)
    yield s
    s.stop()


def parked(srv) -> float:
    return metric(srv.metrics_url, "lmqtt_connections_parked")


def wait_parked(srv, n: float, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = parked(srv)
        if v == n:
            return v
        time.sleep(0.05)
    return parked(srv)


def subscriber(srv, cid: str, topic: str, qos: int = 1, keepalive: int = 60, will=None, version: int = 4):
    c = RawMQTT(srv, version=version)
    ack = c.connect(cid, keepalive=keepalive, will=will)
    assert isinstance(ack, P.ConnAck) and ack.reason_code == 0
    c.send(P.Subscribe(1, [P.SubscriptionRequest(topic, qos)]))
    assert isinstance(c.recv(), P.SubAck)
    return c


def fds(srv) -> int:
    return len(os.listdir(f"/proc/{srv.proc.pid}/fd"))


def test_a_parked_client_gets_its_pingresp_and_its_messages(srv):
    base = parked(srv)
    c = subscriber(srv, "park-a", "park/a", qos=1)
    assert wait_parked(srv, base + 1) == base + 1
    assert metric(srv.metrics_url, "lmqtt_connections") >= 1
    for _ in range(3):                               # answered while parked: it stays parked
        c.send(P.PingReq())
        assert isinstance(c.recv(), P.PingResp)
    assert parked(srv) == base + 1
    c.send_raw(b"\xc0")                              # a PINGREQ in two writes
    time.sleep(0.05)
    c.send_raw(b"\x00")
    assert isinstance(c.recv(), P.PingResp)

    pub = RawMQTT(srv)
    pub.connect("park-pub")
    pub.send(P.Publish("park/a", b"q0", qos=0))
    m = c.recv()
    assert isinstance(m, P.Publish) and m.payload == b"q0" and m.qos == 0
    assert wait_parked(srv, base + 2) == base + 2      # both idle again: parked
    pub.send(P.Publish("park/a", b"q1", qos=1, packet_id=7))
    assert isinstance(pub.recv(), P.PubAck)
    m = c.recv()
    assert isinstance(m, P.Publish) and m.payload == b"q1" and m.qos == 1
    c.send(P.PubAck(m.packet_id))
    c.send(P.PingReq())                              # on the loop again, then parked again
    assert isinstance(c.recv(), P.PingResp)
    assert wait_parked(srv, base + 2) == base + 2
    c.send(P.Disconnect())
    pub.send(P.Disconnect())
    assert c.closed_by_server() and pub.closed_by_server()
    c.close()
    pub.close()
    assert wait_parked(srv, base) == base


def test_a_parked_client_publishing_is_handed_back_with_its_bytes_intact(srv):
    base = parked(srv)
    sub = subscriber(srv, "park-b-sub", "park/b", qos=1)
    c = subscriber(srv, "park-b", "park/b-own", qos=0)
    assert wait_parked(srv, base + 2) == base + 2
    # a PINGREQ, then a QoS 1 PUBLISH split in the middle: the parker answers the first and
    # hands the rest back to the loop, which must see the whole PUBLISH
    from lmqtt.gateway.mqtt import encode
    data = b"\xc0\x00" + encode(P.Publish("park/b", b"hello", qos=1, packet_id=3), 4)
    c.send_raw(data[:5])
    time.sleep(0.05)
    c.send_raw(data[5:])
    assert isinstance(c.recv(), P.PingResp)
    ack = c.recv()
    assert isinstance(ack, P.PubAck) and ack.packet_id == 3
    m = sub.recv()
    assert isinstance(m, P.Publish) and m.payload == b"hello"
    sub.send(P.PubAck(m.packet_id))
    for x in (c, sub):
        x.send(P.Disconnect())
        assert x.closed_by_server()
        x.close()
    assert wait_parked(srv, base) == base


def test_a_takeover_of_a_parked_client_works(srv):
    base = parked(srv)
    old = subscriber(srv, "park-take", "park/take", qos=1, version=5)
    assert wait_parked(srv, base + 1) == base + 1
    new = RawMQTT(srv, version=5)
    ack = new.connect("park-take", clean=False)
    assert isinstance(ack, P.ConnAck) and ack.reason_code == 0
    d = old.recv()
    assert isinstance(d, P.Disconnect) and d.reason_code == 0x8E      # session taken over
    assert old.closed_by_server()
    assert parked(srv) == base
    new.send(P.Subscribe(1, [P.SubscriptionRequest("park/take", 1)]))
    assert isinstance(new.recv(), P.SubAck)
    pub = RawMQTT(srv)
    pub.connect("park-take-pub")
    pub.send(P.Publish("park/take", b"after", qos=1, packet_id=1))
    assert isinstance(pub.recv(), P.PubAck)
    m = new.recv()
    assert isinstance(m, P.Publish) and m.payload == b"after"
    for x in (new, pub):
        x.send(P.Disconnect())
        x.close()
    old.close()


def test_a_silent_parked_client_is_closed_at_its_keep_alive_and_its_will_fires(srv):
    base = parked(srv)
    watcher = subscriber(srv, "park-will-watch", "park/will", qos=1)
    c = subscriber(srv, "park-silent", "park/silent", qos=0, keepalive=1,
                   will=P.Will("park/will", b"gone", qos=1))
    assert wait_parked(srv, base + 2) == base + 2
    assert c.closed_by_server(timeout=8)              # 1.5 x 1 s, the wheel's second late at most
    m = watcher.recv(timeout=8)
    assert isinstance(m, P.Publish) and m.topic == "park/will" and m.payload == b"gone"
    watcher.send(P.PubAck(m.packet_id))
    watcher.send(P.Disconnect())
    watcher.close()
    c.close()
    assert wait_parked(srv, base) == base


def test_pings_keep_a_parked_client_alive(srv):
    base = parked(srv)
    c = subscriber(srv, "park-pinger", "park/pinger", qos=0, keepalive=1)
    assert wait_parked(srv, base + 1) == base + 1
    for _ in range(6):                               # 3 s: twice 1.5 x its keep alive
        time.sleep(0.5)
        c.send(P.PingReq())
        assert isinstance(c.recv(), P.PingResp)
    assert parked(srv) == base + 1
    c.send(P.Disconnect())
    assert c.closed_by_server()
    c.close()


def mqtt_sockets(srv) -> int:
    """The broker's descriptors of established sockets on its MQTT port (a dup'd socket would count twice)."""
    import psutil
    p = psutil.Process(srv.proc.pid)
    return sum(1 for c in p.net_connections("tcp") if c.laddr and c.laddr.port == srv.port and c.status == "ESTABLISHED")


def wait_for(fn, want, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while (v := fn()) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return v


def test_parking_leaks_no_descriptor(srv):
    base = parked(srv)
    socks0 = wait_for(lambda: mqtt_sockets(srv), 0)
    before = fds(srv)
    clients = [subscriber(srv, f"park-fd{i}", f"park/fd{i}", qos=0) for i in range(20)]
    assert wait_parked(srv, base + 20) == base + 20
    assert mqtt_sockets(srv) == socks0 + 20          # one descriptor per parked socket: the dup, no more
    for i, c in enumerate(clients):
        if i % 2:
            c.send(P.Disconnect())                   # woken, then a normal close
        c.close()                                    # the others: EOF seen by the parker
    assert wait_parked(srv, base) == base
    assert wait_for(lambda: mqtt_sockets(srv), socks0) == socks0
    # every descriptor back (other descriptors of the broker, e.g. a /metrics scrape, may come and go)
    assert wait_for(lambda: fds(srv), before) == before


def test_shutdown_disconnects_parked_clients(tmp_path):
    cfg = tmp_path / "park.toml"
    cfg.write_text(f"park_idle_after_s = {PARK_AFTER}\n")
    (tmp_path / "data").mkdir()
    s = LmqttServer(str(tmp_path / "data"), extra_args=("--config", str(cfg))).start()
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                parked(s)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        c5 = subscriber(s, "park-down5", "park/down5", version=5)
        c4 = subscriber(s, "park-down4", "park/down4")
        assert wait_parked(s, 2) == 2
        assert s.stop() == 0                         # SIGTERM: a clean exit, not stuck on parked sockets
        d = c5.recv()
        assert isinstance(d, P.Disconnect) and d.reason_code == 0x8B     # server shutting down
        assert c5.closed_by_server() and c4.closed_by_server()
        c5.close()
        c4.close()
    finally:
        if s.proc is not None:
            s.stop()


def test_a_parked_client_whose_socket_ends_has_its_will_published(srv):
    base = parked(srv)
    watcher = subscriber(srv, "park-eof-watch", "park/eof-will", qos=1)
    c = subscriber(srv, "park-eof", "park/eof", qos=0, will=P.Will("park/eof-will", b"dropped", qos=1))
    assert wait_parked(srv, base + 2) == base + 2
    c.close()                                        # no DISCONNECT: the parker sees EOF
    m = watcher.recv(timeout=8)
    assert isinstance(m, P.Publish) and m.topic == "park/eof-will" and m.payload == b"dropped"
    watcher.send(P.PubAck(m.packet_id))
    watcher.send(P.Disconnect())
    watcher.close()
    assert wait_parked(srv, base) == base
