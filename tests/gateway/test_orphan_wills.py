"""The wills of the connections a crash cut (gateway/clients/session_registry.py
`publish_orphan_wills`): taken from the store and published at start; when the store cannot take
them then (away, its disk full), tried again until it can, skipping the clients that connected
since (their CONNECT voided the crash's will, and what is held for them now is their live one).
Built on a recording fake of the wills facade."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from lmqtt.gateway.clients.session_registry import SessionRegistry
from lmqtt.gateway.storage.facades import Answer
from lmqtt.lightqueue.records import WillRecord
from lmqtt.store import protocol as W
from lmqtt.store.client.errors import DiskFull


class Wills:
    """The WillStore facade: what it holds, a take that fails while `full` is set."""

    def __init__(self, held: dict[str, WillRecord]) -> None:
        self.held_now = dict(held)
        self.full = True
        self.calls: list[tuple[str, ...]] = []

    def _refused(self) -> Answer:
        return Answer.failed(DiskFull(W.E_DISK_FULL, "disk full: cannot write the light-queue metadata"))

    def take(self) -> Answer:
        self.calls.append(("take",))
        if self.full:
            return self._refused()
        out, self.held_now = list(self.held_now.items()), {}
        return Answer.of(out)

    def held(self) -> Answer:
        self.calls.append(("held",))
        return self._refused() if self.full else Answer.of(list(self.held_now.items()))

    def pop(self, cid: str) -> Answer[None]:
        self.calls.append(("pop", cid))
        self.held_now.pop(cid, None)
        return Answer.of(None)

    def void(self, cid: str) -> Answer[None]:
        self.calls.append(("void", cid))
        if not self.full:
            self.held_now.pop(cid, None)
        return Answer.of(None)

    def put(self, cid: str, will: WillRecord) -> Answer[None]:
        self.held_now[cid] = will
        return Answer.of(None)

    def on_wills_published(self, fn) -> None: ...


def _will(topic: str) -> WillRecord:
    return WillRecord(topic, b"gone", 1, False, b"", 0, 0)


def test_orphan_wills_the_store_could_not_take_at_start_are_published_once_it_can():
    async def go() -> tuple[list, Wills]:
        wills = Wills({"a": _will("w/a"), "b": _will("w/b"), "c": _will("w/c")})
        published: list[tuple[str, str]] = []
        metrics = SimpleNamespace(sessions=SimpleNamespace(set_function=lambda fn: None))
        reg = SessionRegistry(asyncio.get_running_loop(), metrics, SimpleNamespace(wills=wills), persist=None,
                              subscriptions=None,
                              publish=lambda cid, qos, topic, payload, retain, props: published.append((cid, topic)))
        reg.ORPHAN_WILLS_RETRY_S = 0.05
        assert reg.publish_orphan_wills() == 0        # the disk is full: nothing taken, nothing lost
        reg.open("b", True)                            # b is back: its CONNECT voids the crash's will...
        wills.put("b", _will("w/b-live"))              # ...and it holds a will of its live connection
        await asyncio.sleep(0.2)                       # a retry or more, still refused
        assert published == []
        wills.full = False
        for _ in range(100):
            if published:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)                       # no second publication
        return published, wills

    published, wills = asyncio.run(go())
    assert sorted(published) == [("a", "w/a"), ("c", "w/c")]
    assert wills.held_now == {"b": _will("w/b-live")}   # the live connection's will is kept
    assert ("pop", "b") not in wills.calls and wills.calls.count(("held",)) >= 2
