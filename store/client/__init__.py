"""The Python SDK of the lmqtt store (docs/sdk.md).

    from lmqtt.store.client import connect
    c = connect("127.0.0.1:10911")
    r = c.producer().send("sensors/a/temp", b"21.5")
    for rec in c.pull("sensors", 0, 0).records: ...

Layers as in redis-py: `connection.py` (framing, pipelining, reconnect with backoff; sync and
asyncio), then the command API on top (`producer.py`, `consumer.py`, `admin.py`; asyncio:
`aio_api.py`).
"""
from .connection import (AsyncConnection, Connection, ConnectionLost, DiskFull, StoreClientError, connect,
                         connect_async, parse_address)
from .consumer import FilterConsumer, PopConsumer, PullConsumer, PullResult, Record
from .producer import AutoBatchProducer, Producer, SendResult
from .aio_api import AsyncFilterConsumer, AsyncPopConsumer, AsyncProducer, AsyncPullConsumer

__all__ = ["connect", "connect_async", "parse_address", "Connection", "AsyncConnection", "ConnectionLost",
           "StoreClientError", "DiskFull", "Producer", "AutoBatchProducer", "SendResult", "PullConsumer",
           "FilterConsumer", "PopConsumer", "PullResult", "Record", "AsyncProducer", "AsyncPullConsumer",
           "AsyncFilterConsumer", "AsyncPopConsumer"]
