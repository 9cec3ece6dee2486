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
import contextlib
import itertools
import os
import signal

import pytest

from lmqtt.gateway.storage.facades import Answer, Storage
from lmqtt.lightqueue.records import HOST, SessionRecord, Subscription, WillRecord
from tests.support import LmqttStore, running

pytestmark = pytest.mark.timeout(60)

_n = itertools.count()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    d = tmp_path_factory.mktemp("contract-node")
    yield from running(LmqttStore(str(d / "data"), log_path=str(d / "lmqtt-store.log")))


class _Side:
    """One implementation's bundle, and a second gateway's view of the same store (`other`)."""

    def __init__(self, storage: Storage, other: Storage, gateway_id: str, close) -> None:
        self.storage, self.other, self.gateway_id, self.close = storage, other, gateway_id, close


@pytest.fixture(scope="module")
def node_b(tmp_path_factory):
    d = tmp_path_factory.mktemp("contract-node-b")
    yield from running(LmqttStore(str(d / "data"), log_path=str(d / "lmqtt-store.log")))


def _grouped_sides(request):
    """Two stores as two groups (docs/groups.md): each facade routed by first-level topic."""
    from lmqtt.gateway.storage.grouped_metadata import grouped_storage
    from lmqtt.gateway.storage.remote_metadata import RemoteMetadata
    from lmqtt.gateway.storage.store_link import LoopConnection
    from lmqtt.gateway.storage.topic_owners import TopicOwners

    a, b = request.getfixturevalue("node"), request.getfixturevalue("node_b")
    names = [a.address, b.address]
    loop = asyncio.new_event_loop()
    links, bundles = [], []
    gid = f"gw-{next(_n)}"
    owners = None           # one view of the owners for both: two gateways that know the topics
    for g in (gid, gid + "-other"):
        per = []
        for srv in (a, b):
            link = LoopConnection(srv.address, loop=loop)
            link.connect_blocking()
            links.append(link)
            per.append(RemoteMetadata(link, g).storage(None))
        owners = owners or TopicOwners(links[-2], names, names, ";".join(names))
        bundles.append(grouped_storage(owners, per, None))
    return bundles, links, loop, gid


@pytest.fixture(params=["inprocess", "remote", "grouped"])
def side(request, tmp_path):
    if request.param == "grouped":
        bundles, links, loop, gid = _grouped_sides(request)
        yield _Side(bundles[0], bundles[1], gid, None)
        for link in links:
            link.close()
        loop.close()
        return
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
    from lmqtt.gateway.storage.store_link import LoopConnection

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
    offsets = {"t/1": 3, "u/1": 4, "v/1": 5, "w/+": 6, "#": 7}     # over several groups: in several
    o.set(c, offsets)
    got, offs = s.load(c).wait()
    assert got == rec and offs == offsets
    assert c in [r.client_id for r in s.all().wait()]
    assert s.delete(c).wait() is True
    assert s.get(c).wait() is None
    assert s.load(c).wait() == (None, {})            # every offset of it gone, wherever it was kept
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
class _Queues:
    """One implementation's bundle builder (for its `QueueStore`, called on the running loop: a
    remote store's mirrors are fed by it) and, for the remote one, `frozen()`: the store node
    stopped (SIGSTOP) while the block runs, so that any request waited for would hang."""

    def __init__(self, build, pid: int | None = None) -> None:
        self.build, self.pid = build, pid

    def __call__(self):
        return self.build()

    @property
    def remote(self) -> bool:
        return self.pid is not None

    @contextlib.contextmanager
    def frozen(self):
        if self.pid is None:
            yield
            return
        os.kill(self.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.pid, signal.SIGCONT)


