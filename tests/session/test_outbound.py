"""The session machine's outbound flow as tables: packet identifiers, QoS 0/1/2 from the server to
the client, Receive Maximum (the send quota), the granted QoS, overlapping subscriptions, No Local,
Retain As Published, order, runs of stored records and retained messages. Each row: the state, the
input, the machine's answer, the packets it wrote, the new state. Rule ids: 5.0 unless marked
3.1.1 (docs/session.md lists them with these tests)."""
from __future__ import annotations

import pytest
from lmqtt.gateway.mqtt import ReasonCode as RC
from lmqtt.gateway.session import OVER, QOS2_SENT, TOO_LARGE, ClientSubscription, InFlight

from tests.session.support import (ANY, NOW_MS, Out, Row, after, check, decode, msg, offered, records, resumed_at,
                                   sent, session)

ACK, COMP = InFlight.WAIT_ACK, InFlight.WAIT_COMP


def pid_of(inf):
    return None if inf is None else inf.pid


# ------------------------------------------------------------------------ packet identifiers, QoS 1
IDS = [
    Row("MQTT-2.2.1-4, MQTT-4.3.2-1; 3.1.1: MQTT-2.3.1-4", "a new QoS 1 PUBLISH takes the next id not in flight",
        given=lambda: resumed_at(session(subs=[("t/#", 2)]), 65535, [(1, 2, 0, ACK)]),
        when=offered(msg(off=1), msg(off=2)),
        answer=0,
        packets=[("PUBLISH", "t/1", 1, 65535, False, False), ("PUBLISH", "t/1", 1, 2, False, False)],
        state={"window": [(1, 2, ACK, "t/#", 0), (65535, 1, ACK, "t/#", 1), (2, 1, ACK, "t/#", 2)],
               "next_pid": 3}),
    Row("MQTT-2.2.1-2, MQTT-3.3.1-2, MQTT-4.3.1-1; 3.1.1: MQTT-2.3.1-5", "QoS 0: no packet id, DUP 0, nothing in flight",
        given=lambda: session(subs=[("t/#", 0)]),
        when=offered(msg(qos=1)),
        answer=0, packets=[("PUBLISH", "t/1", 0, None, False, False)],
        state={"window": [], "next_pid": 1, "cursors": {"t/#": (1, {})}}),
    Row("MQTT-4.3.2-1, MQTT-4.3.2-2, MQTT-4.3.2-3; 3.1.1: MQTT-4.3.2-1", "QoS 1: PUBLISH with DUP 0, in flight until PUBACK",
        given=lambda: session(),
        when=offered(msg()),
        answer=0, packets=[("PUBLISH", "t/1", 1, 1, False, False)],
        state={"window": [(1, 1, ACK, "t/#", 0)], "next_pid": 2, "cursors": {"t/#": (1, {0: 1})}}),
    Row("MQTT-2.2.1-5, MQTT-4.3.2-3; 3.1.1: MQTT-2.3.1-6", "PUBACK releases the message and its offset",
        given=lambda: sent(session(), msg(off=0), msg(off=1)),
        when=lambda s, out: pid_of(s.puback_received(2)),
        answer=2, packets=[],
        state={"window": [(1, 1, ACK, "t/#", 0)], "cursors": {"t/#": (2, {0: 1})}}),
    Row("MQTT-2.2.1-5", "a PUBACK for an id not in flight (a late ack after a reconnect) is ignored",
        given=lambda: sent(session(), msg()),
        when=lambda s, out: s.puback_received(9),
        answer=None, packets=[], state={"window": [(1, 1, ACK, "t/#", 0)]}),
    Row("MQTT-2.2.1-5", "a PUBACK for a QoS 2 exchange is not its ack",
        given=lambda: sent(session(subs=[("t/#", 2)]), msg(qos=2)),
        when=lambda s, out: s.puback_received(1),
        answer=None, packets=[], state={"window": [(1, 2, ACK, "t/#", 0)]}),
    Row("MQTT-2.2.1-4; 3.1.1: MQTT-2.3.1-2", "an id becomes free once its exchange is acknowledged",
        given=lambda: resumed_at(session(receive_max=2), 1, [(1, 1, 0, ACK)]),
        when=lambda s, out: (pid_of(s.puback_received(1)),
                             offered(msg(off=1), msg(off=2))(s, out)),
        answer=(1, 0),
        packets=[("PUBLISH", "t/1", 1, 1, False, False), ("PUBLISH", "t/1", 1, 2, False, False)],
        state={"next_pid": 3}),
]

