"""Limits that protect the broker (gateway/broker/limits.py, docs/gateway.md "Limits"), end to end against
a real `lmqtt serve` (and `lmqtt gateway` over `lmqtt store` where marked), with independent
clients (paho-mqtt) and raw sockets on the gateway's codec where a library hides the reply.

Each test asserts what the refused client sees (the reason code), what the operator sees (the log
line with its cause, the /metrics counter) and that everyone else keeps being served. Source
addresses other than 127.0.0.1 (127.0.0.2, ...) are other loopback addresses, so per-address limits
are tested without other machines. No timing assertions; every wait is bounded.
"""
from __future__ import annotations

import re
import socket
import ssl
import time
import urllib.request

import pytest

from lmqtt.gateway.mqtt import Decoder, encode, packets as P
from tests.support import SERVER_KINDS, LmqttFleet, LmqttServer, Paho, RawMQTT, free_port, listening, pki_files


# ---------------------------------------------------------------------------------------- helpers
def _server(kind: str, tmp_path, toml: str = "", args: tuple[str, ...] = ()):
    conf = tmp_path / "limits.toml"
    conf.write_text(toml)
    extra = ("--config", str(conf), *args)
    if kind == "serve":
        srv = LmqttServer(str(tmp_path / "data"), extra, log_path=str(tmp_path / "serve.log")).start()
    else:
        srv = LmqttFleet(str(tmp_path / "store-data"), extra, log_dir=str(tmp_path)).start()
    # /metrics opens a moment after the MQTT port: the tests read it
    port = int(srv.metrics_url.rsplit(":", 1)[1].split("/")[0])
    if not listening(srv.host, port, 20):
        srv.stop()
        raise RuntimeError(f"/metrics did not open on port {port}: {srv.log_tail()}")
    return srv


class RawFrom(RawMQTT):
    """RawMQTT from a chosen loopback source address (127.0.0.2, ...)."""

    def __init__(self, server, source: str = "127.0.0.1", version: int = 4, timeout: float = 5.0) -> None:
        self.version = version
        self.sock = socket.create_connection((server.host, server.port), timeout=timeout, source_address=(source, 0))
        self.dec = Decoder(version=version, server_side=False)
        self._pending: list = []


def _connect(server, cid: str, version: int = 5, source: str = "127.0.0.1"):
    """(client, CONNACK or None when closed without one)."""
    r = RawFrom(server, source, version)
    r.send(P.Connect(cid, version, True, 60, None, None, None, P.Properties()))
    try:
        return r, r.recv()
    except (ConnectionResetError, socket.timeout):
        return r, None


def _wait_log(srv, pattern: str, timeout: float = 10.0) -> str:
    """The first log line matching the regex `pattern` (fails after `timeout`)."""
    rx = re.compile(pattern)
    deadline = time.monotonic() + timeout
    while True:
        for line in srv.log_tail(200_000).splitlines():
            if rx.search(line):
                return line
        assert time.monotonic() < deadline, f"no log line matching {pattern!r}:\n{srv.log_tail(3000)}"
        time.sleep(0.05)


def _metric(srv, name: str) -> float:
    body = urllib.request.urlopen(srv.metrics_url, timeout=5).read().decode()
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def _served(srv, tag: str) -> None:
    """Another client still publishes and receives (QoS 1 round trip through the broker)."""
    sub = Paho(srv, client_id=f"{tag}-sub", version=5)
    pub = Paho(srv, client_id=f"{tag}-pub", version=4)
    try:
        assert sub.subscribe(f"served/{tag}", qos=1) == [1]
        pub.publish(f"served/{tag}", b"still here", qos=1)
        got = sub.get(timeout=10)
        assert (got.topic, got.payload) == (f"served/{tag}", b"still here")
    finally:
        sub.disconnect()
        pub.disconnect()


