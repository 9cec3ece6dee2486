"""The session machine and the client's limits, as tables: topic aliases both ways, the client's
Maximum Packet Size, message expiry at delivery. Each row: the state, the input, the machine's
answer, the packets it wrote, the new state. Rule ids: MQTT 5.0 (3.1.1 has none of these)."""
from __future__ import annotations

import pytest
from lmqtt.gateway.mqtt import ReasonCode as RC
from lmqtt.gateway.session import EXPIRED, TOO_LARGE

from tests.session.support import NOW_MS, Out, Row, after, check, msg, offered, raises, sent, session


def aliases(out: Out) -> list[tuple]:
    """(topic as sent, topic alias) of each PUBLISH written."""
    return [(p.topic, p.properties.topic_alias) for p in out.packets()]


def offer_topics(*topics, q="t/#"):
    """Offer one message per topic, in order (a QoS 0 subscription: nothing waits for a window)."""
    return offered(*[msg(t, qos=0, off=i) for i, t in enumerate(topics)], q=q)




ALIASES = [
    Row("MQTT-3.1.2-26, MQTT-3.3.2-11, MQTT-3.3.2-8", "outbound aliases: 1..Topic Alias Maximum, never 0; the least "
        "recently used one is re-mapped with its topic",
        given=lambda: session(subs=[("t/#", 0)], alias_max=2),
        when=lambda s, out: (offer_topics("t/a", "t/a", "t/b", "t/c", "t/a")(s, out), aliases(out)),
        answer=(0, [("t/a", 1), ("", 1), ("t/b", 2), ("t/c", 1), ("t/a", 2)])),
    Row("MQTT-3.1.2-27", "no Topic Alias Maximum from the client: no alias sent",
        given=lambda: session(subs=[("t/#", 0)]),
        when=lambda s, out: (offer_topics("t/a", "t/a")(s, out), aliases(out)),
        answer=(0, [("t/a", None), ("t/a", None)])),
    Row("MQTT-3.1.2-26", "the server's own cap on aliases applies too (topic_alias_maximum)",
        given=lambda: after(session(subs=[("t/#", 0)]), lambda s: s.connect(5, None, None, 10, 1, 100)),
        when=lambda s, out: (offer_topics("t/a", "t/b")(s, out), aliases(out)),
        answer=(0, [("t/a", 1), ("t/b", 1)])),
    Row("MQTT-3.3.2-7", "a new network connection forgets the outbound aliases",
        given=lambda: after(session(subs=[("t/#", 0)], alias_max=2), lambda s: offer_topics("t/a")(s, Out()),
                            lambda s: s.connect(5, None, None, 2, 100, 100)),
        when=lambda s, out: (offered(msg("t/a", qos=0, off=1))(s, out), aliases(out)),
        answer=(0, [("t/a", 1)])),
    Row("MQTT-3.3.2-12", "inbound: an alias set with its topic, then used with an empty topic",
        given=lambda: session(),
        when=lambda s, out: (s.resolve_alias("in/a", 3, 10), s.resolve_alias("", 3, 10), s.resolve_alias("in/b", 3, 10),
                             s.resolve_alias("", 3, 10)),
        answer=("in/a", "in/a", "in/b", "in/b")),
    Row("MQTT-3.3.2-8", "inbound alias 0: DISCONNECT 0x94 (Topic Alias invalid)",
        given=lambda: session(),
        when=lambda s, out: raises(lambda: s.resolve_alias("in/a", 0, 10)),
        answer=RC.TOPIC_ALIAS_INVALID),
    Row("MQTT-3.3.2-9, MQTT-3.2.2-17", "inbound alias above our Topic Alias Maximum: DISCONNECT 0x94",
        given=lambda: session(),
        when=lambda s, out: raises(lambda: s.resolve_alias("in/a", 11, 10)),
        answer=RC.TOPIC_ALIAS_INVALID),
    Row("MQTT-3.3.2-12", "an alias never set, with an empty topic: protocol error",
        given=lambda: session(),
        when=lambda s, out: raises(lambda: s.resolve_alias("", 4, 10)),
        answer=RC.PROTOCOL_ERROR),
    Row("MQTT-3.3.2-7", "a new network connection forgets the inbound aliases",
        given=lambda: after(session(), lambda s: s.resolve_alias("in/a", 3, 10),
                            lambda s: s.connect(5, None, None, 0, 100, 100)),
        when=lambda s, out: (raises(lambda: s.resolve_alias("", 3, 10)), s._rare),
        answer=(RC.PROTOCOL_ERROR, None)),
]

