"""SCRAM-SHA-256 for MQTT 5 enhanced authentication (gateway/scram.py): RFC 7677's published
exchange, both sides of a fresh exchange, and every way it must fail."""
from __future__ import annotations

import base64

import pytest

from lmqtt.gateway.scram import ScramClient, ScramError, ScramServer, scram_credentials


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
