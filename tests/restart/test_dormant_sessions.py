"""A restarted `lmqtt serve` keeps its persistent sessions dormant until their
clients come back (gateway/clients/session_persistence.py `Dormant`): their filters held (messages
stored meanwhile are kept for them), their expiry timed, nothing else built. Real processes, a
SIGTERM restart and a kill -9; every wait bounded, no timing asserted."""
from __future__ import annotations

import time

from tests.support import LmqttServer, Paho, listening, metric, wait_metric as _wait_metric


def wait_metric(url: str, name: str, want: float, timeout: float = 15.0) -> float:
    """tests.support's, once the metrics port is up (it opens after the MQTT port)."""
    host, port = url.split("/")[2].split(":")
    deadline = time.monotonic() + timeout
    listening(host, int(port), timeout)
    return _wait_metric(url, name, want, max(1.0, deadline - time.monotonic()))


def test_restored_sessions_wait_dormant_keep_their_messages_and_end_as_before(tmp_path):
    """Persistent sessions: a 3.1.1 one on a wildcard filter, a v5 one on an exact topic, a v5
    one in a shared group; restarted (SIGTERM) each is dormant (lmqtt_sessions_dormant; the gauge
    did not exist before: every session was built at start). Then one connected and one with a
    2 s expiry, and a kill -9: the connected one comes back dormant too, the short one ends.
    Messages published while they sleep reach them when they come back, session present; a clean
    start ends one (its subscription gone)."""
    srv = LmqttServer(str(tmp_path / "data"), log_path=str(tmp_path / "serve.log")).start()
    try:
        a = Paho(srv, "dm-a", version=4, clean=False)
        a.subscribe("dm/a/+", 1)
        a.disconnect()
        b = Paho(srv, "dm-b", version=5, clean=False, expiry=3600)
        b.subscribe("dm/b", 1)
        b.disconnect()
        g = Paho(srv, "dm-g", version=5, clean=False, expiry=3600)
        g.subscribe("$share/grp/dm/g/#", 1)
        g.disconnect()
        srv.restart()
        assert wait_metric(srv.metrics_url, "lmqtt_sessions", 3) == 3, srv.log_tail()
        assert metric(srv.metrics_url, "lmqtt_sessions_dormant") == 3
        short = Paho(srv, "dm-short", version=5, clean=False, expiry=2)
        short.subscribe("dm/short", 1)
        short.disconnect()
        on = Paho(srv, "dm-on", version=5, clean=False, expiry=3600)     # connected at the kill -9
        on.subscribe("dm/on/#", 1)
        pub = Paho(srv, "dm-pub", version=5)
        pub.publish("dm/on/1", b"before-the-kill", qos=1)
        assert [m.payload for m in on.get_n(1)] == [b"before-the-kill"]
        for c in (on, pub):
            c.c.loop_stop()         # still connected at the kill, and no reconnect after it
        srv.restart(kill=True)
        # the short one ends (at the restore, or while dormant): a, b, g and the one connected at the kill
        assert wait_metric(srv.metrics_url, "lmqtt_sessions", 4) == 4, srv.log_tail()
        assert metric(srv.metrics_url, "lmqtt_sessions_dormant") == 4
        pub = Paho(srv, "dm-pub", version=5)
        for topic in ("dm/a/x", "dm/b", "dm/g/1", "dm/on/2", "dm/short"):
            pub.publish(topic, f"while-dormant {topic}".encode(), qos=1)

        a = Paho(srv, "dm-a", version=4, clean=False)
        assert a.session_present
        assert [m.payload for m in a.get_n(1)] == [b"while-dormant dm/a/x"]
        assert metric(srv.metrics_url, "lmqtt_sessions_dormant") == 3
        g = Paho(srv, "dm-g", version=5, clean=False, expiry=3600)
        assert g.session_present
        assert [m.payload for m in g.get_n(1)] == [b"while-dormant dm/g/1"]
        on = Paho(srv, "dm-on", version=5, clean=False, expiry=3600)
        assert on.session_present
        assert [m.payload for m in on.get_n(1)] == [b"while-dormant dm/on/2"]
        # a clean start ends the dormant session: its subscription goes with it
        b = Paho(srv, "dm-b", version=5, clean=True, expiry=3600)
        assert not b.session_present
        pub.publish("dm/b", b"after-the-clean-start", qos=1)
        assert b.drain(0.3) == []
        assert metric(srv.metrics_url, "lmqtt_sessions_dormant") == 0
        for c in (a, g, on, b, pub):
            c.disconnect()
        short = Paho(srv, "dm-short", version=5, clean=False, expiry=2)
        assert not short.session_present
        short.disconnect()
    finally:
        srv.stop()


def test_a_dormant_session_expires_with_its_filter(tmp_path):
    """A v5 session with an 8 s expiry restored dormant ends at its expiry without its client
    coming back: the session count drops, its record goes (its client starts a new session); a
    dormant session that never expires stays."""
    srv = LmqttServer(str(tmp_path / "data"), log_path=str(tmp_path / "serve.log")).start()
    try:
        c = Paho(srv, "dx-1", version=5, clean=False, expiry=8)
        c.subscribe("dx/+/t", 1)
        c.disconnect()
        keep = Paho(srv, "dx-keep", version=5, clean=False, expiry=3600)
        keep.subscribe("dx/keep", 1)
        keep.disconnect()
        srv.restart()
        assert wait_metric(srv.metrics_url, "lmqtt_sessions_dormant", 2) == 2, srv.log_tail()
        assert wait_metric(srv.metrics_url, "lmqtt_sessions", 1, timeout=30) == 1, srv.log_tail()
        assert metric(srv.metrics_url, "lmqtt_sessions_dormant") == 1
        assert "event=session_expired client_id=dx-1" in srv.log_tail(20000)
        c = Paho(srv, "dx-1", version=5, clean=False, expiry=8)
        assert not c.session_present
        c.disconnect()
        keep = Paho(srv, "dx-keep", version=5, clean=False, expiry=3600)
        assert keep.session_present
        keep.disconnect()
    finally:
        srv.stop()
