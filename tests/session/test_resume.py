"""The session machine across connections and restarts, as tables: redelivery when a session is
resumed, what a persistent session's record keeps and how it comes back, shared-group messages when
the client goes, session expiry. Each row: the state, the input, the machine's answer, the packets
it wrote, the new state. Rule ids: 5.0 unless marked 3.1.1."""
from __future__ import annotations

import pytest
from lmqtt.gateway.mqtt import ReasonCode as RC
from lmqtt.gateway.session import NEVER_EXPIRES, InFlight, MqttSession

from tests.session.support import NOW_MS, Out, Row, after, check, msg, offered, raises, sent, session

ACK, COMP = InFlight.WAIT_ACK, InFlight.WAIT_COMP


def three_in_flight(version: int = 5, **kw) -> MqttSession:
    """QoS 1 id 1 awaiting PUBACK, QoS 2 id 2 past PUBREC (PUBREL sent), QoS 2 id 3 awaiting PUBREC."""
    s = sent(session(version=version, subs=[("t/#", 2)], **kw), msg(qos=1, off=0), msg(qos=2, off=1),
             msg(qos=2, off=2))
    s.pubrec_received(2)
    return s


def reconnect(s: MqttSession, version: int = 5, **limits) -> MqttSession:
    s.connect(version, limits.get("receive_max"), limits.get("max_packet"), None, 0, 1000)
    return s


def restarted(s: MqttSession) -> MqttSession:
    """What a restart makes of `s`: a new session from its record (subscriptions, the committed
    offsets, the snapshot of its exchanges) with the messages read again from the store."""
    state = s.snapshot()
    t = session(version=s.version, subs=[(sub.queue, sub.qos) for sub in s.subs.values()], expiry=s.expiry_interval,
                offset=0, client_id=s.client_id)
    for q, cur in s.cursors.items():
        t.cursors[q].next_offset = cur.committed()
    t.restore(state, lambda q, off: msg(qos=2, off=off))
    return t


def group_inflight(s: MqttSession) -> MqttSession:
    out = Out()
    s.send(msg("g/1", qos=1, off=40), 1, False, out.write, out.tally, group="g1")
    return s


def _expiries(s: MqttSession) -> tuple:
    """Expired? connected (at any time); offline since 1,000 ms, at 10,999 and at 11,000 ms; never expiring."""
    connected = s.expired(10 ** 12)
    s.conn = None
    s.disconnected_at_ms = 1000
    before, at = s.expired(10_999), s.expired(11_000)
    s.expiry_interval = NEVER_EXPIRES
    return connected, before, at, s.expired(10 ** 12)




RESUME = [
    Row("MQTT-4.4.0-1, MQTT-3.3.1-1, MQTT-4.3.3-6; 3.1.1: MQTT-4.4.0-1", "a resumed session sends its "
        "exchanges again, in send order, same ids: PUBLISH with DUP 1, PUBREL for those past PUBREC",
        given=lambda: reconnect(three_in_flight()),
        when=lambda s, out: s.resume(out.write, out.tally, NOW_MS),
        answer=[],
        packets=[("PUBLISH", "t/1", 1, 1, True, False), ("PUBREL", 2, 0), ("PUBLISH", "t/1", 2, 3, True, False)],
        state={"window": [(1, 1, ACK, "t/#", 0), (2, 2, COMP, "t/#", 1), (3, 2, ACK, "t/#", 2)]}),
    Row("3.1.1: MQTT-4.4.0-1, MQTT-3.3.1-1", "the same for MQTT 3.1.1",
        given=lambda: reconnect(three_in_flight(version=4), version=4),
        when=lambda s, out: s.resume(out.write, out.tally, NOW_MS),
        answer=[],
        packets=[("PUBLISH", "t/1", 1, 1, True, False), ("PUBREL", 2, 0), ("PUBLISH", "t/1", 2, 3, True, False)],
        version=4),
    Row("MQTT-3.3.1-3", "what was not sent before is sent new, with DUP 0, after the resends",
        given=lambda: reconnect(sent(session(), msg(off=0))),
        when=lambda s, out: (s.resume(out.write, out.tally, NOW_MS), offered(msg(off=1))(s, out)),
        answer=([], 0),
        packets=[("PUBLISH", "t/1", 1, 1, True, False), ("PUBLISH", "t/1", 1, 2, False, False)]),
    Row("MQTT-3.3.4-9", "a resumed connection's smaller Receive Maximum holds new messages until the window drains",
        given=lambda: reconnect(three_in_flight(), receive_max=2),
        when=lambda s, out: (s.resume(out.write, out.tally, NOW_MS), offered(msg(off=3))(s, out), s.window_room()),
        answer=([], 0, -1), state={"cursors": {"t/#": (3, {0: 1, 1: 2, 2: 3})}}),
    Row("MQTT 5 §4.8.2", "the client goes: its shared-group messages in flight go back to their group, the rest stays",
        given=lambda: group_inflight(sent(session(), msg(off=0))),
        when=lambda s, out: [(i.pid, i.group) for i in s.went_offline()],
        answer=[(2, "g1")], state={"window": [(1, 1, ACK, "t/#", 0)]}),
    Row("MQTT-3.1.2-4; 3.1.1: MQTT-3.1.2-6", "the session ends (clean start): nothing of it stays in flight",
        given=lambda: three_in_flight(),
        when=lambda s, out: s.ended(),
        answer=None, state={"window": []}),
]

