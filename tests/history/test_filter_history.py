"""A filter's history over the SDK and `lmqtt consume`: every stored message matching
an MQTT filter, whether or not the filter was held when it was written. Real `lmqtt serve`, paho
publishers, real `lmqtt consume` subprocesses."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from lmqtt.store.client import StoreClientError, connect, connect_async
from tests.support import ROOT, LmqttServer, Paho


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = LmqttServer(str(tmp_path_factory.mktemp("history")),
                      log_path=str(tmp_path_factory.mktemp("history-log") / "serve.log")).start()
    yield srv
    srv.stop()


def publish(srv, items, client_id="hist-pub"):
    """QoS 1 publishes from one paho client, in order (acknowledged: stored)."""
    p = Paho(srv, client_id=client_id)
    try:
        for topic, body in items:
            p.publish(topic, body, qos=1)
    finally:
        p.disconnect()


def consume(srv, flt, *extra) -> list[str]:
    r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "consume", "--store", srv.store_address,
                        "--filter", flt, *extra], capture_output=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout.decode().splitlines()


def poll_all(fc, n=None, idle=1.0, limit=30.0) -> list:
    """Poll until `n` records (or nothing new for `idle` seconds); bounded by `limit`."""
    out = []
    last = time.monotonic()
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        got = fc.poll()
        out += got
        if n is not None and len(out) >= n:
            break
        if got:
            last = time.monotonic()
        elif time.monotonic() - last > idle:
            break
        else:
            time.sleep(0.02)
    return out


def _dataset(prefix: str, n: int):
    """n matching messages over 5 devices (`<prefix>/devK/t`) with other topics between them
    (same first level, other sub-topics; another first level)."""
    items, want = [], []
    for i in range(n):
        t = f"{prefix}/dev{i % 5}/t"
        items.append((t, f"m-{i}".encode()))
        want.append((t, f"m-{i}"))
        if i % 3 == 0:
            items.append((f"{prefix}/dev{i % 5}/h", f"hum-{i}".encode()))
            items.append((f"x{prefix}/dev{i % 5}/t", f"other-{i}".encode()))
    return items, want


def test_never_subscribed_filter_history_sdk_and_consume(server):
    """paho publishes to topics no one subscribes to; the SDK FilterConsumer and `lmqtt consume
    --filter --from` return exactly the matching messages (all, or from a time), in order. Before:
    0 (the filter's light queue, created at the first read, was the only thing read)."""
    first, want1 = _dataset("hx", 150)
    second, want2 = _dataset("hx", 300)
    second, want2 = second[len(first):], want2[150:]
    publish(server, first)
    time.sleep(0.05)
    cut = int(time.time() * 1000)
    time.sleep(0.05)
    publish(server, second)
    want = want1 + want2
    with connect(server.store_address) as c:
        fc = c.filter_consumer("hx/+/t", start="earliest")
        assert [(r.topic, r.body.decode()) for r in poll_all(fc, len(want))] == want
        assert fc.poll() == []
        since = c.filter_consumer("hx/+/t", since=cut)
        assert [(r.topic, r.body.decode()) for r in poll_all(since, len(want2))] == want2
        exact = c.filter_consumer("hx/dev3/t", start="earliest")       # an exact topic: by tag code
        assert [r.body.decode() for r in poll_all(exact)] == [b for t, b in want if t == "hx/dev3/t"]
        with pytest.raises(StoreClientError) as ei:
            c.filter_consumer("hx/#/bad", start="earliest")
        assert "'#' must be the last level" in str(ei.value)
    assert consume(server, "hx/+/t", "--from", "earliest", "--timeout", "1") == [b for _t, b in want]
    assert consume(server, "hx/+/t", "--from", str(cut), "--timeout", "1") == [b for _t, b in want2]
    # a filter starting with a wildcard: every first-level topic's queues, merged in CommitLog order
    # (= publish order here: one publisher)
    assert consume(server, "+/dev2/t", "--from", "earliest", "--timeout", "1") == [
        b.decode() for t, b in first + second if t.split("/")[1:] == ["dev2", "t"]]


def test_history_after_the_last_subscriber_left(server):
    """An MQTT subscriber of `w2x/+/t` gets 200 messages, unsubscribes and leaves (its light queue
    is dropped); `lmqtt consume --from earliest` and a FilterConsumer still return all 200, and a
    consume group resumes exactly where it committed. Before: 0 of 200."""
    sub = Paho(server, client_id="w2x-sub")
    sub.subscribe("w2x/+/t", qos=1)
    items = [(f"w2x/d{i % 4}/t", f"w-{i}".encode()) for i in range(200)]
    items += [("w2x/d1/other", b"no")] * 3
    publish(server, items)
    assert len(sub.get_n(200)) == 200
    sub.unsubscribe("w2x/+/t")
    sub.disconnect()
    want = [f"w-{i}" for i in range(200)]
    with connect(server.store_address) as c:
        assert c.cmd("filter_offsets", filter="w2x/+/t")["max_offset"] in (0, 200)   # dropped, or not yet
        assert [r.body.decode() for r in poll_all(c.filter_consumer("w2x/+/t", start="earliest"), 200)] == want
    assert consume(server, "w2x/+/t", "--from", "earliest", "--timeout", "1") == want
    assert consume(server, "w2x/+/t", "--group", "g1", "--from", "earliest", "--count", "70") == want[:70]
    assert consume(server, "w2x/+/t", "--group", "g1", "--count", "50") == want[70:120]
    assert consume(server, "w2x/+/t", "--group", "g1", "--timeout", "1") == want[120:]


def test_filter_registered_later_history_then_live_no_gap_no_duplicate(server):
    """Messages before the filter is registered (history, from the ConsumeQueues), then live ones
    while the consumer reads (from the light queue the consumer's registration started): every
    one exactly once, in order; a group's commit (through a record) resumes right after it, also
    after a store restart."""
    before = [(f"late/s{i % 3}/v", f"b-{i}".encode()) for i in range(120)]
    publish(server, before)
    with connect(server.store_address) as c:
        fc = c.filter_consumer("late/+/v", group="lg", start="earliest")
        got = poll_all(fc, 50)
        live = [(f"late/s{i % 3}/v", f"l-{i}".encode()) for i in range(90)]
        publish(server, live[:45])
        got += poll_all(fc, 120 + 45 - len(got))
        publish(server, live[45:])
        got += poll_all(fc, 120 + 90 - len(got))
        want = [b.decode() for _t, b in before + live]
        assert [r.body.decode() for r in got] == want
        assert fc.position is not None            # reading the light queue now
        at = fc.position
        assert fc.poll() == [] and fc.position == at   # an empty poll at the tail keeps it (was: None)
        fc.commit(got[99])                         # through the 100th
        fc2 = c.filter_consumer("late/+/v", group="lg")
        assert [r.body.decode() for r in poll_all(fc2, 110)] == want[100:]
        fc2.commit()
    server.restart()
    publish(server, [("late/s0/v", b"after-restart")])
    with connect(server.store_address) as c:
        fc3 = c.filter_consumer("late/+/v", group="lg")
        assert [r.body for r in poll_all(fc3, 1)] == [b"after-restart"]


def test_asyncio_filter_consumer_reads_the_same_history(server):
    items = [(f"aio/h{i % 2}/t", f"a-{i}".encode()) for i in range(60)] + [("aio/h0/x", b"no")]
    publish(server, items)

    async def go():
        c = await connect_async(server.store_address)
        try:
            fc = await c.filter_consumer("aio/+/t", group="ag", start="earliest")
            out = []
            for _ in range(200):
                got = await fc.poll()
                out += got
                if len(out) >= 60:
                    break
                if not got:
                    await asyncio.sleep(0.02)
            await fc.commit(out[29])
            again = await c.filter_consumer("aio/+/t", group="ag")
            rest = []
            for _ in range(200):
                got = await again.poll()
                rest += got
                if len(rest) >= 30 or not got:
                    break
            return [r.body.decode() for r in out], [r.body.decode() for r in rest]
        finally:
            await c.close()
    out, rest = asyncio.run(go())
    assert out == [f"a-{i}" for i in range(60)] and rest == out[30:]
