"""A subscriber far behind its queue's end gets every message in order, and the gateway keeps no
ready copies of that queue's new messages meanwhile (`RecentMessages.lagging`): they would start
where the reader cannot reach them, and under a sustained overload building them cost ~17 % of the
broker's CPU. Once the reader is near the end again, new messages are kept ready for it again.

In-process gateway (real store, real delivery), clients on the connection's in-memory transport."""
from __future__ import annotations

import asyncio

from lmqtt.gateway.app.config import build_config
from lmqtt.gateway.app.gateway import Gateway
from lmqtt.gateway.mqtt import packets as P
from tests.fakes import memory_pair


def test_a_reader_far_behind_gets_everything_in_order_and_no_ready_copies_are_kept_until_it_is_near(tmp_path):
    n, gap = 600, 64

    async def run():
        cfg = build_config({}, {"host": "127.0.0.1", "port": 0, "metrics_port": 0, "max_inflight": 10,
                                "data_dir": str(tmp_path / "d")})
        gw = Gateway(cfg)
        await gw.start()
        try:
            rm = gw.broker.delivery.recent
            rm.gap_max = gap
            sub, pub = await memory_pair(gw, "lag/t")
            got: list = []
            # the subscriber does not acknowledge: its window of 10 fills and it falls behind
            for first in range(0, n, 50):
                pub.send(*[P.Publish("lag/t", f"m{i}".encode(), qos=1, packet_id=i + 1)
                           for i in range(first, first + 50)])
                await asyncio.sleep(0)
                got += sub.publishes()
                pub.tr.take()
            await asyncio.sleep(0.05)
            got += sub.publishes()
            assert len(got) == 10
            lagging, kept = set(rm.lagging), rm.entries
            # it acknowledges now, batch by batch, until it has them all
            acked = 0
            for _ in range(2000):
                if acked >= n:
                    break
                if acked < len(got):
                    sub.send(*[P.PubAck(p.packet_id) for p in got[acked:]])
                    acked = len(got)
                await asyncio.sleep(0.001)
                got += sub.publishes()
            await asyncio.sleep(0.05)
            lagging_after = set(rm.lagging)
            pub.send(P.Publish("lag/t", b"last", qos=1, packet_id=n + 1))
            await asyncio.sleep(0.05)
            last = sub.publishes()
            return got, lagging, kept, lagging_after, last, set(rm.rings)
        finally:
            await gw.stop()

    got, lagging, kept, lagging_after, last, rings = asyncio.run(run())
    assert [p.payload for p in got] == [f"m{i}".encode() for i in range(n)]
    assert len(lagging) == 1 and kept == 0, (lagging, kept)     # no ready copies while it lagged
    assert lagging_after == set()                               # near the end again ...
    assert [p.payload for p in last] == [b"last"]
    assert rings == lagging                                     # ... its queue's new messages kept ready
