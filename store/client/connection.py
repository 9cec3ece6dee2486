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
import json
import select
import socket
import threading
import time
from concurrent.futures import Future

from lmqtt.store import protocol as W

from .admin import Admin
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
from .failover import (
    EXPECT_PRIMARY_S,
    GROUP_RETRY_S,
    keeps_expected,
    next_member,
    parse_addresses,
    primary_named,
    probe_primary,
)
from .handshake import dial
from .producer import AutoBatchProducer, Producer

# the errors every connection class raises, importable from here too (errors.py)
__all__ = ["NOT_IDEMPOTENT", "Connection", "ConnectionLost", "DiskFull", "NotStores", "StoreClientError", "check_reply",
           "connect", "dial", "is_not_primary", "not_a_store", "parse_hello_ok"]


class Connection:
    def __init__(self, address: str = f"127.0.0.1:{W.DEFAULT_PORT}", *, token: str | None = None,
                 timeout: float = 30.0, connect_timeout: float = 5.0, reconnect_attempts: int = 6,
                 backoff_initial: float = 0.05, backoff_max: float = 2.0, client_name: str = "lmqtt-sdk",
                 failover_timeout: float = 30.0) -> None:
        self.addresses = parse_addresses(address)
        self.host, self.port = self.addresses[0]
        # a store group: how long requests keep looking for the primary (across reconnects)
        self.failover_timeout = failover_timeout
        self.failovers = 0          # times this connection moved to another member
        # a store group: seconds without any answer while requests wait before the member is left
        self.stall_timeout = 5.0
        # ... and after `probe_after` s of such silence, every `probe_interval` s, the other members
        # are asked who is primary (probe_primary): one that names a newer primary is followed at
        # once, without waiting for the stall timeout (a SIGSTOPped primary: docs/ha.md)
        self.probe_after = 1.0
        self.probe_interval = 0.5
        self.probe_timeout = 1.0
        self._waiting_since = 0.0
        self._stay = False          # the member dialled named itself primary (still taking over)
        self._expected = None       # (address, deadline): the primary a probe found (keeps_expected)
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
        multi = len(self.addresses) > 1
        # a group member answers HELLO at once; one that accepts and says nothing (stopped) is not
        # waited for the whole connect timeout while the others may have a primary
        s, info, early = dial(self.host, self.port, connect_timeout=min(self.connect_timeout, 2.0) if multi
                              else self.connect_timeout, client_name=self.client_name, token=self.token,
                              decoder=dec)
        role = info.get("role")
        if role is not None and role != "primary" and multi:
            # a store group member that is not the primary: go where it points, or try the next;
            # one that names itself is taking over (elected, not serving yet): dialled again
            s.close()
            self._stay = primary_named(f"primary={info.get('primary')}") == (self.host, self.port)
            self._move(info.get("primary"))
            raise ConnectionLost(f"store {self.host}:{self.port} is not the group's primary ({role}; "
                                 f"primary {info.get('primary') or 'unknown'})")
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
            delay = self.backoff_initial
            last = None
            multi = len(self.addresses) > 1
            deadline = time.monotonic() + self.failover_timeout
            attempt = 0
            not_stores = NotStores(self.addresses)
            while True:
                host = (self.host, self.port)
                try:
                    self._connect_once()
                    return self._sock
                except StoreClientError as e:
                    if not multi:
                        raise              # refused (auth, version) or a malformed answer: retrying won't help
                    not_stores.note(host, e)    # another server's port: the next member (else raised)
                    last = e
                except OSError as e:
                    last = e
                attempt += 1
                if multi:
                    if (self.host, self.port) == host and not self._stay:
                        self._move(None)   # unreachable: the next member
                    self._stay = False
                    if time.monotonic() >= deadline:
                        raise ConnectionLost(f"no primary found among {self._members()} within "
                                             f"{self.failover_timeout:g} s (last: {last}){not_stores.suffix()}")
                    time.sleep(min(delay, GROUP_RETRY_S))
                    delay = min(delay * 2, self.backoff_max)
                    continue
                if attempt >= self.reconnect_attempts:
                    break
                time.sleep(delay)
                delay = min(delay * 2, self.backoff_max)
            # `last` is dial's ConnectionLost, which names the store already
            raise ConnectionLost(f"{last} (gave up after {max(1, self.reconnect_attempts)} attempts)")

    def _members(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.addresses)

    def _move(self, primary) -> None:
        """Point the next connect at `primary` ("host:port" or (host, port), when a member named it)
        or else at the next address of the group."""
        with self._lock:
            if keeps_expected(self._expected, (self.host, self.port), primary):
                self._stay = True
                return
            target = next_member(self.addresses, (self.host, self.port), primary)
            if target != (self.host, self.port):
                self.failovers += 1
            self.host, self.port = target

    def not_primary(self, e: BaseException) -> None:
        """After a not_primary refusal: drop this connection and aim at the primary it names."""
        with self._lock:
            s = self._sock
            self._move(primary_named(getattr(e, "reason", str(e))))
        if s is not None:
            self._drop(s, f"store {self.host}:{self.port}: {e}")

    def _reader(self, s: socket.socket, dec: W.FrameDecoder, early, gen: int) -> None:
        err = "connection closed by the store"
        # a store group: a primary that stops answering (paused, cut off) while requests wait is
        # left after `stall_timeout` s of silence, so the requests go to the group's new primary
        group = len(self.addresses) > 1
        stalled = False
        moved_to = None
        last_rx = time.monotonic()
        next_probe = 0.0
        group_heard = 0.0           # when a probe last heard members that know no newer primary
        try:
            self._deliver(early)
            while True:
                if group:
                    ready, _w, _x = select.select([s], [], [], 0.25)
                    if not ready:
                        waiting = self._waiting_since
                        now = time.monotonic()
                        silent = now - max(last_rx, waiting) if self._pending and waiting else 0.0
                        # while the other members still take this one for the primary (a probe
                        # heard them lately), leaving it would only lead back to it - and to a
                        # HELLO it does not answer: the stall waits, up to twice its timeout
                        held = now - group_heard < 1.5 and silent <= 2 * self.stall_timeout
                        if silent > self.stall_timeout and not held:
                            err = (f"no answer from the store at {self.host}:{self.port} for "
                                   f"{self.stall_timeout:g} s (a stopped or cut-off group member?)")
                            stalled = True
                            break
                        if silent > self.probe_after and now >= next_probe:
                            next_probe = now + self.probe_interval
                            heard: list = []
                            moved_to = probe_primary(self.addresses, (self.host, self.port),
                                                     self.server_info.get("epoch"), token=self.token,
                                                     timeout=self.probe_timeout, client_name=self.client_name,
                                                     heard=heard)
                            if heard and moved_to is None:
                                group_heard = time.monotonic()
                            if moved_to is not None:
                                err = (f"no answer from the store at {self.host}:{self.port} for {silent:.1f} s, "
                                       f"and the group's primary is now {moved_to[0]}:{moved_to[1]}")
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
            # aimed first, so the requests failed below are re-sent to the new primary
            if moved_to is not None:
                self._expected = (moved_to, time.monotonic() + EXPECT_PRIMARY_S)
            self._move(moved_to)
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
            if not self._pending:
                self._waiting_since = time.monotonic()
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
        deadline = time.monotonic() + self.failover_timeout
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
                multi = len(self.addresses) > 1
                if (not multi and i + 1 >= tries) or (multi and (not retry or time.monotonic() >= deadline)):
                    raise
                time.sleep(min(self.backoff_initial * (2 ** min(i, 6)), self.backoff_max if not multi else GROUP_RETRY_S))
            i += 1

    def cmd(self, name: str, **args):
        """A CALL command; returns the JSON result (dict) or, for message replies, the MESSAGES body."""
        args["cmd"] = name
        op, _f, body = self.call(W.OP_CALL, json.dumps(args).encode(), retry=name not in NOT_IDEMPOTENT)
        if op == W.OP_RESULT:
            return json.loads(body)
        return W.decode_messages(body)

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

