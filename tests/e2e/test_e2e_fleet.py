"""The scale-out shape with real processes: one `lmqtt store`, several `lmqtt gateway`s
(docs/fleet.md). A client on one gateway must get what a client on another publishes, for every
QoS, through wildcards, retained messages and a persistent session that moves between gateways;
events are hints, so deliveries survive a gateway that hears none (poll mode), a store restart and
a Redis that dies."""
from __future__ import annotations

import shutil
import time
import urllib.error
import urllib.request

import pytest

from tests.support import LmqttGateway, LmqttStore, Paho, RawMQTT, fleet_of, free_port, metric, store_and_gateways


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """One store and two gateways (A, B) with native EVENT notify, shared by the module's tests
    (each test uses its own topics and client ids)."""
    yield from store_and_gateways(tmp_path_factory.mktemp("fleet"))


@pytest.mark.parametrize("qos", [0, 1, 2])
def test_publish_on_a_is_delivered_on_b(fleet, qos):
    _store, a, b = fleet
    sub = Paho(b, f"fleet-sub-q{qos}")
    pub = Paho(a, f"fleet-pub-q{qos}")
    try:
        sub.subscribe(f"fleet/q{qos}", qos=qos)
        sent = [f"m{i}".encode() for i in range(20)]
        for p in sent:
            pub.publish(f"fleet/q{qos}", p, qos=qos)
        got = sub.get_n(20, timeout=10)
        assert [m.payload for m in got] == sent
        assert all(m.qos == qos for m in got)
        assert sub.drain(0.3) == []          # exactly once each, no duplicates
    finally:
        sub.disconnect()
        pub.disconnect()


def test_wildcards_across_gateways(fleet):
    _store, a, b = fleet
    plus = Paho(b, "fleet-plus")
    hash_ = Paho(a, "fleet-hash")            # also a subscriber on the publisher's own gateway
    pub = Paho(a, "fleet-wpub")
    try:
        plus.subscribe("wild/+/temp", qos=1)
        hash_.subscribe("wild/#", qos=1)
        pub.publish("wild/k1/temp", b"1", qos=1)
        pub.publish("wild/k2/humidity", b"2", qos=1)
        pub.publish("wild/k3/temp", b"3", qos=1)
        assert sorted((m.topic, m.payload) for m in plus.get_n(2)) == [("wild/k1/temp", b"1"), ("wild/k3/temp", b"3")]
        assert sorted(m.payload for m in hash_.get_n(3)) == [b"1", b"2", b"3"]
        assert plus.drain(0.3) == [] and hash_.drain(0.1) == []
    finally:
        for c in (plus, hash_, pub):
            c.disconnect()


def test_retained_set_on_a_is_served_on_b_and_cleared(fleet):
    _store, a, b = fleet
    pub = Paho(a, "fleet-rpub")
    try:
        pub.publish("ret/room1", b"21C", qos=1, retain=True)
        s1 = Paho(b, "fleet-rsub1")
        s1.subscribe("ret/+", qos=1)
        m = s1.get(5)
        assert (m.topic, m.payload, m.retain) == ("ret/room1", b"21C", True)
        s1.disconnect()
        pub.publish("ret/room1", b"", qos=1, retain=True)        # clears it
        s2 = Paho(b, "fleet-rsub2")
        s2.subscribe("ret/+", qos=1)
        assert s2.drain(0.5) == []
        s2.disconnect()
    finally:
        pub.disconnect()


