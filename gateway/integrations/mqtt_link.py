"""One MQTT client connection for a bridge, over asyncio streams and the gateway's own sans-IO codec
(gateway/mqtt: client-side Decoder, `encode`): MQTT 3.1.1 or 5.0, QoS 0/1/2 both ways.

Why not paho or amqtt: they are test and benchmark dependencies, not the product's, and the codec
that the broker trusts is the one that speaks to the other broker. What it does:

* `connect()`: TCP (or a given socket; TLS with an `ssl.SSLContext`), CONNECT, CONNACK (refused:
  `LinkError` with the reason code);
* `subscribe()`: SUBSCRIBE and its SUBACK codes;
* `publish()`: a PUBLISH with a packet id chosen here or given (a re-send keeps its id, DUP set);
  the returned future is done with the reason code when the broker acknowledged it (PUBACK, or
  PUBCOMP after PUBREC/PUBREL), at once for QoS 0;
* received PUBLISHes go to `on_publish(pkt)`, in order; it returns None (acknowledge now) or a
  future, and the acknowledgement (PUBACK, PUBREC) is sent once it is done: a bridge acknowledges
  a message only when the other side has it;
* keep alive: PINGREQ every `keepalive` / 2 s of silence; no answer within `keepalive`: closed;
* `closed`: a future done (with the reason) when the connection ends; every acknowledgement
  awaited then fails with `LinkError`.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from lmqtt.gateway.mqtt import Decoder, ProtocolError, encode, encode_publish
from lmqtt.gateway.mqtt import packets as P

log = logging.getLogger("lmqtt.gateway.bridge")


class LinkError(Exception):
    """The connection was refused, or ended while an answer was awaited (with the reason)."""


class MqttLink:
    def __init__(self, name: str, version: int = 5, keepalive: int = 60) -> None:
        self.name = name
        self.version = version
        self.keepalive = keepalive
        self.on_publish: Callable[[P.Publish], Any] = lambda _p: None
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.closed: asyncio.Future = asyncio.get_running_loop().create_future()
        self._next = 0
        self._acks: dict[int, tuple[asyncio.Future, int]] = {}     # pid -> (future, qos) of our publishes
        self._subacks: dict[int, asyncio.Future] = {}
        self._inbound_qos2: set[int] = set()                        # PUBREC sent, PUBREL awaited
        self._task: asyncio.Task | None = None
        self._ping: asyncio.Task | None = None
        self._last_rx = 0.0
        self.connack: P.ConnAck | None = None

    # ------------------------------------------------------------------------------ connection
    async def connect(self, pkt: P.Connect, *, host: str | None = None, port: int | None = None,
                      sock: Any = None, ssl: Any = None, server_hostname: str | None = None,
                      timeout: float = 10.0) -> P.ConnAck:
        loop = asyncio.get_running_loop()
        if sock is not None:
            self.reader, self.writer = await asyncio.open_connection(sock=sock)
        else:
            self.reader, self.writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=ssl, server_hostname=server_hostname if ssl else None),
                timeout)
        dec = Decoder(self.version, server_side=False)
        self.writer.write(encode(pkt, self.version))
        ack = None
        deadline = loop.time() + timeout
        pending: list = []
        while ack is None:
            left = deadline - loop.time()
            if left <= 0:
                self._abort()
                raise LinkError(f"no CONNACK within {timeout:g} s")
            data = await asyncio.wait_for(self.reader.read(65536), left)
            if not data:
                self._abort()
                raise LinkError("closed before CONNACK")
            for p in dec.feed(data):
                if ack is None and isinstance(p, P.ConnAck):
                    ack = p
                else:
                    pending.append(p)
        if ack.reason_code != 0:
            self._abort()
            raise LinkError(f"CONNECT refused with reason code 0x{ack.reason_code:02X}"
                            + (f" ({ack.properties.reason_string})" if ack.properties.reason_string else ""))
        self.connack = ack
        self._last_rx = loop.time()
        self._task = loop.create_task(self._read(dec, pending))
        if self.keepalive:
            self._ping = loop.create_task(self._pinger())
        return ack

    def _abort(self) -> None:
        if self.writer is not None:
            self.writer.transport.abort()

    def close(self, reason: str = "closed") -> None:
        """Send DISCONNECT (if connected) and close; `closed` is then done."""
        if self.writer is not None and not self.writer.is_closing():
            try:
                self.writer.write(encode(P.Disconnect(0), self.version))
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            self.writer.close()
        self._finish(reason)

    def _finish(self, reason: str) -> None:
        if self.closed.done():
            return
        self.closed.set_result(reason)
        err = LinkError(f"{self.name}: connection ended ({reason})")
        for fut, _q in self._acks.values():
            if not fut.done():
                fut.set_exception(err)
                fut.exception()
        self._acks.clear()
        for fut in self._subacks.values():
            if not fut.done():
                fut.set_exception(err)
                fut.exception()
        self._subacks.clear()
        for t in (self._ping, self._task):
            if t is not None and t is not asyncio.current_task():
                t.cancel()
        if self.writer is not None and not self.writer.is_closing():
            self.writer.transport.abort()

    @property
    def connected(self) -> bool:
        return self.connack is not None and not self.closed.done()

    # ------------------------------------------------------------------------------ sending
    def _pid(self) -> int:
        for _ in range(65535):
            self._next = self._next % 65535 + 1
            if self._next not in self._acks and self._next not in self._subacks:
                return self._next
        raise LinkError("no packet id free (65535 in flight)")

    def _send(self, data: bytes) -> None:
        if self.writer is None or self.closed.done():
            raise LinkError(f"{self.name}: not connected")
        self.writer.write(data)

    async def subscribe(self, reqs: list[P.SubscriptionRequest], timeout: float = 10.0) -> list[int]:
        pid = self._pid()
        fut = asyncio.get_running_loop().create_future()
        self._subacks[pid] = fut
        self._send(encode(P.Subscribe(pid, reqs), self.version))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._subacks.pop(pid, None)

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False,
                props: P.Properties | None = None, packet_id: int | None = None) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        if qos == 0:
            self._send(encode_publish(topic, payload, 0, retain, False, None, props, self.version))
            fut.set_result(0)
            return fut
        dup = packet_id is not None
        pid = packet_id if dup and packet_id not in self._acks else self._pid()
        self._acks[pid] = (fut, qos)
        fut.packet_id = pid            # type: ignore[attr-defined] - a re-send after a reconnect keeps it
        self._send(encode_publish(topic, payload, qos, retain, dup, pid, props, self.version))
        return fut

    def _ack_later(self, pkt: P.Publish, done: Any) -> None:
        """Acknowledge a received PUBLISH once `done` (None or a future) is done."""
        if pkt.qos == 0:
            return
        pid = pkt.packet_id

        def send(_f=None) -> None:
            if self.closed.done():
                return
            if _f is not None and (_f.cancelled() or _f.exception() is not None):
                # the other side could not take it: no ack, the broker sends it again on our next session
                self.close(f"forwarding failed: {_f.exception() if not _f.cancelled() else 'cancelled'}")
                return
            if pkt.qos == 1:
                self._send(encode(P.PubAck(pid), self.version))
            else:
                self._inbound_qos2.add(pid)
                self._send(encode(P.PubRec(pid), self.version))
        if done is None:
            send()
        else:
            done.add_done_callback(send)

    # ------------------------------------------------------------------------------ receiving
    async def _read(self, dec: Decoder, pending: list) -> None:
        reason = "closed by the broker"
        try:
            for p in pending:
                self._packet(p)
            while True:
                data = await self.reader.read(65536)
                if not data:
                    break
                self._last_rx = asyncio.get_running_loop().time()
                for p in dec.feed(data):
                    self._packet(p)
        except asyncio.CancelledError:
            reason = "closed"
        except ProtocolError as e:
            reason = f"protocol error: {e}"
        except (ConnectionError, OSError) as e:
            reason = f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - a bug ends this link only; the bridge reconnects
            log.exception("event=bridge_link_failed link=%s", self.name)
            reason = f"{type(e).__name__}: {e}"
        self._finish(reason)

    def _packet(self, p: Any) -> None:
        t = type(p)
        if t is P.Publish:
            if p.qos == 2 and p.packet_id in self._inbound_qos2:
                self._send(encode(P.PubRec(p.packet_id), self.version))     # a re-send: already taken
                return
            self._ack_later(p, self.on_publish(p))
        elif t is P.PubAck or t is P.PubComp:
            got = self._acks.pop(p.packet_id, None)
            if got is not None and not got[0].done():
                got[0].set_result(p.reason_code)
        elif t is P.PubRec:
            got = self._acks.get(p.packet_id)
            if got is not None and p.reason_code >= 0x80:
                self._acks.pop(p.packet_id)
                got[0].set_result(p.reason_code)
                return
            self._send(encode(P.PubRel(p.packet_id), self.version))
        elif t is P.PubRel:
            self._inbound_qos2.discard(p.packet_id)
            self._send(encode(P.PubComp(p.packet_id), self.version))
        elif t is P.SubAck:
            fut = self._subacks.get(p.packet_id)
            if fut is not None and not fut.done():
                fut.set_result(list(p.reason_codes))
        elif t is P.Disconnect:
            self._finish(f"DISCONNECT 0x{p.reason_code:02X}"
                         + (f" ({p.properties.reason_string})" if p.properties.reason_string else ""))

    async def _pinger(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.closed.done():
            await asyncio.sleep(max(0.5, self.keepalive / 2))
            if loop.time() - self._last_rx > self.keepalive * 1.5:
                self._finish(f"no packet from the broker for {self.keepalive * 1.5:g} s (keep alive)")
                return
            try:
                self._send(encode(P.PingReq(), self.version))
            except LinkError:
                return
