"""What the restore reads of one session record's bytes (gateway/clients/session_persistence.py
`dormant_from`): records as `SessionRecord.to_bytes` writes them, from the gateway's own writes."""
from __future__ import annotations

from lmqtt.gateway.clients.session_persistence import BUILD, ENDED, Dormant, dormant_from
from lmqtt.lightqueue.records import HOST, NEVER_EXPIRES, SessionRecord, Subscription

NOW = 1_800_000_000_000


def _raw(cid="c", expiry=NEVER_EXPIRES, last=NOW - 1000, subs=(("a/+", None),), nxt=("a/+",), host=None,
         state=True) -> bytes:
    extra = {}
    if state:
        extra["inflight"] = {"out": [], "next": {q: 7 for q in nxt}, "in2": [], "pid": 1}
    if host is not None:
        extra[HOST] = host
    return SessionRecord(cid, 5, expiry, last, [Subscription(q, 1, share_group=g) for q, g in subs], extra).to_bytes()


def test_a_current_record_waits_dormant_with_its_filters_and_groups():
    cid, d, rewrite = dormant_from(_raw("dév/1", subs=(("a/+", None), ("b/#", "grp"), ("x,y:}", None)),
                                        nxt=("a/+", "x,y:}")), None, NOW)
    assert (cid, rewrite) == ("dév/1", False)
    assert isinstance(d, Dormant)
    assert d.subs == ("a/+", None, "b/#", "grp", "x,y:}", None)
    assert (d.last_ms, d.expiry) == (NOW - 1000, NEVER_EXPIRES)


def test_online_at_the_stop_is_offline_from_now_and_written_again():
    cid, d, rewrite = dormant_from(_raw(last=None), None, NOW)
    assert rewrite and d.last_ms == NOW


def test_ended_and_expired_records_are_ended():
    assert dormant_from(_raw(expiry=0), None, NOW)[1] is ENDED
    assert dormant_from(_raw(expiry=10, last=NOW - 10_000), None, NOW)[1] is ENDED
    assert isinstance(dormant_from(_raw(expiry=10, last=NOW - 9_000), None, NOW)[1], Dormant)
    assert isinstance(dormant_from(_raw(expiry=10, last=None), None, NOW)[1], Dormant)


def test_a_queue_without_its_delivery_position_is_built_at_start():
    """A record of an older version (no "next", or not for every direct subscription): its start
    would otherwise be the queue's end when its client comes back."""
    assert dormant_from(_raw(state=False), None, NOW)[1] is BUILD
    assert dormant_from(_raw(subs=(("a/+", None), ("b", None)), nxt=("a/+",)), None, NOW)[1] is BUILD
    # a shared subscription reads its group's offset, not the session's: no position needed
    assert isinstance(dormant_from(_raw(subs=(("a/+", "g"),), nxt=()), None, NOW)[1], Dormant)


def test_a_fleet_gateway_takes_its_own_records_and_those_of_no_gateway():
    assert dormant_from(_raw(host="gw-b"), "gw-a", NOW) is None
    assert isinstance(dormant_from(_raw(host="gw-a"), "gw-a", NOW)[1], Dormant)
    assert isinstance(dormant_from(_raw(host=None), "gw-a", NOW)[1], Dormant)
    assert isinstance(dormant_from(_raw(host="gw-b"), None, NOW)[1], Dormant)     # lmqtt serve: all
