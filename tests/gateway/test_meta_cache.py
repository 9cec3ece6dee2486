"""record_props.MetaCache: the one props-decode cache of the delivery engine, the retained-message
sender and the fleet's shared groups."""
from __future__ import annotations

from lmqtt.gateway.storage.record_props import MetaCache, RecordMeta, encode


def test_each_distinct_props_value_is_decoded_once_foreign_ones_as_plain_qos0_and_it_stays_bounded():
    cache = MetaCache()
    b = encode(1, True, "pub-1")
    rec = cache[b]
    assert (rec.qos, rec.retain, rec.client_id) == (1, True, "pub-1")
    assert cache[b] is rec and cache.get(b) is rec          # decoded once, shared after
    assert cache.get(encode(2, False, "other")) is None      # .get only looks
    assert cache[b"\xff\x00garbage"] == RecordMeta()         # not ours: QoS 0, no properties
    for i in range(5000):
        cache[encode(0, False, f"c{i}")]
    assert 0 < len(cache) <= 4096