PERSISTENT = [
    Row("MQTT-3.1.2-23, MQTT-4.4.0-1; 3.1.1: MQTT-3.1.2-4", "a restart keeps the exchanges: same ids, states and "
        "allocator; resent as before the restart",
        given=lambda: restarted(three_in_flight(expiry=60)),
        when=lambda s, out: (s.resume(out.write, out.tally, NOW_MS), offered(msg(qos=2, off=3))(s, out)),
        answer=([], 2),
        packets=[("PUBLISH", "t/1", 1, 1, True, False), ("PUBREL", 2, 0), ("PUBLISH", "t/1", 2, 3, True, False),
                 ("PUBLISH", "t/1", 2, 4, False, False)],
        state={"window": [(1, 1, ACK, "t/#", 0), (2, 2, COMP, "t/#", 1), (3, 2, ACK, "t/#", 2), (4, 2, ACK, "t/#", 3)],
               "next_pid": 5}),
    Row("MQTT-4.3.3-10", "a restart keeps the inbound QoS 2 ids awaiting PUBREL",
        given=lambda: restarted(after(session(expiry=60), lambda s: s.publish_received(2, 7, 100),
                                      lambda s: s.publish_stored(2, 7))),
        when=lambda s, out: s.publish_received(2, 7, 100),
        answer=1, state={"in2": {7}}),
    Row("MQTT-3.1.2-23", "what was delivered and acknowledged before the snapshot is not sent again",
        given=lambda: restarted(after(sent(session(expiry=60), msg(off=0), msg(off=1)),
                                      lambda s: s.puback_received(1))),
        when=lambda s, out: s.resume(out.write, out.tally, NOW_MS),
        answer=[], packets=[("PUBLISH", "t/1", 1, 2, True, False)],
        state={"cursors": {"t/#": (2, {1: 2})}}),
    Row("MQTT-3.1.2-23", "a queue whose message is gone from the store comes back from its committed offset, as new",
        given=lambda: three_in_flight(expiry=60),
        when=lambda s, out: (lambda t: (t.restore(s.snapshot(), lambda q, off: None if off == 1 else msg(qos=2, off=off)),
                                        [i.pid for i in t.inflight()], t.cursors["t/#"].next_offset))(
            session(subs=[("t/#", 2)], expiry=60)),
        answer=(0, [], 0)),
    Row("MQTT-3.1.2-23", "nothing in flight: the snapshot says where delivery stands and the next id",
        given=lambda: after(sent(session(expiry=60), msg(off=4)), lambda s: s.puback_received(1)),
        when=lambda s, out: s.snapshot(),
        answer={"out": [], "next": {"t/#": 5}, "in2": [], "pid": 2}),
]

EXPIRY = [
    Row("MQTT 5 §3.14.2.2.2", "DISCONNECT may not set a Session Expiry Interval when CONNECT had 0",
        given=lambda: session(expiry=0),
        when=lambda s, out: raises(lambda: s.disconnect_received(30, 3600)),
        answer=RC.PROTOCOL_ERROR),
    Row("MQTT-3.1.2-23", "DISCONNECT with 0: the session ends with the connection (its record is deleted)",
        given=lambda: session(expiry=60),
        when=lambda s, out: (s.disconnect_received(0, 3600), s.persistent),
        answer=(True, False)),
    Row("MQTT-3.1.2-23", "DISCONNECT with another interval: kept, capped by the server's maximum",
        given=lambda: session(expiry=60),
        when=lambda s, out: (s.disconnect_received(7200, 3600), s.expiry_interval, s.disconnect_received(None, 3600)),
        answer=(False, 3600, False)),
    Row("MQTT-4.1.0-1, MQTT-4.1.0-2", "expired once offline for its interval; never while connected or when it never "
        "expires",
        given=lambda: session(expiry=10),
        when=lambda s, out: _expiries(s),
        answer=(False, False, True, False)),
]


@pytest.mark.parametrize("row", RESUME + PERSISTENT + EXPIRY, ids=lambda r: r.id)
def test_resume(row: Row) -> None:
    check(row)


def test_a_restore_that_cannot_read_a_message_in_flight_names_the_queue_it_delivers_again() -> None:
    """A message of the record's exchanges no longer readable: its queue's exchanges are not
    resumed, the queue is delivered again from its committed offset, and the caller is told which
    and why (it logs it: what the client completed since that offset comes twice)."""
    s = three_in_flight(expiry=60)
    state = s.snapshot()
    t = session(version=5, subs=[("t/#", 2)], expiry=60, offset=0, client_id=s.client_id)
    requeued: list = []
    n = t.restore(state, lambda q, off: None if off == 1 else msg(qos=2, off=off), requeued)
    assert n == 0 and requeued == [("t/#", 1, "message not readable")]
    assert t.cursors["t/#"].next_offset == 0          # from the committed offset again
    ok: list = []
    assert t.restore(s.snapshot(), lambda q, off: msg(qos=2, off=off), ok) == 3 and ok == []
