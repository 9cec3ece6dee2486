"""One contract for the gateway's storage facades (gateway/storage/facades.py), run against both
implementations: in-process (store/node/inprocess.py over a real MessageStore + LightQueueStore in
a tmp dir, `lmqtt serve`) and remote (gateway/storage/remote_metadata.py over a real `lmqtt store`
subprocess, one per module, `lmqtt gateway`). Each test states what a gateway relies on; the two
implementations must agree on every answer.

The remote facades are driven without a running event loop: every answer is `wait()`ed for,
which drives the link right here (as a gateway's start-up does), and requests not waited for are
still answered in order before the next one waited for (a read after a write sees it)."""
from __future__ import annotations

import asyncio
import itertools

import pytest

from lmqtt.gateway.storage.facades import Answer, Lease, Storage
from lmqtt.lightqueue.records import HOST, SessionRecord, Subscription, WillRecord
from tests.support import LmqttStore

pytestmark = pytest.mark.timeout(60)

_n = itertools.count()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    d = tmp_path_factory.mktemp("contract-node")
    srv = LmqttStore(str(d / "data"), log_path=str(d / "lmqtt-store.log")).start()
    try:
        yield srv
    finally:
        srv.stop()


class _Side:
    """One implementation's bundle, and a second gateway's view of the same store (`other`)."""

    def __init__(self, storage: Storage, other: Storage, gateway_id: str, close) -> None:
        self.storage, self.other, self.gateway_id, self.close = storage, other, gateway_id, close


@pytest.fixture(params=["inprocess", "remote"])
def side(request, tmp_path):
    if request.param == "inprocess":
        from lmqtt.lightqueue import LightQueueStore
        from lmqtt.store import MessageStore, StoreConfig
        from lmqtt.store.node import inprocess

        store = MessageStore(StoreConfig(data_dir=str(tmp_path / "store"), segment_size=16 << 20))
        lq = LightQueueStore(store, str(tmp_path / "lq"))
        store.start()
        one = inprocess.storage(store, lq)
        yield _Side(one, one, "", None)
        lq.close()
        store.shutdown()
        return
    from lmqtt.gateway.storage.remote_metadata import RemoteMetadata
    from lmqtt.store.client.aio import LoopConnection

    srv = request.getfixturevalue("node")
    loop = asyncio.new_event_loop()
    links = []
    bundles = []
    gid = f"gw-{next(_n)}"
    for g in (gid, gid + "-other"):
        link = LoopConnection(srv.address, loop=loop)
        link.connect_blocking()
        links.append(link)
        md = RemoteMetadata(link, g)
        bundles.append(md.storage(None))          # the queues: their own tests below
    yield _Side(bundles[0], bundles[1], gid, None)
    for link in links:
        link.close()
    loop.close()


def _name(prefix: str) -> str:
    return f"{prefix}-{next(_n)}"


# ---------------------------------------------------------------- answers
def test_every_answer_is_a_future_that_can_be_waited_for(side):
    """The facades' methods return `Answer`s: done (in-process) or done once waited for (remote),
    with a done-callback run once it is in."""
    a = side.storage.offsets.get(_name("c"), "q")
    assert isinstance(a, Answer)
    assert a.wait() is None
    seen = []
    a.add_done_callback(lambda x: seen.append(x.result()))
    assert seen == [None]


# ---------------------------------------------------------------- offsets
def test_offsets_round_trip_and_are_deleted_per_queue_or_all(side):
    o = side.storage.offsets
    c = _name("client")
    assert o.get(c, "a/1").wait() is None and o.get_all(c).wait() == {}
    o.set(c, {"a/1": 5, "a/2": 7})                 # not waited for: the read after it sees it
    assert o.get(c, "a/1").wait() == 5
    o.set(c, {"a/1": 6})
    assert o.get_all(c).wait() == {"a/1": 6, "a/2": 7}
    o.delete(c, ["a/1"])
    assert o.get_all(c).wait() == {"a/2": 7}
    o.delete(c)
    assert o.get_all(c).wait() == {}


# ---------------------------------------------------------------- sessions
def test_session_records_round_trip_load_with_offsets_and_delete(side):
    s, o = side.storage.sessions, side.storage.offsets
    c = _name("dev")
    rec = SessionRecord(c, 5, 120, None, [Subscription("t/+", 1), Subscription("x", 0, share_group="g")], {"k": 1})
    s.put(c, rec).wait()
    assert s.get(c).wait() == rec
    o.set(c, {"t/1": 3})
    got, offs = s.load(c).wait()
    assert got == rec and offs == {"t/1": 3}
    assert c in [r.client_id for r in s.all().wait()]
    assert s.delete(c).wait() is True
    assert s.get(c).wait() is None
    assert s.load(_name("none")).wait() == (None, {})


