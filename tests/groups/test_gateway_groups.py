"""`lmqtt gateway` over two store groups (docs/groups.md "The gateway"): two real `lmqtt store`
processes (each a group of one), a gateway with `--store 'A;B'`, paho clients. Each first-level
topic's messages are stored in the group that owns it, and every MQTT feature that lives in a
topic's or a filter's group follows it: live and persistent subscriptions, retained messages,
wills, shared subscriptions; a filter whose first level is a wildcard reads one queue per group
(a shared one: a shared group per group); a kill -9 of one group's store leaves the other's topics flowing
and loses nothing acknowledged."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.parse
import urllib.request

import pytest

from lmqtt.gateway.storage.grouped_metadata import home_group
from lmqtt.store.client import connect
from lmqtt.store.client.groups import rendezvous
from tests.support import LmqttGateway, Paho, metric


@pytest.fixture(scope="module")
def deployment(two, tmp_path_factory):
    a, b = two
    gw = LmqttGateway(f"{a.address};{b.address}", log_path=str(tmp_path_factory.mktemp("gw") / "gw.log")).start()
    try:
        yield a, b, gw
    finally:
        gw.stop()


def _first_levels(a, b, prefix: str) -> tuple[str, str]:
    """A first-level topic that is new and goes to each group (rendezvous over the groups' names:
    a store without --group is named by its address)."""
    names = [a.address, b.address]
    return tuple(next(f"{prefix}{k}" for k in range(10_000) if rendezvous(f"{prefix}{k}", names) == i)
                 for i in (0, 1))


def _stored(store, topic: str) -> list[bytes]:
    """The bodies of `topic`'s queue in one store (read from that store alone), in order."""
    c = connect(store.address)
    try:
        return [r.body for r in c.pull(topic, 0, 0, 1000).records]
    finally:
        c.close()


def test_each_topic_is_stored_and_delivered_through_the_group_that_owns_it(deployment):
    a, b, gw = deployment
    ta, tb = _first_levels(a, b, "dev")
    sub = Paho(gw, "g-sub")
    assert sub.subscribe(f"{ta}/+/temp", 1) == [1] and sub.subscribe(f"{tb}/#", 1) == [1]
    pub = Paho(gw, "g-pub")
    for i in range(20):
        pub.publish(f"{ta}/s{i % 3}/temp", b"a%d" % i, qos=1)
        pub.publish(f"{tb}/s{i % 3}/temp", b"b%d" % i, qos=1)
    got = sorted(m.payload for m in sub.get_n(40))
    assert got == sorted([b"a%d" % i for i in range(20)] + [b"b%d" % i for i in range(20)])
    # written once, in the owning group only (a store's queue of a topic is its first level's)
    assert _stored(a, ta) == [b"a%d" % i for i in range(20)] and _stored(b, ta) == []
    assert _stored(b, tb) == [b"b%d" % i for i in range(20)] and _stored(a, tb) == []


def _collect(client, topics: tuple[str, ...], n: int, timeout: float = 20.0) -> list:
    """The next `n` messages `client` receives on topics under `topics` (others ignored)."""
    deadline = time.monotonic() + timeout
    out: list = []
    while len(out) < n and time.monotonic() < deadline:
        out += [m for m in client.drain(0.1) if m.topic.split("/", 1)[0] in topics]
    return out


