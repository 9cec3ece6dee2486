"""A lean connection generator: many idle MQTT connections from raw non-blocking sockets.

Why not the asyncio client (mqtt_client.py): a Protocol, a transport and a Future per socket cost
the generator more than the broker it measures and open ~5,000 sockets/s; here a socket is an int
in a list and one epoll in the process drives the handshakes: CONNECT and SUBSCRIBE are written
together as soon as the socket is connected, CONNACK + SUBACK read back (both fixed sizes), and the
socket then stays idle, unregistered, until `close_all`.

Source addresses: with `src_ips` each socket binds 127.0.0.x (IP_BIND_ADDRESS_NO_PORT: the port is
chosen at connect, per 4-tuple) so one generator gets past the ~28,000 ephemeral ports of one
source address. With `src_of` each socket binds the address and port given for it instead: the
kernel's own choice searches the port range at every connect, and with 10^5 connections to one
listener held that search (`__inet_hash_connect`, `__inet_check_established`) was half of the
machine's CPU - a generator measuring itself (the million scenario gives each connection a port
of its own below the ephemeral range). File descriptors: the soft limit is raised to the hard limit of the process (never
beyond: that needs CAP_SYS_RESOURCE, the system's business); `capacity()` says how many sockets
one process can hold.

Used by `lmqtt bench million` (loadtest/million_bench.py) in several processes and by the memory
profile of idle connections (loadtest/conn_profile.py).
"""
from __future__ import annotations

import errno
import select
import socket
import time

from lmqtt.gateway.mqtt import encode, packets as P

from .brokers import raise_nofile

IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)
RESERVED_FDS = 64          # kept free in every process: pipes, logs, the interpreter's own


def capacity() -> int:
    """How many sockets one process can hold after `raise_nofile`."""
    return max(0, raise_nofile() - RESERVED_FDS)


def handshake_bytes(client_id: str, topic: str | None, version: int = 4, keepalive: int = 600) -> bytes:
    """CONNECT (clean) and, with a topic, SUBSCRIBE QoS 0 to it (packet id 1), one write."""
    out = encode(P.Connect(client_id, version, True, keepalive), version)
    if topic is not None:
        out += encode(P.Subscribe(1, [P.SubscriptionRequest(topic, 0)]), version)
    return out


def reply_size(version: int, subscribe: bool) -> int:
    """Bytes of CONNACK (+ SUBACK) without properties: 4 (+ 5); MQTT 5: 5 (+ 6)."""
    return (5 + 6 * subscribe) if version == 5 else (4 + 5 * subscribe)