@pytest.fixture(params=["inprocess", "remote"])
def queue_side(request, tmp_path):
    made: list = []
    if request.param == "inprocess":
        from lmqtt.lightqueue import LightQueueStore
        from lmqtt.store import MessageStore, StoreConfig
        from lmqtt.store.node import inprocess

        store = MessageStore(StoreConfig(data_dir=str(tmp_path / "store"), segment_size=16 << 20))
        lq = LightQueueStore(store, str(tmp_path / "lq"))
        store.start()
        yield _Queues(lambda: inprocess.storage(store, lq))
        lq.close()
        store.shutdown()
        return
    from lmqtt.gateway.storage.remote_store import RemoteStore
    from lmqtt.gateway.storage.store_link import LoopConnection

    srv = request.getfixturevalue("node")

    def build():
        link = LoopConnection(srv.address, loop=asyncio.get_running_loop())
        link.connect_blocking()
        st = RemoteStore(link, _name("gw-q"), safety_poll_s=0.2)
        st.start()
        made.append(st)
        return st.metadata
    yield _Queues(build, srv.proc.pid)
    for st in made:
        st.close()
        st.link.close()


async def _until(cond, timeout: float = 10.0) -> bool:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return True
        await asyncio.sleep(0.01)
    return cond()


async def _append(st: Storage, topic: str, bodies: list[bytes], dispatch: bool = True) -> None:
    import time

    from lmqtt.store import Message

    q = st.queues
    res = q.append_batch([Message(topic, b, 0, 0, b"", (), int(time.time() * 1000), q.queues_for_topic(topic))
                          for b in bodies], dispatch=dispatch)
    durable = res[-1].durable
    await (asyncio.wrap_future(durable) if not isinstance(durable, asyncio.Future) else durable)


def test_an_append_is_pulled_from_its_queue_and_new_subscriptions_start_after_it(queue_side):
    """What the publish pipeline and the delivery engine rely on: an append's `.durable` future
    is resolved, the queue's listeners are told, `max_offset` and `pull` then have the message,
    and `start_offset` is after it (a new subscription does not get it as new)."""
    async def go():
        st = queue_side()
        q = st.queues
        topic = _name("qs") + "/t"
        heard: list = []
        q.on_new_data(lambda names: heard.extend(names))
        assert await q.start_offset(topic) == 0 and q.unavailable() is None
        q.enable_delayed(asyncio.get_running_loop())             # both answer it (remote: nothing to do)
        await _append(st, topic, [b"one"])
        assert await _until(lambda: q.max_offset(topic).wait() == 1 and topic in heard)
        assert [(m.topic, bytes(m.body)) for m in (await q.pull(topic, 0)).messages] == [(topic, b"one")]
        assert await q.start_offset(topic) == 1
        state = q.disk_state()
        assert state is None or state["disk_full"] is False
    asyncio.run(go())


def test_an_append_left_for_dispatch_appended_is_pulled_after_it(queue_side):
    """The publish path's order: append with dispatch=False, ack, then `dispatch_appended()`. On
    both sides the message is then pulled from its queue (remote: the store node dispatched it
    anyway; in-process: the call did)."""
    async def go():
        st = queue_side()
        q = st.queues
        topic = _name("qd") + "/t"
        await _append(st, topic, [b"late"], dispatch=False)
        q.dispatch_appended()
        assert await _until(lambda: q.max_offset(topic).wait() == 1)
        assert [bytes(m.body) for m in (await q.pull(topic, 0)).messages] == [b"late"]
    asyncio.run(go())


