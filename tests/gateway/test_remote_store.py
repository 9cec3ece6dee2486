"""`RemoteStore` (gateway/storage/remote_store.py) against a real `lmqtt store`, driven directly: the
mirror serves what the store holds in order, stays within its byte budget (readers behind it read
through to the store), announces new data only once it is local, and stops mirroring queues
nobody reads."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from lmqtt.gateway.storage.facades import Answer
from lmqtt.gateway.storage.remote_metadata import RemoteFilters
from lmqtt.gateway.storage.remote_store import RemoteStore
from lmqtt.gateway.storage.store_link import LoopConnection
from lmqtt.lightqueue.records import WillRecord
from lmqtt.store import Message, MessageTooLarge
from lmqtt.store import protocol as W
from tests.support import wait_until

pytestmark = pytest.mark.timeout(60)


def _remote(address, **kw):
    link = LoopConnection(address, loop=asyncio.get_running_loop())
    link.connect_blocking()
    return RemoteStore(link, "test-gw", safety_poll_s=0.2, **kw)


async def _read_all(st: RemoteStore, q: str, end: int, max_count: int) -> tuple[list, int]:
    """Pull `q` from 0 to `end` as the delivery engine does: a pull behind the mirror is an answer
    not done at once (the chunk is asked for, not waited for), done when the chunk is in. Returns
    the bodies in order and how many pulls had to wait."""
    got, off, waited = [], 0, 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while off < end:
        assert loop.time() < deadline, off
        a = st.pull(q, off, max_count=max_count)
        if not a.done():
            waited += 1
            await asyncio.wait_for(_awaited(a), 20)         # until the chunk is in
        res = a.result()
        if not res.messages:
            assert res.next_offset == off, (off, res)      # nothing is skipped
            await asyncio.sleep(0.001)
            continue
        assert [x.queue_offset for x in res.messages] == list(range(off, off + len(res.messages)))
        got += [x.body for x in res.messages]
        off = res.next_offset
    return got, waited


async def _awaited(answer):
    return await answer


async def _append(st: RemoteStore, topic: str, bodies: list[bytes]) -> None:
    res = st.append_batch([Message(topic, b, 0, 0, b"", (), 0, ()) for b in bodies])
    await res[-1].durable


async def _behind(address, q: str, n: int, fetch_batch: int, batch: int = 500):
    """A RemoteStore whose mirror of `q` keeps only the newest 50-100 entries, after `n` were
    appended (`batch` at a time): a reader from 0 reads behind it. -> (store, the bodies)."""
    st = _remote(address, fetch_batch=fetch_batch)
    st.mirror_entries = 100
    assert st.max_offset(q).wait() == 0
    st.start()
    bodies = [b"%05d" % i for i in range(n)]
    for k in range(0, n, batch):
        await _append(st, q, bodies[k:k + batch])
    assert await wait_until(lambda: st.max_offset(q).wait() == n)
    return st, bodies


def test_mirror_serves_in_order_within_its_budget_and_reads_through_behind_it(lmqtt_store):
    async def go():
        st = _remote(lmqtt_store.address, mirror_bytes=64 << 10)
        heard: list[set] = []
        st.on_new_data(heard.append)
        assert st.max_offset("rs/t").wait() == 0                 # tracked (watched) from here on
        st.start()
        bodies = [b"%06d" % i + b"." * 1000 for i in range(300)]     # ~300 KB through a 64 KB budget
        for k in range(0, 300, 50):
            await _append(st, "rs/t", bodies[k:k + 50])
        assert await wait_until(lambda: st.max_offset("rs/t").wait() == 300), st.max_offset("rs/t").wait()
        assert heard and all(s == {"rs/t"} for s in heard)
        assert st.mirrored_bytes <= 64 << 10 and st.mirror_trims >= 1
        m = st.queues["rs/t"]
        assert m.base > 0                                 # the oldest entries left the mirror ...
        got, waited = await _read_all(st, "rs/t", 300, 64)
        assert got == bodies                              # ... and are still read, in order
        assert st.remote_misses == 1 and waited == 1      # one chunk read, joined to the mirror
        st.close()
        st.link.close()
    asyncio.run(go())


def test_a_reader_far_behind_the_mirror_reads_in_chunks_in_order(lmqtt_store):
    """A subscriber thousands of entries behind (fan-in at full rate) must not cost one round trip
    per delivery batch: it reads chunks of `fetch_batch` entries, and none of them blocks."""
    async def go():
        st, bodies = await _behind(lmqtt_store.address, "lag/t", 3000, 512)
        assert st.queues["lag/t"].base >= 2900
        got, waited = await _read_all(st, "lag/t", 3000, 32)
        assert got == bodies
        assert st.remote_misses <= 3000 // 512 + 1, st.remote_misses    # not 3000 / 32
        assert waited <= st.remote_misses
        st.close()
        st.link.close()
    asyncio.run(go())


def test_a_reader_behind_the_mirror_finds_its_next_chunk_read_ahead(lmqtt_store):
    """A reader behind the mirror that delivers what it reads (time passes between its pulls)
    waits for its first chunk only: past a chunk's middle the next one is asked for, and it
    continues the chunk the reader is in (in order, nothing skipped, nothing read twice)."""
    async def go():
        st, bodies = await _behind(lmqtt_store.address, "ahead/t", 2000, 256)
        m = st.queues["ahead/t"]
        assert m.base >= 1900
        got, off, waited = [], 0, 0
        while off < 2000:
            a = st.pull("ahead/t", off, max_count=32)
            if not a.done():
                waited += 1
                await asyncio.wait_for(_awaited(a), 20)
            res = a.result()
            assert [x.queue_offset for x in res.messages] == list(range(off, off + len(res.messages)))
            got += [x.body for x in res.messages]
            off = res.next_offset
            await asyncio.sleep(0.01)                      # the delivery of what was read
        assert got == bodies
        assert waited == 1, waited                         # the first chunk; the others were in
        assert st.remote_misses <= 2000 // 128 + 2, st.remote_misses
        assert len(m.back) <= 2 * 256                      # what the reader passed was let go
        st.close()
        st.link.close()
    asyncio.run(go())


def test_a_reader_joining_another_readers_read_behind_the_mirror_still_gets_its_entries(lmqtt_store):
    """Two readers behind the mirror, far apart: one's read ahead is under way when the other
    asks for entries that read will not bring. Its answer is its own entries (read after that
    one), never an empty answer that would leave it waiting for news of the queue."""
    async def go():
        st, bodies = await _behind(lmqtt_store.address, "two/t", 1000, 64, batch=1000)
        m = st.queues["two/t"]
        a = st.pull("two/t", 500, max_count=16)
        await asyncio.wait_for(_awaited(a), 20)
        b = st.pull("two/t", 516, max_count=24)                # past the chunk's middle: reads ahead
        assert b.done() and b.result().next_offset == 540
        assert m.reading_back == 564                           # under way
        far = st.pull("two/t", 100, max_count=8)               # the other reader, far behind
        assert not far.done()
        res = await asyncio.wait_for(_awaited(far), 20)
        assert [x.body for x in res.messages] == bodies[100:108]
        st.close()
        st.link.close()
    asyncio.run(go())


def test_pushes_pass_over_a_full_mirror_whose_readers_are_all_behind_it(lmqtt_store):
    """A subscriber that fell behind the mirror (fan-in faster than its delivery): the entries
    pushed while every pull is behind the mirror would be trimmed before it gets there, so they
    are not decoded into it; the reader still reads every entry, in order, in chunks. Once a
    reader is at the mirror's head again, pushes are taken as before."""
    async def go():
        st, bodies = await _behind(lmqtt_store.address, "pass/t", 1000, 64, batch=1000)
        bodies += [b"%05d" % i for i in range(1000, 1500)]
        m = st.queues["pass/t"]
        taken = st.pushed_entries
        got, off = [], 0
        for k in range(1000, 1500, 50):
            await _append(st, "pass/t", bodies[k:k + 50])
            assert await wait_until(lambda: st.max_offset("pass/t").wait() == k + 50)
            a = st.pull("pass/t", off, max_count=16)            # behind the mirror
            if not a.done():
                await asyncio.wait_for(_awaited(a), 20)
            res = a.result()
            got += [x.body for x in res.messages]
            off = res.next_offset
        assert st.push_skipped >= 300, (st.push_skipped, st.pushed_entries - taken)
        assert st.pushed_entries - taken <= 200
        rest, _waited = await _read_all(st, "pass/t", 1500, 64)
        assert got + rest[off:] == bodies                    # nothing lost, nothing twice
        assert st.pull("pass/t", 1500).result().messages == []     # the reader is at the head now
        await _append(st, "pass/t", [b"live"])
        assert await wait_until(lambda: m.end == 1501 and m.items and m.items[-1].body == b"live")
        st.close()
        st.link.close()
    asyncio.run(go())


