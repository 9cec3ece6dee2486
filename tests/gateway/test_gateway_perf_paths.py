"""The gateway's QoS 1 hot-path shortcuts must produce exactly what the general code produces.

- `OutboundMessage.encode` (pre-encoded head/tail per variant, packet id joined in) == `encode_publish`
  for every QoS / retain / DUP / protocol version / property combination, and the bytes decode
  back with the codec;
- `FastHistogram` (plain-int histogram) is exported as a normal Prometheus histogram;
- the notify bus delivers the first event after a quiet window at once and merges what arrives
  while a delivery is pending (leading-edge window);
- `Decoder(share_empty_properties=True)` decodes the same packets as the default decoder;
- the delivery ring (records the loop appended itself, served without a pull) holds exactly what
  a pull of the same queue range returns, also across appends the store's own thread dispatched;
- names the loop thread raises on the notify bus wait for `drain()` and skip the window.
"""
from __future__ import annotations

import asyncio
import random

from prometheus_client import generate_latest

from lmqtt.gateway.storage import record_props
from lmqtt.gateway.app.metrics import GatewayMetrics
from lmqtt.gateway.mqtt import Decoder, encode, encode_publish, packets as P
from lmqtt.gateway.storage.record_props import RecordMeta
from lmqtt.gateway.session import OutboundMessage
from lmqtt.notify import InProcessBus


def test_item_encoding_equals_codec_for_every_variant():
    rnd = random.Random(5)
    metas = [RecordMeta(1, False, "c"),
             RecordMeta(2, True, "pub", payload_format_indicator=1, message_expiry_interval=60,
                        content_type="text/plain", response_topic="r/t", correlation_data=b"\x00\x01",
                        user_property=[("k", "v"), ("k", "v2")])]
    for topic in ("a/b", "t" * 300, "é/ü/😀"):
        for payload in (b"", b"x" * 64, b"y" * 20000, b"z" * 2_100_000):
            for meta in metas:
                it = OutboundMessage(topic, payload, meta)
                for version in (3, 4, 5):
                    for qos in (0, 1, 2):
                        for retain in (False, True):
                            for dup in ((False,) if qos == 0 else (False, True)):
                                pid = rnd.randint(1, 65535) if qos else None
                                props = meta.to_properties() if version == 5 and meta.has_app_properties() else None
                                want = encode_publish(topic, payload, qos, retain, dup, pid, props, version)
                                assert it.encode(qos, retain, version, pid, dup) == want
                                # cached variant, another packet id
                                if qos:
                                    pid2 = pid % 65535 + 1
                                    assert it.encode(qos, retain, version, pid2) == encode_publish(
                                        topic, payload, qos, retain, False, pid2, props, version)


def test_item_encoding_decodes_back():
    meta = RecordMeta(1, False, "c", user_property=[("a", "b")])
    it = OutboundMessage("s/1", b"hello", meta)
    for version in (4, 5):
        dec = Decoder(version, server_side=False)
        pkt, = dec.feed(it.encode(1, True, version, 77, dup=True))
        assert (pkt.topic, pkt.payload, pkt.qos, pkt.retain, pkt.dup, pkt.packet_id) == ("s/1", b"hello", 1, True, True, 77)
        if version == 5:
            assert pkt.properties.user_property == [("a", "b")]


def test_record_props_cache_matches_encode():
    for args in ((1, False, "c", None), (2, True, "cid", P.Properties()),
                 (1, False, "c", P.Properties(user_property=[("k", "v")])),
                 (0, False, "c", P.Properties(content_type="x"))):
        assert record_props.encode_cached(*args) == record_props.encode(*args)
        assert record_props.encode_cached(*args) == record_props.encode(*args)   # cached path