def _bind_given(s: socket.socket, src: tuple[str, int]) -> None:
    """Bind `s` to the source address and port given. SO_REUSEADDR: a port of the run before in
    TIME_WAIT may be taken again (loopback reuses such 4-tuples: tcp_tw_reuse); a port someone
    else holds (a server's, bound to every address) falls back to the kernel's choice."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(src)
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        s.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        s.bind((src[0], 0))


class Holder:
    """Open `count` MQTT connections to host:port and hold them idle.

    `client_id(i)` and `topic(i)` name connection i (topic None: no SUBSCRIBE). At most `window`
    handshakes are in progress at once (a SYN flood of 10^5 makes the listener drop SYNs, and a
    dropped SYN costs a 1 s retransmit). `open_all` stops at `deadline` (time.monotonic())."""

    def __init__(self, host: str, port: int, count: int, client_id, topic, *, version: int = 4,
                 src_ips: list[str] | None = None, window: int = 256, keepalive: int = 600,
                 ports: tuple = (), src_of=None) -> None:
        self.host, self.port, self.count = host, port, count
        self.ports = ports or (port,)      # connection i goes to ports[i % len(ports)] (a fleet's gateways)
        self.client_id, self.topic, self.version = client_id, topic, version
        self.src_ips = src_ips or []
        self.src_of = src_of              # i -> (source address, source port) of connection i, or None
        self.window = window
        self.keepalive = keepalive
        self.held: list[socket.socket] = []
        self.failed = 0
        self.errors: list[str] = []
        self.t_start = self.t_done = 0.0
        self.reply = reply_size(version, topic is not None)

    def _error(self, what: str) -> None:
        self.failed += 1
        if len(self.errors) < 5:
            self.errors.append(what)

    def open_all(self, deadline: float) -> int:
        ep = select.epoll()
        pending: dict[int, list] = {}        # fd -> [socket, index, bytes to send, bytes read]
        nxt = 0
        n = self.count
        ips = self.src_ips
        src_of = self.src_of
        addrs = [(self.host, p) for p in self.ports]
        self.t_start = time.monotonic()
        try:
            while (nxt < n or pending) and time.monotonic() < deadline:
                while nxt < n and len(pending) < self.window:
                    i = nxt
                    nxt += 1
                    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    s.setblocking(False)
                    try:
                        if src_of is not None:
                            _bind_given(s, src_of(i))
                        elif ips:
                            s.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
                            s.bind((ips[i % len(ips)], 0))
                        rc = s.connect_ex(addrs[i % len(addrs)])
                    except OSError as e:
                        s.close()
                        self._error(f"connect {i}: {e}")
                        continue
                    if rc not in (0, errno.EINPROGRESS):
                        s.close()
                        self._error(f"connect {i}: {errno.errorcode.get(rc, rc)}")
                        continue
                    pending[s.fileno()] = [s, i, None, b""]
                    ep.register(s.fileno(), select.EPOLLOUT | select.EPOLLIN)
                for fd, ev in ep.poll(0.2):
                    st = pending.get(fd)
                    if st is None:
                        continue
                    s = st[0]
                    if ev & (select.EPOLLERR | select.EPOLLHUP) and not ev & select.EPOLLIN:
                        err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                        self._drop(ep, pending, fd, f"{st[1]}: {errno.errorcode.get(err, err) if err else 'hang-up'}")
                        continue
                    if st[2] is None and ev & select.EPOLLOUT:
                        hs = handshake_bytes(self.client_id(st[1]), self.topic(st[1]), self.version,
                                             self.keepalive)
                        try:
                            s.send(hs)          # ~60 bytes into an empty socket buffer: all of it
                        except OSError as e:
                            self._drop(ep, pending, fd, f"{st[1]}: send: {e}")
                            continue
                        st[2] = True
                        ep.modify(fd, select.EPOLLIN)
                    if ev & select.EPOLLIN:
                        try:
                            data = s.recv(64)
                        except BlockingIOError:
                            continue
                        except OSError as e:
                            self._drop(ep, pending, fd, f"{st[1]}: recv: {e}")
                            continue
                        if not data:
                            self._drop(ep, pending, fd, f"{st[1]}: closed by the broker")
                            continue
                        st[3] += data
                        got = st[3]
                        if got[:1] != b"\x20" or (len(got) >= 4 and got[3] != 0 and self.version == 4):
                            self._drop(ep, pending, fd, f"{st[1]}: refused: {got[:8].hex()}")
                            continue
                        if len(got) >= self.reply:
                            ep.unregister(fd)
                            del pending[fd]
                            self.held.append(s)
        finally:
            for st in pending.values():
                self._error(f"{st[1]}: not connected by the deadline")
                st[0].close()
            ep.close()
            self.t_done = time.monotonic()
        return len(self.held)

    def _drop(self, ep, pending: dict, fd: int, why: str) -> None:
        st = pending.pop(fd)
        ep.unregister(fd)
        st[0].close()
        self._error(why)

    def still_open(self) -> int:
        """How many held sockets the broker has not closed (nothing readable on them: an idle
        connection gets no bytes, a closed one reads EOF, one with an error reports it)."""
        ep = select.epoll()
        try:
            for s in self.held:
                ep.register(s.fileno(), select.EPOLLIN | select.EPOLLRDHUP)
            bad = ep.poll(0, maxevents=max(1, len(self.held)))
        finally:
            ep.close()
        return len(self.held) - len(bad)

    def close_all(self) -> None:
        for s in self.held:
            s.close()
        self.held = []
