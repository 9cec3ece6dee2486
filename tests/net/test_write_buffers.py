"""A connection's write buffer grows while its client drains it fast (gateway/net/write_buffers.py):
the marks the transport really has, the budget all connections share, back to the base for a
client that drains slowly, the growth given back when a connection closes; and, on `lmqtt serve`,
a subscriber that drains bursts fast grows its buffer while one that never reads does not."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

from lmqtt.gateway.mqtt import encode, packets as P
from lmqtt.gateway.net.write_buffers import GROW_MIN_RATE, WriteBuffers
from tests.support import LmqttServer, RawMQTT, metric, until

MIB = 1 << 20


class _Conn:
    """What WriteBuffers reads and writes of a connection, over a real transport."""

    def __init__(self, transport) -> None:
        self.transport = transport
        self.write_high = 0
        self.write_paused_at = None


def test_marks_double_on_a_fast_drain_within_the_shared_budget_and_fall_back_on_a_slow_one():
    async def main():
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        transports = []
        for s in (a, b):
            t, _ = await loop.connect_accepted_socket(asyncio.Protocol, sock=s)
            t.set_write_buffer_limits(high=MIB, low=MIB // 4)
            transports.append(t)
        wb = WriteBuffers(MIB, MIB // 4, 16 * MIB, 6 * MIB)
        c1, c2 = _Conn(transports[0]), _Conn(transports[1])
        def cycle(c, rate):
            """A pause that ends with the client having drained what it held at `rate` bytes/s."""
            high = c.write_high or MIB
            wb.paused(c, 100.0)
            wb.resumed(c, 100.0 + (high - high // 4) / rate)

        def marks(c):
            return c.transport.get_write_buffer_limits()

        cycle(c1, 10 * GROW_MIN_RATE)     # to the ceiling, cut to what the 6 MiB budget allows
        assert c1.write_high == 7 * MIB and marks(c1) == (7 * MIB // 4, 7 * MIB)
        cycle(c1, 10 * GROW_MIN_RATE)     # still fast: kept
        assert c1.write_high == 7 * MIB and wb.grown == 6 * MIB and wb.grows == 1
        cycle(c2, 10 * GROW_MIN_RATE)     # the budget is spent: c2 keeps the base
        assert c2.write_high == 0 and marks(c2) == (MIB // 4, MIB)
        cycle(c1, GROW_MIN_RATE / 4)      # c1 drained slowly this time: back to the base
        assert c1.write_high == 0 and marks(c1) == (MIB // 4, MIB) and wb.grown == 0
        cycle(c2, 10 * GROW_MIN_RATE)
        assert c2.write_high == 7 * MIB and wb.grown == 6 * MIB
        wb.release(c2)                    # closed or parked: its growth back in the budget
        assert c2.write_high == 0 and wb.grown == 0
        for t in transports:
            t.close()

    asyncio.run(main())


def test_a_subscriber_draining_bursts_fast_grows_its_buffer_one_that_never_reads_does_not(tmp_path):
    srv = LmqttServer(str(tmp_path / "data"), (), str(tmp_path / "serve.log")).start()
    try:
        url = srv.metrics_url
        subs = {}
        for name in ("never-reads", "fast"):
            r = RawMQTT(srv, version=4)
            # a receive buffer of its own size: the kernel's autotuning (up to 32 MiB here) would
            # take every burst and the server's socket buffer would never fill
            r.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 << 10)
            assert r.connect(name).reason_code == 0
            r.send(P.Subscribe(1, [P.SubscriptionRequest("burst/#", 0)]))
            assert isinstance(r.recv(), P.SubAck)
            subs[name] = r
        pub = RawMQTT(srv, version=4)
        assert pub.connect("pub").reason_code == 0
        frame = encode(P.Publish("burst/x", b"b" * (64 << 10), 0), 4)
        got = [0]
        reading = threading.Event()

        def drain(r):
            r.sock.settimeout(0.2)
            while True:
                reading.wait()
                try:
                    data = r.sock.recv(1 << 20)
                except socket.timeout:
                    continue
                except OSError:
                    return
                if not data:
                    return
                got[0] += len(data)

        t = threading.Thread(target=drain, args=(subs["fast"],), daemon=True)
        t.start()
        for burst in range(3):        # 24 MiB the fast subscriber does not read, then reads at once
            reading.clear()
            for _ in range(384):
                pub.send_raw(frame)
            time.sleep(0.3)
            reading.set()
            until(lambda b=burst: got[0] >= (b + 1) * 384 * (64 << 10), timeout=30)
        assert metric(url, "lmqtt_write_buffer_grows_total") >= 1
        grown = metric(url, "lmqtt_write_buffer_growth_bytes")
        assert 0 < grown <= 15 * MIB          # the fast one's alone: the one that never reads never resumed
        subs["fast"].close()
        until(lambda: metric(url, "lmqtt_write_buffer_growth_bytes") == 0, timeout=10)
    finally:
        srv.stop()


def test_a_connection_back_at_the_base_marks_keeps_nothing_of_its_pauses_and_gives_its_growth_back(tmp_path):
    """Through the connection's own pause_writing / resume_writing: a client that drained at once
    grows to write_high_water_max, one that took long goes back to the base and the connection
    keeps no rare state for it (an idle connection's memory), a closed one gives its growth back."""
    from tests.gateway.test_broker_handlers import Client, run

    async def body(gw):
        c = Client(gw, version=4)
        assert (await c.connect("pauses")).reason_code == 0
        conn, wb, cfg = c.conn, gw.broker.write_buffers, gw.broker.cfg
        rare0 = conn._rare
        conn.pause_writing()
        assert conn.write_blocked
        conn.resume_writing()                      # drained within the same loop turn: fast
        assert not conn.write_blocked and conn.write_high == cfg.write_high_water_max
        assert wb.grown == cfg.write_high_water_max - cfg.write_high_water
        conn.pause_writing()
        conn.write_paused_at -= 600.0              # ... and this time it took ten minutes
        conn.resume_writing()
        assert conn.write_high == 0 and wb.grown == 0 and conn._rare is rare0
        conn.pause_writing()
        conn.resume_writing()
        assert wb.grown > 0
        conn.connection_lost(None)
        assert wb.grown == 0

    run(tmp_path, body)
