"""MQTT 5 enhanced authentication (SCRAM-SHA-256) through the broker's packet handlers in-process
(gateway/security/enhanced_auth.py `EnhancedAuth`, gateway/security/auth.py `ScramLogin`): the AUTH exchange
packet by packet, every refusal's reason code and log cause, protocol errors, the stall timeout,
re-authentication, and `lmqtt passwd --scram` writing the verifier."""
from __future__ import annotations

import asyncio
import logging

import pytest

from lmqtt.gateway.security import passwd
from lmqtt.gateway.security.auth import PasswordFile, hash_password, read_password_file, split_entry
from lmqtt.gateway.app.config import build_config
from lmqtt.gateway.mqtt import ReasonCode as RC, packets as P
from lmqtt.gateway.security.scram import ScramClient, scram_credentials
from lmqtt.gateway.app.gateway import Gateway
from tests.gateway.test_broker_handlers import Client

METHOD = "SCRAM-SHA-256"


def _pwfile(tmp_path, scram_users: dict[str, str], plain_users: dict[str, str] | None = None) -> str:
    path = tmp_path / "passwd"
    lines = [f"{u}:{hash_password(p, iterations=1000)}:{scram_credentials(p, 4096)}\n" for u, p in scram_users.items()]
    lines += [f"{u}:{hash_password(p, iterations=1000)}\n" for u, p in (plain_users or {}).items()]
    path.write_text("".join(lines))
    return str(path)


def run(tmp_path, body, **cfg_extra):
    async def main():
        cfg = build_config({}, {"host": "127.0.0.1", "port": 0, "metrics_port": 0,
                                "data_dir": str(tmp_path / "data"), "segment_mb": 16,
                                "password_file": _pwfile(tmp_path, {"alice": "s3cret"}, {"bob": "builder"}),
                                **cfg_extra})
        gw = Gateway(cfg)
        await gw.start()
        try:
            return await body(gw)
        finally:
            await gw.stop()
    return asyncio.run(main())


def _connect_pkt(cid: str, data: bytes | None, method: str = METHOD, username=None) -> P.Connect:
    c = P.Connect(client_id=cid, protocol_level=5, username=username)
    c.properties.authentication_method = method
    c.properties.authentication_data = data
    return c


def _auth(rc: int, data: bytes | None, method: str = METHOD) -> P.Auth:
    a = P.Auth(rc)
    a.properties.authentication_method = method
    a.properties.authentication_data = data
    return a


async def _scram_login(c: Client, cid: str, user: str, password: str):
    """CONNECT/AUTH/AUTH; returns (the client, the final packet: CONNACK)."""
    sc = ScramClient(user, password)
    c.send(_connect_pkt(cid, sc.first()))
    challenge, = await c.wait_for(P.Auth)
    assert challenge.reason_code == RC.CONTINUE_AUTHENTICATION
    assert challenge.properties.authentication_method == METHOD
    c.send(_auth(RC.CONTINUE_AUTHENTICATION, sc.final(challenge.properties.authentication_data)))
    ack, = await c.wait_for(P.ConnAck)
    return sc, ack


def test_scram_login_connack_carries_the_server_signature_and_the_user_is_the_identity(tmp_path):
    async def body(gw):
        c = Client(gw)
        sc, ack = await _scram_login(c, "dev1", "alice", "s3cret")
        assert ack.reason_code == 0
        assert ack.properties.authentication_method == METHOD
        sc.verify(ack.properties.authentication_data)         # the server knows our verifier
        assert c.conn.connected and c.conn.identity.username == "alice"
        assert c.conn.identity.method == "scram"
        c.send(P.Subscribe(1, [P.SubscriptionRequest("t/#", qos=1)]))
        assert (await c.wait_for(P.SubAck))[0].reason_codes == [1]
        c.send(P.Publish("t/x", b"hello", qos=1, packet_id=5))
        msg, = await c.wait_for(P.Publish)
        assert msg.payload == b"hello"
    run(tmp_path, body)


