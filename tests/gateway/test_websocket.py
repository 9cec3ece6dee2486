"""MQTT over WebSocket (gateway/net/websocket.py): paho-mqtt over WebSocket against a real in-process
gateway, and the WebSocket edge cases with a raw wsproto client."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from wsproto import ConnectionType, WSConnection
from wsproto.events import (AcceptConnection, BytesMessage, CloseConnection, RejectConnection, Request,
                            TextMessage)

from lmqtt.gateway.net.websocket import WebSocketProtocol


class LoopThread:
    """An asyncio loop on its own thread, for servers the blocking test clients talk to."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.t = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.t.start()

    def run(self, coro, timeout: float = 20):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.t.join(5)


class Echo(asyncio.Protocol):
    """Inner protocol for the edge-case tests: echoes every byte it gets."""

    def connection_made(self, transport):
        self.t = transport

    def data_received(self, data):
        self.t.write(data)


@pytest.fixture
def echo_server():
    lt = LoopThread()

    async def start():
        return await lt.loop.create_server(lambda: WebSocketProtocol(Echo), "127.0.0.1", 0)
    srv = lt.run(start())
    yield srv.sockets[0].getsockname()[1]
    lt.loop.call_soon_threadsafe(srv.close)
    lt.stop()


class RawWS:
    def __init__(self, port: int, path: str = "/mqtt", subprotocols=("mqtt",)) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.sock.sendall(self.ws.send(Request(host="localhost", target=path, subprotocols=list(subprotocols))))

    def events(self, until, timeout: float = 5.0):
        out = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            data = self.sock.recv(65536)
            self.ws.receive_data(data or None)
            out.extend(self.ws.events())
            if not data or any(until(e) for e in out):
                break
        return out


def test_edge_cases_binary_only_path_subprotocol_fragmentation(echo_server):
    c = RawWS(echo_server)
    ev = c.events(lambda e: isinstance(e, AcceptConnection))
    assert isinstance(ev[0], AcceptConnection) and ev[0].subprotocol == "mqtt"
    # one message sent in three frames comes back whole (inner protocol saw a byte stream)
    c.sock.sendall(c.ws.send(BytesMessage(data=b"\x10\x02", message_finished=False)))
    c.sock.sendall(c.ws.send(BytesMessage(data=b"\x00", message_finished=False)))
    c.sock.sendall(c.ws.send(BytesMessage(data=b"\x04", message_finished=True)))
    got = b""
    for e in c.events(lambda e: isinstance(e, BytesMessage) and e.message_finished):
        if isinstance(e, BytesMessage):
            got += e.data
    deadline = time.monotonic() + 2
    while len(got) < 4 and time.monotonic() < deadline:
        for e in c.events(lambda e: isinstance(e, BytesMessage)):
            if isinstance(e, BytesMessage):
                got += e.data
    assert got == b"\x10\x02\x00\x04"
    # a text frame is a protocol violation for MQTT: close 1003
    c.sock.sendall(c.ws.send(TextMessage(data="hello")))
    closes = [e for e in c.events(lambda e: isinstance(e, CloseConnection)) if isinstance(e, CloseConnection)]
    assert closes and closes[0].code == 1003


def test_other_paths_get_404_and_clients_without_subprotocol_are_accepted(echo_server):
    c = RawWS(echo_server, path="/other")
    ev = c.events(lambda e: isinstance(e, RejectConnection))
    assert isinstance(ev[0], RejectConnection) and ev[0].status_code == 404
    c2 = RawWS(echo_server, subprotocols=())
    ev2 = c2.events(lambda e: isinstance(e, AcceptConnection))
    assert isinstance(ev2[0], AcceptConnection) and ev2[0].subprotocol is None


def test_garbage_instead_of_a_handshake_closes_only_that_connection(echo_server):
    s = socket.create_connection(("127.0.0.1", echo_server), timeout=5)
    s.sendall(b"\x10\x0c\x00\x04MQTT\x04\x02\x00<\x00\x00" * 3)
    s.settimeout(5)
    data = b""
    try:
        while True:
            d = s.recv(4096)
            if not d:
                break
            data += d
    except ConnectionResetError:
        pass
    assert data == b"" or data.startswith(b"HTTP/1.1 400")
    c = RawWS(echo_server)                                  # the listener still serves
    assert isinstance(c.events(lambda e: isinstance(e, AcceptConnection))[0], AcceptConnection)


def test_paho_over_websocket_publishes_and_receives_through_a_real_gateway(tmp_path):
    paho = pytest.importorskip("paho.mqtt.client")
    from lmqtt.gateway.app.config import build_config
    from lmqtt.gateway.net.connection import MQTTConnection
    from lmqtt.gateway.app.gateway import Gateway
    lt = LoopThread()
    cfg = build_config({}, {"host": "127.0.0.1", "port": 0, "data_dir": str(tmp_path / "data"),
                            "metrics_port": 0, "segment_mb": 16})
    gw = Gateway(cfg)

    async def start():
        await gw.start()
        return await lt.loop.create_server(
            lambda: WebSocketProtocol(lambda: MQTTConnection(gw.broker)), "127.0.0.1", 0)
    ws_srv = lt.run(start())
    port = ws_srv.sockets[0].getsockname()[1]
    try:
        got = []
        subscribed = threading.Event()
        sub = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="ws-sub", transport="websockets",
                          protocol=paho.MQTTv5)
        sub.ws_set_options(path="/mqtt")
        sub.on_message = lambda c, u, m: got.append((m.topic, m.payload, m.qos))
        sub.on_subscribe = lambda *a: subscribed.set()
        sub.connect("127.0.0.1", port)
        sub.loop_start()
        sub.subscribe("sensors/+/temp", qos=1)
        assert subscribed.wait(5)
        pub = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="ws-pub", transport="websockets")
        pub.connect("127.0.0.1", port)
        pub.loop_start()
        big = bytes(range(256)) * 400                       # 100 KiB: many WebSocket frames
        for i, payload in enumerate((b"21.5", big)):
            pub.publish(f"sensors/k{i}/temp", payload, qos=1).wait_for_publish(5)
        deadline = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert got == [("sensors/k0/temp", b"21.5", 1), ("sensors/k1/temp", big, 1)]
        pub.loop_stop()
        pub.disconnect()
        sub.loop_stop()
        sub.disconnect()
    finally:
        async def stop():
            ws_srv.close()
            await gw.stop()
        lt.run(stop())
        lt.stop()
