"""Shared subscriptions balanced across the fleet, with real processes: one
`lmqtt store`, two `lmqtt gateway`s, paho members. The store hands each message of a group to one
gateway (store/node/group_assign.py), the gateway to one of its members (docs/fleet.md, "Shared
subscriptions across gateways")."""
from __future__ import annotations

import threading
import time

import pytest

from tests.support import Paho, metric, store_and_gateways

TOPIC = "fleet/shared/work"
FILTER = f"$share/workers/{TOPIC}"


@pytest.fixture
def fleet(tmp_path):
    yield from store_and_gateways(tmp_path)


def _members(gw, prefix: str, n: int, qos: int = 1) -> list[Paho]:
    out = []
    for i in range(n):
        m = Paho(gw, f"{prefix}-{i}")
        assert m.subscribe(FILTER, qos=qos) == [qos]
        out.append(m)
    return out


def _collect(members: list[Paho], until, timeout: float) -> list[list[int]]:
    """Each member's messages (as ints, in arrival order) until `until(all received)` or timeout."""
    got: list[list[int]] = [[] for _ in members]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for k, m in enumerate(members):
            got[k] += [int(x.payload) for x in m.drain(0.02)]
        if until([n for g in got for n in g]):
            break
    for k, m in enumerate(members):          # whatever else is on its way (a duplicate would show)
        got[k] += [int(x.payload) for x in m.drain(0.3)]
    return got


@pytest.mark.parametrize("qos", [1, 2])
def test_a_group_with_two_members_on_each_gateway_shares_every_message_once_and_evenly(fleet, qos):
    """Two members on A, two on B, 400 QoS 1 (200 QoS 2) messages: each message exactly once across the four,
    every member's share within 25 % of an even share, each member's messages in publish order
    (nothing was redelivered). Before (the store leased a group to ONE gateway at a time) the
    two members of the other gateway got nothing."""
    _store, a, b = fleet
    n = 400 if qos == 1 else 200
    members = _members(a, "sh-a", 2, qos) + _members(b, "sh-b", 2, qos)
    pub = Paho(a, "sh-pub")
    try:
        for i in range(n):
            pub.publish(TOPIC, b"%d" % i, qos=qos)
        got = _collect(members, lambda seen: len(seen) >= n, timeout=30)
        every = sorted(x for g in got for x in g)
        assert every == list(range(n)), f"each message once: {len(every)} received, {len(set(every))} distinct"
        shares = [len(g) for g in got]
        print(f"\nshares of {n} over 2 members on A and 2 on B: {shares}")
        even = n / len(members)
        assert all(0.75 * even <= s <= 1.25 * even for s in shares), f"shares {shares}, even {even:g}"
        for g in got:
            assert g == sorted(g), "a member gets its messages in publish order"
    finally:
        for c in (*members, pub):
            c.disconnect()


def test_kill9_of_a_gateway_mid_stream_its_unacknowledged_messages_go_to_the_other_gateways_members(fleet):
    """Two members on A, two on B, a publisher on B; A is killed (-9) mid-stream. Every message
    reaches a member (none lost): those A held unacknowledged go to B's members once A's lease at
    the store lapses. A message may arrive twice only if an A member received it before the kill
    (its PUBACK or A's acknowledgement to the store did not get through): counted and printed.
    Before (the store leased the group to ONE gateway at a time) B's members got nothing while
    A held the lease."""
    _store, a, b = fleet
    n = 1200
    on_a = _members(a, "k-a", 2)
    on_b = _members(b, "k-b", 2)
    pub = Paho(b, "k-pub")
    published = threading.Event()
    errors: list[BaseException] = []
    half = threading.Event()

    def publish() -> None:
        try:
            for i in range(n):
                pub.publish(TOPIC, b"%d" % i, qos=1, timeout=15)
                if i == n // 3:
                    half.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
        finally:
            half.set()
            published.set()

    t = threading.Thread(target=publish, daemon=True)
    t.start()
    try:
        assert half.wait(60)
        # what B's members received while both gateways took the stream
        before = [[int(x.payload) for x in m.drain(0.05)] for m in on_b]
        a.kill9()
        # what A's members received before the kill (their connections are gone with it)
        got_a = [[int(x.payload) for x in m.drain(0.5)] for m in on_a]
        for m in on_a:
            m.c.loop_stop()
        assert published.wait(60) and not errors, errors
        assert all(before), f"both of B's members took messages while A was alive: {[len(x) for x in before]}"
        had = {x for g in got_a + before for x in g}      # taken before the kill, by either side
        got_b = _collect(on_b, lambda seen: set(range(n)) <= set(seen) | had, timeout=60)
        seen_a = [x for g in got_a for x in g]
        seen_b = [x for g in before + got_b for x in g]
        assert seen_a, "A's members took messages before the kill"
        lost = set(range(n)) - set(seen_a) - set(seen_b)
        assert not lost, f"{len(lost)} messages lost, e.g. {sorted(lost)[:10]}"
        assert len(seen_b) == len(set(seen_b)), "B's members got no message twice"
        assert len(seen_a) == len(set(seen_a)), "A's members got no message twice"
        dups = set(seen_a) & set(seen_b)
        after = [x for x in seen_b if x > max(seen_a)]
        assert after, "B's members took the rest of the stream"
        print(f"\nkill -9 of gateway A: {len(seen_a)} messages on A's members, {len(seen_b)} on B's, "
              f"{len(dups)} received on both (in flight at the kill), 0 lost")
    finally:
        for c in (*on_b, pub):
            c.disconnect()


