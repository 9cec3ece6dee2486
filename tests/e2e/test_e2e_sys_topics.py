"""`$SYS/broker/...` on a real `lmqtt serve`, read as Mosquitto's tools read them: retained values
under Mosquitto's names, updated every `--sys-interval`, never matched by a `#` subscription."""
import time

from tests.support import LmqttServer, Paho


def test_sys_topics_are_retained_updated_and_not_matched_by_hash(tmp_path):
    srv = LmqttServer(str(tmp_path / "data"), extra_args=("--sys-interval", "0.5"),
                      log_path=str(tmp_path / "serve.log")).start()
    try:
        everything = Paho(srv, client_id="all", version=5)
        everything.subscribe("#", qos=0)
        pub = Paho(srv, client_id="pub", version=5)
        for i in range(5):
            pub.publish("plain/t", str(i).encode(), qos=1)
        sys_ = Paho(srv, client_id="sys-reader", version=5)
        sys_.subscribe("$SYS/broker/#", qos=0)
        values = {}

        def current():              # the latest value of each topic, ticks every 0.5 s
            return (values.get("$SYS/broker/version", "").startswith("lmqtt version ")
                    and values.get("$SYS/broker/uptime", "").endswith(" seconds")
                    and int(values.get("$SYS/broker/clients/connected", 0)) >= 2
                    and int(values.get("$SYS/broker/messages/received", 0)) >= 5
                    and int(values.get("$SYS/broker/subscriptions/count", 0)) >= 1)
        deadline = time.monotonic() + 3          # within 3 s (the fixed window this waited before)
        while not current() and time.monotonic() < deadline:
            for m in sys_.get_n(1, timeout=max(0.01, deadline - time.monotonic())):
                values[m.topic] = m.payload.decode()
        assert values["$SYS/broker/version"].startswith("lmqtt version ")
        assert values["$SYS/broker/uptime"].endswith(" seconds")
        assert int(values["$SYS/broker/clients/connected"]) >= 2
        assert int(values["$SYS/broker/messages/received"]) >= 5
        assert int(values["$SYS/broker/subscriptions/count"]) >= 1
        # a late reader gets the current values at once: they are retained
        late = Paho(srv, client_id="late", version=5)
        late.subscribe("$SYS/broker/clients/connected", qos=0)
        m = late.get(timeout=5)
        assert m.retain and int(m.payload) >= 3
        # '#' matches none of them (MQTT: wildcards at the first level skip '$' topics)
        got = everything.drain(0.5)
        assert [m.topic for m in got if m.topic.startswith("$")] == []
        assert sorted(m.payload for m in got if m.topic == "plain/t") == [str(i).encode() for i in range(5)]
        # clients cannot write $SYS: MQTT 5 gets PUBACK 0x87, the value stays the broker's
        info = pub.c.publish("$SYS/broker/version", b"spoofed", qos=1)
        info.wait_for_publish(5)
        check = Paho(srv, client_id="check", version=5)
        check.subscribe("$SYS/broker/version", qos=0)
        assert check.get(timeout=5).payload.startswith(b"lmqtt version ")
        check.disconnect()
        assert "event=publish_denied client_id=pub topic='$SYS/broker/version'" in srv.log_tail(50_000)
        for c in (everything, pub, sys_, late):
            c.disconnect()
    finally:
        srv.stop()
