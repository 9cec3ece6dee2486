"""Connection layer of the SDK: framing, pipelining, reconnect with backoff (sync and asyncio).

`Connection` (sync): one TCP socket, a reader thread that matches replies to requests by request
id, so any number of requests can be in flight (`request()` returns a `concurrent.futures.Future`;
`call()` waits for it). Thread-safe: producers, AutoBatch's flusher and consumers share one.

`AsyncConnection` (asyncio, aio.py): the same on an asyncio.Protocol;
`request()` returns an asyncio future; server pushes go to `on_push` callbacks.

Lost connection: every request in flight fails with `ConnectionLost` (nothing is silently
dropped); the next request reconnects, with exponential backoff (`backoff_initial` doubling up to
`backoff_max`, `reconnect_attempts` tries). Commands that are safe to repeat (reads, PRODUCE with
producer id + sequence, which the store deduplicates) are retried by `call(..., retry=True)`.

A store group (docs/ha.md): the address may list several members, "a:p,b:p,c:p". The connection
goes to the primary: a member that is not says so in its HELLO_OK (role, primary) or answers a
request with ERROR not_primary naming the primary; the connection then moves there (or to the next
address while no primary is known) and sends again - nothing was done by the refusal, so every
request may be repeated. After a failover the same happens by itself, for up to
`failover_timeout` seconds (default 30) across reconnects; a PRODUCE is re-sent with its producer
id + sequence, so the new primary stores it once (the dedup markers are replicated). Which member
to dial (the address list, the primary named, the probe of the others) is failover.py's.
"""
from __future__ import annotations

import itertools
import select
import socket
import threading
import time
from concurrent.futures import Future

from lmqtt.store import protocol as W

from .admin import Admin
from .commands import AnyCall, Command
from .consumer import FilterConsumer, PendingPull, PopConsumer, PullConsumer, pull
from .errors import (
    NOT_IDEMPOTENT,
    ConnectionLost,
    DiskFull,
    NotStores,
    StoreClientError,
    check_reply,
    is_not_primary,
    not_a_store,
    parse_hello_ok,
)
from .failover import GROUP_RETRY_S, FollowsMembers, Members
from .handshake import dial
from .producer import AutoBatchProducer, Producer

# the errors every connection class raises, importable from here too (errors.py)
__all__ = ["NOT_IDEMPOTENT", "Connection", "ConnectionLost", "DiskFull", "NotStores", "StoreClientError", "check_reply",
           "connect", "dial", "is_not_primary", "not_a_store", "parse_hello_ok"]


