"""`--auth-http URL` end to end: a real `lmqtt serve` and a real HTTP service process answering in
EMQX's shape (tests/integrations/http_service.py). Allowed and denied users and topics, `ignore`
falling through to the password file and to the ACL file, a superuser, the decision cache, and
the service killed (refused: server unavailable, never allowed) and slow (the bounded timeout)."""
from __future__ import annotations

import time

import pytest

from lmqtt.gateway.mqtt import packets as P
from tests.integrations.support import HttpService
from tests.support import LmqttServer, RawMQTT, lmqtt_cli, metric

pytestmark = pytest.mark.timeout(180)


def _connect(srv, cid: str, user: str | None, pw: str | None, version: int = 5):
    c = RawMQTT(srv, version=version)
    c.send(P.Connect(cid, version, True, 60, user, pw.encode() if pw is not None else None))
    return c, c.recv(timeout=10)


def _answer(c: RawMQTT):
    """The next packet that is not a delivered PUBLISH (acknowledged and skipped)."""
    while True:
        p = c.recv(timeout=10)
        if not isinstance(p, P.Publish):
            return p
        if p.qos:
            c.send(P.PubAck(p.packet_id))


def _publish(c: RawMQTT, topic: str, pid: int):
    c.send(P.Publish(topic, b"x", qos=1, packet_id=pid))
    return _answer(c)


def _subscribe(c: RawMQTT, flt: str, pid: int):
    c.send(P.Subscribe(pid, [P.SubscriptionRequest(flt, 1)]))
    return _answer(c)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("authhttp")
    svc = HttpService(d)
    svc.set_rules({"users": {"alice": {"password": "alice-pw"}, "mallory": {"result": "deny"},
                             "root": {"password": "root-pw", "is_superuser": True}},
                   "unknown_user": "ignore",
                   "acl": [{"username": "alice", "action": "publish", "topic": "alice/#", "result": "allow"},
                           {"username": "alice", "action": "publish", "topic": "secret/#", "result": "deny"},
                           {"username": "alice", "action": "subscribe", "topic": "alice/#", "result": "allow"},
                           {"username": "alice", "action": "subscribe", "topic": "secret/#", "result": "deny"}],
                   "acl_default": "ignore"})
    svc.start()
    pw = d / "passwd"
    r = lmqtt_cli("passwd", "-c", "-b", str(pw), "filer", "filer-pw")
    assert r.returncode == 0, r.stderr
    acl = d / "acl"
    # what the service ignores, the ACL file decides: `filer` may use files/#, nothing else
    acl.write_text("default deny\nallow user:filer all files/#\nallow user:alice all shared/#\n")
    srv = LmqttServer(str(d / "data"), extra_args=("--auth-http", svc.url, "--password-file", str(pw),
                                                  "--acl-file", str(acl), "--auth-http-timeout-s", "1",
                                                  "--sys-interval", "0"),
                      log_path=str(d / "serve.log")).start()
    try:
        yield srv, svc
    finally:
        svc.kill()
        assert srv.stop() == 0, srv.log_tail()


def test_the_service_allows_and_denies_users(world):
    srv, svc = world
    c, ack = _connect(srv, "a1", "alice", "alice-pw")
    assert isinstance(ack, P.ConnAck) and ack.reason_code == 0, ack
    c.close()
    sent = svc.requests("/auth")[-1]
    assert sent["clientid"] == "a1" and sent["username"] == "alice" and sent["password"] == "alice-pw"
    assert sent["peerhost"] == "127.0.0.1" and sent["proto_ver"] == 5 and sent["protocol"] == "mqtt"
    for user, pw in (("alice", "wrong"), ("mallory", "any")):
        c, ack = _connect(srv, "x", user, pw)
        assert isinstance(ack, P.ConnAck) and ack.reason_code == 0x86, (user, ack)
        c.close()
    c, ack = _connect(srv, "x4", "mallory", "any", version=4)
    assert ack.reason_code == 4, ack          # 3.1.1: bad user name or password
    c.close()


def test_ignore_falls_through_to_the_password_file(world):
    srv, svc = world
    c, ack = _connect(srv, "f1", "filer", "filer-pw")
    assert ack.reason_code == 0, ack
    c.close()
    assert svc.requests("/auth")[-1]["username"] == "filer"      # asked first, said ignore
    c, ack = _connect(srv, "f2", "filer", "wrong")
    assert ack.reason_code == 0x86, ack
    c.close()
    c, ack = _connect(srv, "f3", "nobody", "x")       # ignored by the service, unknown to the file
    assert ack.reason_code == 0x86, ack
    c.close()