def test_a_raw_pull_gives_what_a_decoded_pull_gives(lmqtt_store):
    """`gw_pull` with `raw` (what a reader behind the mirror reads with): the records as the store
    wrote them, decoded and checked here, are the entries the decoded reply carries, with their
    light-queue offsets and dispatch queues; where there is nothing to serve raw the store answers
    with the decoded reply."""
    from lmqtt.gateway.storage.remote_entries import RawPullReply, entries
    from lmqtt.store.node.protocol import PullReply

    async def go():
        st = _remote(lmqtt_store.address)
        res = st.append_batch([Message("raw/t", b"r%d" % i, 0, 0, b"\x01p", (), 0, ("raw/t",)) for i in range(30)])
        await res[-1].durable
        assert await wait_until(lambda: st.max_offset("raw/t").wait() == 30)
        raw = await st.node.pull("raw/t", 5, 10, 1 << 20, raw=True)
        dec = await st.node.pull("raw/t", 5, 10)
        assert type(raw) is RawPullReply and type(dec) is PullReply
        assert raw.next_offset == dec.next_offset == 15
        fields = [[(m.queue_offset, m.topic, m.body, m.props, tuple(m.dispatch_queues)) for m in entries(r)]
                  for r in (raw, dec)]
        assert fields[0] == fields[1] == [(k, "raw/t", b"r%d" % k, b"\x01p", ("raw/t",)) for k in range(5, 15)]
        past = await st.node.pull("raw/t", 30, 10, 1 << 20, raw=True)     # nothing there yet
        assert type(past) is PullReply and past.messages == [] and past.next_offset == 30
        st.close()
        st.link.close()
    asyncio.run(go())


