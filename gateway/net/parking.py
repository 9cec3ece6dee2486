"""Parking idle connections (docs/gateway.md "Idle connections").

An idle connected client costs the broker its event-loop transport (uvloop's TCPTransport, its
libuv handle and buffers, the loop's fd -> transport map: ~1.2 KiB) and its packet decoder, for
nothing: it sends a PINGREQ now and then. After `park_idle_after_s` (GatewayConfig) with no packet
in or out and nothing in flight or queued (FRESH_IDLE_S, 0.05 s, for a client silent since its
handshake: `Parking`), `MQTTConnection.park` takes its socket out of the loop:
it keeps a dup of the fd (closing the transport then does not end the TCP connection), drops the
transport and the decoder, and hands the fd to a `Parker`, which watches every parked socket with
one epoll of its own (the loop watches that epoll's fd: one reader for all of them). The Parker
answers PINGREQ itself and notes the time of every byte (the keep-alive wheel asks it, so a
silent parked client still times out at 1.5 x keep alive and its will fires); anything else it
reads, EOF or an error hand the socket back (`MQTTConnection.unpark`): a new transport over the
same fd (`loop.connect_accepted_socket`), the bytes already read fed first. A connection with
something to send (a delivery, a DISCONNECT of a takeover or shutdown) is woken by its `write`.
The MQTTConnection object itself stays (it is what the session, the registries and the metrics
know): a parked connection is connected for everyone.

`Parker` is the C module `lmqtt.gateway.net._park` (gateway/net/_park.c) when built, else
`PyParker` below: same interface, same behaviour (tests/net/test_park_parker.py compares them).
"""
from __future__ import annotations

import asyncio
import logging
import operator
import os
import select
import time
from typing import TYPE_CHECKING, Any

from lmqtt.gateway.mqtt import PINGREQ_HEAD, PINGRESP_BYTES
from lmqtt.store import accel

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.net.connection import MQTTConnection

log = logging.getLogger("lmqtt.gateway.conn")

READ_BUF = 4096
MAX_READS = 16        # reads of one socket per poll: a PINGREQ flood waits for the next poll
PONG = PINGRESP_BYTES


class PyParker:
    """The pure-Python reference of `_park.Parker` (interface in gateway/net/_park.c's header)."""

    def __init__(self) -> None:
        self._ep: select.epoll | None = select.epoll()
        self._slots: dict[int, list] = {}     # fd -> [owner, last byte time, pending 0xC0]
        self.pings = 0

    def fileno(self) -> int:
        if self._ep is None:
            raise ValueError("parker is closed")
        return self._ep.fileno()

    def __len__(self) -> int:
        return len(self._slots)

    def add(self, fd: int, owner: Any) -> None:
        fd = operator.index(fd)          # as the C Parker: an fd is an int, never a float
        if self._ep is None:
            raise ValueError("parker is closed")
        if fd < 0:
            raise ValueError(f"bad fd {fd}")
        if fd in self._slots:
            raise ValueError(f"fd {fd} is already parked")
        self._ep.register(fd, select.EPOLLIN)
        self._slots[fd] = [owner, time.monotonic(), False]

    def _unwatch(self, fd: int) -> list:
        slot = self._slots.pop(fd)
        try:
            self._ep.unregister(fd)
        except (OSError, ValueError, AttributeError):
            pass
        return slot

    def remove(self, fd: int):
        fd = operator.index(fd)
        if fd not in self._slots:
            return None
        owner, _, pending = self._unwatch(fd)
        return owner, (PINGREQ_HEAD if pending else b"")

    def idle(self, fd: int) -> float:
        slot = self._slots.get(operator.index(fd))
        if slot is None:
            raise KeyError(f"fd {fd} is not parked")
        return time.monotonic() - slot[1]

    def _serve(self, fd: int, slot: list):
        """None: stays parked; (rest, eof): hand back."""
        for _ in range(MAX_READS):
            head = PINGREQ_HEAD if slot[2] else b""
            try:
                data = os.read(fd, READ_BUF - len(head))
            except (BlockingIOError, InterruptedError):
                return None
            except OSError:
                return head, True
            if not data:
                return head, True
            slot[1] = time.monotonic()
            buf = head + data
            i, n = 0, len(buf)
            while i + 1 < n and buf[i] == 0xC0 and buf[i + 1] == 0:
                i += 2
            pongs = i // 2
            if pongs:
                try:
                    w = os.write(fd, PONG * pongs)
                except OSError:
                    w = -1
                if w != 2 * pongs:
                    return buf[i:], True
                self.pings += pongs
            slot[2] = False
            if n - i == 1 and buf[i] == 0xC0:
                slot[2] = True
                continue
            if n > i:
                return buf[i:], False
        return None

    def poll(self, max_events: int = 256) -> list:
        if self._ep is None:
            return []
        max_events = min(max(max_events, 1), 1024)
        out = []
        for fd, _ in self._ep.poll(0, max_events):
            slot = self._slots.get(fd)
            if slot is None:
                continue
            r = self._serve(fd, slot)
            if r is None:
                continue
            self._unwatch(fd)
            out.append((slot[0], fd, r[0], r[1]))
        return out

    def close(self) -> None:
        self._slots.clear()
        if self._ep is not None:
            self._ep.close()
            self._ep = None


