"""A session's record is encoded once, straight from the session (`SessionPersistence.record_of`,
a reconnect storm): the same bytes as the reference (`record_reference(s).to_bytes()`: the record's
objects, then its dict, then the JSON encoder) for any session - plain and optioned
subscriptions, shared ones, exchanges in flight or not, inbound QoS 2 ids, ids written ahead, a
state restored as read, online or offline, with a fleet gateway's host or not - and its fields
(read back from those bytes) are the reference record's. What a restart reads is unchanged."""
from __future__ import annotations

import types

from hypothesis import given, settings, strategies as st

from lmqtt.gateway.clients.session_persistence import SessionPersistence, WrittenRecord
from lmqtt.gateway.session import ClientSubscription, Cursor, InFlight, MqttSession
from lmqtt.lightqueue.records import SessionRecord

_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=10)
_sub = st.tuples(_text, st.integers(0, 2), st.none() | _text, st.booleans(), st.booleans(), st.integers(0, 2),
                 st.none() | st.integers(1, 2**28))


def _persistence(host):
    return SessionPersistence(types.SimpleNamespace(sessions=None, offsets=None), session_live=lambda s: True,
                              group_live=lambda g: True, host=host)


@st.composite
def _sessions(draw):
    s = MqttSession(draw(_text))
    s.version = draw(st.sampled_from([3, 4, 5]))
    s.expiry_interval = draw(st.integers(1, 0xFFFFFFFF))
    for flt, qos, group, nl, rap, rh, sid in draw(st.lists(_sub, max_size=4)):
        queue = flt or "q"
        sub = ClientSubscription(queue if group is None else f"$share/{group}/{queue}", queue, qos, group,
                                 nl, rap, rh, sid)
        if sub.group is not None or sub.filter != sub.queue:
            s.split_direct()
        s.subs[sub.filter] = sub
        if group is None:
            s.direct[queue] = sub
            s.cursors[queue] = Cursor(draw(st.integers(0, 2**40)))
    queues = list(s.cursors)
    for pid in draw(st.lists(st.integers(1, 65535), max_size=3, unique=True)):
        q = draw(st.sampled_from(queues)) if queues and draw(st.booleans()) else None
        qos, retain = draw(st.integers(1, 2)), draw(st.booleans())
        off = draw(st.integers(0, 2**40)) if q is not None else None
        ids = tuple(draw(st.lists(st.integers(1, 2**28), min_size=1, max_size=2))) if draw(st.booleans()) else None
        state = draw(st.sampled_from([InFlight.WAIT_ACK, InFlight.WAIT_COMP]))
        s._window[pid] = InFlight.of(pid, qos, retain, q, off, None, ids, None, None, state)
    if draw(st.booleans()):
        s._in2 = set(draw(st.lists(st.integers(1, 65535), max_size=3)))
    if draw(st.booleans()):
        s.write_ahead(draw(st.integers(1, 65535)), draw(_text), draw(_text), draw(st.integers(0, 2**45)))
    if draw(st.integers(0, 9)) == 0:
        s.keep_saved({"next": {draw(_text): draw(st.integers(0, 99))}, "out": [], "pid": 7, "in2": []})
    s.next_pid = draw(st.integers(1, 65535))
    if draw(st.booleans()):
        s.disconnected_at_ms = draw(st.integers(0, 2**45))
    if draw(st.booleans()):
        s.conn = object()           # online
    return s


def _fields(rec: SessionRecord) -> tuple:
    return (rec.client_id, rec.protocol_version, rec.expiry_interval, rec.last_disconnect_ms,
            rec.subscriptions, rec.extra, rec.host)


@settings(max_examples=400, deadline=None)
@given(_sessions(), st.none() | _text, st.none() | st.integers(1, 2**45))
def test_record_bytes_are_the_reference_encoding(s, host, offline_ms):
    p = _persistence(host)
    ref = p.record_reference(s, offline_ms)
    if ref.last_disconnect_ms is not None and not s.disconnected_at_ms and offline_ms is None:
        ref.last_disconnect_ms = None       # "now" (a disconnect time of 0 is none too): taken at each call; set below
    rec = p.record_of(s, offline_ms)
    if ref.last_disconnect_ms is None and rec.last_disconnect_ms is not None:
        ref.last_disconnect_ms = rec.last_disconnect_ms
    assert rec.to_bytes() == ref.to_bytes()
    assert rec.is_stub == ref.is_stub        # asked of every record written, without decoding it
    assert _fields(rec) == _fields(ref)
    assert _fields(SessionRecord.from_bytes(rec.to_bytes())) == _fields(ref)


def test_a_storm_clients_record_takes_the_template():
    """The record of a device's usual session (plain subscriptions, nothing in flight) is encoded
    by the template, not by building the reference record."""
    s = MqttSession("dev-1")
    s.expiry_interval = 0xFFFFFFFF
    s.subs["a/+"] = ClientSubscription("a/+", "a/+", 1)
    s.cursors["a/+"] = Cursor(5)
    p = _persistence(None)
    calls = []
    p.record_reference = lambda *a: calls.append(a)
    rec = p.record_of(s, 1234)
    assert isinstance(rec, WrittenRecord) and not calls
    assert rec.to_bytes() == SessionRecord.to_bytes(_persistence(None).record_reference(s, 1234))
