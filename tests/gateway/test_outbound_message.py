"""`OutboundMessage`, the gateway's message in delivery: the codec's PUBLISH template plus where
the message was read. A record dispatched to several queues is one message per queue offset,
all sharing one set of encodings (`at_offset`)."""
from __future__ import annotations

from lmqtt.gateway.mqtt import Decoder
from lmqtt.gateway.storage.record_props import RecordMeta
from lmqtt.gateway.session import OutboundMessage


def test_a_message_at_another_queue_offset_shares_its_encodings():
    rec = RecordMeta(qos=1, content_type="c")
    first = OutboundMessage("a/b", b"p" * 40, rec, 7, 1234, ("a/b", "a/+"), 99)
    data = first.encode(1, False, 5, 3)
    first.sent = True
    other = first.at_offset(12)
    assert (other.queue_offset, other.phys_offset, other.dispatch_queues, other.store_ts, other.record, other.sent) \
        == (12, 1234, ("a/b", "a/+"), 99, rec, True)
    assert first.queue_offset == 7
    assert other.encodings is first.encodings       # encoded once for both queues
    assert other.encode(1, False, 5, 3) == data
    [pkt] = Decoder(5, server_side=False).feed(other.encode(1, True, 5, 4, True))
    assert (pkt.topic, pkt.dup, pkt.retain, pkt.packet_id, pkt.properties.content_type) == ("a/b", True, True, 4, "c")


def test_resend_and_expiry_variants_of_a_record():
    """DUP redelivery and the remaining expiry come from the template: the bytes a v5 client reads
    carry the DUP flag, the packet id and the seconds left, with the record's other properties."""
    rec = RecordMeta(qos=2, message_expiry_interval=60, user_property=[("k", "v")])
    it = OutboundMessage("e/x", b"body", rec, 0, store_ts=1)
    dec = Decoder(5, server_side=False)
    [a, b] = dec.feed(it.encode_with_expiry(2, False, 9, True, 41) + it.encode_with_expiry(0, True, None, False, 40))
    assert (a.qos, a.dup, a.packet_id, a.properties.message_expiry_interval, a.properties.user_property) \
        == (2, True, 9, 41, [("k", "v")])
    assert (b.qos, b.retain, b.properties.message_expiry_interval) == (0, True, 40)