def _metric_lines(m: GatewayMetrics, name: str) -> dict[str, float]:
    out = {}
    for line in generate_latest(m.registry).decode().splitlines():
        if line.startswith(name):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def test_fast_histogram_exports_prometheus_histogram():
    m = GatewayMetrics()
    m.flush_latency.observe(0.0001)          # on a bound: counted in that bucket (le = "<=")
    m.flush_latency.observe_many([0.003, 0.004, 99.0])
    got = _metric_lines(m, "lmqtt_store_durable_seconds")
    assert got['lmqtt_store_durable_seconds_bucket{le="0.0001"}'] == 1
    assert got['lmqtt_store_durable_seconds_bucket{le="0.0025"}'] == 1
    assert got['lmqtt_store_durable_seconds_bucket{le="0.005"}'] == 3
    assert got['lmqtt_store_durable_seconds_bucket{le="5.0"}'] == 3
    assert got['lmqtt_store_durable_seconds_bucket{le="+Inf"}'] == 4
    assert got["lmqtt_store_durable_seconds_count"] == 4
    assert abs(got["lmqtt_store_durable_seconds_sum"] - 99.0071) < 1e-9
    m.append_batch_size.observe(3)
    got = _metric_lines(m, "lmqtt_store_append_batch_messages")
    assert got['lmqtt_store_append_batch_messages_bucket{le="2.0"}'] == 0
    assert got['lmqtt_store_append_batch_messages_bucket{le="4.0"}'] == 1
    assert got["lmqtt_store_append_batch_messages_sum"] == 3


def test_notify_bus_leading_edge_then_merges_within_window():
    async def run():
        loop = asyncio.get_running_loop()
        bus = InProcessBus(loop, window_s=0.3)
        got: list[set[str]] = []
        waiter: list[asyncio.Future] = [loop.create_future()]

        def cb(names):
            got.append(names)
            if not waiter[0].done():
                waiter[0].set_result(None)
        bus.subscribe(cb)
        bus.publish({"a"})                    # quiet bus: delivered at once (next test: not held)
        await asyncio.wait_for(waiter[0], 10)
        waiter[0] = loop.create_future()
        bus.publish({"b"})                    # within the window: waits, and merges with the next
        bus.publish({"c", "b"})
        await asyncio.wait_for(waiter[0], 10)
        bus.close()
        return got, bus

    got, bus = asyncio.run(run())
    assert got == [{"a"}, {"b", "c"}]
    assert (bus.events_in, bus.deliveries) == (3, 2)


def test_notify_bus_first_event_not_held_for_a_long_window():
    async def run():
        loop = asyncio.get_running_loop()
        bus = InProcessBus(loop, window_s=3600)
        fut = loop.create_future()
        bus.subscribe(lambda names: fut.done() or fut.set_result(names))
        bus.publish({"x"})
        names = await asyncio.wait_for(fut, 10)
        bus.close()
        return names

    assert asyncio.run(run()) == {"x"}


def test_decoder_shared_empty_properties_decodes_the_same():
    stream = [P.Connect(client_id="c", protocol_level=4)]
    for i in range(1, 200):
        stream.append(P.Publish(f"t/{i}", b"p" * (i * 3), i % 3, bool(i & 1), bool(i % 3 and i & 2),
                                i if i % 3 else None))
        stream.append(P.PubAck(i))
        stream.append(P.PubRec(i))
        stream.append(P.PubComp(i))
    data = b"".join(encode(p, 4) for p in stream)
    a = Decoder()
    b = Decoder(share_empty_properties=True)
    got_a, got_b = [], []
    for k in range(0, len(data), 97):      # uneven splits, packets straddle feeds
        got_a += a.feed(data[k:k + 97])
        got_b += b.feed(data[k:k + 97])
    assert got_a == got_b
    assert len(got_b) == len(stream)
    shared = [p.properties for p in got_b if isinstance(p, (P.Publish, P.PubAck))]
    assert all(x is shared[0] for x in shared)


