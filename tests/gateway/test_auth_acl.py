"""Authentication and ACL rules (gateway/security/auth.py, gateway/security/acl.py): Mosquitto's own files, written by
the real mosquitto_passwd, verify here; lmqtt's hashes are Mosquitto's `$7$` form; ACL semantics of
both file formats."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from lmqtt.gateway.security.acl import AclError, AclFile, filter_covers, topic_matches
from lmqtt.gateway.security.auth import (AuthChain, AuthError, ClientCertificate, Credentials, HmacSignature, Identity,
                                PasswordFile, certificate_subject, hash_password, verify_password,
                                write_password_file)
from tests.support import free_port, listening

MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd")



def _denied(result, reason_part: str) -> bool:
    """A refusal (falsy, not None) whose logged reason names what was wrong."""
    from lmqtt.gateway.security.auth import Denied
    assert isinstance(result, Denied) and not result, result
    assert reason_part in result.reason, result.reason
    return True

def C(client_id="c1", username=None, password=None, cert=None):
    return Credentials(client_id, username, None if password is None else password.encode(), cert)


@pytest.mark.skipif(MOSQUITTO_PASSWD is None, reason="mosquitto_passwd not installed")
def test_a_password_file_written_by_mosquitto_passwd_verifies(tmp_path):
    pw = str(tmp_path / "passwd")
    subprocess.run([MOSQUITTO_PASSWD, "-c", "-b", pw, "alice", "s3cret"], check=True)
    subprocess.run([MOSQUITTO_PASSWD, "-b", pw, "bob", "p@ss:w0rd with spaces"], check=True)
    f = PasswordFile(pw)
    assert f.authenticate(C(username="alice", password="s3cret")).username == "alice"
    assert f.authenticate(C(username="bob", password="p@ss:w0rd with spaces")).method == "password"
    assert _denied(f.authenticate(C(username="alice", password="wrong")), "wrong password for user 'alice'")
    assert f.authenticate(C(username="carol", password="x")) is None       # not ours: next authenticator


@pytest.mark.skipif(shutil.which("mosquitto") is None, reason="mosquitto not installed")
def test_mosquitto_accepts_a_password_file_written_by_lmqtt(tmp_path):
    """The other direction: lmqtt's `$7$` hashes are what Mosquitto 2 reads."""
    pw = str(tmp_path / "passwd")
    write_password_file(pw, {"dave": hash_password("hunter2", iterations=1000)})
    assert oct(os.stat(pw).st_mode & 0o777) == "0o600"
    port = free_port()
    conf = tmp_path / "m.conf"
    # `user root`: otherwise Mosquitto started as root drops to `mosquitto`, who cannot enter tmp_path
    conf.write_text(f"user root\nlistener {port} 127.0.0.1\nallow_anonymous false\npassword_file {pw}\n")
    p = subprocess.Popen(["mosquitto", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import time

        import paho.mqtt.client as mqtt
        assert listening("127.0.0.1", port, 5, p), "mosquitto did not start"
        results = {}
        for name, password in (("ok", "hunter2"), ("bad", "nope")):
            c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"t-{name}")
            c.username_pw_set("dave", password)
            got = []
            c.on_connect = lambda cl, u, fl, rc, pr, got=got: got.append(rc)
            c.connect("127.0.0.1", port)
            c.loop_start()
            t_end = time.monotonic() + 5
            while not got and time.monotonic() < t_end:
                time.sleep(0.02)
            c.loop_stop()
            c.disconnect()
            results[name] = got[0].is_failure if got else None
        assert results == {"ok": False, "bad": True}
    finally:
        p.terminate()
        p.wait(5)


def test_hashes_are_salted_slow_and_never_plaintext(tmp_path):
    h1, h2 = hash_password("same"), hash_password("same")
    assert h1 != h2 and h1.startswith("$7$210000$")
    assert verify_password(h1, b"same") and not verify_password(h1, b"other")
    plain = tmp_path / "plain"
    plain.write_text("eve:letmein\n")
    with pytest.raises(AuthError, match=r"plain:1: user 'eve': the password is in plaintext"):
        PasswordFile(str(plain))


def test_password_file_changes_are_picked_up_and_a_broken_edit_keeps_the_last_good_file(tmp_path):
    pw = str(tmp_path / "passwd")
    write_password_file(pw, {"a": hash_password("1", iterations=1000)})
    f = PasswordFile(pw)
    assert f.authenticate(C(username="a", password="1"))
    write_password_file(pw, {"a": hash_password("2", iterations=1000)})
    f.reload()
    assert _denied(f.authenticate(C(username="a", password="1")), "wrong password")   # the cache was dropped
    assert f.authenticate(C(username="a", password="2"))
    with open(pw, "a") as fh:
        fh.write("garbage line\n")
    os.utime(pw, ns=(1, 1))
    assert f.authenticate(C(username="a", password="2"))                 # still the last good file


def test_hmac_signature_as_rocketmq_mqtt_signs_client_ids(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("AK1:topsecret\n")
    h = HmacSignature(str(keys))
    sig = HmacSignature.sign("topsecret", "dev-42")
    assert h.authenticate(C("dev-42", "Signature|AK1|inst", sig)).username == "AK1"
    assert h.authenticate(C("dev-42", "AK1", sig)).method == "hmac"
    assert _denied(h.authenticate(C("dev-43", "AK1", sig)), "does not sign client id 'dev-43'")  # another id
    assert h.authenticate(C("dev-42", "AK2", sig)) is None


def test_chain_order_anonymous_switch_and_certificates(tmp_path):
    pw = str(tmp_path / "passwd")
    write_password_file(pw, {"alice": hash_password("pw", iterations=1000)})
    chain = AuthChain([PasswordFile(pw), ClientCertificate()], allow_anonymous=False)
    assert chain.authenticate(C(username="alice", password="pw")).username == "alice"
    assert chain.authenticate(C(username="alice", password="bad")) is None
    assert chain.authenticate(C()) is None                                # anonymous refused
    assert chain.authenticate(C(cert="gw-01")).username == "gw-01"
    assert AuthChain([], allow_anonymous=True).authenticate(C()).method == "anonymous"
    # the operator's log learns why; the client only gets the reason code
    assert _denied(chain.check(C(username="mallory", password="x")), "unknown user 'mallory'")
    assert _denied(chain.check(C(username="alice", password="bad")), "wrong password for user 'alice'")
    assert _denied(chain.check(C()), "anonymous clients are not allowed")
    # a hash not computed yet is slow (run off the event loop); a remembered one is not
    assert chain.is_slow(C(username="alice", password="other"))
    assert not chain.is_slow(C(username="alice", password="pw"))          # verified above: cached
    assert not chain.is_slow(C(username="nobody", password="x"))           # no hash to compute
    assert certificate_subject({"subject": ((("commonName", "dev-9"),),)}) == "dev-9"
    assert certificate_subject({"subject": (), "subjectAltName": (("DNS", "dev.example"),)}) == "dev.example"


@pytest.mark.parametrize("flt,topic,want", [
    ("a/#", "a", True), ("a/#", "a/b/c", True), ("a/+", "a/b", True), ("a/+", "a/b/c", False),
    ("#", "$SYS/x", False), ("$SYS/#", "$SYS/x", True), ("+/b", "a/b", True), ("a/b", "a/b/", False),
])
def test_topic_matches(flt, topic, want):
    assert topic_matches(flt, topic) is want


@pytest.mark.parametrize("rule,req,want", [
    ("sensors/#", "sensors/+/temp", True), ("sensors/+/temp", "sensors/#", False),
    ("sensors/+/temp", "sensors/a/temp", True), ("sensors/a/temp", "sensors/+/temp", False),
    ("#", "a/b", True), ("#", "$SYS/#", False), ("+/+", "a/+", True), ("a/+", "a/#", False),
])
def test_filter_covers(rule, req, want):
    assert filter_covers(rule, req) is want


MOSQ_ACL = """
# anonymous clients
topic read public/#

user alice
topic readwrite sensors/alice/#
topic read sensors/#
topic deny sensors/secret/#

user bob
topic write cmd/bob

pattern readwrite devices/%c/#
pattern read users/%u/inbox
"""


def _ident(user, cid="c1", method="password"):
    return Identity(user, cid, method if user else "anonymous")


def test_mosquitto_acl_file_semantics(tmp_path):
    p = tmp_path / "acl"
    p.write_text(MOSQ_ACL)
    acl = AclFile(str(p))
    alice, bob, anon = _ident("alice"), _ident("bob", "dev7"), _ident(None, "x")
    assert acl.can_publish(alice, "sensors/alice/temp")
    assert not acl.can_publish(alice, "sensors/bob/temp")                  # read only there
    assert acl.can_subscribe(alice, "sensors/+/temp")
    assert not acl.can_subscribe(alice, "sensors/secret/x")                 # deny wins
    assert acl.can_subscribe(alice, "sensors/#")                            # overlaps the denied area:
    assert acl.needs_read_check(alice, "sensors/#")                         # ... checked per message
    assert not acl.can_read(alice, "sensors/secret/x") and acl.can_read(alice, "sensors/k/t")
    assert not acl.needs_read_check(alice, "sensors/alice/#")
    assert acl.can_publish(bob, "cmd/bob") and not acl.can_subscribe(bob, "cmd/bob")
    assert acl.can_publish(bob, "devices/dev7/state")                       # %c
    assert not acl.can_publish(bob, "devices/dev8/state")
    assert acl.can_subscribe(bob, "users/bob/inbox") and not acl.can_subscribe(alice, "users/bob/inbox")
    assert acl.can_subscribe(anon, "public/news") and not acl.can_publish(anon, "public/news")
    assert not acl.can_subscribe(anon, "sensors/#")


LMQTT_ACL = """
default deny
deny   client:legacy-*  all        #
allow  user:alice       publish    sensors/alice/#
allow  cert:gw-01       subscribe  devices/+/state
allow  all              subscribe  inbox/%u/#
allow  anonymous        subscribe  public/#
deny   user:alice       subscribe  sensors/secret/#
allow  user:alice       subscribe  sensors/#
"""


def test_lmqtt_acl_first_match_wins_with_substitution_and_default(tmp_path):
    p = tmp_path / "acl"
    p.write_text(LMQTT_ACL)
    acl = AclFile(str(p))
    alice = _ident("alice")
    assert acl.can_publish(alice, "sensors/alice/t") and not acl.can_publish(alice, "sensors/bob/t")
    assert not acl.can_publish(_ident("alice", "legacy-3"), "sensors/alice/t")   # earlier deny
    assert acl.can_subscribe(Identity("gw", "g", "certificate", "gw-01"), "devices/+/state")
    assert acl.can_subscribe(alice, "inbox/alice/#") and not acl.can_subscribe(alice, "inbox/bob/#")
    assert not acl.can_subscribe(_ident(None), "inbox/%u/#")                  # no username: no match
    assert acl.can_subscribe(_ident(None), "public/x")
    assert not acl.can_subscribe(alice, "sensors/secret/a")
    assert acl.can_subscribe(alice, "sensors/+/temp") and acl.needs_read_check(alice, "sensors/+/temp")
    assert not acl.can_read(alice, "sensors/secret/temp") and acl.can_read(alice, "sensors/k/temp")
    assert acl.can_subscribe(alice, "sensors/kitchen/temp")
    assert not acl.needs_read_check(alice, "sensors/kitchen/temp")
    p.write_text("default allow\n")
    acl.reload()
    assert acl.can_publish(_ident("anyone"), "x/y")


@pytest.mark.parametrize("text,msg", [
    ("allow user:a publish\n", r"acl:1: expected `allow\|deny WHO ACTION FILTER`"),
    ("allow group:a publish x\n", r"acl:1: bad WHO 'group:a'"),
    ("allow all read x\n", r"acl:1: bad action 'read'"),
    ("allow all publish a/#/b\n", r"acl:1: invalid topic filter 'a/#/b'"),
    ("user alice\ntopic readwrite\n", r"acl:2: `topic` needs a topic filter"),
    ("user alice\nallow all publish x\n", r"acl:2: unknown keyword 'allow'"),
    ("permit x\n", r"acl:1: unknown keyword 'permit'"),
])
def test_a_malformed_acl_names_the_line_and_keeps_the_previous_rules(tmp_path, text, msg):
    p = tmp_path / "acl"
    p.write_text("default allow\n")
    acl = AclFile(str(p))
    p.write_text(text)
    with pytest.raises(AclError, match=msg):
        acl.reload()
    assert acl.can_publish(_ident("x"), "a/b")                                 # previous rules in force


def _passwd(*args):
    import sys
    return subprocess.run([sys.executable, "-m", "lmqtt.gateway.security.passwd", *args], capture_output=True, text=True)


def test_lmqtt_passwd_creates_changes_deletes_and_upgrades_plaintext(tmp_path):
    pw = str(tmp_path / "passwd")
    assert _passwd("-b", pw, "alice", "x").returncode == 1                     # no file, no -c
    assert _passwd("-c", "-b", pw, "alice", "one-pw").returncode == 0
    assert _passwd("-b", pw, "bob", "two-pw").returncode == 0
    f = PasswordFile(pw)
    assert f.authenticate(C(username="alice", password="one-pw")) and f.authenticate(C(username="bob", password="two-pw"))
    assert "one-pw" not in open(pw).read()                               # "-" is outside the base64 of salt and hash
    assert _passwd("-D", pw, "alice").returncode == 0
    r = _passwd("-D", pw, "alice")
    assert r.returncode == 1 and "not in" in r.stderr
    f.reload()
    assert f.authenticate(C(username="alice", password="one-pw")) is None
    plain = tmp_path / "plain"
    plain.write_text("carol:pw3\n# comment\ndave:$7$101$cHLBo9T75EyCMnAY$2ceqdEz08ZPhlvze5VkEyuox8gVZWmRR3a2AT+LVDjyzcuUnG9VSVZuz4baL6m0BQARkGIRX5HKUE8+FOk6B4A==\n")
    assert _passwd("-U", str(plain)).returncode == 0
    g = PasswordFile(str(plain))
    assert g.authenticate(C(username="carol", password="pw3"))
    assert g.authenticate(C(username="dave", password="secret1"))               # kept as it was


SECRET = "a-32-byte-shared-secret-for-hs256"


def test_jwt_hs256_and_rs256_with_expiry_issuer_and_client_id_binding(tmp_path):
    import time

    import jwt
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    from lmqtt.gateway.security.auth import JwtToken
    now = int(time.time())
    hs = JwtToken(secret=SECRET, issuer="idp")
    tok = jwt.encode({"sub": "dev-1", "exp": now + 60, "iss": "idp", "clientid": "c-1"}, SECRET, algorithm="HS256")
    assert hs.authenticate(C("c-1", None, tok)).username == "dev-1"
    assert hs.authenticate(C("c-1", "dev-1", tok)).method == "jwt"
    assert _denied(hs.authenticate(C("c-1", "someone-else", tok)), "JWT is for user 'dev-1'")
    assert _denied(hs.authenticate(C("c-2", None, tok)), "bound to client id 'c-1'")
    expired = jwt.encode({"sub": "d", "exp": now - 3600, "iss": "idp"}, SECRET, algorithm="HS256")
    assert _denied(hs.authenticate(C("c", None, expired)), "JWT expired")
    no_exp = jwt.encode({"sub": "d", "iss": "idp"}, SECRET, algorithm="HS256")
    assert _denied(hs.authenticate(C("c", None, no_exp)), "exp")
    wrong_iss = jwt.encode({"sub": "d", "exp": now + 60, "iss": "other"}, SECRET, algorithm="HS256")
    assert _denied(hs.authenticate(C("c", None, wrong_iss)), "issuer")
    assert hs.authenticate(C("c", "u", "not-a-token")) is None                 # a password: not ours
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pub = tmp_path / "pub.pem"
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    rs = JwtToken(public_key_file=str(pub))
    good = jwt.encode({"sub": "fleet-7", "exp": now + 60}, key, algorithm="RS256")
    assert rs.authenticate(C("x", None, good)).username == "fleet-7"
    forged = jwt.encode({"sub": "fleet-7", "exp": now + 60}, "g" * 32, algorithm="HS256")
    assert _denied(rs.authenticate(C("x", None, forged)), "JWT")                # no algorithm confusion
