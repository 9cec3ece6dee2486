"""`SubscribeHandler` (gateway/subscriptions/subscribe_handler.py) built from nothing but the narrow callables it is
given, on the path a remote store takes when its answers are not in at once: the SUBSCRIBE asks
for its answers (`prepare`), waits on hold until they are all in, is then decided inside
`deciding` through `resume`, and a store that does not answer refuses every filter without
subscribing anything."""
from __future__ import annotations

import contextlib

from lmqtt.gateway.storage.facades import Answer

from lmqtt.gateway.mqtt import SUBACK_FAILURE_V311, ReasonCode as RC, packets as P
from lmqtt.gateway.session import MqttSession
from lmqtt.gateway.subscriptions.subscribe_handler import SubscribeHandler
from lmqtt.gateway.subscriptions.subscription_registry import Prepared


class Conn:
    """What the handler uses of an MQTTConnection, recording what it is told."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.session = MqttSession("c1")
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


class Filters:
    """The FilterRegistry facade's face: what is let go of is noted."""

    def __init__(self, events: list) -> None:
        self.events = events

    def release(self, flt: str) -> Answer[None]:
        self.events.append(("release", flt))
        return Answer.of(None)


class Registry:
    """The SubscriptionRegistry's face: `prepare` asks for the hold of "a/+" (an answer the test
    resolves) and hands out `ready`, which the test resolves too; `deciding` notes its context."""

    def __init__(self, events: list) -> None:
        self.events = events
        self.held: Answer = Answer()
        self.ready: Answer = Answer()
        self.added: list = []

    def prepare(self, s, requests, since_all, retained) -> Prepared:
        p = Prepared(Filters(self.events))
        p.registered["a/+"] = self.held
        p.ready = self.ready
        return p

    @contextlib.contextmanager
    def deciding(self, prepared: Prepared):
        self.events.append(("deciding",))
        try:
            yield prepared
        finally:
            prepared.release()
            self.events.append(("decided",))

    def add(self, s, sub) -> bool:
        self.added.append(sub)
        s.subs[sub.filter] = sub
        return False


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
    events, conn = [], Conn(5)
    registry = Registry(events)
    h = _handler(registry, events)
    h.on_subscribe(conn, _subscribe("a/+", "bad/#/x"))
    assert conn.calls == ["hold"] and conn.sent == [] and events == []      # nothing decided yet
    registry.held.set_result(1)
    assert events == []                                                     # one answer in: not yet
    registry.ready.set_result(None)
    s = conn.session
    assert [type(p) for p in conn.sent] == [P.SubAck]
    assert conn.sent[0].packet_id == 5 and conn.sent[0].reason_codes == [1, RC.TOPIC_FILTER_INVALID]
    assert [(sub.filter, sub.qos) for sub in registry.added] == [("a/+", 1)]
    # (this fake's `add` takes no hold: the one asked for is let go of when the decision ends)
    assert events == [("resume", "_decide"), ("deciding",), ("save_session", s), ("save_offsets", s),
                      ("kick", s), ("release", "a/+"), ("decided",)]
    assert conn.calls == ["hold", "release"]


def test_a_store_that_does_not_answer_refuses_every_filter_and_subscribes_nothing():
    for version, code in ((5, RC.UNSPECIFIED_ERROR), (4, SUBACK_FAILURE_V311)):
        events, conn = [], Conn(version)
        registry = Registry(events)
        _handler(registry, events).on_subscribe(conn, _subscribe("a/+", "b"))
        registry.held.set_exception(ConnectionError("link down"))
        registry.ready.set_result(None)
        ack, = conn.sent
        assert ack.reason_codes == [code, code]
        assert ack.properties.reason_string == ("store unavailable: link down" if version == 5 else None)
        assert registry.added == [] and conn.session.subs == {}
        assert events == [("resume", "_decide"), ("deciding",), ("decided",)]   # nothing held to let go
        assert conn.calls == ["hold", "release"]                              # the connection stays


def test_a_client_gone_while_the_store_answered_gets_nothing_and_its_holds_are_let_go():
    events, conn = [], Conn(5)
    registry = Registry(events)
    _handler(registry, events).on_subscribe(conn, _subscribe("a/+"))
    conn.closing = True
    registry.held.set_result(1)
    registry.ready.set_result(None)
    assert events == [("release", "a/+")]                                   # not decided: let go
    assert conn.sent == [] and registry.added == [] and conn.calls == ["hold"]
