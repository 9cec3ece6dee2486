"""Events of a scripted session, end to end: a real `lmqtt serve --webhook URL` and a real HTTP
receiver process (tests/integrations/http_service.py). The receiver gets every event (JSON
batches), a receiver that is down gets them once it is back (retried with backoff), the same events
are records under `$events/...` that `lmqtt consume` reads, and MQTT clients cannot publish there."""
from __future__ import annotations

import json
import time

import pytest

from lmqtt.gateway.mqtt import packets as P
from tests.integrations.support import HttpService
from tests.support import LmqttServer, Paho, RawMQTT, lmqtt_cli, metric

pytestmark = pytest.mark.timeout(180)


def _events(svc: HttpService) -> list[dict]:
    return [e for batch in svc.requests("/hook") for e in batch]


def _wait_events(svc: HttpService, pred, timeout: float = 20.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while not pred(got := _events(svc)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def test_a_scripted_session_reaches_the_webhook_and_the_store(tmp_path):
    svc = HttpService(tmp_path).start()
    srv = LmqttServer(str(tmp_path / "data"), extra_args=("--webhook", svc.url + "/hook", "--sys-interval", "0"),
                      log_path=str(tmp_path / "serve.log")).start()
    try:
        # a persistent MQTT 5 session: connect, subscribe, unsubscribe, a message too large for it,
        # a clean disconnect, then its expiry
        c = RawMQTT(srv, version=5)
        props = P.Properties(session_expiry_interval=2, maximum_packet_size=200)
        c.send(P.Connect("ev-dev", 5, True, 60, "u1", None, None, props))
        assert c.recv().reason_code == 0
        c.send(P.Subscribe(1, [P.SubscriptionRequest("ev/#", 1)]))
        assert c.recv().reason_codes == [1]
        c.send(P.Subscribe(2, [P.SubscriptionRequest("big/#", 1)]))
        assert c.recv().reason_codes == [1]
        c.send(P.Unsubscribe(3, ["ev/#"]))
        assert isinstance(c.recv(), P.UnsubAck)
        pub = Paho(srv, client_id="ev-pub", version=5)
        pub.publish("big/1", b"x" * 1000, qos=1)       # over the subscriber's Maximum Packet Size: dropped
        pub.disconnect()
        time.sleep(0.5)
        c.send(P.Disconnect(0))
        c.close()
        # a client taken over by a second connection with its client id
        a = Paho(srv, client_id="ev-twin", version=4)
        b = Paho(srv, client_id="ev-twin", version=4)
        b.disconnect()
        a.c.loop_stop()

        def complete(evs):
            acts = [(e["action"], e.get("clientid")) for e in evs]
            return ("session_expired", "ev-dev") in acts and acts.count(("client_disconnected", "ev-twin")) == 2
        evs = _wait_events(svc, complete)
        assert complete(evs), evs
        mine = [e for e in evs if e.get("clientid") == "ev-dev"]
        assert [e["action"] for e in mine] == ["client_connected", "session_subscribed", "session_subscribed",
                                               "session_unsubscribed", "client_disconnected", "session_expired"], mine
        conn = mine[0]
        assert conn["username"] == "u1" and conn["ipaddress"] == "127.0.0.1" and conn["proto_ver"] == 5
        assert conn["session_present"] is False and conn["keepalive"] == 60 and conn["node"]
        assert [(e["topic"], e["qos"]) for e in mine if e["action"] == "session_subscribed"] == [("ev/#", 1), ("big/#", 1)]
        assert mine[3]["topic"] == "ev/#" and mine[4]["reason"] == "normal"
        drops = [e for e in evs if e["action"] == "message_dropped"]
        assert drops and drops[0]["reason"] == "packet_too_large" and drops[0]["count"] == 1, drops
        twin = [e["reason"] for e in evs if e["action"] == "client_disconnected" and e["clientid"] == "ev-twin"]
        assert twin[0] == "0x8E session taken over" and twin[1] == "normal", twin
        assert all(isinstance(e["timestamp"], int) for e in evs)
        # the same events are records in the store: connectivity history for the SDK and Spark
        r = lmqtt_cli("consume", "--store", srv.store_address, "--filter", "$events", "--from", "earliest",
                      "--count", str(len(evs)), "--timeout", "10", "--format", "json")
        assert r.returncode == 0, r.stderr
        stored = [json.loads(json.loads(line)["payload"]) for line in r.stdout.splitlines()]
        assert [(e["action"], e.get("clientid")) for e in stored] == [(e["action"], e.get("clientid")) for e in evs]
        topics = {json.loads(line)["topic"] for line in r.stdout.splitlines()}
        assert "$events/client_connected" in topics and "$events/session_expired" in topics
        # MQTT clients may not write there
        w = RawMQTT(srv, version=5)
        assert w.connect("ev-writer").reason_code == 0
        w.send(P.Publish("$events/client_connected", b"{}", qos=1, packet_id=1))
        assert w.recv().reason_code == 0x87
        w.close()
    finally:
        svc.kill()
        assert srv.stop() == 0, srv.log_tail()


def test_events_wait_for_a_receiver_that_is_down_and_a_full_queue_counts_what_it_drops(tmp_path):
    svc = HttpService(tmp_path)                  # not started: the receiver is down
    srv = LmqttServer(str(tmp_path / "data"), extra_args=("--webhook", svc.url + "/hook", "--webhook-queue", "30",
                                                          "--sys-interval", "0"),
                      log_path=str(tmp_path / "serve.log")).start()
    try:
        for i in range(10):                      # 20 events: connected + disconnected each
            Paho(srv, client_id=f"down-{i}").disconnect()
        time.sleep(1.0)
        assert metric(srv.metrics_url, "lmqtt_webhook_events_sent") == 0
        assert metric(srv.metrics_url, "lmqtt_webhook_failures") >= 1
        svc.start()                              # back: everything queued arrives, in order
        evs = _wait_events(svc, lambda e: len(e) >= 20)
        assert [(e["action"], e["clientid"]) for e in evs] == [
            (a, f"down-{i}") for i in range(10) for a in ("client_connected", "client_disconnected")], evs
        assert metric(srv.metrics_url, "lmqtt_webhook_events_dropped") == 0
        svc.kill()
        for i in range(25):                      # 50 events into a queue of 30
            Paho(srv, client_id=f"flood-{i}").disconnect()
        time.sleep(0.5)
        assert metric(srv.metrics_url, "lmqtt_webhook_events_dropped") == 20
        assert metric(srv.metrics_url, "lmqtt_webhook_queue") == 30
        assert "event=webhook_queue_full" in srv.log_tail(20000)
    finally:
        svc.kill()
        assert srv.stop() == 0, srv.log_tail()
