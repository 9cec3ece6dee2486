"""Listeners, authentication and ACL of a real `lmqtt serve` (docs/gateway.md "Security and
listeners"): password file (3.1.1 return codes 4/5, MQTT 5 0x86/0x87), ACL publish/subscribe
denial, SIGHUP reload without dropping connections, TLS with a required client certificate whose
CN is matched by an ACL rule, MQTT over WebSocket, and the refusal to serve a non-loopback address
without authentication."""
from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import time

import pytest

from lmqtt.gateway.security.auth import hash_password
from lmqtt.gateway.mqtt import packets as P
from tests.support import (SERVER_KINDS, LmqttServer, Paho, RawMQTT, before_sentinel, free_port, per_test,
                           pki_files, serve_or_fleet)

ACL = """\
# lmqtt ACL used by these tests
default deny
allow user:alice   all        #
allow user:bob     subscribe  open/#
allow user:bob     publish    open/#
allow user:dev-01  all        devices/dev-01/#
deny  user:carol   all        secret/#
allow user:carol   all        #
"""


def _pwfile(tmp_path, users: dict[str, str]) -> str:
    path = tmp_path / "passwd"
    # few iterations: the hash form is the real one, CONNECT stays fast in tests
    path.write_text("".join(f"{u}:{hash_password(p, iterations=1000)}\n" for u, p in users.items()))
    return str(path)


def _secured(kind, tmp_path):
    pw = _pwfile(tmp_path, {"alice": "wonder", "bob": "builder", "carol": "c4rol"})
    acl = tmp_path / "acl"
    acl.write_text(ACL)
    servers = serve_or_fleet(kind, tmp_path, ("--password-file", pw, "--acl-file", str(acl)))
    srv = next(servers)
    try:
        yield srv, acl
    finally:
        servers.close()


@pytest.fixture(scope="module", params=SERVER_KINDS)
def secured_shared(request, tmp_path_factory):
    """One secured server per kind for the tests that neither leave retained messages nor change
    the ACL (each uses its own client ids)."""
    yield from _secured(request.param, tmp_path_factory.mktemp(f"secured-{request.param}"))


@pytest.fixture
def secured(secured_shared):
    """`lmqtt serve`, and `lmqtt gateway` over `lmqtt store`, with a password file and an ACL:
    shared by the module (up when the test starts; the test's clients are closed when it ends)."""
    srv, acl = secured_shared
    for _ in per_test(srv):
        yield srv, acl


@pytest.fixture(params=SERVER_KINDS)
def secured_fresh(request, tmp_path):
    """A secured server of its own, for a test that leaves retained messages or rewrites the ACL."""
    yield from _secured(request.param, tmp_path)


