"""lmqtt store: a write-once CommitLog with flush modes, dispatch, ConsumeQueues, a key index,
recovery and retention (modelled on Apache RocketMQ). The API is described in docs/internals.md;
the on-disk format and the flush modes' guarantees in docs/store.md.

The store never knows MQTT: topics are strings, `props` are opaque bytes.
"""
from .lazy_exports import lazy_exports

# The API names load their modules on first use (PEP 562), so importing a part of the package
# (the SDK in `lmqtt.store.client`, the accelerator loader `lmqtt.store.accel` the MQTT codec
# uses) does not load the whole engine: ~50 ms and a dozen modules a client never runs.
_WHERE = {
    "ENCODER": ".commitlog", "StoreConfig": ".config", "Dispatcher": ".dispatch",
    "CorruptRecord": ".errors", "DiskFull": ".errors", "InvalidMessage": ".errors", "InvalidTopic": ".errors",
    "MessageTooLarge": ".errors", "NotVisible": ".errors", "StoreClosed": ".errors", "StoreError": ".errors",
    "AppendResult": ".message", "DispatchRequest": ".message", "Message": ".message", "StoredMessage": ".message",
    "MessageStore": ".message_store",
}

__getattr__ = lazy_exports(__name__, _WHERE, globals())


__all__ = [
    "MessageStore", "StoreConfig", "Message", "StoredMessage", "DispatchRequest", "Dispatcher",
    "AppendResult", "StoreError", "MessageTooLarge", "InvalidTopic", "InvalidMessage", "DiskFull",
    "CorruptRecord", "NotVisible", "StoreClosed", "ENCODER",
]
