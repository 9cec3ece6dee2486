"""Users and ACL rules managed live (`--live-security`, `lmqtt admin --user-add / --acl-add ...`):
real `lmqtt serve` and `lmqtt store` + `lmqtt gateway` processes, `lmqtt admin` run as the real
command, raw MQTT 5 clients. A user added connects at once; a rule added or removed changes what a
client that stays connected may publish and subscribe, at its next packet; everything is kept in
the store across a kill -9."""
from __future__ import annotations

import json
import time

import pytest

from tests.integrations.test_http_auth import _connect, _publish, _subscribe
from tests.support import LmqttGateway, LmqttServer, LmqttStore, lmqtt_cli

pytestmark = pytest.mark.timeout(240)


def admin(store: str, *args: str, stdin: str | None = None):
    r = lmqtt_cli("admin", "--store", store, *args, input=stdin)
    assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r.stdout


def _until(fn, want, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while (got := fn()) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def test_users_and_rules_change_live_and_survive_a_kill9(tmp_path):
    srv = LmqttServer(str(tmp_path / "data"), extra_args=("--live-security", "--sys-interval", "0"),
                      log_path=str(tmp_path / "serve.log")).start()
    store = srv.store_address
    try:
        c, ack = _connect(srv, "bob-1", "bob", "bob-pw")
        assert ack.reason_code == 0x86, ack              # no such user yet
        c.close()
        out = admin(store, "--user-add", "bob", stdin="bob-pw\n")
        assert "user bob added" in out, out
        users = json.loads(admin(store, "--users", "--format", "json"))["users"]
        assert list(users) == ["bob"] and "hash" not in users["bob"]
        bob, ack = _connect(srv, "bob-1", "bob", "bob-pw")
        assert ack.reason_code == 0, ack
        c, ack = _connect(srv, "bob-2", "bob", "wrong")
        assert ack.reason_code == 0x86, ack
        c.close()
        # a rule added while bob stays connected: his next PUBLISH and SUBSCRIBE obey it
        assert _publish(bob, "plant/1", 1).reason_code == 0
        admin(store, "--acl-add", "deny user:bob publish plant/#")
        admin(store, "--acl-add", "deny user:bob subscribe plant/#")
        assert _publish(bob, "plant/1", 2).reason_code == 0x87
        assert _subscribe(bob, "plant/#", 3).reason_codes == [0x87]
        assert _publish(bob, "other/1", 4).reason_code == 0
        listed = admin(store, "--acls")
        assert "1  deny user:bob publish plant/#" in listed and "2  deny user:bob subscribe plant/#" in listed, listed
        # a default decides what no rule does
        admin(store, "--acl-default", "deny")
        assert _publish(bob, "other/2", 5).reason_code == 0x87
        admin(store, "--acl-add", "allow user:bob publish other/#", "--position", "1")
        assert _publish(bob, "other/3", 6).reason_code == 0
        admin(store, "--acl-remove", "deny user:bob publish plant/#")
        admin(store, "--acl-default", "none")
        assert _publish(bob, "plant/2", 7).reason_code == 0
        # a mistyped rule is refused by name, nothing changes
        r = lmqtt_cli("admin", "--store", store, "--acl-add", "allow bob publish x")
        assert r.returncode == 2 and "bad WHO 'bob'" in r.stderr, r.stderr
        # kept in the store: after a kill -9 the user and the rules are back
        bob.close()
        srv.restart(kill=True)
        bob, ack = _connect(srv, "bob-3", "bob", "bob-pw")
        assert ack.reason_code == 0, ack
        assert _subscribe(bob, "plant/#", 8).reason_codes == [0x87]
        # a user removed: connected clients stay, new connections are refused
        admin(store, "--user-remove", "bob")
        assert _publish(bob, "other/4", 9).reason_code == 0
        c, ack = _connect(srv, "bob-4", "bob", "bob-pw")
        assert ack.reason_code == 0x86, ack
        c.close()
        bob.close()
        r = lmqtt_cli("admin", "--store", store, "--user-remove", "bob")
        assert r.returncode == 4 and "no user 'bob'" in r.stderr, r.stderr
    finally:
        assert srv.stop() == 0, srv.log_tail()


def test_a_fleet_gateway_applies_changes_made_at_its_store(tmp_path):
    st = LmqttStore(str(tmp_path / "store"), log_path=str(tmp_path / "store.log")).start()
    gw = None
    try:
        admin(st.address, "--user-add", "eve", "--password", "eve-pw")
        gw = LmqttGateway(st.address, ("--live-security", "--sys-interval", "0"), log_dir=str(tmp_path)).start()
        deadline = time.monotonic() + 10         # the banner comes once the metrics port is up too
        banner: list[str] = []
        while not banner and time.monotonic() < deadline:
            with open(gw.log_path) as f:
                banner = [ln.strip() for ln in f if ln.strip().startswith("auth:")]
            time.sleep(0.1)
        assert banner == ["auth:       live; anonymous refused"], banner   # no "ACL None": it has no ACL file
        eve, ack = _connect(gw, "eve-1", "eve", "eve-pw")
        assert ack.reason_code == 0, (ack, gw.log_tail())
        assert _publish(eve, "fleet/1", 1).reason_code == 0
        admin(st.address, "--acl-add", "deny user:eve publish fleet/#")
        pid = [10]

        def code():
            pid[0] += 1
            return _publish(eve, "fleet/1", pid[0]).reason_code
        assert _until(code, 0x87) == 0x87                   # within the gateway's 1 s poll
        eve.close()
        admin(st.address, "--user-add", "frank", "--password", "frank-pw")

        def frank():
            c, ack = _connect(gw, "frank-1", "frank", "frank-pw")
            c.close()
            return ack.reason_code
        assert _until(frank, 0) == 0
    finally:
        if gw is not None:
            gw.stop()
        assert st.stop() == 0, st.log_tail()
