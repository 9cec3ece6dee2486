"""`$SYS/broker/...` on a real `lmqtt serve`, read as Mosquitto's tools read them: retained values
under Mosquitto's names, updated every `--sys-interval`, never matched by a `#` subscription, and
served from the gateway's memory: never appended to the store."""
import os
import time

import pytest

from lmqtt.store.client import connect
from tests.support import SERVER_KINDS, LmqttServer, Paho, serve_or_fleet


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


@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_sys_topics_are_served_from_memory_and_an_idle_log_does_not_grow(kind, tmp_path):
    """`$SYS` values are the gateway's and ephemeral: a `$SYS/#` subscriber gets them (retained at
    once, then live every tick) while nothing is appended to the store: its CommitLog end stays
    where it was and no `$SYS` ConsumeQueue appears. `lmqtt serve` and a fleet's `lmqtt gateway`
    (which publishes under `$SYS/broker/gateways/<id>/`)."""
    conf = tmp_path / "lmqtt.toml"
    conf.write_text("sys_interval = 0.1\n")          # `lmqtt gateway` takes it from the file
    servers = serve_or_fleet(kind, tmp_path, ("--config", str(conf)))
    srv = next(servers)
    admin = connect(srv.store_address)
    try:
        reader = Paho(srv, client_id="sys-reader", version=5)
        reader.subscribe("$SYS/#", qos=0)
        first = reader.get(timeout=5)
        assert first.topic.startswith("$SYS/broker/") and first.retain       # the current values, at once
        start = admin.admin().stats()["max_offset"]
        # messages/sent moves every tick (the reader is sent $SYS messages): live updates
        sent = set()
        deadline = time.monotonic() + 10
        while len(sent) < 5 and time.monotonic() < deadline:
            for m in reader.get_n(1, timeout=max(0.01, deadline - time.monotonic())):
                if m.topic.endswith("/messages/sent") and not m.retain:
                    sent.add(m.payload)
        assert len(sent) >= 5, sent
        assert admin.admin().stats()["max_offset"] == start
        assert not os.path.exists(os.path.join(srv.data_dir, "store", "consumequeue", "%24SYS"))
        reader.disconnect()
    finally:
        admin.close()
        servers.close()


def test_live_sys_values_reach_overlapping_subscriptions_once_with_their_identifiers(tmp_path):
    """Sent from memory as the delivery engine sends a stored message: one PUBLISH per value for
    overlapping filters, carrying every matching subscription identifier (MQTT 5 §3.3.4)."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
    from paho.mqtt.subscribeoptions import SubscribeOptions

    srv = LmqttServer(str(tmp_path / "data"), extra_args=("--sys-interval", "0.2"),
                      log_path=str(tmp_path / "serve.log")).start()
    try:
        c = Paho(srv, client_id="sys-ids", version=5)
        for flt, sid in (("$SYS/broker/uptime", 7), ("$SYS/#", 9)):
            props = Properties(PacketTypes.SUBSCRIBE)
            props.SubscriptionIdentifier = sid
            res, _mid = c.c.subscribe(flt, options=SubscribeOptions(qos=0), properties=props)
            assert res == 0
        live = []
        deadline = time.monotonic() + 10
        while len(live) < 3 and time.monotonic() < deadline:
            for m in c.get_n(1, timeout=max(0.01, deadline - time.monotonic())):
                if m.topic == "$SYS/broker/uptime" and not m.retain:
                    live.append((m.payload, sorted(m.properties.SubscriptionIdentifier)))
        assert len(live) >= 3, live
        assert len({p for p, _ in live}) == len(live), f"a value came twice: {live}"
        assert all(ids == [7, 9] for _, ids in live), live
        c.disconnect()
    finally:
        srv.stop()


def test_live_sys_values_follow_unsubscribe_and_subscribe_again(tmp_path):
    """A reader that unsubscribes gets no more live `$SYS` values while another still does; once
    it subscribes again they come back (the gateway sends each value to the `$SYS` filters it
    holds readers of, kept as subscriptions come and go)."""
    srv = LmqttServer(str(tmp_path / "data"), extra_args=("--sys-interval", "0.2"),
                      log_path=str(tmp_path / "serve.log")).start()

    def live(c, n, timeout=10):
        got = []
        deadline = time.monotonic() + timeout
        while len(got) < n and time.monotonic() < deadline:
            got += [m for m in c.get_n(1, timeout=max(0.01, deadline - time.monotonic()))
                    if m.topic == "$SYS/broker/uptime" and not m.retain]
        return got

    try:
        c = Paho(srv, client_id="sys-on-off", version=5)
        other = Paho(srv, client_id="sys-stays", version=5)
        for x in (c, other):
            x.subscribe("$SYS/broker/uptime", qos=0)
        assert len(live(c, 2)) == 2
        c.c.unsubscribe("$SYS/broker/uptime")
        time.sleep(0.3)
        c.drain(0.1)
        other.drain(0.1)
        assert len(live(other, 3)) == 3                  # ticks went on meanwhile
        assert [m.topic for m in c.drain(0.1)] == []
        c.subscribe("$SYS/broker/uptime", qos=0)
        assert len(live(c, 2)) == 2
        for x in (c, other):
            x.disconnect()
    finally:
        srv.stop()