def _served_from(srv, source: str, tag: str) -> None:
    """`_served` with raw clients from another loopback address."""
    sub, ack = _connect(srv, f"{tag}-sub", source=source)
    assert ack.reason_code == 0
    pub, ack = _connect(srv, f"{tag}-pub", source=source, version=4)
    assert ack.reason_code == 0
    sub.send(P.Subscribe(1, [P.SubscriptionRequest(f"served/{tag}", 1)]))
    assert sub.recv().reason_codes == [1]
    pub.send(P.Publish(f"served/{tag}", b"still here", 1, packet_id=1))
    assert isinstance(pub.recv(), P.PubAck)
    got = sub.recv(timeout=10)
    assert isinstance(got, P.Publish) and got.payload == b"still here"
    sub.close()
    pub.close()


# -------------------------------------------------------------------------------- total connections
@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_max_connections_refuses_with_0x97_and_rc3_and_others_are_served(tmp_path, kind):
    srv = _server(kind, tmp_path, "max_connections = 4\n")
    try:
        sub = Paho(srv, client_id="mc-sub", version=5)
        pub = Paho(srv, client_id="mc-pub", version=4)
        idle, ack = _connect(srv, "mc-idle")
        assert ack.reason_code == 0
        fourth, ack = _connect(srv, "mc-fourth")
        assert ack.reason_code == 0
        # full: MQTT 5 gets 0x97 quota exceeded with a reason string, 3.1.1 return code 3
        r5, ack5 = _connect(srv, "mc-over5", version=5)
        assert isinstance(ack5, P.ConnAck) and ack5.reason_code == 0x97
        assert "max_connections" in ack5.properties.reason_string
        assert r5.recv() is None                              # and closed
        r4, ack4 = _connect(srv, "mc-over4", version=4)
        assert isinstance(ack4, P.ConnAck) and ack4.reason_code == 3
        assert r4.recv() is None
        line = _wait_log(srv, r"event=connect_refused .*reason_code=0x97 cause=max_connections limit=4")
        assert "peer=127.0.0.1:" in line
        assert _metric(srv, 'lmqtt_limit_hits_total{limit="max_connections"}') >= 2
        assert _metric(srv, 'lmqtt_connect_refused_total{reason="0x97"}') >= 2
        # the connected ones are served
        assert sub.subscribe("mc/t", qos=1) == [1]
        pub.publish("mc/t", b"while full", qos=1)
        assert sub.get(timeout=10).payload == b"while full"
        # a slot freed is a slot taken: the next client gets in (bounded retry: the close is async)
        idle.close()
        fourth.close()
        for attempt in range(100):
            r, ack = _connect(srv, f"mc-after-{attempt}")
            if ack is not None and ack.reason_code == 0:
                break
            r.close()
            time.sleep(0.05)
        assert ack is not None and ack.reason_code == 0, ack
        r.close()
        sub.disconnect()
        pub.disconnect()
    finally:
        srv.stop()


# ------------------------------------------------------------------------- connections per address
def test_max_connections_per_address_refuses_that_address_only(tmp_path):
    srv = _server("serve", tmp_path, "max_connections_per_address = 2\n")
    try:
        a1, ack = _connect(srv, "pa-1", source="127.0.0.2")
        assert ack.reason_code == 0
        a2, ack = _connect(srv, "pa-2", source="127.0.0.2")
        assert ack.reason_code == 0
        r5, ack = _connect(srv, "pa-3", source="127.0.0.2")
        assert ack.reason_code == 0x97 and "from your address" in ack.properties.reason_string
        r4, ack = _connect(srv, "pa-3v4", version=4, source="127.0.0.2")
        assert ack.reason_code == 3
        line = _wait_log(srv, r"event=connect_refused peer=127\.0\.0\.2:\d+ reason_code=0x97 "
                              r"cause=max_connections_per_address limit=2")
        assert "reason='too many connections from your address" in line
        assert _metric(srv, 'lmqtt_limit_hits_total{limit="max_connections_per_address"}') == 2
        # other addresses are not affected, and the two admitted ones still work
        b1, ack = _connect(srv, "pb-1", source="127.0.0.3")
        assert ack.reason_code == 0
        a1.send(P.PingReq())
        assert isinstance(a1.recv(), P.PingResp)
        _served(srv, "per-address")           # from 127.0.0.1
        for c in (a1, a2, r5, r4, b1):
            c.close()
    finally:
        srv.stop()


