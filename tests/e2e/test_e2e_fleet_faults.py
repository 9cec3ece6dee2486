"""Faults of the scale-out shape with real processes (docs/fleet.md): `kill -9` of a gateway under
QoS 1 load (its clients move, its clients' wills are published by the store node), a gateway
restarting beside a live one (fires only its own orphan wills), Redis restarted during traffic,
and `kill -9` of the store in sync flush mode. Every wait is bounded; nothing asserts timings."""
from __future__ import annotations

import shutil
import threading
import time
import urllib.error
import urllib.request

import pytest

from lmqtt.loadtest.brokers import free_port_pair
from tests.support import LmqttGateway, LmqttStore, Paho, metric, stop_all, wait_metric

needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")


class _Publisher:
    """QoS 1 publishes of numbered payloads in a thread; `acked` holds those the gateway PUBACKed.
    Stops at the first publish that is not acknowledged (or at stop())."""

    def __init__(self, gw, client_id: str, topic: str, prefix: bytes) -> None:
        self.client = Paho(gw, client_id)
        self.topic, self.prefix = topic, prefix
        self.acked: list[bytes] = []
        self.failed: BaseException | None = None
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            p = self.prefix + b"-%06d" % i
            try:
                self.client.publish(self.topic, p, qos=1, timeout=3.0)
            except BaseException as e:  # noqa: BLE001 - the gateway or store went away
                self.failed = e
                return
            self.acked.append(p)
            i += 1

    def wait_acked(self, n: int, timeout: float = 20.0) -> int:
        deadline = time.monotonic() + timeout
        while len(self.acked) < n and self._t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        return len(self.acked)

    def stop(self) -> list[bytes]:
        self._stop.set()
        self._t.join(10)
        try:
            self.client.disconnect()
        except Exception:  # noqa: BLE001
            pass
        return list(self.acked)


def _collect(clients, want: set, timeout: float = 20.0) -> set:
    """Payloads the clients received until `want` is covered (or the timeout)."""
    got: set = set()
    deadline = time.monotonic() + timeout
    while not want <= got and time.monotonic() < deadline:
        for c in clients:
            got |= {m.payload for m in c.drain(0.05)}
    return got


