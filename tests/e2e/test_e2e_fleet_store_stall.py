"""A fleet gateway keeps serving while one client waits for the store (real processes).

A CONNECT that resumes a session, a SUBSCRIBE to a new wildcard filter, the CONNACK of a
persistent session and the end of a clean session's wildcard filter all involve the store. The store is frozen with SIGSTOP while each one
is in flight: the gateway must go on answering the other clients, must not answer the waiting
client before the store did, and must finish its packet once the store runs again (SIGCONT).
"""
from __future__ import annotations

import os
import signal
import socket
import time
from contextlib import contextmanager

import pytest

from lmqtt.gateway.mqtt import packets as P
from tests.support import LmqttGateway, LmqttStore, RawMQTT


@contextmanager
def frozen(store: LmqttStore):
    """The store process stopped (SIGSTOP) for the block's duration: its sockets stay open and
    nothing it is asked is answered until SIGCONT."""
    os.kill(store.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(store.proc.pid, signal.SIGCONT)


def nothing_within(c: RawMQTT, seconds: float) -> bool:
    try:
        pkt = c.recv(timeout=seconds)
    except (socket.timeout, TimeoutError):
        return True
    raise AssertionError(f"expected no packet yet, got {pkt!r}")


def answered_ping(probe: RawMQTT) -> bool:
    probe.send(P.PingReq())
    return isinstance(probe.recv(timeout=2.0), P.PingResp)


def subscribe_while_frozen(store: LmqttStore, client: RawMQTT, probe: RawMQTT, flt: str, pid: int = 1):
    """SUBSCRIBE `flt` (QoS 1) with the store frozen: no SUBACK while it is, the probe is served
    meanwhile; returns the SUBACK that comes once the store runs again."""
    with frozen(store):
        client.send(P.Subscribe(pid, [P.SubscriptionRequest(flt, qos=1)]))
        assert nothing_within(client, 0.5)
        assert answered_ping(probe)
    return client.recv(timeout=10.0)


def delivered(probe: RawMQTT, client: RawMQTT, topic: str, payload: bytes, pid: int) -> bool:
    """The probe publishes (QoS 1) and `client` receives it."""
    probe.send(P.Publish(topic, payload, qos=1, packet_id=pid))
    assert isinstance(probe.recv(timeout=10.0), P.PubAck)
    got = client.recv(timeout=10.0)
    return isinstance(got, P.Publish) and (got.topic, got.payload) == (topic, payload)


@pytest.fixture
def fleet(tmp_path):
    store = LmqttStore(str(tmp_path / "store"), log_path=str(tmp_path / "store.log")).start()
    gw = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    try:
        yield store, gw
    finally:
        gw.stop()
        store.stop()


def test_clients_waiting_for_a_frozen_store_do_not_stop_the_gateway_for_the_others(fleet):
    store, gw = fleet
    probe = RawMQTT(gw)
    assert isinstance(probe.connect("probe"), P.ConnAck)

    # 1. a session left on the store earlier, resumed while the store is frozen
    first = RawMQTT(gw)
    assert first.connect("dev-1", clean=False).session_present is False
    first.send(P.Subscribe(1, [P.SubscriptionRequest("dev/1/cmd", qos=1)]))
    assert isinstance(first.recv(), P.SubAck)
    first.send(P.Disconnect())
    first.close()

    again = RawMQTT(gw)
    with frozen(store):
        again.send(P.Connect("dev-1", 4, False, 60))
        assert nothing_within(again, 0.5)             # the session is on the store: no CONNACK yet
        assert answered_ping(probe)                   # ... and the others are served meanwhile
    ack = again.recv(timeout=10.0)
    assert isinstance(ack, P.ConnAck) and ack.reason_code == 0 and ack.session_present is True

    # 2. a SUBSCRIBE to a wildcard filter new to this gateway (registered on the store)
    sub = subscribe_while_frozen(store, again, probe, "alerts/+", pid=2)
    assert isinstance(sub, P.SubAck) and sub.reason_codes == [1]
    assert delivered(probe, again, "alerts/7", b"after the freeze", pid=5)

    # 3. a new MQTT 5 persistent session: its CONNACK waits for its record on the store
    v5 = RawMQTT(gw, version=5)
    props = P.Properties()
    props.session_expiry_interval = 600
    with frozen(store):
        v5.send(P.Connect("dev-2", 5, True, 60, None, None, None, props))
        assert nothing_within(v5, 0.5)
        assert answered_ping(probe)
    ack = v5.recv(timeout=10.0)
    assert isinstance(ack, P.ConnAck) and ack.reason_code == 0

    # 4. a clean session's wildcard filter let go of when it leaves: the store's hold goes too
    brief = RawMQTT(gw)
    assert isinstance(brief.connect("brief"), P.ConnAck)
    brief.send(P.Subscribe(1, [P.SubscriptionRequest("brief/+", qos=0)]))
    assert isinstance(brief.recv(), P.SubAck)
    with frozen(store):
        brief.send(P.Disconnect())
        brief.close()
        assert answered_ping(probe)
    from lmqtt.store.client import connect
    with connect(store.address) as sdk:
        deadline = time.monotonic() + 10
        while "brief/+" in sdk.cmd("gw_filters", gateway=f"test-{gw.port}")["filters"] and time.monotonic() < deadline:
            time.sleep(0.05)
        held = sdk.cmd("gw_filters", gateway=f"test-{gw.port}")["filters"]
    assert "brief/+" not in held and held.get("alerts/+") == 1
    for c in (probe, again, v5):
        c.close()


def test_a_store_lost_while_clients_wait_for_it_fails_their_packets_with_the_reason(fleet):
    """kill -9 of the (frozen) store while a SUBSCRIBE and a CONNECT resuming a session wait for
    it: the SUBSCRIBE is answered 0x80 for its filter with the reason, the CONNECT refused with
    0x88, the other clients stay served and connected, and once the store is back the same
    client subscribes."""
    store, gw = fleet
    v5 = P.Properties()
    v5.session_expiry_interval = 600
    probe = RawMQTT(gw)
    assert isinstance(probe.connect("probe"), P.ConnAck)
    earlier = RawMQTT(gw, version=5)
    assert isinstance(earlier.connect("dev-9", clean=False, props=v5), P.ConnAck)
    earlier.send(P.Disconnect())
    earlier.close()
    sub = RawMQTT(gw, version=5)
    assert isinstance(sub.connect("sub"), P.ConnAck)
    resumed = RawMQTT(gw, version=5)

    os.kill(store.proc.pid, signal.SIGSTOP)
    sub.send(P.Subscribe(1, [P.SubscriptionRequest("lost/+", qos=1)]))
    resumed.send(P.Connect("dev-9", 5, False, 60, None, None, None, v5))
    assert nothing_within(sub, 0.3) and nothing_within(resumed, 0.3)
    store.kill9()                                     # SIGKILL ends a stopped process too

    suback = sub.recv(timeout=10.0)
    assert isinstance(suback, P.SubAck) and suback.reason_codes == [0x80]
    assert "store" in (suback.properties.reason_string or "")
    connack = resumed.recv(timeout=10.0)
    assert isinstance(connack, P.ConnAck) and connack.reason_code == 0x88
    assert answered_ping(probe)

    store.start()
    deadline = time.monotonic() + 30
    while True:                                       # the gateway redials with backoff
        sub.send(P.Subscribe(2, [P.SubscriptionRequest("lost/+", qos=1)]))
        ack = sub.recv(timeout=10.0)
        if ack.reason_codes == [1] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert ack.reason_codes == [1]
    for c in (probe, sub, resumed):
        c.close()


def test_shared_groups_replays_and_expiry_checks_do_not_stop_the_gateway_either(fleet, tmp_path):
    """The rarer reads: a shared group new to the gateway (its start offset), a subscription from
    the past (its replay plan), a resumed session whose shared group lives on another gateway
    (the group's committed offset) and a session expiry check (is the record still the one this
    gateway saw leave?). Each waits for the frozen store alone; the others are served."""
    store, gw = fleet
    probe = RawMQTT(gw)
    assert isinstance(probe.connect("probe"), P.ConnAck)

    # 1. a shared group new to this gateway: it starts at the queue's end, asked of the store
    worker = RawMQTT(gw)
    assert isinstance(worker.connect("worker"), P.ConnAck)
    sub = subscribe_while_frozen(store, worker, probe, "$share/pool/jobs/+")
    assert isinstance(sub, P.SubAck) and sub.reason_codes == [1]
    assert delivered(probe, worker, "jobs/1", b"job", pid=1)

    # 2. a subscription from the past: the history of a filter nobody subscribed to
    for i in range(3):
        probe.send(P.Publish(f"hist/{i}", b"h%d" % i, qos=1, packet_id=10 + i))
        assert isinstance(probe.recv(timeout=10.0), P.PubAck)
    reader = RawMQTT(gw)
    assert isinstance(reader.connect("reader"), P.ConnAck)
    sub = subscribe_while_frozen(store, reader, probe, "$replay/0/hist/+")
    assert isinstance(sub, P.SubAck) and sub.reason_codes == [1]
    history = []
    while len(history) < 3:
        pkt = reader.recv(timeout=10.0)
        history.append(pkt.payload)
        if pkt.qos:
            reader.send(P.PubAck(pkt.packet_id))
    assert history == [b"h0", b"h1", b"h2"]

    # 3. a persistent session in a shared group resumed on a second gateway, which has no such
    #    group yet: it resumes from the group's committed offset, read from the store
    v5 = P.Properties()
    v5.session_expiry_interval = 600
    member = RawMQTT(gw, version=5)
    assert isinstance(member.connect("member", clean=False, props=v5), P.ConnAck)
    member.send(P.Subscribe(1, [P.SubscriptionRequest("$share/crew/tasks/#", qos=1)]))
    assert isinstance(member.recv(timeout=10.0), P.SubAck)
    member.send(P.Disconnect())
    member.close()
    other = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    try:
        probe2 = RawMQTT(other)
        assert isinstance(probe2.connect("probe2"), P.ConnAck)
        back = RawMQTT(other, version=5)
        with frozen(store):
            back.send(P.Connect("member", 5, False, 60, None, None, None, v5))
            assert nothing_within(back, 0.5)
            assert answered_ping(probe2)
        ack = back.recv(timeout=10.0)
        assert isinstance(ack, P.ConnAck) and ack.reason_code == 0 and ack.session_present is True
        back.close()
        probe2.close()
    finally:
        other.stop()

    # 4. a session's expiry falls due while the store is frozen: the check waits, the others not
    short = P.Properties()
    short.session_expiry_interval = 1
    brief = RawMQTT(gw, version=5)
    assert isinstance(brief.connect("brief", clean=False, props=short), P.ConnAck)
    brief.send(P.Disconnect())
    brief.close()
    left = time.monotonic()
    with frozen(store):
        time.sleep(max(0.0, left + 1.4 - time.monotonic()))    # the expiry (1 s) is due
        assert answered_ping(probe)
    from lmqtt.store.client import connect
    with connect(store.address) as sdk:              # ended once the store answered the check
        deadline = time.monotonic() + 10
        while sdk.cmd("gw_get_session", client_id="brief")["rec"] is not None and time.monotonic() < deadline:
            time.sleep(0.05)
    again = RawMQTT(gw, version=5)
    assert again.connect("brief", clean=False, props=short).session_present is False
    again.close()
    for c in (probe, worker, reader):
        c.close()
