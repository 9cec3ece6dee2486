"""The Python SDK of the lmqtt store (docs/sdk.md).

    from lmqtt.store.client import connect
    c = connect("127.0.0.1:10911")
    r = c.producer().send("sensors/a/temp", b"21.5")
    for rec in c.pull("sensors", 0, 0).records: ...

Layers as in redis-py: `connection.py` (framing, pipelining, reconnect with backoff; sync) and
`aio.py` (asyncio), over `errors.py`, `handshake.py` and `failover.py`; then the command API on
top (`producer.py`, `consumer.py`, `admin.py`; asyncio: `aio_api.py`).
"""
import importlib
from typing import TYPE_CHECKING

# where each name of the API lives: imported on first use (PEP 562), so that importing one
# submodule (the gateway reads `lmqtt.store.client.props`) does not import the connections, the
# producers and the consumers (~40 ms of an `lmqtt serve` start)
_WHERE = {
    "connection": ("Connection", "connect"),
    "aio": ("AsyncConnection", "connect_async"),
    "errors": ("ConnectionLost", "DiskFull", "StoreClientError"),
    "failover": ("parse_address",),
    "consumer": ("FilterConsumer", "PopConsumer", "PullConsumer", "PullResult", "Record"),
    "producer": ("AutoBatchProducer", "Producer", "SendResult"),
    "aio_api": ("AsyncFilterConsumer", "AsyncPopConsumer", "AsyncProducer", "AsyncPullConsumer"),
}
_MODULE_OF = {name: mod for mod, names in _WHERE.items() for name in names}

__all__ = ["connect", "connect_async", "parse_address", "Connection", "AsyncConnection", "ConnectionLost",
           "StoreClientError", "DiskFull", "Producer", "AutoBatchProducer", "SendResult", "PullConsumer",
           "FilterConsumer", "PopConsumer", "PullResult", "Record", "AsyncProducer", "AsyncPullConsumer",
           "AsyncFilterConsumer", "AsyncPopConsumer"]


def __getattr__(name: str):
    mod = _MODULE_OF.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from .aio import AsyncConnection, connect_async
    from .connection import Connection, connect
    from .errors import ConnectionLost, DiskFull, StoreClientError
    from .failover import parse_address
    from .aio_api import AsyncFilterConsumer, AsyncPopConsumer, AsyncProducer, AsyncPullConsumer
    from .consumer import FilterConsumer, PopConsumer, PullConsumer, PullResult, Record
    from .producer import AutoBatchProducer, Producer, SendResult