def _wait_ready(gw, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    url = f"http://{gw.host}:{gw.metrics_port}/readyz"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    return False


_SENTINEL = iter(range(1, 1 << 62))


def _before_sentinel(publisher, topic: str, sub, timeout: float = 15.0) -> list:
    """`publisher` publishes a unique sentinel to `topic` (matched by `sub`'s subscription); returns
    what `sub` received before it. Whatever was stored ahead of the sentinel on that filter has
    arrived by then: a "nothing more arrives" check without a fixed wait."""
    token = b"sentinel-%d" % next(_SENTINEL)
    publisher.publish(topic, token, qos=1)
    got = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"sentinel on {topic!r} did not arrive (before it: {[m.topic for m in got]})"
        batch = sub.drain(min(left, 0.1))
        for i, m in enumerate(batch):
            if m.payload == token:
                return got + batch[:i]
        got += batch



def test_kill9_of_a_gateway_under_qos1_load_clients_move_and_its_wills_fire(tmp_path):
    """Gateway A dies by kill -9 while B publishes a QoS 1 stream to A's persistent subscribers.
    The store publishes the wills of A's clients once A stays away past the grace period (seen by
    a subscriber on B), except the will of a client that reconnected on B first; A's subscribers
    then resume on B and get every message B acknowledged."""
    store = LmqttStore(str(tmp_path / "store"), ("--will-grace-s", "2"), log_path=str(tmp_path / "store.log")).start()
    a = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    b = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    pub = None
    try:
        watcher = Paho(b, "wf-watch")
        watcher.subscribe("wf/will/#", qos=1)
        subs = []
        for i in range(3):
            cid = f"wf-sub{i}"
            s = Paho(a, cid, clean=False, will=(f"wf/will/{cid}", b"dead:" + cid.encode(), 1, False))
            s.subscribe("wf/load", qos=1)
            subs.append(s)
        mover = Paho(a, "wf-mover", will=("wf/will/wf-mover", b"dead:wf-mover", 1, False))
        pub = _Publisher(b, "wf-pub", "wf/load", b"load")
        assert pub.wait_acked(200) >= 200, f"publisher stalled: {pub.failed!r}"
        a.kill9()
        mover.disconnect()                    # its library would re-dial A forever
        moved = Paho(b, "wf-mover")           # back on B before the grace period ends: no will
        # the store publishes the other three wills once A has stayed away for the grace period
        want = {f"wf/will/wf-sub{i}" for i in range(3)}
        seen: list = []
        deadline = time.monotonic() + 30
        while not want <= {m.topic for m in seen} and time.monotonic() < deadline:
            seen += watcher.drain(0.1)
        seen += _before_sentinel(moved, "wf/will/sentinel", watcher)     # and nothing else
        topics = [m.topic for m in seen]
        assert sorted(topics) == sorted(want), f"wills seen on B: {topics}\n{store.log_tail()}"
        assert all(m.payload == b"dead:" + m.topic.rsplit("/", 1)[1].encode() for m in seen)
        # A's subscribers come back on B: every message B acknowledged reaches each of them
        resumed = []
        for i, old in enumerate(subs):
            old.disconnect()
            r = Paho(b, f"wf-sub{i}", clean=False)
            assert r.session_present, "the session A served must continue on B"
            resumed.append((old, r))
        n = len(pub.acked)
        assert pub.wait_acked(n + 200) >= n + 200, f"publisher stalled: {pub.failed!r}"
        acked = set(pub.stop())
        pub = None
        for old, r in resumed:
            got = _collect([old, r], acked)
            assert acked <= got, f"{r.c._client_id!r}: {len(acked - got)} of {len(acked)} acknowledged messages missing"
            r.disconnect()
        moved.disconnect()
        watcher.disconnect()
    finally:
        if pub is not None:
            pub.stop()
        stop_all([a, b], store)


def test_a_gateway_restarting_fires_only_its_own_orphan_wills(tmp_path):
    """Gateway A is killed and started again while B serves a client with a will: the will of A's
    client goes out exactly once, the will of B's live client never (it used to: a starting
    gateway published every will in the store)."""
    store = LmqttStore(str(tmp_path / "store"), log_path=str(tmp_path / "store.log")).start()
    a = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    b = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    try:
        watcher = Paho(b, "wr-watch")
        watcher.subscribe("wr/#", qos=1)
        on_b = Paho(b, "wr-on-b", will=("wr/will/wr-on-b", b"dead", 1, False))
        on_a = Paho(a, "wr-on-a", will=("wr/will/wr-on-a", b"dead", 1, False))
        on_a.publish("wr/hello", b"a", qos=1)
        on_b.publish("wr/hello", b"b", qos=1)
        assert sorted(m.payload for m in watcher.get_n(2)) == [b"a", b"b"]
        a.restart(kill=True)
        on_a.disconnect()
        seen: list = []
        deadline = time.monotonic() + 30
        while "wr/will/wr-on-a" not in [m.topic for m in seen] and time.monotonic() < deadline:
            seen += watcher.drain(0.1)
        seen += _before_sentinel(on_b, "wr/sentinel", watcher)     # and nothing else
        assert [m.topic for m in seen] == ["wr/will/wr-on-a"], \
            f"wills seen: {[m.topic for m in seen]}\n{a.log_tail()}"
        # B's client is still connected and served
        on_b.publish("wr/still", b"here", qos=1)
        m = watcher.get(10)
        assert (m.topic, m.payload) == ("wr/still", b"here")
        on_b.disconnect()                     # a clean DISCONNECT: its will is discarded
        assert wait_metric(b.metrics_url, "lmqtt_connections", 1) == 1      # only the watcher is left on B
        assert _before_sentinel(watcher, "wr/sentinel", watcher) == []
        watcher.disconnect()
    finally:
        stop_all([a, b], store)


@needs_redis
def test_redis_restarted_during_traffic_loses_nothing(tmp_path):
    """Store and gateways use Redis for notify events and the session directory. Redis dies in the
    middle of a QoS 1 stream and comes back on the same port: every acknowledged message reaches
    the subscriber on the other gateway, and events flow through Redis again."""
    from lmqtt.loadtest.redis_streams import RedisServer
    redis = RedisServer()
    port = redis.port
    store = a = b = pub = None
    try:
        store = LmqttStore(str(tmp_path / "store"), ("--redis", redis.url), log_path=str(tmp_path / "store.log")).start()
        args = ("--redis", redis.url, "--safety-poll-ms", "300")
        a = LmqttGateway(store.address, args, log_dir=str(tmp_path)).start()
        b = LmqttGateway(store.address, args, log_dir=str(tmp_path)).start()
        sub = Paho(b, "rr-sub", clean=False)
        sub.subscribe("rr/t", qos=1)
        pub = _Publisher(a, "rr-pub", "rr/t", b"rr")
        assert pub.wait_acked(200) >= 200, f"publisher stalled: {pub.failed!r}"
        redis.stop()
        n = len(pub.acked)
        assert pub.wait_acked(n + 200) >= n + 200, f"publishing stopped without Redis: {pub.failed!r}"
        redis = RedisServer(port=port)
        before = metric(b.metrics_url, "lmqtt_remote_redis_events")
        n = len(pub.acked)
        assert pub.wait_acked(n + 200) >= n + 200, f"publishing stopped after Redis came back: {pub.failed!r}"
        # events come through Redis again (bounded: the subscriber re-dials with backoff)
        deadline = time.monotonic() + 20
        while metric(b.metrics_url, "lmqtt_remote_redis_events") <= before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(b.metrics_url, "lmqtt_remote_redis_events") > before, f"no Redis events after the restart\n{b.log_tail()}"
        acked = set(pub.stop())
        pub = None
        got = _collect([sub], acked)
        assert acked <= got, f"{len(acked - got)} of {len(acked)} acknowledged messages missing"
        sub.disconnect()
        # the session directory is back too: connecting on B takes the client id over from A
        # (bounded retries: a claim sent before the gateways re-subscribed to Redis is lost)
        from tests.support import RawMQTT
        taken = False
        for _ in range(10):
            on_a = RawMQTT(a)
            on_a.connect("rr-mover")
            on_b = RawMQTT(b)
            on_b.connect("rr-mover")
            taken = on_a.closed_by_server(2.0)
            on_a.close()
            on_b.close()
            if taken:
                break
        assert taken, f"no takeover across gateways after Redis came back\n{a.log_tail()}"
    finally:
        if pub is not None:
            pub.stop()
        if store is not None:
            stop_all([g for g in (a, b) if g is not None], store)
        redis.stop()


def test_kill9_of_the_store_in_sync_mode_loses_no_acknowledged_message(tmp_path):
    """`lmqtt store --flush-mode sync` dies by kill -9 in the middle of a QoS 1 stream and starts
    again: both gateways reconnect by themselves, and the persistent subscriber on the other
    gateway gets every message acknowledged before the kill and every one published after."""
    store = LmqttStore(str(tmp_path / "store"), ("--flush-mode", "sync"), log_path=str(tmp_path / "store.log")).start()
    a = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    b = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    pub = None
    try:
        sub = Paho(b, "sk-sub", clean=False)
        sub.subscribe("sk/t", qos=1)
        pub = _Publisher(a, "sk-pub", "sk/t", b"before")
        assert pub.wait_acked(300) >= 300, f"publisher stalled: {pub.failed!r}"
        store.kill9()
        acked = set(pub.stop())               # it stops at the first unacknowledged publish
        pub = None
        store.start()
        assert _wait_ready(a) and _wait_ready(b), f"gateways did not reconnect\n{a.log_tail()}\n{b.log_tail()}"
        after = [b"after-%03d" % i for i in range(50)]
        p2 = Paho(a, "sk-pub2")
        for p in after:
            p2.publish("sk/t", p, qos=1)
        p2.disconnect()
        want = acked | set(after)
        got = _collect([sub], want, timeout=30)
        assert acked <= got, f"{len(acked - got)} of {len(acked)} messages acknowledged before the kill missing"
        assert set(after) <= got, f"{len(set(after) - got)} messages published after the restart missing"
        sub.disconnect()
    finally:
        if pub is not None:
            pub.stop()
        stop_all([a, b], store)


def test_wills_the_store_published_for_a_gateway_cut_off_too_long_are_not_published_twice(tmp_path):
    """The store cannot tell a gateway cut off from it from a dead one: past the grace period
    (here 0: a store restart is longer) it publishes the gateway's wills. The gateway, back, is
    told which; when such a client then drops its connection, its will is not published again."""
    from lmqtt.gateway.mqtt import packets as P
    from tests.support import RawMQTT
    store = LmqttStore(str(tmp_path / "store"), ("--will-grace-s", "0"), log_path=str(tmp_path / "store.log")).start()
    a = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    b = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    try:
        watcher = Paho(b, "wc-watch")
        watcher.subscribe("wc/#", qos=1)
        x = RawMQTT(a)
        ack = x.connect("wc-x", will=P.Will("wc/will/wc-x", b"dead", 1, False))
        assert isinstance(ack, P.ConnAck) and ack.reason_code == 0
        x.send(P.Publish("wc/hello", b"x", 1, packet_id=1))     # after the will on A's store link
        assert isinstance(x.recv(10), P.PubAck)
        assert watcher.get(10).payload == b"x"
        store.restart(kill=True)               # A is away longer than the grace: its will goes out
        seen: list = []
        deadline = time.monotonic() + 30
        while "wc/will/wc-x" not in [m.topic for m in seen] and time.monotonic() < deadline:
            seen += watcher.drain(0.1)
        assert [m.topic for m in seen] == ["wc/will/wc-x"], f"{[m.topic for m in seen]}\n{store.log_tail()}"
        assert _wait_ready(a) and _wait_ready(b)
        # a round trip on A's store link after its gw_hello, whose answer named wc-x
        x.send(P.Publish("wc/hello", b"x2", 1, packet_id=2))
        assert isinstance(x.recv(10), P.PubAck)
        x.close()                              # no DISCONNECT: A would publish the will now
        assert wait_metric(a.metrics_url, "lmqtt_connections", 0) == 0
        pa = Paho(a, "wc-pa")                  # the sentinel goes through A's pipeline after it
        before = _before_sentinel(pa, "wc/sentinel", watcher)
        assert [m.topic for m in before] == ["wc/hello"], f"{[(m.topic, m.payload) for m in before]}"
        pa.disconnect()
        watcher.disconnect()
    finally:
        stop_all([a, b], store)


def test_serve_workers_a_restarted_worker_fires_only_the_wills_of_its_own_clients(tmp_path):
    """`lmqtt serve --workers 2`: a worker killed with SIGKILL is restarted by the supervisor. The
    wills of the clients it served go out once each; the clients on the other worker stay connected
    and their wills are not published."""
    import os
    import signal
    import subprocess
    from lmqtt.gateway.mqtt import packets as P
    from tests.support import LmqttServer, RawMQTT
    srv = LmqttServer(str(tmp_path / "data"), ("--workers", "2"), log_path=str(tmp_path / "serve.log"))
    srv.metrics_port = free_port_pair()          # worker i serves metrics on metrics_port + i
    srv.start()
    raws = []
    try:
        for i in (0, 1):
            gw = type("W", (), {"host": "127.0.0.1", "metrics_port": srv.metrics_port + i})
            assert _wait_ready(gw, 30), f"worker {i} not ready: {srv.log_tail()}"
        watcher = Paho(srv, "ww-watch", clean=False)          # persistent: it may be on the victim
        watcher.subscribe("ww/will/#", qos=1)
        # the kernel spreads connections over the workers by a hash: connect until each worker holds
        # at least two (the watcher is one of them on one worker), so both kinds of client exist
        per_worker = [0, 0]
        while len(raws) < 12 or (min(per_worker) < 2 and len(raws) < 60):
            i = len(raws)
            r = RawMQTT(srv)
            ack = r.connect(f"ww-c{i}", will=P.Will(f"ww/will/ww-c{i}", b"dead", 1, False))
            assert isinstance(ack, P.ConnAck) and ack.reason_code == 0
            raws.append(r)
            if len(raws) >= 12:
                per_worker = [metric(f"http://127.0.0.1:{srv.metrics_port + w}/metrics", "lmqtt_connections")
                              for w in (0, 1)]
        assert min(per_worker) >= 2, f"{len(raws)} clients all on one worker: {per_worker}"
        out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(srv.proc.pid)], capture_output=True,
                             text=True).stdout
        gateways = sorted(int(line.split()[0]) for line in out.splitlines() if " gateway " in line)
        assert len(gateways) == 2, out
        os.kill(gateways[0], signal.SIGKILL)
        dead = {f"ww/will/ww-c{i}" for i, r in enumerate(raws) if r.closed_by_server(0.5)}
        assert 0 < len(dead) < len(raws), (f"clients closed after one worker's SIGKILL: {sorted(dead)} of "
                                           f"{len(raws)}, connections per worker before {per_worker}; "
                                           f"log: {srv.log_tail()}")
        seen: list = []
        deadline = time.monotonic() + 40
        while not dead <= {m.topic for m in seen} and time.monotonic() < deadline:
            seen += watcher.drain(0.1)
        seen += _before_sentinel(watcher, "ww/will/sentinel", watcher)      # and nothing else
        topics = sorted(m.topic for m in seen)
        assert topics == sorted(dead), f"wills seen: {topics}, clients of the killed worker: {sorted(dead)}"
        watcher.disconnect()
    finally:
        for r in raws:
            r.close()
        srv.stop()