def _wait_log(srv, text: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while text not in srv.log_tail(20000) and time.monotonic() < deadline:
        time.sleep(0.05)
    return srv.log_tail(20000)


def _raw_connect(srv, version, username=None, password=None, cid="c1"):
    r = RawMQTT(srv, version=version)
    r.send(P.Connect(cid, version, True, 60, username, password, None, P.Properties()))
    return r, r.recv()


def _paho(srv, user, pw, version=5, cid=""):
    c = Paho(srv, client_id=cid, version=version, connect=False)
    c.c.username_pw_set(user, pw)
    c.connect()
    return c


@pytest.mark.parametrize("version, bad_pw, no_creds", [(4, 4, 5), (5, 0x86, 0x87)])
def test_password_file_accepts_and_refuses(secured, version, bad_pw, no_creds):
    srv, _ = secured
    r, ack = _raw_connect(srv, version, "alice", b"wonder")
    assert isinstance(ack, P.ConnAck) and ack.reason_code == 0
    r.sock.close()
    for user, pw, want in (("alice", b"wrong", bad_pw), ("mallory", b"x", bad_pw), (None, None, no_creds)):
        r, ack = _raw_connect(srv, version, user, pw, cid="c2")
        assert isinstance(ack, P.ConnAck) and ack.reason_code == want, (user, ack)
        assert r.recv() is None          # and the connection is closed
        r.sock.close()


def test_acl_publish_denied_mqtt5_gets_0x87_and_nothing_is_delivered(secured):
    srv, _ = secured
    sub = _paho(srv, "alice", "wonder")
    sub.subscribe("#", qos=1)
    r, ack = _raw_connect(srv, 5, "bob", b"builder", cid="bob")
    assert ack.reason_code == 0
    r.send(P.Publish("secret/x", b"no", qos=1, packet_id=7))
    pa = r.recv()
    assert isinstance(pa, P.PubAck) and pa.packet_id == 7 and pa.reason_code == 0x87
    r.send(P.Publish("open/x", b"yes", qos=1, packet_id=8))
    pa = r.recv()
    assert isinstance(pa, P.PubAck) and pa.reason_code == 0
    got = sub.get(timeout=5)
    assert (got.topic, got.payload) == ("open/x", b"yes")
    assert sub.before_sentinel(sub, "open/x") == []          # the denied message was never stored
    sub.disconnect()


def test_acl_publish_denied_mqtt311_is_acked_and_dropped(secured):
    srv, _ = secured
    sub = _paho(srv, "alice", "wonder", version=4)
    sub.subscribe("#", qos=1)
    r, ack = _raw_connect(srv, 4, "bob", b"builder", cid="bob4")
    assert ack.reason_code == 0
    r.send(P.Publish("secret/x", b"no", qos=1, packet_id=3))
    pa = r.recv()
    assert isinstance(pa, P.PubAck) and pa.packet_id == 3
    r.send(P.Publish("open/y", b"yes", qos=1, packet_id=4))
    assert isinstance(r.recv(), P.PubAck)
    got = sub.get(timeout=5)
    assert got.topic == "open/y" and sub.before_sentinel(sub, "open/y") == []
    sub.disconnect()


@pytest.mark.parametrize("version, denied", [(4, 0x80), (5, 0x87)])
def test_acl_subscribe_denied_per_filter(secured, version, denied):
    srv, _ = secured
    r, ack = _raw_connect(srv, version, "bob", b"builder", cid=f"bob-s{version}")
    assert ack.reason_code == 0
    r.send(P.Subscribe(1, [P.SubscriptionRequest("open/#", 1), P.SubscriptionRequest("secret/#", 1)]))
    sa = r.recv()
    assert isinstance(sa, P.SubAck) and sa.reason_codes == [1, denied]


def test_retained_on_subscribe_obeys_read_rules(secured_fresh):
    srv, _ = secured_fresh
    alice = _paho(srv, "alice", "wonder")
    alice.publish("open/r", b"visible", qos=1, retain=True)
    alice.publish("secret/r", b"hidden", qos=1, retain=True)
    bob = _paho(srv, "bob", "builder")
    assert bob.subscribe("open/#", qos=1) == [1]
    got = bob.get(timeout=5)
    assert (got.topic, got.payload) == ("open/r", b"visible")
    assert bob.drain(0.5) == []
    bob.disconnect()
    alice.disconnect()


def test_sighup_reloads_acl_for_new_subscriptions_without_dropping_clients(secured_fresh):
    srv, acl = secured_fresh
    bob = _paho(srv, "bob", "builder")
    rcs = bob.subscribe("news/#", qos=1)
    assert [int(getattr(x, "value", x)) for x in rcs] == [0x87]
    acl.write_text(ACL + "allow user:bob subscribe news/#\n")
    os.kill(srv.proc.pid, signal.SIGHUP)
    assert "event=reloaded what=acl" in _wait_log(srv, "event=reloaded what=acl")
    rcs = bob.subscribe("news/#", qos=1)            # same connection, new rules
    assert [int(getattr(x, "value", x)) for x in rcs] == [1]
    alice = _paho(srv, "alice", "wonder")
    alice.publish("news/today", b"n", qos=1)
    assert bob.get(timeout=5).payload == b"n"
    assert bob.disconnects.empty()
    # a broken file keeps the rules in force
    acl.write_text("this is not an acl\n")
    os.kill(srv.proc.pid, signal.SIGHUP)
    assert "event=reload_failed what=acl" in _wait_log(srv, "event=reload_failed what=acl")
    alice.publish("news/later", b"m", qos=1)
    assert bob.get(timeout=5).payload == b"m"
    bob.disconnect()
    alice.disconnect()


@pytest.fixture
def pki(tmp_path):
    pytest.importorskip("trustme")
    return pki_files(tmp_path)


def test_tls_listener_with_required_client_certificate_and_cn_acl(tmp_path, pki):
    acl = tmp_path / "acl"
    acl.write_text(ACL)
    tls_port = free_port()
    srv = LmqttServer(str(tmp_path / "data"), log_path=str(tmp_path / "serve.log"), extra_args=(
        "--tls-port", str(tls_port), "--cert", pki["cert"], "--key", pki["key"], "--cafile", pki["ca"],
        "--require-certificate", "--acl-file", str(acl))).start()
    try:
        assert f"mqtts://127.0.0.1:{tls_port} (TLS)" in _wait_log(srv, "mqtts://")
        c = Paho(srv, client_id="dev", version=5, connect=False)
        c.port = tls_port
        c.c.tls_set(ca_certs=pki["ca"], certfile=pki["client"], keyfile=pki["client"])
        c.connect()
        assert c.subscribe("devices/dev-01/#", qos=1) == [1]
        rcs = c.subscribe("devices/dev-02/#", qos=1)
        assert [int(getattr(x, "value", x)) for x in rcs] == [0x87]
        c.publish("devices/dev-01/t", b"21.5", qos=1)
        got = c.get(timeout=5)
        assert (got.topic, got.payload) == ("devices/dev-01/t", b"21.5")
        c.disconnect()
        # without a client certificate the TLS handshake fails
        import socket
        ctx = ssl.create_default_context(cafile=pki["ca"])
        with socket.create_connection(("127.0.0.1", tls_port), timeout=5) as s:
            with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
                with ctx.wrap_socket(s, server_hostname="127.0.0.1") as ts:
                    ts.sendall(b"\x10\x00")
                    if not ts.recv(10):
                        raise ConnectionError("closed")
    finally:
        srv.stop()


def test_websocket_and_secure_websocket_listeners(tmp_path, pki):
    ws_port, wss_port = free_port(), free_port()
    srv = LmqttServer(str(tmp_path / "data"), log_path=str(tmp_path / "serve.log"), extra_args=(
        "--ws-port", str(ws_port), "--wss-port", str(wss_port), "--cert", pki["cert"], "--key", pki["key"])).start()
    try:
        import paho.mqtt.client as mqtt
        tcp = Paho(srv, version=5)
        tcp.subscribe("ws/#", qos=1)
        for port, tls in ((ws_port, False), (wss_port, True)):
            c = Paho(srv, version=5, connect=False)
            c.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5, transport="websockets")
            c.c.ws_set_options(path="/mqtt")
            c.c.on_connect = lambda cl, u, flags, rc, props, c=c: c.connack.put((flags, rc, props))
            c.c.on_publish = None
            if tls:
                c.c.tls_set(ca_certs=pki["ca"])
            c.port = port
            c.connect()
            c.c.publish(f"ws/{port}", b"over-ws", qos=1).wait_for_publish(5)
            got = tcp.get(timeout=5)
            assert (got.topic, got.payload) == (f"ws/{port}", b"over-ws")
            c.c.disconnect()
            c.c.loop_stop()
        tcp.disconnect()
    finally:
        srv.stop()


