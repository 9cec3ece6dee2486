"""`InProcessQueues` (store/node/inprocess.py), the in-process `QueueStore` of the gateway, over a real
MessageStore and LightQueueStore in a tmp dir."""
from __future__ import annotations

import time

import pytest

from lmqtt.gateway.storage.facades import QueueStore
from lmqtt.store.node.inprocess import storage as in_process_storage


def test_in_process_store_appends_notifies_pulls_and_registers_filters(tmp_path):
    from lmqtt.lightqueue import LightQueueStore
    from lmqtt.store import Message, MessageStore, StoreConfig

    store = MessageStore(StoreConfig(data_dir=str(tmp_path / "store"), segment_size=16 << 20))
    lq = LightQueueStore(store, str(tmp_path / "lq"))
    bundle = in_process_storage(store, lq)
    api: QueueStore = bundle.queues
    seen: list[set] = []
    api.on_new_data(lambda names: seen.append(set(names)))
    store.start()
    try:
        filters = bundle.filters
        assert filters.register("s/+").result() == 1                            # in-process: answered at once
        assert filters.registered().result() == {"s/+": 1}
        queues = api.queues_for_topic("s/1")
        assert set(queues) == {"s/1", "s/+"}
        res = api.append_batch([Message("s/1", b"hello", 0, 0, b"", (), int(time.time() * 1000), queues)])
        res[-1].durable.result(timeout=10)
        for _ in range(5000):
            if api.all_visible():
                break
            time.sleep(0.001)
        assert api.all_visible()
        assert {"s/1", "s/+"} <= set().union(*seen)       # "queues have new data" for both
        for q in ("s/1", "s/+"):
            assert api.max_offset(q).result() == 1          # in-process: answered at once
            pulled = api.pull(q, 0).result()
            assert [(m.topic, m.body) for m in pulled.messages] == [("s/1", b"hello")]
        assert bundle.retained.set("s/1", b"kept", b"").done()          # in-process: answered at once
        assert [(t, p) for t, p, _props in bundle.retained.matching("s/#").result()] == [("s/1", b"kept")]
        assert filters.unregister("s/+").result() == 0
        assert filters.registered().result() == {}
        assert api.queues_for_topic("s/1") == ("s/1",)
    finally:
        store.shutdown()
        lq.close()


def test_a_remote_history_is_read_ahead_and_a_failed_read_is_asked_again():
    """`ReplayPlan` over `read_later` (a fleet gateway's `$replay/` history): `read` never waits.
    It answers None while a chunk is on its way and `on_ready` says when it came; chunks are read
    ahead (up to AHEAD, each asked for with the cursor the one before returned) while the gateway
    sends; a failed read raises once, after the chunks already in, and is asked for again from
    where the history stands."""
    import asyncio

    from lmqtt.gateway.storage.facades import ReplayPlan

    async def go():
        loop = asyncio.get_running_loop()
        asked: list = []

        def read_later(cursor, n):
            f = loop.create_future()
            asked.append((cursor, f))
            return f

        async def answer(i, result=None, error=None):
            f = asked[i][1]
            f.set_exception(error) if error else f.set_result(result)
            await asyncio.sleep(0)

        plan = ReplayPlan({"source": "log", "live_offset": 9, "cursor": {"at": 0}}, read_later=read_later)
        ready: list = []
        plan.on_ready = lambda: ready.append(1)
        assert plan.read() is None and plan.read() is None and len(asked) == 1   # one read in flight
        await answer(0, (["m0", "m1"], {"at": 2}, False))
        assert ready == [1] and [c for c, _ in asked] == [{"at": 0}, {"at": 2}]  # the next asked at once
        await answer(1, (["m2"], {"at": 3}, False))
        assert len(asked) == 2                              # two chunks ahead: no third yet
        assert plan.read() == ["m0", "m1"] and plan.cursor == {"at": 2}
        assert asked[2][0] == {"at": 3}                     # room again: asked from the newest cursor
        await answer(2, error=ConnectionError("store gone"))
        assert plan.read() == ["m2"] and plan.cursor == {"at": 3}    # what came in goes first
        with pytest.raises(ConnectionError):
            plan.read()
        assert plan.read() is None and asked[3][0] == {"at": 3}       # asked again, same cursor
        await answer(3, (["m3"], None, True))
        assert plan.read() == ["m3"] and plan.done and plan.read() == [] and len(asked) == 4
    asyncio.run(go())
