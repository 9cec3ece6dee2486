"""Small stand-ins shared by tests that drive a protocol object without a socket."""


class RecordingTransport:
    """What an asyncio Protocol sees of its transport: records what is written back (acks) and
    whether the protocol closed it — enough to feed `data_received` byte strings by hand."""

    def __init__(self):
        self.out, self.closed = bytearray(), False

    def write(self, b):
        self.out += b

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed


class FakeTransport:
    """An asyncio transport without a socket, for driving `MQTTConnection` in-process: records the
    bytes written, the close/abort, reading pauses and the write-buffer limits it was given. Like
    asyncio's, closing it calls the protocol's `connection_lost` in a later loop callback."""

    def __init__(self, protocol=None, peer=("127.0.0.1", 50000)):
        self.protocol = protocol
        self.out = bytearray()
        self.closed = False
        self.aborted = False
        self.reading = True
        self.limits = None
        self.peer = peer

    def set_write_buffer_limits(self, high=None, low=None):
        self.limits = (high, low)

    def get_extra_info(self, name, default=None):
        return self.peer if name == "peername" else default

    def get_write_buffer_size(self):
        return 0

    def write(self, b):
        if self.closed:
            raise RuntimeError("write after close")
        self.out += b

    def take(self) -> bytes:
        data, self.out = bytes(self.out), bytearray()
        return data

    def close(self):
        if not self.closed:
            self.closed = True
            self._lost()

    def abort(self):
        self.aborted = True
        self.close()

    def _lost(self):
        if self.protocol is not None:
            import asyncio
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def is_closing(self):
        return self.closed

    def pause_reading(self):
        self.reading = False

    def resume_reading(self):
        self.reading = True


async def started_gateway(tmp_path, data: str = "data"):
    """A real embedded Gateway (store, dispatch, light queues, delivery) started on
    `tmp_path`/`data`, listening nowhere that matters (MQTT on port 0, metrics off); the caller
    stops it."""
    from lmqtt.gateway.app.config import build_config
    from lmqtt.gateway.app.gateway import Gateway

    cfg = build_config({}, {"host": "127.0.0.1", "port": 0, "metrics_port": 0,
                            "data_dir": str(tmp_path / data)})
    gw = Gateway(cfg)
    await gw.start()
    return gw


def fake_connection(gw):
    """(conn, transport): an MQTTConnection of `gw`'s broker on a FakeTransport, connection made
    (feed it with `conn.data_received(bytes)`, read what it wrote with `transport.take()`)."""
    from lmqtt.gateway.net.connection import MQTTConnection

    conn = MQTTConnection(gw.broker)
    tr = FakeTransport(conn)
    conn.connection_made(tr)
    return conn, tr


async def gateway_with_subscribed_pair(tmp_path, topic: str = "t/x"):
    """A real embedded Gateway (store, dispatch, light queues, delivery) started on `tmp_path`, and
    two MQTTConnections on FakeTransports: "sub" (3.1.1, subscribed to `topic` at QoS 1, its
    CONNACK + SUBACK taken) and "pub" (3.1.1, connected). Returns (gw, (sub, sub_tr), (pub, pub_tr));
    the caller stops gw."""
    import asyncio

    from lmqtt.gateway.mqtt import encode, packets as P

    gw = await started_gateway(tmp_path)
    conns = []
    for cid in ("sub", "pub"):
        c, tr = fake_connection(gw)
        c.data_received(encode(P.Connect(client_id=cid, protocol_level=4), 4))
        conns.append((c, tr))
    (sub, sub_tr), (pub, pub_tr) = conns
    sub.data_received(encode(P.Subscribe(1, [P.SubscriptionRequest(topic, qos=1)]), 4))
    for _ in range(200):
        await asyncio.sleep(0.005)
        if sub_tr.take():             # CONNACK + SUBACK
            break
    pub_tr.take()                     # CONNACK
    return gw, (sub, sub_tr), (pub, pub_tr)


class MemoryClient:
    """A 3.1.1 client of `gw`'s broker on a FakeTransport (`fake_connection`): `send` packets,
    read back what the broker wrote as decoded packets (`packets`) or only its PUBLISHes."""

    def __init__(self, gw) -> None:
        from lmqtt.gateway.mqtt import Decoder

        self.conn, self.tr = fake_connection(gw)
        self.dec = Decoder(version=4, server_side=False)

    def send(self, *pkts) -> None:
        from lmqtt.gateway.mqtt import encode

        self.conn.data_received(b"".join(encode(p, 4) for p in pkts))

    def packets(self) -> list:
        return self.dec.feed(self.tr.take())

    def publishes(self) -> list:
        from lmqtt.gateway.mqtt import packets as P

        return [p for p in self.packets() if isinstance(p, P.Publish)]


async def memory_pair(gw, topic: str) -> tuple[MemoryClient, MemoryClient]:
    """(sub, pub): two connected MemoryClients of `gw`, "sub" subscribed to `topic` at QoS 1,
    what the broker wrote to either so far taken."""
    import asyncio

    from lmqtt.gateway.mqtt import packets as P

    sub, pub = MemoryClient(gw), MemoryClient(gw)
    sub.send(P.Connect(client_id="s", protocol_level=4))
    pub.send(P.Connect(client_id="p", protocol_level=4))
    await asyncio.sleep(0.01)
    sub.send(P.Subscribe(1, [P.SubscriptionRequest(topic, qos=1)]))
    await asyncio.sleep(0.2)
    sub.packets(), pub.packets()
    return sub, pub