def _serve_once(tmp_path, *args, timeout=30):
    return subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "serve", "--data-dir", str(tmp_path / "d"),
                           "--metrics-port", "0", "--store-port", "0", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_non_loopback_without_auth_refuses_to_start(tmp_path):
    r = _serve_once(tmp_path, "--host", "0.0.0.0", "--port", "0")
    assert r.returncode == 2
    assert "refusing to listen on 0.0.0.0 (not loopback) without authentication" in r.stderr
    assert "--allow-anonymous" in r.stderr
    assert not (tmp_path / "d" / "store").exists()        # refused before opening anything


def test_startup_errors_name_the_cause(tmp_path, pki):
    r = _serve_once(tmp_path, "--port", "0", "--tls-port", str(free_port()), "--cert", str(tmp_path / "nope.pem"),
                    "--key", pki["key"])
    assert r.returncode == 2 and "nope.pem: no such file" in r.stderr
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = _serve_once(tmp_path, "--port", "0", "--ws-port", str(port))
    assert r.returncode == 1 and f"cannot listen on WebSocket 127.0.0.1:{port} (--ws-port)" in r.stderr
    r = _serve_once(tmp_path, "--port", "0", "--password-file", str(tmp_path / "missing"))
    assert r.returncode == 2 and "cannot read password file" in r.stderr


def test_will_to_a_denied_topic_is_dropped_connect_accepted(secured):
    srv, _ = secured
    alice = _paho(srv, "alice", "wonder")
    alice.subscribe("#", qos=1)
    for topic in ("secret/will", "open/will"):
        r = RawMQTT(srv, version=5)
        r.send(P.Connect(f"w-{topic}", 5, True, 60, "bob", b"builder", P.Will(topic, b"gone", 1, False),
                         P.Properties()))
        ack = r.recv()
        assert isinstance(ack, P.ConnAck) and ack.reason_code == 0
        r.sock.close()                  # no DISCONNECT: the will is due
    got = alice.get(timeout=5)
    assert (got.topic, got.payload) == ("open/will", b"gone")
    assert alice.drain(0.5) == []
    alice.disconnect()


