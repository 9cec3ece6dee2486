"""The compact state of an idle subscribed client (memory per idle connection): what the
gateway keeps per device is shared or folded where it repeats, with the same behaviour.

- a session whose subscriptions are all plain (not shared, filter = queue) reads `direct` from its
  `subs` dict itself (gateway/session/machine.py, kept by subscriptions/subscription_registry.py);
- a queue with one online reader holds it in a 1-tuple, not a set (gateway/delivery/engine.py);
- equal keep-alive values are one int object (gateway/net/connection.py).
The end-to-end figure is tests/net/test_idle_connection_memory.py's budget."""
from __future__ import annotations

from types import SimpleNamespace

from lmqtt.gateway.delivery.engine import DeliveryEngine
from lmqtt.gateway.session import MqttSession
from lmqtt.gateway.net.connection import MQTTConnection
from tests.gateway.test_subscription_registry import _registry, _sub


def _check(s: MqttSession) -> None:
    """`direct` holds exactly the non-shared subscriptions by queue; it is `subs` itself iff all are plain."""
    assert s.direct == {sub.queue: sub for sub in s.subs.values() if sub.group is None}
    plain = all(sub.group is None and sub.filter == sub.queue for sub in s.subs.values())
    assert (s.direct is s.subs) == plain


def test_direct_is_the_subs_dict_while_every_subscription_is_plain():
    reg, _store = _registry()
    s = MqttSession("dev")
    assert s.direct is s.subs
    reg.add(s, _sub("d/1"))
    reg.add(s, _sub("d/2"))
    _check(s)
    assert s.direct is s.subs and set(s.cursors) == {"d/1", "d/2"}
    reg.add(s, _sub("d/1", "g"))              # shared on the same queue: `direct` splits off
    _check(s)
    assert set(s.direct) == {"d/1", "d/2"} and len(s.subs) == 3
    reg.add(s, _sub("d/3"))                   # a plain one while split: in both
    _check(s)
    reg.remove(s, s.subs["$share/g/d/1"])     # the last shared one gone: joined again
    _check(s)
    assert s.direct is s.subs
    reg.remove(s, s.subs["d/2"])
    _check(s)
    assert set(s.direct) == {"d/1", "d/3"} and set(s.cursors) == {"d/1", "d/3"}
    reg.restore(s, _sub("r/+", "g"), {})    # a restored shared one splits too
    _check(s)
    reg.remove_all(s)
    _check(s)
    assert s.subs == {} and s.direct is s.subs and s.cursors == {}


def test_a_queue_with_one_reader_holds_the_session_itself():
    dropped: list[str] = []
    eng = SimpleNamespace(direct={}, groups={}, sys_queues=set(), drop_recent=dropped.append)
    a, b = MqttSession("a"), MqttSession("b")
    DeliveryEngine.add_reader(eng, a, "q")
    DeliveryEngine.add_reader(eng, a, "q")          # twice: still one reader
    assert eng.direct == {"q": a} and eng.direct["q"] is a and list(eng.direct["q"]) == [a]
    DeliveryEngine.add_reader(eng, b, "q")
    assert isinstance(eng.direct["q"], set) and eng.direct["q"] == {a, b}
    DeliveryEngine.remove_reader(eng, a, "q")
    assert eng.direct["q"] is b and dropped == []
    DeliveryEngine.remove_reader(eng, a, "q")       # not a reader: nothing changes
    DeliveryEngine.remove_reader(eng, a, "other")
    assert eng.direct["q"] is b and [s for s in eng.direct["q"]] == [b] and dropped == []
    DeliveryEngine.remove_reader(eng, b, "q")
    assert eng.direct == {} and dropped == ["q"]
    assert [s for s in eng.direct.get("q", ())] == []


def test_equal_keep_alives_are_one_int_object():
    handler = SimpleNamespace(cfg=SimpleNamespace(max_packet_size=1 << 20), metrics=None, writes=None,
                              loop=SimpleNamespace(time=lambda: 0.0))
    c1, c2 = MQTTConnection(handler), MQTTConnection(handler)
    c1.keepalive = int("600")
    c2.keepalive = int("600")                       # a distinct int object, as each CONNECT decodes
    assert c1.keepalive == c2.keepalive == 600
    assert c1._keepalive is c2._keepalive


def test_a_session_keeps_its_rare_state_out_of_line_until_it_is_used():
    s = MqttSession("dev")
    assert (s.expiry_handle, s.disconnected_at_ms, s.dropped_expired, s.dropped_too_large, s._saved,
            s._in_keys) == (None, None, 0, 0, None, None)
    s.expiry_handle = None                          # defaults written back: still nothing made
    s._saved = None
    s.dropped_expired = 0
    assert s._rare is None
    s.dropped_too_large += 1
    s.disconnected_at_ms = 1234
    s.write_ahead(7, "t", "k", 1)
    assert s._rare is not None
    assert (s.dropped_too_large, s.disconnected_at_ms, s._in_keys) == (1, 1234, {7: ("t", "k", 1)})
    s.disconnected_at_ms = None
    assert s.disconnected_at_ms is None and s.dropped_expired == 0


