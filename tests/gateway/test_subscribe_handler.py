"""`SubscribeHandler` (gateway/core/subscribe_handler.py) built from nothing but the narrow callables it is
given, on the remote-store path the in-process gateway never takes: the SUBSCRIBE waits on hold
for the store's read-ahead, is then decided inside the context it answers through `resume`, and a store
that does not answer refuses every filter without subscribing anything."""
from __future__ import annotations

from lmqtt.gateway.storage.facades import Answer

from lmqtt.gateway.mqtt import SUBACK_FAILURE_V311, ReasonCode as RC, packets as P
from lmqtt.gateway.model.session import Session
from lmqtt.gateway.core.subscribe_handler import SubscribeHandler


class Conn:
    """What the handler uses of an MQTTConnection, recording what it is told."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.session = Session("c1")
        self.session.version = version
        self.session.expiry_interval = 60          # persistent: the record and offsets are saved
        self.client_id = "c1"
        self.closing = False
        self.problem_info = True
        self.identity = None
        self.read_checks = None
        self.sent: list = []
        self.calls: list[str] = []

    def hold(self) -> None:
        self.calls.append("hold")

    def release(self) -> None:
        self.calls.append("release")

    def send(self, pkt) -> None:
        self.sent.append(pkt)

    def send_fitting(self, pkt) -> None:
        self.sent.append(pkt)


class Registry:
    """The SubscriptionRegistry's face: `read_ahead` hands out an answer the test resolves."""

    def __init__(self) -> None:
        self.future: Answer = Answer()
        self.added: list = []

    def read_ahead(self, s, requests, since_all):
        return self.future

    def add(self, s, sub) -> bool:
        self.added.append(sub)
        s.subs[sub.filter] = sub
        return False


class Ahead:
    """What a remote store's read-ahead answers: the context the SUBSCRIBE is decided in."""

    def __init__(self, events: list) -> None:
        self.events = events

    def __enter__(self):
        self.events.append(("using", self))

    def __exit__(self, *exc):
        self.events.append(("used", self))


def _handler(registry: Registry, events: list) -> SubscribeHandler:
    def resume(conn, fn, *args):
        events.append(("resume", fn.__name__))
        fn(*args)

    return SubscribeHandler(subscriptions=registry, retained=None, acl=None, gate=None,
                            max_subscriptions=0, save_session=lambda s: events.append(("save_session", s)),
                            save_offsets=lambda s: events.append(("save_offsets", s)),
                            kick=lambda s: events.append(("kick", s)), resume=resume)


def _subscribe(*filters: str) -> P.Subscribe:
    return P.Subscribe(5, [P.SubscriptionRequest(f, qos=1, retain_handling=2) for f in filters])


def test_a_subscribe_waits_for_the_store_then_is_decided_from_its_answers():
    events, registry, conn = [], Registry(), Conn(5)
    h = _handler(registry, events)
    h.on_subscribe(conn, _subscribe("a/+", "bad/#/x"))
    assert conn.calls == ["hold"] and conn.sent == [] and events == []      # nothing decided yet
    ahead = Ahead(events)
    registry.future.set_result(ahead)
    s = conn.session
    assert [type(p) for p in conn.sent] == [P.SubAck]
    assert conn.sent[0].packet_id == 5 and conn.sent[0].reason_codes == [1, RC.TOPIC_FILTER_INVALID]
    assert [(sub.filter, sub.qos) for sub in registry.added] == [("a/+", 1)]
    assert events == [("using", ahead), ("resume", "_subscribe"), ("save_session", s), ("save_offsets", s),
                      ("kick", s), ("used", ahead)]
    assert conn.calls == ["hold", "release"]


def test_a_store_that_does_not_answer_refuses_every_filter_and_subscribes_nothing():
    for version, code in ((5, RC.UNSPECIFIED_ERROR), (4, SUBACK_FAILURE_V311)):
        events, registry, conn = [], Registry(), Conn(version)
        _handler(registry, events).on_subscribe(conn, _subscribe("a/+", "b"))
        registry.future.set_exception(ConnectionError("link down"))
        ack, = conn.sent
        assert ack.reason_codes == [code, code]
        assert ack.properties.reason_string == ("store unavailable: link down" if version == 5 else None)
        assert registry.added == [] and conn.session.subs == {} and events == []
        assert conn.calls == ["hold", "release"]                              # the connection stays


def test_a_client_gone_while_the_store_answered_gets_nothing_and_its_reads_are_dropped():
    events, registry, conn = [], Registry(), Conn(5)
    _handler(registry, events).on_subscribe(conn, _subscribe("a/+"))
    conn.closing = True
    ahead = Ahead(events)
    registry.future.set_result(ahead)
    assert events == [("using", ahead), ("used", ahead)]                   # entered and left: dropped
    assert conn.sent == [] and registry.added == [] and conn.calls == ["hold"]
