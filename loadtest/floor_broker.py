"""The floor of a Python broker: the cheapest MQTT 3.1.1 broker this machine runs in Python on
uvloop, and the same with lmqtt's own store under it.

    python3 -m lmqtt.loadtest.floor_broker --port P [--store DIR]
    lmqtt bench cost --brokers floor,floor-store,lmqtt,mosquitto --scenarios latency

Why: lmqtt's CPU per message at a few thousand messages a second is several times Mosquitto's
(BENCHMARKS.md), and a profile of it is flat. This splits the figure: `floor` is what Python and
uvloop themselves cost per message (one read and one write per packet, a PUBACK, a forward to each
subscriber, nothing else); `floor-store` adds exactly what lmqtt's store adds to each PUBLISH (its
light queues looked up, the record appended to the CommitLog and dispatched inline into the
ConsumeQueue and the light queues, as `lmqtt serve` does) and nothing of lmqtt's gateway. lmqtt
less `floor-store` is then the gateway's share: sessions, delivery through the light queues, acks
tracked, metrics.

What it is not: a broker. No sessions, no retained messages, no wills, no QoS 2 (a QoS 2 PUBLISH
closes the connection), no authentication, no MQTT 5, no keep-alive; delivery is at most what the
socket takes, and nothing is read back from the store.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import struct

from lmqtt.gateway.mqtt.wire import encode_varint
from lmqtt.lightqueue import LightQueueStore
from lmqtt.lightqueue.topics import is_wildcard, topic_matches
from lmqtt.store.config import StoreConfig
from lmqtt.store.message import Message
from lmqtt.store.message_store import MessageStore

from .traffic_worker import install_uvloop

_H = struct.Struct("!H")


def _frame(first: int, body: bytes) -> bytes:
    return bytes((first,)) + encode_varint(len(body)) + body


class Floor:
    """The broker's state: exact subscriptions by topic, wildcard ones in a list; the store."""

    def __init__(self, store_dir: str | None) -> None:
        self.exact: dict[bytes, list["FloorConnection"]] = {}
        self.wild: list[tuple[str, "FloorConnection"]] = []
        self.append = None
        if store_dir is not None:
            os.makedirs(store_dir, exist_ok=True)
            cfg = StoreConfig(data_dir=os.path.join(store_dir, "store"))
            cfg.dispatch_inline = True          # as `lmqtt serve`: dispatched on the appender's thread
            self.store = MessageStore(cfg)
            lq = LightQueueStore(self.store, os.path.join(store_dir, "lightqueue"))
            self.store.start()
            queues, append = lq.queues_for_topic, self.store.append

            def store_append(topic: str, payload: bytes) -> None:
                append(Message(topic, payload, dispatch_queues=queues(topic)))
            self.append = store_append

    def subscribers(self, topic: bytes) -> list["FloorConnection"]:
        out = list(self.exact.get(topic, ()))
        if self.wild:
            t = topic.decode()
            out += [c for f, c in self.wild if topic_matches(f, t)]
        return out


class FloorConnection(asyncio.Protocol):
    def __init__(self, floor: Floor) -> None:
        self.floor = floor
        self.buf = b""
        self.pid = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        i, n = 0, len(buf)
        while i + 2 <= n:
            first, j, rl, mul = buf[i], i + 1, 0, 1
            while j < n:
                b = buf[j]
                rl += (b & 127) * mul
                mul *= 128
                j += 1
                if not b & 128:
                    break
            else:
                break                            # the length is not all in yet
            if j + rl > n:
                break
            self._packet(first, buf[j:j + rl])
            i = j + rl
        self.buf = buf[i:]

    def _packet(self, first: int, body: bytes) -> None:
        kind, write = first >> 4, self.transport.write
        if kind == 3:                                    # PUBLISH
            qos = (first >> 1) & 3
            tl = _H.unpack_from(body)[0]
            topic, pos = body[2:2 + tl], 2 + tl
            if qos == 2:
                self.transport.close()
                return
            pid = body[pos:pos + 2] if qos else b""
            payload = body[pos + len(pid):]
            if self.floor.append is not None:          # appended before it is acknowledged, as in lmqtt
                self.floor.append(topic.decode(), payload)
            if qos:
                write(b"\x40\x02" + pid)              # PUBACK
            head = _H.pack(tl) + topic
            for s in self.floor.subscribers(topic):
                if qos:
                    s.pid = s.pid % 65535 + 1
                    s.transport.write(_frame(0x32, head + _H.pack(s.pid) + payload))
                else:
                    s.transport.write(_frame(0x30, head + payload))
        elif kind == 1:                                  # CONNECT
            write(b"\x20\x02\x00\x00")
        elif kind == 8:                                  # SUBSCRIBE
            pos, codes = 2, bytearray()
            while pos < len(body):
                tl = _H.unpack_from(body, pos)[0]
                flt = body[pos + 2:pos + 2 + tl]
                codes.append(min(body[pos + 2 + tl], 1))
                pos += 3 + tl
                if is_wildcard(flt.decode()):
                    self.floor.wild.append((flt.decode(), self))
                else:
                    self.floor.exact.setdefault(flt, []).append(self)
            write(_frame(0x90, body[:2] + bytes(codes)))
        elif kind == 12:                                 # PINGREQ
            write(b"\xd0\x00")
        elif kind == 14:                                 # DISCONNECT
            self.transport.close()
        # PUBACK from a subscriber (4) and anything else: nothing to do

    def connection_lost(self, exc) -> None:
        f = self.floor
        for subs in f.exact.values():
            while self in subs:
                subs.remove(self)
        f.wild = [(flt, c) for flt, c in f.wild if c is not self]


async def serve(host: str, port: int, store_dir: str | None) -> None:
    floor = Floor(store_dir)
    server = await asyncio.get_running_loop().create_server(lambda: FloorConnection(floor), host, port,
                                                            reuse_address=True)
    print(f"floor broker: listening on {host}:{port}" + (f", store in {store_dir}" if store_dir else ""),
          flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python3 -m lmqtt.loadtest.floor_broker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--store", metavar="DIR", help="append every PUBLISH to lmqtt's store in DIR first")
    a = ap.parse_args(argv)
    install_uvloop()
    asyncio.run(serve(a.host, a.port, a.store))


if __name__ == "__main__":
    main()