def test_a_connection_reads_its_handlers_parts_and_keeps_an_ipv4_peer_as_one_int():
    handler = SimpleNamespace(cfg=SimpleNamespace(max_packet_size=1 << 20), metrics=object(), writes=object(),
                              loop=SimpleNamespace(time=lambda: 0.0))
    c = MQTTConnection(handler)
    assert (c.cfg, c.metrics, c.loop, c.writes) == (handler.cfg, handler.metrics, handler.loop, handler.writes)
    assert c.peer == "?"
    c._set_peer(("10.1.2.3", 65535))
    assert c.peer == "10.1.2.3:65535" and type(c._peer) is int
    c._set_peer(("::1", 5, 0, 0))
    assert c.peer == "::1:5"
    c._set_peer(None)
    assert c.peer == "?"


def test_a_connection_makes_its_rare_fields_only_when_one_leaves_its_default():
    handler = SimpleNamespace(cfg=SimpleNamespace(max_packet_size=1 << 20), metrics=None, writes=None,
                              loop=SimpleNamespace(time=lambda: 0.0))
    c = MQTTConnection(handler)
    assert (c.refusal, c._holds, c.auth_method, c._rate_timer) == (None, 0, None, None)
    assert getattr(c, "fleet_attached_ms", 0) == 0
    c._holds = 0
    c.refusal = None
    assert c._rare is None
    c._holds += 1                                   # `hold`: made now
    c.auth_method = "SCRAM-SHA-256"
    assert c._rare is not None and c._holds == 1
    c._holds -= 1
    assert c._holds == 0 and c._rare is not None    # the method is still set
    c.auth_method = None
    assert c._rare is None                          # all back at their defaults: dropped
    c.fleet_attached_ms = 5
    assert c.fleet_attached_ms == 5 and c._rare is None
    # a topic alias (the session's, per connection): the new (empty, then filled) map is kept, not
    # mistaken for the shared empty default
    from lmqtt.gateway.session import MqttSession
    d = MqttSession("d")
    assert d.resolve_alias("a/b", 3, 10) == "a/b"
    assert d.resolve_alias("", 3, 10) == "a/b" and d._rare is not None
    assert MqttSession("e")._aliases_in == {}


def test_a_cursor_makes_its_in_flight_table_when_it_first_holds_an_offset():
    from lmqtt.gateway.session import Cursor
    c = Cursor(5)
    c.release(3)
    assert c._inflight is None and c.committed() == 5 and not c.busy()
    c.hold(7, 1)
    c.hold(9, 2)
    assert c.committed() == 7 and c.busy() and c.holds(9) and c.held() == {7: 1, 9: 2}
    c.release(7)
    assert c.committed() == 9
    c.release(9)
    assert c.committed() == 5 and not c.busy()


def test_a_plain_subscription_keeps_three_fields_and_one_with_options_keeps_them_all():
    import sys
    from lmqtt.gateway.session import ClientSubscription
    plain = ClientSubscription("d/1", "d/1", 1)
    assert sys.getsizeof(plain) <= 64          # a 64-byte block (was 96 with eight slots)
    assert (plain.group, plain.no_local, plain.retain_as_published, plain.retain_handling,
            plain.subscription_id) == (None, False, False, 0, None)
    full = ClientSubscription("$share/g/d/1", "d/1", 2, "g", True, True, 2, 9)
    assert (full.filter, full.queue, full.qos, full.group, full.no_local, full.retain_as_published,
            full.retain_handling, full.subscription_id) == ("$share/g/d/1", "d/1", 2, "g", True, True, 2, 9)
    for kw in ({"no_local": True}, {"retain_as_published": True}, {"retain_handling": 1},
               {"subscription_id": 3}, {"group": "g"}):
        one = ClientSubscription("d/1", "d/1", 1, **kw)
        assert [getattr(one, k) for k in kw] == list(kw.values())
        assert one != plain
    assert plain == ClientSubscription("d/1", "d/1", 1) and plain != ClientSubscription("d/1", "d/1", 0)
    assert full == ClientSubscription("$share/g/d/1", "d/1", 2, "g", True, True, 2, 9)


def test_parked_connections_share_their_last_receive_time_never_earlier_than_it_was():
    from lmqtt.gateway.net.connection_parking import _parked_rx_time
    base = 1_000_000.0
    times = [base + i * 0.013 for i in range(40)]       # a park wave over half a second
    shared = [_parked_rx_time(t) for t in times]
    for t, v in zip(times, shared):
        assert t <= v <= t + 0.1 + 1e-9                 # a keep alive may end late, never early
    assert len({id(v) for v in shared}) <= 6            # one float per tenth of a second, not 40
    assert _parked_rx_time(base + 5.0) >= base + 5.0    # a later ping moves it on
