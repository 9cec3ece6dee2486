"""End-to-end robustness: malformed input, a client that never reads (bounded memory), metrics."""
from __future__ import annotations

import re
import socket
import threading
import time
import urllib.request

import psutil
import pytest

from tests.support import LmqttServer, Paho, RawMQTT, both_kinds_fixtures
from lmqtt.gateway.mqtt import encode, packets as P


shared_server, lmqtt_server = both_kinds_fixtures()


pytestmark = pytest.mark.timeout(120)


def _metric(url: str, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    pat = re.compile(r"^" + re.escape(name) + (re.escape("{" + labels + "}") if labels else r"") + r" ([0-9.e+]+)$", re.M)
    m = pat.search(text)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("garbage,version", [
    (b"\x30\xff\xff\xff\xff\x7f", 4),          # remaining length longer than 4 bytes
    (b"\x36\x05\x00\x01a\x00\x01", 5),          # PUBLISH with QoS 3
    (b"\x82\x04\x00\x01\x00\x00", 4),           # SUBSCRIBE without any filter
    (b"\x30\x05\x00\x03\xff\xfe\xfd", 5),       # topic that is not UTF-8
    (b"\xf2\x00", 4),                           # AUTH-type byte with bad flags
])
def test_malformed_packet_closes_only_that_connection(lmqtt_server, garbage, version):
    good = Paho(lmqtt_server, "bystander", version=5)
    good.subscribe("mal/t", 1)
    bad = RawMQTT(lmqtt_server, version=version)
    assert bad.connect("bad-one").reason_code == 0
    bad.send_raw(garbage)
    if version == 5:
        d = bad.recv()
        assert isinstance(d, P.Disconnect) and d.reason_code >= 0x80
    assert bad.closed_by_server()
    good.publish("mal/t", b"still-served", qos=1)
    assert good.get().payload == b"still-served"
    fresh = Paho(lmqtt_server, "after-bad")
    fresh.subscribe("mal/t", 0)
    good.publish("mal/t", b"again", qos=1)
    assert fresh.get().payload == b"again"


def test_garbage_before_connect_is_closed(lmqtt_server):
    s = socket.create_connection((lmqtt_server.host, lmqtt_server.port))
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    s.settimeout(5)
    assert s.recv(100) == b""
    s.close()
    Paho(lmqtt_server, "ok-after-http").disconnect()


def test_topic_alias_beyond_maximum_refused_with_reason(lmqtt_server):
    raw = RawMQTT(lmqtt_server, version=5)
    ack = raw.connect("aliaser")
    over = ack.properties.topic_alias_maximum + 1       # one past what CONNACK allowed
    raw.send(P.Publish("al/t", b"x", 0, properties=P.Properties(topic_alias=over)))
    d = raw.recv()
    assert isinstance(d, P.Disconnect) and d.reason_code == 0x94
    assert "Topic Alias Maximum" in d.properties.reason_string


def _anon_rss(proc: psutil.Process) -> int:
    """Resident memory that is not file-backed: the CommitLog is memory-mapped, so its written
    pages show up in RSS as (reclaimable) page cache; what must stay bounded is the heap."""
    mi = proc.memory_info()
    return mi.rss - mi.shared


@pytest.mark.slow
def test_client_that_never_reads_does_not_grow_server_memory(tmp_path):
    cfg = tmp_path / "lmqtt.toml"
    # a QoS 0 subscription more than 200 messages behind skips to the newest (the 1,600 below)
    cfg.write_text("lq_cache_mb = 8\nmax_qos0_backlog = 200\n")
    srv = LmqttServer(str(tmp_path / "data"), ("--config", str(cfg)), str(tmp_path / "serve.log")).start()
    try:
        proc = psutil.Process(srv.proc.pid)
        # Two clients that subscribe and then never read: QoS 0 and QoS 1 subscriptions.
        slow = []
        for q in (0, 1):
            r = RawMQTT(srv, version=4)
            r.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            assert r.connect(f"never-reads-{q}").reason_code == 0
            r.send(P.Subscribe(1, [P.SubscriptionRequest("flood/#", q)]))
            assert isinstance(r.recv(), P.SubAck)
            slow.append(r)
        other = Paho(srv, "healthy")
        other.subscribe("ctl/t", 1)
        time.sleep(0.3)
        rss0 = _anon_rss(proc)
        payload = b"x" * (64 * 1024)
        total = 1600                                   # 100 MiB through the server
        pub = RawMQTT(srv, version=4)
        pub.connect("flooder")
        frame = encode(P.Publish("flood/data", payload, 0), 4)
        peak = [rss0]
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], _anon_rss(proc))
                time.sleep(0.05)
        t = threading.Thread(target=sample, daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        for i in range(total):
            pub.send_raw(frame)
            if i % 400 == 399:
                other_pub = Paho(srv, f"ctl-pub-{i}")
                other_pub.publish("ctl/t", f"tick{i}".encode(), qos=1)
                other_pub.disconnect()
                assert other.get(timeout=10).payload == f"tick{i}".encode()   # others still served
            assert time.monotonic() < deadline
        pub.send(P.PingReq())
        assert isinstance(pub.recv(timeout=30), P.PingResp)   # every publish above was processed
        time.sleep(0.5)
        stop.set()
        t.join()
        growth = peak[0] - rss0
        print(f"anon RSS before {rss0 / 2**20:.1f} MiB, peak growth {growth / 2**20:.1f} MiB")
        assert growth < 50 * 1024 * 1024, f"server RSS grew by {growth / 2**20:.1f} MiB for 100 MiB published"
        dropped = _metric(srv.metrics_url, "lmqtt_dropped_messages_total", 'reason="qos0_backpressure"')
        assert dropped > 0
        for r in slow:
            r.close()
    finally:
        srv.stop()


def _slow_qos0_reader(tmp_path, settings: str, n: int = 640) -> tuple[list[int], float]:
    """A QoS 0 subscriber that does not read while `n` messages of 64 KiB (40 MiB: beyond what the
    kernel's socket buffers hold, its socket far above the gateway's high-water mark) are published
    to it, then reads until nothing comes for 3 s -> (the indexes it got, in the order they came;
    the messages counted as dropped for back-pressure)."""
    cfg = tmp_path / "lmqtt.toml"
    cfg.write_text("write_high_water = 65536\nwrite_low_water = 16384\n" + settings)
    srv = LmqttServer(str(tmp_path / "data"), ("--config", str(cfg)), str(tmp_path / "serve.log")).start()
    try:
        sub = RawMQTT(srv, version=4)
        assert sub.connect("slow-q0").reason_code == 0
        sub.send(P.Subscribe(1, [P.SubscriptionRequest("slow0/t", 0)]))
        assert isinstance(sub.recv(), P.SubAck)
        pub = RawMQTT(srv, version=4)
        pub.connect("slow-q0-pub")
        body = b"x" * (64 * 1024)
        for i in range(n):
            pub.send_raw(encode(P.Publish("slow0/t", b"%06d" % i + body, 0), 4))
        pub.send(P.PingReq())
        assert isinstance(pub.recv(timeout=30), P.PingResp)    # every publish above was stored
        time.sleep(0.5)
        got: list[int] = []
        while True:
            try:
                pkt = sub.recv(timeout=3)
            except socket.timeout:
                break
            assert isinstance(pkt, P.Publish), f"after {len(got)} of {n}: {pkt!r}"
            got.append(int(pkt.payload[:6]))
        return got, _metric(srv.metrics_url, "lmqtt_dropped_messages_total", 'reason="qos0_backpressure"')
    finally:
        srv.stop()


def test_a_qos0_subscriber_that_reads_slowly_gets_every_message_in_order(tmp_path):
    """A QoS 0 subscriber that stops reading while 40 MiB are published to it loses nothing once it
    reads again: its messages waited in the store, not in the gateway's memory, and none is
    counted as dropped. Before, a full socket skipped the whole backlog of a QoS 0 subscription."""
    got, dropped = _slow_qos0_reader(tmp_path, "")
    assert got == list(range(640)) and dropped == 0


def test_a_qos0_subscriber_too_far_behind_keeps_the_newest_max_qos0_backlog(tmp_path):
    """Further behind than max_qos0_backlog, a QoS 0 subscription skips the older messages only:
    it gets what was written to its socket before it filled, then the newest 100, every one in
    order, and each message it did not get is counted as dropped."""
    got, dropped = _slow_qos0_reader(tmp_path, "max_qos0_backlog = 100\n")
    assert got == sorted(got) and len(set(got)) == len(got)
    assert got[-100:] == list(range(540, 640))
    assert len(got) + dropped == 640 and dropped > 0


def test_metrics_endpoint_counts_traffic(lmqtt_server):
    s = Paho(lmqtt_server, "m-sub")
    s.subscribe("met/t", 1)
    p = Paho(lmqtt_server, "m-pub")
    for _ in range(7):
        p.publish("met/t", b"abc", qos=1)
    assert len(s.get_n(7)) == 7
    url = lmqtt_server.metrics_url
    assert _metric(url, "lmqtt_messages_in_total", 'qos="1"') >= 7
    assert _metric(url, "lmqtt_messages_out_total", 'qos="1"') >= 7
    assert _metric(url, "lmqtt_connections") >= 2
    assert _metric(url, "lmqtt_store_append_seconds_count") >= 1
    assert _metric(url, "lmqtt_notify_events_total") >= 1
    assert _metric(url, "lmqtt_bytes_in_total") > 7 * 3
    assert _metric(url, "lmqtt_dispatch_lag_seconds_count") >= 1


@pytest.mark.parametrize("version", [4, 5])
def test_message_over_store_limit_is_refused_and_others_continue(lmqtt_server, version):
    watcher = Paho(lmqtt_server, f"big-watch-{version}")
    watcher.subscribe("big/#", 1)
    raw = RawMQTT(lmqtt_server, version=version)
    raw.connect(f"big-{version}")
    raw.send(P.Publish("big/t", b"b" * ((4 << 20) - 16), 1, packet_id=5))
    if version == 5:
        ack = raw.recv(timeout=10)
        assert isinstance(ack, P.PubAck) and ack.packet_id == 5 and ack.reason_code >= 0x80
        raw.send(P.Publish("big/t", b"small", 1, packet_id=6))     # the connection still works
        ack = raw.recv()
        assert isinstance(ack, P.PubAck) and ack.reason_code == 0
        assert watcher.get().payload == b"small"
    else:
        assert raw.closed_by_server(10)      # 3.1.1 has no negative PUBACK: close, nothing stored
    Paho(lmqtt_server, f"big-pub-{version}").publish("big/ok", b"fine", qos=1)
    got = [m.payload for m in watcher.get_n(1) + watcher.before_sentinel(watcher, "big/sentinel")]
    assert b"fine" in got and all(len(p) < 100 for p in got)


@pytest.mark.parametrize("version", [4, 5])
def test_will_with_wildcard_topic_is_refused(lmqtt_server, version):
    raw = RawMQTT(lmqtt_server, version=version)
    reply = raw.connect("bad-will", will=P.Will("will/+/bad", b"x", 0, False))
    if version == 5:
        assert isinstance(reply, P.ConnAck) and reply.reason_code in (0x82, 0x90)   # codec: 0x82
        assert raw.recv() is None
    else:
        assert reply is None                     # 3.1.1 has no CONNACK code for it: closed
    Paho(lmqtt_server, "after-bad-will").disconnect()


def test_connection_without_connect_is_closed(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("connect_timeout_s = 1.0\n")
    srv = LmqttServer(str(tmp_path / "d"), ("--config", str(cfg)), str(tmp_path / "log")).start()
    try:
        idle = socket.create_connection((srv.host, srv.port))
        idle.settimeout(10)
        assert idle.recv(10) == b""              # closed by the server, nothing sent
        idle.close()
        Paho(srv, "still-accepting").disconnect()
    finally:
        srv.stop()


@pytest.mark.parametrize("version,code", [(4, 0x80), (5, 0x97)])
def test_subscription_quota_refused_per_filter(tmp_path, version, code):
    cfg = tmp_path / "c.toml"
    cfg.write_text("max_subscriptions = 2\n")
    srv = LmqttServer(str(tmp_path / "d"), ("--config", str(cfg)), str(tmp_path / "log")).start()
    try:
        raw = RawMQTT(srv, version=version)
        raw.connect(f"quota{version}")
        raw.send(P.Subscribe(3, [P.SubscriptionRequest(f, 1) for f in ("q/a", "q/b", "q/c", "q/a")]))
        ack = raw.recv()
        assert ack.reason_codes == [1, 1, code, 1]      # re-subscribing an existing filter is fine
        raw.send(P.Publish("q/c", b"not for me", 1, packet_id=1))
        raw.send(P.Publish("q/b", b"for me", 1, packet_id=2))
        got = [p for p in (raw.recv(), raw.recv(), raw.recv()) if isinstance(p, P.Publish)]
        assert [p.payload for p in got] == [b"for me"]
    finally:
        srv.stop()