# ------------------------------------------------------------------------------ connect rate
def test_connect_rate_per_address_refuses_with_0x9f(tmp_path):
    # 3 at once, then one per 5 s: ten quick attempts from one address cannot all pass
    srv = _server("serve", tmp_path, "connect_rate_per_address = 0.2\nconnect_burst_per_address = 3\n")
    try:
        codes = []
        for i in range(10):
            r, ack = _connect(srv, f"cr-{i}", source="127.0.0.4")
            codes.append(ack.reason_code)
            r.close()
        assert codes[:3] == [0, 0, 0] and 0x9F in codes[3:], codes
        r, ack = _connect(srv, "cr-v4", version=4, source="127.0.0.4")
        assert ack.reason_code == 3                            # 3.1.1: server unavailable
        r.close()
        line = _wait_log(srv, r"event=connect_refused peer=127\.0\.0\.4:\d+ reason_code=0x9F "
                              r"cause=connect_rate_per_address limit=0.2")
        assert "connection rate exceeded" in line
        assert _metric(srv, 'lmqtt_limit_hits_total{limit="connect_rate_per_address"}') >= 2
        assert _metric(srv, 'lmqtt_connect_refused_total{reason="0x9F"}') >= 1
        _served_from(srv, "127.0.0.5", "rate")                 # another address has its own budget
    finally:
        srv.stop()


# ------------------------------------------------------------------------------ publish rate
@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_publish_rate_per_client_is_back_pressure_nothing_lost(tmp_path, kind):
    # 5 at once, then 10/s: 40 publishes take at least 3.5 s to be read
    srv = _server(kind, tmp_path, "publish_rate_per_client = 10\npublish_burst_per_client = 5\n")
    try:
        sub = Paho(srv, client_id="pr-sub", version=5)
        assert sub.subscribe("pr/#", qos=1) == [1]
        fast = RawFrom(srv, version=5)
        fast.connect("pr-fast")
        # all 40 in one write: the broker reads them at once but must not handle them at once
        fast.send_raw(b"".join(encode(P.Publish("pr/fast", str(i).encode(), 1, packet_id=i + 1), 5)
                               for i in range(40)))
        line = _wait_log(srv, r"event=publish_throttled client_id=pr-fast .*cause=publish_rate_per_client "
                              r"limit=10.0 burst=5 action=pause_reading")
        assert "peer=127.0.0.1:" in line
        # meanwhile another client is served while pr-fast is still held back
        _served(srv, "publish-rate")
        got_so_far = sub.drain(0.0)
        assert len(got_so_far) < 40, "the throttled client's publishes were not held back"
        # every message arrives, in order, and every one is acknowledged: nothing refused or lost
        got = got_so_far + sub.get_n(40 - len(got_so_far), timeout=30)
        assert [m.payload for m in got] == [str(i).encode() for i in range(40)]
        acks = []
        while len(acks) < 40:
            pkt = fast.recv(timeout=10)
            assert isinstance(pkt, P.PubAck), pkt              # no DISCONNECT
            acks.append((pkt.packet_id, pkt.reason_code))
        assert acks == [(i + 1, 0) for i in range(40)]
        assert _metric(srv, 'lmqtt_limit_hits_total{limit="publish_rate_per_client"}') >= 1
        fast.send(P.PingReq())                                 # still connected, still read
        assert isinstance(fast.recv(), P.PingResp)
        fast.close()
        sub.disconnect()
    finally:
        srv.stop()


