"""A parked client's session folded (gateway/session/parked.py `fold`): its tables (subs,
direct, cursors, the in-flight window) are one subscription or a tuple of them and their offsets while its
connection is parked, made again at the first read or write of any of them. The rules: what
unfolds is what was folded (the same subscription objects, the same positions, `direct` the
`subs` dict again when it was), a session with anything in flight is not folded, and the readers
that ask every session something (counts, a shared group's choice of member) do not unfold it.
On a real `lmqtt serve` through every kind of wake: tests/net/test_park_state.py (its client's
session is folded at each park); the bytes: tests/net/test_idle_connection_memory.py."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from lmqtt.gateway.subscriptions.shared_groups import SharedGroup
from lmqtt.gateway.session import ClientSubscription, Cursor, MqttSession, ParkedSession, fold, unfold


def _session(specs) -> MqttSession:
    """A session subscribed as the subscription registry does it (`add`: `direct` split at the
    first subscription that is not plain, a cursor per direct one)."""
    s = MqttSession("dev")
    for flt, qos, group, sub_id, prefix, off in specs:
        queue = flt
        shown = f"$share/{group}/{flt}" if group else (f"$x/{flt}" if prefix else flt)
        sub = ClientSubscription(shown, queue, qos, group, subscription_id=sub_id)
        if not (sub.group is None and sub.filter == sub.queue):
            s.split_direct()
        if shown in s.subs or (group is None and queue in s.direct):
            continue
        s.subs[shown] = sub
        if group is None:
            s.direct[queue] = sub
            s.cursors[queue] = Cursor(off)
    return s


def _state(s: MqttSession):
    """Everything a reader sees; a subscription by identity, but a device's one plain subscription
    (made again at unfold) by its fields and class."""
    one = len(s.subs) == 1 and s.direct is s.subs and type(next(iter(s.subs.values()))) is ClientSubscription

    def who(sub):
        return (type(sub), sub._key()) if one else id(sub)
    return ([(f, who(sub)) for f, sub in s.subs.items()], {q: who(sub) for q, sub in s.direct.items()},
            s.direct is s.subs, {q: (c.next_offset, c._inflight) for q, c in s.cursors.items()},
            s.inflight())


spec = st.tuples(st.sampled_from(["a", "b/c", "d/+", "e/#", "f"]), st.integers(0, 2),
                 st.sampled_from([None, None, "g"]), st.sampled_from([None, None, 7]), st.booleans(),
                 st.integers(0, 2**40))


@settings(max_examples=200, deadline=None)
@given(st.lists(spec, max_size=6))
def test_a_folded_session_unfolds_to_what_it_was(specs):
    s = _session(specs)
    before = _state(s)
    assert fold(s) and s.__class__ is ParkedSession
    assert s.subscription_count() == len(before[0])
    unfold(s)
    assert s.__class__ is MqttSession and _state(s) == before
    assert fold(s)
    assert _state(s) == before          # read through the properties: unfolded by the first read
    assert s.__class__ is MqttSession


def test_one_plain_subscription_folds_to_its_filter_qos_and_offset():
    s = _session([("t/1", 2, None, None, False, 300)])
    flt = s.subs["t/1"].filter
    assert fold(s)
    assert MqttSession.subs.__get__(s) is flt and MqttSession.direct.__get__(s) == 2
    assert MqttSession.cursors.__get__(s) == 300 and MqttSession._window.__get__(s) is None
    assert s.subs == {"t/1": ClientSubscription("t/1", "t/1", 2)} and s.cursors["t/1"].next_offset == 300
    s = _session([("t/1", 1, None, 5, False, 0)])          # an option set: the object is kept
    sub = s.subs["t/1"]
    assert fold(s) and MqttSession.subs.__get__(s) == (sub,) and MqttSession.subs.__get__(s)[0] is sub


def test_every_table_unfolds_at_its_first_read_or_write():
    for touch in (lambda s: s.subs, lambda s: s.direct, lambda s: s.cursors, lambda s: s.inflight(),
                  lambda s: s._take_ids(1), lambda s: s.sub_ids_for, lambda s: s.puback_received(1),
                  lambda s: setattr(s, "_window", {}), lambda s: setattr(s, "cursors", {})):
        s = _session([("t/1", 1, None, None, False, 5)])
        assert fold(s)
        touch(s)
        if s.__class__ is ParkedSession:      # a bound method: touched when called only
            continue
        assert s.__class__ is MqttSession


def test_counts_and_a_shared_groups_question_do_not_unfold():
    s = _session([("t/1", 1, None, None, False, 5), ("t/2", 1, "g", None, False, 0)])
    assert fold(s)
    assert s.subscription_count() == 2 and SharedGroup.can_take(s) is False      # offline: no connection
    assert s.window_open() and s.window_room() == s._receive_max and s.inflight_count() == 0
    assert s.quiet() and s.plain_snapshot_pid() == 1 and s.change_mark() == (0, 1)
    assert not s.online and not s.persistent
    assert s.__class__ is ParkedSession


def test_a_session_with_anything_in_flight_is_not_folded():
    s = _session([("t/1", 1, None, None, False, 5)])
    s._window[1] = object()
    assert not fold(s) and s.__class__ is MqttSession
    s = _session([("t/1", 1, None, None, False, 5)])
    s.cursors["t/1"].hold(5, 1)
    assert not fold(s) and s.__class__ is MqttSession
    s = _session([("t/1", 1, None, None, False, 5)])
    s.cursors["other"] = Cursor(0)                 # a cursor no direct subscription explains
    assert not fold(s) and s.__class__ is MqttSession
    s = _session([("t/1", 1, None, None, False, 5)])
    s.cursors["t/1"].hold(5, 1)
    s.cursors["t/1"].release(5)                    # an empty in-flight table made: foldable
    assert fold(s)