def test_a_filter_whose_first_level_is_a_wildcard_reads_every_group(deployment):
    """`#` and `+/state` match topics of both groups: one queue per group behind the one
    subscription - live, retained and persistent (offline, then resumed) - each group's topics
    in their order; unsubscribed, nothing more comes."""
    a, b, gw = deployment
    ta, tb = _first_levels(a, b, "wild")
    pub = Paho(gw, "g-wild-pub")
    pub.publish(f"{ta}/state", b"ra", qos=1, retain=True)
    pub.publish(f"{tb}/state", b"rb", qos=1, retain=True)
    live = Paho(gw, "g-wild-live", version=5)
    assert live.subscribe("+/state", 1) == [1]
    assert sorted(m.payload for m in _collect(live, (ta, tb), 2)) == [b"ra", b"rb"]   # both groups' retained
    away = Paho(gw, "g-wild-away", clean=False)
    assert away.subscribe("#", 2) == [2]
    assert sorted(m.payload for m in _collect(away, (ta, tb), 2)) == [b"ra", b"rb"]
    away.disconnect()
    for i in range(10):
        pub.publish(f"{ta}/state", b"a%d" % i, qos=1)
        pub.publish(f"{tb}/state", b"b%d" % i, qos=2)
    for c in (live, Paho(gw, "g-wild-away", clean=False)):
        got = [m.payload for m in _collect(c, (ta, tb), 20)]
        assert [p for p in got if p[:1] == b"a"] == [b"a%d" % i for i in range(10)]
        assert [p for p in got if p[:1] == b"b"] == [b"b%d" % i for i in range(10)]
        assert _collect(c, (ta, tb), 1, timeout=0.5) == []          # each once
    assert live.unsubscribe("+/state") is not None
    pub.publish(f"{tb}/state", b"after", qos=1)
    assert _collect(live, (ta, tb), 1, timeout=1.0) == []


def test_overlapping_subscriptions_across_groups_deliver_each_message_once_at_the_highest_qos(deployment):
    """`#` (QoS 1) and a topic of each group (QoS 2): a message is in the topic's queue and in its
    group's part of `#`; the session gets it once, at QoS 2 (MQTT-3.3.5-1's "maximum QoS")."""
    a, b, gw = deployment
    ta, tb = _first_levels(a, b, "over")
    c = Paho(gw, "g-over")
    assert c.subscribe("#", 1) == [1]
    assert c.subscribe(f"{ta}/x", 2) == [2] and c.subscribe(f"{tb}/x", 2) == [2]
    pub = Paho(gw, "g-over-pub")
    for i in range(10):
        pub.publish(f"{ta}/x", b"a%d" % i, qos=2)
        pub.publish(f"{tb}/x", b"b%d" % i, qos=2)
    got = _collect(c, (ta, tb), 20)
    got += _collect(c, (ta, tb), 1, timeout=1.0)
    assert sorted(m.payload for m in got) == sorted([b"a%d" % i for i in range(10)] + [b"b%d" % i for i in range(10)])
    assert {m.qos for m in got} == {2}


@pytest.mark.parametrize("flt, qos", [("+/r", 2), ("$share/sg/+/r", 1)], ids=["direct", "shared"])
def test_a_persistent_wildcard_session_resumes_every_groups_position_after_a_gateway_kill9(two, tmp_path, flt, qos):
    """The session's position in each group (its offset there, its QoS 2 exchanges; shared: the
    offset of its share group's part in each group) comes back after a kill -9 of its gateway:
    what was published before and after, once each, each group's in order."""
    a, b = two
    ta, tb = _first_levels(a, b, "resume" if qos == 2 else "sres")
    gw = LmqttGateway(f"{a.address};{b.address}", log_path=str(tmp_path / "gw.log")).start()
    try:
        s = Paho(gw, f"g-res-{qos}", clean=False)
        assert s.subscribe(flt, qos) == [qos]
        s.disconnect()
        pub = Paho(gw, "g-res-pub")
        for i in range(5):
            pub.publish(f"{ta}/r", b"a%d" % i, qos=1)
            pub.publish(f"{tb}/r", b"b%d" % i, qos=1)
        pub.disconnect()
        gw.kill9()
        gw.start()
        pub = Paho(gw, "g-res-pub")
        for i in range(5, 10):
            pub.publish(f"{ta}/r", b"a%d" % i, qos=1)
            pub.publish(f"{tb}/r", b"b%d" % i, qos=1)
        s = Paho(gw, f"g-res-{qos}", clean=False)
        got = [m.payload for m in _collect(s, (ta, tb), 20)]
        assert [p for p in got if p[:1] == b"a"] == [b"a%d" % i for i in range(10)], gw.log_tail()
        assert [p for p in got if p[:1] == b"b"] == [b"b%d" % i for i in range(10)], gw.log_tail()
        assert _collect(s, (ta, tb), 1, timeout=0.5) == []
    finally:
        gw.stop()