@pytest.mark.parametrize("user, password, cause", [
    ("alice", "wrong", "wrong password"),
    ("mallory", "whatever", "unknown user"),
    ("bob", "builder", "unknown user"),        # a password-only user has no SCRAM verifier
])
def test_failed_scram_login_is_0x86_with_the_cause_only_in_the_log(tmp_path, caplog, user, password, cause):
    async def body(gw):
        c = Client(gw)
        with caplog.at_level(logging.INFO, logger="lmqtt.gateway"):
            _sc, ack = await _scram_login(c, "dev2", user, password)
        assert ack.reason_code == RC.BAD_USER_NAME_OR_PASSWORD
        assert cause not in (ack.properties.reason_string or "")
        assert c.transport.closed and not c.conn.connected
        line, = [r.getMessage() for r in caplog.records if "event=connect_refused" in r.getMessage()]
        assert "reason_code=0x86" in line and cause in line and f"user {user!r}" in line
        other = Client(gw)                                   # the server keeps serving
        assert (await _scram_login(other, "dev3", "alice", "s3cret"))[1].reason_code == 0
    run(tmp_path, body)


def test_unknown_method_is_0x8c_and_no_auth_packet_is_sent(tmp_path, caplog):
    async def body(gw):
        c = Client(gw)
        with caplog.at_level(logging.INFO, logger="lmqtt.gateway"):
            c.send(_connect_pkt("dev4", b"x", method="GS2-KRB5"))
            ack, = await c.wait_for(P.ConnAck)
        assert ack.reason_code == RC.BAD_AUTHENTICATION_METHOD
        assert not [p for p in c.packets() if isinstance(p, P.Auth)]
        assert "GS2-KRB5" in caplog.text and "is not offered" in caplog.text
    run(tmp_path, body)


def test_a_malformed_client_first_is_0x87(tmp_path):
    async def body(gw):
        c = Client(gw)
        c.send(_connect_pkt("dev5", b"p=tls-server-end-point,,n=alice,r=abc"))
        ack, = await c.wait_for(P.ConnAck)
        assert ack.reason_code == RC.NOT_AUTHORIZED
        assert c.transport.closed
    run(tmp_path, body)


def test_connect_username_must_match_the_scram_user(tmp_path):
    async def body(gw):
        c = Client(gw)
        sc = ScramClient("alice", "s3cret")
        c.send(_connect_pkt("dev6", sc.first(), username="bob"))
        ch, = await c.wait_for(P.Auth)
        c.send(_auth(RC.CONTINUE_AUTHENTICATION, sc.final(ch.properties.authentication_data)))
        ack, = await c.wait_for(P.ConnAck)
        assert ack.reason_code == RC.BAD_USER_NAME_OR_PASSWORD
    run(tmp_path, body)


@pytest.mark.parametrize("intruder", [
    P.Publish("t/x", b"sneak", qos=0),                          # MQTT-3.1.2-30: only AUTH/DISCONNECT
    _auth(RC.SUCCESS, None),                                    # AUTH 0x00 from a client mid-exchange
    _auth(RC.CONTINUE_AUTHENTICATION, b"c=biws", method="OTHER"),  # method changed
])
def test_wrong_packet_during_the_exchange_is_a_protocol_error(tmp_path, intruder):
    async def body(gw):
        c = Client(gw)
        c.send(_connect_pkt("dev7", ScramClient("alice", "s3cret").first()))
        await c.wait_for(P.Auth)
        c.send(intruder)
        ack, = await c.wait_for(P.ConnAck)
        assert ack.reason_code == RC.PROTOCOL_ERROR
        assert c.transport.closed and "dev7" not in gw.broker.sessions
    run(tmp_path, body)


def test_auth_on_a_password_login_is_a_protocol_error(tmp_path):
    async def body(gw):
        c = Client(gw)
        c.send(P.Connect(client_id="dev8", protocol_level=5, username="bob", password=b"builder"))
        ack, = await c.wait_for(P.ConnAck)
        assert ack.reason_code == 0
        c.send(_auth(RC.RE_AUTHENTICATE, b"n,,n=bob,r=x"))
        d, = await c.wait_for(P.Disconnect)
        assert d.reason_code == RC.PROTOCOL_ERROR
    run(tmp_path, body)


def test_a_stalled_exchange_is_refused_after_connect_timeout(tmp_path, caplog):
    async def body(gw):
        c = Client(gw)
        with caplog.at_level(logging.INFO, logger="lmqtt.gateway"):
            c.send(_connect_pkt("dev9", ScramClient("alice", "s3cret").first()))
            await c.wait_for(P.Auth)                         # ... and never answers
            for _ in range(60):
                if c.transport.closed:
                    break
                await asyncio.sleep(0.1)
        assert c.transport.closed
        ack, = await c.wait_for(P.ConnAck)
        assert ack.reason_code == RC.NOT_AUTHORIZED
        assert "did not complete within connect_timeout_s" in caplog.text
    run(tmp_path, body, connect_timeout_s=1.0)