def test_delayed_wills_of_a_stopped_gateway_are_published_by_the_store_after_their_delay(tmp_path):
    """MQTT 5 Will Delay Interval across a gateway that is stopped and does not come back: the
    delayed will of a client that stays away is published by the store once the delay is over;
    the delayed will of a client that reconnects on B meanwhile is never published."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
    store = LmqttStore(str(tmp_path / "store"), ("--will-grace-s", "1"), log_path=str(tmp_path / "store.log")).start()
    a = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    b = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    try:
        watcher = Paho(b, "wd-watch")
        watcher.subscribe("wd/#", qos=1)
        clients = {}
        for cid in ("wd-gone", "wd-back"):
            c = Paho(a, cid, version=5, clean=False, expiry=300, connect=False)
            wp = Properties(PacketTypes.WILLMESSAGE)
            wp.WillDelayInterval = 3
            c.c.will_set(f"wd/will/{cid}", b"dead:" + cid.encode(), 1, False, wp)
            c.connect()
            clients[cid] = c
        assert a.stop() == 0, a.log_tail()     # clean stop: both wills wait out their delay
        for c in clients.values():
            c.disconnect()
        back = Paho(b, "wd-back", version=5, clean=False, expiry=300)   # back within the delay
        assert back.session_present
        seen: list = []
        deadline = time.monotonic() + 30
        while "wd/will/wd-gone" not in [m.topic for m in seen] and time.monotonic() < deadline:
            seen += watcher.drain(0.1)
        seen += _before_sentinel(back, "wd/sentinel", watcher)      # and nothing else
        assert [(m.topic, m.payload) for m in seen] == [("wd/will/wd-gone", b"dead:wd-gone")], \
            f"{[m.topic for m in seen]}\n{store.log_tail()}"
        back.disconnect()
        watcher.disconnect()
    finally:
        stop_all([a, b], store)
