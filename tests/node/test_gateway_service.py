"""The store side of the remote gateway seam (store/node/gateway_service.py) on a real `lmqtt
store`, through the SDK connections: wildcard filters held per gateway id (indexed while any
gateway holds them, holds surviving a store restart), gw_pull's dispatch queues, and the PUSH
frames that carry new entries to the gateways that ask for them."""
from __future__ import annotations

import time

import pytest

from lmqtt.store.client import connect


def _max(c, q: str) -> int:
    return c.cmd("gw_max_offsets", queues=[q])["max_offsets"][q]


def _until_max(c, q: str, want: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while (got := _max(c, q)) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


def test_filter_holds_per_gateway_survive_a_restart_and_release_last(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        p = c.producer()
        assert c.cmd("gw_register", gateway="gw1", filter="h/+")["count"] == 1
        assert c.cmd("gw_register", gateway="gw1", filter="h/+")["count"] == 2
        assert c.cmd("gw_register", gateway="gw2", filter="h/+")["count"] == 1
        p.send("h/x", b"1")
        assert _until_max(c, "h/+", 1) == 1
        assert c.cmd("gw_unregister", gateway="gw1", filter="h/+")["count"] == 1
        assert c.cmd("gw_unregister", gateway="gw1", filter="h/+")["count"] == 0
        p.send("h/x", b"2")                                  # gw2 still holds it: still indexed
        assert _until_max(c, "h/+", 2) == 2
        header, recs = c.cmd("gw_pull", queue="h/+", offset=0, max_count=10)
        assert [r[8] for r in recs] == [b"1", b"2"]
        assert all(set(dq) == {"h/x", "h/+"} for dq in header["dq"])
    lmqtt_store.restart()
    with connect(lmqtt_store.address) as c:
        assert c.cmd("gw_filters", gateway="gw2")["filters"] == {"h/+": 1}
        assert c.cmd("gw_filters", gateway="gw1")["filters"] == {}
        c.producer().send("h/y", b"3")
        assert _until_max(c, "h/+", 3) == 3                   # the hold came back with the store
        assert c.cmd("gw_unregister", gateway="gw2", filter="h/+")["count"] == 0
        assert c.cmd("gw_filters", gateway="gw2")["filters"] == {}


def test_a_filter_one_gateway_lets_go_of_just_before_another_holds_it_keeps_its_queue_whole(lmqtt_store):
    # Gateways starting together each reconcile their own holds: the one whose sessions moved away
    # lets go, the one that restores them registers, in either order. The entries of the messages
    # still in flight to those sessions, and those stored meanwhile, must stay readable.
    with connect(lmqtt_store.address) as c:
        p = c.producer()
        assert c.cmd("gw_register", gateway="gw-old", filter="lg/#")["count"] == 1
        p.send("lg/a", b"1")
        p.send("lg/a", b"2")
        assert _until_max(c, "lg/#", 2) == 2
        assert c.cmd("gw_unregister", gateway="gw-old", filter="lg/#")["count"] == 0
        p.send("lg/a", b"3")                                 # nobody holds it for a moment
        assert _until_max(c, "lg/#", 3) == 3
        assert c.cmd("gw_register", gateway="gw-new", filter="lg/#")["count"] == 1
        header, recs = c.cmd("gw_pull", queue="lg/#", offset=0, max_count=10)
        assert [r[8] for r in recs] == [b"1", b"2", b"3"]
        assert c.cmd("gw_unregister", gateway="gw-new", filter="lg/#")["count"] == 0


def test_metadata_commands_round_trip(lmqtt_store):
    import base64

    from lmqtt.lightqueue.records import SessionRecord, Subscription, WillRecord
    with connect(lmqtt_store.address) as c:
        rec = SessionRecord("cid", 5, 60, None, [Subscription("a/#", 1)])
        c.cmd("gw_put_session", client_id="cid", rec=rec.to_bytes().decode())
        assert SessionRecord.from_bytes(c.cmd("gw_get_session", client_id="cid")["rec"].encode()) == rec
        c.cmd("gw_set_offsets", consumer="cid", offsets={"a/#": 7})
        assert c.cmd("gw_get_offsets", consumer="cid")["offsets"] == {"a/#": 7}
        c.cmd("gw_set_retained", topic="r/1", payload=base64.b64encode(b"\x00\xff").decode(), props="")
        assert c.cmd("gw_retained_matching", filter="r/#")["retained"] == [["r/1", "AP8=", ""]]
        w = WillRecord("w/t", b"bye", 1, False, b"", 0, 1)
        c.cmd("gw_put_will", client_id="cid", will=base64.b64encode(w.to_bytes()).decode())
        [[cid, raw]] = c.cmd("gw_list_wills")["wills"]
        assert cid == "cid" and WillRecord.from_bytes(base64.b64decode(raw)) == w
        assert c.cmd("gw_pop_will", client_id="cid")["will"] is not None
        assert c.cmd("gw_list_wills")["wills"] == []
        assert c.cmd("gw_delete_session", client_id="cid")["deleted"] is True
        assert c.cmd("gw_get_session", client_id="cid")["rec"] is None


class _Gate:
    """A dispatcher that holds the dispatch stage while closed: PRODUCED (durable) is answered,
    the light queues do not have the message yet, as on a busy store node."""
    name = "gate"

    def __init__(self) -> None:
        import threading
        self.open = threading.Event()
        self.open.set()

    def checkpoint(self) -> int:
        return 0

    def dispatch(self, batch, end_offset) -> None:
        self.open.wait(10)

    def flush(self) -> None: ...
    def truncate(self, offset) -> None: ...
    def on_segments_deleted(self, m) -> None: ...
    def close(self) -> None: ...


def test_start_offsets_wait_for_dispatch_of_acknowledged_messages(tmp_path):
    """A subscription made right after a publish was acknowledged must start after it (not get it
    as a new message): gw_start_offsets answers only once dispatch passed the acknowledged end,
    where gw_max_offsets may still answer the old end."""
    import asyncio
    import json
    import threading

    from lmqtt.lightqueue import LightQueueStore
    from lmqtt.store.node import gateway_service
    from lmqtt.store.node.sdk_service import install
    from lmqtt.store import MessageStore, StoreConfig
    from lmqtt.store import protocol as W
    from lmqtt.store.server import StoreServer

    store = MessageStore(StoreConfig(data_dir=str(tmp_path / "store"), flush_mode="async"))
    gate = _Gate()
    store.add_dispatcher(gate)             # before the light queues' dispatcher: they wait behind it
    lq = LightQueueStore(store, str(tmp_path / "lq"))
    store.start()
    loop = asyncio.new_event_loop()
    srv = StoreServer(store, str(tmp_path / "meta"), port=0)
    install(srv, lq)
    gws = gateway_service.install(srv, lq, loop)
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        asyncio.run_coroutine_threadsafe(srv.start(), loop).result(5)
        with connect("%s:%d" % srv.address) as c:
            p = c.producer()
            p.send("s/x", b"before")
            assert _until_max(c, "s/x", 1) == 1
            gate.open.clear()
            p.send("s/x", b"acked, not dispatched")                  # returns: durable
            assert _max(c, "s/x") == 1                               # the light queue lags
            # the answer waits for the dispatch; requests behind it on the connection do not
            waiting = c.request(W.OP_CALL, json.dumps({"cmd": "gw_start_offsets", "queues": ["s/x"]}).encode())
            assert _max(c, "s/x") == 1
            assert not waiting.done()
            gate.open.set()
            _op, _f, body = waiting.result(5)
            assert json.loads(body)["max_offsets"]["s/x"] == 2
            assert c.cmd("gw_start_offsets", queues=["s/x"])["max_offsets"]["s/x"] == 2   # idle: at once
    finally:
        gate.open.set()
        asyncio.run_coroutine_threadsafe(srv.stop(), loop).result(5)
        gws.close()
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
        store.shutdown()
        lq.close()


# ---------------------------------------------------------------- wills of a gateway that died
def _will(topic: str, *, retain: bool = False, delay: int = 0):
    import base64

    from lmqtt.lightqueue.records import WillRecord
    return base64.b64encode(WillRecord(topic, b"gone:" + topic.encode(), 1, retain, b"", delay, 1).to_bytes()).decode()


def _until(fn, want, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while (got := fn()) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def test_wills_of_a_gateway_that_stays_away_are_published_by_the_store(tmp_path):
    """Gateway A's store connection closes and A does not come back within the grace period: the
    store publishes A's wills into its light queues (and a retained one as retained), except a
    will voided by the client's new CONNECT, a will another gateway holds now, and one with a
    Will Delay Interval still running (persistent session); A, back later, is told which."""
    from tests.support import LmqttStore
    from lmqtt.lightqueue.records import SessionRecord
    store = LmqttStore(str(tmp_path / "s"), ("--will-grace-s", "0.5"), log_path=str(tmp_path / "s.log")).start()
    try:
        with connect(store.address) as obs, connect(store.address) as b:
            assert b.cmd("gw_hello", gateway="gwB")["wills_published"] == []
            with connect(store.address) as a:
                assert a.cmd("gw_hello", gateway="gwA")["wills_published"] == []
                for cid in ("c1", "c2", "c3", "c4"):
                    a.cmd("gw_put_will", client_id=cid, will=_will(f"will/{cid}"), gateway="gwA")
                a.cmd("gw_put_will", client_id="c5", will=_will("will/c5", retain=True), gateway="gwA")
                # c6: persistent session (expiry 60 s) with a will delay of an hour: waits
                obs.cmd("gw_put_session", client_id="c6", rec=SessionRecord("c6", 5, 60).to_bytes().decode())
                a.cmd("gw_put_will", client_id="c6", will=_will("will/c6", delay=3600), gateway="gwA")
                # c7: no session record, so its will delay ends with the connection
                a.cmd("gw_put_will", client_id="c7", will=_will("will/c7", delay=3600), gateway="gwA")
                assert sorted(c for c, _w in a.cmd("gw_list_wills", gateway="gwA")["wills"]) == \
                    ["c1", "c2", "c3", "c4", "c5", "c6", "c7"]
            # A is gone. c3 reconnects on B without a will (void), c4 with one (B holds it now)
            b.cmd("gw_pop_will", client_id="c3")
            b.cmd("gw_put_will", client_id="c4", will=_will("will/c4b"), gateway="gwB")
            # B's own pop of a will A holds does nothing
            assert b.cmd("gw_pop_will", client_id="c1", gateway="gwB")["will"] is None
            for q in ("will/c1", "will/c2", "will/c5", "will/c7"):
                assert _until(lambda q=q: _max(obs, q), 1) == 1, f"{q} not published: {store.log_tail()}"
            header, recs = obs.cmd("gw_pull", queue="will/c1", offset=0, max_count=10)
            assert [r[8] for r in recs] == [b"gone:will/c1"]
            assert obs.cmd("gw_retained_matching", filter="will/c5")["retained"][0][0] == "will/c5"
            for q in ("will/c3", "will/c4", "will/c4b", "will/c6"):
                assert _max(obs, q) == 0, f"{q} must not be published"
            assert [c for c, _w in obs.cmd("gw_list_wills", gateway="gwA")["wills"]] == ["c6"]
            assert [c for c, _w in obs.cmd("gw_list_wills", gateway="gwB")["wills"]] == ["c4"]
            with connect(store.address) as a2:     # A comes back: told which wills went out
                assert sorted(a2.cmd("gw_hello", gateway="gwA")["wills_published"]) == ["c1", "c2", "c5", "c7"]
                [[cid, _raw]] = a2.cmd("gw_take_wills", gateway="gwA")["wills"]     # A's restart
                assert cid == "c6"
                assert a2.cmd("gw_list_wills", gateway="gwA")["wills"] == []
    finally:
        store.stop()


def test_a_gateway_back_within_the_grace_keeps_its_wills_and_a_restarted_store_waits_for_it(tmp_path):
    """A's connection drops and comes back within the grace period: nothing is published. A store
    that restarts gives every gateway holding wills the grace period to connect: A does, so its
    wills stay; Z never does, so Z's are published."""
    from tests.support import LmqttStore
    store = LmqttStore(str(tmp_path / "s"), ("--will-grace-s", "1.5"), log_path=str(tmp_path / "s.log")).start()
    try:
        with connect(store.address) as a:
            a.cmd("gw_hello", gateway="gwA")
            a.cmd("gw_put_will", client_id="a1", will=_will("back/a1"), gateway="gwA")
        with connect(store.address) as z:
            z.cmd("gw_hello", gateway="gwZ")
            z.cmd("gw_put_will", client_id="z1", will=_will("back/z1"), gateway="gwZ")
            with connect(store.address) as a:       # A back before its grace ended
                assert a.cmd("gw_hello", gateway="gwA")["wills_published"] == []
                time.sleep(2.0)                      # past A's grace: nothing may happen
                assert _max(a, "back/a1") == 0
                assert [c for c, _w in a.cmd("gw_list_wills", gateway="gwA")["wills"]] == ["a1"]
        # store restart while A is connected again at once, Z stays away
        store.restart()
        with connect(store.address) as a:
            a.cmd("gw_hello", gateway="gwA")
            assert _until(lambda: _max(a, "back/z1"), 1) == 1, store.log_tail()
            assert _max(a, "back/a1") == 0
            assert [c for c, _w in a.cmd("gw_list_wills", gateway="gwA")["wills"]] == ["a1"]
    finally:
        store.stop()


def test_metadata_wills_are_held_per_gateway(tmp_path):
    """MetadataStore under the will CALLs: a will moves to the gateway that wrote it last, only its
    holder pops it (or anyone without a gateway: a new CONNECT), take_wills removes one gateway's
    wills only, and the embedded gateway (no id) still sees and takes every will."""
    from lmqtt.lightqueue import MetadataStore
    from lmqtt.lightqueue.records import WillRecord
    md = MetadataStore(str(tmp_path / "md"))
    try:
        md.put_will("c1", WillRecord("t/1"), gateway="g1")
        md.put_will("c2", WillRecord("t/2"), gateway="g1")
        md.put_will("c3", WillRecord("t/3"), gateway="g2")
        md.put_will("c2", WillRecord("t/2b"), gateway="g2")           # c2 moved to g2
        assert [c for c, _w in md.list_wills("g1")] == ["c1"]
        assert sorted(c for c, _w in md.list_wills("g2")) == ["c2", "c3"]
        assert md.pop_will("c2", gateway="g1") is None                 # g1 no longer holds it
        assert md.get_will("c2").topic == "t/2b"
        assert md.will_gateways() == {"g1", "g2"}
        assert [(c, w.topic) for c, w in md.take_wills("g2")] == [("c2", "t/2b"), ("c3", "t/3")]
        assert md.list_wills("g2") == [] and [c for c, _w in md.list_wills()] == ["c1"]
        md.void_will("c1")                                               # any holder
        assert md.list_wills() == [] and md.list_wills("g1") == []
        md.put_will("e", WillRecord("t/e"))                              # embedded: no gateway id
        assert [c for c, _w in md.take_wills()] == ["e"] and md.will_gateways() == set()
    finally:
        md.close()


def test_many_wills_of_a_gateway_that_stays_away_are_all_published(tmp_path):
    """More wills than one append chunk (512): every one is published, each once."""
    from tests.support import LmqttStore
    store = LmqttStore(str(tmp_path / "s"), ("--will-grace-s", "0.2"), log_path=str(tmp_path / "s.log")).start()
    try:
        with connect(store.address) as obs:
            assert obs.cmd("gw_register", gateway="obs", filter="many/#")["count"] == 1
            with connect(store.address) as a:
                a.cmd("gw_hello", gateway="gwM")
                for i in range(1100):
                    a.cmd("gw_put_will", client_id=f"m{i}", will=_will(f"many/{i}"), gateway="gwM")
            assert _until(lambda: _max(obs, "many/#"), 1100, timeout=30) == 1100, store.log_tail()
            # all popped once published: none can go out again
            assert obs.cmd("gw_list_wills", gateway="gwM")["wills"] == []
    finally:
        store.stop()


def test_push_watchers_get_the_new_entries_and_event_watchers_the_offsets(lmqtt_store):
    """`gw_watch {push: true}`: PUSH frames carry the entries themselves (with their dispatch
    queues), each entry once, in offset order, from where the watch or the connection's own pull
    left off; a watch without it still gets EVENT frames (what an older gateway asks for)."""
    import asyncio

    from lmqtt.store import protocol as W
    from lmqtt.store.client.aio import connect_async

    async def go():
        pusher = await connect_async(lmqtt_store.address)
        plain = await connect_async(lmqtt_store.address)
        frames: dict[str, list] = {"push": [], "plain": []}
        pusher.on_push(lambda op, body: frames["push"].append((op, body)))
        plain.on_push(lambda op, body: frames["plain"].append((op, body)))
        r = await pusher.cmd("gw_watch", queues=["ps/a", "ps/b"], push=True)
        assert r == {"max_offsets": {"ps/a": 0, "ps/b": 0}, "push": True}
        assert await plain.cmd("gw_watch", queues=["ps/a"]) == {"max_offsets": {"ps/a": 0}}
        prod = pusher.producer()
        for i in range(20):
            await prod.send("ps/a" if i % 2 == 0 else "ps/b", b"m%d" % i)

        def got(q):
            out = []
            for op, body in frames["push"]:
                assert op == W.OP_PUSH
                for name, mx, recs, dqs in W.decode_push(body):
                    if name == q:
                        assert all(rec[0] < mx for rec in recs)
                        out += [(rec[0], rec[8], dq) for rec, dq in zip(recs, dqs)]
            return out

        deadline = asyncio.get_running_loop().time() + 5
        while (len(got("ps/a")) < 10 or len(got("ps/b")) < 10) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        assert got("ps/a") == [(k, b"m%d" % (2 * k), ("ps/a",)) for k in range(10)]
        assert got("ps/b") == [(k, b"m%d" % (2 * k + 1), ("ps/b",)) for k in range(10)]
        assert frames["plain"] and all(op == W.OP_EVENT for op, _ in frames["plain"])
        assert W.decode_event(frames["plain"][-1][1]) == {"ps/a": 10}
        # a pull on the push connection moves its cursor: what it pulled is not pushed again
        await pusher.cmd("gw_unwatch", queues=["ps/b"])
        await pusher.cmd("gw_watch", queues=["ps/b"], push=True)       # from the end: 10
        await plain.producer().send("ps/b", b"late-1")
        header, recs = await pusher.cmd("gw_pull", queue="ps/b", offset=10, max_count=10)
        if not recs:                                                   # not dispatched yet
            await asyncio.sleep(0.2)
            header, recs = await pusher.cmd("gw_pull", queue="ps/b", offset=10, max_count=10)
        assert [x[8] for x in recs] == [b"late-1"]
        frames["push"].clear()
        await prod.send("ps/b", b"late-2")
        while len(got("ps/b")) < 1 and asyncio.get_running_loop().time() < deadline + 5:
            await asyncio.sleep(0.02)
        assert [(o, b) for o, b, _dq in got("ps/b")] == [(11, b"late-2")]
        await pusher.close()
        await plain.close()
    asyncio.run(go())


def test_push_frames_round_trip_and_malformed_ones_are_refused():
    from lmqtt.store import StoredMessage, protocol as W

    def msg(off, body, dq):
        return StoredMessage("t/x", body, b"\x01p", 0, 0, off, 1000 + off, 50, 7, 8, "id", ("k1", "k2"), dq)
    body = W.encode_push([("t/x", 3, [msg(1, b"a", ("t/x", "t/+")), msg(2, b"", ("t/x",))]), ("idle", 9, [])])
    out = W.decode_push(body)
    assert out == [("t/x", 3, [(1, 1001, 7, 8, 0, "t/x", ("k1", "k2"), b"\x01p", b"a"),
                               (2, 1002, 7, 8, 0, "t/x", ("k1", "k2"), b"\x01p", b"")],
                    [("t/x", "t/+"), ("t/x",)]),
                   ("idle", 9, [], [])]
    for bad in (body[:-1], body + b"\x00", body[:5], b"\x00\x01\x00\x02\xff\xfe" + bytes(12)):
        with pytest.raises(W.ProtocolError) as e:
            W.decode_push(bad)
        assert e.value.code == W.E_BAD_FRAME


def test_a_gateway_that_stops_reading_gets_hints_not_data_and_pulls_the_rest(lmqtt_store):
    """PUSH frames carry data, so a push connection whose replies back up (a frozen gateway) must
    not make the store buffer every new entry for it: it gets hints (max offsets) meanwhile, and
    once it reads again it finds every entry, in order, by pulling from where its pushes stopped."""
    import socket

    from lmqtt.store import protocol as W
    from lmqtt.store.client import connect

    host, port = lmqtt_store.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    dec = W.FrameDecoder()

    def frames_until(pred):
        got = []
        while not pred(got):
            got += dec.feed(s.recv(1 << 20))
        return got

    s.sendall(W.hello_frame("frozen-gw"))
    assert frames_until(lambda f: f)[0][0] == W.OP_HELLO_OK
    s.sendall(W.json_frame(W.OP_CALL, 1, {"cmd": "gw_watch", "queues": ["fz/t"], "push": True}))
    assert frames_until(lambda f: any(x[2] == 1 for x in f))
    n, body = 1200, b"x" * 20_000                        # 24 MB, far beyond the socket buffers
    with connect(lmqtt_store.address) as c:
        p = c.producer()
        for k in range(0, n, 10):                        # this client does not read meanwhile
            p.send_batch([("fz/t", b"%05d" % i + body) for i in range(k, k + 10)])
    entries, hints, maxes = [], 0, []

    def collect(fs):
        nonlocal hints
        for op, _fl, rid, b in fs:
            if op != W.OP_PUSH:
                continue
            for name, mx, recs, _dq in W.decode_push(b):
                maxes.append(mx)
                hints += not recs
                entries.extend((r[0], r[8][:5]) for r in recs)
        return maxes and maxes[-1] == n
    s.settimeout(10)
    while not collect(dec.feed(s.recv(1 << 20))):
        pass
    assert hints, "the store kept pushing data to a connection that did not read"
    have = [o for o, _b in entries]
    assert have == list(range(len(have)))               # what was pushed continues from 0, once
    # the rest by pull, as a gateway does after a hint
    off, rid = len(have), 100
    while off < n:
        rid += 1
        s.sendall(W.json_frame(W.OP_CALL, rid, {"cmd": "gw_pull", "queue": "fz/t", "offset": off,
                                                "max_count": 256, "max_bytes": 4 << 20}))
        (reply,) = [f for f in frames_until(lambda f: any(x[2] == rid for x in f)) if f[2] == rid]
        _h, recs = W.decode_messages(reply[3])
        entries.extend((r[0], r[8][:5]) for r in recs)
        off = recs[-1][0] + 1
    assert entries == [(i, b"%05d" % i) for i in range(n)]
    s.close()


def test_raw_push_watchers_get_the_records_as_written(lmqtt_store):
    """`gw_watch {push: true, raw: true}`: PUSH_RAW frames carry each queue's new entries as the
    CommitLog's record bytes; decoded (as the gateway does) they are the same entries, in offset
    order, each once, with their dispatch queues; a pull still moves the connection's cursor."""
    import asyncio

    from lmqtt.gateway.storage.remote_entries import decode_raw_entries
    from lmqtt.store import protocol as W
    from lmqtt.store.client.aio import connect_async

    async def go():
        pusher = await connect_async(lmqtt_store.address)
        frames: list = []
        pusher.on_push(lambda op, body: frames.append((op, body)))
        r = await pusher.cmd("gw_watch", queues=["pr/a", "pr/b"], push=True, raw=True)
        assert r == {"max_offsets": {"pr/a": 0, "pr/b": 0}, "push": True, "raw": True}
        prod = pusher.producer()
        for i in range(20):
            await prod.send("pr/a" if i % 2 == 0 else "pr/b", b"m%d" % i)
        ident = pusher.ident

        def got(q):
            out = []
            for op, body in frames:
                assert op == W.OP_PUSH_RAW
                for name, mx, first, runs, sizes in W.decode_push_raw(body):
                    if name == q and sizes:
                        msgs = decode_raw_entries(memoryview(body), runs, sizes, first, ident)
                        assert msgs is not None and all(m.queue_offset < mx for m in msgs)
                        out += [(m.queue_offset, m.body, m.dispatch_queues) for m in msgs]
            return out

        deadline = asyncio.get_running_loop().time() + 5
        while (len(got("pr/a")) < 10 or len(got("pr/b")) < 10) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        assert got("pr/a") == [(k, b"m%d" % (2 * k), ("pr/a",)) for k in range(10)]
        assert got("pr/b") == [(k, b"m%d" % (2 * k + 1), ("pr/b",)) for k in range(10)]
        header, recs = await pusher.cmd("gw_pull", queue="pr/a", offset=10, max_count=10)
        frames.clear()
        await prod.send("pr/a", b"late")
        while not got("pr/a") and asyncio.get_running_loop().time() < deadline + 5:
            await asyncio.sleep(0.02)
        assert got("pr/a") == [(10, b"late", ("pr/a",))]
        await pusher.close()
    asyncio.run(go())


def test_raw_push_frames_round_trip_and_malformed_ones_are_refused():
    from lmqtt.store import protocol as W

    body = b"".join(W.encode_push_raw([("t/x", 9, 4, [(100, 2, b"a" * 30), (900, 1, b"b" * 7)], [10, 20, 7]),
                                       ("idle", 3, 3, [], [])]))
    [(n1, mx, first, spans, sizes), idle] = W.decode_push_raw(body)
    assert (n1, mx, first, sizes) == ("t/x", 9, 4, (10, 20, 7)) and idle == ("idle", 3, 3, [], ())
    assert [(p, c) for p, c, _s, _e in spans] == [(100, 2), (900, 1)]
    assert [body[s:e] for _p, _c, s, e in spans] == [b"a" * 30, b"b" * 7] and spans[-1][3] == len(body)
    bad_sizes = b"".join(W.encode_push_raw([("t/x", 9, 4, [(100, 2, b"a" * 30)], [10, 21])]))
    for bad in (body[:-1], body + b"\x00", body[:5], bad_sizes):
        with pytest.raises(W.ProtocolError) as e:
            W.decode_push_raw(bad)
        assert e.value.code == W.E_BAD_FRAME