def test_a_shared_group_split_over_a_and_b_gets_each_message_once(fleet):
    """Members of one `$share/` group on both gateways: each message goes to exactly one member
    of the fleet (the store hands each to one gateway), and when one gateway's members leave, the
    other gateway's members get what follows."""
    _store, a, b = fleet
    sa = Paho(a, "fleet-sh-a")
    sb = Paho(b, "fleet-sh-b")
    pub = Paho(a, "fleet-sh-pub")
    try:
        sa.subscribe("$share/g/fleet/sh", qos=1)
        sb.subscribe("$share/g/fleet/sh", qos=1)
        for i in range(40):
            pub.publish("fleet/sh", b"%d" % i, qos=1)
        got = []
        deadline = time.monotonic() + 15
        while len(got) < 40 and time.monotonic() < deadline:
            got += [(c, int(m.payload)) for c in ("a", "b") for m in (sa, sb)[c == "b"].drain(0.1)]
        assert sorted(n for _c, n in got) == list(range(40)), "each message once across the fleet"
        holder, other = (sa, sb) if got[0][0] == "a" else (sb, sa)
        holder.disconnect()                       # the deliverer's gateway has no member left
        for i in range(40, 60):
            pub.publish("fleet/sh", b"%d" % i, qos=1)
        rest = other.get_n(20, timeout=15)        # the other gateway takes the lease over
        assert sorted(int(m.payload) for m in rest) == list(range(40, 60))
        # the store handed messages of the group to each gateway (/metrics)
        assert metric(a.metrics_url, "lmqtt_group_messages_assigned") >= 1
        assert metric(b.metrics_url, "lmqtt_group_messages_assigned") >= 1
    finally:
        for c in (sa, sb, pub):
            c.disconnect()

def test_persistent_session_leaves_a_and_resumes_on_b_with_every_message(fleet):
    _store, a, b = fleet
    c = Paho(a, "fleet-mover", clean=False)
    c.subscribe("move/#", qos=1)
    c.publish("move/x", b"before", qos=1)
    assert c.get(5).payload == b"before"
    c.disconnect()
    pub = Paho(a, "fleet-mpub")
    sent = [f"offline-{i}".encode() for i in range(30)]
    for p in sent:
        pub.publish("move/x", p, qos=1)
    pub.disconnect()
    c2 = Paho(b, "fleet-mover", clean=False)                  # the same client id, on gateway B
    try:
        assert c2.session_present, "gateway B must resume the session gateway A kept"
        got = c2.get_n(len(sent), timeout=10)
        assert [m.payload for m in got] == sent
        # live delivery continues on B (its subscription came with the session)
        pub2 = Paho(a, "fleet-mpub2")
        pub2.publish("move/y", b"after", qos=1)
        assert c2.get(5).payload == b"after"
        pub2.disconnect()
    finally:
        c2.disconnect()


def test_one_store_pull_per_event_however_many_local_subscribers(fleet):
    """The mirror: ten sessions on B reading one queue cost B one remote pull per new batch, not ten."""
    _store, a, b = fleet
    subs = [Paho(b, f"fleet-fan{i}") for i in range(10)]
    pub = Paho(a, "fleet-fanpub")
    try:
        for s in subs:
            s.subscribe("fan/t", qos=1)
        before = metric(b.metrics_url, "lmqtt_remote_pulls")
        n = 20
        for i in range(n):
            pub.publish("fan/t", str(i).encode(), qos=1)
        for s in subs:
            assert [m.payload for m in s.get_n(n)] == [str(i).encode() for i in range(n)]
        pulls = metric(b.metrics_url, "lmqtt_remote_pulls") - before
        # at most one pull per publish (events may merge several into one), never one per session
        assert 1 <= pulls <= n, pulls
    finally:
        for s in subs:
            s.disconnect()
        pub.disconnect()


