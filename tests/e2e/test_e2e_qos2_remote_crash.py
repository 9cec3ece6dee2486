"""QoS 2 exactly once across a kill -9 of a gateway over a remote store (`lmqtt gateway` +
`lmqtt store`, as a fleet and `lmqtt serve --workers` run): the gateway restores its sessions at
start, but over a remote store it cannot read the messages of their exchanges in flight there
(they are read ahead with the CONNECT that resumes a session); the restored copy keeps the
record's state unchanged (`Session.saved_inflight`, written back as read) and the client's CONNECT
resumes it with those messages: PUBLISH again with DUP and the same packet id, PUBREL for those
past PUBREC, never a message sent again as new. Before, the copy restored at start dropped its
queue's exchanges (the messages were "not stored"), wrote that back over the record, and the
messages since the last committed offset went out again as new ones: the subscriber delivered
them twice (`lmqtt bench chaos`: QoS 2 duplicates after a kill of the store under `serve
--workers` or of a fleet gateway)."""
from __future__ import annotations

import pytest

from lmqtt.gateway.mqtt import packets as P
from tests.e2e.test_e2e_qos2_crash import Receiver, _stored
from tests.support import LmqttFleet, RawMQTT


@pytest.fixture
def fleet(tmp_path):
    f = LmqttFleet(str(tmp_path / "store-data"), log_dir=str(tmp_path)).start()
    try:
        yield f
    finally:
        f.stop()


@pytest.mark.parametrize("victim", ["gateway", "store and gateway"])
def test_qos2_exchanges_survive_kill9_of_a_remote_gateway_exactly_once(fleet, victim):
    sub = Receiver(fleet, "dev")
    assert sub.connect() is False
    sub.c.send(P.Subscribe(1, [P.SubscriptionRequest("t/#", qos=2)]))
    assert isinstance(sub.c.recv(timeout=10.0), P.SubAck)

    pub = RawMQTT(fleet)
    assert isinstance(pub.connect("pub", clean=False), P.ConnAck)
    for i in range(4):
        pub.send(P.Publish("t/a", b"m%d" % i, qos=2, packet_id=10 + i))
        assert isinstance(pub.recv(timeout=10.0), P.PubRec)
        pub.send(P.PubRel(10 + i))
        assert isinstance(pub.recv(timeout=10.0), P.PubComp)
    pub.send(P.Publish("t/a", b"in", qos=2, packet_id=50))      # stored, PUBREL not sent
    assert isinstance(pub.recv(timeout=10.0), P.PubRec)

    got = {}
    for _ in range(5):
        p = sub.recv(answer=False)
        assert isinstance(p, P.Publish)
        got[p.payload] = p
    # m0: the whole exchange; m1: released by the client (delivered), PUBCOMP not sent; m2: PUBREC
    # sent, its PUBREL not read; m3, in: PUBLISH received, nothing answered
    for name in (b"m0", b"m1", b"m2"):
        sub.c.send(P.PubRec(got[name].packet_id))
    rels = set()
    while len(rels) < 3:
        p = sub.c.recv(timeout=10.0)
        assert isinstance(p, P.PubRel), p
        rels.add(p.packet_id)
    sub.handle(P.PubRel(got[b"m0"].packet_id))
    sub.handle(P.PubRel(got[b"m1"].packet_id), answer=False)
    sub.c.send(P.PingReq())
    assert isinstance(sub.c.recv(timeout=10.0), P.PingResp)

    if victim == "gateway":
        fleet.gateway.restart(kill=True)                 # the store stays up
    else:
        fleet.restart(kill=True)
    assert sub.c.closed_by_server(timeout=10.0) and pub.closed_by_server(timeout=10.0)
    sub.c.close()
    pub.close()

    assert sub.connect() is True
    pub = RawMQTT(fleet)
    assert pub.connect("pub", clean=False).session_present is True
    pub.send(P.Publish("t/a", b"in", qos=2, dup=True, packet_id=50))
    assert isinstance(pub.recv(timeout=10.0), P.PubRec)
    pub.send(P.PubRel(50))
    assert isinstance(pub.recv(timeout=10.0), P.PubComp)
    pub.send(P.Publish("t/a", b"after", qos=2, packet_id=51))
    assert isinstance(pub.recv(timeout=10.0), P.PubRec)
    pub.send(P.PubRel(51))
    assert isinstance(pub.recv(timeout=10.0), P.PubComp)
    sub.run_until_quiet()

    names = [b"m0", b"m1", b"m2", b"m3", b"in", b"after"]
    assert dict(sub.delivered) == {n: 1 for n in names}, fleet.log_tail()
    assert sub.held == set()
    assert dict(_stored(fleet, "t/#")) == {n: 1 for n in names}
    sub.c.close()
    pub.close()