def test_a_member_that_leaves_unacknowledged_hands_its_messages_to_the_other_gateway(fleet):
    """A's only member (MQTT 5, Receive Maximum 5) never acknowledges and drops its connection:
    gateway A has no member left to give its messages to, so it hands them back to the store at
    once (not after its lease), and B's member gets every message, those included."""
    from lmqtt.gateway.mqtt import packets as MP
    from tests.support import RawMQTT
    _store, a, b = fleet
    n = 40
    mb = Paho(b, "hb-b")
    assert mb.subscribe(FILTER, qos=1) == [1]
    ra = RawMQTT(a, version=5)
    assert ra.connect("hb-a", props=MP.Properties(receive_maximum=5)).reason_code == 0
    ra.send(MP.Subscribe(1, [MP.SubscriptionRequest(FILTER, qos=1)]))
    assert isinstance(ra.recv(), MP.SubAck)
    pub = Paho(b, "hb-pub")
    try:
        held: list[int] = []
        i = 0
        while not held and i < n:              # until A's member holds some (unacknowledged)
            pub.publish(TOPIC, b"%d" % i, qos=1)
            i += 1
            try:
                pkt = ra.recv(timeout=0.2)
            except OSError:
                continue
            if isinstance(pkt, MP.Publish):
                held.append(int(pkt.payload))
        assert held, "A's member was handed a message"
        for j in range(i, n):
            pub.publish(TOPIC, b"%d" % j, qos=1)
        ra.close()                              # gone without DISCONNECT, nothing acknowledged
        got = _collect([mb], lambda seen: set(range(n)) <= set(seen), timeout=30)[0]
        assert sorted(got) == list(range(n)), f"B's member got each message once: {sorted(got)}"
        assert metric(a.metrics_url, "lmqtt_group_messages_handed_back") >= len(held)
    finally:
        for c in (mb, pub):
            c.disconnect()


@pytest.mark.parametrize("filt", [FILTER, "$share/workers/fleet/+/work"])
def test_a_persistent_sole_member_back_on_its_gateway_gets_what_was_published_while_it_was_away(fleet, filt):
    """The group's only member (a persistent MQTT 5 session) is away while 30 messages are
    published through the other gateway; the store's pop the gateway had parked is answered while
    no member is there (handed back), and on the member's return every message of the absence
    arrives, in order, once."""
    _store, a, b = fleet
    m = Paho(a, "away-1", version=5, clean=False, expiry=600, receive_maximum=4)
    assert m.subscribe(filt, qos=1) == [1]
    pub = Paho(b, "away-pub")
    try:
        for i in range(3):
            pub.publish(TOPIC, b"%d" % i, qos=1)
        assert [int(x.payload) for x in m.get_n(3, 10)] == [0, 1, 2]
        m.c.disconnect()
        m.c.loop_stop()
        for i in range(3, 33):
            pub.publish(TOPIC, b"%d" % i, qos=1)
        time.sleep(1.5)                           # past a lease tick with no member here
        m.connect()
        assert m.session_present
        got = _collect([m], lambda seen: set(range(3, 33)) <= set(seen), timeout=20)[0]
        assert got == list(range(3, 33))
    finally:
        for c in (m, pub):
            c.disconnect()
