"""The store's own queues are not MQTT topics: a client's PUBLISH to `$timer` (the queue delayed
messages are parked in, store/delayed.py) is refused as a `$SYS` one is (MQTT 5 PUBACK 0x87, 3.1.1
acknowledged and dropped), so no client can put a record the timer follower would read as a parked
message; other `$` topics stay the clients' (as Mosquitto)."""
from __future__ import annotations

from lmqtt.gateway.mqtt import packets as P
from lmqtt.gateway.mqtt.reason_codes import ReasonCode as RC
from tests.support import LmqttServer, RawMQTT


def test_publish_to_the_timer_queue_is_refused(tmp_path):
    srv = LmqttServer(str(tmp_path / "data"), log_path=str(tmp_path / "serve.log")).start()
    try:
        c = RawMQTT(srv, version=5)
        assert isinstance(c.connect("intruder"), P.ConnAck)
        c.send(P.Publish("$timer", b"\x00" * 32, qos=1, packet_id=1))
        ack = c.recv(timeout=10.0)
        assert isinstance(ack, P.PubAck) and ack.reason_code == RC.NOT_AUTHORIZED, ack
        c.send(P.Publish("$app/x", b"ok", qos=1, packet_id=2))     # an ordinary $ topic: accepted
        ack = c.recv(timeout=10.0)
        assert isinstance(ack, P.PubAck) and ack.reason_code == 0, ack
        c.close()
        log = srv.log_tail(50_000)
        assert "event=publish_denied client_id=intruder topic='$timer'" in log
        assert "no timer" not in log          # the timer follower never saw a foreign record
    finally:
        srv.stop()
