"""The SDK's throughput paths against a real `lmqtt store`: AutoBatch's per-message futures (one
Future per batch underneath), flush() as the one way to wait, a refused batch failing only its
own messages, and pulls in the raw layout giving every message once, in order, equal to the
classic layout."""
from __future__ import annotations

import threading
import time

import pytest

from lmqtt.store import protocol as W
from lmqtt.store.client import StoreClientError, connect
from lmqtt.store.client.consumer import pull_result
from tests.support import LmqttStore, ensure_running, running


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    """One `lmqtt store` for the module: each test uses its own first-level topics (queues)."""
    d = tmp_path_factory.mktemp("sdk-batching")
    yield from running(LmqttStore(str(d / "store-data"), log_path=str(d / "lmqtt-store.log")))


@pytest.fixture
def lmqtt_store(shared_store):
    """The module's store, running when the test starts."""
    return ensure_running(shared_store)


def visible(c, topic, n, timeout=10.0):
    """Wait until `n` records of queue `topic` are readable (acknowledged = durable; readable comes
    a moment later, after dispatch)."""
    deadline = time.monotonic() + timeout
    while c.admin().offsets(topic)[1] < n or len(c.pull(topic, 0, n - 1, 1).records) < 1:
        assert time.monotonic() < deadline, f"{n} records of {topic!r} not readable within {timeout} s"
        time.sleep(0.02)


def pull_all(c, topic, offset=0, max_count=97, max_bytes=4 << 20):
    out = []
    while True:
        r = c.pull(topic, 0, offset, max_count, max_bytes)
        if not r.records:
            return out
        out += r.records
        offset = r.next_offset