def test_reauthentication_succeeds_and_a_failed_one_disconnects(tmp_path):
    async def body(gw):
        c = Client(gw)
        assert (await _scram_login(c, "dev10", "alice", "s3cret"))[1].reason_code == 0
        sc = ScramClient("alice", "s3cret")
        c.send(_auth(RC.RE_AUTHENTICATE, sc.first()))
        ch = (await c.wait_for(P.Auth, 2))[1]                # [0] was the login's challenge
        assert ch.reason_code == RC.CONTINUE_AUTHENTICATION
        c.send(_auth(RC.CONTINUE_AUTHENTICATION, sc.final(ch.properties.authentication_data)))
        done = (await c.wait_for(P.Auth, 3))[2]
        assert done.reason_code == RC.SUCCESS
        sc.verify(done.properties.authentication_data)
        c.send(P.PingReq())
        await c.wait_for(P.PingResp)                         # still connected
        bad = ScramClient("alice", "nope")
        c.send(_auth(RC.RE_AUTHENTICATE, bad.first()))
        ch2 = (await c.wait_for(P.Auth, 4))[3]
        c.send(_auth(RC.CONTINUE_AUTHENTICATION, bad.final(ch2.properties.authentication_data)))
        d, = await c.wait_for(P.Disconnect)
        assert d.reason_code == RC.NOT_AUTHORIZED             # DISCONNECT cannot carry 0x86
        assert c.transport.closed
    run(tmp_path, body)


def test_reauthentication_as_another_user_is_refused(tmp_path):
    async def body(gw):
        pw = gw.cfg.password_file
        with open(pw, "a") as f:                              # a second SCRAM user, picked up by mtime
            f.write(f"carol:{hash_password('c4rol', iterations=1000)}:{scram_credentials('c4rol')}\n")
        c = Client(gw)
        assert (await _scram_login(c, "dev11", "alice", "s3cret"))[1].reason_code == 0
        sc = ScramClient("carol", "c4rol")
        c.send(_auth(RC.RE_AUTHENTICATE, sc.first()))
        ch = (await c.wait_for(P.Auth, 2))[1]
        c.send(_auth(RC.CONTINUE_AUTHENTICATION, sc.final(ch.properties.authentication_data)))
        d, = await c.wait_for(P.Disconnect)
        assert d.reason_code == RC.NOT_AUTHORIZED
    run(tmp_path, body)


# ------------------------------------------------------------------------------ lmqtt passwd --scram
def test_passwd_scram_writes_a_verifier_kept_in_step_and_never_the_password(tmp_path):
    f = str(tmp_path / "pw")
    assert passwd.main(["-c", "-b", "--scram", f, "alice", "pencil"]) == 0
    assert passwd.main(["-b", f, "bob", "builder"]) == 0
    text = open(f).read()
    assert "pencil" not in text and "builder" not in text
    users = read_password_file(f)
    h, verifier = split_entry(users["alice"])
    assert h.startswith("$7$") and verifier.startswith("$scram-sha-256$4096$")
    assert split_entry(users["bob"])[1] is None
    pf = PasswordFile(f)
    sc = ScramClient("alice", "pencil")
    from lmqtt.gateway.security.scram import ScramServer
    srv = ScramServer(pf.scram_credentials)
    sc.verify(srv.final(sc.final(srv.first(sc.first()))))
    # a password change keeps the verifier, for the new password
    assert passwd.main(["-b", f, "alice", "newpw"]) == 0
    pf.reload()
    old, new = ScramClient("alice", "pencil"), ScramClient("alice", "newpw")
    s1, s2 = ScramServer(pf.scram_credentials), ScramServer(pf.scram_credentials)
    with pytest.raises(Exception, match="wrong password"):
        s1.final(old.final(s1.first(old.first())))
    s2.final(new.final(s2.first(new.first())))
    assert passwd.main(["-b", "--scram", "--scram-iterations", "100", f, "x", "y"]) == 2


def test_password_file_rejects_a_malformed_or_misplaced_verifier(tmp_path):
    from lmqtt.gateway.security.auth import AuthError
    f = tmp_path / "pw"
    f.write_text(f"alice:{scram_credentials('x')}\n")
    with pytest.raises(AuthError, match="must follow the password hash"):
        read_password_file(str(f))
    f.write_text(f"alice:{hash_password('x', iterations=1000)}:$scram-sha-256$4096$AA==\n")
    with pytest.raises(AuthError, match=r"pw:1: user 'alice'.*scram-sha-256"):
        read_password_file(str(f))
