"""`LoopConnection`: the gateway's link to its store, one connection driven by an asyncio loop's
selector, for callers that live ON the loop and are partly synchronous (the remote gateway,
gateway/storage/remote_store.py). It speaks the SDK's protocol with the SDK's handshake, errors and
member rules (lmqtt.store.client: handshake.py, errors.py, failover.py) and lives with the
gateway's storage, the one room that talks to a remote store.

Why it exists beside the SDK's `AsyncConnection` (store/client/aio.py): the gateway's publish and
delivery code calls the store synchronously. The hot paths must not block - a PRODUCE is written
and its reply resolves a future later, pushed EVENT frames arrive through `loop.add_reader` - but a
few rare reads (a filter registration before SUBACK, retained messages on SUBSCRIBE, a session on
CONNECT) need their answer now, from code that cannot `await`. A blocking wait on an asyncio
stream would deadlock (the loop that must read the reply is the one waiting), so this connection
owns its socket: `call_blocking` flushes the output and reads the socket itself (select, bounded by
`timeout`), handing every other frame it meets to its own future/push callback as the loop would.

Everything goes over ONE socket, so requests are processed by the store in the order they were
written: a fire-and-forget metadata write is always seen by a later blocking read, and the
retained message written before a PRODUCE is stored before that PRODUCE is acknowledged.

Push frames (request id 0, e.g. EVENT 0xC0, PUSH 0xC1) go to `on_push` callbacks: called at once
when the loop read them (no extra loop iteration on the delivery path), via `call_soon` when a
blocking wait read them (never inside a blocking wait's stack). After a lost connection every
request in flight fails with `ConnectionLost`, the connection re-dials with backoff and
`on_reconnect` callbacks run (the gateway re-watches its queues there).

A store group (docs/ha.md, docs/fleet.md): the address may list every member, "a:p,b:p,c:p". The
link then connects to the primary only: a member whose HELLO_OK says it is not is left for the
primary it names (or the next address while none is known), at start and on every redial, for up
to `failover_timeout` seconds at start (the redial goes on until the link is closed). A request
answered ERROR not_primary (a deposed primary) drops the link at once, aimed at the primary the
refusal names: every request in flight fails with ConnectionLost and the redial finds the new
primary; so does a member that answers nothing for `stall_timeout` (5 s) while requests wait (a
stopped or cut-off primary keeps its socket open), or sooner, once another member asked after
`probe_after` (1 s) of such silence names a newer primary (failover.probe_primary); the reconnect callbacks re-establish what the gateway had there (its hello, watches) and
the gateway's producer re-sends its PRODUCEs in flight with their producer id + sequence
(gateway/storage/remote_produce.py), so the new primary stores each batch once.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import select
import socket
import time
from typing import Callable

from lmqtt.store import protocol as W
from lmqtt.store.client.errors import ConnectionLost, StoreClientError
from lmqtt.store.client.failover import GROUP_RETRY_S, FollowsMembers, Members, Retry
from lmqtt.store.client.handshake import dial

# the logger's name from when this class lived in aio.py: log filters that name it keep working
log = logging.getLogger("lmqtt.store.client.aio")


class LoopConnection(FollowsMembers):
    def __init__(self, address: str, *, loop: asyncio.AbstractEventLoop, token: str | None = None,
                 timeout: float = 5.0, connect_timeout: float = 5.0, backoff_max: float = 2.0,
                 client_name: str = "lmqtt-gateway", max_frame: int = W.DEFAULT_MAX_FRAME,
                 failover_timeout: float = 30.0) -> None:
        # one store, or a store group's members (the link follows its primary by the one policy of
        # every connection, failover.py Members); `failover_timeout`: how long the first connect
        # looks for the primary, and how long the gateway's producer keeps re-sending a PRODUCE
        # across failovers (remote_produce.py); a member silent for `stall_timeout` s while requests
        # wait is left, or sooner once a probe of the others (in a thread) names a newer primary
        self.members = Members(address, failover_timeout=failover_timeout)
        self.loop = loop
        self.token = token
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.backoff_max = backoff_max
        self.client_name = client_name
        self.max_frame = max_frame
        self.server_info: dict = {}
        self.connected = False
        self.closed = False
        self.reconnects = 0
        self._sock: socket.socket | None = None
        self._dec = W.FrameDecoder(max_frame)
        self._out = bytearray()
        self._writing = False
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._push: list[Callable[[int, bytes], None]] = []
        self._reconnect_cbs: list[Callable[[], None]] = []
        self._lost_cbs: list[Callable[[str], None]] = []
        self._redial: asyncio.Task | None = None
        self.last_error: str | None = None
        self._blocking = 0             # > 0 while call_blocking reads the socket itself
        self._probing = False
        self._last_rx = 0.0
        self._stall_handle: asyncio.TimerHandle | None = None

    # ---------------------------------------------------------------- callbacks
    def on_push(self, fn: Callable[[int, bytes], None]) -> None:
        self._push.append(fn)

    def on_reconnect(self, fn: Callable[[], None]) -> None:
        self._reconnect_cbs.append(fn)

    def on_lost(self, fn: Callable[[str], None]) -> None:
        self._lost_cbs.append(fn)

    # ---------------------------------------------------------------- connect
    def connect_blocking(self) -> None:
        """Dial and handshake now (startup: the gateway does not serve before its store answers).
        A store group: look for the primary among the members for up to `failover_timeout`
        (a group may be electing); ConnectionLost naming every member when none is found."""
        if not self.members.group:
            s, dec, self.server_info, early = self._dial_primary()
        else:
            deadline = time.monotonic() + self.failover_timeout
            while True:
                try:
                    s, dec, self.server_info, early = self._dial_primary()
                    break
                except ConnectionLost as e:
                    if time.monotonic() >= deadline:
                        raise ConnectionLost(f"no primary found among the store group {self.members.members} within "
                                             f"{self.failover_timeout:g} s (last: {e})") from None
                    time.sleep(0.1)
        self._attach(s, dec)
        for f in early:
            self._frame(*f)

    def _dial_primary(self):
        """One dial of the current target -> (socket, decoder, server info, early frames). In a
        group, a member that says it is not the primary is closed and the target moves to the
        primary it names, or the next member (ConnectionLost); an unreachable member likewise."""
        dec = W.FrameDecoder(self.max_frame)
        m = self.members
        at = m.at
        try:
            s, info, early = dial(m.host, m.port, connect_timeout=self.connect_timeout,
                                  client_name=self.client_name, token=self.token, decoder=dec)
        except ConnectionLost:
            m.unreachable(at)            # a group: the next member
            raise
        why = m.refusal(info)            # a group member that is not the primary: aimed where it points
        if why is not None:
            s.close()
            raise ConnectionLost(why)
        return s, dec, info, early

    def _attach(self, s: socket.socket, dec: W.FrameDecoder) -> None:
        self.members.attached()
        s.setblocking(False)
        self._sock = s
        self._dec = dec
        self._out.clear()
        self._writing = False
        self.connected = True
        self._last_rx = time.monotonic()
        self.loop.add_reader(s.fileno(), self._on_readable)
        if self.members.group and self._stall_handle is None:
            self._stall_handle = self.loop.call_later(0.25, self._stall_tick)

    def _stall_tick(self) -> None:
        self._stall_handle = None
        if self.closed:
            return
        m = self.members
        quiet = m.silence(self._last_rx, self.connected and bool(self._pending), can_probe=not self._probing)
        if quiet is not None and quiet[0] == "leave":
            self._drop(m.stalled())
            m.move(None)             # before the redial the drop started runs (it is a task)
        elif quiet is not None:      # "probe": the other members, asked in a thread
            self._probing = True
            sock = self._sock
            fut = self.loop.run_in_executor(None, lambda: m.probe(self.server_info.get("epoch"), token=self.token,
                                                                  client_name=self.client_name))
            fut.add_done_callback(lambda f, sock=sock: self._probed(f, sock))
        self._stall_handle = self.loop.call_later(0.25, self._stall_tick)

    def _probed(self, fut, sock) -> None:
        """On the loop: a probe's answer. The link still on the silent member moves to the primary
        another member named (its requests fail with ConnectionLost and are re-sent by their
        owners after the redial)."""
        self._probing = False
        target, heard = (None, []) if fut.cancelled() or fut.exception() is not None else fut.result()
        m = self.members
        if target is not None and (self.closed or not self.connected or self._sock is not sock):
            target = None            # the link moved on meanwhile
        silent = time.monotonic() - max(self._last_rx, m.waiting_since)
        if target is not None and (not self._pending or silent <= m.probe_after):
            target = None            # it answered meanwhile
        why = m.probed(target, heard, silent)
        if why is not None:
            self._drop(why)
            m.move(target)           # before the redial the drop started runs (it is a task)

    async def _redial_loop(self) -> None:
        # a group: members are tried in turn while one is elected; the wait stays short; the link
        # redials until it is closed
        retry = Retry(0.05, min(self.backoff_max, GROUP_RETRY_S) if self.members.group else self.backoff_max)
        while not self.closed:
            await asyncio.sleep(retry.wait() or 0.0)
            try:
                await self.loop.run_in_executor(None, self._dial_only)
            except Exception as e:  # noqa: BLE001 - logged, retried
                self.last_error = str(e)
                continue
            return

    def _dial_only(self) -> None:
        # runs in a thread: handshake blocking there, then attach on the loop
        s, dec, info, early = self._dial_primary()
        fut = asyncio.run_coroutine_threadsafe(self._attach_async(s, dec, info, early), self.loop)
        fut.result(10)

    async def _attach_async(self, s, dec, info, rest) -> None:
        """On the loop: attach the new socket and run the reconnect callbacks in the same step,
        so nothing on the loop sees `connected` before the callbacks (e.g. the gateway's
        re-watch of its queues) have run; frames that came with HELLO_OK are handled after."""
        if self.closed:
            s.close()
            return
        self.server_info = info
        self._attach(s, dec)
        self.reconnects += 1
        if self.members.group:
            log.info("event=store_reconnected address=%s role=%s failovers=%d", self.address,
                     info.get("role"), self.failovers)
        else:
            log.info("event=store_reconnected address=%s", self.address)
        for fn in list(self._reconnect_cbs):
            try:
                fn()
            except Exception:  # noqa: BLE001
                log.exception("event=reconnect_callback_failed")
        for f in rest:
            self._frame(*f)

    def drop(self, reason: str) -> None:
        """Drop the link now with `reason` (what requests, `unavailable()` and /readyz report); it
        redials as after a loss."""
        self._drop(reason)

    def _drop(self, reason: str) -> None:
        if not self.connected:
            return
        self.connected = False
        self.last_error = reason
        s = self._sock
        self._sock = None
        try:
            self.loop.remove_reader(s.fileno())
            if self._writing:
                self.loop.remove_writer(s.fileno())
        except Exception:  # noqa: BLE001 - loop closing
            pass
        s.close()
        self._writing = False
        self._out.clear()
        pending, self._pending = self._pending, {}
        err = ConnectionLost(f"connection to the store at {self.address} lost: {reason}")
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)
                fut.exception()        # retrieved here: a fire-and-forget request must not warn
        if not self.closed:
            log.warning("event=store_connection_lost address=%s reason=%s (reconnecting)", self.address, reason)
            for fn in list(self._lost_cbs):
                try:
                    fn(reason)
                except Exception:  # noqa: BLE001
                    log.exception("event=lost_callback_failed")
            self._redial = self.loop.create_task(self._redial_loop())

    def close(self) -> None:
        self.closed = True
        if self._stall_handle is not None:
            self._stall_handle.cancel()
            self._stall_handle = None
        if self._redial is not None:
            self._redial.cancel()
        if self._sock is not None and self._out:
            self._on_writable()          # what this iteration queued, as far as the socket takes it
        self._drop("closed")

    # ---------------------------------------------------------------- I/O
    def _on_readable(self) -> bool:
        """Read what the socket has (one read); True when something was read."""
        s = self._sock
        if s is None:
            return False
        try:
            data = s.recv(1 << 18)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as e:
            self._drop(str(e))
            return False
        if not data:
            self._drop("closed by the store")
            return False
        self._last_rx = time.monotonic()
        self._feed(data)
        return True

    def _feed(self, data: bytes) -> None:
        try:
            frames = self._dec.feed(data)
        except W.ProtocolError as e:
            self._drop(f"bad frame from the store: {e}")
            return
        for f in frames:
            self._frame(*f)

    def _frame(self, op: int, flags: int, rid: int, body: bytes) -> None:
        if rid == 0:
            if op == W.OP_ERROR:
                log.error("event=store_error_push error=%s", W.parse_error(body))
                return
            if self._blocking:
                for fn in self._push:
                    self.loop.call_soon(fn, op, body)
                return
            for fn in self._push:
                try:
                    fn(op, body)
                except Exception:  # noqa: BLE001 - one callback must not cost the frames after it
                    log.exception("event=push_callback_failed")
            return
        fut = self._pending.pop(rid, None)
        if fut is None or fut.done():
            return
        if op == W.OP_ERROR:
            err = StoreClientError(*W.parse_error(body))
            if self.members.group and err.code == W.E_NOT_PRIMARY:
                # a deposed primary: nothing was done; leave it now for the primary it names (every
                # other request in flight fails with ConnectionLost and is re-sent by its owner)
                self._drop(f"not the group's primary any more ({err.reason})")
                self.members.not_primary(err.reason)
            fut.set_exception(err)
        else:
            fut.set_result((op, flags, body))

    def _write(self, data: bytes) -> None:
        """Queue `data`; what is queued in one loop iteration goes in one send at its end (a
        reconnect storm asks several things per client: one syscall each was a sixth of the
        gateway's time). `call_blocking` sends what is queued itself."""
        if self._out:
            self._out += data
            return
        self._out += data
        if not self._writing:
            self._writing = True
            self.loop.call_soon(self._send_queued)

    def _send_queued(self) -> None:
        """End of the iteration that queued output: send it; what the socket does not take waits
        for it to become writable."""
        if self._sock is None or not self._writing:
            return
        self._on_writable()
        if self._out and self._sock is not None:
            self.loop.add_writer(self._sock.fileno(), self._on_writable)
        else:
            self._writing = False

    def _on_writable(self) -> None:
        if self._sock is None:
            return
        try:
            n = self._sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._drop(str(e))
            return
        del self._out[:n]
        if not self._out and self._writing:
            self._writing = False
            self.loop.remove_writer(self._sock.fileno())

    # ---------------------------------------------------------------- requests
    def unavailable_reason(self) -> str:
        """Why a request cannot be answered now; in a group, failing over, the member being dialled
        may not be the one the last error names."""
        if self.members.group:
            return f"store group failing over (connecting to {self.address}; last: {self.last_error})"
        return f"store at {self.address} unavailable: {self.last_error}"

    def request(self, op: int, body: bytes = b"", flags: int = 0) -> asyncio.Future:
        """Write one request now; the future gets (op, flags, body), or StoreClientError /
        ConnectionLost."""
        fut = self.loop.create_future()
        if not self.connected:
            fut.set_exception(ConnectionLost(self.unavailable_reason()))
            return fut
        rid = next(self._ids) & 0xFFFFFFFF or next(self._ids)
        self.members.sent(bool(self._pending))
        self._pending[rid] = fut
        self._write(W.frame(op, rid, body, flags))
        return fut

    def cmd(self, name: str, **args) -> asyncio.Future:
        """A CALL, not waited for (its future resolves to the result dict)."""
        args["cmd"] = name
        return self.request(W.OP_CALL, W.compact_json(args).encode())

    def cmd_within(self, name: str, timeout: float | None = None, **args) -> asyncio.Future:
        """A CALL answered within `timeout` (default: the connection's), not waited for here: the
        same bound as `cmd_blocking` (no answer in time: the store is taken for gone and the
        connection dropped, failing every request in flight), without stopping the loop.

        The bound is on the store's silence, not on this one request: while the store keeps
        answering (other replies arrive within `timeout`) a late request is queued behind others,
        not lost, and is waited for up to `failover_timeout`. A connect storm over many gateways
        queues thousands of requests at one store; dropping the link then failed every CONNECT in
        flight and sent the gateway back with all its watches to re-register: more load, not less."""
        fut = self.cmd(name, **args)
        if not fut.done():
            t = self.timeout if timeout is None else timeout
            timer: list[asyncio.TimerHandle] = []
            timer.append(self.loop.call_later(t, self._overdue, fut, t, time.monotonic(), timer))
            fut.add_done_callback(lambda _f: timer[0].cancel())
        return fut

    def _overdue(self, fut: asyncio.Future, t: float, sent_at: float, timer: list) -> None:
        if fut.done():
            return
        # the replies already in the socket first: after the loop was held up (a gateway starved
        # of CPU) one read per iteration leaves the rest of a burst's answers unread while the
        # timers run, and a reply that came in time may be among them
        for _ in range(256):
            if fut.done() or not self._on_readable():
                break
        if fut.done():
            return
        now = time.monotonic()
        heard = now - self._last_rx
        if self.connected and now - sent_at < self.failover_timeout and (self._out or heard < t):
            # this side has not sent it all yet, or the store answers, only not this yet: look
            # again once the store has been silent for `t`
            timer[0] = self.loop.call_later(t if self._out else t - heard, self._overdue, fut, t, sent_at, timer)
            return
        if heard < t:
            self._drop(f"no reply within {now - sent_at:.0f} s while the store answered others")
        else:
            self._drop(f"no reply within {t} s")
        if self.members.group:     # a stopped or cut-off member keeps its socket open: try the others first
            self.members.move(None)

    def cmd_nowait(self, name: str, **args) -> None:
        """A CALL whose failure is only logged (metadata writes: ordered with everything after)."""
        fut = self.cmd(name, **args)

        def done(f, name=name):
            e = f.exception()
            if e is not None:
                log.error("event=store_write_failed cmd=%s error=%s", name, e)
        fut.add_done_callback(done)

    def call_blocking(self, op: int, body: bytes = b"", timeout: float | None = None) -> tuple[int, int, bytes]:
        """Send and wait for the reply right here (the loop does not run meanwhile; other frames
        that arrive are handled as usual). Bounded by `timeout` (default: the connection's)."""
        fut = self.request(op, body)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self._blocking += 1
        try:
            self._wait_reply(fut, deadline, timeout)
        finally:
            self._blocking -= 1
        if not fut.done():
            raise ConnectionLost(self.unavailable_reason())
        return fut.result()

    def wait_reply(self, fut: asyncio.Future, timeout: float | None = None) -> None:
        """Wait right here (the loop does not run) until `fut`, a future of `request` / `cmd` /
        `cmd_within`, is done, bounded by `timeout` (default: the connection's; no answer in time
        drops the connection, which fails it). For callers that hold such a future and must have
        the answer now (the gateway's storage facades, `Answer.wait`)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self._blocking += 1
        try:
            self._wait_reply(fut, deadline, timeout)
        finally:
            self._blocking -= 1

    def _wait_reply(self, fut, deadline: float, timeout: float | None) -> None:
        while not fut.done():
            s = self._sock
            if s is None:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                self._drop(f"no reply within {self.timeout if timeout is None else timeout} s")
                break
            wl = [s] if self._out else []
            try:
                r, w, _ = select.select([s], wl, [], left)
            except (OSError, ValueError) as e:
                self._drop(str(e))
                break
            if w:
                self._on_writable()
            if r:
                self._on_readable()

    def cmd_blocking(self, name: str, timeout: float | None = None, **args):
        args["cmd"] = name
        op, _f, body = self.call_blocking(W.OP_CALL, W.compact_json(args).encode(), timeout)
        if op == W.OP_MESSAGES:
            return W.decode_messages(body)
        return json.loads(body)


__all__ = ["LoopConnection"]