def test_delivery_ring_equals_pull_of_the_same_range(tmp_path):
    from lmqtt.gateway.app.config import build_config
    from lmqtt.gateway.app.gateway import Gateway
    from lmqtt.gateway.session import Cursor, MqttSession

    async def run():
        cfg = build_config({}, {"data_dir": str(tmp_path / "d"), "port": 0, "metrics_port": 0})
        assert cfg.dispatch_inline
        gw = Gateway(cfg)
        await gw.start()
        try:
            b, store, lq = gw.broker, gw.store, gw.lq
            d = b.delivery
            lq.register_filter("r/+")
            reader = MqttSession("reader")             # offline reader at 0: nothing is consumed
            for q in ("r/a", "r/+"):
                reader.cursors[q] = Cursor(0)
                d.add_reader(reader, q)
            n = 0
            for rnd in range(41):          # the last round is not gated
                for _ in range(1 + rnd % 5):
                    topic = ("r/a", "r/b", "other/x")[n % 3]
                    b.publisher.submit(None, n % 2, None, topic, f"m{n}".encode(), False, f"c{n % 2}", None)
                    n += 1
                if rnd % 4 == 3:
                    # the store's dispatch lock held: no inline dispatch, its thread dispatches
                    # after we let go, and the ring must bridge the gap
                    with store.dispatch._dispatching:
                        b.publisher.flush()
                    for _ in range(2000):
                        if store.dispatched_offset >= store.max_offset:
                            break
                        await asyncio.sleep(0.001)
                else:
                    b.publisher.flush()
                await asyncio.sleep(0)
            got = {}
            for q in ("r/a", "r/+"):
                start, items = d.recent.rings[q]
                res = lq.pull(q, start, max_count=len(items) + 10, max_bytes=1 << 30)
                got[q] = (start, len(items), lq.max_offset(q),
                          [(it.topic, it.payload, it.queue_offset, tuple(it.dispatch_queues),
                            it.record.qos, it.record.client_id) for it in items],
                          [(m.topic, m.body, m.queue_offset, tuple(m.dispatch_queues),
                            d._meta_of(m.props).qos, d._meta_of(m.props).client_id) for m in res.messages])
            return got
        finally:
            await gw.stop()

    got = asyncio.run(run())
    for q, (start, count, maxo, ring, pulled) in got.items():
        assert start == 0, q                      # every gap was bridged: one range from the start
        assert start + count == maxo, q
        assert ring == pulled, q
    assert got["r/+"][2] > got["r/a"][2] > 0


def test_notify_bus_loop_thread_names_wait_for_drain():
    async def run():
        loop = asyncio.get_running_loop()
        bus = InProcessBus(loop, window_s=3600)
        got: list[set[str]] = []
        bus.subscribe(got.append)
        bus.publish({"a"})                    # raised on the loop thread: kept for drain()
        bus.publish({"b"})
        assert got == []
        bus.drain()
        assert got == [{"a", "b"}]
        bus.publish({"c"})                    # nobody drains: the loop delivers it anyway
        await asyncio.sleep(0.01)
        bus.close()
        return got

    assert asyncio.run(run()) == [{"a", "b"}, {"c"}]


def test_dispatch_lag_from_store_times_counts_as_one_observation_per_message():
    """`first_sent` buckets a batch's store times by bisecting them, without a lag value per
    message (a batch of a few observed one by one): the buckets, count and sum are those of
    observing each message's lag (a store time after now counts as lag 0, one before the gateway
    started is not lag), in any order, for batches of both sizes."""
    from lmqtt.gateway.app.metrics import LagHistogram, _LAT_BUCKETS
    rnd = random.Random(11)
    now_ms = 1_800_000_000_000.0
    for trial in range(200):
        started = now_ms / 1000.0 - rnd.choice((0.05, 3.0, 10_000.0))
        a = LagHistogram("a", "", _LAT_BUCKETS)
        b = LagHistogram("b", "", _LAT_BUCKETS)
        a.started = b.started = started
        ts = [now_ms - rnd.choice((rnd.uniform(-5, 1), rnd.uniform(0, 60), rnd.uniform(0, 6000),
                                   rnd.uniform(0, 20_000_000))) // 1 + 0.5
              for _ in range(rnd.randrange(0, 300) if trial % 4 < 2 else rnd.randrange(0, 8))]
        if trial % 2:
            ts.sort()
        import time as _t
        real = _t.time
        _t.time = lambda: now_ms / 1000.0      # both sides read the same clock
        try:
            a.observe_many([max(0.0, (now_ms - t) / 1000.0) for t in ts])
            b.observe_store_times(ts, now_ms)
        finally:
            _t.time = real
        assert b.counts == a.counts, trial
        assert abs(b.sum - a.sum) <= 1e-9 * max(1.0, a.sum), trial