# ------------------------------------------------------------------------- subscriptions per client
@pytest.mark.parametrize("version, code", [(4, 0x80), (5, 0x97)])
def test_subscriptions_per_client_refused_logged_and_counted(tmp_path, version, code):
    # the SUBACK codes themselves: test_e2e_robustness.test_subscription_quota_refused_per_filter;
    # here the log line, the counter and the others
    srv = _server("serve", tmp_path, "max_subscriptions = 2\n")
    try:
        raw = RawFrom(srv, version=version)
        raw.connect(f"sq{version}")
        raw.send(P.Subscribe(1, [P.SubscriptionRequest(f, 1) for f in ("sq/a", "sq/b", "sq/c")]))
        assert raw.recv().reason_codes == [1, 1, code]
        line = _wait_log(srv, rf"event=subscribe_refused client_id=sq{version} filter='sq/c' "
                              rf"reason_code=0x{code:02X} cause=max_subscriptions limit=2")
        assert line
        assert _metric(srv, 'lmqtt_limit_hits_total{limit="max_subscriptions"}') == 1
        raw.send(P.PingReq())                                  # the connection stays
        assert isinstance(raw.recv(), P.PingResp)
        _served(srv, f"subs{version}")                         # another client subscribes freely
        raw.close()
    finally:
        srv.stop()


# ------------------------------------------------------------------------------ max packet size
def test_packet_over_maximum_size_is_logged_and_only_that_client_is_closed(tmp_path):
    # the MQTT 5 DISCONNECT 0x95 itself: test_e2e_mqtt5.test_packet_over_servers_maximum_is_refused_with_0x95;
    # here 3.1.1 too, the log line, the counter and the others still served
    srv = _server("serve", tmp_path, "max_packet_size = 4096\n")
    try:
        sub = Paho(srv, client_id="mp-sub", version=5)
        assert sub.subscribe("mp/#", qos=1) == [1]
        before = _metric(srv, "lmqtt_protocol_errors_total")
        r5 = RawFrom(srv, version=5)
        assert r5.connect("mp-big5").properties.maximum_packet_size == 4096
        r5.send(P.Publish("mp/big", b"x" * 5000, 1, packet_id=1))
        d = r5.recv()
        assert isinstance(d, P.Disconnect) and d.reason_code == 0x95
        assert r5.recv() is None
        r4 = RawFrom(srv, version=4)
        assert r4.connect("mp-big4").reason_code == 0
        r4.send(P.Publish("mp/big", b"x" * 5000, 1, packet_id=1))
        assert r4.recv() is None                               # 3.1.1 has no reason code: closed
        for cid in ("mp-big5", "mp-big4"):
            line = _wait_log(srv, rf"event=protocol_error client_id={cid} .*reason_code=0x95")
            assert re.search(r"packet too large: 50\d\d bytes > maximum packet size 4096", line), line
        assert _metric(srv, "lmqtt_protocol_errors_total") == before + 2
        assert sub.drain(0.3) == []                            # nothing of the big ones stored
        pub = Paho(srv, client_id="mp-small", version=4)
        pub.publish("mp/small", b"fits", qos=1)
        assert sub.get(timeout=10).payload == b"fits"
        pub.disconnect()
        sub.disconnect()
    finally:
        srv.stop()


# ------------------------------------------------------------------------------ TLS
@pytest.fixture
def pki(tmp_path):
    pytest.importorskip("trustme")
    return pki_files(tmp_path)


def _tls_paho(srv, port, pki, cid, certfile=None):
    c = Paho(srv, client_id=cid, version=5, connect=False)
    c.port = port
    c.c.tls_set(ca_certs=pki["ca"], certfile=certfile, keyfile=certfile)
    c.connect()
    return c


def test_plaintext_mqtt_on_the_tls_port_is_refused_and_logged(tmp_path, pki):
    tls_port = free_port()
    srv = _server("serve", tmp_path, args=("--tls-port", str(tls_port), "--cert", pki["cert"], "--key", pki["key"]))
    try:
        tls_sub = _tls_paho(srv, tls_port, pki, "tls-sub")
        assert tls_sub.subscribe("tls/#", qos=1) == [1]
        # a device configured for plain MQTT pointed at the TLS port
        with socket.create_connection(("127.0.0.1", tls_port), timeout=10) as s:
            s.sendall(encode(P.Connect("plain-on-tls", 4, True, 60, None, None, None, P.Properties()), 4))
            got = b""
            try:
                while chunk := s.recv(4096):
                    got += chunk
            except ConnectionResetError:
                pass
            assert not got.startswith(b"\x20")                # never a CONNACK: it was not spoken to as MQTT
        line = _wait_log(srv, r"event=tls_handshake_failed listener=mqtts peer=127\.0\.0\.1:\d+ cause=not_tls")
        assert "plain MQTT" in line and "WRONG_VERSION_NUMBER" in line.upper()
        assert _metric(srv, 'lmqtt_tls_handshake_failures_total{cause="not_tls"}') == 1
        # TLS and plain clients are served as before
        pub = Paho(srv, client_id="plain-pub", version=4)
        pub.publish("tls/x", b"over plain tcp", qos=1)
        assert tls_sub.get(timeout=10).payload == b"over plain tcp"
        tls_pub = _tls_paho(srv, tls_port, pki, "tls-pub")
        tls_pub.publish("tls/y", b"over tls", qos=1)
        assert tls_sub.get(timeout=10).payload == b"over tls"
        for c in (pub, tls_pub, tls_sub):
            c.disconnect()
    finally:
        srv.stop()