def test_publish_and_subscribe_are_decided_by_the_service_then_the_acl_file(world):
    srv, svc = world
    c, ack = _connect(srv, "a-acl", "alice", "alice-pw")
    assert ack.reason_code == 0
    try:
        assert _publish(c, "alice/t", 1).reason_code == 0
        assert _publish(c, "secret/t", 2).reason_code == 0x87
        assert _publish(c, "shared/t", 3).reason_code == 0            # ignored -> the ACL file allows
        assert _publish(c, "other/t", 4).reason_code == 0x87          # ignored -> the file's default deny
        assert _subscribe(c, "alice/#", 5).reason_codes == [1]
        assert _subscribe(c, "secret/#", 6).reason_codes == [0x87]
        acl = svc.requests("/acl")
        assert {"clientid": "a-acl", "username": "alice", "peerhost": "127.0.0.1", "topic": "alice/t",
                "action": "publish"} in acl, acl
        # cached per client and topic: the same publishes ask nothing more
        before = len(svc.requests("/acl"))
        for i in range(20):
            assert _publish(c, "alice/t", 100 + i).reason_code == 0
        assert len(svc.requests("/acl")) == before
    finally:
        c.close()


def test_a_superuser_is_not_subject_to_acls(world):
    srv, svc = world
    c, ack = _connect(srv, "root-1", "root", "root-pw")
    assert ack.reason_code == 0
    try:
        assert _publish(c, "secret/anything", 1).reason_code == 0
        assert _subscribe(c, "other/#", 2).reason_codes == [1]
        assert not [r for r in svc.requests("/acl") if r["clientid"] == "root-1"]
    finally:
        c.close()


def test_a_slow_service_refuses_within_the_timeout_and_allows_nothing(world):
    srv, svc = world
    svc.set_rules({"users": {"alice": {"password": "alice-pw"}}, "delay_s": 4})
    try:
        t0 = time.monotonic()
        c, ack = _connect(srv, "slow-1", "alice", "alice-pw")
        took = time.monotonic() - t0
        assert isinstance(ack, P.ConnAck) and ack.reason_code == 0x88, ack     # server unavailable
        assert took < 3.5, took                   # the 1 s timeout, not the service's 4 s
        c.close()
    finally:
        svc.set_rules({"users": {"alice": {"password": "alice-pw"}, "root": {"password": "root-pw",
                                                                             "is_superuser": True}},
                       "acl": [{"username": "alice", "action": "publish", "topic": "alice/#", "result": "allow"}]})
    assert "event=auth_http_failed kind=auth" in srv.log_tail(20000)


def test_a_killed_service_refuses_connects_and_uncached_publishes(world):
    srv, svc = world
    c, ack = _connect(srv, "before-kill", "alice", "alice-pw")
    assert ack.reason_code == 0
    assert _publish(c, "alice/cached", 1).reason_code == 0      # cached before the service goes
    svc.kill()
    try:
        assert _publish(c, "alice/cached", 2).reason_code == 0             # the cached decision holds
        assert _publish(c, "alice/new", 3).reason_code == 0x80             # not known, cannot be asked
        assert _subscribe(c, "alice/new/#", 4).reason_codes == [0x80]
        for version, want in ((5, 0x88), (4, 3)):
            c2, ack = _connect(srv, f"after-kill-{version}", "alice", "alice-pw", version)
            assert isinstance(ack, P.ConnAck) and ack.reason_code == want, ack
            c2.close()
        c3, ack = _connect(srv, "after-kill-filer", "filer", "filer-pw")   # not a fall-through: refused
        assert ack.reason_code == 0x88, ack
        c3.close()
    finally:
        c.close()
    assert metric(srv.metrics_url, 'lmqtt_auth_http_requests_total{kind="auth",outcome="unavailable"}') >= 3
    assert metric(srv.metrics_url, 'lmqtt_auth_http_requests_total{kind="acl",outcome="unavailable"}') >= 1
    assert "reason_code=0x88" in srv.log_tail(20000)
    svc.start()                                   # back: connects are allowed again
    c, ack = _connect(srv, "after-restart", "alice", "alice-pw")
    assert ack.reason_code == 0, ack
    c.close()


def test_a_cached_decision_is_asked_again_after_its_ttl(tmp_path):
    svc = HttpService(tmp_path)
    svc.set_rules({"users": {"ttl": {}}, "acl": [{"action": "publish", "topic": "t/#", "result": "allow"}]})
    svc.start()
    srv = LmqttServer(str(tmp_path / "data"), extra_args=("--auth-http", svc.url, "--auth-http-cache-s", "1",
                                                         "--sys-interval", "0"), log_path=str(tmp_path / "s.log")).start()
    try:
        c, ack = _connect(srv, "ttl-1", "ttl", "x")
        assert ack.reason_code == 0
        assert _publish(c, "t/1", 1).reason_code == 0
        svc.set_rules({"users": {"ttl": {}}, "acl": [{"action": "publish", "topic": "t/#", "result": "deny"}]})
        assert _publish(c, "t/1", 2).reason_code == 0          # the cached decision, within its TTL
        deadline, pid, code = time.monotonic() + 10, 3, 0
        while code == 0 and time.monotonic() < deadline:       # at most twice the TTL
            time.sleep(0.2)
            code = _publish(c, "t/1", pid).reason_code
            pid += 1
        assert code == 0x87
        c.close()
    finally:
        svc.kill()
        assert srv.stop() == 0, srv.log_tail()