def py_trim() -> bool:
    """malloc_trim(0) through ctypes (glibc), the reference of `_park.trim`; False where there is none."""
    global _libc_trim
    if _libc_trim is None:
        try:
            import ctypes
            _libc_trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _libc_trim = False
    return bool(_libc_trim(0)) if _libc_trim else False


_libc_trim = None
_park = accel.load("lmqtt.gateway.net._park")
Parker = _park.Parker if _park is not None else PyParker
trim = _park.trim if _park is not None else py_trim
TRIM_AFTER = 64      # parks in one check after which the freed heap pages are given back (`trim`)
# A client silent since its handshake (CONNECT, SUBSCRIBE, then nothing: most devices) is parked
# after FRESH_IDLE_S, not `after_s`: a burst of thousands connecting at once then never has all its
# transports alive together (each ~1.2 KiB, whose freed blocks the allocators keep resident: issue
# 29), the later arrivals reuse the memory the first ones gave up. Checked every FRESH_IDLE_S while
# a connection is that young; one still talking FRESH_FOR_S after its socket was accepted keeps the
# `after_s` regime (a client that talks every few seconds is not parked and woken at every packet).
# 0.05 s, not 0.1: fewer transports of a fast burst alive at once, 0.89-0.92 KiB per
# idle connection in `lmqtt bench compare --scenarios conn` vs 0.91-1.03 (BENCHMARKS.md); a young
# connection is checked once or twice before it is parked either way, so the CPU is the same.
FRESH_IDLE_S = 0.05
FRESH_FOR_S = 1.0
HANDSHAKE_TAIL = (8, 10)     # the packet types that keep a woken young client young: SUBSCRIBE, UNSUBSCRIBE