def test_autobatch_futures_resolve_with_their_own_offsets(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        called = []
        lock = threading.Lock()
        with c.auto_batch_producer(batch_bytes=8 << 10, linger_ms=1) as ab:
            futs = []
            for i in range(6000):
                topic = ("left/a", "right/b", "left/c")[i % 3]      # two ConsumeQueues, interleaved
                f = ab.send(topic, b"%05d" % i, **({"keys": (f"k{i}",)} if i % 1000 == 0 else {}))
                futs.append((topic, i, f))
            futs[5][2].add_done_callback(lambda f: (lock.acquire(), called.append(f), lock.release()))
            assert ab.flush() == 6000 and ab.acknowledged == 6000
        assert all(f.done() and f.exception() is None for _t, _i, f in futs)
        assert called == [futs[5][2]]
        visible(c, "left", 4000)
        visible(c, "right", 2000)
        by_id = {r.msg_id: r for q in ("left", "right") for r in pull_all(c, q)}
        assert len(by_id) == 6000
        for topic, i, f in futs:
            res = f.result()
            rec = by_id[res.msg_id]                        # the record stored at the offset reported
            assert (rec.topic, rec.body, rec.queue_offset, rec.offset) == (topic, b"%05d" % i, res.queue_offset,
                                                                           res.offset)
        left = [f.result().queue_offset for t, _i, f in futs if t != "right/b"]
        assert left == list(range(4000))                   # per queue: in send order, no gaps


def test_autobatch_refused_batch_fails_its_messages_and_flush_raises_it(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        ab = c.auto_batch_producer(linger_ms=1)
        good = [ab.send("ok/t", b"a%d" % i) for i in range(10)]
        assert ab.flush() == 10
        bad = [ab.send("ok/t", b"doomed"), ab.send("bad\x00topic", b"x")]    # one batch, refused whole
        with pytest.raises(StoreClientError) as ei:
            ab.flush()
        assert ei.value.code == W.E_INVALID and "NUL" in str(ei.value)
        for f in bad:
            assert isinstance(f.exception(), StoreClientError)
            with pytest.raises(StoreClientError):
                f.result()
        assert ab.failed is None                            # raised once, then cleared
        later = [ab.send("ok/t", b"b%d" % i) for i in range(10)]
        assert ab.flush() == 20                             # the producer goes on after a refusal
        ab.close()
        visible(c, "ok", 20)
        assert [f.result().queue_offset for f in good + later] == list(range(20))
        assert [r.body for r in pull_all(c, "ok")] == [b"a%d" % i for i in range(10)] + [b"b%d" % i for i in range(10)]
        with pytest.raises(RuntimeError):
            ab.send("ok/t", b"after close")


def test_pull_across_batches_every_message_once_in_order_raw_equals_classic(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        p = c.producer()
        sent = []
        for b in range(30):        # batches of varying sizes, two topics of queue `feed` and another queue
            msgs = [(f"feed/{'x' if i % 2 else 'y'}", b"%d-%d" % (b, i) * (1 + i % 7)) for i in range(b * 7 % 50 + 1)]
            p.send_batch(msgs + [("other/z", b"noise")])
            sent += msgs
        p.send("feed/k", b"with-key", keys=("k1", "k2"), user_properties={"u": "v"})
        sent.append(("feed/k", b"with-key"))
        visible(c, "feed", len(sent))
        lo, hi = c.admin().offsets("feed")
        assert hi - lo == len(sent)
        for max_count, max_bytes in ((1, 0), (13, 0), (1000, 0), (1000, 700)):
            got = pull_all(c, "feed", lo, max_count, max_bytes)
            assert [(r.topic, r.body) for r in got] == sent
            assert [r.queue_offset for r in got] == list(range(lo, hi))
        # the raw reply is what the SDK asked for, and it decodes to the classic reply's records
        body = W.encode_pull("feed", 0, lo, 10_000, 0)
        op, flags, raw = c.request(W.OP_PULL, body, W.F_RAW_OK).result(10)
        op2, flags2, plain = c.request(W.OP_PULL, body).result(10)
        assert op == op2 == W.OP_MESSAGES and flags & W.F_RAW and not flags2 & W.F_RAW
        a, b = pull_result(c.ident, raw, flags), pull_result(c.ident, plain, flags2)
        assert a.records == b.records and a.next_offset == b.next_offset == hi
        last = a.records[-1]
        assert last.keys == ("k1", "k2") and last.mqtt.user_properties == [("u", "v")]


def test_group_consumer_commits_and_resumes_with_raw_pulls(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        c.producer().send_batch([("grp/t", b"%d" % i) for i in range(2500)])
        visible(c, "grp", 2500)
        g = c.consumer("grp", "g1", max_count=1000)
        first = g.poll()
        g.commit()
        again = c.consumer("grp", "g1", max_count=1000)    # a restarted member resumes after the commit
        rest = []
        while True:
            got = again.poll()
            if not got:
                break
            rest += got
        assert [r.body for r in first + rest] == [b"%d" % i for i in range(2500)]


def test_send_batch_mixes_plain_tuples_and_dicts_in_order(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        p = c.producer()
        rs = p.send_batch([("mix/a", b"one"), {"topic": "mix/b", "body": b"two", "keys": ("k",), "qos": 0},
                           ("mix/a", bytearray(b"three")), ("mix/c", memoryview(b"four")), ("mix/a", b"")])
        assert [r.queue_offset for r in rs] == [0, 1, 2, 3, 4] and len({r.msg_id for r in rs}) == 5
        visible(c, "mix", 5)
        recs = pull_all(c, "mix")
        assert [(r.topic, r.body, r.keys, r.mqtt.qos) for r in recs] == [
            ("mix/a", b"one", (), 1), ("mix/b", b"two", ("k",), 0), ("mix/a", b"three", (), 1),
            ("mix/c", b"four", (), 1), ("mix/a", b"", (), 1)]
        assert [r.msg_id for r in recs] == [r.msg_id for r in rs]
        with pytest.raises(TypeError):
            p.send_batch([("mix/a", "not bytes")])


def test_prefetching_consumer_follows_a_seek_and_new_messages(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        p = c.producer()
        p.send_batch([("seek/t", b"%d" % i) for i in range(300)])
        visible(c, "seek", 300)
        g = c.consumer("seek", "g", max_count=100)
        assert [r.body for r in g.poll()] == [b"%d" % i for i in range(100)]   # next 100 now in flight
        g.position = 10                                                         # seek back: not the prefetched
        assert [r.queue_offset for r in g.poll()] == list(range(10, 110))
        g.max_count = 5
        assert [r.queue_offset for r in g.poll()] == list(range(110, 115))
        g.max_count = 1000
        assert [r.queue_offset for r in g.poll()] == list(range(115, 300))
        assert g.poll() == []                                                   # caught up: nothing ahead
        p.send("seek/t", b"late")
        visible(c, "seek", 301)
        assert [r.body for r in g.poll()] == [b"late"]


def test_autobatch_memory_bound_blocks_send_until_acks_free_room(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        ab = c.auto_batch_producer(batch_bytes=4 << 10, linger_ms=1, max_memory=16 << 10, max_in_flight=1)
        peak = [0]
        done = threading.Event()

        def produce():
            for i in range(20_000):
                ab.send("mem/t", b"%06d" % i + b"m" * 94)
                peak[0] = max(peak[0], ab._mem)
            done.set()
        t = threading.Thread(target=produce, daemon=True)
        t.start()
        assert done.wait(60), "send() stayed blocked: acknowledgements did not free memory"
        assert ab.flush(30) == 20_000
        ab.close()
        assert 0 < peak[0] <= 16 << 10           # queued + unacknowledged bytes never passed max_memory
        visible(c, "mem", 20_000)
        assert [r.body[:6] for r in pull_all(c, "mem", max_count=5000)] == [b"%06d" % i for i in range(20_000)]


# ----------------------------------------------------------------------- the asyncio AutoBatch
def test_async_autobatch_handles_resolve_with_their_own_offsets(lmqtt_store):
    import asyncio

    from lmqtt.store.client import connect_async

    async def produce():
        c = await connect_async(lmqtt_store.address)
        try:
            async with c.auto_batch_producer(batch_bytes=8 << 10, linger_ms=1) as ab:
                hs = []
                for i in range(6000):
                    topic = ("aleft/a", "aright/b", "aleft/c")[i % 3]
                    kw = {"keys": (f"k{i}",)} if i % 1000 == 0 else {}
                    hs.append((topic, i, await ab.send(topic, b"%05d" % i, **kw)))
                assert await ab.flush() == 6000 and ab.acknowledged == 6000
            return [(t, i, await h) for t, i, h in hs]
        finally:
            await c.close()
    results = asyncio.run(produce())
    with connect(lmqtt_store.address) as c:
        visible(c, "aleft", 4000)
        visible(c, "aright", 2000)
        by_id = {r.msg_id: r for q in ("aleft", "aright") for r in pull_all(c, q)}
    assert len(by_id) == 6000
    for topic, i, res in results:
        rec = by_id[res.msg_id]                            # the record stored at the offset reported
        assert (rec.topic, rec.body, rec.queue_offset) == (topic, b"%05d" % i, res.queue_offset)
    assert [res.queue_offset for t, _i, res in results if t != "aright/b"] == list(range(4000))


def test_async_autobatch_refused_batch_fails_its_messages_and_flush_raises_it(lmqtt_store):
    import asyncio

    from lmqtt.store.client import connect_async

    async def run():
        c = await connect_async(lmqtt_store.address)
        ab = c.auto_batch_producer(linger_ms=1)
        good = [await ab.send("aok/t", b"a%d" % i) for i in range(10)]
        assert await ab.flush() == 10
        bad = [await ab.send("aok/t", b"doomed"), await ab.send("bad\x00topic", b"x")]   # one batch, refused whole
        with pytest.raises(StoreClientError) as ei:
            await ab.flush()
        assert ei.value.code == W.E_INVALID and "NUL" in str(ei.value)
        for h in bad:
            with pytest.raises(StoreClientError):
                await h
        later = [await ab.send("aok/t", b"b%d" % i) for i in range(10)]
        assert await ab.flush() == 20                      # the producer goes on after a refusal
        await ab.close()
        with pytest.raises(RuntimeError):
            await ab.send("aok/t", b"after close")
        offsets = [(await h).queue_offset for h in good + later]
        await c.close()
        return offsets
    assert asyncio.run(run()) == list(range(20))
    with connect(lmqtt_store.address) as c:
        visible(c, "aok", 20)
        assert [r.body for r in pull_all(c, "aok")] == [b"a%d" % i for i in range(10)] + [b"b%d" % i for i in range(10)]


def test_async_autobatch_memory_bound_holds_send_until_acks_free_room(lmqtt_store):
    import asyncio

    from lmqtt.store.client import connect_async

    async def run():
        c = await connect_async(lmqtt_store.address)
        ab = c.auto_batch_producer(batch_bytes=4 << 10, linger_ms=1, max_memory=16 << 10, max_in_flight=1)
        peak = 0
        for i in range(20_000):
            await ab.send("amem/t", b"%06d" % i + b"m" * 94)
            peak = max(peak, ab._mem)
        assert await ab.flush() == 20_000
        await ab.close()
        await c.close()
        return peak
    peak = asyncio.run(asyncio.wait_for(run(), 60))
    assert 0 < peak <= 16 << 10             # queued + unacknowledged bytes never passed max_memory
    with connect(lmqtt_store.address) as c:
        visible(c, "amem", 20_000)
        assert [r.body[:6] for r in pull_all(c, "amem", max_count=5000)] == [b"%06d" % i for i in range(20_000)]


def test_async_autobatch_across_a_store_restart_stores_each_message_once(lmqtt_store):
    """The store is restarted while the producer sends: frames cut off are re-sent with their
    sequence when the connection is back, and the store keeps one copy of each."""
    import asyncio

    from lmqtt.store.client import connect_async

    async def run():
        loop = asyncio.get_running_loop()
        c = await connect_async(lmqtt_store.address)
        ab = c.auto_batch_producer(batch_bytes=2 << 10, linger_ms=1)
        n = 0
        for _ in range(1000):
            await ab.send("arst/t", b"%05d" % n)
            n += 1
        assert await ab.flush() == 1000
        restart = loop.run_in_executor(None, lmqtt_store.restart)
        while not restart.done() and n < 20_000:             # sending all through the restart
            await ab.send("arst/t", b"%05d" % n)
            n += 1
            await asyncio.sleep(0.001)
        await restart
        for _ in range(1000):
            await ab.send("arst/t", b"%05d" % n)
            n += 1
        assert await ab.flush() == n
        await ab.close()
        await c.close()
        return n
    n = asyncio.run(asyncio.wait_for(run(), 90))
    assert n > 2100, "the restart was over before anything was sent during it"
    print(f"{n - 2000} messages sent during the restart")
    with connect(lmqtt_store.address) as c:
        visible(c, "arst", n)
        bodies = [r.body for r in pull_all(c, "arst", max_count=1000)]
    assert sorted(bodies) == [b"%05d" % i for i in range(n)]           # each once, none lost