def test_unserved_queues_are_forgotten_and_too_large_refused_before_sending(lmqtt_store):
    async def go():
        st = _remote(lmqtt_store.address)
        served = {"keep/t"}
        st.is_served = lambda q: q in served
        st.max_offset("keep/t").wait()
        st.max_offset("drop/t").wait()
        assert st.forget_unserved() == 1 and set(st.queues) == {"keep/t"}
        with pytest.raises(MessageTooLarge):
            st.append_batch([Message("keep/t", b"x" * (4 << 20), 0, 0, b"", (), 0, ())])
        await _append(st, "drop/t", [b"later"])            # a forgotten queue is tracked again on use
        assert await wait_until(lambda: st.max_offset("drop/t").wait() == 1 or st.queues["drop/t"].end == 1)
        assert (await _read_all(st, "drop/t", 1, 32))[0] == [b"later"]
        st.link.close()
    asyncio.run(go())


@pytest.mark.parametrize("raw", [True, False], ids=["raw-records", "messages"])
def test_new_entries_come_with_the_event_and_need_no_pull(lmqtt_store, raw):
    """The store pushes what a watched queue gained: local readers get it without a gw_pull round
    trip (one store read per queue and event either way), in order, once; as the store's record
    bytes (PUSH_RAW, decoded here) or as messages (PUSH, what a gateway asks without raw)."""
    async def go():
        st = _remote(lmqtt_store.address, raw_push=raw)
        heard: list[set] = []
        st.on_new_data(heard.append)
        assert st.max_offset("push/t").wait() == 0 and st.push
        st.start()
        writer = _remote(lmqtt_store.address)            # another gateway publishes
        bodies = [b"%03d" % i for i in range(60)]
        for k in range(0, 60, 6):
            await _append(writer, "push/t", bodies[k:k + 6])
        assert await wait_until(lambda: st.max_offset("push/t").wait() == 60)
        assert [m.body for m in st.pull("push/t", 0, max_count=100).wait().messages] == bodies
        assert st.pushed_entries == 60 and st.push_skipped == 0
        assert st.remote_pulls == st.pushed_batches          # every read was a push: no gw_pull sent
        assert heard and all(s == {"push/t"} for s in heard)
        kinds = {type(m).__name__ for m in st.queues["push/t"].items}
        assert kinds == ({"StoredMessage"} if raw else {"RemoteMessage"})      # the frames it got
        st.close()
        for s in (st, writer):
            s.link.close()
    asyncio.run(go())