class Parking:
    """The parked connections of one broker: the Parker, its reader on the loop, and the checks
    that park idle connections: the young ones (`fresh`, connected less than FRESH_FOR_S ago)
    silent for FRESH_IDLE_S, checked every as long while there are any; the others (`candidates`,
    added from `fresh` and at each unpark) idle for `after_s`, checked every `after_s`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, after_s: float) -> None:
        self.loop = loop
        self.after_s = after_s
        self.parker = Parker()
        self.candidates: set["MQTTConnection"] = set()
        # young connections (`watch`), when after_s is longer than FRESH_IDLE_S
        self.fresh: set["MQTTConnection"] | None = set() if after_s > FRESH_IDLE_S else None
        self.parked_total = 0         # parks so far (tests, metrics)
        self.unparked_total = 0
        self.fresh_parked = 0         # of which by the young connections' check (tests)
        self._untrimmed = 0           # parks by that check since its last `trim`
        self._fd = self.parker.fileno()
        loop.add_reader(self._fd, self._ready)
        self._handle: asyncio.TimerHandle | None = loop.call_later(after_s, self._check)
        self._fresh_handle: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self.parker)

    def watch(self, c: "MQTTConnection") -> None:
        """`c`'s CONNECT was accepted: park it once idle."""
        fresh = self.fresh
        if fresh is None:
            self.candidates.add(c)
            return
        fresh.add(c)
        if self._fresh_handle is None and self._fd is not None:
            self._fresh_handle = self.loop.call_later(FRESH_IDLE_S, self._check_fresh)

    def rewatch(self, c: "MQTTConnection", woken_by: bytes = b"") -> None:
        """`c` is back on the loop (`unpark`: `woken_by` the bytes it sent; a `wake` to send to it:
        none). A young one woken by a SUBSCRIBE or an UNSUBSCRIBE is still in its handshake (parked
        between its CONNACK and its SUBSCRIBE by a round trip longer than FRESH_IDLE_S): young
        again. The others, a client that publishes or one the broker delivers to, wait `after_s`.
        Why: made young again too, a device publishing every 0.4 s was parked and woken (a
        transport rebuilt) at every packet of its first second; 2,000 such devices starting at
        once raised the p99 of a 5,000 msg/s run by a third (BENCHMARKS.md)."""
        if (self.fresh is not None and woken_by and woken_by[0] >> 4 in HANDSHAKE_TAIL
                and self.loop.time() - c.accepted_at < FRESH_FOR_S):
            self.watch(c)
        else:
            self.candidates.add(c)

    def forget(self, c: "MQTTConnection") -> None:
        """`c` is closed."""
        self.candidates.discard(c)
        if self.fresh is not None:
            self.fresh.discard(c)

    def _check_fresh(self) -> None:
        self._fresh_handle = None
        fresh = self.fresh
        try:
            now = self.loop.time()
            parked0 = self.parked_total
            young = now - FRESH_FOR_S
            for c in list(fresh):
                if c.closing:
                    fresh.discard(c)
                elif c.park_if_idle(now, FRESH_IDLE_S):
                    fresh.discard(c)
                elif c.accepted_at < young:      # still talking: the `after_s` regime
                    fresh.discard(c)
                    self.candidates.add(c)
            n = self.parked_total - parked0
            self.fresh_parked += n
            self._untrimmed += n
            # after a wave of parks, and once the young ones are all parked (a burst's last wave)
            if self._untrimmed >= TRIM_AFTER or (self._untrimmed and not fresh):
                self._untrimmed = 0
                trim()
        except Exception:   # never stop the checks for one connection's bug
            log.exception("event=park_check_failed")
        finally:
            if fresh and self._fd is not None:
                self._fresh_handle = self.loop.call_later(FRESH_IDLE_S, self._check_fresh)
            elif not fresh:
                self.fresh = set()    # a set keeps its table: a burst's young ones left ~50 B each

    def _check(self) -> None:
        self._handle = None
        try:
            now = self.loop.time()
            cands = self.candidates
            n = len(cands)
            parked0 = self.parked_total
            for c in list(cands):
                if c.closing:
                    cands.discard(c)
                elif c.park_if_idle(now, self.after_s):
                    cands.discard(c)
            if len(cands) < n // 2:
                self.candidates = set(cands)     # a set keeps its table: 10,000 parked at once left ~50 B each
            if self.parked_total - parked0 >= TRIM_AFTER:
                trim()       # the transports just dropped: their pages back to the system (RSS)
        except Exception:   # never stop the checks for one connection's bug
            log.exception("event=park_check_failed")
        finally:
            if self._fd is not None:
                self._handle = self.loop.call_later(self.after_s, self._check)

    def _ready(self) -> None:
        for owner, fd, data, eof in self.parker.poll():
            try:
                owner.unpark(fd, data, eof)
            except Exception:
                log.exception("event=unpark_failed client_id=%s", getattr(owner, "client_id", None))

    def close(self) -> None:
        """Stop watching (the broker's shutdown closed its connections first, parked ones included)."""
        for h in (self._handle, self._fresh_handle):
            if h is not None:
                h.cancel()
        self._handle = self._fresh_handle = None
        if self._fd is not None:
            try:
                self.loop.remove_reader(self._fd)
            except Exception:
                pass
            self._fd = None
        self.parker.close()
