"""The SDK's delayed sends against a real `lmqtt store`: `delay=` / `deliver_at=` on
send, send_async, send_batch, AutoBatch and the asyncio connection; cancel by msg id; refusals;
the PRODUCE frame's F_DELAYED trailer (docs/protocol.md). The store's timer wheel runs with its
default 1 s precision: a message must not be stored under its topic before its due time (checked
on the store's own timestamps, strictly), and appears once, a bounded time after it."""
from __future__ import annotations

import asyncio
import struct
import time
from datetime import datetime, timezone

import pytest

from lmqtt.store import protocol as W
from lmqtt.store.client import StoreClientError, connect
from lmqtt.store.client.aio import AsyncConnection
from lmqtt.store.client.producer import pack_one

pytestmark = pytest.mark.timeout(60)

PRECISION_MS = 1000
MARGIN_S = 3.0


def _records(c, first_level):
    out, off = [], 0
    while True:
        r = c.pull(first_level, 0, off, 1000)
        if not r.records:
            return out
        out += r.records
        off = r.next_offset


def _wait_for(c, first_level, n, timeout):
    deadline = time.monotonic() + timeout
    recs = _records(c, first_level)
    while len(recs) < n and time.monotonic() < deadline:
        time.sleep(0.05)
        recs = _records(c, first_level)
    return recs


