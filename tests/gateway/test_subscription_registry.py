"""`SubscriptionRegistry` (gateway/subscriptions/subscription_registry.py) as the single owner of this gateway's filter
registrations with the store, built on a recording fake store: every register/release the store
sees, including those of a fleet gateway reloading a session (gateway/fleet/sessions.py), goes through
the registry's own counts."""
from __future__ import annotations

import time
from types import SimpleNamespace

from lmqtt.gateway.fleet.sessions import FleetSessionRegistry
from lmqtt.gateway.clients.session_persistence import SessionPersistence
from lmqtt.gateway.session import ClientSubscription, MqttSession
from lmqtt.gateway.subscriptions.subscription_registry import SubscriptionRegistry
from lmqtt.gateway.storage.facades import Answer
from lmqtt.lightqueue.records import SessionRecord, Subscription as SubscriptionRecord


class Metadata:
    """The storage facades' face (storage/facades.py): offsets and session records written, nothing
    read back but offsets."""
    gateway_id = "gw-test"

    def __init__(self, store) -> None:
        self.offsets = _Offsets()
        self.sessions = _Sessions()
        self.wills = _Wills()
        self.filters = _Filters(store.calls)
        self.queues = store


class _Offsets:
    def __init__(self) -> None:
        self.kept: dict = {}

    def set(self, consumer, offsets) -> Answer[None]:
        self.kept.setdefault(consumer, {}).update(offsets)
        return Answer.of(None)

    def get(self, consumer, queue) -> Answer[int | None]:
        return Answer.of(self.kept.get(consumer, {}).get(queue))

    def delete(self, consumer, queues) -> Answer[None]:
        for q in queues:
            self.kept.get(consumer, {}).pop(q, None)
        return Answer.of(None)


class _Sessions:
    def put(self, cid, rec) -> Answer[None]:
        return Answer.of(None)

    def delete(self, cid) -> Answer[bool]:
        return Answer.of(True)

    def on_sessions_swept(self, fn) -> None: ...
    def on_sessions_moved(self, fn) -> None: ...


class _Filters:
    """The FilterRegistry facade, recording what it is asked for."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def register(self, f: str) -> Answer[int]:
        self.calls.append(("register", f))
        return Answer.of(1)

    def release(self, f: str) -> Answer[None]:
        self.calls.append(("release", f))
        return Answer.of(None)


class _Wills:
    def on_wills_published(self, fn) -> None: ...


class Store:
    """A QueueStore; its bundle's filters facade records the registrations it is asked for."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.metadata = Metadata(self)        # the Storage bundle, this as its queues

    def start_offset(self, q: str) -> Answer[int]:
        return Answer.of(0)

    def max_offset(self, q: str) -> Answer[int]:
        return Answer.of(0)


class Delivery:
    """The DeliveryEngine's face: readers and groups are only noted."""

    def __init__(self) -> None:
        self.histories: dict = {}

    def add_reader(self, s, q) -> None: ...
    def remove_reader(self, s, q) -> None: ...
    def add_group(self, g) -> None: ...
    def remove_group(self, g) -> None: ...
    def kick_queue(self, q) -> None: ...


def _registry(host=None):
    store = Store()
    persist = SessionPersistence(store.metadata, session_live=lambda s: True, group_live=lambda g: True,
                                 host=host)
    return SubscriptionRegistry(store.metadata, Delivery(), persist), store


def _sub(flt: str, group: str | None = None) -> ClientSubscription:
    return ClientSubscription(f"$share/{group}/{flt}" if group else flt, flt, 1, group)


def test_one_registration_per_filter_however_many_local_users():
    reg, store = _registry()
    a, b = MqttSession("a"), MqttSession("b")
    reg.add(a, _sub("w/+"))
    reg.add(b, _sub("w/+", "g"))
    reg.add(b, _sub("plain"))                     # not a wildcard: nothing to register
    assert store.calls == [("register", "w/+")]
    assert reg.unheld(["w/+", "x/#", "x/#", "plain"]) == ["x/#"]
    reg.remove_all(a)
    assert store.calls == [("register", "w/+")]   # the group still reads it
    reg.remove_all(b)
    assert store.calls == [("register", "w/+"), ("release", "w/+")]
    assert reg.unheld(["w/+"]) == ["w/+"]


def test_a_session_restored_while_running_holds_the_filters_only_it_uses():
    reg, store = _registry()
    other = MqttSession("other")
    reg.add(other, _sub("held/+"))
    store.calls.clear()
    s = MqttSession("back")
    for sub in (_sub("p/+"), _sub("p/+", "g"), _sub("held/+"), _sub("exact/t")):
        reg.restore(s, sub, {})
    assert store.calls == []                      # restore counts, it does not register
    reg.hold_restored(s)
    # one registration for the direct and the shared subscription on p/+; held/+ already is
    assert store.calls == [("register", "p/+")]
    reg.remove_all(s)
    assert store.calls == [("register", "p/+"), ("release", "p/+")]


