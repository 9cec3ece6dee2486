"""lmqtt notify package: topic events from dispatch to gateways.

`InProcessBus` is the embedded (`lmqtt serve`) bus; the Redis bus for scale-out has the same shape.
"""
from .bus import InProcessBus

__all__ = ["InProcessBus"]