def test_sessions_listed_for_restore_carry_offsets_and_a_fleet_gateway_gets_its_own(side):
    s, o = side.storage.sessions, side.storage.offsets
    mine, theirs, nobodys = _name("mine"), _name("theirs"), _name("nobody")
    for cid, host in ((mine, "gw-a"), (theirs, "gw-b"), (nobodys, None)):
        s.put(cid, SessionRecord(cid, 4, 60, 1, [Subscription(f"r/{cid}")], {HOST: host} if host else {}))
        o.set(cid, {f"r/{cid}": 9})
    got = {rec.client_id: offs for rec, offs in s.list_for_restore().wait()}
    assert {mine, theirs, nobodys} <= set(got) and got[mine] == {f"r/{mine}": 9}
    got_a = {rec.client_id for rec, _offs in s.list_for_restore("gw-a").wait()}
    assert mine in got_a and nobodys in got_a and theirs not in got_a


def test_session_claims_and_flush_are_answered(side):
    s = side.storage.sessions
    assert s.claim([(_name("c"), 1000)]).wait() is None
    assert s.flush().wait() is None
    # events are registered on both implementations (in-process: never fire)
    s.on_sessions_moved(lambda ids: None)
    s.on_sessions_swept(lambda ids: None)
    s.on_session_claims(lambda gid, claims: None)


# ---------------------------------------------------------------- retained
def test_retained_set_match_and_clear_if_still_the_same(side):
    r = side.storage.retained
    base = _name("ret")
    r.set(f"{base}/a", b"one", b"p1")
    r.set(f"{base}/b", b"two", b"p2")
    assert r.matching(f"{base}/#").wait() == [(f"{base}/a", b"one", b"p1"), (f"{base}/b", b"two", b"p2")]
    assert [m for batch in r.batches(f"{base}/+").wait() for m in batch] == r.matching(f"{base}/+").wait()
    assert r.clear_if(f"{base}/a", b"other").wait() is False       # replaced since: kept
    assert r.clear_if(f"{base}/a", b"p1").wait() is True
    r.set(f"{base}/b", b"", b"")                                   # an empty payload clears
    assert r.matching(f"{base}/#").wait() == []


# ---------------------------------------------------------------- wills
def _will(topic: str) -> WillRecord:
    return WillRecord(topic, b"gone", 1, False, b"", 0, 1)


def test_wills_put_pop_void_and_take(side):
    w = side.storage.wills
    a, b, c = _name("wa"), _name("wb"), _name("wc")
    for cid in (a, b, c):
        w.put(cid, _will(f"will/{cid}"))
    held = dict(w.held().wait())
    assert {a, b, c} <= set(held) and held[a].topic == f"will/{a}"
    w.pop(a)                                  # published or discarded by this gateway
    w.void(b)                                 # a new connection of b: never published
    assert not {a, b} & set(dict(w.held().wait()))
    taken = dict(w.take().wait())             # the orphans of a crash: removed as they are returned
    assert c in taken and taken[c].payload == b"gone"
    assert c not in dict(w.held().wait())
    w.on_wills_published(lambda ids: None)


def test_a_will_another_gateway_wrote_since_survives_this_gateways_pop_but_not_a_void(side):
    """pop removes only this gateway's will; void removes the client's will whoever holds it (a
    single in-process gateway holds every will: there the two agree)."""
    cid = _name("moved")
    side.storage.wills.put(cid, _will("w/1"))
    side.other.wills.put(cid, _will("w/2"))       # the client reconnected through another gateway
    side.storage.wills.pop(cid)
    left = dict(side.other.wills.held().wait())
    if side.other is not side.storage:
        assert left[cid].topic == "w/2"
    side.other.wills.void(cid)
    assert cid not in dict(side.other.wills.held().wait())


# ---------------------------------------------------------------- group leases
def test_a_group_lease_is_granted_renewed_and_handed_back_with_the_offset(side):
    leases, offsets = side.storage.leases, side.storage.offsets
    group, queue = _name("grp"), _name("lq")
    consumer = f"$share/{group}"
    offsets.set(consumer, {queue: 4})
    got = leases.claim(group, queue, consumer, 3000).wait()
    assert got == Lease(side.gateway_id, 4)
    assert leases.claim(group, queue, consumer, 3000).wait().owner == side.gateway_id     # renewed
    if side.other is not side.storage:
        assert side.other.leases.claim(group, queue, consumer, 3000).wait().owner == side.gateway_id   # held
    leases.release(group, queue, 9).wait()
    assert leases.claim(group, queue, consumer, 3000).wait() == Lease(side.gateway_id, 9)


# ---------------------------------------------------------------- filter registrations
def test_filter_holds_are_counted_listed_released_and_registered_many_at_once(side):
    """What the subscription registry relies on: a hold per register, the count after each
    change, `registered` naming this gateway's holds, `release` not waited for yet seen by the
    next request, `register_all` one hold more of each."""
    f = side.storage.filters
    a, b, c = (f"{_name('flt')}/+" for _ in range(3))
    assert f.register(a).wait() == 1
    assert f.register(a).wait() == 2
    assert f.registered().wait().get(a) == 2
    assert f.unregister(a).wait() == 1
    f.release(a)                                   # not waited for: the read after it sees it
    assert a not in f.registered().wait()
    assert f.register(b).wait() == 1
    assert f.register_all([b, c]).wait() == {b: 2, c: 1}
    held = f.registered().wait()
    assert (held.get(b), held.get(c)) == (2, 1)
    if side.other is not side.storage:             # a fleet: each gateway sees its own holds
        assert b not in side.other.filters.registered().wait()
        assert side.other.filters.register(b).wait() == 1
        assert f.registered().wait().get(b) == 2
    for x in (b, b, c):
        f.release(x)
    assert not {b, c} & set(f.registered().wait())


