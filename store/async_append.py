"""The store's asyncio callers: `append_async` / `append_batch_async` (`AsyncAppend`, a part of
`MessageStore`) and `await_durable`, the wait for a durable future from an event loop.

Why a module of its own: message_store.py wires the store and appends from any thread; this is
what an event loop adds on top of that - the appends of one loop iteration coalesced into one
append_batch (one lock, one copy, one share of the group commit), and many waiters of one
group-commit round woken with one call_soon_threadsafe per loop. The store server
(server/connection.py) answers its PRODUCEs once durable through `durable_waiter` too.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

from .errors import StoreError
from .message import AppendResult, Message


class AsyncAppend:
    """`MessageStore`'s asyncio appends (a mixin over its `append_batch` and `_coalesce`)."""

    async def append_async(self, msg: Message) -> AppendResult:
        """Append one message and wait until it is durable under the flush mode."""
        rs = await self.append_batch_async((msg,))
        return rs[0]

    async def append_batch_async(self, msgs) -> list[AppendResult]:
        """Append `msgs` (all or none) and wait until durable.

        Concurrent callers on one event loop are coalesced: every append of one loop iteration
        goes into ONE append_batch (one lock, one copy into the map, one share of the group
        commit). That is what lets many writers, each waiting for its own ack, run at batch speed
        (`lmqtt bench store --modes sync --batch 1 --writers 64`). A batch that the store refuses
        is retried caller by caller, so one bad message fails only its own caller."""
        msgs = list(msgs)
        if not msgs:
            return []
        loop = asyncio.get_running_loop()
        pending = self._coalesce.get(loop)
        if pending is None:
            pending = self._coalesce[loop] = []
            loop.call_soon(self._flush_coalesced, loop)
        w = loop.create_future()
        pending.append((msgs, w))
        rs = await w
        await await_durable(rs[-1].durable)
        return rs

    def _flush_coalesced(self, loop) -> None:
        pending = self._coalesce.pop(loop, None)
        if not pending:
            return
        if len(pending) == 1:
            groups = pending
        else:
            allmsgs = [m for msgs, _ in pending for m in msgs]
            try:
                results = self.append_batch(allmsgs)
            except StoreError:
                groups = pending  # somebody's message was refused: retry caller by caller
            except Exception as e:  # noqa: BLE001 - every writer of the batch sees the failure
                for _, w in pending:
                    if not w.done():
                        w.set_exception(e)
                return
            else:
                i = 0
                for msgs, w in pending:
                    n = len(msgs)
                    if not w.done():  # a cancelled writer's messages are still appended
                        w.set_result(results[i:i + n])
                    i += n
                return
        for msgs, w in groups:
            try:
                rs = self.append_batch(msgs)
            except Exception as e:  # noqa: BLE001 - handed to that writer
                if not w.done():
                    w.set_exception(e)
            else:
                if not w.done():
                    w.set_result(rs)


_WAITERS_LOCK = threading.Lock()
# durable future -> the (loop, waiter) pairs awaiting it: an entry from the first waiter until the
# future's done-callback takes it (a future is done once, so every entry goes)
_WAITERS: dict[Future, list] = {}


def _wake_waiters(fut: Future) -> None:
    """Done-callback of a durable future (runs on the thread that resolved it): one
    call_soon_threadsafe per event loop with waiters, not one per waiting append."""
    with _WAITERS_LOCK:
        lst = _WAITERS.pop(fut, None)
    by_loop: dict = {}
    for loop, w in lst or ():
        by_loop.setdefault(loop, []).append(w)
    for loop, ws in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle, ws, fut)
        except RuntimeError:  # that loop is closed; nobody is waiting any more
            pass


def _settle(ws: list, fut: Future) -> None:
    exc = fut.exception()
    for w in ws:
        if not w.done():  # a cancelled waiter stays cancelled
            if exc is not None:
                w.set_exception(exc)
            else:
                w.set_result(fut.result())


def durable_waiter(fut: Future, loop: asyncio.AbstractEventLoop) -> asyncio.Future | None:
    """A future of `loop` that completes as the durable future `fut` does, or None when `fut` is
    done already (the caller reads `fut.result()`). Many appends share one future per
    group-commit round: each waiter is a cheap loop future registered on the shared one, and the
    round wakes each loop once. Cancelling a waiter never cancels the shared future (which other
    writers wait on)."""
    if fut.done():
        return None
    w = loop.create_future()
    with _WAITERS_LOCK:
        lst = _WAITERS.get(fut)
        if fut.done() and lst is None:      # the callback ran (or runs at once below): it is done
            return None
        if lst is None:      # first waiter on this future
            _WAITERS[fut] = [(loop, w)]
            first = True
        else:
            lst.append((loop, w))
            first = False
    if first:
        fut.add_done_callback(_wake_waiters)  # runs at once if fut is already done
    return w


async def await_durable(fut: Future) -> None:
    """Await a durable future from an event loop (`durable_waiter`)."""
    w = durable_waiter(fut, asyncio.get_running_loop())
    if w is None:
        fut.result()
        return
    await w