def test_hmac_and_jwt_authentication(tmp_path):
    jwt = pytest.importorskip("jwt")
    from lmqtt.gateway.security.auth import HmacSignature
    keys = tmp_path / "keys"
    keys.write_text("AK1:s3cret\n")
    srv = LmqttServer(str(tmp_path / "data"), log_path=str(tmp_path / "serve.log"), extra_args=(
        "--hmac-keys", str(keys), "--jwt-secret", "jwt-key-for-tests-0123456789abcdef")).start()
    try:
        sig = HmacSignature.sign("s3cret", "dev-7").encode()
        r, ack = _raw_connect(srv, 5, "Signature|AK1|inst", sig, cid="dev-7")
        assert ack.reason_code == 0
        r, ack = _raw_connect(srv, 5, "Signature|AK1|inst", sig, cid="dev-8")   # signed for another id
        assert ack.reason_code == 0x86
        tok = jwt.encode({"sub": "svc", "exp": int(time.time()) + 60}, "jwt-key-for-tests-0123456789abcdef",
                         algorithm="HS256")
        r, ack = _raw_connect(srv, 4, "svc", tok.encode(), cid="svc-1")
        assert ack.reason_code == 0
        bad = jwt.encode({"sub": "svc", "exp": int(time.time()) + 60}, "another-key-0123456789abcdefghij",
                         algorithm="HS256")
        r, ack = _raw_connect(srv, 4, "svc", bad.encode(), cid="svc-2")
        assert ack.reason_code == 4
    finally:
        srv.stop()


def test_subscription_overlapping_a_denied_area_is_filtered_at_delivery(secured):
    srv, _ = secured
    carol = _paho(srv, "carol", "c4rol")
    assert carol.subscribe("#", qos=1) == [1]              # allowed: '#' is not inside secret/#
    assert carol.subscribe("secret/#", qos=1) == [0x87]
    shared = _paho(srv, "carol", "c4rol", cid="carol-shared")
    assert shared.subscribe("$share/g/#", qos=1) == [1]
    alice = _paho(srv, "alice", "wonder")
    for topic in ("secret/a", "open/a", "secret/b", "open/b"):
        alice.publish(topic, topic.encode(), qos=1)
    assert sorted(m.topic for m in carol.get_n(2)) == ["open/a", "open/b"]
    assert sorted(m.topic for m in shared.get_n(2)) == ["open/a", "open/b"]
    assert before_sentinel(alice, "open/c", carol, shared) == [[], []]
    for c in (carol, shared, alice):
        c.disconnect()


def test_each_login_refusal_has_its_code_and_log_cause_and_others_stay_served(tmp_path):
    """What an operator sees for each kind of failed login (the client only gets the code): wrong
    password, unknown user, expired JWT, tampered JWT, an HMAC signature for another client id;
    a connected client keeps publishing and receiving throughout."""
    import re

    import jwt

    from lmqtt.gateway.security.auth import HmacSignature
    pw = tmp_path / "passwd"
    pw.write_text(f"alice:{hash_password('4lice')}\n")
    keys = tmp_path / "hmac"
    keys.write_text("AK1:s3cret\n")
    secret = "jwt-key-for-tests-0123456789abcdef"
    srv = LmqttServer(str(tmp_path / "data"), log_path=str(tmp_path / "serve.log"), extra_args=(
        "--password-file", str(pw), "--hmac-keys", str(keys), "--jwt-secret", secret)).start()
    try:
        watcher = _paho(srv, "alice", "4lice", cid="bystander")
        watcher.subscribe("by/#", qos=1)
        now = int(time.time())
        cases = [
            ("alice", b"wrong", "c-wrong", r"wrong password for user 'alice'"),
            ("mallory", b"x", "c-unknown", r"unknown user 'mallory'"),
            ("svc", jwt.encode({"sub": "svc", "exp": now - 60}, secret, algorithm="HS256").encode(),
             "c-expired", r"JWT expired"),
            ("svc", jwt.encode({"sub": "svc", "exp": now + 60}, "another-key-0123456789abcdefghij",
                               algorithm="HS256").encode(), "c-tampered", r"JWT signature does not verify"),
            ("Signature|AK1|inst", HmacSignature.sign("s3cret", "dev-7").encode(), "dev-8",
             r"HMAC signature of access key 'AK1' does not sign client id"),
        ]
        for i, (user, password, cid, cause) in enumerate(cases):
            _r, ack = _raw_connect(srv, 5, user, password, cid=cid)
            assert ack.reason_code in (0x86, 0x87), (cid, ack.reason_code)
            assert cause.split(" '")[0] not in (ack.properties.reason_string or ""), "the client is not told why"
            deadline = time.monotonic() + 5
            while not re.search(r"event=connect_refused .*reason_code=0x8[67].*cause=.*" + cause, srv.log_tail(50000)):
                assert time.monotonic() < deadline, f"no log line for {cid}: {srv.log_tail(2000)}"
                time.sleep(0.05)
            watcher.publish(f"by/{i}", b"still here", qos=1)          # the broker goes on serving
            assert watcher.get(timeout=5).payload == b"still here"
        watcher.disconnect()
    finally:
        srv.stop()