# ------------------------------------------------------------------------ QoS 2 from the server
QOS2 = [
    Row("MQTT-4.3.3-1, MQTT-4.3.3-2, MQTT-4.3.3-3; 3.1.1: MQTT-4.3.3-1", "QoS 2: PUBLISH with DUP 0, in flight until PUBREC",
        given=lambda: session(subs=[("t/#", 2)]),
        when=offered(msg(qos=2)),
        answer=QOS2_SENT, packets=[("PUBLISH", "t/1", 2, 1, False, False)],
        state={"window": [(1, 2, ACK, "t/#", 0)]}),
    Row("MQTT-4.3.3-4, MQTT-4.3.3-5", "PUBREC: PUBREL with the same id, in flight until PUBCOMP",
        given=lambda: sent(session(subs=[("t/#", 2)]), msg(qos=2)),
        when=lambda s, out: (decode(s.pubrec_received(1)[0]).packet_id, s.inflight()[0].state),
        answer=(1, COMP), state={"window": [(1, 2, COMP, "t/#", 0)], "cursors": {"t/#": (1, {0: 1})}}),
    Row("MQTT-4.3.3-4", "a persistent session's PUBREL waits for its record (exactly once across a crash)",
        given=lambda: sent(session(subs=[("t/#", 2)], expiry=60), msg(qos=2)),
        when=lambda s, out: s.pubrec_received(1)[2],
        answer=True),
    Row("MQTT-4.3.3-5", "PUBCOMP ends the exchange: the id and the offset are free",
        given=lambda: after(sent(session(subs=[("t/#", 2)]), msg(qos=2)), lambda s: s.pubrec_received(1)),
        when=lambda s, out: pid_of(s.pubcomp_received(1)),
        answer=1, state={"window": [], "cursors": {"t/#": (1, {})}}),
    Row("MQTT-4.4.0-2, MQTT-4.3.3-4", "PUBREC with a failure code: acknowledged, no PUBREL, not sent again",
        given=lambda: sent(session(subs=[("t/#", 2)]), msg(qos=2)),
        when=lambda s, out: (lambda r: (r[0], pid_of(r[1]), r[2]))(s.pubrec_received(1, RC.UNSPECIFIED_ERROR)),
        answer=(None, 1, False), state={"window": [], "cursors": {"t/#": (1, {})}}),
    Row("MQTT-2.2.1-5", "PUBREC for an id not in flight: PUBREL 0x92 (Packet Identifier not found)",
        given=lambda: session(subs=[("t/#", 2)]),
        when=lambda s, out: (lambda r: (decode(r[0]).reason_code, r[1], r[2]))(s.pubrec_received(4)),
        answer=(RC.PACKET_IDENTIFIER_NOT_FOUND, None, False)),
    Row("3.1.1: MQTT-2.3.1-6", "PUBREC for an id not in flight, MQTT 3.1.1: PUBREL (no reason codes)",
        given=lambda: session(version=4, subs=[("t/#", 2)]),
        when=lambda s, out: decode(s.pubrec_received(4)[0], 4).packet_id,
        answer=4),
    Row("MQTT-4.3.3-5", "PUBCOMP for an exchange whose PUBREL was not sent (awaiting PUBREC) is ignored",
        given=lambda: sent(session(subs=[("t/#", 2)]), msg(qos=2)),
        when=lambda s, out: s.pubcomp_received(1),
        answer=None, state={"window": [(1, 2, ACK, "t/#", 0)]}),
]

