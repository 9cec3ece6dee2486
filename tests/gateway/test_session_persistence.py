"""`SessionPersistence`'s offset flushing (gateway/clients/session_persistence.py): offsets marked dirty on the ack
path are written by its own timer, only for the sessions and shared groups that are still the
live ones, and once more when flushing stops at shutdown (also when it never started: a
shutdown after a failed start)."""
from __future__ import annotations

import asyncio

from lmqtt.gateway.clients.session_persistence import SessionPersistence
from lmqtt.gateway.session import Cursor, MqttSession
from lmqtt.gateway.subscriptions.shared_groups import SharedGroup
from lmqtt.gateway.storage.facades import Answer


class Metadata:
    """The storage facades SessionPersistence uses (storage/facades.py): offsets written are kept."""
    def __init__(self) -> None:
        self.writes: list[tuple[str, dict]] = []
        self.offsets = self
        self.sessions = None

    def set(self, consumer, offsets) -> Answer[None]:
        self.writes.append((consumer, dict(offsets)))
        return Answer.of(None)


def _session(cid: str, offset: int) -> MqttSession:
    s = MqttSession(cid)
    s.expiry_interval = 60
    s.cursors["q"] = Cursor(offset)
    return s


def test_dirty_offsets_of_live_sessions_and_groups_are_written_by_the_timer_and_at_stop():
    async def main():
        meta = Metadata()
        live, gone = _session("live", 5), _session("gone", 7)
        g_live, g_gone = SharedGroup("g", "q", 3), SharedGroup("h", "q", 4)
        p = SessionPersistence(meta, session_live=lambda s: s is live, group_live=lambda g: g is g_live)
        p.start_flushing(asyncio.get_running_loop(), 0.01)
        for s in (live, gone):
            p.mark_session(s)
        for g in (g_live, g_gone):
            p.mark_group(g)
        for _ in range(200):
            if meta.writes:
                break
            await asyncio.sleep(0.005)
        assert sorted(meta.writes) == sorted([("live", {"q": 5}), (g_live.consumer, {"q": 3})])
        assert not p.dirty_sessions and not p.dirty_groups
        meta.writes.clear()
        p.stop_flushing()
        p.mark_session(live)
        await asyncio.sleep(0.05)
        assert meta.writes == []                       # the timer is gone
        p.stop_flushing()                              # at shutdown: written once more
        assert meta.writes == [("live", {"q": 5})]
    asyncio.run(main())


def test_offsets_written_at_stop_without_the_timer_are_those_of_live_sessions_and_groups_only():
    """A shutdown after a failed start stops a flushing that never started: the live checks given
    at construction still keep ended or replaced sessions and dropped groups out."""
    meta = Metadata()
    live, gone = _session("live", 5), _session("gone", 7)
    g_live, g_gone = SharedGroup("g", "q", 3), SharedGroup("h", "q", 4)
    p = SessionPersistence(meta, session_live=lambda s: s is live, group_live=lambda g: g is g_live)
    for s in (live, gone):
        p.mark_session(s)
    for g in (g_live, g_gone):
        p.mark_group(g)
    p.stop_flushing()
    assert sorted(meta.writes) == sorted([("live", {"q": 5}), (g_live.consumer, {"q": 3})])
    assert not p.dirty_sessions and not p.dirty_groups
