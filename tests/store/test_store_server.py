"""The store as a network service: a real `lmqtt store` subprocess, the SDK over real sockets."""
from __future__ import annotations

import json
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest

from lmqtt.store import protocol as W
from lmqtt.store.client import ConnectionLost, StoreClientError, connect
from tests.support import ROOT, LmqttStore, ensure_running, free_port, poll_n, running


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    """One `lmqtt store` for the tests that take `lmqtt_store` here: each uses its own first-level
    topics (queues) and groups; tests that restart or configure a store start their own."""
    d = tmp_path_factory.mktemp("store-server")
    yield from running(LmqttStore(str(d / "store-data"), log_path=str(d / "lmqtt-store.log")))


@pytest.fixture
def lmqtt_store(shared_store):
    """The module's store, running when the test starts."""
    return ensure_running(shared_store)


def _wait(fn, timeout=10.0, step=0.05):
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(step)


def _pull_all(c, topic, qid=0, offset=0, want=None, timeout=10.0):
    out = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = c.pull(topic, qid, offset, 10_000)
        out += r.records
        offset = r.next_offset
        if want is not None and len(out) >= want:
            break
        if want is None and not r.records:
            break
        if not r.records:
            time.sleep(0.05)
    return out


def test_send_pull_keys_props_and_msg_id(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        p = c.producer()
        r = p.send("orders/eu/1", b"hello", keys=("order-1",), user_properties={"k": "v"}, content_type="text/plain")
        assert r.msg_id.endswith(f"{r.offset:016X}") and r.queue_offset == 0
        rs = p.send_batch([("orders/eu/2", b"b%d" % i) for i in range(10)])
        assert [x.queue_offset for x in rs] == list(range(1, 11))
        recs = _pull_all(c, "orders", want=11)
        assert [x.body for x in recs] == [b"hello"] + [b"b%d" % i for i in range(10)]
        first = recs[0]
        assert first.keys == ("order-1",) and first.topic == "orders/eu/1" and first.msg_id == r.msg_id
        assert first.mqtt.user_properties == [("k", "v")] and first.mqtt.content_type == "text/plain"
        # offsets clamp and paginate
        page = c.pull("orders", 0, 5, max_count=3)
        assert [x.queue_offset for x in page.records] == [5, 6, 7] and page.next_offset == 8


def test_a_batch_of_messages_whose_topic_and_keys_read_alike_stores_each_as_sent(lmqtt_store):
    """Topic "alias/a" keyed "b" and topic "alias/ab" without keys are one run of bytes split in two
    places in a PRODUCE (the store once gave the second the first one's topic and keys)."""
    with connect(lmqtt_store.address) as c:
        c.producer().send_batch([dict(topic="alias/a", body=b"1", keys=("b",)), dict(topic="alias/ab", body=b"2"),
                                 dict(topic="alias/a", body=b"3", keys=("b",))])
        recs = _pull_all(c, "alias", want=3)
        assert [(r.topic, r.keys, r.body) for r in recs] == \
            [("alias/a", ("b",), b"1"), ("alias/ab", (), b"2"), ("alias/a", ("b",), b"3")]


def test_autobatch_delivers_everything_in_order(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        with c.auto_batch_producer(batch_bytes=16 << 10, linger_ms=2) as ab:
            futs = [ab.send("bulk/t", b"%06d" % i + b"x" * 94) for i in range(30_000)]
        res = [f.result() for f in futs]
        assert [r.queue_offset for r in res] == list(range(30_000))
        recs = _pull_all(c, "bulk", want=30_000)
        assert len(recs) == 30_000
        assert all(r.body[:6] == b"%06d" % i for i, r in enumerate(recs))


def test_pipelining_many_requests_in_flight_matched_by_id(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        p = c.producer()
        for i in range(50):
            p.send(f"pipe/{i % 5}", b"m%d" % i)
        _wait(lambda: len(c.pull("pipe", 0, 0, 100).records) == 50)
        # 300 requests of three kinds sent before any reply is read; each reply must fit its request
        futs = []
        for i in range(300):
            kind = i % 3
            if kind == 0:
                futs.append((kind, i, c.request(W.OP_PULL, W.encode_pull("pipe", 0, i % 50, 1, 0))))
            elif kind == 1:
                futs.append((kind, i, c.request(W.OP_CALL, json.dumps({"cmd": "offsets", "topic": "pipe"}).encode())))
            else:
                futs.append((kind, i, c.request(W.OP_PRODUCE, W.encode_produce(
                    "", 0, 1, W.encode_messages_for_produce([(f"piped/{i}", b"x%d" % i, (), b"", 0, 0)])))))
        produced = []
        for kind, i, f in futs:
            op, _fl, body = f.result(10)
            if kind == 0:
                assert op == W.OP_MESSAGES
                _h, msgs = W.decode_messages(body)
                assert msgs[0][0] == i % 50 and msgs[0][8] == b"m%d" % (i % 50)
            elif kind == 1:
                assert op == W.OP_RESULT and json.loads(body)["max_offset"] == 50
            else:
                assert op == W.OP_PRODUCED
                produced.append((i, W.decode_produced(body)[0]))
        assert [q for _i, (_p, q) in produced] == list(range(100))     # appended in request order
        recs = _pull_all(c, "piped", want=100)
        assert [r.body for r in recs] == [b"x%d" % i for i, _ in produced]


def test_filter_consumer_sees_what_mqtt_subscriber_sees(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        plus = c.filter_consumer("sensors/+/temp")
        hashc = c.filter_consumer("sensors/#")
        exact = c.filter_consumer("sensors/b/temp")
        p = c.producer()
        for t in ("sensors/a/temp", "sensors/b/temp", "sensors/a/hum", "other/a/temp", "sensors/b/c/temp"):
            p.send(t, t.encode())
        p.send("other/end", b"end")
        assert _wait(lambda: c.pull("other", 0, 0).records[-1:] and True)   # everything before is visible
        got_plus = poll_n(plus, 2)
        assert sorted(r.topic for r in got_plus) == ["sensors/a/temp", "sensors/b/temp"]
        assert sorted(r.topic for r in poll_n(hashc, 4)) == ["sensors/a/hum", "sensors/a/temp", "sensors/b/c/temp",
                                                         "sensors/b/temp"]
        assert [r.topic for r in poll_n(exact, 1)] == ["sensors/b/temp"]
        assert plus.poll() == []
        with pytest.raises(StoreClientError) as ei:
            c.filter_consumer("sensors/#/bad")
        assert ei.value.code == W.E_INVALID


def test_group_offsets_survive_store_restart(tmp_path):
    srv = LmqttStore(str(tmp_path / "d"), log_path=str(tmp_path / "s.log")).start()
    try:
        c = connect(srv.address)
        c.producer().send_batch([("grp/a", b"%d" % i) for i in range(20)])
        cons = c.consumer("grp", "billing")
        got = poll_n(cons, 20)
        assert len(got) == 20
        cons.commit(12)
        fc = c.filter_consumer("grp/+", group="billing-f", start="earliest")
        c.producer().send("grp/b", b"after")
        # earliest: the filter's history (grp/a, stored before the filter was registered), then live
        assert [r.body for r in poll_n(fc, 21)] == [b"%d" % i for i in range(20)] + [b"after"]
        fc.commit()
        c.close()
        srv.restart()
        c = connect(srv.address)
        assert c.consumer("grp", "billing").position == 12
        assert [r.body for r in c.consumer("grp", "billing").poll()] == [b"%d" % i for i in range(12, 20)] + [b"after"]
        assert c.admin().committed("billing", "grp") == 12
        lag = {(q.get("topic") or q.get("filter")): q["lag"] for q in c.admin().lag("billing")}
        assert lag == {"grp": 9}
        fc2 = c.filter_consumer("grp/+", group="billing-f")
        assert fc2.position == 1
        c.producer().send("grp/c", b"later")
        assert [r.body for r in _wait(lambda: fc2.poll() or None)] == [b"later"]   # filter still registered
        c.close()
    finally:
        srv.stop()


def test_producer_retry_same_sequence_stored_once_even_across_restart(tmp_path):
    srv = LmqttStore(str(tmp_path / "d"), log_path=str(tmp_path / "s.log")).start()
    try:
        c = connect(srv.address)
        p = c.producer("producer-A")
        packed = W.encode_messages_for_produce([("dedup/x", b"one", (), b"", 0, 0), ("dedup/x", b"two", (), b"", 0, 0)])
        first = p.send_packed(2, packed, seq=7)
        again = p.send_packed(2, packed, seq=7)
        assert again == first
        c.close()
        srv.restart(kill=True)          # dedup state is on disk, not in the process
        c = connect(srv.address)
        third = c.producer("producer-A").send_packed(2, packed, seq=7)
        assert third == first
        assert [r.body for r in _pull_all(c, "dedup", want=2)] == [b"one", b"two"]
        time.sleep(0.2)
        assert len(c.pull("dedup", 0, 0).records) == 2
        # a new sequence is stored; batches re-sent out of order are each stored once
        pa = c.producer("producer-A")
        pa.send_packed(2, packed, seq=10)
        pa.send_packed(2, packed, seq=9)        # in flight with 10, re-sent after it: not a duplicate
        pa.send_packed(2, packed, seq=10)
        # a new Producer object with the same id (a restarted process) continues above
        assert c.producer("producer-A").send("dedup/x", b"three").queue_offset == 6
        assert len(_pull_all(c, "dedup", want=7)) == 7
        c.close()
    finally:
        srv.stop()


def test_client_reconnects_after_store_restart_and_in_flight_fail_clearly(tmp_path):
    srv = LmqttStore(str(tmp_path / "d"), log_path=str(tmp_path / "s.log")).start()
    try:
        c = connect(srv.address, backoff_initial=0.1, reconnect_attempts=30)
        p = c.producer()
        p.send("rc/a", b"1")
        srv.proc.send_signal(signal.SIGSTOP)             # the request below is in flight, unanswered
        fut = c.request(W.OP_CALL, b'{"cmd":"stats"}')
        time.sleep(0.2)
        assert not fut.done()
        srv.kill9()
        with pytest.raises(ConnectionLost):
            fut.result(10)
        srv.start()
        assert p.send("rc/a", b"2").queue_offset == 1     # reconnected under the hood
        assert [r.body for r in _pull_all(c, "rc", want=2)] == [b"1", b"2"]
        c.close()
    finally:
        srv.stop()


def _raw(srv, hello=True):
    s = socket.create_connection((srv.host, srv.port), timeout=5)
    dec = W.FrameDecoder()
    if hello:
        s.sendall(W.json_frame(W.OP_HELLO, 1, {"version": 1}))
        assert _recv(s, dec)[0] == W.OP_HELLO_OK
    return s, dec


def _recv(s, dec):
    """Next frame (op, rid, body), or None when the server closed the connection."""
    buf = dec.__dict__.setdefault("pending", []) if hasattr(dec, "__dict__") else _PENDING.setdefault(id(dec), [])
    while not buf:
        data = s.recv(65536)
        if not data:
            return None
        buf += dec.feed(data)
    op, fl, rid, body = buf.pop(0)
    return op, rid, body


_PENDING: dict = {}


def test_malformed_truncated_oversized_frames(lmqtt_store):
    s, dec = _raw(lmqtt_store)
    # a PRODUCE whose message claims more bytes than the frame has: error, nothing stored, open
    bad = W.encode_produce("", 0, 2, W.encode_messages_for_produce([("bad/x", b"ok", (), b"", 0, 0)]))
    s.sendall(W.frame(W.OP_PRODUCE, 5, bad))
    op, rid, body = _recv(s, dec)
    assert (op, rid, W.parse_error(body)[0]) == (W.OP_ERROR, 5, W.E_BAD_FRAME)
    # trailing junk, a truncated PULL, garbage JSON, unknown command, unknown opcode: each answered
    s.sendall(W.frame(W.OP_PRODUCE, 6, W.encode_produce("", 0, 1, W.encode_messages_for_produce(
        [("bad/y", b"ok", (), b"", 0, 0)])) + b"junk"))
    s.sendall(W.frame(W.OP_PULL, 7, b"\x00\x01"))
    s.sendall(W.frame(W.OP_CALL, 8, b"{not json"))
    s.sendall(W.frame(W.OP_CALL, 9, b'{"cmd":"nope"}'))
    s.sendall(W.frame(0x55, 10, b""))
    s.sendall(W.frame(W.OP_CALL, 11, b'{"cmd":"commit","group":"g"}'))     # missing keys
    s.sendall(W.frame(W.OP_PRODUCE, 12, W.encode_produce("", 0, 1, W.encode_messages_for_produce(
        [("bad/+/wild", b"x", (), b"", 0, 0)]))))
    codes = {}
    for _ in range(7):
        op, rid, body = _recv(s, dec)
        assert op == W.OP_ERROR
        codes[rid] = W.parse_error(body)[0]
    assert codes == {6: W.E_BAD_FRAME, 7: W.E_BAD_FRAME, 8: W.E_BAD_FRAME, 9: W.E_UNKNOWN_CMD,
                     10: W.E_BAD_FRAME, 11: W.E_INVALID, 12: W.E_INVALID}
    # the same connection still serves
    s.sendall(W.frame(W.OP_CALL, 13, b'{"cmd":"offsets","topic":"bad"}'))
    op, rid, body = _recv(s, dec)
    assert op == W.OP_RESULT and rid == 13 and json.loads(body)["max_offset"] == 0   # nothing stored
    # oversized length: error frame then close
    s.sendall(struct.pack(">IBBI", (1 << 31), W.OP_PRODUCE, 0, 14))
    op, rid, body = _recv(s, dec)
    assert op == W.OP_ERROR and W.parse_error(body)[0] == W.E_TOO_LARGE
    assert _recv(s, dec) is None
    s.close()
    # a length below the header, then a frame cut off by the client closing
    s, dec = _raw(lmqtt_store)
    s.sendall(struct.pack(">IBBI", 2, 0, 0, 0))
    assert W.parse_error(_recv(s, dec)[2])[0] == W.E_BAD_FRAME
    s.close()
    s, dec = _raw(lmqtt_store)
    s.sendall(W.frame(W.OP_PRODUCE, 3, W.encode_produce("", 0, 1, W.encode_messages_for_produce(
        [("bad/z", b"x" * 1000, (), b"", 0, 0)])))[:500])
    s.close()
    # no HELLO first: error + close; wrong version: error + close
    s, dec = _raw(lmqtt_store, hello=False)
    s.sendall(W.frame(W.OP_CALL, 1, b'{"cmd":"stats"}'))
    assert W.parse_error(_recv(s, dec)[2])[0] == W.E_NOT_READY and _recv(s, dec) is None
    s, dec = _raw(lmqtt_store, hello=False)
    s.sendall(W.json_frame(W.OP_HELLO, 1, {"version": 99}))
    assert W.parse_error(_recv(s, dec)[2])[0] == W.E_VERSION and _recv(s, dec) is None
    # the server is alive and stored nothing of all that
    with connect(lmqtt_store.address) as c:
        assert c.admin().offsets("bad") == (0, 0)
        assert c.producer().send("bad/ok", b"fine").queue_offset == 0
    assert lmqtt_store.proc.poll() is None


def test_pop_two_consumers_exclusive_redelivery_and_dead_letter(lmqtt_store):
    with connect(lmqtt_store.address) as c1, connect(lmqtt_store.address) as c2:
        c1.producer().send_batch([("jobs/x", b"%d" % i) for i in range(40)])
        _wait(lambda: len(c1.pull("jobs", 0, 0, 100).records) == 40)
        a = c1.pop_consumer("jobs", "workers", invisible_ms=1500, max_attempts=2)
        b = c2.pop_consumer("jobs", "workers", invisible_ms=1500, max_attempts=2)
        got_a, got_b = [], []
        for _ in range(10):
            got_a += a.pop(3)
            got_b += b.pop(4)
        ids_a = {r.queue_offset for r in got_a}
        ids_b = {r.queue_offset for r in got_b}
        assert not ids_a & ids_b and ids_a | ids_b == set(range(40))
        assert a.pop(10) == [] and b.pop(10) == []          # all invisible now
        a.ack(got_a)                                        # b acks none of its own
        keep = got_b[0]
        assert b.change_invisible_time(keep, 60_000)
        # b's messages come back as their invisibility ends, which is 1.5 s after each of b's pops:
        # on a loaded machine those pops are spread out, so they may come back over several pops
        want = ids_b - {keep.queue_offset}
        back = []
        deadline = time.monotonic() + 10
        while {r.queue_offset for r in back} != want and time.monotonic() < deadline:
            back += a.pop(100)
            time.sleep(0.02)
        assert {r.queue_offset for r in back} == want
        assert set(a.last_attempts.values()) == {2}
        # second attempt also unacked: the next due pop moves them to the dead-letter topic
        time.sleep(1.6)
        assert a.pop(100) == []
        info = c1.admin().pop_info("workers", "jobs")
        assert info["inflight"] == 1 and info["dlq_topic"] == "%DLQ%workers"
        dlq = _pull_all(c1, "%DLQ%workers", want=len(back))
        assert sorted(r.body for r in dlq) == sorted(r.body for r in back)
        assert b.ack([keep]) == 1


def test_queries_key_range_time_msgid_and_admin(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        p = c.producer()
        t0 = int(time.time() * 1000)
        r1 = p.send("q/a", b"v1", keys=("dev-1",))
        time.sleep(0.05)
        t1 = int(time.time() * 1000)
        r2 = p.send("q/a", b"v2", keys=("dev-1", "x"))
        p.send("q/a", b"v3", keys=("dev-2",))
        a = c.admin()
        _wait(lambda: len(a.query_by_key("q/a", "dev-1")) == 2)
        assert [m.body for m in a.query_by_key("q/a", "dev-1")] == [b"v2", b"v1"]       # newest first
        assert [m.body for m in a.query_by_key("q/a", "dev-1", begin_ms=t1)] == [b"v2"]
        assert a.query_by_key("q/a", "dev-1", end_ms=t0 - 1) == []
        assert a.get_by_msg_id(r1.msg_id).body == b"v1" and a.get_by_msg_id("00" * 16) is None
        assert a.offset_for_time("q", t1) == r2.queue_offset
        assert a.offset_for_time("q", 0) == 0 and a.offset_for_time("q", t1 + 10**9) == 3
        assert {"topic": "q", "queue_id": 0, "max_offset": 3} in a.topics()
        st = a.stats()
        assert st["max_offset"] > 0 and st["connections"] >= 1


def test_non_loopback_bind_requires_token_and_client_sends_it(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "store", "--host", "0.0.0.0", "--port",
                        str(free_port()), "--data-dir", str(tmp_path / "x")], cwd=ROOT, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and "without an auth token" in r.stderr
    srv = LmqttStore(str(tmp_path / "d"), extra_args=("--token", "s3cret"), log_path=str(tmp_path / "s.log")).start()
    try:
        with pytest.raises(StoreClientError) as ei:
            connect(srv.address)
        assert ei.value.code == W.E_AUTH
        with pytest.raises(StoreClientError):
            connect(srv.address, token="wrong")
        with connect(srv.address, token="s3cret") as c:
            assert c.producer().send("tok/a", b"x").queue_offset == 0
    finally:
        srv.stop()


def test_unwritable_data_dir_is_named(tmp_path):
    f = tmp_path / "plainfile"
    f.write_text("x")
    for cmd in ("store", "serve"):
        args = [sys.executable, "-m", "lmqtt.gateway.cli", cmd, "--port", str(free_port()),
                "--data-dir", str(f / "data")]
        if cmd == "serve":
            args += ["--metrics-port", "0", "--store-port", str(free_port())]
        r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert r.returncode == 1, r.stderr
        assert "cannot use data dir" in r.stderr and "plainfile" in r.stderr and "cannot listen" not in r.stderr


def test_async_connection_send_and_pull(lmqtt_store):
    import asyncio
    from lmqtt.store.client import connect_async

    async def go():
        c = await connect_async(lmqtt_store.address)
        rs = await asyncio.gather(*[c.send("aio/t", b"%d" % i) for i in range(50)])
        assert sorted(r.queue_offset for r in rs) == list(range(50))
        for _ in range(100):
            res = await c.pull("aio", 0, 0, 100)
            if len(res.records) == 50:
                break
            await asyncio.sleep(0.05)
        assert sorted(int(r.body) for r in res.records) == list(range(50))
        await c.close()
    asyncio.run(go())


def test_serve_store_port_taken_is_named(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "serve", "--port", str(free_port()),
                            "--metrics-port", "0", "--data-dir", str(tmp_path / "d"), "--store-port", str(port)],
                           cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert r.returncode == 1
        assert f"cannot listen on store port 127.0.0.1:{port}" in r.stderr
        r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "store", "--port", str(port),
                            "--data-dir", str(tmp_path / "s")], cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert r.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in r.stderr
    finally:
        busy.close()


def test_pop_state_survives_store_restart(tmp_path):
    srv = LmqttStore(str(tmp_path / "d"), log_path=str(tmp_path / "s.log")).start()
    try:
        c = connect(srv.address)
        c.producer().send_batch([("popr/x", b"%d" % i) for i in range(6)])
        _wait(lambda: len(c.pull("popr", 0, 0).records) == 6)
        # invisible long enough to outlast the restart on a loaded machine (2 s did not, once)
        pc = c.pop_consumer("popr", "g", invisible_ms=8000)
        got = pc.pop(4)
        assert [r.body for r in got] == [b"0", b"1", b"2", b"3"]
        pc.ack(got[:2])
        c.close()
        srv.restart()                 # SIGTERM: state persisted at shutdown
        c = connect(srv.address)
        pc = c.pop_consumer("popr", "g", invisible_ms=8000)
        assert [r.body for r in pc.pop(10)] == [b"4", b"5"]       # 2, 3 still invisible; 0, 1 acked
        back = _wait(lambda: pc.pop(10), timeout=30)
        assert sorted(r.body for r in back) == [b"2", b"3"]
        c.close()
    finally:
        srv.stop()


def test_oversized_batch_refused_by_client_and_server_connection_error_named(tmp_path):
    srv = LmqttStore(str(tmp_path / "d"), extra_args=("--max-frame-mb", "1"), log_path=str(tmp_path / "s.log")).start()
    try:
        with connect(srv.address) as c:
            with pytest.raises(StoreClientError) as ei:
                c.producer().send("big/x", b"x" * (2 << 20))
            assert ei.value.code == W.E_TOO_LARGE
            c.server_info["max_frame"] = 1 << 30      # pretend not to know: the server refuses and closes
            with pytest.raises(ConnectionLost, match="too_large"):
                c.request(W.OP_PRODUCE, W.encode_produce("", 0, 1, W.encode_messages_for_produce(
                    [("big/x", b"x" * (2 << 20), (), b"", 0, 0)]))).result(10)
            assert c.producer().send("big/x", b"small").queue_offset == 0   # reconnects
            assert _wait(lambda: c.admin().offsets("big") == (0, 1))
        # a peer that writes the whole oversized frame reads the ERROR, then a clean close (the
        # server reads the frame away first: no "connection reset" in the middle of the write)
        for _ in range(3):
            s, dec = _raw(srv)
            s.sendall(W.frame(W.OP_PRODUCE, 9, b"\0" * (3 << 20)))
            op, rid, body = _recv(s, dec)
            assert op == W.OP_ERROR and W.parse_error(body)[0] == W.E_TOO_LARGE
            assert _recv(s, dec) is None
            s.close()
    finally:
        srv.stop()
