"""The connections' write path: everything a connection sends during one loop iteration is joined
and written with one `transport.write` at the end of it (one syscall per tick, not per packet).

Separate from gateway/net/connection.py because it is one object for the whole broker, not a
part of one connection: it keeps the list of connections with pending output and flushes it with
ONE loop callback, or right away at the end of a delivery run / an ack batch (`flush`), so a
PUBLISH or PUBACK does not wait one more loop iteration; a publish batch `hold`s it and writes
what it queued itself. The connection's side is `MQTTConnection.write`/`flush`.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.net.connection import MQTTConnection


class WriteBatcher:
    """Connections with queued output, written together once per loop iteration (or on `flush`)."""

    __slots__ = ("loop", "_dirty", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._dirty: list["MQTTConnection"] = []
        self._scheduled = False

    def want_flush(self, conn: "MQTTConnection") -> None:
        """`conn` has queued output: write it at the latest in the next loop iteration."""
        self._dirty.append(conn)
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._on_loop)

    def _on_loop(self) -> None:
        self._scheduled = False
        self.flush()

    def hold(self) -> bool:
        """The caller writes what gets queued itself (`release`) before it returns to the loop, so
        no loop callback is scheduled meanwhile (the publish pipeline: one a message, which found
        nothing left to write). Returns what `release` needs: whether one was already scheduled."""
        was = self._scheduled
        self._scheduled = True
        return was

    def release(self, was: bool) -> None:
        if not was:
            self._scheduled = False
            if self._dirty:
                self.flush()

    def flush(self) -> None:
        """Write every connection's queued output now (one transport.write per connection)."""
        conns = self._dirty
        if conns:
            self._dirty = []
            for c in conns:
                c.flush()