@pytest.mark.parametrize("version", [4, 5])
def test_a_replay_of_a_filter_whose_first_level_is_a_wildcard_reads_each_groups_history_then_goes_live(
        deployment, version):
    """Subscribing from the past to `+/rp4` (`+/rp5`) over two groups (`$replay/{ms}/` for MQTT 3.1.1, the
    `since` user property for MQTT 5): each group's part reads its history from the log (the
    filter was not held before, so no light queue holds it) and goes live at its own seam: every
    message of both groups since that time, each group's in order, then the live ones, once."""
    a, b, gw = deployment
    ta, tb = _first_levels(a, b, f"rp{version}x")
    leaf = f"rp{version}"
    pub = Paho(gw, f"g-rp-pub{version}")
    pub.publish(f"{ta}/{leaf}", b"old", qos=1)                   # before the replay's time: not sent
    pub.publish(f"{tb}/{leaf}", b"old", qos=1)
    time.sleep(0.05)
    since = int(time.time() * 1000)
    time.sleep(0.05)
    for i in range(5):
        pub.publish(f"{ta}/{leaf}", b"a%d" % i, qos=1)
        pub.publish(f"{tb}/{leaf}", b"b%d" % i, qos=1)
    r = Paho(gw, f"g-rp{version}", version=version)
    if version == 5:
        assert r.subscribe(f"+/{leaf}", 1, since=since) == [1]
    else:
        assert r.subscribe(f"$replay/{since}/+/{leaf}", 1) == [1]
    got = [m.payload for m in _collect(r, (ta, tb), 10)]
    for i in range(5, 8):
        pub.publish(f"{ta}/{leaf}", b"a%d" % i, qos=1)
        pub.publish(f"{tb}/{leaf}", b"b%d" % i, qos=1)
    got += [m.payload for m in _collect(r, (ta, tb), 6)]
    assert [p for p in got if p[:1] == b"a"] == [b"a%d" % i for i in range(8)], got
    assert [p for p in got if p[:1] == b"b"] == [b"b%d" % i for i in range(8)], got
    assert b"old" not in got and _collect(r, (ta, tb), 1, timeout=0.5) == []


def test_a_shared_filter_whose_first_level_is_a_wildcard_hands_each_groups_messages_to_one_member(deployment):
    """`$share/g/+/job` over two groups: a shared group per store group behind the one
    subscription; every message of both groups reaches exactly one member (MQTT 5 and 3.1.1
    members), a member gone leaves the rest to the other."""
    a, b, gw = deployment
    ta, tb = _first_levels(a, b, "shw")
    m1, m2 = Paho(gw, "g-sw1", version=5), Paho(gw, "g-sw2")
    assert m1.subscribe("$share/sw/+/job", 1) == [1] and m2.subscribe("$share/sw/+/job", 1) == [1]
    pub = Paho(gw, "g-sw-pub")
    sent = []
    for i in range(20):
        for t in (ta, tb):
            pub.publish(f"{t}/job", b"%s-%d" % (t.encode(), i), qos=1)
            sent.append(b"%s-%d" % (t.encode(), i))
    got1: list[bytes] = []
    got2: list[bytes] = []
    deadline = time.monotonic() + 20
    while len(got1) + len(got2) < len(sent) and time.monotonic() < deadline:
        got1 += [m.payload for m in m1.drain(0.1) if m.topic in (f"{ta}/job", f"{tb}/job")]
        got2 += [m.payload for m in m2.drain(0.1) if m.topic in (f"{ta}/job", f"{tb}/job")]
    assert sorted(got1 + got2) == sorted(sent)                  # each once, from both groups
    assert got1 and got2                                        # handed round the members
    m1.disconnect()
    later = [b"%s-late%d" % (t.encode(), i) for i in range(5) for t in (ta, tb)]
    for i in range(5):
        for t in (ta, tb):
            pub.publish(f"{t}/job", b"%s-late%d" % (t.encode(), i), qos=1)
    assert sorted(m.payload for m in _collect(m2, (ta, tb), len(later))) == sorted(later)
    assert not m2.drain(0.5)


