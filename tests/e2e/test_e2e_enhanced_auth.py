"""MQTT 5 enhanced authentication (SCRAM-SHA-256 over AUTH packets) against a real `lmqtt serve`,
and `lmqtt gateway` over `lmqtt store` (docs/gateway.md "Security and listeners"), with a
password file written by `lmqtt passwd --scram` and an ACL.

The SCRAM client is driven with the project's own codec (tests/support.py `RawMQTT`): paho-mqtt
2.2 cannot take part in an enhanced-authentication exchange (its packet dispatcher has no AUTH
handler: an AUTH from the server is "Unrecognised command" and a protocol error), so it is used
here only as the bystander that must keep being served, and to check that Mosquitto itself still
reads the password file with the SCRAM field."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import types

import pytest

from lmqtt.gateway.security import passwd
from lmqtt.gateway.mqtt import ReasonCode as RC, packets as P
from lmqtt.gateway.security.scram import ScramClient
from tests.support import ROOT, SERVER_KINDS, Paho, RawMQTT, free_port, listening, per_test, serve_or_fleet

METHOD = "SCRAM-SHA-256"
ACL = """\
default deny
allow user:alice all alice/#
allow user:bob   all #
"""


@pytest.fixture(scope="module", params=SERVER_KINDS)
def server_shared(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"enhanced-auth-{request.param}")
    pw = str(tmp / "passwd")
    assert passwd.main(["-c", "-b", "--scram", pw, "alice", "pencil"]) == 0
    assert passwd.main(["-b", pw, "bob", "builder"]) == 0          # a password-only user
    (tmp / "acl").write_text(ACL)
    (tmp / "lmqtt.toml").write_text("connect_timeout_s = 2.0\n")
    servers = serve_or_fleet(request.param, tmp, ("--password-file", pw, "--acl-file", str(tmp / "acl"),
                                                  "--config", str(tmp / "lmqtt.toml")))
    srv = next(servers)
    srv.pwfile = pw
    try:
        yield srv
    finally:
        servers.close()


@pytest.fixture
def srv(server_shared):
    for _ in per_test(server_shared):
        yield server_shared


def _wait_log(srv, text: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while text not in srv.log_tail(40000) and time.monotonic() < deadline:
        time.sleep(0.05)
    return srv.log_tail(40000)


def _begin(srv, cid: str, user: str, password: str, method: str = METHOD):
    r = RawMQTT(srv, version=5)
    sc = ScramClient(user, password)
    r.send(P.Connect(cid, 5, True, 60, None, None, None,
                     P.Properties(authentication_method=method, authentication_data=sc.first())))
    return r, sc, r.recv()


def _login(srv, cid: str, user: str, password: str):
    """The whole exchange; returns (client, ScramClient, CONNACK)."""
    r, sc, challenge = _begin(srv, cid, user, password)
    assert isinstance(challenge, P.Auth), challenge
    assert challenge.reason_code == RC.CONTINUE_AUTHENTICATION
    r.send(P.Auth(RC.CONTINUE_AUTHENTICATION,
                  P.Properties(authentication_method=METHOD,
                               authentication_data=sc.final(challenge.properties.authentication_data))))
    return r, sc, r.recv()


def _bystander(srv, cid: str) -> Paho:
    c = Paho(srv, client_id=cid, version=5, connect=False)
    c.c.username_pw_set("bob", "builder")
    c.connect()
    return c


def test_scram_login_then_publish_and_subscribe_under_the_acl(srv):
    r, sc, ack = _login(srv, "scram-ok", "alice", "pencil")
    assert isinstance(ack, P.ConnAck) and ack.reason_code == 0, ack
    assert ack.properties.authentication_method == METHOD
    sc.verify(ack.properties.authentication_data)        # the server proved it holds our verifier
    r.send(P.Subscribe(1, [P.SubscriptionRequest("alice/#", qos=1), P.SubscriptionRequest("bob/#", qos=1)]))
    sub = r.recv()
    assert isinstance(sub, P.SubAck) and sub.reason_codes == [1, RC.NOT_AUTHORIZED]   # the ACL sees "alice"
    r.send(P.Publish("alice/t", b"hello", qos=1, packet_id=9))
    got = [r.recv(), r.recv()]
    assert {type(p) for p in got} == {P.PubAck, P.Publish}, got
    msg = next(p for p in got if isinstance(p, P.Publish))
    assert (msg.topic, msg.payload) == ("alice/t", b"hello")
    r.close()


def test_wrong_password_is_0x86_and_the_log_names_the_cause(srv):
    r, _sc, ack = _login(srv, "scram-bad", "alice", "wrong")
    assert isinstance(ack, P.ConnAck) and ack.reason_code == RC.BAD_USER_NAME_OR_PASSWORD
    assert "wrong password" not in (ack.properties.reason_string or "")      # the client learns nothing more
    assert r.closed_by_server()
    log = _wait_log(srv, "cause=\"SCRAM-SHA-256 user 'alice': authentication failed: wrong password")
    assert "reason_code=0x86" in log
    assert "cause=\"SCRAM-SHA-256 user 'alice': authentication failed: wrong password" in log
    # a password-only user has no verifier: refused alike, logged as unknown
    r2, _sc, ack2 = _login(srv, "scram-bob", "bob", "builder")
    assert ack2.reason_code == RC.BAD_USER_NAME_OR_PASSWORD
    assert "user 'bob': authentication failed: unknown user" in _wait_log(srv, "user 'bob': authentication failed")
    r2.close()


def test_unknown_method_is_0x8c(srv):
    r, _sc, ack = _begin(srv, "scram-krb", "alice", "pencil", method="GS2-KRB5")
    assert isinstance(ack, P.ConnAck) and ack.reason_code == RC.BAD_AUTHENTICATION_METHOD
    assert r.closed_by_server()
    assert "'GS2-KRB5' is not offered" in _wait_log(srv, "'GS2-KRB5' is not offered")


def test_stalled_exchange_is_closed_while_other_clients_are_served(srv):
    bob = _bystander(srv, "scram-bystander")
    bob.subscribe("news/#", qos=1)
    r, _sc, challenge = _begin(srv, "scram-stall", "alice", "pencil")
    assert isinstance(challenge, P.Auth)                  # ... and the client never answers
    t0 = time.monotonic()
    for i in range(5):                                    # meanwhile the server serves others
        bob.publish("news/x", str(i).encode(), qos=1)
        assert bob.get(timeout=5).payload == str(i).encode()
    ack = r.recv(timeout=10)                              # connect_timeout_s = 2 in this server
    assert isinstance(ack, P.ConnAck) and ack.reason_code == RC.NOT_AUTHORIZED, ack
    assert r.closed_by_server()
    assert 1.0 < time.monotonic() - t0 < 8.0
    assert "did not complete within connect_timeout_s" in _wait_log(srv, "did not complete within connect_timeout_s")
    bob.publish("news/y", b"after", qos=1)
    assert bob.get(timeout=5).payload == b"after"
    bob.disconnect()


def test_publish_before_connack_during_the_exchange_is_a_protocol_error(srv):
    r, _sc, challenge = _begin(srv, "scram-early", "alice", "pencil")
    assert isinstance(challenge, P.Auth)
    r.send(P.Publish("alice/early", b"x", qos=0))
    ack = r.recv()
    assert isinstance(ack, P.ConnAck) and ack.reason_code == RC.PROTOCOL_ERROR
    assert r.closed_by_server()


def test_a_user_added_with_passwd_scram_logs_in_after_sighup(srv):
    assert passwd.main(["-b", "--scram", srv.pwfile, "carol", "c4rol"]) == 0
    os.kill(srv.proc.pid, signal.SIGHUP)
    _wait_log(srv, "event=reloaded what=password")
    r, sc, ack = _login(srv, "scram-carol", "carol", "c4rol")
    assert ack.reason_code == 0
    sc.verify(ack.properties.authentication_data)
    r.close()


@pytest.mark.skipif(shutil.which("mosquitto") is None, reason="mosquitto is not installed")
def test_mosquitto_still_reads_the_password_file_with_scram_fields(tmp_path):
    """The SCRAM verifier is a third field Mosquitto ignores: its users keep logging in there."""
    pw = str(tmp_path / "passwd")
    assert passwd.main(["-c", "-b", "--scram", pw, "alice", "pencil"]) == 0
    port = free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous false\npassword_file {pw}\n"
                    + ("user root\n" if os.geteuid() == 0 else ""))   # it reads the 0600 file as us
    proc = subprocess.Popen(["mosquitto", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        assert listening("127.0.0.1", port, 10, proc), "mosquitto did not start"
        srv = types.SimpleNamespace(host="127.0.0.1", port=port)
        # Mosquitto 2.0 refuses a wrong password with 0x87 (not authorized)
        for password, want in (("pencil", {0}), ("wrong", {RC.BAD_USER_NAME_OR_PASSWORD, RC.NOT_AUTHORIZED})):
            r = RawMQTT(srv, version=5)
            r.send(P.Connect(f"m-{password}", 5, True, 60, "alice", password.encode(), None, P.Properties()))
            ack = r.recv()
            assert isinstance(ack, P.ConnAck) and ack.reason_code in want, ack
            r.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


JS = os.path.join(ROOT, "tests", "js")
NODE = shutil.which("node")


@pytest.mark.skipif(NODE is None or not os.path.isdir(os.path.join(JS, "node_modules", "mqtt")),
                    reason="MQTT.js not installed (node + `npm ci --prefix tests/js`)")
def test_mqttjs_with_its_own_scram_client_logs_in_and_a_wrong_password_is_refused(srv):
    """An independent implementation on both sides of the exchange: MQTT.js drives the AUTH
    packets (its handleAuth hook) and tests/js/mqttjs_scram.mjs computes SCRAM with node's crypto
    from the RFC; it checks the server signature in CONNACK before publishing."""
    url = f"mqtt://{srv.host}:{srv.port}"

    def run(cid, password):
        r = subprocess.run([NODE, os.path.join(JS, "mqttjs_scram.mjs"), url, cid, "alice", password, "alice/js"],
                           capture_output=True, text=True, timeout=30, cwd=JS)
        lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
        assert lines, f"no output from node: {r.stderr[-2000:]}"
        return lines[-1]

    ok = run("js-scram-ok", "pencil")
    assert ok == {"event": "ok", "topic": "alice/js", "payload": "hello from mqtt.js", "serverVerified": True}
    bad = run("js-scram-bad", "wrong")
    assert bad["event"] == "refused" and bad["reasonCode"] == 0x86, bad