def test_an_invalid_filter_is_a_failed_answer_not_an_exception_of_the_call(side):
    bad = side.storage.filters.register("no/#/more")
    with pytest.raises(Exception):
        bad.wait()
    assert side.storage.filters.register_all([]).wait() == {}


# ---------------------------------------------------------------- light queues
@pytest.fixture(params=["inprocess", "remote"])
def queue_side(request, tmp_path):
    """A builder of one implementation's whole bundle (for its `QueueStore`), called on the
    running loop (a remote store's mirrors are fed by it)."""
    made: list = []
    if request.param == "inprocess":
        from lmqtt.lightqueue import LightQueueStore
        from lmqtt.store import MessageStore, StoreConfig
        from lmqtt.store.node import inprocess

        store = MessageStore(StoreConfig(data_dir=str(tmp_path / "store"), segment_size=16 << 20))
        lq = LightQueueStore(store, str(tmp_path / "lq"))
        store.start()
        yield lambda: inprocess.storage(store, lq)
        lq.close()
        store.shutdown()
        return
    from lmqtt.gateway.storage.remote_store import RemoteStore
    from lmqtt.store.client.aio import LoopConnection

    srv = request.getfixturevalue("node")

    def build():
        link = LoopConnection(srv.address, loop=asyncio.get_running_loop())
        link.connect_blocking()
        st = RemoteStore(link, _name("gw-q"), safety_poll_s=0.2)
        st.start()
        made.append(st)
        return st.metadata
    yield build
    for st in made:
        st.close()
        st.link.close()


async def _until(cond, timeout: float = 10.0) -> bool:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return True
        await asyncio.sleep(0.01)
    return cond()


def test_an_append_is_pulled_from_its_queue_and_new_subscriptions_start_after_it(queue_side):
    """What the publish pipeline and the delivery engine rely on: an append's `.durable` future
    is resolved, the queue's listeners are told, `max_offset` and `pull` then have the message,
    and `start_offset` is after it (a new subscription does not get it as new)."""
    import time

    from lmqtt.store import Message

    async def go():
        q = queue_side().queues
        topic = _name("qs") + "/t"
        heard: list = []
        q.on_new_data(lambda names: heard.extend(names))
        assert q.start_offset(topic) == 0 and q.unavailable() is None
        q.enable_delayed(asyncio.get_running_loop())             # both answer it (remote: nothing to do)
        res = q.append_batch([Message(topic, b"one", 0, 0, b"", (), int(time.time() * 1000),
                                      q.queues_for_topic(topic))])
        durable = res[-1].durable
        await (asyncio.wrap_future(durable) if not isinstance(durable, asyncio.Future) else durable)
        assert await _until(lambda: q.max_offset(topic) == 1 and topic in heard)
        assert [(m.topic, bytes(m.body)) for m in q.pull(topic, 0).messages] == [(topic, b"one")]
        assert q.start_offset(topic) == 1
        state = q.disk_state()
        assert state is None or state["disk_full"] is False
    asyncio.run(go())


def test_a_packets_reads_are_answered_inside_the_context_read_ahead_answers(queue_side):
    """What the SUBSCRIBE path relies on: it asks `read_ahead` for what it will read, waits for
    the answer, and inside the context it answers makes its requests as usual, which are then
    answered at once (remote: from the read-ahead; in-process: locally); after it, the store
    holds exactly the registrations taken, and nothing asked for but not taken."""
    import time

    from lmqtt.gateway.storage.facades import StoreReads
    from lmqtt.store import Message

    async def go():
        st = queue_side()
        base = _name("ra")
        q, flt, unused = base + "/t", base + "/+", f"{_name('unused')}/+"
        st.retained.set(q, b"kept", b"")
        res = st.queues.append_batch([Message(q, b"old", 0, 0, b"", (), int(time.time() * 1000),
                                              st.queues.queues_for_topic(q))])
        durable = res[-1].durable
        await (asyncio.wrap_future(durable) if not isinstance(durable, asyncio.Future) else durable)
        answer = st.queues.read_ahead(StoreReads([flt, unused], [q], [q], [flt]))
        ctx = await answer
        with ctx:
            held = st.filters.register(flt)
            kept = st.retained.matching(flt)
            assert held.done() and kept.done()             # no round trip inside the context
            assert held.result() == 1
            assert [(t, p) for t, p, _props in kept.result()] == [(q, b"kept")]
            assert st.queues.start_offset(q) == 1
        held_now = st.filters.registered().wait()
        assert held_now.get(flt) == 1 and unused not in held_now
        st.filters.release(flt).wait()               # nothing left in flight when the loop ends
    asyncio.run(go())