# ------------------------------------------------------------------------ Receive Maximum, QoS, order
FLOW = [
    Row("MQTT-3.3.4-9, MQTT-4.9.0-2", "no more QoS 1/2 in flight than the client's Receive Maximum; the cursor waits",
        given=lambda: session(receive_max=2),
        when=offered(msg(off=0), msg(off=1), msg(off=2)),
        answer=0,
        packets=[("PUBLISH", "t/1", 1, 1, False, False), ("PUBLISH", "t/1", 1, 2, False, False)],
        state={"cursors": {"t/#": (2, {0: 1, 1: 2})}}),
    Row("MQTT-4.9.0-3, MQTT-3.3.4-10", "the quota at zero holds back QoS 1/2 PUBLISHes only: QoS 0 still goes",
        given=lambda: sent(session(receive_max=1), msg(off=0)),
        when=offered(msg(qos=0, off=1)),
        answer=0, packets=[("PUBLISH", "t/1", 0, None, False, False)],
        state={"cursors": {"t/#": (2, {0: 1})}}),
    Row("MQTT-4.9.0-1", "the quota: the client's Receive Maximum (absent: 65,535), capped by the server's max_inflight",
        given=lambda: session(),
        when=lambda s, out: [(s.connect(5, rm, None, None, 0, 1000), s.window_room())[1] for rm in (None, 10, 5000)],
        answer=[1000, 10, 1000]),
    Row("MQTT-3.8.4-8; 3.1.1: MQTT-3.8.4-6", "sent at the lower of the published QoS and the granted QoS",
        given=lambda: session(subs=[("t/#", 1)]),
        when=offered(msg(qos=2, off=0), msg(qos=0, off=1)),
        packets=[("PUBLISH", "t/1", 1, 1, False, False), ("PUBLISH", "t/1", 0, None, False, False)], answer=0),
    Row("MQTT-3.3.1-12; 3.1.1: MQTT-3.3.1-9", "an established subscription's PUBLISH has RETAIN 0",
        given=lambda: session(),
        when=offered(msg(retain=True)),
        packets=[("PUBLISH", "t/1", 1, 1, False, False)], answer=0),
    Row("MQTT-3.3.1-13", "Retain As Published: RETAIN as published",
        given=lambda: session(subs=[ClientSubscription("t/#", "t/#", 1, retain_as_published=True)]),
        when=offered(msg(retain=True, off=0), msg(off=1)),
        packets=[("PUBLISH", "t/1", 1, 1, False, True), ("PUBLISH", "t/1", 1, 2, False, False)], answer=0),
    Row("MQTT-3.8.3-3", "No Local: the client's own messages are not sent to it; the cursor moves past them",
        given=lambda: session(subs=[ClientSubscription("t/#", "t/#", 1, no_local=True)], client_id="me"),
        when=offered(msg(publisher="me", off=0), msg(publisher="other", off=1)),
        packets=[("PUBLISH", "t/1", 1, 1, False, False)], answer=0,
        state={"cursors": {"t/#": (2, {1: 1})}}),
    Row("MQTT-3.3.4-2; 3.1.1: MQTT-3.3.5-1", "overlapping subscriptions: one copy, at the highest QoS, from that queue",
        given=lambda: session(subs=[("a/+", 0), ("a/#", 2)]),
        when=lambda s, out: (offered(msg("a/b", qos=2, queues=("a/+", "a/#")), q="a/+")(s, out),
                             offered(msg("a/b", qos=2, queues=("a/+", "a/#")), q="a/#")(s, out)),
        answer=(0, QOS2_SENT), packets=[("PUBLISH", "a/b", 2, 1, False, False)],
        state={"cursors": {"a/+": (1, {}), "a/#": (1, {0: 1})}}),
    Row("MQTT-3.3.4-3, MQTT-3.3.4-4", "the one copy carries the identifiers of every matching subscription",
        given=lambda: session(subs=[("a/+", 1, 7), ("a/#", 1, 3)]),
        when=lambda s, out: (offered(msg("a/b", queues=("a/+", "a/#")), q="a/#")(s, out),
                             sorted(out.packets()[0].properties.subscription_identifier)),
        answer=(0, [3, 7])),
    Row("MQTT-4.6.0-6; 3.1.1: MQTT-4.6.0-6", "order: a message the window cannot take stops the batch there",
        given=lambda: session(receive_max=1),
        when=offered(msg(off=0), msg(off=1), msg(qos=0, off=2)),
        answer=0, packets=[("PUBLISH", "t/1", 1, 1, False, False)],
        state={"cursors": {"t/#": (1, {0: 1})}}),
    Row("MQTT-4.9.0-3", "the byte budget stops a batch after the message that used it up (OVER)",
        given=lambda: session(subs=[("t/#", 0)]),
        when=offered(msg(qos=0, off=0), msg(qos=0, off=1), budget=1),
        answer=OVER, packets=[("PUBLISH", "t/1", 0, None, False, False)], state={"cursors": {"t/#": (1, {})}}),
    Row("MQTT-4.6.0-6", "a batch entirely sent moves the cursor to the batch's end",
        given=lambda: session(subs=[("t/#", 0)]),
        when=lambda s, out: s.offer("t/#", [msg(qos=0, off=3)], 10, out.write, out.tally, 1 << 30),
        answer=0, state={"cursors": {"t/#": (10, {})}}),
    Row("MQTT-3.1.2-24, MQTT-3.1.2-25", "over the client's Maximum Packet Size: not sent, completed as if sent",
        given=lambda: session(max_packet=40),
        when=lambda s, out: (offered(msg(payload=b"x" * 60, off=0), msg(off=1))(s, out), out.tally.drops,
                             s.dropped_too_large),
        answer=(0, {TOO_LARGE: 1}, 1), packets=[("PUBLISH", "t/1", 1, 1, False, False)],
        state={"window": [(1, 1, ACK, "t/#", 1)], "cursors": {"t/#": (2, {1: 1})}}),
]


