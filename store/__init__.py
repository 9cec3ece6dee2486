"""lmqtt store: a write-once CommitLog with flush modes, dispatch, ConsumeQueues, a key index,
recovery and retention (modelled on Apache RocketMQ). The API is described in docs/internals.md;
the on-disk format and the flush modes' guarantees in docs/store.md.

The store never knows MQTT: topics are strings, `props` are opaque bytes.
"""
from .commitlog import ENCODER
from .config import StoreConfig
from .dispatch import Dispatcher
from .errors import (CorruptRecord, DiskFull, InvalidMessage, InvalidTopic, MessageTooLarge, NotVisible,
                     StoreClosed, StoreError)
from .message import AppendResult, DispatchRequest, Message, StoredMessage
from .message_store import MessageStore

__all__ = [
    "MessageStore", "StoreConfig", "Message", "StoredMessage", "DispatchRequest", "Dispatcher",
    "AppendResult", "StoreError", "MessageTooLarge", "InvalidTopic", "InvalidMessage", "DiskFull",
    "CorruptRecord", "NotVisible", "StoreClosed", "ENCODER",
]