@pytest.mark.parametrize("raw", [True, False], ids=["raw-records", "messages"])
def test_entries_a_push_cannot_place_are_pulled_and_nothing_is_lost(lmqtt_store, raw):
    """Pushes are hints too: after a lost connection the store pushes from its current end, so the
    mirror has a gap below the first push; it pulls the gap (nothing lost, nothing twice)."""
    async def go():
        st = _remote(lmqtt_store.address, raw_push=raw)
        assert st.max_offset("gap/t").wait() == 0
        st.start()
        writer = _remote(lmqtt_store.address)
        await _append(writer, "gap/t", [b"a0", b"a1"])
        assert await wait_until(lambda: st.max_offset("gap/t").wait() == 2)
        lost = asyncio.Event()
        st.link.on_lost(lambda _r: lost.set())
        st.link._sock.shutdown(2)                       # the connection breaks; events meanwhile are lost
        await asyncio.wait_for(lost.wait(), 5)
        await _append(writer, "gap/t", [b"b%d" % i for i in range(5)])
        assert await wait_until(lambda: st.link.connected, 10)
        await _append(writer, "gap/t", [b"c%d" % i for i in range(5)])    # pushed from offset 7 on
        assert await wait_until(lambda: st.max_offset("gap/t").wait() == 12, 10)
        got = [m.body for m in st.pull("gap/t", 0, max_count=100).wait().messages]
        assert got == [b"a0", b"a1"] + [b"b%d" % i for i in range(5)] + [b"c%d" % i for i in range(5)]
        st.close()
        for s in (st, writer):
            s.link.close()
    asyncio.run(go())


def test_a_pushed_record_that_fails_its_check_is_not_taken(tmp_path):
    """PUSH_RAW records are checked where they are decoded: they read back as the store wrote
    them, with the light queue's offsets; one damaged byte and the queue's entries are refused
    (the gateway pulls them instead, where the store reports and skips)."""
    from lmqtt.gateway.storage.remote_entries import decode_raw_entries
    from lmqtt.store import MessageStore, StoreConfig, protocol as W
    from lmqtt.store.fastpath import raw_runs

    cfg = StoreConfig(data_dir=str(tmp_path / "store"), segment_size=64 * 1024, max_message_size=16 * 1024,
                      flush_mode="async")
    with MessageStore(cfg) as ms:
        rs = ms.append_batch([Message("rw/t", b"body-%d" % i, 0, 0, b"\x01p", (), 1000 + i, ("rw/t",))
                              for i in range(3)])
        entries = [(r.phys_offset, r.size) for r in rs]
        runs = raw_runs(ms, entries)
        ident = ms.ident
    sizes = [e[1] for e in entries]
    body = bytearray(b"".join(W.encode_push_raw([("rw/t", 10, 7, runs, sizes)])))
    [(_name, _mx, first, spans, got_sizes)] = W.decode_push_raw(bytes(body))
    ok = decode_raw_entries(memoryview(bytes(body)), spans, got_sizes, first, ident)
    assert [(m.queue_offset, m.body, m.dispatch_queues, m.phys_offset) for m in ok] == \
        [(7 + i, b"body-%d" % i, ("rw/t",), entries[i][0]) for i in range(3)]
    # the same frame answering a raw gw_pull: its entries, or, damaged, refused by name
    from lmqtt.gateway.storage.node_client import pull_reply
    from lmqtt.gateway.storage.remote_entries import BadPushedRecord
    assert [m.body for m in pull_reply(W.OP_PUSH_RAW, bytes(body), ident).messages] == [m.body for m in ok]
    body[-2] ^= 0xFF
    assert decode_raw_entries(memoryview(bytes(body)), spans, got_sizes, first, ident) is None
    with pytest.raises(BadPushedRecord, match="failed its check"):
        pull_reply(W.OP_PUSH_RAW, bytes(body), ident)