def test_health_endpoints_follow_the_store(tmp_path):
    store = LmqttStore(str(tmp_path / "store"), log_path=str(tmp_path / "store.log")).start()
    gw = LmqttGateway(store.address, ("--safety-poll-ms", "200"), log_dir=str(tmp_path)).start()
    base = f"http://{gw.host}:{gw.metrics_port}"
    try:
        assert urllib.request.urlopen(base + "/healthz", timeout=5).status == 200
        assert urllib.request.urlopen(base + "/readyz", timeout=5).status == 200
        store.stop()
        deadline = time.monotonic() + 5
        code = 200
        while time.monotonic() < deadline and code == 200:
            try:
                code = urllib.request.urlopen(base + "/readyz", timeout=5).status
            except urllib.error.HTTPError as e:
                code = e.code
            time.sleep(0.05)
        assert code == 503, "a gateway without its store must not be ready"
        assert urllib.request.urlopen(base + "/healthz", timeout=5).status == 200
        # no store, no session to offer: CONNECT is refused with "server unavailable" and the
        # reason, never answered with an empty session that would later overwrite the stored one
        raw = RawMQTT(gw, version=5)
        ack = raw.connect("health-persist", clean=False)
        assert ack.reason_code == 0x88
        assert store.address in (ack.properties.reason_string or "")
        raw.close()
        # the store comes back on the same port: the gateway reconnects and serves again
        store.start()
        deadline = time.monotonic() + 10
        while True:               # refused (0x88) until the gateway has re-dialled
            try:
                sub = Paho(gw, "health-sub")
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert urllib.request.urlopen(base + "/readyz", timeout=5).status == 200
        sub.subscribe("back/t", qos=1)
        pub = Paho(gw, "health-pub")
        pub.publish("back/t", b"again", qos=1)
        assert sub.get(5).payload == b"again"
        sub.disconnect()
        pub.disconnect()
    finally:
        assert gw.stop() == 0, gw.log_tail()
        store.stop()


def test_without_events_the_safety_poll_still_delivers(fleet, tmp_path):
    """A gateway that hears no event at all (--notify-mode poll) delivers within its poll interval:
    a lost event delays a delivery, never loses it."""
    store, a, _b = fleet
    c = LmqttGateway(store.address, ("--notify-mode", "poll", "--safety-poll-ms", "200"),
                     log_dir=str(tmp_path)).start()
    try:
        sub = Paho(c, "poll-sub")
        sub.subscribe("poll/+", qos=1)
        pub = Paho(a, "poll-pub")
        for i in range(5):
            pub.publish(f"poll/{i}", str(i).encode(), qos=1)
        assert sorted(m.payload for m in sub.get_n(5, timeout=10)) == [b"0", b"1", b"2", b"3", b"4"]
        assert metric(c.metrics_url, "lmqtt_remote_events") == 0
        assert metric(c.metrics_url, "lmqtt_remote_safety_polls") >= 1
        sub.disconnect()
        pub.disconnect()
    finally:
        assert c.stop() == 0, c.log_tail()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
@pytest.mark.parametrize("mode", ["broadcast", "precise"])
def test_redis_notify_and_a_dead_redis(tmp_path, mode):
    """Store publishes events to a real redis-server, gateways hear them there (every event, or
    only those of queues they registered); after redis dies, messages still arrive (the safety
    poll)."""
    from lmqtt.loadtest.redis_streams import RedisServer
    redis = RedisServer()
    notify = ("--redis", redis.url, "--notify-mode", mode)
    try:
        with fleet_of(tmp_path, 2, notify, (*notify, "--safety-poll-ms", "300")) as (_store, a, b):
            sub = Paho(b, "redis-sub")
            sub.subscribe("rd/#", qos=1)
            pub = Paho(a, "redis-pub")
            for i in range(10):
                pub.publish("rd/x", str(i).encode(), qos=1)
            assert [m.payload for m in sub.get_n(10)] == [str(i).encode() for i in range(10)]
            assert metric(b.metrics_url, "lmqtt_remote_events") == 0      # not the native push: Redis carried them
            assert metric(b.metrics_url, "lmqtt_remote_redis_events") >= 1
            redis.stop()
            for i in range(10, 15):
                pub.publish("rd/x", str(i).encode(), qos=1)
            assert [m.payload for m in sub.get_n(5, timeout=10)] == [str(i).encode() for i in range(10, 15)]
            sub.disconnect()
            pub.disconnect()
    finally:
        redis.stop()