# ------------------------------------------------------------------------ runs of stored records
def _records(s, out, *specs, receive_max=None):
    msgs, metas = records(*specs)
    return s.offer_records("t/#", msgs, msgs[-1].queue_offset + 1, out.write, out.flush, out.tally, 1 << 30,
                           metas, metas.__getitem__, lambda m: msg(m.topic, m.body, metas[m.props].qos, m.queue_offset,
                                                                   expiry=metas[m.props].message_expiry_interval),
                           NOW_MS)


RUNS = [
    Row("MQTT-2.2.1-4, MQTT-4.3.2-1", "a run of stored records: one write, a run of ids, one InFlight each",
        given=lambda: session(version=4),
        when=lambda s, out: (_records(s, out, ("r/a", 1, 0), ("r/b", 1, 1), ("r/c", 0, 2)), len(out.frames)),
        answer=(0, 1),
        packets=[("PUBLISH", "r/a", 1, 1, False, False), ("PUBLISH", "r/b", 1, 2, False, False),
                 ("PUBLISH", "r/c", 0, None, False, False)],
        state={"window": [(1, 1, ACK, "t/#", 0), (2, 1, ACK, "t/#", 1)], "next_pid": 3,
               "cursors": {"t/#": (3, {0: 1, 1: 2})}}, version=4),
    Row("MQTT-4.6.0-6", "a record that needs more than a run goes one by one, in the queue's order",
        given=lambda: session(subs=[("t/#", 2)]),
        when=lambda s, out: _records(s, out, ("r/a", 1, 0), ("r/b", 2, 1), ("r/c", 1, 2, 60)),
        answer=QOS2_SENT,
        packets=[("PUBLISH", "r/a", 1, 1, False, False), ("PUBLISH", "r/b", 2, 2, False, False),
                 ("PUBLISH", "r/c", 1, 3, False, False)],
        state={"cursors": {"t/#": (3, {0: 1, 1: 2, 2: 3})}}),
    Row("MQTT-3.3.4-9", "a run stops at the Receive Maximum; the cursor waits on the first not sent",
        given=lambda: session(receive_max=2, version=4),
        when=lambda s, out: _records(s, out, ("r/a", 1, 0), ("r/b", 1, 1), ("r/c", 1, 2)),
        answer=0, state={"cursors": {"t/#": (2, {0: 1, 1: 2})}}, version=4),
]


# ------------------------------------------------------------------------ retained messages
def _retained(s, out, *specs, sub_qos=1):
    from lmqtt.gateway.storage.record_props import RecordMeta
    items = [(t, b"v", (RecordMeta(qos=q, retain=True), 0, True)) for t, q in specs]
    return s.offer_retained(items, sub_qos, None, out.write, out.flush, out.tally)


RETAINED = [
    Row("MQTT-3.3.1-9; 3.1.1: MQTT-3.3.1-6, MQTT-3.3.1-8", "retained messages of a new subscription: RETAIN 1",
        given=lambda: session(),
        when=lambda s, out: _retained(s, out, ("k/a", 1), ("k/b", 0)) and None,
        packets=[("PUBLISH", "k/a", 1, 1, False, True), ("PUBLISH", "k/b", 0, None, False, True)],
        state={"window": [(1, 1, ACK, None, None)], "cursors": {"t/#": (0, {})}}),
    Row("MQTT-3.3.4-9", "retained QoS 1 messages over the Receive Maximum wait for the window",
        given=lambda: session(receive_max=1),
        when=lambda s, out: (_retained(s, out, ("k/a", 1), ("k/b", 1)) and None, s.retained_waiting()),
        answer=(None, True), packets=[("PUBLISH", "k/a", 1, 1, False, True)]),
    Row("MQTT-3.3.4-9", "... and go once an ack opens it",
        given=lambda: after(session(receive_max=1), lambda s: _retained(s, Out(), ("k/a", 1), ("k/b", 1))),
        when=lambda s, out: (pid_of(s.puback_received(1)), s.drain_retained(out.write, out.tally),
                             s.retained_waiting()),
        answer=(1, None, False), packets=[("PUBLISH", "k/b", 1, 2, False, True)]),
]


@pytest.mark.parametrize("row", IDS + QOS2 + FLOW + RUNS + RETAINED, ids=lambda r: r.id)
def test_outbound(row: Row) -> None:
    check(row)


def test_every_row_names_its_rules():
    for row in IDS + QOS2 + FLOW + RUNS + RETAINED:
        assert "MQTT-" in row.rules and row.answer is not ANY or row.packets is not None