def test_a_subscribes_reads_asked_together_come_in_together_and_a_hold_let_go_of_is_gone(lmqtt_store):
    """A SUBSCRIBE's reads (holds, the start offset of a queue not mirrored yet, retained
    messages) asked together in one loop turn: none answered while the store is stopped (nothing
    waited for, the calls returned at once), all in once it runs; the queue is mirrored by then;
    a hold let go of (a filter then refused) leaves the store holding only the one taken."""
    import os
    import signal


    async def go():
        st = _remote(lmqtt_store.address)
        st.metadata.retained.set("ra/1", b"kept", b"")
        await _append(st, "ra/1", [b"old-1", b"old-2"])
        os.kill(lmqtt_store.proc.pid, signal.SIGSTOP)
        try:
            asked = [st.metadata.filters.register("ra/+"), st.metadata.filters.register("unused/+"),
                     st.start_offset("ra/1"), st.metadata.retained.batches("ra/+")]
            assert not any(a.done() for a in asked)          # asked, not waited for
        finally:
            os.kill(lmqtt_store.proc.pid, signal.SIGCONT)
        await asyncio.wait_for(_awaited(Answer.all_in(asked)), 10)
        held, unused, start, kept = (a.result() for a in asked)
        assert held == 1 and unused == 1 and start == 2
        assert "ra/1" in st.queues                         # mirrored as the answers came in
        assert [(t, p) for batch in kept for t, p, _props in batch] == [("ra/1", b"kept")]
        st.metadata.filters.release("unused/+")
        assert st.metadata.filters.registered().wait() == {"ra/+": 1}       # "unused/+" went again
        st.link.close()
    asyncio.run(go())


def _calls(link: LoopConnection) -> list[dict]:
    """Every CALL `link` sends from now on, decoded (its "cmd" and fields)."""
    sent: list[dict] = []
    request = link.request

    def counting(op, body=b"", flags=0):
        if op == W.OP_CALL:
            sent.append(json.loads(body))
        return request(op, body, flags)
    link.request = counting
    return sent


def test_a_subscribe_of_a_queue_not_watched_yet_asks_its_watch_and_start_in_one_request(lmqtt_store):
    """The start offset of a queue the gateway does not watch yet comes with the watch
    (`gw_watch {start: true}`): one request; the subscription starting there misses nothing
    acknowledged after it and gets nothing acknowledged before it as new. A queue already watched
    asks its start alone."""
    async def go():
        st = _remote(lmqtt_store.address)
        await _append(st, "ws/1", [b"before-1", b"before-2"])
        sent = _calls(st.link)
        start = await _awaited(st.start_offset("ws/1"))
        assert [c["cmd"] for c in sent] == ["gw_watch"] and sent[0]["start"] is True
        assert start == 2 and "ws/1" in st.queues
        await _append(st, "ws/1", [b"after"])
        got, _waited = await _read_all(st, "ws/1", 3, 10)
        assert got[start:] == [b"after"]
        sent.clear()
        assert await _awaited(st.start_offset("ws/1")) == 3       # watched now: its start alone
        assert [c["cmd"] for c in sent] == ["gw_start_offsets"]
        st.link.close()
    asyncio.run(go())


def _will(body: bytes) -> WillRecord:
    return WillRecord("will/t", body, 1, False, b"", 0, 1)


def _gateway_holding_wills(address: str, client_ids: tuple[str, ...]) -> RemoteStore:
    """Another gateway ("old-gw") whose connections of `client_ids` left their wills in the store."""
    link = LoopConnection(address, loop=asyncio.get_running_loop())
    link.connect_blocking()
    old = RemoteStore(link, "old-gw", safety_poll_s=0.2)
    for cid in client_ids:
        old.metadata.wills.put(cid, _will(b"old")).wait()
    return old


def test_a_connects_void_and_new_will_are_one_request_and_a_turns_voids_go_together(lmqtt_store):
    """Wills another gateway left for clients that connect here again: a CONNECT that brings its
    own will puts it and that replaces the old one (no void sent); the other CONNECTs' voids of one
    loop turn leave in one `gw_void_wills`. Either way no old will is left to be published."""
    async def go():
        old = _gateway_holding_wills(lmqtt_store.address, ("vw-a", "vw-b", "vw-c"))
        assert {cid for cid, _w in old.metadata.wills.held().wait()} == {"vw-a", "vw-b", "vw-c"}
        st = _remote(lmqtt_store.address)
        wills = st.metadata.wills
        sent = _calls(st.link)
        voided = [wills.void("vw-a"), wills.void("vw-b"), wills.void("vw-c")]
        wills.put("vw-a", _will(b"new"))                   # vw-a's CONNECT came with a will
        await _awaited(Answer.all_in(voided))
        assert [c["cmd"] for c in sent] == ["gw_put_will", "gw_void_wills"]
        assert sent[1]["client_ids"] == ["vw-b", "vw-c"]
        assert old.metadata.wills.held().wait() == []
        assert [(cid, w.payload) for cid, w in wills.held().wait()] == [("vw-a", b"new")]
        st.link.close()
        old.link.close()
    asyncio.run(go())


