"""The connection sweep's keep-alive wheel (gateway/net/keepalive.py `ConnectionSweep`): a tick
looks only at the deadlines that have come, not at every connection (at 10^5-10^6 idle
connections the old pass over all of them twice a second was the broker's whole CPU), and it
still ends a silent connection and keeps a talking one. In-process broker, fake transports, the
tick given the time it is run at (no sleeping)."""
from __future__ import annotations

from lmqtt.gateway.mqtt import ReasonCode, packets as P
from tests.gateway.test_broker_handlers import Client, run


async def _connected(gw, n: int, keepalive: int, prefix: str) -> list[Client]:
    out = []
    for i in range(n):
        c = Client(gw)
        c.send(P.Connect(client_id=f"{prefix}{i}", protocol_level=5, keepalive=keepalive))
        await c.wait_for(P.ConnAck)
        out.append(c)
    return out


def test_a_tick_looks_at_no_idle_connection_before_its_keep_alive_deadline(tmp_path):
    async def body(gw):
        sweep = gw.broker.sweep
        clients = await _connected(gw, 300, 60, "idle")
        assert sweep.armed() == 300 and not sweep.pending
        first = min(c.conn.last_rx for c in clients)
        checked = sweep.checked
        for dt in (0.5, 10, 60, 88):                # deadlines are 90 s (1.5 x 60) after each CONNECT
            sweep.tick(first + dt)
        assert sweep.checked == checked            # the old sweep: 300 per tick
        assert not any(c.transport.closed for c in clients)
    run(tmp_path, body)


def test_the_wheel_ends_a_silent_connection_and_puts_a_talking_one_back(tmp_path):
    async def body(gw):
        sweep = gw.broker.sweep
        quiet, talking = await _connected(gw, 2, 10, "ka")
        t0 = gw.broker.loop.time()
        talking.conn.last_rx = t0 + 10               # heard from 10 s later
        sweep.tick(t0 + 17)                          # both deadlines (15 s) have come
        d, = await quiet.wait_for(P.Disconnect)
        assert d.reason_code == ReasonCode.KEEP_ALIVE_TIMEOUT and quiet.transport.closed
        assert not talking.transport.closed
        assert sweep.armed() == 1 and talking.conn._ka_slot is not None   # back in the wheel, a later slot
        sweep.tick(t0 + 26)
        assert talking.transport.closed              # silent since t0 + 10: past t0 + 25
    run(tmp_path, body)


def test_a_closed_connection_leaves_every_table_of_the_sweep(tmp_path):
    async def body(gw):
        sweep = gw.broker.sweep
        waiting = Client(gw)                         # no CONNECT yet
        assert waiting.conn in sweep.pending
        c, = await _connected(gw, 1, 30, "gone")
        assert sweep.armed() == 1 and c.conn not in sweep.pending
        c.conn.connection_lost(None)
        waiting.conn.connection_lost(None)
        assert sweep.armed() == 0 and waiting.conn not in sweep.pending
    run(tmp_path, body)


def test_a_socket_without_connect_is_closed_by_the_tick_after_connect_timeout(tmp_path):
    async def body(gw):
        idle = Client(gw)
        now = gw.broker.loop.time()
        gw.broker.sweep.tick(now + 1)
        assert not idle.transport.closed
        gw.broker.sweep.tick(now + gw.cfg.connect_timeout_s + 1)
        assert idle.transport.closed and idle.conn not in gw.broker.sweep.pending
    run(tmp_path, body)
