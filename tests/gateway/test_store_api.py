"""`InProcessStore`, the in-process implementation of the gateway's store interface, over a real
MessageStore and LightQueueStore in a tmp dir."""
from __future__ import annotations

import time

from lmqtt.gateway.store_api import GatewayStore, InProcessStore


def test_in_process_store_appends_notifies_pulls_and_registers_filters(tmp_path):
    from lmqtt.lightqueue import LightQueueStore
    from lmqtt.store import Message, MessageStore, StoreConfig

    store = MessageStore(StoreConfig(data_dir=str(tmp_path / "store"), segment_size=16 << 20))
    lq = LightQueueStore(store, str(tmp_path / "lq"))
    api: GatewayStore = InProcessStore(store, lq)
    seen: list[set] = []
    api.on_new_data(lambda names: seen.append(set(names)))
    store.start()
    try:
        assert api.register_filter("s/+") == 1
        assert api.registered_filters() == {"s/+": 1}
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
            assert api.max_offset(q) == 1
            pulled = api.pull(q, 0)
            assert [(m.topic, m.body) for m in pulled.messages] == [("s/1", b"hello")]
        api.metadata.set_retained("s/1", b"kept", b"")
        assert [(t, p) for t, p, _props in api.metadata.retained_matching("s/#")] == [("s/1", b"kept")]
        assert api.unregister_filter("s/+") == 0
        assert api.registered_filters() == {}
        assert api.queues_for_topic("s/1") == ("s/1",)
    finally:
        store.shutdown()
        lq.close()