def test_send_with_delay_is_stored_under_its_topic_at_its_due_time_once(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        p = c.producer()
        t0 = time.time()
        r = p.send("sd/a", b"later", delay=1.5, user_properties={"k": "v"})
        due = int(t0 * 1000) + 1500
        assert r.msg_id                                             # the parked message: cancellable
        assert _records(c, "sd") == []                              # not delivered now
        recs = _wait_for(c, "sd", 1, 1.5 + PRECISION_MS / 1000 + MARGIN_S)
        assert [(x.topic, x.body) for x in recs] == [("sd/a", b"later")]
        assert recs[0].store_ts >= due, f"stored {due - recs[0].store_ts} ms before its due time"
        assert recs[0].store_ts <= due + PRECISION_MS + MARGIN_S * 1000
        assert recs[0].mqtt.user_properties == [("k", "v")]           # properties kept
        time.sleep(1.2)
        assert len(_records(c, "sd")) == 1                          # fired once


def test_deliver_at_send_async_and_a_mixed_batch_fire_in_due_order(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        p = c.producer()
        now = time.time()
        p.send("mx/at", b"at-2.0", deliver_at=int((now + 2.0) * 1000))
        f = p.send_async("mx/async", b"async-1.0", delay=1.0)
        rs = p.send_batch([("mx/plain", b"plain"),
                           {"topic": "mx/dt", "body": b"dt-1.5",
                            "deliver_at": datetime.fromtimestamp(now + 1.5, tz=timezone.utc)},
                           ("mx/plain", b"plain-2")])
        assert f.result(5).msg_id and len(rs) == 3
        now_recs = _wait_for(c, "mx", 2, 2.0)
        assert [x.body for x in now_recs] == [b"plain", b"plain-2"]   # the batch's ordinary ones: now
        assert min(x.store_ts for x in now_recs) < int(now * 1000) + 1000
        recs = _wait_for(c, "mx", 5, 2.0 + PRECISION_MS / 1000 + MARGIN_S)
        assert [x.body for x in recs] == [b"plain", b"plain-2", b"async-1.0", b"dt-1.5", b"at-2.0"]
        by = {x.body: x.store_ts for x in recs}
        assert by[b"async-1.0"] >= int(now * 1000) + 1000
        assert by[b"dt-1.5"] >= int((now + 1.5) * 1000)
        assert by[b"at-2.0"] >= int((now + 2.0) * 1000)


def test_cancel_by_msg_id(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        p = c.producer()
        keep = p.send("cx/a", b"keep", delay=1)
        drop = p.send("cx/a", b"drop", delay=1)
        assert p.cancel_delayed(drop.msg_id) is True
        assert p.cancel_delayed("0" * 32) is False                   # not a delayed message here
        recs = _wait_for(c, "cx", 1, 1 + PRECISION_MS / 1000 + MARGIN_S)
        time.sleep(1.0)
        assert [x.body for x in _records(c, "cx")] == [b"keep"]
        assert p.cancel_delayed(keep.msg_id) is False                # already fired
        assert [x.body for x in recs] == [b"keep"]


def test_autobatch_carries_delays_per_message(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        t0 = time.time()
        with c.auto_batch_producer(linger_ms=50) as ab:
            futs = [ab.send("ab/x", b"plain-0"), ab.send("ab/x", b"late", delay=1.0), ab.send("ab/x", b"plain-1")]
            assert ab.flush() == 3
        assert all(f.result().msg_id for f in futs)
        assert [x.body for x in _wait_for(c, "ab", 2, 0.8)] == [b"plain-0", b"plain-1"]
        recs = _wait_for(c, "ab", 3, 1 + PRECISION_MS / 1000 + MARGIN_S)
        assert [x.body for x in recs] == [b"plain-0", b"plain-1", b"late"]
        assert recs[2].store_ts >= int(t0 * 1000) + 1000


def test_asyncio_send_with_delay_and_cancel(lmqtt_store):
    async def go():
        c = AsyncConnection(lmqtt_store.address)
        t0 = time.time()
        r = await c.send("as/x", b"later", delay=1.0)
        gone = await c.send("as/x", b"gone", delay=1.0)
        assert await c.cancel_delayed(gone.msg_id) is True
        await c.close()
        return r, t0
    r, t0 = asyncio.run(go())
    with connect(lmqtt_store.address) as c:
        recs = _wait_for(c, "as", 1, 1 + PRECISION_MS / 1000 + MARGIN_S)
        time.sleep(1.0)
        recs = _records(c, "as")
        assert [x.body for x in recs] == [b"later"]
        assert recs[0].store_ts >= int(t0 * 1000) + 1000


def test_refusals_store_nothing_and_the_connection_goes_on(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        p = c.producer()
        with pytest.raises(StoreClientError, match="exceeds the maximum") as e:
            p.send("rf/x", b"", delay=41 * 86400)
        assert e.value.code == W.E_INVALID
        with pytest.raises(StoreClientError, match=r"topics starting with '\$' belong to the broker"):
            p.send("$rf/x", b"", delay=1)       # a '$' topic is refused before any delay is looked at
        with pytest.raises(ValueError, match="not both"):
            p.send("rf/x", b"", delay=1, deliver_at=1)
        with pytest.raises(ValueError):
            p.send("rf/x", b"", delay=-1)
        p.send("rf/x", b"fine")
        assert [x.body for x in _wait_for(c, "rf", 1, 5)] == [b"fine"]
        assert c.admin().offsets("$timer")[1] == 0                   # nothing parked either


def test_f_delayed_frames_on_the_wire(lmqtt_store):
    """The trailer: one u64 due time per message after the last one; 0 = not delayed. A body too
    short for its trailer is bad_frame and stores nothing; without the flag, the same bytes are
    refused too (bytes after the last message), so a delay is never silently dropped."""
    with connect(lmqtt_store.address) as c:
        packed = pack_one("wf/x", b"a") + pack_one("wf/x", b"b")
        body = W.encode_produce("", 0, 2, packed)
        due = int(time.time() * 1000) + 1000
        op, _f, rb = c.call(W.OP_PRODUCE, body + W.encode_due_trailer([0, due]), flags=W.F_DELAYED)
        assert op == W.OP_PRODUCED and len(W.decode_produced(rb)) == 2
        with pytest.raises(StoreClientError) as e:
            c.call(W.OP_PRODUCE, body + struct.pack(">Q", due), flags=W.F_DELAYED)      # one of two due times
        assert e.value.code == W.E_BAD_FRAME
        with pytest.raises(StoreClientError) as e:
            c.call(W.OP_PRODUCE, body + W.encode_due_trailer([0, due]))                  # flag missing
        assert e.value.code == W.E_BAD_FRAME
        assert [x.body for x in _wait_for(c, "wf", 1, 0.8)] == [b"a"]
        recs = _wait_for(c, "wf", 2, 1 + PRECISION_MS / 1000 + MARGIN_S)
        assert [x.body for x in recs] == [b"a", b"b"]
