"""`HistoryRuns` (gateway/replay.py): the subscriptions from the past still sending their history,
driven by the delivery engine. Its rules, with stand-in runs: a marked session is pumped; one that
can send more stays marked; a finished history goes live when the session is online and still
subscribed; a failed read is retried through the engine's kick a second later."""
from __future__ import annotations

from types import SimpleNamespace

from lmqtt.gateway.replay import HistoryRuns
from lmqtt.gateway.session import Cursor, Session


class Run:
    """A stand-in HistoryRun: `steps` pumps, each answering `more`, then finished."""

    def __init__(self, session, queue, steps=1, fail=False):
        self.session, self.queue, self.steps, self.fail = session, queue, steps, fail
        self.plan = SimpleNamespace(on_ready=None)
        self.meta_of = None
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


def _runs():
    kicked, live = [], []
    loop = Loop()
    meta_of = object()
    h = HistoryRuns(loop, SimpleNamespace(write_high_water=1 << 20), kick=kicked.append,
                    go_live=lambda s, q: live.append((s.client_id, q)), meta_of=meta_of)
    return h, loop, kicked, live, meta_of


def _online(cid, *queues):
    s = Session(cid)
    s.conn = object()
    for q in queues:
        s.cursors[q] = Cursor(0)
    return s


def test_a_history_is_pumped_until_done_then_goes_live():
    h, _, kicked, live, meta_of = _runs()
    s = _online("a", "t/#")
    run = Run(s, "t/#", steps=2)
    h.start(run)
    assert run.meta_of is meta_of and h.has(s, "t/#") and not h.has(s, "u") and s in h.marked
    run.plan.on_ready()                       # a chunk of a remote history came in: the engine's kick
    assert kicked == [s]
    h.run()
    assert s in h.marked and live == []       # could send more: examined again at the next run
    h.run()
    assert live == [("a", "t/#")] and h.by_session == {} and not h.marked
    assert not h.mark(s)                      # no history under way any more


def test_a_history_that_waits_is_examined_when_marked():
    h, _, _, live, _ = _runs()
    s = _online("a", "t/#")
    h.start(Run(s, "t/#", steps=3))
    h.marked.clear()
    h.run()
    assert live == [] and h.has(s, "t/#")     # not marked: not pumped
    assert h.mark(s) and s in h.marked


def test_no_live_reading_for_a_session_gone_offline_or_unsubscribed():
    h, _, _, live, _ = _runs()
    off = _online("off", "t/#")
    off.conn = None
    gone = _online("gone")
    h.start(Run(off, "t/#"))
    h.start(Run(gone, "t/#"))
    h.run()
    assert live == [] and h.by_session == {}


def test_drop_one_subscription_or_the_whole_session():
    h, _, _, _, _ = _runs()
    s = _online("a", "x", "y")
    h.start(Run(s, "x"))
    h.start(Run(s, "y"))
    h.drop(s, "x")
    assert not h.has(s, "x") and h.has(s, "y")
    h.drop(s)
    assert h.by_session == {} and s not in h.marked


def test_a_failed_read_is_retried_a_second_later():
    h, loop, kicked, live, _ = _runs()
    s = _online("a", "t/#")
    run = Run(s, "t/#", fail=True)
    h.start(run)
    h.run()
    assert loop.later == [(1.0, kicked.append, (s,))] and h.has(s, "t/#") and live == []