MAX_PACKET = [
    Row("MQTT-3.1.2-24, MQTT-3.1.2-25", "a PUBLISH over the client's Maximum Packet Size is dropped for it, counted, "
        "its id not used",
        given=lambda: session(max_packet=40),
        when=lambda s, out: (offered(msg(payload=b"x" * 60, off=0), msg(off=1))(s, out), s.dropped_too_large,
                             out.tally.drops),
        answer=(0, 1, {TOO_LARGE: 1}), packets=[("PUBLISH", "t/1", 1, 1, False, False)],
        state={"cursors": {"t/#": (2, {1: 1})}}),
    Row("MQTT-3.1.2-24", "a PUBLISH exactly at the limit is sent",
        given=lambda: session(subs=[("t/#", 0)], max_packet=len(msg(qos=0).encode(0, False, 5))),
        when=offered(msg(qos=0)),
        answer=0, packets=[("PUBLISH", "t/1", 0, None, False, False)]),
    Row("MQTT-3.1.2-25, MQTT-3.3.2-11", "a dropped PUBLISH sets no alias: the next one of its topic carries the topic",
        given=lambda: session(subs=[("t/#", 0)], max_packet=40, alias_max=2),
        when=lambda s, out: (offered(msg("t/a", b"x" * 60, qos=0, off=0), msg("t/a", qos=0, off=1))(s, out),
                             aliases(out)),
        answer=(0, [("t/a", 1)])),
    Row("MQTT-3.1.2-25", "a message in flight too large for the new connection's limit: dropped at the resend",
        given=lambda: after(sent(session(), msg(payload=b"x" * 60)), lambda s: s.connect(5, None, 40, None, 0, 100)),
        when=lambda s, out: ([i.pid for i in s.resume(out.write, out.tally, NOW_MS)], s.dropped_too_large),
        answer=([1], 1), packets=[], state={"window": [], "cursors": {"t/#": (1, {})}}),
]

EXPIRY = [
    Row("MQTT-3.3.2-5", "a message whose Message Expiry Interval passed before delivery: not sent, counted",
        given=lambda: session(),
        when=lambda s, out: (offered(msg(expiry=2, store_ts=NOW_MS - 2000, off=0), msg(off=1))(s, out),
                             s.dropped_expired, out.tally.drops),
        answer=(0, 1, {EXPIRED: 1}), packets=[("PUBLISH", "t/1", 1, 1, False, False)],
        state={"cursors": {"t/#": (2, {1: 1})}}),
    Row("MQTT-3.3.2-6", "the PUBLISH carries the interval less the whole seconds the message waited",
        given=lambda: session(),
        when=lambda s, out: (offered(msg(expiry=10, store_ts=NOW_MS - 2500))(s, out),
                             out.packets()[0].properties.message_expiry_interval),
        answer=(0, 8)),
    Row("3.1.1: MQTT-4.5.0-1", "MQTT 3.1.1 has no Message Expiry Interval in PUBLISH: the message goes as it is",
        given=lambda: session(version=4),
        when=offered(msg(expiry=10, store_ts=NOW_MS - 2500)),
        answer=0, packets=[("PUBLISH", "t/1", 1, 1, False, False)], version=4),
    Row("MQTT-4.3.3-7", "no expiry once a PUBLISH has been sent: the resend goes, with at least 1 second",
        given=lambda: sent(session(subs=[("t/#", 2)]), msg(qos=2, expiry=2)),
        when=lambda s, out: (s.resume(out.write, out.tally, NOW_MS + 5000),
                             out.packets()[0].properties.message_expiry_interval),
        answer=([], 1), packets=[("PUBLISH", "t/1", 2, 1, True, False)]),
]


@pytest.mark.parametrize("row", ALIASES + MAX_PACKET + EXPIRY, ids=lambda r: r.id)
def test_limits(row: Row) -> None:
    check(row)
