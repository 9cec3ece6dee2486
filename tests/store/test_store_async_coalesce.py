"""The asyncio API coalesces concurrent appends of one loop tick into one batch, without letting one
writer's bad message fail the others, and each writer still gets only its own results."""
from __future__ import annotations

import asyncio

import pytest

from lmqtt.store import InvalidTopic, Message, MessageStore, StoreConfig


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_concurrent_writers_share_batches_and_get_their_own_results(tmp_path, mode):
    st = MessageStore(StoreConfig(data_dir=str(tmp_path / "s"), segment_size=1 << 20, max_message_size=4096, flush_mode=mode))
    st.start()
    try:
        async def writer(w: int):
            out = []
            for i in range(20):
                if i % 2:
                    out.append(await st.append_async(Message(topic=f"w{w}", body=b"%d-%d" % (w, i))))
                else:
                    out.extend(await st.append_batch_async([Message(topic=f"w{w}", body=b"%d-%d" % (w, i))]))
            return out

        async def main():
            return await asyncio.gather(*[writer(w) for w in range(16)])

        per_writer = asyncio.run(main())
        last = max(r.phys_offset + r.size for rs in per_writer for r in rs)
        if mode == "sync":
            assert st.flushed_offset >= last  # every awaited append was durable when it returned
        assert st.wait_dispatched(last, 10)
        for w, rs in enumerate(per_writer):
            assert [st.read(r.phys_offset).body for r in rs] == [b"%d-%d" % (w, i) for i in range(20)]
            assert [r.queue_offset for r in rs] == list(range(20))  # per-topic order kept
    finally:
        st.shutdown()


def test_one_bad_message_fails_only_its_own_writer(tmp_path):
    st = MessageStore(StoreConfig(data_dir=str(tmp_path / "s"), segment_size=1 << 20, max_message_size=4096))
    st.start()
    try:
        async def main():
            return await asyncio.gather(
                st.append_async(Message(topic="ok", body=b"a")),
                st.append_async(Message(topic="bad\x00topic", body=b"b")),
                st.append_batch_async([Message(topic="ok", body=b"c"), Message(topic="ok", body=b"d")]),
                return_exceptions=True)

        a, bad, cd = asyncio.run(main())
        assert isinstance(bad, InvalidTopic)
        assert st.wait_dispatched(cd[-1].phys_offset + cd[-1].size, 10)
        assert [m.body for m in st.read_consume_queue("ok", 0, 0, 10)] == [b"a", b"c", b"d"]
    finally:
        st.shutdown()
