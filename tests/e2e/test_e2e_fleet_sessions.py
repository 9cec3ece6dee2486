"""Persistent sessions across a fleet with real processes (docs/fleet.md "Sessions across gateways"): a
gateway restores at start only the sessions it served last (the others are loaded by whichever
gateway their client comes back to), and the store node ends at their expiry the sessions of a
gateway that is gone for good. Every wait is bounded; nothing asserts timings."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from lmqtt.store.client import connect
from tests.support import LmqttGateway, LmqttStore, Paho, free_port, metric, stop_all, until, wait_metric


def test_a_restarted_gateway_restores_only_its_own_sessions_and_the_others_resume_anywhere(tmp_path):
    """Three persistent sessions served by gateway A, two by B. B restarts: it holds its two again
    (it used to restore all five); a message published while B was down reaches B's session, and a
    session A served resumes on B with its subscription and the message it missed."""
    store = LmqttStore(str(tmp_path / "store"), log_path=str(tmp_path / "store.log")).start()
    a = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    b = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    try:
        for gw, cids in ((a, ("fs-a1", "fs-a2", "fs-a3")), (b, ("fs-b1", "fs-b2"))):
            for cid in cids:
                c = Paho(gw, cid, version=5, clean=False, expiry=3600)
                c.subscribe(f"fs/{cid}/#", 1)
                c.disconnect()
        assert wait_metric(a.metrics_url, "lmqtt_sessions", 3) == 3
        assert wait_metric(b.metrics_url, "lmqtt_sessions", 2) == 2
        # each record names the gateway that served it (what `lmqtt admin --sessions` shows)
        r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "admin", "--store", store.address,
                            "--sessions", "--format", "json"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert {x["client_id"]: x["gateway"] for x in json.loads(r.stdout)["sessions"]} == {
            **{c: f"test-{a.port}" for c in ("fs-a1", "fs-a2", "fs-a3")},
            **{c: f"test-{b.port}" for c in ("fs-b1", "fs-b2")}}
        b.stop()
        pub = Paho(a, "fs-pub")
        pub.publish("fs/fs-b1/x", b"while-b-was-down", qos=1)
        pub.publish("fs/fs-a1/x", b"for-a1", qos=1)
        b.start()
        assert metric(b.metrics_url, "lmqtt_sessions") == 2, b.log_tail()
        own = Paho(b, "fs-b1", version=5, clean=False, expiry=3600)
        assert own.session_present
        assert [m.payload for m in own.get_n(1)] == [b"while-b-was-down"]
        moved = Paho(b, "fs-a1", version=5, clean=False, expiry=3600)
        assert moved.session_present
        assert [m.payload for m in moved.get_n(1)] == [b"for-a1"]
        assert metric(b.metrics_url, "lmqtt_sessions") == 3
        pub.publish("fs/fs-a1/y", b"after-the-move", qos=1)
        assert [m.payload for m in moved.get_n(1)] == [b"after-the-move"]
        for c in (own, moved, pub):
            c.disconnect()
    finally:
        stop_all([a, b], store)


def test_the_store_ends_the_expired_sessions_of_a_gateway_gone_for_good(tmp_path):
    """Gateway A is killed and never comes back, holding one connected and one offline session
    with a 2 s expiry and one with an hour. The store node ends the two short ones once their
    expiry has passed since A's loss (the connected one counts from the loss), with their offsets:
    their clients start new sessions on B, while the hour-long one resumes there."""
    store_metrics = free_port()
    store = LmqttStore(str(tmp_path / "store"), log_path=str(tmp_path / "store.log"),
                       extra_args=("--will-grace-s", "0.5", "--session-sweep-s", "0.2",
                                   "--metrics-port", str(store_metrics))).start()
    url = f"http://127.0.0.1:{store_metrics}/metrics"
    a = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    b = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    try:
        offline = Paho(a, "gone-offline", version=5, clean=False, expiry=2)
        offline.subscribe("gone/offline", 1)
        offline.disconnect()
        online = Paho(a, "gone-online", version=5, clean=False, expiry=2)
        online.subscribe("gone/online", 1)
        long_lived = Paho(a, "gone-long", version=5, clean=False, expiry=3600)
        long_lived.subscribe("gone/long", 1)
        long_lived.disconnect()
        assert wait_metric(a.metrics_url, "lmqtt_sessions", 3) == 3
        a.stop(signal.SIGKILL)
        online.disconnect()
        assert wait_metric(url, "lmqtt_store_gateway_sessions_ended_total", 2) == 2, store.log_tail()
        pub = Paho(b, "gone-pub")
        for cid in ("gone-offline", "gone-online"):
            c = Paho(b, cid, version=5, clean=False, expiry=2)
            assert not c.session_present, cid
            pub.publish(f"gone/{cid.split('-')[1]}", b"x", qos=1)
            assert c.drain(0.3) == []            # its subscription ended with the session
            c.disconnect()
        pub.publish("gone/long", b"kept", qos=1)
        kept = Paho(b, "gone-long", version=5, clean=False, expiry=3600)
        assert kept.session_present
        assert [m.payload for m in kept.get_n(1)] == [b"kept"]
        assert metric(url, "lmqtt_store_gateway_sessions_ended_total") == 2
        kept.disconnect()
        pub.disconnect()
    finally:
        stop_all([a, b], store)


def _record(store, cid: str):
    from lmqtt.lightqueue.records import SessionRecord
    from lmqtt.store.client import connect
    with connect(store.address) as c:
        raw = c.cmd("gw_get_session", client_id=cid)["rec"]
    return None if raw is None else SessionRecord.from_bytes(raw.encode())


def test_a_gateway_taken_for_gone_writes_again_the_records_of_its_connected_clients(tmp_path):
    """The store restarts while the gateway cannot reconnect (SIGSTOP) for longer than the grace:
    its sweep takes the gateway for gone, marks its connected client's session offline and ends
    the one with a 1 s expiry. When the gateway is back, the store tells it (gw_hello) and it writes
    both records again, connected, with their offsets: the clients go on as if nothing happened."""
    store = LmqttStore(str(tmp_path / "store"), log_path=str(tmp_path / "store.log"),
                       extra_args=("--will-grace-s", "0.2", "--session-sweep-s", "0.1")).start()
    gw = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    try:
        long_lived = Paho(gw, "cut-long", version=5, clean=False, expiry=3600)
        long_lived.subscribe("cut/long", 1)
        short = Paho(gw, "cut-short", version=5, clean=False, expiry=1)
        short.subscribe("cut/short", 1)
        pub = Paho(gw, "cut-pub")
        pub.publish("cut/long", b"before", qos=1)
        assert [m.payload for m in long_lived.get_n(1)] == [b"before"]
        assert _record(store, "cut-long").last_disconnect_ms is None
        os.kill(gw.proc.pid, signal.SIGSTOP)
        try:
            store.stop()
            store.start()
            assert until(lambda: (r := _record(store, "cut-long")) is not None and r.last_disconnect_ms is not None), \
                store.log_tail()
            assert until(lambda: _record(store, "cut-short") is None), store.log_tail()
        finally:
            os.kill(gw.proc.pid, signal.SIGCONT)
        assert until(lambda: (r := _record(store, "cut-long")) is not None and r.last_disconnect_ms is None), \
            gw.log_tail()
        assert until(lambda: (r := _record(store, "cut-short")) is not None and r.last_disconnect_ms is None), \
            gw.log_tail()
        assert "event=sessions_swept_by_store count=2 rewritten=2" in gw.log_tail()
        pub.publish("cut/long", b"after", qos=1)
        pub.publish("cut/short", b"after", qos=1)
        assert [m.payload for m in long_lived.get_n(1, timeout=20)] == [b"after"]
        assert [m.payload for m in short.get_n(1, timeout=20)] == [b"after"]
        for c in (long_lived, short, pub):
            c.disconnect()
    finally:
        stop_all([gw], store)


def test_a_gateway_drops_its_offline_copy_of_a_session_another_gateway_took_over(tmp_path):
    """Two sessions left gateway A with a wildcard filter each. One comes back on B (resumed), the
    other is ended there by a clean connect, while the claims B makes of those client ids are lost
    (the gateways' session directory is a Redis that is down): the store tells A anyway
    (SESSIONS_MOVED), and A drops both offline copies and their filter holds: the ended session's
    filter, which nobody holds any more, stops being indexed (it used to be held by A's copy
    forever: a 3.1.1 session never expires), while the resumed one still gets what is published.
    (The store runs without a filter linger: a filter let go of is dropped at once.)"""
    from lmqtt.loadtest.redis_streams import RedisServer
    redis = RedisServer()
    store_metrics = free_port()
    store = LmqttStore(str(tmp_path / "store"), log_path=str(tmp_path / "store.log"),
                       extra_args=("--metrics-port", str(store_metrics), "--filter-linger-s", "0")).start()
    directory_only = ("--redis", redis.url, "--notify-mode", "native")    # Redis: the session directory only
    a = LmqttGateway(store.address, directory_only, log_dir=str(tmp_path)).start()
    b = LmqttGateway(store.address, directory_only, log_dir=str(tmp_path)).start()
    try:
        for cid in ("mv-resumed", "mv-ended"):
            c = Paho(a, cid, clean=False)
            c.subscribe(f"mv/{cid}/+", 1)
            c.disconnect()
        assert wait_metric(a.metrics_url, "lmqtt_sessions", 2) == 2
        redis.stop()
        pub = Paho(b, "mv-pub")
        pub.publish("mv/mv-ended/1", b"a", qos=1)
        with connect(store.address) as c:
            assert c.cmd("filter_offsets", filter="mv/mv-ended/+")["max_offset"] == 1
        resumed = Paho(b, "mv-resumed", clean=False)
        assert resumed.session_present
        Paho(b, "mv-ended", clean=True).disconnect()
        assert wait_metric(f"http://127.0.0.1:{store_metrics}/metrics", "lmqtt_store_sessions_moved_told_total", 2) == 2
        assert wait_metric(a.metrics_url, "lmqtt_sessions", 0) == 0, a.log_tail()
        for i in (2, 3):
            pub.publish("mv/mv-ended/%d" % i, b"b", qos=1)
        pub.publish("mv/mv-resumed/x", b"still-here", qos=1)
        assert [m.payload for m in resumed.get_n(1)] == [b"still-here"]
        with connect(store.address) as c:
            assert c.cmd("filter_offsets", filter="mv/mv-ended/+")["max_offset"] <= 1
        for c in (resumed, pub):
            c.disconnect()
    finally:
        stop_all([a, b], store)
        redis.stop()


def test_a_filter_one_gateway_lets_go_of_at_start_stays_whole_for_the_gateway_that_restores_its_session(tmp_path):
    """The store's holds say gateway A holds `lg/#`, while the persistent session subscribed to it
    was last served by B (a session moved between two gateways while the disk was full leaves them
    so). Both restart: A, whose own sessions do not use the filter, lets go of it before B,
    restoring the session, registers it again. The message stored while the session was away and
    the one stored while nobody held the filter both reach the session on B."""
    store = LmqttStore(str(tmp_path / "store"), log_path=str(tmp_path / "store.log")).start()
    b = LmqttGateway(store.address, ("--gateway-id", "gw-b"), log_dir=str(tmp_path)).start()
    a = None
    try:
        sub = Paho(b, "lg-sub", clean=False)
        sub.subscribe("lg/#", 1)
        sub.disconnect()
        with connect(store.address) as c:
            p = c.producer()
            p.send("lg/x", b"while away")
            assert until(lambda: c.cmd("filter_offsets", filter="lg/#")["max_offset"] == 1, 10)
            b.kill9()
            assert c.cmd("gw_register", gateway="gw-a", filter="lg/#")["count"] == 1
            assert c.cmd("gw_unregister", gateway="gw-b", filter="lg/#")["count"] == 0
            a = LmqttGateway(store.address, ("--gateway-id", "gw-a"), log_dir=str(tmp_path)).start()
            assert until(lambda: c.cmd("gw_filters", gateway="gw-a")["filters"] == {}, 10)   # A let go
            p.send("lg/y", b"while nobody held it")
            b.start()
            assert until(lambda: c.cmd("gw_filters", gateway="gw-b")["filters"] == {"lg/#": 1}, 10)
        sub = Paho(b, "lg-sub", clean=False)
        assert sub.session_present
        assert [m.payload for m in sub.get_n(2)] == [b"while away", b"while nobody held it"]
        sub.disconnect()
    finally:
        stop_all([g for g in (a, b) if g is not None], store)


def test_a_session_claimed_by_a_gateway_that_never_writes_its_record_keeps_its_filter_where_it_was(tmp_path):
    """Gateway A serves a persistent session subscribed to `cw/#`. Another gateway claims the
    client id (its new connection) and then never writes the session's record: its write failed
    on a full disk, or it was killed first (here the claim is sent and nothing follows it). A
    closes its connection, but the record still names A, so A keeps its copy offline and with it
    the hold on `cw/#`: a message published meanwhile is indexed, and the session, back on A,
    gets it. (It used to drop the copy at the claim: nobody held the filter, its queue was
    dropped, and the message never reached the session.) Once a record naming another gateway
    is written, A drops the copy. The store runs without a filter linger."""
    store = LmqttStore(str(tmp_path / "store"), ("--filter-linger-s", "0"), log_path=str(tmp_path / "store.log")).start()
    a = LmqttGateway(store.address, ("--gateway-id", "gw-a"), log_dir=str(tmp_path)).start()
    try:
        sub = Paho(a, "cw-sub", clean=False)
        sub.subscribe("cw/#", 1)
        with connect(store.address) as c:
            assert c.cmd("gw_filters", gateway="gw-a")["filters"] == {"cw/#": 1}
            c.cmd("gw_claim_sessions", gateway="gw-b", claims=[["cw-sub", int(time.time() * 1000)]])
        sub.disconnects.get(timeout=10)          # taken over (0x8E), by the claim
        sub.c.loop_stop()                        # paho would reconnect by itself
        with connect(store.address) as c:
            assert c.cmd("gw_filters", gateway="gw-a")["filters"] == {"cw/#": 1}
            c.producer().send("cw/x", b"while claimed")
            assert until(lambda: c.cmd("filter_offsets", filter="cw/#")["max_offset"] == 1, 10)
        back = Paho(a, "cw-sub", clean=False)
        assert back.session_present
        assert [m.payload for m in back.get_n(1)] == [b"while claimed"]
        back.disconnect()
        assert wait_metric(a.metrics_url, "lmqtt_sessions", 1) == 1
        # the claimant writes its record now (here: a clean start ends the session on another
        # gateway): A drops its copy and its hold
        b = LmqttGateway(store.address, ("--gateway-id", "gw-b"), log_dir=str(tmp_path)).start()
        try:
            Paho(b, "cw-sub", clean=True).disconnect()
            assert wait_metric(a.metrics_url, "lmqtt_sessions", 0) == 0, a.log_tail()
            with connect(store.address) as c:
                assert until(lambda: c.cmd("gw_filters", gateway="gw-a")["filters"] == {}, 10)
        finally:
            b.stop()
    finally:
        a.stop()
        store.stop()


def test_a_clean_start_on_another_gateway_discards_the_session_even_if_that_gateway_is_killed(tmp_path):
    """A persistent session left gateway A subscribed to `cs/#`. Its client connects on gateway B
    with clean session 1, and B is killed (kill -9) while that connection is open. The old
    session is gone all the same (MQTT-3.1.2-4: a clean start discards it): the client connecting
    to A with clean session 0 finds no session, and what is published to its old filter does not
    reach it. (The record used to be deleted only when the clean connection ended: with B killed
    first, the old session came back.)"""
    store = LmqttStore(str(tmp_path / "store"), log_path=str(tmp_path / "store.log")).start()
    a = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    b = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    try:
        old = Paho(a, "cs-dev", clean=False)
        old.subscribe("cs/#", 1)
        old.disconnect()
        clean = Paho(b, "cs-dev", clean=True)
        assert not clean.session_present
        b.kill9()
        clean.c.loop_stop()                     # paho would reconnect by itself
        back = Paho(a, "cs-dev", clean=False)
        assert not back.session_present, a.log_tail()
        pub = Paho(a, "cs-pub")
        pub.publish("cs/x", b"to nobody", qos=1)
        assert back.drain(1.0) == []
        for c in (back, pub):
            c.disconnect()
    finally:
        stop_all([a], store)
