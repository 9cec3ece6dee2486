"""The records of sessions going offline (a reconnect storm): on `lmqtt serve` the dropped
connections of one event-loop tick have their records written together at its end, in one metadata
write (was: one write each); a client that sent DISCONNECT has its record in that write too, and
its connection is closed only once it is written (it sees the close:
tests/e2e/test_e2e_inflight_restart.py); a newer write or a delete of the session in the
same tick wins over the waiting one; a stop writes what waits; and across kill -9 the sessions are
back as their clients left them."""
from __future__ import annotations

import asyncio
import time

from lmqtt.gateway.clients.session_persistence import SessionPersistence
from lmqtt.gateway.storage.record_props import RecordMeta
from lmqtt.gateway.session import ClientSubscription, Counts, MqttSession, OutboundMessage
from lmqtt.gateway.mqtt import packets as P
from lmqtt.lightqueue.metadata import MetadataStore
from lmqtt.store.node.inprocess import InProcessOffsets, InProcessSessions
from tests.lightqueue.test_filter_register_write import _Counting
from tests.support import RawMQTT, metric


class _Facades:
    def __init__(self, md: MetadataStore) -> None:
        self.sessions = InProcessSessions(md)
        self.offsets = InProcessOffsets(md)


class _Conn:
    """What `close_after_record` does to the connection of a client that sent DISCONNECT."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def hold(self) -> None:
        self.events.append("hold")

    def close(self) -> None:
        self.events.append("close")


def _offline(cid: str) -> MqttSession:
    s = MqttSession(cid)
    s.expiry_interval = 3600
    s.subs[f"d/{cid}/+"] = ClientSubscription(f"d/{cid}/+", f"d/{cid}/+", 1)
    s.disconnected_at_ms = 1234
    return s


def test_the_disconnects_of_one_tick_are_one_write(tmp_path):
    md = MetadataStore(str(tmp_path / "md"))
    real, md._db = md._db, _Counting(md._db)
    sessions: dict[str, MqttSession] = {}

    async def main() -> None:
        p = SessionPersistence(_Facades(md), session_live=lambda s: sessions.get(s.client_id) is s,
                               group_live=lambda g: True)
        p.start_flushing(asyncio.get_running_loop(), 3600)
        for cid in ("a", "b", "c", "d", "e"):
            sessions[cid] = _offline(cid)
            p.save_later(sessions[cid])
        p.delete_session("d")                 # ended in the same tick: not written back
        sessions.pop("e")                     # no longer the live one: not written
        p.save_session(sessions["c"])         # a newer write of c: the waiting one is dropped
        assert md._db.writes == 1 + 1         # the delete, c's own write
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert md._db.writes == 2 + 1         # a and b together
        for cid in ("a", "b", "c"):
            rec = md.get_session(cid)
            assert rec.last_disconnect_ms == 1234 and [x.filter for x in rec.subscriptions] == [f"d/{cid}/+"]
        assert md.get_session("d") is None and md.get_session("e") is None
        # g and h sent DISCONNECT: each connection is held, closed once the tick's one write
        # holding their records (offline) is done; their detach then writes nothing more, unless
        # the session changed meanwhile (h: a message went out to it)
        conns = {}
        for cid in ("g", "h"):
            s = sessions[cid] = _offline(cid)
            s.conn = conns[cid] = _Conn()
            assert p.close_after_record(s, s.conn)
        assert conns["g"].events == ["hold"] and md._db.writes == 3
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert md._db.writes == 4 and conns["g"].events == conns["h"].events == ["hold", "close"]
        rec = md.get_session("g")
        assert rec.last_disconnect_ms is not None and [x.filter for x in rec.subscriptions] == ["d/g/+"]
        sessions["h"].send(OutboundMessage("d/h/x", b"m", RecordMeta(qos=1)), 1, False, lambda frame: None, Counts())
        for cid in ("g", "h"):                # connection_lost: detach
            sessions[cid].conn = None
            p.save_later(sessions[cid])
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert md._db.writes == 5             # h's only
        sessions["f"] = _offline("f")
        p.save_later(sessions["f"])
        p.stop_flushing()                     # a stop writes what waits, now
        assert md.get_session("f") is not None
        assert md._db.writes == 6
    try:
        asyncio.run(main())
    finally:
        md._db = real
        md.close()


def test_sessions_that_left_in_one_burst_are_back_after_kill9(lmqtt_server):
    srv = lmqtt_server
    n = 40
    clients = []
    for i in range(n):
        c = RawMQTT(srv, version=4)
        assert c.connect(f"burst-{i}", clean=False).session_present is False
        c.send(P.Subscribe(1, [P.SubscriptionRequest(f"burst/{i}/+", 1)]))
        assert isinstance(c.recv(), P.SubAck)
        clients.append(c)
    for c in clients:                             # all gone at once: disconnects in the same ticks
        c.close()
    again = RawMQTT(srv, version=4)               # one back at once, still connected at the kill
    assert again.connect("burst-0", clean=False).session_present is True
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:            # the others' disconnects seen
        if metric(srv.metrics_url, "lmqtt_connections") == 1:
            break
        time.sleep(0.05)
    time.sleep(0.2)
    srv.kill9()
    again.close()
    srv.start()
    pub = RawMQTT(srv, version=4)
    assert pub.connect("burst-pub").reason_code == 0
    for i in range(n):
        pub.send(P.Publish(topic=f"burst/{i}/x", payload=b"m%d" % i, qos=1, packet_id=i + 1))
        assert isinstance(pub.recv(), P.PubAck)
    for i in range(n):
        c = RawMQTT(srv, version=4)
        assert c.connect(f"burst-{i}", clean=False).session_present is True, i
        m = c.recv()
        assert isinstance(m, P.Publish) and m.payload == b"m%d" % i and m.qos == 1, (i, m)
        c.close()
    pub.close()