def test_members_of_one_wildcard_share_on_two_gateways_get_each_groups_messages_once(deployment, tmp_path):
    """`$share/two/+/w` with a member on each of two gateways over the same two groups: each
    group's store hands each message of its part to one gateway, so every message of both
    groups reaches one member."""
    a, b, gw = deployment
    ta, tb = _first_levels(a, b, "two")
    gw2 = LmqttGateway(f"{a.address};{b.address}", log_path=str(tmp_path / "gw2.log")).start()
    try:
        m1, m2 = Paho(gw, "g-two1"), Paho(gw2, "g-two2")
        assert m1.subscribe("$share/two/+/w", 1) == [1] and m2.subscribe("$share/two/+/w", 1) == [1]
        pub = Paho(gw, "g-two-pub")
        sent = [b"%s-%d" % (t.encode(), i) for i in range(30) for t in (ta, tb)]
        for i in range(30):
            for t in (ta, tb):
                pub.publish(f"{t}/w", b"%s-%d" % (t.encode(), i), qos=1)
        got: list[bytes] = []
        deadline = time.monotonic() + 20
        while len(got) < len(sent) and time.monotonic() < deadline:
            got += [m.payload for c in (m1, m2) for m in c.drain(0.1) if m.topic in (f"{ta}/w", f"{tb}/w")]
        got += [m.payload for c in (m1, m2) for m in c.drain(0.5) if m.topic in (f"{ta}/w", f"{tb}/w")]
        assert sorted(got) == sorted(sent), (gw.log_tail(), gw2.log_tail())
    finally:
        gw2.stop()


def test_persistent_sessions_retained_messages_wills_and_shared_groups_follow_their_groups(deployment):
    a, b, gw = deployment
    ta, tb = _first_levels(a, b, "site")
    # a persistent session subscribed in both groups gets what was published while it was away
    p = Paho(gw, "g-persist", clean=False)
    assert p.subscribe(f"{ta}/#", 1) == [1] and p.subscribe(f"{tb}/#", 1) == [1]
    p.disconnect()
    pub = Paho(gw, "g-pub2")
    pub.publish(f"{ta}/x", b"away-a", qos=1)
    pub.publish(f"{tb}/x", b"away-b", qos=1)
    p = Paho(gw, "g-persist", clean=False)
    assert sorted(m.payload for m in p.get_n(2)) == [b"away-a", b"away-b"]
    # retained messages, each in its topic's group
    pub.publish(f"{ta}/state", b"ra", qos=1, retain=True)
    pub.publish(f"{tb}/state", b"rb", qos=1, retain=True)
    r = Paho(gw, "g-ret")
    r.subscribe(f"{ta}/state", 1)
    r.subscribe(f"{tb}/state", 1)
    assert sorted(m.payload for m in r.get_n(2)) == [b"ra", b"rb"]
    # a will on a topic of the second group, published when its client vanishes
    w = Paho(gw, "g-watch")
    w.subscribe(f"{tb}/will", 1)
    dying = Paho(gw, "g-dying", will=(f"{tb}/will", b"gone", 1, False), keepalive=2)
    dying.c._sock.close()                  # no DISCONNECT: the will goes out
    assert [m.payload for m in w.get_n(1, timeout=15)] == [b"gone"]
    # a shared subscription of a topic in the second group: every message to one member
    m1, m2 = Paho(gw, "g-m1"), Paho(gw, "g-m2")
    assert m1.subscribe(f"$share/grp/{tb}/jobs", 1) == [1] and m2.subscribe(f"$share/grp/{tb}/jobs", 1) == [1]
    for i in range(30):
        pub.publish(f"{tb}/jobs", b"j%d" % i, qos=1)
    deadline = time.monotonic() + 20
    got: list[bytes] = []
    while len(got) < 30 and time.monotonic() < deadline:
        got += [m.payload for m in m1.drain(0.1) + m2.drain(0.1)]
    assert sorted(got) == sorted(b"j%d" % i for i in range(30))