def test_a_fleet_reload_registers_a_filter_new_here_even_with_two_subscriptions_on_it():
    """A session coming back from another gateway with a direct and a shared subscription on one
    wildcard filter: this gateway must hold the filter in the store, else the other gateway's
    release (its copy dropped) leaves nobody holding it and the filter stops being indexed."""
    reg, store = _registry(host="gw-test")
    metadata = store.metadata
    metrics = SimpleNamespace(sessions=SimpleNamespace(set_function=lambda fn: None))
    fleet = FleetSessionRegistry(None, metrics, metadata, reg.persist, reg, publish=None)
    rec = SessionRecord("moved", 5, 3600, int(time.time() * 1000),
                        [SubscriptionRecord("p/+", 1), SubscriptionRecord("p/+", 1, share_group="g")])
    fleet._reload("moved", rec, {})
    assert set(fleet.sessions["moved"].subs) == {"p/+", "$share/g/p/+"}
    assert store.calls == [("register", "p/+")]


def test_a_fleet_reload_the_store_refuses_to_hold_leaves_nothing_counted_and_holds_nothing():
    """The store refuses the hold of a session coming back (a full disk there): the CONNECT fails,
    and this gateway keeps no copy counting as a user of its filters. Kept, the copy would make the
    next reload skip the registration (its filter counted as held here), and the store would drop
    the filter, queue and all, when the gateway the client left lets go of it."""
    from lmqtt.store import protocol as W
    from lmqtt.store.client.errors import DiskFull

    reg, store = _registry(host="gw-test")
    refused = {"q/+"}
    register = reg.filters.register

    def register_or_refuse(f: str) -> Answer[int]:
        if f in refused:
            store.calls.append(("refused", f))
            return Answer.failed(DiskFull(W.E_DISK_FULL, "disk full: cannot write the SDK metadata"))
        return register(f)
    reg.filters.register = register_or_refuse
    metrics = SimpleNamespace(sessions=SimpleNamespace(set_function=lambda fn: None))
    fleet = FleetSessionRegistry(None, metrics, store.metadata, reg.persist, reg, publish=None)
    rec = SessionRecord("moved", 5, 3600, int(time.time() * 1000),
                        [SubscriptionRecord("a/+", 1), SubscriptionRecord("q/+", 1),
                         SubscriptionRecord("q/+", 1, share_group="g")])
    try:
        fleet._reload("moved", rec, {})
    except DiskFull:
        pass
    else:
        raise AssertionError("the refused hold did not fail the reload")
    assert "moved" not in fleet.sessions
    # a/+ was held for it before q/+ was refused: let go again
    assert store.calls == [("register", "a/+"), ("refused", "q/+"), ("release", "a/+")]
    assert reg.unheld(["a/+", "q/+"]) == ["a/+", "q/+"] and not reg.groups
    refused.clear()                                   # space is back: the client's next CONNECT
    store.calls.clear()
    fleet._reload("moved", rec, {})
    assert set(fleet.sessions["moved"].subs) == {"a/+", "q/+", "$share/g/q/+"}
    assert store.calls == [("register", "a/+"), ("register", "q/+")]


def test_a_decision_inside_another_leaves_the_outer_its_own_prepared_answers():
    """A SUBSCRIBE decided while another is being decided: once the inner decision ends, the
    outer one still takes the holds it prepared (no second registration of its filter), and each
    lets go only of what it prepared and nothing took."""
    reg, store = _registry()
    a, b = MqttSession("a"), MqttSession("b")
    req = lambda f: SimpleNamespace(topic_filter=f, retain_handling=2)  # noqa: E731
    outer = reg.prepare(a, [req("w/+")])
    inner = reg.prepare(b, [req("x/+"), req("y/+")])
    assert store.calls == [("register", "w/+"), ("register", "x/+"), ("register", "y/+")]
    with reg.deciding(outer):
        with reg.deciding(inner):
            reg.add(b, _sub("x/+"))               # y/+ refused, say: its hold is let go of
        assert store.calls[-1] == ("release", "y/+")
        reg.add(a, _sub("w/+"))
    assert store.calls == [("register", "w/+"), ("register", "x/+"), ("register", "y/+"), ("release", "y/+")]
    assert reg.unheld(["w/+", "x/+", "y/+"]) == ["y/+"]
