"""A fleet gateway's safety poll (gateway/storage/remote_store.py) asks the store about a bounded
slice of its mirrored queues per poll, the next slice at the next poll: with a queue per idle
device (each client on a topic of its own) polling every queue every second was most of an idle
gateway's CPU. A missed event is still found, within ceil(queues / POLL_SLICE) polls. Real
`lmqtt store`, RemoteStore driven directly, as in tests/gateway/test_remote_store.py."""
from __future__ import annotations

import asyncio

import pytest

from lmqtt.store.node import protocol as P
from tests.gateway.test_remote_store import _append, _remote
from tests.support import wait_until

pytestmark = pytest.mark.timeout(60)


def test_the_safety_poll_asks_a_slice_at_a_time_and_still_finds_what_no_event_said(lmqtt_store):
    async def go():
        st = _remote(lmqtt_store.address, watch=False)        # no events: only the poll finds entries
        st.POLL_SLICE = 3
        names = [f"slice/{i}" for i in range(7)]
        for q in names:
            assert st.max_offset(q).wait() == 0
        asked: list[list[str]] = []
        call = st.node.call

        def recording(req, *a, **kw):        # the real call, its queue list noted
            if isinstance(req, P.MaxOffsets):
                asked.append(list(req.queues))
            return call(req, *a, **kw)
        st.node.call = recording
        writer = _remote(lmqtt_store.address)
        await _append(writer, "slice/6", [b"unannounced"])
        st.start()
        assert await wait_until(lambda: st.queues["slice/6"].known == 1, 10)
        assert all(len(q) <= 3 for q in asked), asked
        assert set().union(*asked) == set(names)           # the round covered every queue
        st.close()
        st.link.close()
        writer.link.close()
    asyncio.run(go())


def test_with_the_native_watch_a_poll_round_is_spread_over_many_polls(lmqtt_store):
    """The store pushes every event on the watched connection itself, so the backstop poll goes
    round the mirrored queues over WATCHED_ROUND_POLLS polls (at least POLL_SLICE_MIN a poll)
    instead of POLL_SLICE at every poll: a fleet of gateways holding a queue per idle device
    asked the one store about all of them every few seconds."""
    async def go():
        st = _remote(lmqtt_store.address)                     # the native watch (gw_watch)
        assert st.watch
        st.WATCHED_ROUND_POLLS, st.POLL_SLICE_MIN = 5, 2
        names = [f"round/{i}" for i in range(23)]
        for q in names:
            assert st.max_offset(q).wait() == 0
        asked: list[list[str]] = []
        call = st.node.call

        def recording(req, *a, **kw):
            if isinstance(req, P.MaxOffsets):
                asked.append(list(req.queues))
            return call(req, *a, **kw)
        st.node.call = recording
        st.start()
        assert await wait_until(lambda: len(asked) >= 6, 10)
        assert all(len(q) <= 5 for q in asked), asked          # ceil(23 / 5) a poll
        assert set().union(*asked[:5]) == set(names)           # five polls make a round
        st.close()
        st.link.close()
    asyncio.run(go())