def _session_ids(store, prefix: str) -> set[str]:
    """The client ids (starting with `prefix`) whose session records one store holds."""
    c = connect(store.address)
    try:
        return {r["client_id"] for r in c.cmd("sessions", limit=10_000)["sessions"]
                if r["client_id"].startswith(prefix)}
    finally:
        c.close()


def test_session_records_are_spread_by_client_id_and_one_written_before_a_group_was_added_is_found(
        deployment, tmp_path):
    """Persistent sessions' records live in the group their client id hashes to (`home_group`),
    each listed by the console with its group. A record written when the deployment had one
    group (by a gateway over the first group alone) stays there although its client id now
    hashes to the second: the client resumes it through the gateway of both groups, with what was
    published while it was away, its record is written again where it was, and a clean start
    ends it."""
    a, b, gw = deployment
    ta, _tb = _first_levels(a, b, "sess")
    ids = [f"spread-{k}" for k in range(40)]
    want = {i: {c for c in ids if home_group(c, 2) == i} for i in (0, 1)}
    for cid in ids:
        p = Paho(gw, cid, clean=False)
        assert p.subscribe(f"{ta}/s", 1) == [1]
        p.disconnect()
    assert _session_ids(a, "spread-") == want[0] and _session_ids(b, "spread-") == want[1]
    assert want[0] and want[1]
    listed = {r["client_id"]: r["store_group"] for r in _console(gw, "sessions")["sessions"]
              if r["client_id"].startswith("spread-")}
    assert listed == {c: (a.address if c in want[0] else b.address) for c in ids}

    cid = next(f"early-{k}" for k in range(1000) if home_group(f"early-{k}", 2) == 1)
    one = LmqttGateway(a.address, log_path=str(tmp_path / "gw-one-group.log")).start()
    try:
        p = Paho(one, cid, clean=False)
        assert p.subscribe(f"{ta}/s", 1) == [1]
        p.disconnect()
    finally:
        assert one.stop() == 0, one.log_tail()
    assert cid in _session_ids(a, "early-") and cid not in _session_ids(b, "early-")
    pub = Paho(gw, "sess-pub")
    pub.publish(f"{ta}/s", b"while-away", qos=1)
    p = Paho(gw, cid, clean=False)
    assert p.session_present
    assert [m.payload for m in p.get_n(1)] == [b"while-away"]
    p.disconnect()
    assert cid in _session_ids(a, "early-") and cid not in _session_ids(b, "early-")
    Paho(gw, cid, clean=True).disconnect()
    assert cid not in _session_ids(a, "early-") | _session_ids(b, "early-")


