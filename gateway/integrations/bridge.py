"""A bridge to another MQTT broker (TOML `[[bridge]]`, bridge_config.py): local messages out to the
remote broker, the remote's in, both kept by the store until the other side has them.

How: a bridge is two MQTT client connections (mqtt_link.py). The **local** one is a persistent MQTT
5 session of this gateway's own broker (client id `lmqtt-bridge-NAME`) reached over a socket pair,
not the network: no listener, port or password is involved, and the broker takes it as an internal
client (no authentication, no ACL, as Mosquitto's bridges). The **remote** one is an ordinary client
of the other broker (`address`, credentials, TLS), with a persistent session there too.

* **Out, store-and-forward.** The local session subscribes to each `out` line's local filter. A
  message delivered to it is published to the remote, and the local PUBLISH is acknowledged only
  once the remote acknowledged its copy (PUBACK / PUBCOMP). Until then it is in the local session's
  in-flight window, and its offset in the store does not move: while the remote is away, what is
  published locally stays in the store (the session's window is full: the broker stops handing out
  more) and is read from there, in order, when the remote returns; the offset is durable (a
  persistent session's), so a gateway restart or kill -9 meanwhile loses nothing either. QoS 0
  messages are sent while the remote is connected and dropped otherwise (counted).
* **In.** The remote session subscribes to each `in` line's remote filter; a message received is
  published locally (QoS 1/2 stored before the remote's PUBLISH is acknowledged).
* **Reconnects** with backoff (0.5 s doubling to `reconnect_max_s`); messages in flight to the
  remote when it went away are sent again first, in order, with their packet ids.
* **Loops.** Every subscription is made with MQTT 5 No Local (our own publishes never come back on
  the same connection), and a message a bridge carried (in or out) carries the user property
  `lmqtt-bridge` = NAME: a bridge never carries such a message again, either way, so two brokers
  bridged to each other (lmqtt to lmqtt, or over a broker that passes user properties) do not
  ping-pong. (Two bridges that both carry a topic both ways still deliver it twice: one `both`
  bridge, or one `out` line on each side, is the configuration.) With an MQTT
  3.1.1 remote (`protocol = 4`, no No Local) a message coming back from the remote that the bridge
  sent out in the last minute is recognised (topic and payload) and not published again.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
import ssl as _ssl
import time
from collections import OrderedDict, deque
from typing import Any, Callable

from lmqtt.gateway.integrations.bridge_config import BridgeConfig, TopicLine
from lmqtt.gateway.integrations.mqtt_link import LinkError, MqttLink
from lmqtt.gateway.mqtt import packets as P

log = logging.getLogger("lmqtt.gateway.bridge")

MARKER = "lmqtt-bridge"
NEVER_EXPIRES = 0xFFFFFFFF


def matches(flt: str, topic: str) -> bool:
    if topic.startswith("$") and flt[:1] in ("+", "#"):
        return False
    f, t = flt.split("/"), topic.split("/")
    for i, lv in enumerate(f):
        if lv == "#":
            return True
        if i >= len(t) or (lv != "+" and lv != t[i]):
            return False
    return len(f) == len(t)


class _Out:
    """A local message on its way to the remote: acknowledged locally when `done` is."""

    __slots__ = ("topic", "payload", "qos", "retain", "props", "pid", "done")

    def __init__(self, topic: str, payload: bytes, qos: int, retain: bool, props, done: asyncio.Future) -> None:
        self.topic, self.payload, self.qos, self.retain, self.props = topic, payload, qos, retain, props
        self.pid: int | None = None
        self.done = done


class Bridge:
    def __init__(self, cfg: BridgeConfig, open_local: Callable[[], socket.socket]) -> None:
        """`open_local()`: a connected socket whose other end the broker serves as an internal client."""
        self.cfg = cfg
        self.name = cfg.name
        self.open_local = open_local
        self.local: MqttLink | None = None
        self.remote: MqttLink | None = None
        self.pending: OrderedDict[int, _Out] = OrderedDict()
        self._seq = 0
        self._stopping = False
        self._tasks: list[asyncio.Task] = []
        self._echo: deque[tuple[bytes, float]] = deque()
        self._echo_set: dict[bytes, int] = {}
        # counters for /metrics
        self.sent_out = self.received_in = self.dropped_qos0 = self.looped = 0
        self.remote_connects = self.remote_failures = 0
        self.last_error: str | None = None

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._keep_local()), loop.create_task(self._keep_remote())]

    async def stop(self) -> None:
        self._stopping = True
        for link in (self.remote, self.local):
            if link is not None:
                link.close("bridge stopping")
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _keep(self, side: str, connect) -> None:
        backoff = 0.5
        # an OS error ("Connection refused", "Name or service not known") names no address
        where = f" remote={self.cfg.host}:{self.cfg.port}" if side == "remote" else ""
        while not self._stopping:
            link = None
            try:
                link = await connect()
                backoff = 0.5
                why = await link.closed
                if not self._stopping:
                    log.warning("event=bridge_disconnected bridge=%s side=%s%s reason=%r", self.name, side, where, why)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - refused, unreachable, TLS: logged, retried
                self.last_error = f"{side}: {e}"
                if side == "remote":
                    self.remote_failures += 1
                if self.remote_failures <= 3 or self.remote_failures % 20 == 0 or side == "local":
                    log.warning("event=bridge_connect_failed bridge=%s side=%s%s error=%r (retry in %.1f s)",
                                self.name, side, where, str(e), backoff)
                if link is not None:
                    link.close("failed")
            finally:
                if side == "remote":
                    self.remote = None
                else:
                    self.local = None
            if self._stopping:
                return
            await asyncio.sleep(backoff)
            backoff = min(self.cfg.reconnect_max_s if side == "remote" else 5.0, backoff * 2)

    async def _keep_local(self) -> None:
        await self._keep("local", self._connect_local)

    async def _keep_remote(self) -> None:
        await self._keep("remote", self._connect_remote)

    # ------------------------------------------------------------------------------ local side
    async def _connect_local(self) -> MqttLink:
        cfg = self.cfg
        link = MqttLink(f"{self.name}/local", 5, keepalive=0)
        link.on_publish = self._from_local
        props = P.Properties(session_expiry_interval=NEVER_EXPIRES, receive_maximum=cfg.local_receive_maximum)
        await link.connect(P.Connect(f"lmqtt-bridge-{self.name}", 5, clean_start=False, keepalive=0,
                                     properties=props), sock=self.open_local())
        outs = [P.SubscriptionRequest(line.local_filter, line.qos, no_local=True, retain_as_published=True)
                for line in cfg.topics if line.outbound()]
        if outs:
            codes = await link.subscribe(outs)
            bad = [(r.topic_filter, c) for r, c in zip(outs, codes) if c >= 0x80]
            if bad:
                log.error("event=bridge_subscribe_refused bridge=%s side=local filters=%r", self.name, bad)
        self.local = link
        log.info("event=bridge_local_ready bridge=%s filters=%d", self.name, len(outs))
        return link

    def _line_out(self, topic: str) -> TopicLine | None:
        for line in self.cfg.topics:
            if line.outbound() and matches(line.local_filter, topic):
                return line
        return None

    def _from_local(self, pkt: P.Publish):
        """A local message for the remote: None (acknowledge now) or the future of its remote ack."""
        if any(k == MARKER for k, _v in pkt.properties.user_property):
            self.looped += 1           # it came in over a bridge: never sent out again
            return None
        line = self._line_out(pkt.topic)
        if line is None:
            return None
        topic = line.remote_prefix + pkt.topic[len(line.local_prefix):]
        qos = min(pkt.qos, line.qos)
        props = self._props_out(pkt.properties)
        remote = self.remote
        if qos == 0:
            if remote is not None and remote.connected:
                try:
                    remote.publish(topic, pkt.payload, 0, pkt.retain, props)
                    self.sent_out += 1
                    self._remember_echo(topic, pkt.payload)
                except LinkError:
                    self.dropped_qos0 += 1
            else:
                self.dropped_qos0 += 1
            return None
        done = asyncio.get_running_loop().create_future()
        out = _Out(topic, pkt.payload, qos, pkt.retain, props, done)
        self._seq += 1
        self.pending[self._seq] = out
        if remote is not None and remote.connected:
            self._send(remote, self._seq, out)
        return done

    def _props_out(self, props: P.Properties) -> P.Properties | None:
        if self.cfg.protocol != 5:
            return None
        out = P.Properties(user_property=list(props.user_property) + [(MARKER, self.name)],
                           content_type=props.content_type, payload_format_indicator=props.payload_format_indicator,
                           response_topic=props.response_topic, correlation_data=props.correlation_data,
                           message_expiry_interval=props.message_expiry_interval)
        return out

    def _send(self, remote: MqttLink, seq: int, out: _Out) -> None:
        try:
            fut = remote.publish(out.topic, out.payload, out.qos, out.retain, out.props, out.pid)
        except LinkError:
            return                      # sent again when the remote is back
        out.pid = getattr(fut, "packet_id", None)
        self._remember_echo(out.topic, out.payload)

        def acked(f: asyncio.Future, seq=seq, out=out) -> None:
            if f.cancelled() or f.exception() is not None:
                return                  # the link ended: still pending, sent again after the reconnect
            self.pending.pop(seq, None)
            self.sent_out += 1
            if f.result() >= 0x80:
                log.warning("event=bridge_publish_refused bridge=%s topic=%r reason_code=0x%02X (acknowledged "
                            "locally: the remote refuses it)", self.name, out.topic, f.result())
            if not out.done.done():
                out.done.set_result(None)
        fut.add_done_callback(acked)

    # ------------------------------------------------------------------------------ remote side
    def _ssl(self):
        cfg = self.cfg
        if not cfg.tls:
            return None
        ctx = _ssl.create_default_context(cafile=cfg.cafile)
        if cfg.certfile:
            ctx.load_cert_chain(cfg.certfile, cfg.keyfile)
        if cfg.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = _ssl.CERT_NONE
        return ctx

    async def _connect_remote(self) -> MqttLink:
        cfg = self.cfg
        link = MqttLink(f"{self.name}/remote", cfg.protocol, cfg.keepalive)
        link.on_publish = self._from_remote
        props = P.Properties(session_expiry_interval=NEVER_EXPIRES) if cfg.protocol == 5 else P.Properties()
        await link.connect(P.Connect(cfg.client_id, cfg.protocol, clean_start=False, keepalive=cfg.keepalive,
                                     username=cfg.username,
                                     password=cfg.password.encode() if cfg.password is not None else None,
                                     properties=props),
                           host=cfg.host, port=cfg.port, ssl=self._ssl(), server_hostname=cfg.host)
        ins = [P.SubscriptionRequest(line.remote_filter, line.qos, no_local=True, retain_as_published=True)
               for line in cfg.topics if line.inbound()]
        if ins:
            codes = await link.subscribe(ins)
            bad = [(r.topic_filter, c) for r, c in zip(ins, codes) if c >= 0x80]
            if bad:
                log.error("event=bridge_subscribe_refused bridge=%s side=remote filters=%r", self.name, bad)
        # what was in flight when the remote went away goes first, in order, then the new messages
        for seq, out in list(self.pending.items()):
            self._send(link, seq, out)
        self.remote = link
        self.remote_connects += 1
        self.last_error = None
        log.info("event=bridge_connected bridge=%s remote=%s:%d resent=%d", self.name, cfg.host, cfg.port,
                 len(self.pending))
        return link

    def _line_in(self, topic: str) -> TopicLine | None:
        for line in self.cfg.topics:
            if line.inbound() and matches(line.remote_filter, topic):
                return line
        return None

    def _from_remote(self, pkt: P.Publish):
        """A remote message for the local broker: None or the future of its local acknowledgement."""
        if self.cfg.protocol != 5 and self._is_echo(pkt.topic, pkt.payload):
            self.looped += 1
            return None
        if any(k == MARKER for k, _v in pkt.properties.user_property):
            self.looped += 1           # another bridge brought it to the remote: not brought in again
            return None
        line = self._line_in(pkt.topic)
        local = self.local
        if line is None:
            return None
        topic = line.local_prefix + pkt.topic[len(line.remote_prefix):]
        qos = min(pkt.qos, line.qos)
        src = pkt.properties
        props = P.Properties(user_property=[(k, v) for k, v in src.user_property if k != MARKER] + [(MARKER, self.name)],
                             content_type=src.content_type, payload_format_indicator=src.payload_format_indicator,
                             response_topic=src.response_topic, correlation_data=src.correlation_data,
                             message_expiry_interval=src.message_expiry_interval)
        if local is None or not local.connected:
            if qos == 0:
                return None
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(LinkError("the local broker is not connected"))
            return fut
        self.received_in += 1
        return local.publish(topic, pkt.payload, qos, pkt.retain, props)

    # ------------------------------------------------------------------------------ 3.1.1 echoes
    def _remember_echo(self, topic: str, payload: bytes) -> None:
        if self.cfg.protocol == 5 or not any(line.inbound() for line in self.cfg.topics):
            return
        k = hashlib.blake2b(topic.encode() + b"\0" + payload, digest_size=16).digest()
        now = time.monotonic()
        self._echo.append((k, now))
        self._echo_set[k] = self._echo_set.get(k, 0) + 1
        while self._echo and (now - self._echo[0][1] > 60 or len(self._echo) > 100_000):
            old, _t = self._echo.popleft()
            n = self._echo_set.get(old, 0) - 1
            if n <= 0:
                self._echo_set.pop(old, None)
            else:
                self._echo_set[old] = n

    def _is_echo(self, topic: str, payload: bytes) -> bool:
        k = hashlib.blake2b(topic.encode() + b"\0" + payload, digest_size=16).digest()
        n = self._echo_set.get(k, 0)
        if not n:
            return False
        if n == 1:
            del self._echo_set[k]
        else:
            self._echo_set[k] = n - 1
        return True

    # ------------------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        return {"name": self.name, "remote": f"{self.cfg.host}:{self.cfg.port}",
                "remote_connected": self.remote is not None and self.remote.connected,
                "local_connected": self.local is not None and self.local.connected,
                "pending": len(self.pending), "sent_out": self.sent_out, "received_in": self.received_in,
                "dropped_qos0": self.dropped_qos0, "loops_stopped": self.looped, "last_error": self.last_error}
