"""The floor broker (`lmqtt bench cost --brokers floor,floor-store`) must carry the traffic of the
scenarios it is measured with, or its CPU per message would be per message lost: QoS 1 with its
PUBACK, exact and wildcard subscriptions, and with `floor-store` every PUBLISH in lmqtt's store
before it is forwarded. Driven by paho, an independent client."""
from __future__ import annotations

import queue

import paho.mqtt.client as mqtt

from lmqtt.loadtest import brokers
from lmqtt.store.config import StoreConfig
from lmqtt.store.message_store import MessageStore


def _client(port: int, cid: str, got: queue.Queue | None = None) -> mqtt.Client:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cid, protocol=mqtt.MQTTv311)
    if got is not None:
        c.on_message = lambda _c, _u, m: got.put((m.topic, m.payload, m.qos))
    c.connect("127.0.0.1", port)
    c.loop_start()
    return c


def _round_trip(port: int) -> list:
    """Subscribe (two filters in one SUBSCRIBE, a third in another), publish three QoS 1 messages,
    return what the subscriber got."""
    got: queue.Queue = queue.Queue()
    subacks: queue.Queue = queue.Queue()
    sub = _client(port, "sub", got)
    sub.on_subscribe = lambda _c, _u, mid, _rc, _p: subacks.put(mid)
    pub = _client(port, "pub")
    try:
        mids = {sub.subscribe([("plant/+/temp", 1), ("plant/7/hum", 1)])[1], sub.subscribe("plant/#", 0)[1]}
        assert {subacks.get(timeout=5), subacks.get(timeout=5)} == mids
        infos = [pub.publish("plant/7/temp", b"21.5", qos=1), pub.publish("plant/7/hum", b"40", qos=1),
                 pub.publish("other/x", b"no", qos=1)]
        for i in infos:
            i.wait_for_publish(5)                  # its PUBACK came back
            assert i.is_published()
        out = []
        try:
            while True:
                out.append(got.get(timeout=1.0))
        except queue.Empty:
            pass
        return sorted(out)
    finally:
        pub.loop_stop()
        sub.loop_stop()
        pub.disconnect()
        sub.disconnect()


def test_the_floor_broker_acks_and_forwards_to_exact_and_wildcard_subscriptions(tmp_path):
    rb = brokers.start("floor", tmp_path / "f")
    try:
        assert _round_trip(rb.port) == [("plant/7/hum", b"40", 1), ("plant/7/hum", b"40", 1),
                                        ("plant/7/temp", b"21.5", 1), ("plant/7/temp", b"21.5", 1)]
    finally:
        rb.stop()


def test_the_floor_broker_with_the_store_appends_every_publish_before_forwarding_it(tmp_path):
    rb = brokers.start("floor-store", tmp_path / "f")
    try:
        assert len(_round_trip(rb.port)) == 4
    finally:
        rb.stop()
    st = MessageStore(StoreConfig(data_dir=str(tmp_path / "f" / "floor-data" / "store")))
    st.start()
    try:
        got, off = [], 0
        while off < st.max_offset:
            m = st.read(off)
            got.append((m.topic, m.body))
            off += m.size
        assert got == [("plant/7/temp", b"21.5"), ("plant/7/hum", b"40"), ("other/x", b"no")]
    finally:
        st.shutdown()