def test_a_session_whose_record_is_in_the_second_group_is_taken_over_by_another_gateway(deployment, tmp_path):
    """Claims over two groups: a client whose record lives in the second group (its client id's
    home) connects to a second gateway while its connection to the first is open. The claim goes
    to the record's group, which relays it to the first gateway: that gateway closes the old
    connection (0x8E), and the session resumes on the second gateway with what is published to
    topics of either group."""
    a, b, gw = deployment
    ta, tb = _first_levels(a, b, "tko")
    cid = next(f"tko-{k}" for k in range(1000) if home_group(f"tko-{k}", 2) == 1)
    first = Paho(gw, cid, version=5, clean=False, expiry=600)
    assert first.subscribe(f"{ta}/t", 1) == [1] and first.subscribe(f"{tb}/t", 1) == [1]
    gw2 = LmqttGateway(f"{a.address};{b.address}", log_path=str(tmp_path / "gw2.log")).start()
    try:
        second = Paho(gw2, cid, version=5, clean=False, expiry=600)
        assert second.session_present
        rc = first.disconnects.get(timeout=10)
        first.c.loop_stop()                      # no reconnect of its own: the session moved
        assert int(getattr(rc, "value", rc)) == 0x8E
        assert metric(gw.metrics_url, "lmqtt_takeovers_by_other_gateway_total") >= 1
        pub = Paho(gw, "tko-pub")
        pub.publish(f"{ta}/t", b"to-a", qos=1)
        pub.publish(f"{tb}/t", b"to-b", qos=1)
        assert sorted(m.payload for m in _collect(second, (ta, tb), 2)) == [b"to-a", b"to-b"]
        assert _session_ids(b, "tko-") == {cid} and not _session_ids(a, "tko-")
        second.disconnect()
        pub.disconnect()
    finally:
        assert gw2.stop() == 0, gw2.log_tail()


def test_a_kill9_of_one_groups_store_leaves_the_other_flowing_and_loses_nothing(deployment):
    a, b, gw = deployment
    ta, tb = _first_levels(a, b, "plant")
    sub = Paho(gw, "g-k-sub", clean=False)
    assert sub.subscribe(f"{ta}/#", 1) == [1] and sub.subscribe(f"{tb}/#", 1) == [1]
    pub = Paho(gw, "g-k-pub")
    pub.publish(f"{ta}/m", b"a-before", qos=1)
    pub.publish(f"{tb}/m", b"b-before", qos=1)
    assert sorted(m.payload for m in sub.get_n(2)) == [b"a-before", b"b-before"]
    b.kill9()
    pub.publish(f"{ta}/m", b"a-while", qos=1)          # group A goes on while B is down
    assert [m.payload for m in sub.get_n(1)] == [b"a-while"]
    late = Paho(gw, "g-k-late")                          # and a client connecting meanwhile is served
    assert late.subscribe(f"{ta}/late", 1) == [1]
    pub.publish(f"{ta}/late", b"a-late", qos=1)
    assert [m.payload for m in late.get_n(1)] == [b"a-late"]
    b.start()
    deadline = time.monotonic() + 30
    while True:                                          # B back: the gateway reconnects to it
        try:
            pub.publish(f"{tb}/m", b"b-after", qos=1, timeout=5)
            break
        except AssertionError:
            assert time.monotonic() < deadline, gw.log_tail()
    got: set[bytes] = set()
    deadline = time.monotonic() + 20
    while b"b-after" not in got and time.monotonic() < deadline:
        got |= {m.payload for m in sub.drain(0.1)}
    assert b"b-after" in got, (got, gw.log_tail())
    assert _stored(b, tb) == [b"b-before", b"b-after"] and _stored(a, ta) == [b"a-before", b"a-while", b"a-late"]