def test_untrusted_client_certificate_is_refused_and_logged(tmp_path, pki):
    # test_e2e_security covers a missing certificate; here one signed by another CA
    tls_port = free_port()
    srv = _server("serve", tmp_path, args=("--tls-port", str(tls_port), "--cert", pki["cert"], "--key", pki["key"],
                                           "--cafile", pki["ca"], "--require-certificate"))
    try:
        good = _tls_paho(srv, tls_port, pki, "good-dev", certfile=pki["client"])
        assert good.subscribe("devices/#", qos=1) == [1]
        ctx = ssl.create_default_context(cafile=pki["ca"])
        ctx.load_cert_chain(pki["rogue"])
        with socket.create_connection(("127.0.0.1", tls_port), timeout=10) as s:
            with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
                with ctx.wrap_socket(s, server_hostname="127.0.0.1") as ts:   # TLS 1.3: refused after "done"
                    ts.sendall(encode(P.Connect("rogue", 5, True, 60, None, None, None, P.Properties()), 5))
                    if not ts.recv(10):
                        raise ConnectionError("closed without a CONNACK")
        line = _wait_log(srv, r"event=tls_handshake_failed listener=mqtts peer=127\.0\.0\.1:\d+ "
                              r"cause=client_certificate_untrusted")
        assert "not signed by --cafile" in line
        assert _metric(srv, 'lmqtt_tls_handshake_failures_total{cause="client_certificate_untrusted"}') == 1
        other = _tls_paho(srv, tls_port, pki, "good-dev-2", certfile=pki["client"])
        other.publish("devices/dev-01/t", b"21.5", qos=1)
        assert good.get(timeout=10).payload == b"21.5"
        other.disconnect()
        good.disconnect()
    finally:
        srv.stop()


# ------------------------------------------------------------------------------ topic length/levels
def test_topic_length_and_levels_limits(tmp_path):
    srv = _server("serve", tmp_path, "max_topic_levels = 4\nmax_topic_length = 40\n")
    try:
        sub = Paho(srv, client_id="tl-sub", version=5)
        assert sub.subscribe("tl/#", qos=1) == [1]
        # SUBSCRIBE: the filter over a limit is refused alone, the connection stays
        for version, code in ((5, 0x8F), (4, 0x80)):
            r = RawFrom(srv, version=version)
            r.connect(f"tl-s{version}")
            r.send(P.Subscribe(1, [P.SubscriptionRequest("tl/a/b/c/d", 1), P.SubscriptionRequest("tl/a/b", 1),
                                   P.SubscriptionRequest("tl/" + "x" * 40, 1)]))
            assert r.recv().reason_codes == [code, 1, code]
            _wait_log(srv, rf"event=subscribe_refused client_id=tl-s{version} filter='tl/a/b/c/d' "
                           rf"reason_code=0x{code:02X} cause=max_topic_levels reason='topic of 5 levels exceeds "
                           rf"the limit of 4'")
            _wait_log(srv, rf"event=subscribe_refused client_id=tl-s{version} .*cause=max_topic_length")
            r.close()
        # PUBLISH: like an invalid topic name, DISCONNECT 0x90 (3.1.1: closed), nothing stored
        r5 = RawFrom(srv, version=5)
        r5.connect("tl-p5")
        r5.send(P.Publish("tl/a/b/c/d", b"deep", 1, packet_id=1))
        d = r5.recv()
        assert isinstance(d, P.Disconnect) and d.reason_code == 0x90
        assert "max_topic_levels" in d.properties.reason_string
        r4 = RawFrom(srv, version=4)
        r4.connect("tl-p4")
        r4.send(P.Publish("tl/" + "y" * 40, b"long", 1, packet_id=1))
        assert r4.recv() is None
        _wait_log(srv, r"event=protocol_error client_id=tl-p5 .*reason_code=0x90 error='topic of 5 levels exceeds "
                       r"the limit of 4 \(max_topic_levels\)'")
        _wait_log(srv, r"event=protocol_error client_id=tl-p4 .*reason_code=0x90 .*\(max_topic_length\)")
        assert _metric(srv, 'lmqtt_limit_hits_total{limit="max_topic_levels"}') == 3
        assert _metric(srv, 'lmqtt_limit_hits_total{limit="max_topic_length"}') == 3
        pub = Paho(srv, client_id="tl-ok", version=4)
        pub.publish("tl/a/b/c", b"fits", qos=1)                # 4 levels: fine
        assert [m.payload for m in sub.get_n(1)] == [b"fits"] and sub.drain(0.3) == []
        pub.disconnect()
        sub.disconnect()
    finally:
        srv.stop()


