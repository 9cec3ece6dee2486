"""`HistoryRuns` (gateway/delivery/history.py): the subscriptions from the past still sending their history,
driven by the delivery engine. Its rules, with stand-in runs: a marked session is pumped; one that
can send more stays marked; a finished history goes live when the session is online and still
subscribed; a failed read is retried through the engine's kick a second later. And the engine's
`start_history`: the `HistoryRun` it starts decodes props through the engine's cache and reads
with its ACL."""
from __future__ import annotations

from types import SimpleNamespace

from lmqtt.gateway.app.config import GatewayConfig
from lmqtt.gateway.delivery.engine import DeliveryEngine
from lmqtt.gateway.delivery.history import HistoryRun, HistoryRuns
from lmqtt.gateway.session import ClientSubscription, Cursor, MqttSession


class Run:
    """A stand-in HistoryRun: `steps` pumps, each answering `more`, then finished."""

    def __init__(self, session, queue, steps=1, fail=False):
        self.session, self.queue, self.steps, self.fail = session, queue, steps, fail
        self.plan = SimpleNamespace(on_ready=None)
        self.sent = 0

    def pump(self, budget_bytes):
        if self.fail:
            raise OSError("store away")
        self.steps -= 1
        self.sent += 1
        return self.steps > 0

    def finished(self):
        return self.steps <= 0


class Loop:
    def __init__(self):
        self.later = []

    def call_later(self, delay, fn, *args):
        self.later.append((delay, fn, args))

    def call_soon(self, fn, *args):
        self.later.append((0, fn, args))


def _runs():
    kicked, live = [], []
    loop = Loop()
    h = HistoryRuns(loop, SimpleNamespace(write_high_water=1 << 20), kick=kicked.append,
                    go_live=lambda s, q: live.append((s.client_id, q)))
    return h, loop, kicked, live


def _online(cid, *queues):
    s = MqttSession(cid)
    s.conn = object()
    for q in queues:
        s.cursors[q] = Cursor(0)
    return s


def test_a_history_is_pumped_until_done_then_goes_live():
    h, _, kicked, live = _runs()
    s = _online("a", "t/#")
    run = Run(s, "t/#", steps=2)
    h.start(run)
    assert h.has(s, "t/#") and not h.has(s, "u") and s in h.marked
    run.plan.on_ready()                       # a chunk of a remote history came in: the engine's kick
    assert kicked == [s]
    h.run()
    assert s in h.marked and live == []       # could send more: examined again at the next run
    h.run()
    assert live == [("a", "t/#")] and h.by_session == {} and not h.marked
    assert not h.mark(s)                      # no history under way any more


def test_a_history_that_waits_is_examined_when_marked():
    h, _, _, live = _runs()
    s = _online("a", "t/#")
    h.start(Run(s, "t/#", steps=3))
    h.marked.clear()
    h.run()
    assert live == [] and h.has(s, "t/#")     # not marked: not pumped
    assert h.mark(s) and s in h.marked


def test_no_live_reading_for_a_session_gone_offline_or_unsubscribed():
    h, _, _, live = _runs()
    off = _online("off", "t/#")
    off.conn = None
    gone = _online("gone")
    h.start(Run(off, "t/#"))
    h.start(Run(gone, "t/#"))
    h.run()
    assert live == [] and h.by_session == {}


def test_drop_one_subscription_or_the_whole_session():
    h, _, _, _ = _runs()
    s = _online("a", "x", "y")
    h.start(Run(s, "x"))
    h.start(Run(s, "y"))
    h.drop(s, "x")
    assert not h.has(s, "x") and h.has(s, "y")
    h.drop(s)
    assert h.by_session == {} and s not in h.marked


def test_a_failed_read_is_retried_a_second_later():
    h, loop, kicked, live = _runs()
    s = _online("a", "t/#")
    run = Run(s, "t/#", fail=True)
    h.start(run)
    h.run()
    assert loop.later == [(1.0, kicked.append, (s,))] and h.has(s, "t/#") and live == []


def test_the_engine_starts_a_history_with_its_props_cache_and_acl():
    acl = object()
    d = DeliveryEngine(None, Loop(), None, GatewayConfig(), session_offsets_moved=lambda s: None,
                       group_offsets_moved=lambda g: None, flush_writes=lambda: None, acl=acl)
    s = _online("a", "t/#")
    d.add_reader(s, "t/#")
    sub = ClientSubscription("t/#", "t/#", 1)
    plan = SimpleNamespace(on_ready=None)
    d.start_history(s, sub, plan)
    [run] = d.histories[s]
    assert isinstance(run, HistoryRun) and run.sub is sub and run.plan is plan and run.acl is acl
    assert run.meta_of == d._meta_of              # props decoded once per distinct value
    assert s not in d.direct.get("t/#", ())       # not a live reader until the history is sent
    assert d.has_history(s, "t/#")


def test_records_of_two_store_groups_at_the_same_log_position_stay_two_messages():
    """A delivery run shares one message object per CommitLog position (a record read through
    several queues); over several store groups two records can sit at the same position, each in
    its own group's log - with different topics, since a first level lives in one group."""
    from lmqtt.gateway.storage.record_props import encode as encode_props
    from lmqtt.gateway.storage.remote_entries import RemoteMessage
    d = DeliveryEngine(None, Loop(), None, GatewayConfig(), session_offsets_moved=lambda s: None,
                       group_offsets_moved=lambda g: None, flush_writes=lambda: None)
    props = encode_props(1, False, "pub")
    a = RemoteMessage((0, 4096, 1, 2, 0, "a/x", (), props, b"from group A"), ("a/#",))
    b = RemoteMessage((0, 4096, 1, 2, 0, "b/x", (), props, b"from group B"), ("b/#",))
    a_again = RemoteMessage((7, 4096, 1, 2, 0, "a/x", (), props, b"from group A"), ("a/+",))
    d._outbound = {}
    got = d._outbound_messages([a, b]) + [d._outbound_message(a), d._outbound_message(b)]
    assert [(m.topic, m.payload) for m in got] == [("a/x", b"from group A"), ("b/x", b"from group B")] * 2
    d._outbound = {}
    first, again = d._outbound_messages([a, a_again])   # one record through two queues: one record
    assert again.payload is first.payload and again.record is first.record and again.queue_offset == 7