class Connection(FollowsMembers):
    def __init__(self, address: str = f"127.0.0.1:{W.DEFAULT_PORT}", *, token: str | None = None,
                 timeout: float = 30.0, connect_timeout: float = 5.0, reconnect_attempts: int = 6,
                 backoff_initial: float = 0.05, backoff_max: float = 2.0, client_name: str = "lmqtt-sdk",
                 failover_timeout: float = 30.0) -> None:
        # which member of a store group it talks to, and when it leaves it (failover.py: the one
        # policy of every connection); `failover_timeout`: how long requests keep looking for the
        # primary across reconnects; a member silent for `stall_timeout` s while requests wait is
        # left, or sooner once a probe of the others names a newer primary (a SIGSTOPped primary)
        self.members = Members(address, failover_timeout=failover_timeout)
        self.token = token
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.reconnect_attempts = reconnect_attempts
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.client_name = client_name
        self.ident: str | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.RLock()          # connect + write
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._generation = 0
        self._conn_error: str | None = None
        self.server_info: dict = {}

    # ---------------------------------------------------------------- connect
    def _connect_once(self) -> None:
        dec = W.FrameDecoder()
        m = self.members
        # a group member answers HELLO at once; one that accepts and says nothing (stopped) is not
        # waited for the whole connect timeout while the others may have a primary
        s, info, early = dial(m.host, m.port, connect_timeout=min(self.connect_timeout, 2.0) if m.group
                              else self.connect_timeout, client_name=self.client_name, token=self.token,
                              decoder=dec)
        why = m.refusal(info)        # a group member that is not the primary: aimed where it points
        if why is not None:
            s.close()
            raise ConnectionLost(why)
        m.attached()
        self.ident = info.get("ident")
        self.server_info = info
        self._sock = s
        self._generation += 1
        t = threading.Thread(target=self._reader, args=(s, dec, early, self._generation),
                             name=f"lmqtt-sdk-reader-{self.port}", daemon=True)
        t.start()

    def _ensure(self) -> socket.socket:
        with self._lock:
            if self._closed:
                raise ConnectionLost("connection closed by the application")
            if self._sock is not None:
                return self._sock
            m = self.members
            retry = m.retry(self.backoff_initial, self.backoff_max, self.reconnect_attempts)
            last = None
            not_stores = NotStores(m.addresses)
            while True:
                at = m.at
                try:
                    self._connect_once()
                    return self._sock
                except StoreClientError as e:
                    if not m.group:
                        raise              # refused (auth, version) or a malformed answer: retrying won't help
                    not_stores.note(at, e)      # another server's port: the next member (else raised)
                    last = e
                except OSError as e:
                    last = e
                m.unreachable(at)          # a group: the next member
                wait = retry.wait()
                if wait is None:
                    break
                time.sleep(wait)
            if m.group:
                raise ConnectionLost(f"no primary found among {m.members} within "
                                     f"{m.failover_timeout:g} s (last: {last}){not_stores.suffix()}")
            # `last` is dial's ConnectionLost, which names the store already
            raise ConnectionLost(f"{last} (gave up after {max(1, self.reconnect_attempts)} attempts)")

    def not_primary(self, e: BaseException) -> None:
        """After a not_primary refusal: drop this connection and aim at the primary it names."""
        with self._lock:
            s = self._sock
            self.members.not_primary(getattr(e, "reason", str(e)))
        if s is not None:
            self._drop(s, f"store {self.members.address}: {e}")

    def _reader(self, s: socket.socket, dec: W.FrameDecoder, early, gen: int) -> None:
        err = "connection closed by the store"
        # a store group: a primary that stops answering (paused, cut off) while requests wait is
        # left (Members.silence), so the requests go to the group's new primary
        m = self.members
        stalled = False
        last_rx = time.monotonic()
        try:
            self._deliver(early)
            while True:
                if m.group:
                    ready, _w, _x = select.select([s], [], [], 0.25)
                    if not ready:
                        quiet = m.silence(last_rx, bool(self._pending))
                        if quiet is not None and quiet[0] == "leave":
                            err = m.stalled()
                            m.move(None)          # aimed first: the requests failed below go there
                            stalled = True
                            break
                        if quiet is not None:     # "probe": the other members, asked now
                            target, heard = m.probe(self.server_info.get("epoch"), token=self.token,
                                                    client_name=self.client_name)
                            why = m.probed(target, heard, quiet[1])
                            if why is not None:
                                err = why
                                m.move(target)    # aimed first: the requests failed below go there
                                stalled = True
                                break
                        continue
                data = s.recv(1 << 20)
                if not data:
                    break
                last_rx = time.monotonic()
                self._deliver(dec.feed(data))
        except (OSError, W.ProtocolError) as e:
            err = f"connection to the store lost: {e}"
        except ValueError:
            # select() on a socket another thread closed meanwhile (a failover's drop or close():
            # its fd is -1): the connection is gone, as for an OSError
            err = "connection closed"
        if self._conn_error:
            err = f"the store closed the connection: {self._conn_error}"
            self._conn_error = None
        if stalled:
            try:
                s.shutdown(socket.SHUT_RDWR)     # a send blocked on the silent member fails now
            except OSError:
                pass
        self._drop(s, err)

    def _deliver(self, frames) -> None:
        pop = self._pending.pop
        for op, flags, rid, body in frames:
            fut = pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result((op, flags, body))
            elif rid == 0 and op == W.OP_ERROR:
                # a connection-level error (e.g. too_large): the close that follows fails the
                # requests in flight with this reason
                code, msg = W.parse_error(body)
                self._conn_error = f"{W.ERROR_NAMES.get(code, code)}: {msg}"

    def _drop(self, s: socket.socket, reason: str) -> None:
        with self._lock:
            if self._sock is s:
                self._sock = None
            try:
                s.close()
            except OSError:
                pass
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(ConnectionLost(reason))

    # ---------------------------------------------------------------- requests
    def request(self, op: int, body: bytes = b"", flags: int = 0) -> Future:
        """Send one frame; the future resolves to `(opcode, flags, body)` (ERROR frames included)."""
        fut: Future = Future()
        with self._lock:
            s = self._ensure()
            limit = self.server_info.get("max_frame")
            if limit and len(body) + 6 > limit:     # refused here: the store would close the connection
                raise StoreClientError(W.E_TOO_LARGE, f"request of {len(body) + 6} bytes exceeds the store's "
                                       f"frame limit of {limit} bytes (split the batch)")
            rid = next(self._ids) & 0xFFFFFFFF or next(self._ids)
            self.members.sent(bool(self._pending))
            self._pending[rid] = fut
            try:
                s.sendall(W.frame(op, rid, body, flags))
            except OSError as e:
                self._pending.pop(rid, None)
                self._drop(s, f"send failed: {e}")
                raise ConnectionLost(f"connection to the store lost while sending: {e}") from e
        return fut

    def call(self, op: int, body: bytes = b"", *, retry: bool = False, timeout: float | None = None,
             flags: int = 0):
        """request() and wait; ERROR -> StoreClientError. `retry`: the request is idempotent, so a
        lost connection is retried (reconnecting with backoff) instead of raised."""
        tries = self.reconnect_attempts if retry else 1
        deadline = time.monotonic() + self.members.failover_timeout
        i = 0
        while True:
            try:
                fut = self.request(op, body, flags)
                return check_reply(fut.result(self.timeout if timeout is None else timeout))
            except StoreClientError as e:
                # a group member that is not the primary did nothing: always safe to send again
                if not is_not_primary(e) or time.monotonic() >= deadline:
                    raise
                self.not_primary(e)
                time.sleep(min(self.backoff_initial * (2 ** min(i, 6)), GROUP_RETRY_S))
            except ConnectionLost:
                multi = self.members.group
                if (not multi and i + 1 >= tries) or (multi and (not retry or time.monotonic() >= deadline)):
                    raise
                time.sleep(min(self.backoff_initial * (2 ** min(i, 6)), self.backoff_max if not multi else GROUP_RETRY_S))
            i += 1

    def execute(self, command: Command):
        """Send one command of the command layer (commands.py) and read its reply: its typed value.
        ERROR -> StoreClientError; a lost connection is retried when the command may be repeated."""
        op, body, flags = command.encode()
        rop, rflags, rbody = self.call(op, body, retry=command.retry, flags=flags)
        return command.decode(rop, rflags, rbody, self.ident)

    def cmd(self, name: str, **args):
        """A CALL command by name; returns the JSON result (dict) or, for message replies, the
        MESSAGES body (header, entries)."""
        return self.execute(AnyCall(name, args))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            s = self._sock
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._drop(s, "connection closed by the application")

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- command API factories
    def producer(self, producer_id: str | None = None, **kw):
        return Producer(self, producer_id, **kw)

    def auto_batch_producer(self, producer_id: str | None = None, **kw):
        return AutoBatchProducer(self, producer_id, **kw)

    def pull(self, topic: str, queue_id: int = 0, offset: int = 0, max_count: int = 256, max_bytes: int = 4 << 20):
        return pull(self, topic, queue_id, offset, max_count, max_bytes)

    def pull_request(self, topic: str, queue_id: int = 0, offset: int = 0, max_count: int = 256,
                     max_bytes: int = 4 << 20):
        """Send a pull now, read it later: -> PendingPull, whose `result()` is the PullResult.
        Keeps the next pull in flight while the current records are processed."""
        return PendingPull(self, topic, queue_id, offset, max_count, max_bytes)

    def consumer(self, topic: str, group: str, queue_id: int = 0, **kw):
        return PullConsumer(self, topic, group, queue_id, **kw)

    def filter_consumer(self, topic_filter: str, group: str | None = None, **kw):
        return FilterConsumer(self, topic_filter, group, **kw)

    def pop_consumer(self, topic: str, group: str, queue_id: int = 0, **kw):
        return PopConsumer(self, topic, group, queue_id, **kw)

    def admin(self):
        return Admin(self)


def connect(address: str = f"127.0.0.1:{W.DEFAULT_PORT}", **kw) -> Connection:
    """Open a sync connection (handshake done now, so a bad address/token fails here)."""
    c = Connection(address, **kw)
    c._ensure()
    return c

