"""The session machine's inbound flow as tables: the client's QoS 1/2 PUBLISH (duplicates while the
store has not answered, a stored QoS 2 message sent again before PUBREL), the store's answer,
PUBREL, our Receive Maximum, the write-ahead of a persistent session's QoS 2 ids. Each row: the
state, the input, the machine's answer, the new state. Rule ids: 5.0 unless marked 3.1.1."""
from __future__ import annotations

import pytest
from lmqtt.gateway.mqtt import ReasonCode as RC
from lmqtt.gateway.session import ACCEPT, DUPLICATE, PENDING

from tests.session.support import Row, after, check, decode, raises, session




def stored(s, qos, pid):
    s.publish_received(qos, pid, 100)
    s.publish_stored(qos, pid)
    return s


def waiting(s, qos, pid):
    s.publish_received(qos, pid, 100)
    return s


INBOUND = [
    Row("MQTT-4.3.2-4; 3.1.1: MQTT-4.3.2-2", "QoS 1: a new message, its id waiting for the store",
        given=lambda: session(),
        when=lambda s, out: s.publish_received(1, 7, 100),
        answer=ACCEPT, state={"in_wait": {7}, "in2": set()}),
    Row("MQTT-4.3.2-4", "QoS 1 stored: PUBACK now (the answer says: not after a record)",
        given=lambda: waiting(session(expiry=60), 1, 7),
        when=lambda s, out: s.publish_stored(1, 7),
        answer=False, state={"in_wait": set(), "in2": set()}),
    Row("MQTT-4.3.2-5; 3.1.1: MQTT-4.3.2-2", "after its PUBACK, a PUBLISH with the same id is a new message",
        given=lambda: stored(session(), 1, 7),
        when=lambda s, out: s.publish_received(1, 7, 100),
        answer=ACCEPT, state={"in_wait": {7}}),
    Row("MQTT-4.3.2-4", "the same id again before the store answered: nothing stored twice, its ack follows",
        given=lambda: waiting(session(), 1, 7),
        when=lambda s, out: s.publish_received(1, 7, 100),
        answer=PENDING, state={"in_wait": {7}}),
    Row("MQTT-4.3.3-8; 3.1.1: MQTT-4.3.3-2", "QoS 2 stored: the id awaits PUBREL, PUBREC now",
        given=lambda: waiting(session(), 2, 9),
        when=lambda s, out: s.publish_stored(2, 9),
        answer=False, state={"in_wait": set(), "in2": {9}}),
    Row("MQTT-4.3.3-8", "a persistent session's PUBREC waits for its record to hold the id",
        given=lambda: waiting(session(expiry=60), 2, 9),
        when=lambda s, out: s.publish_stored(2, 9),
        answer=True, state={"in2": {9}}),
    Row("MQTT-4.3.3-10; 3.1.1: MQTT-4.3.3-2", "a stored QoS 2 id sent again before PUBREL: PUBREC again, not stored twice",
        given=lambda: stored(session(), 2, 9),
        when=lambda s, out: (s.publish_received(2, 9, 100), decode(s.pubrec(9)).packet_id),
        answer=(DUPLICATE, 9), state={"in_wait": set(), "in2": {9}}),
    Row("MQTT-4.3.3-11; 3.1.1: MQTT-4.3.3-2", "PUBREL: PUBCOMP with the same id, the id forgotten",
        given=lambda: stored(session(), 2, 9),
        when=lambda s, out: (lambda r: (decode(r[0]).packet_id, decode(r[0]).reason_code, r[1]))(s.pubrel_received(9)),
        answer=(9, 0, False), state={"in2": set()}),
    Row("MQTT-4.3.3-11", "a persistent session's PUBCOMP waits for its record to forget the id",
        given=lambda: stored(session(expiry=60), 2, 9),
        when=lambda s, out: s.pubrel_received(9)[1],
        answer=True),
    Row("MQTT-4.3.3-12; 3.1.1: MQTT-4.3.3-2", "after PUBCOMP, a PUBLISH with that id is a new message",
        given=lambda: after(stored(session(), 2, 9), lambda s: s.pubrel_received(9)),
        when=lambda s, out: s.publish_received(2, 9, 100),
        answer=ACCEPT, state={"in_wait": {9}, "in2": set()}),
    Row("MQTT-2.2.1-5", "PUBREL for an id not stored: PUBCOMP 0x92 (Packet Identifier not found)",
        given=lambda: session(),
        when=lambda s, out: decode(s.pubrel_received(5)[0]).reason_code,
        answer=RC.PACKET_IDENTIFIER_NOT_FOUND),
    Row("3.1.1: MQTT-4.3.3-2", "PUBREL for an id not stored, MQTT 3.1.1: PUBCOMP (no reason codes)",
        given=lambda: session(version=4),
        when=lambda s, out: decode(s.pubrel_received(5)[0], 4).packet_id,
        answer=5, version=4),
    Row("MQTT-4.3.3-9", "not stored (PUBREC with a failure code): a PUBLISH with that id is a new message",
        given=lambda: after(waiting(session(), 2, 9), lambda s: s.publish_failed(9)),
        when=lambda s, out: s.publish_received(2, 9, 100),
        answer=ACCEPT, state={"in_wait": {9}, "in2": set()}),
    Row("MQTT-3.3.4-7", "more QoS 1/2 PUBLISHes unacknowledged than our Receive Maximum: DISCONNECT 0x93",
        given=lambda: stored(waiting(session(), 1, 1), 2, 2),
        when=lambda s, out: (raises(lambda: s.publish_received(1, 3, 3)), raises(lambda: s.publish_received(1, 4, 3))),
        answer=(None, RC.RECEIVE_MAXIMUM_EXCEEDED), state={"in_wait": {1, 3}, "in2": {2}}),
    Row("3.1.1: MQTT-4.3.2-2", "MQTT 3.1.1 has no Receive Maximum",
        given=lambda: waiting(waiting(session(version=4), 1, 1), 1, 2),
        when=lambda s, out: s.publish_received(1, 3, 1),
        answer=ACCEPT, state={"in_wait": {1, 2, 3}}, version=4),
    Row("3.1.1: MQTT-3.3.5-2, MQTT-4.3.3-2", "a QoS 2 PUBLISH the ACL refused (3.1.1): acknowledged, its PUBREL answered",
        given=lambda: session(version=4),
        when=lambda s, out: (s.publish_refused_stored(4), decode(s.pubrel_received(4)[0], 4).packet_id),
        answer=(None, 4), state={"in2": set()}, version=4),
    Row("MQTT-4.3.3-10", "a persistent session's new QoS 2 id is written ahead with its key, until stored",
        given=lambda: waiting(session(expiry=60), 2, 9),
        when=lambda s, out: (s.write_ahead(9, "t/x", "k1", 5), s.snapshot()["in2p"], s.publish_stored(2, 9),
                             "in2p" in s.snapshot(), s.snapshot()["in2"]),
        answer=(None, [[9, "t/x", "k1", 5]], True, False, [9])),
    Row("MQTT-4.3.3-9", "written ahead, then the append failed: the id no longer waits, the PUBLISH "
        "sent again is appended with the same key (one record per key at the store)",
        given=lambda: waiting(session(expiry=60), 2, 9),
        when=lambda s, out: (s.write_ahead(9, "t/x", "k1", 5), s.publish_failed(9), s.written_ahead(9),
                             s.publish_received(2, 9, 100)),
        answer=(None, None, ("t/x", "k1", 5), ACCEPT), state={"in_wait": {9}, "in2": set()}),
    Row("MQTT-4.3.3-9", "a record's pending id (its message not found in the log) is restored with its key",
        given=lambda: session(expiry=60),
        when=lambda s, out: (s.restore({"in2p": [[9, "t/x", "k1", 5]], "in2": [4]}, lambda q, o: None),
                             s.written_ahead(9), s.snapshot()["in2p"], s.publish_received(2, 9, 100)),
        answer=(0, ("t/x", "k1", 5), [[9, "t/x", "k1", 5]], ACCEPT), state={"in_wait": {9}, "in2": {4}}),
    Row("MQTT-4.3.3-9", "a restored session's inbound QoS 2 ids, stored and written ahead with their keys, "
        "read for the log line of its restore",
        given=lambda: session(expiry=60),
        when=lambda s, out: (s.restore({"in2p": [[9, "t/x", "k1", 5]], "in2": [4, 2]}, lambda q, o: None),
                             s.exchanges_text()),
        answer=(0, "out=[] in2=[2, 4] in2_ahead=['9:k1']")),
]


@pytest.mark.parametrize("row", INBOUND, ids=lambda r: r.id)
def test_inbound(row: Row) -> None:
    check(row)
