"""End-to-end: subscribing from the past (docs/gateway.md "Subscribing from the past"): MQTT 5
`since` user property and the 3.1.1 `$replay/{epoch-ms}/{filter}` form, history then live with no
gap and no duplicate under concurrent publishing, a never-subscribed filter (read from the log), a
registered filter (read from its light queue), refusal outside retention. Against `lmqtt serve`
and `lmqtt store` + `lmqtt gateway`."""
from __future__ import annotations

import os
import threading
import time
from datetime import datetime, timezone

import pytest

from tests.support import SERVER_KINDS, LmqttFleet, LmqttServer, LmqttStore, Paho, both_kinds_fixtures


shared_server, lmqtt_server = both_kinds_fixtures()


pytestmark = pytest.mark.timeout(90)


# ---------------------------------------------------------------- helpers (this file's own)
def subscribe_since(p: Paho, topic: str, qos: int, since, timeout: float = 10.0):
    """MQTT 5 SUBSCRIBE with the user property `since`: -> (reason codes, SUBACK properties)."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
    from paho.mqtt.subscribeoptions import SubscribeOptions
    got = {}
    ev = threading.Event()

    def on_sub(c, u, mid, rcs, props):
        got[mid] = ([int(getattr(r, "value", r)) for r in rcs], props)
        ev.set()
    p.c.on_subscribe = on_sub
    props = Properties(PacketTypes.SUBSCRIBE)
    props.UserProperty = ("since", str(since))
    res, mid = p.c.subscribe(topic, options=SubscribeOptions(qos=qos), properties=props)
    assert res == 0
    deadline = time.monotonic() + timeout
    while mid not in got:
        assert time.monotonic() < deadline, f"no SUBACK for {topic!r}"
        ev.wait(0.05)
        ev.clear()
    return got[mid]


def now_ms() -> int:
    return int(time.time() * 1000)


def after(ms: int) -> int:
    """A time strictly later than `ms` (bounded wait for the clock to move)."""
    for _ in range(1000):
        t = now_ms()
        if t > ms:
            return t
        time.sleep(0.002)
    pytest.fail("clock did not move")


def payloads(msgs) -> list[str]:
    return [m.payload.decode() for m in msgs]


def collect_until(p: Paho, want: int, timeout: float = 30.0) -> list:
    return p.get_n(want, timeout)


# ---------------------------------------------------------------- tests
def test_replay_under_concurrent_publishing_is_history_then_live_exactly(lmqtt_server):
    """A publisher thread numbers its QoS 1 messages while a client subscribes with `since` to a
    filter nobody subscribed before, and goes on publishing after the SUBACK: the client gets every
    number from the first on, once each, in order (history from the log, then live from the seam)."""
    pub = Paho(lmqtt_server, "cc-pub", version=5)
    sub = Paho(lmqtt_server, "cc-sub", version=5)
    since = now_ms()
    published = []
    at_suback = []                      # how many were published when the SUBACK came
    done = threading.Event()

    def publisher():
        try:
            for i in range(20_000):
                pub.publish(f"cc/{i % 3}/v", str(i).encode(), qos=1)
                published.append(i)
                if at_suback and i >= at_suback[0] + 300:
                    return
        finally:
            done.set()

    th = threading.Thread(target=publisher)
    th.start()
    try:
        for _ in range(3000):
            if len(published) > 200:
                break
            time.sleep(0.005)
        codes, _props = subscribe_since(sub, "cc/+/v", 1, since)
        at_suback.append(len(published))
        assert codes == [1]
    finally:
        if not at_suback:
            at_suback.append(0)
        th.join(60)
    total = len(published)
    assert 200 < at_suback[0] < total        # published before, during and after the subscribe
    got = payloads(collect_until(sub, total))
    assert got == [str(i) for i in range(total)]
    assert sub.drain(0.5) == []             # nothing twice
    pub.publish("cc/1/v", b"after", qos=1)
    assert payloads(sub.get_n(1)) == ["after"]


def test_replay_of_a_never_subscribed_filter_for_mqtt_311(lmqtt_server):
    pub = Paho(lmqtt_server, "nv-pub", version=4)
    pub.publish("nv/a/x", b"too old", qos=1)
    since = after(now_ms())
    for i in range(20):
        pub.publish(f"nv/{'ab'[i % 2]}/x", f"h{i}".encode(), qos=1)
        pub.publish(f"nv/{'ab'[i % 2]}/y", b"not matching", qos=1)
    sub = Paho(lmqtt_server, "nv-sub", version=4)
    assert sub.subscribe(f"$replay/{since}/nv/+/x", 1) == [1]
    got = sub.get_n(20)
    assert payloads(got) == [f"h{i}" for i in range(20)]
    assert {m.topic for m in got} == {"nv/a/x", "nv/b/x"}
    pub.publish("nv/b/x", b"live", qos=1)
    assert payloads(sub.get_n(1)) == ["live"]
    assert sub.drain(0.3) == []
    # the subscription is the filter's own: UNSUBSCRIBE with the $replay/ form ends it too
    sub.unsubscribe(f"$replay/{since}/nv/+/x")
    pub.publish("nv/a/x", b"after unsubscribe", qos=1)
    assert sub.drain(0.5) == []


def test_replay_from_a_registered_filters_light_queue(lmqtt_server):
    """`lq/+/t` is held by another subscriber the whole time: the history comes from its light
    queue (the gateway logs source=queue), from the first message stored at/after `since` (here an
    RFC 3339 time)."""
    keeper = Paho(lmqtt_server, "lq-keeper", version=4)
    assert keeper.subscribe("lq/+/t", 0) == [0]
    pub = Paho(lmqtt_server, "lq-pub", version=4)
    pub.publish("lq/a/t", b"registered but before since", qos=1)
    since = (now_ms() // 1000 + 1) * 1000                  # a whole second, as RFC 3339 here
    after(since)
    rfc = datetime.fromtimestamp(since / 1000, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    for i in range(10):
        pub.publish(f"lq/{i % 2}/t", f"m{i}".encode(), qos=1)
    sub = Paho(lmqtt_server, "lq-sub", version=5)
    codes, _ = subscribe_since(sub, "lq/+/t", 1, rfc)
    assert codes == [1]
    assert payloads(sub.get_n(10)) == [f"m{i}" for i in range(10)]
    pub.publish("lq/z/t", b"live", qos=1)
    assert payloads(sub.get_n(1)) == ["live"]
    assert sub.drain(0.3) == []
    for _ in range(100):
        if "source=queue" in lmqtt_server.log_tail(20000):
            break
        time.sleep(0.05)
    assert "event=replay_subscribe" in lmqtt_server.log_tail(20000)
    assert "filter=lq/+/t since_ms=%d source=queue" % since in lmqtt_server.log_tail(20000)


def test_bad_since_is_refused_with_a_reason(lmqtt_server):
    sub = Paho(lmqtt_server, "bad-since", version=5)
    codes, props = subscribe_since(sub, "bs/#", 1, "yesterday")
    assert codes == [0x80]
    assert "RFC 3339" in props.ReasonString
    v4 = Paho(lmqtt_server, "bad-replay", version=4)
    assert v4.subscribe("$replay/soon/bs/#", 1) == [0x80]


def test_sdk_filter_consumer_since(lmqtt_server):
    """The SDK's FilterConsumer gets the same option: history of a never-subscribed filter, then
    live."""
    from lmqtt.store.client import connect
    pub = Paho(lmqtt_server, "sdk-pub", version=4)
    pub.publish("sdk/a/x", b"too old", qos=1)
    since = after(now_ms())
    for i in range(15):
        pub.publish(f"sdk/{i % 3}/x", f"h{i}".encode(), qos=1)
        pub.publish(f"sdk/{i % 3}/y", b"no", qos=1)
    c = connect(lmqtt_server.store_address)
    try:
        fc = c.filter_consumer("sdk/+/x", since=since)
        pub.publish("sdk/z/x", b"live", qos=1)
        got = []
        for _ in range(200):
            got += [r.body for r in fc.poll()]
            if len(got) >= 16:
                break
            time.sleep(0.02)
        assert got == [f"h{i}".encode() for i in range(15)] + [b"live"]
    finally:
        c.close()


def test_since_and_replay_filter_forms():
    """The two ways to ask, parsed (no server needed)."""
    from lmqtt.gateway.delivery.history import ReplayRequestError, parse_since, plain_filter, split_replay_filter
    assert parse_since("1795420800000") == 1795420800000
    assert parse_since("2026-11-23T08:00:00Z") == parse_since("2026-11-23T09:00:00+01:00")
    assert parse_since("2026-11-23T08:00:00.250Z") % 1000 == 250
    for bad in ("yesterday", "2026-11-23T08:00:00", "-5"):
        with pytest.raises(ReplayRequestError):
            parse_since(bad)
    assert split_replay_filter("$replay/1700000000000/a/+/c") == (1700000000000, "a/+/c")
    assert split_replay_filter("$replay/1/#") == (1, "#")
    assert split_replay_filter("a/#") is None
    for bad in ("$replay/x/a", "$replay/1", "$replay//a"):
        with pytest.raises(ReplayRequestError):
            split_replay_filter(bad)
    assert plain_filter("$replay/5/a/#") == "a/#" and plain_filter("a/#") == "a/#"


# ---------------------------------------------------------------- outside retention
def _trimmed_data(data_dir: str, segment_mb: int) -> int:
    """A data dir whose CommitLog start was deleted by retention (in-process, before the server
    starts); returns the store time of the oldest message left."""
    from lmqtt.lightqueue import LightQueueStore
    from lmqtt.store import Message, MessageStore, StoreConfig
    st = MessageStore(StoreConfig(data_dir=os.path.join(data_dir, "store"), segment_size=segment_mb << 20))
    lq = LightQueueStore(st, os.path.join(data_dir, "lightqueue"))
    st.start()
    try:
        body = b"x" * (3 << 20)
        for i in range(4):                  # 12 MiB over 8 MiB segments: the first one can go
            st.append(Message(topic="ret/a", body=body, dispatch_queues=lq.queues_for_topic("ret/a")))
        st.append(Message(topic="ret/a", body=b"small", dispatch_queues=lq.queues_for_topic("ret/a")))
        assert st.wait_dispatched(st.max_offset, 10)
        for d in st._dispatchers:
            d.flush()
        assert st.delete_expired_segments(now_ms=now_ms() + 100 * 3600 * 1000) > 0
        assert st.min_offset > 0
        left = len(st.read_consume_queue("ret", 0, 0, 10))     # records in deleted segments are skipped
        return st.read(st.min_offset).store_ts, left
    finally:
        st.shutdown()
        lq.close()


@pytest.fixture(params=SERVER_KINDS)
def trimmed_server(request, tmp_path):
    if request.param == "serve":
        data = str(tmp_path / "data")
        oldest = _trimmed_data(data, 8)
        srv = LmqttServer(data, ("--segment-mb", "8"), log_path=str(tmp_path / "lmqtt-serve.log")).start()
    else:
        data = str(tmp_path / "store-data")
        oldest = _trimmed_data(data, 8)
        srv = LmqttFleet(data, log_dir=str(tmp_path))
        srv.store = LmqttStore(data, ("--segment-mb", "8"), log_path=str(tmp_path / "lmqtt-store.log"))
        srv.start()
    try:
        yield srv, oldest
    finally:
        srv.stop()


def test_replay_beyond_retention_is_refused_clearly(trimmed_server):
    srv, (oldest, left) = trimmed_server
    sub = Paho(srv, "ret-5", version=5)
    codes, props = subscribe_since(sub, "ret/#", 1, oldest - 1)
    assert codes == [0x80]
    assert "outside retention" in props.ReasonString
    v4 = Paho(srv, "ret-4", version=4)
    assert v4.subscribe(f"$replay/{oldest - 1}/ret/#", 1) == [0x80]
    for _ in range(100):
        if "event=replay_refused" in srv.log_tail(20000):
            break
        time.sleep(0.05)
    assert "outside retention" in srv.log_tail(20000)
    # from the oldest message left on, the history is served
    ok = Paho(srv, "ret-ok", version=5)
    codes, _ = subscribe_since(ok, "ret/#", 1, oldest)
    assert codes == [1]
    got = ok.get_n(left, timeout=20)
    assert 1 < left < 5 and len(got) == left and payloads(got)[-1] == "small"
    assert ok.drain(0.3) == []