def test_session_takeover_across_gateways_without_redis(fleet):
    """No Redis: the store relays the claims. Connecting on B closes the connection on A with MQTT
    5 reason 0x8E, and the session (subscription, queued messages) continues on B; a 3.1.1 clean
    session's older connection is closed too (no record to move: only the claim tells A)."""
    from lmqtt.gateway.mqtt import packets as P
    _store, a, b = fleet
    closed_before = metric(a.metrics_url, "lmqtt_takeovers_by_other_gateway")
    first = RawMQTT(a, version=5)
    assert first.connect("roamer-nr", clean=False, props=P.Properties(session_expiry_interval=300)).reason_code == 0
    first.send(P.Subscribe(1, [P.SubscriptionRequest("roamnr/#", 1)]))
    assert isinstance(first.recv(), P.SubAck)
    old311 = RawMQTT(a, version=4)
    assert old311.connect("roamer-311", clean=True).reason_code == 0
    second = Paho(b, "roamer-nr", version=5, clean=False, expiry=300)
    new311 = Paho(b, "roamer-311")
    try:
        assert second.session_present
        pkt = first.recv(5)
        assert isinstance(pkt, P.Disconnect) and pkt.reason_code == 0x8E, pkt
        assert first.closed_by_server(5)
        assert old311.closed_by_server(5)          # 3.1.1: closed without a DISCONNECT
        pub = Paho(a, "roamnr-pub")
        for i in range(5):
            pub.publish("roamnr/t", str(i).encode(), qos=1)
        assert [m.payload for m in second.get_n(5)] == [str(i).encode() for i in range(5)]
        assert second.drain(0.3) == []
        new311.subscribe("roamnr/311", qos=1)      # the newer 3.1.1 connection stays open
        pub.publish("roamnr/311", b"kept", qos=1)
        assert new311.get(5).payload == b"kept"
        assert metric(a.metrics_url, "lmqtt_takeovers_by_other_gateway") == closed_before + 2
        assert metric(b.metrics_url, "lmqtt_session_claims_sent") >= 2
        assert metric(a.metrics_url, "lmqtt_session_claims_heard") >= 2
        pub.disconnect()
    finally:
        second.disconnect()
        new311.disconnect()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_redis_session_takeover_across_gateways(tmp_path):
    """With --redis, one live connection per client id across the fleet: connecting on B closes
    the connection on A with MQTT 5 reason 0x8E, and the session (subscription, queued messages)
    continues on B."""
    from lmqtt.gateway.mqtt import packets as P
    from lmqtt.loadtest.redis_streams import RedisServer
    redis = RedisServer()
    try:
        with fleet_of(tmp_path, 2, ("--redis", redis.url), ("--redis", redis.url)) as (_store, a, b):
            first = RawMQTT(a, version=5)
            ack = first.connect("roamer", clean=False, props=P.Properties(session_expiry_interval=300))
            assert ack.reason_code == 0
            first.send(P.Subscribe(1, [P.SubscriptionRequest("roam/#", 1)]))
            assert isinstance(first.recv(), P.SubAck)
            second = Paho(b, "roamer", version=5, clean=False, expiry=300)
            assert second.session_present
            pkt = first.recv(5)
            assert isinstance(pkt, P.Disconnect) and pkt.reason_code == 0x8E, pkt
            assert first.closed_by_server(5)
            pub = Paho(a, "roam-pub")
            for i in range(5):
                pub.publish("roam/t", str(i).encode(), qos=1)
            assert [m.payload for m in second.get_n(5)] == [str(i).encode() for i in range(5)]
            assert second.drain(0.3) == []
            pub.disconnect()
            second.disconnect()
    finally:
        redis.stop()