def test_every_queue_read_is_an_answer_and_none_waits_for_the_store(queue_side):
    """Every `QueueStore` read returns an `Answer` without waiting for the store: in-process done
    at once; remote, for a queue it does not mirror (and a start offset, a message, a replay
    plan), asked for while the store node is stopped, the calls return at once with answers not
    in yet (the gateway's loop is never blocked on a round trip), which complete when it runs
    again; both give the same values."""
    from lmqtt.gateway.storage.facades import ReplayPlan

    async def go():
        writer, st = queue_side(), queue_side()
        q = st.queues
        topic = _name("aq") + "/t"
        await _append(writer, topic, [b"m0", b"m1", b"m2"])
        assert await writer.queues.start_offset(topic) == 3       # (the store dispatched them)
        with queue_side.frozen():
            reads = {"max": q.max_offset(topic), "end": q.end_offset(topic), "start": q.start_offset(topic),
                     "pull": q.pull(topic, 1, 32), "at": q.message_at(topic, 2), "gone": q.message_at(topic, 99),
                     "plan": q.replay_plan(topic, 0)}
            assert all(isinstance(a, Answer) for a in reads.values())
            assert all(a.done() for a in reads.values()) is not queue_side.remote
        await asyncio.wait_for(_all(Answer.all_in(list(reads.values()))), 20)
        assert (reads["max"].result(), reads["end"].result(), reads["start"].result()) == (3, 3, 3)
        assert [bytes(m.body) for m in reads["pull"].result().messages] == [b"m1", b"m2"]
        assert bytes(reads["at"].result().body) == b"m2" and reads["at"].result().queue_offset == 2
        assert reads["gone"].result() is None
        plan = reads["plan"].result()
        assert isinstance(plan, ReplayPlan) and plan.source in ("queue", "log")
        # the queue is followed now: its end is answered at once (remote: from the mirror)
        again = q.max_offset(topic), q.pull(topic, 3, 32)
        assert all(a.done() for a in again) and again[0].result() == 3
        assert again[1].result().messages == [] and again[1].result().next_offset == 3
    asyncio.run(go())


async def _all(answer):
    return await answer


def test_a_pull_behind_what_is_held_completes_when_the_entries_are_in(queue_side):
    """A reader far behind (a resumed session's backlog: remote, behind the mirror, which starts
    where the queue ended when it was first read) gets an answer that completes with the entries
    from its offset, in order, and nothing is skipped."""
    async def go():
        writer, st = queue_side(), queue_side()
        q = st.queues
        topic = _name("behind") + "/t"
        await q.max_offset(topic)                      # followed from here (remote: mirrored)
        bodies = [b"%04d" % i for i in range(200)]
        await _append(writer, topic, bodies)
        assert await _until(lambda: q.max_offset(topic).wait() == 200)
        got, off = [], 0
        while off < 200:
            res = await asyncio.wait_for(_all(q.pull(topic, off, 64)), 20)
            assert [m.queue_offset for m in res.messages] == list(range(off, off + len(res.messages)))
            assert res.messages, off
            got += [bytes(m.body) for m in res.messages]
            off = res.next_offset
        assert got == bodies
    asyncio.run(go())


def test_a_subscribes_answers_asked_together_are_in_together(queue_side):
    """What the SUBSCRIBE path does now (subscriptions/subscription_registry.py `prepare`): it asks each
    facade for what it will read (a filter hold, the start offset, the replay plan, the retained
    messages), then waits for them together (`Answer.all_in`), never asking which implementation
    it holds; remote, they were all asked while the store was stopped (none answered, nothing
    waited for) and all come in once it runs; the values agree."""
    async def go():
        st = queue_side()
        base = _name("sub")
        q, flt = base + "/t", base + "/+"
        st.retained.set(q, b"kept", b"")
        await _append(st, q, [b"old"])
        with queue_side.frozen():
            held = st.filters.register(flt)
            start = st.queues.start_offset(q)
            plan = st.queues.replay_plan(flt, 0)
            kept = st.retained.batches(flt)
            ready = Answer.all_in([held, start, plan, kept])
            assert ready.done() is not queue_side.remote
        await asyncio.wait_for(_all(ready), 20)
        assert held.result() == 1 and start.result() == 1
        assert [(t, p) for batch in kept.result() for t, p, _props in batch] == [(q, b"kept")]
        assert plan.result().live_offset >= 0
        st.filters.release(flt).wait()
    asyncio.run(go())


class _Delivery:
    """The DeliveryEngine's face the subscription registry uses: readers and groups only noted;
    `at_hand` is what the registry hands it while a resumed session is decided."""
    histories: dict = {}
    at_hand = None

    def add_reader(self, s, q) -> None: ...
    def remove_reader(self, s, q) -> None: ...
    def add_group(self, g) -> None: ...
    def remove_group(self, g) -> None: ...
    def kick_queue(self, q) -> None: ...