def test_a_claim_voids_the_wills_other_gateways_hold_for_the_clients_claimed(lmqtt_store):
    """A client attached here is claimed (`gw_claim_sessions`): the will an earlier connection of
    it left on another gateway is void with that one request, so a fleet CONNECT sends no void of
    its own. The claimant's own will (its new connection's, which may be stored before the claim
    leaves) and the wills of clients not claimed stay."""
    async def go():
        old = _gateway_holding_wills(lmqtt_store.address, ("cw-a", "cw-b"))
        st = _remote(lmqtt_store.address)
        assert st.metadata.sessions.claims_void_wills
        st.metadata.wills.put("cw-c", _will(b"own")).wait()
        sent = _calls(st.link)
        st.metadata.sessions.claim([("cw-a", int(time.time() * 1000)), ("cw-c", int(time.time() * 1000))]).wait()
        assert [c["cmd"] for c in sent] == ["gw_claim_sessions"]
        assert [cid for cid, _w in old.metadata.wills.held().wait()] == ["cw-b"]
        assert [(cid, w.payload) for cid, w in st.metadata.wills.held().wait()] == [("cw-c", b"own")]
        st.link.close()
        old.link.close()
    asyncio.run(go())


def test_group_offsets_and_replay_plans_asked_together_are_then_in_hand(lmqtt_store):
    """A resumed session's shared group offsets and a subscription's replay plan, asked together:
    once in, they are values in hand while the store is frozen (an offset asked for then waits
    for it); the plan is the one a fresh `replay_plan` gives once it runs again."""
    import os
    import signal


    async def go():
        st = _remote(lmqtt_store.address)
        st.metadata.offsets.set("$share/crew", {"ro/q": 1})
        await _append(st, "ro/h", [b"h0", b"h1"])
        asked = [st.metadata.offsets.get("$share/crew", "ro/q"), st.metadata.offsets.get("$share/none", "ro/q"),
                 st.replay_plan("ro/h", 0), st.start_offset("ro/q")]
        await asyncio.wait_for(_awaited(Answer.all_in(asked)), 10)
        os.kill(lmqtt_store.proc.pid, signal.SIGSTOP)
        try:
            crew, none, planned, start = asked
            assert crew.result() == 1 and none.result() is None and start.result() == 0
            plan = planned.result()
            other = st.metadata.offsets.get("$share/other", "ro/q")
            assert not other.done()                          # not asked before: asked of the store
            assert st.max_offset("ro/h").done()              # the plan's filter is mirrored
        finally:
            os.kill(lmqtt_store.proc.pid, signal.SIGCONT)
        assert other.wait() is None
        again = st.replay_plan("ro/h", 0).wait()
        assert (plan.source, plan.live_offset, plan.done) == (again.source, again.live_offset, again.done)
        st.link.close()
    asyncio.run(go())


def test_a_gateway_restores_every_session_with_its_offsets_a_page_at_a_time(lmqtt_store, monkeypatch):
    """`SessionStore.list_for_restore` (a gateway's restore at start) pages through the store's session
    records, each with its committed offsets, and misses none at the page boundaries."""
    from lmqtt.gateway.storage.remote_metadata import RemoteSessions
    from lmqtt.lightqueue.records import SessionRecord, Subscription

    async def go():
        st = _remote(lmqtt_store.address)
        for i in range(7):
            cid = f"dev-{i:02d}"
            st.metadata.sessions.put(cid, SessionRecord(cid, 4, 60, 1, [Subscription(f"d/{i}")]))
            st.metadata.offsets.set(cid, {f"d/{i}": i})
        monkeypatch.setattr(RemoteSessions, "RESTORE_PAGE", 3)
        got = st.metadata.sessions.list_for_restore().wait()
        assert [(rec.client_id, offs) for rec, offs in got] == [(f"dev-{i:02d}", {f"d/{i}": i}) for i in range(7)]
        st.link.close()
    asyncio.run(go())