def test_one_config_file_for_store_and_gateways(tmp_path):
    """The Helm chart mounts one lmqtt.toml into every pod: gateway keys at the top level must not
    stop the store, a typo must (exit 2, naming the key)."""
    import subprocess
    import sys
    from tests.support import ROOT
    conf = tmp_path / "lmqtt.toml"
    conf.write_text('max_inflight = 10\nsafety_poll_ms = 250\n[store]\nflush_mode = "sync"\n')
    store = LmqttStore(str(tmp_path / "store"), ("--config", str(conf)), log_path=str(tmp_path / "store.log")).start()
    gw = LmqttGateway(store.address, ("--config", str(conf)), log_dir=str(tmp_path)).start()
    try:
        deadline = time.monotonic() + 10        # the banners are printed just after the ports open
        while not ("flush mode: sync" in store.log_tail() and "safety poll every 250 ms" in gw.log_tail()) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "flush mode: sync" in store.log_tail()
        assert "safety poll every 250 ms" in gw.log_tail()
        sub, pub = Paho(gw, "conf-sub"), Paho(gw, "conf-pub")
        sub.subscribe("conf/t", qos=1)
        pub.publish("conf/t", b"ok", qos=1)
        assert sub.get(5).payload == b"ok"
        sub.disconnect()
        pub.disconnect()
    finally:
        gw.stop()
        store.stop()
    bad = tmp_path / "bad.toml"
    bad.write_text('[store]\nflush_mdoe = "sync"\n')
    r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "store", "--port", "0", "--data-dir",
                        str(tmp_path / "s2"), "--config", str(bad)], cwd=ROOT, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and "unknown key 'flush_mdoe'" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "gateway", "--port", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--store HOST:PORT is required" in r.stderr, r.stderr
    dead = f"127.0.0.1:{free_port()}"
    r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "gateway", "--store", dead, "--port", "0",
                        "--metrics-port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and f"cannot reach the store at {dead}" in r.stderr, r.stderr
    tok = LmqttStore(str(tmp_path / "tok"), ("--token", "right"), log_path=str(tmp_path / "tok.log")).start()
    try:
        r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "gateway", "--store", tok.address,
                            "--port", "0", "--metrics-port", "0", "--token", "wrong"], cwd=ROOT,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 1 and "refused the connection" in r.stderr and "token" in r.stderr, r.stderr
    finally:
        tok.stop()


def test_kill9_of_a_gateway_mid_load_loses_no_acknowledged_message(tmp_path):
    """kill -9 the publisher's gateway in the middle of a QoS 1 stream: every message its PUBACK
    confirmed reaches the subscriber on the other gateway. Then kill -9 the subscriber's gateway:
    the persistent session resumes on a third gateway and gets the rest."""
    import threading
    with fleet_of(tmp_path, 3) as (_store, a, b, c):
        sub = Paho(b, "k9-sub", clean=False)
        sub.subscribe("k9/#", qos=1)
        pub = Paho(a, "k9-pub")
        acked: list[bytes] = []
        stop = threading.Event()

        def run():
            i = 0
            while not stop.is_set():
                p = b"%06d" % i
                try:
                    pub.publish("k9/t", p, qos=1, timeout=2.0)
                except (AssertionError, Exception):
                    return
                acked.append(p)
                i += 1

        t = threading.Thread(target=run, daemon=True)
        t.start()
        deadline = time.monotonic() + 10
        while len(acked) < 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        a.kill9()                                  # mid-stream
        t.join(10)
        stop.set()
        assert len(acked) >= 200
        got = {m.payload for m in sub.get_n(len(acked), timeout=15)}
        assert set(acked) <= got, f"{len(set(acked) - got)} acknowledged messages missing"
        # more messages while the subscriber's gateway dies: the session moves to gateway C
        pub2 = Paho(c, "k9-pub2")
        later = [b"later-%03d" % i for i in range(50)]
        for p in later[:25]:
            pub2.publish("k9/t", p, qos=1)
        b.kill9()
        for p in later[25:]:
            pub2.publish("k9/t", p, qos=1)
        sub2 = Paho(c, "k9-sub", clean=False)
        assert sub2.session_present
        # the session's messages: what its connection on B acknowledged before the kill, then
        # everything after that on C
        seen = {m.payload for m in sub.drain(0.1)}
        deadline = time.monotonic() + 15
        while not set(later) <= seen and time.monotonic() < deadline:
            seen |= {m.payload for m in sub2.drain(0.2)}
        assert set(later) <= seen, f"missing after the move: {sorted(set(later) - seen)[:5]}"
        sub2.disconnect()
        pub2.disconnect()