def _registry(st: Storage, delivery=None):
    from lmqtt.gateway.clients.session_persistence import SessionPersistence
    from lmqtt.gateway.subscriptions.subscription_registry import SubscriptionRegistry

    persist = SessionPersistence(st, session_live=lambda s: True, group_live=lambda g: True)
    return SubscriptionRegistry(st, delivery or _Delivery(), persist)


def test_a_subscribe_is_decided_from_answers_asked_together_without_the_store(queue_side):
    """What the SUBSCRIBE path relies on (subscriptions/subscription_registry.py `prepare`, `deciding`):
    the answers it asked for together are in once `ready` is; then it is decided with the store
    stopped (remote: any request waited for would hang), the subscriptions start after what was
    stored, the retained messages are at hand; afterwards the store holds exactly the filter
    holds taken, not the one asked for a filter that was then refused."""
    from lmqtt.gateway.session import ClientSubscription, MqttSession
    from lmqtt.gateway.mqtt import packets as P

    async def go():
        st = queue_side()
        reg = _registry(st)
        base = _name("pr")
        q, flt, refused = base + "/t", base + "/+", f"{_name('refused')}/+"
        st.retained.set(q, b"kept", b"")
        await _append(st, q, [b"old"])
        s = MqttSession(_name("c"))
        p = reg.prepare(s, [P.SubscriptionRequest(f, qos=1) for f in (flt, q, refused)], None, st.retained)
        await asyncio.wait_for(_all(p.ready), 20)
        assert p.failure() is None
        with queue_side.frozen():
            with reg.deciding(p):
                for f in (flt, q):                          # (`refused`: the ACL said no, say)
                    reg.add(s, ClientSubscription(f, f, 1, None))
                kept = p.take_retained(flt)
            assert s.cursors[q].next_offset == 1 and s.cursors[flt].next_offset == 0
            assert [(t, bytes(pl)) for batch in kept for t, pl, _props in batch] == [(q, b"kept")]
        held = st.filters.registered().wait()
        assert held.get(flt) == 1 and refused not in held
        reg.remove_all(s)
        assert flt not in st.filters.registered().wait()
    asyncio.run(go())


def test_a_resumed_session_is_restored_from_answers_asked_together_without_the_store(queue_side):
    """What a fleet gateway's CONNECT of a session served elsewhere relies on (`prepare_resume`):
    its filters new here held, its queues' ends, a new shared group's committed offset and the
    message it had in flight come in together; restored with the store stopped, from them."""
    from lmqtt.gateway.session import ClientSubscription, MqttSession
    from lmqtt.lightqueue.records import Subscription

    async def go():
        st = queue_side()
        delivery = _Delivery()
        reg = _registry(st, delivery)
        base = _name("rs")
        q, flt = base + "/t", base + "/+"
        await _append(st, q, [b"m0", b"m1"])
        assert await st.queues.start_offset(q) == 2
        st.offsets.set("$share/crew", {q: 1})
        subs = [Subscription(flt, 1), Subscription(q, 1, share_group="crew")]
        p = reg.prepare_resume(subs, [(q, 1)])
        await asyncio.wait_for(_all(p.ready), 20)
        assert p.failure() is None
        s = MqttSession(_name("c"))
        with queue_side.frozen():
            with reg.deciding(p):
                reg.restore(s, ClientSubscription(flt, flt, 1, None), {})
                reg.restore(s, ClientSubscription(f"$share/crew/{q}", q, 1, "crew"), {})
                reg.hold_restored(s)
                at = delivery.at_hand[(q, 1)]
                assert at.done() and bytes(at.result().body) == b"m1"
            assert reg.groups[("crew", q)].cursor.next_offset == 1
            assert s.cursors[flt].next_offset == 0
        assert st.filters.registered().wait().get(flt) == 1
        reg.remove_all(s)
        assert flt not in st.filters.registered().wait()     # (nothing left in flight at the end)
    asyncio.run(go())
