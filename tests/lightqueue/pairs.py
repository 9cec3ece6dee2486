"""A real MessageStore with a LightQueueStore over it, for the light-queue tests (the `pair`
fixture is in this folder's conftest.py)."""
from __future__ import annotations

from lmqtt.lightqueue import LightQueueStore
from lmqtt.store import Message, MessageStore, StoreConfig


def open_pair(tmp_path, **kw):
    """(MessageStore, LightQueueStore) in `tmp_path`, not started; `kw`: more StoreConfig fields
    (segment_size defaults to 16 MiB)."""
    st = MessageStore(StoreConfig(data_dir=str(tmp_path / "store"), segment_size=kw.pop("segment_size", 1 << 24),
                                  preallocate=False, **kw))
    lq = LightQueueStore(st, str(tmp_path / "lq"))
    return st, lq


def publish(st, lq, topic, body, **kw):
    """Append a message to every light queue its topic matches, and wait until it is dispatched;
    `kw`: more Message fields (queue_id, keys ...)."""
    r = st.append(Message(topic=topic, body=body, dispatch_queues=lq.queues_for_topic(topic), **kw))
    assert st.wait_dispatched(r.phys_offset + r.size, 10)
    return r
