"""Bad input is rejected with a clear error and leaves nothing behind; the store keeps working."""
from __future__ import annotations

import pytest

from lmqtt.store import (InvalidMessage, InvalidTopic, Message, MessageStore, MessageTooLarge, StoreClosed,
                         StoreConfig, StoreError)


@pytest.fixture
def st(tmp_path):
    s = MessageStore(StoreConfig(data_dir=str(tmp_path / "s"), segment_size=1 << 20, max_message_size=4096,
                                 index_slots=64, index_entries=1024))
    s.start()
    yield s
    s.shutdown()


BAD = [
    (Message(topic="t", body=b"x" * 5000), MessageTooLarge, "max_message_size"),
    (Message(topic="", body=b"x"), InvalidTopic, "non-empty"),
    (Message(topic="a\x00b", body=b"x"), InvalidTopic, "NUL"),
    (Message(topic="t" * 5000, body=b"x"), InvalidTopic, "limit"),
    (Message(topic="t", body=b"x", keys=("a\x00b",)), InvalidMessage, "keys"),
    (Message(topic="t", body=b"x", keys=("",)), InvalidMessage, "keys"),
    (Message(topic="t", body=b"x", dispatch_queues=("q\x00",)), InvalidMessage, "dispatch_queues"),
    (Message(topic="t", body="text, not bytes"), InvalidMessage, "bytes-like"),
    (Message(topic="t", body=b"x", queue_id=-1), InvalidMessage, "out of range"),
    (Message(topic="t", body=b"x", flags=1 << 32), InvalidMessage, "out of range"),
]


@pytest.mark.parametrize("bad,exc,words", BAD, ids=[b[1].__name__ + "-" + b[2] for b in BAD])
def test_bad_message_rejected_and_nothing_else_affected(st, bad, exc, words):
    good = st.append(Message(topic="t", body=b"before"))
    end = st.max_offset
    with pytest.raises(exc, match=words):
        st.append(bad)
    # a batch containing it is rejected as a whole
    with pytest.raises(exc):
        st.append_batch([Message(topic="t", body=b"ok1"), bad, Message(topic="t", body=b"ok2")])
    assert st.max_offset == end
    after = st.append(Message(topic="t", body=b"after"))
    assert after.phys_offset == end and after.queue_offset == good.queue_offset + 1
    assert st.wait_dispatched(after.phys_offset + after.size, 10)
    assert [m.body for m in st.read_consume_queue("t", 0, 0, 10)] == [b"before", b"after"]
    assert issubclass(exc, StoreError)


def test_message_at_exactly_the_limit_is_accepted(st):
    r = st.append(Message(topic="t", body=b""))
    over = 4096 - r.size
    r2 = st.append(Message(topic="t", body=b"y" * over))
    assert r2.size == 4096
    with pytest.raises(MessageTooLarge):
        st.append(Message(topic="t", body=b"y" * (over + 1)))


def test_config_rejects_nonsense(tmp_path):
    with pytest.raises(ValueError, match="flush_mode"):
        StoreConfig(data_dir=str(tmp_path), flush_mode="fast")
    with pytest.raises(ValueError, match="segment_size"):
        StoreConfig(data_dir=str(tmp_path), segment_size=1000)
    with pytest.raises(ValueError, match="max_message_size"):
        StoreConfig(data_dir=str(tmp_path), segment_size=8192, max_message_size=8192)


def test_append_before_start_and_after_shutdown(tmp_path):
    s = MessageStore(StoreConfig(data_dir=str(tmp_path / "s"), segment_size=1 << 20, max_message_size=4096))
    with pytest.raises(StoreClosed):
        s.append(Message(topic="t", body=b"x"))
    s.start()
    s.shutdown()
    with pytest.raises(StoreClosed):
        s.append(Message(topic="t", body=b"x"))


def test_bad_dispatcher_rejected(tmp_path):
    s = MessageStore(StoreConfig(data_dir=str(tmp_path / "s"), segment_size=1 << 20, max_message_size=4096))
    with pytest.raises(TypeError, match="Dispatcher protocol"):
        s.add_dispatcher(object())
