"""`lmqtt bench compare --password` without mosquitto_passwd writes the password file itself
(loadtest/compare.py `mosquitto_hash`, so the load tool needs nothing of the gateway): the line it
writes is one lmqtt's password check accepts for the password, and only for it."""
from __future__ import annotations

from lmqtt.gateway.security.auth import verify_password
from lmqtt.loadtest.compare import mosquitto_hash


def test_the_bench_password_hash_is_one_lmqtt_accepts():
    h = mosquitto_hash("bench-secret")
    assert h.startswith("$7$101$")
    assert verify_password(h, b"bench-secret")
    assert not verify_password(h, b"bench-secreT")
    assert mosquitto_hash("bench-secret") != h          # a fresh salt each time
