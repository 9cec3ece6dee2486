"""The connections' deadlines: connect timeout, a stalled enhanced authentication or
re-authentication, keep alive (`ConnectionSweep`, one per broker).

Separate from gateway/net/connection.py because it is the broker's clock over all connections,
not one connection's packet handling: twice a second it checks the few connections still logging
in and the keep-alive slots that have come (a wheel of one-second slots), never every connection.
A connection registers itself here (`MQTTConnection.keepalive`/`auth_login` setters,
`connection_made`, `connection_lost`); the sweep also starts the parking of idle connections
(`watch_idle`, gateway/net/parking.py).
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Callable

from lmqtt.gateway.mqtt import ReasonCode

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.net.connection import MQTTConnection


class ConnectionSweep:
    """The deadlines of every connection, checked every `INTERVAL` seconds: a socket whose CONNECT
    is not accepted within `connect_timeout_s` is closed (an enhanced authentication still in
    progress is refused first, through `login_timed_out(conn)`); a re-authentication not done
    within it ends the same way; a connection silent for 1.5 times its keep alive gets DISCONNECT
    0x8D (MQTT-3.1.2-24).

    Why no timer per connection: a timer re-armed at every packet costs a heap operation per
    packet on the hot path and memory per idle connection. Why not one pass over every connection
    either: at 10^5-10^6 idle connections a pass twice a second is the broker's whole CPU (40,000
    connections over two gateways: 17 % of a core). So: the sockets not yet connected and the
    logins in progress (few) are looked at every tick (`pending`, `logins`); keep-alive deadlines
    sit in a wheel of one-second slots (`arm`), each connection in the slot of the moment it
    would time out if silent from its last packet on. When a slot comes, each connection in it
    either timed out or is put back in the slot its last packet now gives: a packet costs nothing
    here, and an idle connection is looked at once per 1.5 keep alives. Half a second to a second
    late is within what MQTT allows for a keep alive."""

    INTERVAL = 0.5

    def __init__(self, loop: asyncio.AbstractEventLoop, connections: "set[MQTTConnection]",
                 connect_timeout_s: float, login_timed_out: "Callable[[MQTTConnection], None]") -> None:
        self.loop = loop
        self.connections = connections     # every connection (`sweep`, the full pass)
        self.connect_timeout_s = connect_timeout_s
        self.login_timed_out = login_timed_out
        self.pending: set[MQTTConnection] = set()   # CONNECT not accepted yet
        self.logins: set[MQTTConnection] = set()    # an (re-)authentication in progress
        self.wheel: dict[int, dict[MQTTConnection, None]] = {}   # second -> connections due then
        self._done = int(loop.time())      # every slot up to this second has been handled
        self.checked = 0                   # keep-alive deadlines looked at by the ticks (tests, metrics)
        self._handle: asyncio.TimerHandle | None = None
        self._running = False              # between start() and stop()
        self.parking = None                # parking.Parking once a connection may be parked (`watch_idle`)
        self._park_after: float | None = None

    def watch_idle(self, c: "MQTTConnection") -> None:
        """`c`'s CONNECT was accepted: park it once idle (`park_idle_after_s`; 0 = never)."""
        p = self.parking
        if p is None:
            after = self._park_after
            if after is None:
                after = self._park_after = float(getattr(c.cfg, "park_idle_after_s", 2.0) or 0.0)
            if after <= 0:
                return
            from lmqtt.gateway.net.parking import Parking
            p = self.parking = Parking(self.loop, after)
            gauge = getattr(c.metrics, "connections_parked", None)
            if gauge is not None:
                gauge.set_function(lambda parker=p.parker: len(parker))
        p.watch(c)

    def start(self) -> None:
        self._done = int(self.loop.time())
        self._running = True
        self._tick()

    def resume(self) -> None:
        """Something to watch again after the ticks stopped for want of it (`_tick`)."""
        if self._handle is None and self._running:
            self._handle = self.loop.call_later(self.INTERVAL, self._tick)

    def stop(self) -> None:
        self._running = False
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self.parking is not None:
            self.parking.close()
            self.parking = None

    def armed(self) -> int:
        """Connections with a keep-alive deadline in the wheel (slots emptied by closes stay until they come)."""
        return sum(len(d) for d in self.wheel.values())

    # -- registration (by MQTTConnection) -----------------------------------------------------
    def arm(self, c: "MQTTConnection") -> None:
        """Put `c` in the slot of its keep-alive deadline (from its last packet); none for keep alive 0."""
        self.disarm(c)
        ka = c._keepalive
        if ka and not c.closing:
            slot = max(int(c.last_rx + 1.5 * ka) + 1, self._done + 1)
            d = self.wheel.get(slot)
            if d is None:
                d = self.wheel[slot] = {}
            d[c] = None
            c._ka_slot = d        # the slot's table itself (shared), not its number (an int per connection)
            if self._handle is None:
                self.resume()

    def disarm(self, c: "MQTTConnection") -> None:
        d = c._ka_slot
        if d is not None:
            c._ka_slot = None
            d.pop(c, None)        # an emptied slot stays in the wheel until it comes

    def forget(self, c: "MQTTConnection") -> None:
        """`c` is closed: out of every table (a closed connection must not be kept alive here)."""
        self.disarm(c)
        self.pending.discard(c)
        self.logins.discard(c)
        if self.parking is not None:
            self.parking.forget(c)

    # -- the periodic check ---------------------------------------------------------------------
    def _tick(self) -> None:
        try:
            self.tick()
        finally:
            # nothing to watch (no client): no tick until a connection comes (`resume`), so an
            # idle broker does not wake twice a second for an empty wheel
            if self.pending or self.logins or self.wheel:
                self._handle = self.loop.call_later(self.INTERVAL, self._tick)
            else:
                self._handle = None

    def tick(self, now: float | None = None) -> None:
        """What is due at `now` (the loop's time): logins and connects past their deadline, and
        the keep-alive slots that have come."""
        now = self.loop.time() if now is None else now
        limit = self.connect_timeout_s
        if self.pending:
            for c in list(self.pending):
                if not (c.closing or c.connected):
                    self._check(c, now, limit)
                if c.closing or c.connected:
                    self.pending.discard(c)
        if self.logins:
            for c in list(self.logins):
                if c.closing or c._auth_login is None:
                    self.logins.discard(c)
                elif c.connected:
                    self._check(c, now, limit)
        wheel = self.wheel
        until = int(now)
        if wheel:
            while self._done < until:
                self._done += 1
                due = wheel.pop(self._done, None)
                if due is None:
                    continue
                self.checked += len(due)
                for c in due:
                    c._ka_slot = None
                    if c.closing:
                        continue
                    if c._park.__class__ is int:
                        c.parked_rx(now)     # the parker read its PINGREQs: when was its last byte
                    if now - c.last_rx > 1.5 * c._keepalive:
                        c.close_with_error(ReasonCode.KEEP_ALIVE_TIMEOUT, "keep alive timeout")
                    else:
                        self.arm(c)
        self._done = max(self._done, until)

    def _check(self, c: "MQTTConnection", now: float, limit: float) -> None:
        login = c._auth_login
        if not c.connected:
            if now - c.accepted_at > limit:
                if login is not None and not c.closing:
                    self.login_timed_out(c)
                c.close()
        elif login is not None and now - login.started_at > limit:
            self.login_timed_out(c)
        elif c._keepalive:
            if c._park.__class__ is int:
                c.parked_rx(now)
            if now - c.last_rx > 1.5 * c._keepalive:
                c.close_with_error(ReasonCode.KEEP_ALIVE_TIMEOUT, "keep alive timeout")

    def sweep(self) -> None:
        """Every connection's deadlines checked now (one full pass): what the ticks do by their
        tables, for a caller that moved clocks by hand (tests) or wants it at once."""
        now = self.loop.time()
        limit = self.connect_timeout_s
        for c in list(self.connections):
            self._check(c, now, limit)