def test_pubacks_keep_the_publish_order_across_groups_and_new_topics(deployment):
    """One client's QoS 1 PUBLISHes to topics of both groups, new first levels among them (each
    waits for its claim), sent without waiting: the PUBACKs come back in the order sent
    (MQTT-4.6.0-2) though each group answers on its own."""
    from lmqtt.gateway.mqtt import packets as P
    from tests.support import RawMQTT

    a, b, gw = deployment
    names = [a.address, b.address]
    raw = RawMQTT(gw)
    assert raw.connect("g-order").reason_code == 0
    topics = [f"ord{k}/x" for k in range(12)]           # new first levels, spread over both groups
    assert {rendezvous(t.split("/")[0], names) for t in topics} == {0, 1}
    pids = list(range(1, 121))
    for pid in pids:
        raw.send(P.Publish(topics[pid % len(topics)], b"%d" % pid, 1, packet_id=pid))
    acks = []
    while len(acks) < len(pids):
        pkt = raw.recv(10)
        assert pkt is not None, f"closed after {len(acks)} acks"
        acks.append(pkt.packet_id)
    assert acks == pids
    # the first group slow (stopped a moment), the second quick: the second's PUBACK still waits
    ta, tb = _first_levels(a, b, "ord")
    raw.send(P.Publish(f"{ta}/x", b"warm", 1, packet_id=200))
    raw.send(P.Publish(f"{tb}/x", b"warm", 1, packet_id=201))
    assert [raw.recv(10).packet_id for _ in range(2)] == [200, 201]
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        raw.send(P.Publish(f"{ta}/x", b"slow", 1, packet_id=202))
        time.sleep(0.3)
        raw.send(P.Publish(f"{tb}/x", b"quick", 1, packet_id=203))
        time.sleep(0.5)                                  # the second group has answered by now
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    assert [raw.recv(10).packet_id for _ in range(2)] == [202, 203]


def _console(gw, path: str) -> dict:
    """A console API answer of the gateway (loopback: no login)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{gw.metrics_port}/console/api/{path}", timeout=20) as r:
        return json.loads(r.read())


def _traced(gw, flt: str, want: int, timeout: float = 20.0) -> list[dict]:
    """The tracer's messages of `flt` from the start of the log, until `want` of them came."""
    q = urllib.parse.urlencode({"filter": flt, "since": 0})
    got: list[dict] = []
    with urllib.request.urlopen(f"http://127.0.0.1:{gw.metrics_port}/console/api/trace?{q}", timeout=timeout) as r:
        deadline = time.monotonic() + timeout
        while len(got) < want and time.monotonic() < deadline:
            line = r.readline()
            if line.startswith(b"data: "):
                got += json.loads(line[6:])
    return got


def test_the_console_shows_every_store_group(deployment):
    """The console of a gateway over two groups: each group's store (its name, where, log end),
    the topics of both, an SDK consumer group's position in each, and a trace of `#` reading
    both groups' messages."""
    a, b, gw = deployment
    ta, tb = _first_levels(a, b, "con")
    pub = Paho(gw, "g-con-pub")
    for i in range(3):
        pub.publish(f"{ta}/x", b"ca%d" % i, qos=1)
        pub.publish(f"{tb}/x", b"cb%d" % i, qos=1)
    c = connect(f"{a.address};{b.address}")
    try:
        f = c.filter_consumer("+/x", group="con-g", start="earliest")
        recs: list = []
        for _ in range(20):
            recs += [r for r in f.poll() if r.topic in (f"{ta}/x", f"{tb}/x")]
            if len(recs) >= 6:
                break
        assert len(recs) == 6
        f.commit()
    finally:
        c.close()

    store = _console(gw, "overview")["store"]
    groups = store["groups"]
    assert [g["where"] for g in groups] == [f"lmqtt://{a.address}", f"lmqtt://{b.address}"]
    assert [g["group"] for g in groups] == [a.address, b.address]      # no --group: named by address
    assert all(g["error"] is None and g["stats"]["max_offset"] > 0 for g in groups)

    topics = {t["topic"] for t in _console(gw, "topics")["topics"]}
    assert {ta, tb} <= topics

    grp = next(g for g in _console(gw, "groups")["groups"] if g["group"] == "con-g")
    assert {r["store_group"] for r in grp["queues"]} == {a.address, b.address}
    assert grp["lag"] == 0

    traced = [m for m in _traced(gw, "+/x", 6) if m["topic"] in (f"{ta}/x", f"{tb}/x")]
    assert sorted(m["payload"] for m in traced) == sorted(["ca0", "ca1", "ca2", "cb0", "cb1", "cb2"])
