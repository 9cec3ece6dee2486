"""SCRAM-SHA-256 for MQTT 5 enhanced authentication (gateway/security/scram.py): RFC 7677's published
exchange, both sides of a fresh exchange, and every way it must fail."""
from __future__ import annotations

import base64

import pytest

from lmqtt.gateway.security.scram import ScramClient, ScramError, ScramServer, scram_credentials


def test_server_first_carries_the_stored_salt_and_iterations_and_extends_the_client_nonce():
    """RFC 7677 §3's user "user", password "pencil", salt W22ZaJ0SNY7soEsUEjb6gQ==, 4096 iterations."""
    stored = scram_credentials("pencil", 4096, base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ=="))
    server = ScramServer(lambda u: stored if u == "user" else None)
    server_first = server.first(b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO")
    attrs = dict(p.split("=", 1) for p in server_first.decode().split(","))
    assert attrs["s"] == "W22ZaJ0SNY7soEsUEjb6gQ==" and attrs["i"] == "4096"
    assert attrs["r"].startswith("rOprNGfwEbeRWgbNEkqO") and len(attrs["r"]) > len("rOprNGfwEbeRWgbNEkqO")


def test_a_full_exchange_authenticates_both_sides():
    stored = scram_credentials("s3cret")
    server = ScramServer({"alice": stored}.get)
    client = ScramClient("alice", "s3cret")
    server_final = server.final(client.final(server.first(client.first())))
    client.verify(server_final)
    assert server.username == "alice"


def test_the_rfc7677_client_proof_is_accepted():
    """The RFC's own client-final for its own server nonce verifies against its credentials."""
    stored = scram_credentials("pencil", 4096, base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ=="))
    server = ScramServer(lambda u: stored)
    server.first(b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO")
    server._nonce = "rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
    server._auth_message_prefix = ("n=user,r=rOprNGfwEbeRWgbNEkqO,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                                   "s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096")
    final = server.final(b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                         b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
    assert final == b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="


@pytest.mark.parametrize("user,password", [("alice", "wrong"), ("mallory", "anything")])
def test_a_wrong_password_or_unknown_user_fails_alike(user, password):
    server = ScramServer({"alice": scram_credentials("s3cret")}.get)
    client = ScramClient(user, password)
    sf = server.first(client.first())
    assert b"s=" in sf and b"i=" in sf                  # unknown users still get a challenge
    with pytest.raises(ScramError, match="authentication failed"):
        server.final(client.final(sf))


def test_tampering_and_protocol_misuse_are_refused():
    stored = scram_credentials("s3cret")
    server = ScramServer({"alice": stored}.get)
    client = ScramClient("alice", "s3cret")
    sf = server.first(client.first())
    cf = client.final(sf)
    with pytest.raises(ScramError, match="nonce mismatch"):
        server.final(cf.replace(b"r=", b"r=X", 1))
    with pytest.raises(ScramError, match="unexpected client-final"):
        server.final(cf)                                   # one exchange, one final
    with pytest.raises(ScramError, match="channel binding is not supported"):
        ScramServer({}.get).first(b"p=tls-unique,,n=a,r=x")
    with pytest.raises(ScramError, match="client-first needs"):
        ScramServer({}.get).first(b"n,,n=a")
    c2 = ScramClient("alice", "s3cret")
    good = ScramServer({"alice": stored}.get)
    sf2 = good.first(c2.first())
    good.final(c2.final(sf2))
    with pytest.raises(ScramError, match="server's signature is wrong"):
        c2.verify(b"v=" + base64.b64encode(b"\0" * 32))


# ------------------------------------------------------------- an independent client (RFC 5802 §3)
def _rfc_client_final(password: str, client_first_bare: str, server_first: str) -> tuple[str, str]:
    """client-final and the server-final it expects, computed from the RFC's formulas with hashlib
    and hmac only (none of gateway/security/scram.py), so a shared mistake cannot hide."""
    import hashlib
    import hmac
    attrs = dict(p.split("=", 1) for p in server_first.split(","))
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), base64.b64decode(attrs["s"]), int(attrs["i"]))
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    stored_key = hashlib.sha256(client_key).digest()
    without_proof = f"c=biws,r={attrs['r']}"
    auth_message = f"{client_first_bare},{server_first},{without_proof}".encode()
    signature = hmac.new(stored_key, auth_message, hashlib.sha256).digest()
    proof = bytes(a ^ b for a, b in zip(client_key, signature))
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()
    server_signature = hmac.new(server_key, auth_message, hashlib.sha256).digest()
    return (f"{without_proof},p={base64.b64encode(proof).decode()}",
            f"v={base64.b64encode(server_signature).decode()}")


RFC_SALT = "W22ZaJ0SNY7soEsUEjb6gQ=="
RFC_CLIENT_FIRST = "n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
RFC_SERVER_NONCE = "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
RFC_SERVER_FIRST = "r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
RFC_CLIENT_FINAL = ("c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                    "p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
RFC_SERVER_FINAL = "v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="


def test_rfc7677_test_vector_message_for_message():
    """RFC 7677 §3: the server, given the RFC's nonce, produces the RFC's server-first; the
    independent client computes the RFC's client-final from it; the server answers the RFC's
    server-final."""
    stored = scram_credentials("pencil", 4096, base64.b64decode(RFC_SALT))
    server = ScramServer({"user": stored}.get, server_nonce=RFC_SERVER_NONCE)
    server_first = server.first(RFC_CLIENT_FIRST.encode()).decode()
    assert server_first == RFC_SERVER_FIRST
    client_final, expected_server_final = _rfc_client_final("pencil", RFC_CLIENT_FIRST[3:], server_first)
    assert client_final == RFC_CLIENT_FINAL
    assert expected_server_final == RFC_SERVER_FINAL
    assert server.final(client_final.encode()).decode() == RFC_SERVER_FINAL
    assert server.username == "user"


def test_independent_client_with_fresh_nonces_and_a_wrong_password():
    stored = scram_credentials("s3cret", 4096)
    server = ScramServer({"alice": stored}.get)
    bare = "n=alice,r=Zm9vYmFyYmF6cXV4"
    sf = server.first(f"n,,{bare}".encode()).decode()
    cf, want = _rfc_client_final("s3cret", bare, sf)
    assert server.final(cf.encode()).decode() == want
    server2 = ScramServer({"alice": stored}.get)
    sf2 = server2.first(f"n,,{bare}".encode()).decode()
    assert sf2 != sf                                           # a fresh server nonce per exchange
    cf2, _ = _rfc_client_final("wrong", bare, sf2)
    with pytest.raises(ScramError, match="wrong password"):
        server2.final(cf2.encode())


def test_verifier_parsing_refuses_malformed_lines():
    from lmqtt.gateway.security.scram import ScramCredentials
    good = scram_credentials("x", 4096)
    assert ScramCredentials.parse(good).iterations == 4096
    for bad in ("$scram-sha-256$x$AA==$AA==$AA==", good.replace("$scram-sha-256$", "$scram-sha-1$"),
                good[:-4], "$scram-sha-256$4096$!!$AA==$AA=="):
        with pytest.raises(ScramError):
            ScramCredentials.parse(bad)


def test_authzid_empty_message_and_extensions_are_refused():
    server = lambda: ScramServer({}.get)   # noqa: E731
    with pytest.raises(ScramError, match="authorization identity"):
        server().first(b"n,a=admin,n=a,r=x")
    with pytest.raises(ScramError, match="empty"):
        server().first(b"")
    with pytest.raises(ScramError, match="extension"):
        server().first(b"n,,m=ext,n=a,r=x")


def test_wrong_credentials_are_scram_auth_failed_and_a_malformed_exchange_is_not():
    """The broker answers ScramAuthFailed with 0x86 and any other ScramError with 0x87
    (gateway/security/auth.py ScramLogin.step): the class, not the message, tells them apart."""
    from lmqtt.gateway.security.scram import ScramAuthFailed
    stored = scram_credentials("s3cret", 4096)

    def final_of(user: str, password: str, tamper=lambda cf: cf):
        server = ScramServer({"alice": stored}.get)
        client = ScramClient(user, password)
        with pytest.raises(ScramError) as e:
            server.final(tamper(client.final(server.first(client.first()))))
        return e.value

    assert isinstance(final_of("alice", "wrong"), ScramAuthFailed)                # wrong password
    assert isinstance(final_of("mallory", "x"), ScramAuthFailed)                  # unknown user
    short = final_of("alice", "s3cret", lambda cf: cf.rsplit(b",p=", 1)[0] + b",p=AAAA")
    assert isinstance(short, ScramAuthFailed) and "wrong length" in str(short)
    malformed = final_of("alice", "s3cret", lambda cf: cf.rsplit(b",p=", 1)[0] + b",p=!!")
    assert not isinstance(malformed, ScramAuthFailed) and "malformed proof" in str(malformed)