# ------------------------------------------------------------------------------ ACL decisions cached
def test_acl_publish_decisions_cached_per_connection_are_dropped_on_reload(tmp_path):
    """A connection remembers the topics the ACL let it publish (the ACL-cost fix for 10,000-rule
    files); a SIGHUP that revokes the right must apply to the very next PUBLISH."""
    import os
    import signal

    from lmqtt.gateway.security.auth import hash_password
    pw = tmp_path / "passwd"
    pw.write_text(f"bob:{hash_password('builder', iterations=1000)}\n")
    acl = tmp_path / "acl"
    acl.write_text("default deny\nallow user:bob all open/#\n")
    srv = _server("serve", tmp_path, args=("--password-file", str(pw), "--acl-file", str(acl)))
    try:
        r = RawFrom(srv, version=5)
        r.send(P.Connect("bob-c", 5, True, 60, "bob", b"builder", None, P.Properties()))
        assert r.recv().reason_code == 0
        for pid in (1, 2):                                     # the second one from the cache
            r.send(P.Publish("open/x", b"ok", 1, packet_id=pid))
            assert (r.recv().reason_code, pid) == (0, pid)
        acl.write_text("default deny\nallow user:bob all other/#\n")
        os.kill(srv.proc.pid, signal.SIGHUP)
        _wait_log(srv, r"event=reloaded what=acl")
        r.send(P.Publish("open/x", b"no longer", 1, packet_id=3))
        pa = r.recv()
        assert isinstance(pa, P.PubAck) and pa.reason_code == 0x87
        r.close()
    finally:
        srv.stop()


def test_tcp_probe_of_the_tls_port_is_counted_not_logged_as_a_warning(tmp_path, pki):
    """A load balancer's TCP health check (connect, close) on the TLS port must not fill the log
    with warnings; it is counted as cause=connection_lost."""
    tls_port = free_port()
    srv = _server("serve", tmp_path, args=("--tls-port", str(tls_port), "--cert", pki["cert"], "--key", pki["key"]))
    try:
        for _ in range(3):
            socket.create_connection(("127.0.0.1", tls_port), timeout=5).close()
        deadline = time.monotonic() + 10
        while _metric(srv, 'lmqtt_tls_handshake_failures_total{cause="connection_lost"}') < 3:
            assert time.monotonic() < deadline, srv.log_tail(3000)
            time.sleep(0.05)
        assert "event=tls_handshake_failed" not in srv.log_tail(200_000)
        c = _tls_paho(srv, tls_port, pki, "after-probes")            # and TLS still works
        c.disconnect()
    finally:
        srv.stop()