def test_a_fleet_gateway_restores_its_own_sessions_and_those_of_no_gateway(lmqtt_store, monkeypatch):
    """`SessionStore.list_for_restore(hosted_by=G)`: the records G served last and those of no gateway,
    with their offsets, across pages of which some hold none of G's (the store filters: a page
    may come back empty while more follow)."""
    from lmqtt.gateway.storage.remote_metadata import RemoteSessions
    from lmqtt.lightqueue.records import HOST, SessionRecord

    async def go():
        st = _remote(lmqtt_store.address)
        hosts = ["gw-a", "gw-b", "gw-b", "gw-b", "gw-b", None, "gw-a", "gw-b", "gw-a"]
        for i, h in enumerate(hosts):
            cid = f"hb-{i:02d}"
            st.metadata.sessions.put(cid, SessionRecord(cid, 5, 60, 1, [], {HOST: h} if h else {}))
            st.metadata.offsets.set(cid, {f"hb/{i}": i})
        monkeypatch.setattr(RemoteSessions, "RESTORE_PAGE", 2)
        got = st.metadata.sessions.list_for_restore("gw-a").wait()
        want = [i for i, h in enumerate(hosts) if h in (None, "gw-a")]
        assert [(rec.client_id, offs) for rec, offs in got] == [(f"hb-{i:02d}", {f"hb/{i}": i}) for i in want]
        assert all(rec.host in (None, "gw-a") for rec, _ in got)
        assert len(st.metadata.sessions.list_for_restore().wait()) == len(hosts)
        st.link.close()
    asyncio.run(go())


def test_a_gateways_filters_are_registered_many_per_round_trip(lmqtt_store, monkeypatch):
    """`FilterRegistry.register_all` (a gateway's start): every filter held once more, across chunks,
    and the store registers exactly those."""
    async def go():
        st = _remote(lmqtt_store.address)
        filters = st.metadata.filters
        monkeypatch.setattr(RemoteFilters, "REGISTER_CHUNK", 2)
        assert filters.register("m/0/+").wait() == 1
        got = filters.register_all(["m/0/+", "m/1/+", "m/2/#"]).wait()
        assert got == {"m/0/+": 2, "m/1/+": 1, "m/2/#": 1}
        assert filters.registered().wait() == {"m/0/+": 2, "m/1/+": 1, "m/2/#": 1}
        st.link.close()
    asyncio.run(go())


def test_a_call_the_store_does_not_answer_in_time_fails_and_drops_the_link(lmqtt_store):
    """`cmd_within`: the bound of a blocking call without blocking: a frozen store (SIGSTOP) fails
    the request after its timeout with the reason, the link is dropped and redialled."""
    import os
    import signal

    from lmqtt.store.client.aio import ConnectionLost

    async def go():
        st = _remote(lmqtt_store.address)
        os.kill(lmqtt_store.proc.pid, signal.SIGSTOP)
        try:
            fut = st.link.cmd_within("gw_filters", timeout=0.3, gateway="x")
            with pytest.raises(ConnectionLost, match="no reply within 0.3 s"):
                await asyncio.wait_for(fut, 5)
            assert not st.link.connected
        finally:
            os.kill(lmqtt_store.proc.pid, signal.SIGCONT)
        assert await wait_until(lambda: st.link.connected, 10)
        st.link.close()
    asyncio.run(go())


def test_a_gateway_loop_held_up_past_the_bound_still_takes_the_reply_that_came_in_time(lmqtt_store):
    """A burst of requests sent just before the gateway's loop was held up longer than the bound
    (a gateway starved of CPU in a connect storm): every one is answered over the same link. The
    store answers meanwhile, more than one socket read of replies, some only after the bound;
    the link reads what came before it judges, and takes a store that is still answering for
    alive (a dropped link would fail every request in flight)."""
    import uvloop

    async def go():
        st = _remote(lmqtt_store.address)
        link = st.link
        # replies of ~2 KB each: the answers to the burst below are more than one read of the socket
        st.metadata.filters.register_all([f"held/{i:04d}/with/a/long/enough/name/+" for i in range(50)]).wait()
        before = link.reconnects
        futs = [link.cmd_within("gw_filters", timeout=0.2, gateway="test-gw") for i in range(5000)]
        await asyncio.sleep(0)           # the requests go out at the end of this iteration
        time.sleep(0.6)                  # the loop is held up: the store answers meanwhile
        done = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 10)
        assert [e for e in done if isinstance(e, BaseException)] == []
        assert link.connected and link.reconnects == before
        st.link.close()
    uvloop.run(go())

