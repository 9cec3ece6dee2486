"""The SDK's asyncio connection:

`AsyncConnection`   the asyncio twin of the sync `Connection`: an asyncio.Protocol, pipelined
                    requests answered as futures, server pushes (EVENT) to `on_push` callbacks,
                    reconnect with backoff on the next request and `on_reconnect` callbacks (where a
                    client re-watches what it watched).

(The gateway's selector-driven link to its store, `LoopConnection`, is gateway/storage/store_link.py.)
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from typing import Callable

from .. import protocol as W
from .aio_api import (
    AsyncAdmin,
    AsyncAutoBatchProducer,
    AsyncFilterConsumer,
    AsyncPopConsumer,
    AsyncProducer,
    AsyncPullConsumer,
)
from .commands import AnyCall, CancelDelayed, Command, Pull
from .errors import (
    ConnectionLost,
    NotStores,
    StoreClientError,
    check_reply,
    is_not_primary,
    not_a_store,
    parse_hello_ok,
)
from .failover import GROUP_RETRY_S, FollowsMembers, Members
from .producer import SendResult, delayed_frame, due_ms, pack_one

log = logging.getLogger("lmqtt.store.client.aio")


class AsyncConnection(FollowsMembers):
    """asyncio twin of `Connection` (same frames, same error types), on an asyncio.Protocol."""

    def __init__(self, address: str = f"127.0.0.1:{W.DEFAULT_PORT}", *, token: str | None = None,
                 timeout: float = 30.0, reconnect_attempts: int = 6, backoff_initial: float = 0.05,
                 backoff_max: float = 2.0, client_name: str = "lmqtt-sdk-async",
                 failover_timeout: float = 30.0) -> None:
        # a store group (docs/ha.md): several addresses; requests follow the primary by the one policy
        # of every connection (failover.py Members): a member silent while requests wait is left,
        # or sooner once a probe of the others names a newer primary
        self.members = Members(address, failover_timeout=failover_timeout)
        self.token = token
        self.timeout = timeout
        self.reconnect_attempts = reconnect_attempts
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.client_name = client_name
        self._proto: "_AsyncProtocol | None" = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._lock: asyncio.Lock | None = None
        self._push: list[Callable[[int, bytes], None]] = []
        self._reconnect_cbs: list[Callable[[], None]] = []
        self._connects = 0
        self.ident = None
        self.server_info: dict = {}
        self._watch: asyncio.Task | None = None

    def on_push(self, fn: Callable[[int, bytes], None]) -> None:
        """fn(opcode, body) for every frame the server sends unasked (request id 0)."""
        self._push.append(fn)

    def on_reconnect(self, fn: Callable[[], None]) -> None:
        """fn() after every connect but the first (re-watch, re-subscribe)."""
        self._reconnect_cbs.append(fn)

    async def _connect_once(self) -> None:
        loop = asyncio.get_running_loop()
        hello: asyncio.Future = loop.create_future()
        # a group member that accepts but does not answer (stopped) or cannot be reached is not
        # waited for long: the others are tried meanwhile
        m = self.members
        wait = min(self.timeout, 2.0) if m.group else self.timeout
        _t, proto = await asyncio.wait_for(
            loop.create_connection(lambda: _AsyncProtocol(self, hello), m.host, m.port), wait)
        proto.transport.write(W.hello_frame(self.client_name, self.token))
        try:
            op, body = await asyncio.wait_for(hello, wait)
            info = parse_hello_ok(op, body)
        except BaseException:
            proto.transport.close()
            raise
        why = m.refusal(info)        # a group member that is not the primary: aimed where it points
        if why is not None:
            proto.transport.close()
            raise ConnectionLost(why)
        m.attached()
        self.server_info = info
        self.ident = info.get("ident")
        self._proto = proto
        self._connects += 1
        if m.group and (self._watch is None or self._watch.done()):
            self._watch = loop.create_task(self._watch_silence(), name="lmqtt-aio-group-watch")
        if self._connects > 1:
            for fn in list(self._reconnect_cbs):
                try:
                    fn()
                except Exception:  # noqa: BLE001
                    log.exception("event=reconnect_callback_failed")

    async def _ensure(self) -> "_AsyncProtocol":
        if self._proto is not None:
            return self._proto
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._proto is not None:
                return self._proto
            m = self.members
            retry = m.retry(self.backoff_initial, self.backoff_max, self.reconnect_attempts)
            last = None
            not_stores = NotStores(m.addresses)
            while True:
                at = m.at
                try:
                    await self._connect_once()
                    return self._proto
                except StoreClientError as e:
                    if not m.group:
                        raise
                    not_stores.note(at, e)      # another server's port: the next member (else raised)
                    last = e
                except (OSError, ConnectionLost, asyncio.TimeoutError) as e:
                    last = e
                m.unreachable(at)          # a group: the next member
                wait = retry.wait()
                if wait is None:
                    if m.group:
                        raise ConnectionLost(f"no primary found among the store group's members within "
                                             f"{m.failover_timeout:g} s (last: {last}){not_stores.suffix()}")
                    raise ConnectionLost(f"cannot connect to store {m.address}: {last}")
                await asyncio.sleep(wait)

    async def _watch_silence(self) -> None:
        """A store group: leave a member that answers nothing while requests wait - for the primary
        another member names (Members.probe, run in a thread: it dials), or after `stall_timeout`
        for the next member. One task per connection, started by its connect, ended with it."""
        loop = asyncio.get_running_loop()
        m = self.members
        while True:
            await asyncio.sleep(0.25)
            proto = self._proto
            if proto is None:
                return                  # the next connect starts another
            quiet = m.silence(proto.last_rx, bool(self._pending))
            if quiet is None:
                continue
            if quiet[0] == "leave":
                why = m.stalled()
                m.move(None)            # aimed first: the requests failed below are re-sent there
            else:
                target, heard = await loop.run_in_executor(
                    None, lambda: m.probe(self.server_info.get("epoch"), token=self.token, client_name=self.client_name))
                if self._proto is not proto:
                    continue
                why = m.probed(target, heard, quiet[1])
                if why is None:
                    continue
                m.move(target)          # aimed first: the requests failed below are re-sent there
            proto.transport.abort()
            self._lost(proto, why)

    def _not_primary(self, e: StoreClientError) -> None:
        proto = self._proto
        self.members.not_primary(e.reason)
        if proto is not None:
            proto.transport.close()
            self._lost(proto, f"not the primary: {e}")

    def _lost(self, proto: "_AsyncProtocol", err: str) -> None:
        if self._proto is not None and self._proto is not proto:
            # an earlier connection's late close (connection_lost runs a loop step after the
            # close): its requests failed then; those pending now were sent on the current one
            return
        self._proto = None
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(ConnectionLost(err))

    def _frame(self, op: int, flags: int, rid: int, body: bytes) -> None:
        if rid == 0:
            if op == W.OP_ERROR:
                log.error("event=store_error_push error=%s", W.parse_error(body))
                return
            for fn in self._push:
                try:
                    fn(op, body)
                except Exception:  # noqa: BLE001
                    log.exception("event=push_callback_failed")
            return
        fut = self._pending.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result((op, flags, body))

    async def request(self, op: int, body: bytes = b"", flags: int = 0) -> asyncio.Future:
        proto = await self._ensure()
        rid = next(self._ids) & 0xFFFFFFFF or next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self.members.sent(bool(self._pending))
        self._pending[rid] = fut
        proto.transport.write(W.frame(op, rid, body, flags))
        return fut

    async def call(self, op: int, body: bytes = b"", *, retry: bool = False, flags: int = 0):
        tries = self.reconnect_attempts if retry else 1
        multi = self.members.group
        deadline = time.monotonic() + self.members.failover_timeout
        i = 0
        while True:
            try:
                fut = await self.request(op, body, flags)
                return check_reply(await asyncio.wait_for(fut, self.timeout))
            except StoreClientError as e:
                # a group member that is not the primary did nothing: safe to send again there
                if not is_not_primary(e) or time.monotonic() >= deadline:
                    raise
                self._not_primary(e)
                await asyncio.sleep(min(self.backoff_initial * (2 ** min(i, 6)), GROUP_RETRY_S))
            except ConnectionLost:
                if (not multi and i + 1 >= tries) or (multi and (not retry or time.monotonic() >= deadline)):
                    raise
                await asyncio.sleep(min(self.backoff_initial * (2 ** min(i, 6)), GROUP_RETRY_S if multi else self.backoff_max))
            i += 1

    async def execute(self, command: Command):
        """Send one command of the command layer (commands.py) and read its reply: its typed value
        (Connection.execute, awaited)."""
        op, body, flags = command.encode()
        rop, rflags, rbody = await self.call(op, body, retry=command.retry, flags=flags)
        return command.decode(rop, rflags, rbody, self.ident)

    async def cmd(self, name: str, **args):
        """A CALL command by name (Connection.cmd, awaited)."""
        return await self.execute(AnyCall(name, args))

    async def send(self, topic: str, body: bytes, *, delay: float | None = None, deliver_at=None, **kw):
        """Send one message (no dedup id); -> SendResult once durable. `delay` (seconds) or
        `deliver_at` (epoch ms / aware datetime): delivered then (Producer.send)."""
        due = due_ms(delay, deliver_at) if delay is not None or deliver_at is not None else 0
        frame, flags = delayed_frame(W.encode_produce("", 0, 1, pack_one(topic, body, **kw)), [due] if due else None)
        op, _f, rb = await self.call(W.OP_PRODUCE, frame, flags=flags)
        phys, qoff = W.decode_produced(rb)[0]
        return SendResult(f"{self.ident}{phys:016X}", phys, qoff)

    async def cancel_delayed(self, msg_id: str) -> bool:
        """Producer.cancel_delayed: True when the delayed message was pending and will not fire."""
        return await self.execute(CancelDelayed(msg_id))

    async def pull(self, topic: str, queue_id: int = 0, offset: int = 0, max_count: int = 256,
                   max_bytes: int = 4 << 20):
        return await self.execute(Pull(topic, queue_id, offset, max_count, max_bytes))

    # the command API (aio_api.py), as on the sync Connection
    def producer(self, producer_id: str | None = None):
        return AsyncProducer(self, producer_id)

    def auto_batch_producer(self, producer_id: str | None = None, **kw):
        """An AsyncAutoBatchProducer (aio_api.py); create it inside the running loop."""
        return AsyncAutoBatchProducer(self, producer_id, **kw)

    async def consumer(self, topic: str, group: str, queue_id: int = 0, *, start: str = "earliest", **kw):
        return await AsyncPullConsumer(self, topic, group, queue_id, **kw).start(start)

    async def filter_consumer(self, topic_filter: str, group: str | None = None, *, start: str = "latest",
                              since: int | None = None, **kw):
        return await AsyncFilterConsumer(self, topic_filter, group, **kw).start(start, since)

    def pop_consumer(self, topic: str, group: str, queue_id: int = 0, **kw):
        return AsyncPopConsumer(self, topic, group, queue_id, **kw)

    def admin(self):
        """AsyncAdmin (aio_api.py): topics, offsets, lag, stats, lookups by msg id / key / time."""
        return AsyncAdmin(self)

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._proto is not None:
            self._proto.transport.close()
            self._proto = None


class _AsyncProtocol(asyncio.Protocol):
    def __init__(self, owner: AsyncConnection, hello: asyncio.Future) -> None:
        self.owner = owner
        self.hello = hello
        self.dec = W.FrameDecoder()
        self.transport: asyncio.Transport | None = None
        self.last_rx = time.monotonic()

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        self.last_rx = time.monotonic()
        try:
            frames = self.dec.feed(data)
        except W.ProtocolError as e:
            if not self.hello.done():       # not store frames at all: another server's port
                self.hello.set_exception(not_a_store(f"{self.owner.host}:{self.owner.port}", data))
            self.transport.close()
            self.owner._lost(self, f"bad frame from the store: {e}")
            return
        for op, flags, rid, body in frames:
            if not self.hello.done():
                self.hello.set_result((op, body))
                continue
            self.owner._frame(op, flags, rid, body)

    def connection_lost(self, exc) -> None:
        err = f"connection to the store lost: {exc}" if exc else "connection closed by the store"
        if not self.hello.done():
            self.hello.set_exception(ConnectionLost(err))
        self.owner._lost(self, err)


async def connect_async(address: str = f"127.0.0.1:{W.DEFAULT_PORT}", **kw) -> AsyncConnection:
    c = AsyncConnection(address, **kw)
    await c._ensure()
    return c


__all__ = ["AsyncConnection", "connect_async", "parse_hello_ok", "ConnectionLost",
           "StoreClientError"]