def test_connect_rate_on_the_tls_port_refuses_before_the_handshake(tmp_path, pki):
    """Over its connect rate a TLS client is closed before the handshake it would cost (no CONNACK
    can be sent without one); within the rate it gets in; others are not affected."""
    tls_port = free_port()
    srv = _server("serve", tmp_path, "connect_rate_per_address = 0.2\nconnect_burst_per_address = 2\n",
                  args=("--tls-port", str(tls_port), "--cert", pki["cert"], "--key", pki["key"]))
    try:
        ctx = ssl.create_default_context(cafile=pki["ca"])

        def tls_connect(cid: str, source: str = "127.0.0.6"):
            s = socket.create_connection(("127.0.0.1", tls_port), timeout=10, source_address=(source, 0))
            try:
                ts = ctx.wrap_socket(s, server_hostname="127.0.0.1")
            except (ssl.SSLError, OSError):
                s.close()
                return None
            with ts:
                ts.sendall(encode(P.Connect(cid, 5, True, 60, None, None, None, P.Properties()), 5))
                return Decoder(version=5, server_side=False).feed(ts.recv(4096))[0].reason_code

        results = [tls_connect(f"tr-{i}") for i in range(8)]
        assert results[:2] == [0, 0] and None in results[2:], results
        line = _wait_log(srv, r"event=connect_refused peer=127\.0\.0\.6:\d+ reason_code=none "
                              r"cause=connect_rate_per_address limit=0.2 reason='closed before the TLS handshake")
        assert "listener mqtts" in line
        assert _metric(srv, 'lmqtt_limit_hits_total{limit="connect_rate_per_address"}') >= 1
        r, ack = _connect(srv, "tr-plain", source="127.0.0.6")           # one budget per address
        assert ack.reason_code == 0x9F
        r.close()
        assert tls_connect("tr-other", source="127.0.0.7") == 0       # another address: served
    finally:
        srv.stop()


@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_max_offline_backlog_keeps_the_newest_messages_per_subscription(tmp_path, kind):
    """`--max-offline-backlog 3`: a persistent session back from offline gets the newest 3 of
    each subscription's messages stored meanwhile (fewer: all), the rest counted as dropped; what
    is published once it is back is delivered in full."""
    srv = _server(kind, tmp_path, args=("--max-offline-backlog", "3"))
    try:
        sub = RawMQTT(srv)
        assert sub.connect("away", clean=False).session_present is False
        sub.send(P.Subscribe(1, [P.SubscriptionRequest("many/#", qos=1), P.SubscriptionRequest("few/x", qos=1)]))
        assert isinstance(sub.recv(timeout=10.0), P.SubAck)
        sub.send(P.Disconnect())
        assert sub.closed_by_server()
        sub.close()
        pub = RawMQTT(srv)
        assert isinstance(pub.connect("pub"), P.ConnAck)
        for i, topic in enumerate([*["many/1"] * 10, "few/x", "few/x"]):
            pub.send(P.Publish(topic, b"%d" % i, qos=1, packet_id=i + 1))
            assert isinstance(pub.recv(timeout=10.0), P.PubAck)

        back = RawMQTT(srv)
        assert back.connect("away", clean=False).session_present is True
        got = []
        while True:
            try:
                pkt = back.recv(timeout=1.0)
            except (socket.timeout, TimeoutError):
                break
            got.append((pkt.topic, pkt.payload))
            back.send(P.PubAck(pkt.packet_id))
        assert sorted(got) == sorted([("many/1", b"7"), ("many/1", b"8"), ("many/1", b"9"),
                                      ("few/x", b"10"), ("few/x", b"11")])
        assert _metric(srv, 'lmqtt_dropped_messages_total{reason="offline_backlog"}') == 7
        for i in range(5):                            # online again: nothing trimmed
            pub.send(P.Publish("many/1", b"live-%d" % i, qos=1, packet_id=100 + i))
            assert isinstance(pub.recv(timeout=10.0), P.PubAck)
        live = []
        for _ in range(5):
            pkt = back.recv(timeout=10.0)
            live.append(pkt.payload)
            back.send(P.PubAck(pkt.packet_id))
        assert live == [b"live-%d" % i for i in range(5)]
        for c in (back, pub):
            c.close()
    finally:
        srv.stop()
