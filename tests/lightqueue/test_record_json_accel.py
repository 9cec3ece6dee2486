"""A session record's JSON is made by the C encoder called directly (lightqueue/records.py
`_json_dumps`, a reconnect storm): the same bytes as `json.JSONEncoder(separators=(",", ":"),
ensure_ascii=False).encode` of the same dict (the reference), for any record; and it is the one in use."""
from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from lmqtt.lightqueue import records
from lmqtt.lightqueue.records import SessionRecord, Subscription

_REF = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)

_text = st.text(max_size=12)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=12)
_subs = st.builds(Subscription, filter=_text, qos=st.integers(0, 2), no_local=st.booleans(),
                  retain_as_published=st.booleans(), retain_handling=st.integers(0, 2),
                  subscription_id=st.none() | st.integers(1, 2**28), share_group=st.none() | _text)
_records = st.builds(SessionRecord, client_id=_text, protocol_version=st.sampled_from([3, 4, 5]),
                     expiry_interval=st.integers(0, 0xFFFFFFFF),
                     last_disconnect_ms=st.none() | st.integers(0, 2**45),
                     subscriptions=st.lists(_subs, max_size=3),
                     extra=st.dictionaries(_text, _json, max_size=3))


def _reference(rec: SessionRecord) -> bytes:
    d = {"client_id": rec.client_id, "protocol_version": rec.protocol_version,
         "expiry_interval": rec.expiry_interval, "last_disconnect_ms": rec.last_disconnect_ms,
         "subscriptions": [{"filter": s.filter, "qos": s.qos, "no_local": s.no_local,
                            "retain_as_published": s.retain_as_published, "retain_handling": s.retain_handling,
                            "subscription_id": s.subscription_id, "share_group": s.share_group}
                           for s in rec.subscriptions],
         "extra": rec.extra, "v": 1}
    return _REF.encode(d).encode("utf-8")


@settings(max_examples=300, deadline=None)
@given(_records)
def test_the_c_encoded_record_is_the_reference_bytes(rec):
    assert rec.to_bytes() == _reference(rec)


def test_the_c_encoder_is_built_and_used():
    assert records._C_ENCODE is not None
    rec = SessionRecord("c-é", 4, 0xFFFFFFFF, None, [Subscription("a/+", 1)], {"inflight": {"next": {"a/+": 3}}})
    assert records._json_dumps({"x": [1, None]}) == '{"x":[1,null]}'
    assert SessionRecord.from_bytes(rec.to_bytes()) == rec
