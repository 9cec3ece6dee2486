"""`lmqtt_connections` (open connections after CONNECT) and `lmqtt_connects_total` (CONNECTs
accepted) are plain ints on the broker's hot path (a reconnect storm: prometheus_client's lock was
~2 % of a reconnect storm's CPU) and still exported with the same names and values: a CONNECT
counts, a close and a takeover uncount. In-process gateway, clients on in-memory transports."""
from __future__ import annotations

import asyncio

from prometheus_client import generate_latest

from lmqtt.gateway.mqtt import encode, packets as P
from tests.fakes import fake_connection, started_gateway


def _exported(gw) -> dict:
    text = generate_latest(gw.metrics.registry).decode()
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
            if ln.startswith(("lmqtt_connections ", "lmqtt_connects_total "))}


def test_connections_and_connects_exported(tmp_path):
    async def run():
        gw = await started_gateway(tmp_path, "d")
        try:
            def connect(cid):
                conn, _tr = fake_connection(gw)
                conn.data_received(encode(P.Connect(client_id=cid, protocol_level=4), 4))
                return conn
            _, b = connect("a"), connect("b")
            await asyncio.sleep(0.01)
            assert _exported(gw) == {"lmqtt_connections": 2.0, "lmqtt_connects_total": 2.0}
            connect("a")                      # takes over a's session
            await asyncio.sleep(0.01)
            assert _exported(gw) == {"lmqtt_connections": 2.0, "lmqtt_connects_total": 3.0}
            b.data_received(encode(P.Disconnect(), 4))
            await asyncio.sleep(0.05)
            assert _exported(gw) == {"lmqtt_connections": 1.0, "lmqtt_connects_total": 3.0}
            assert gw._sys_stats()["connects"] == 3
        finally:
            await gw.stop()
    asyncio.run(run())
