"""lmqtt notify package: "queue has new data" events from dispatch to gateways.

`InProcessBus` is the embedded (`lmqtt serve`) bus; `RedisEventPublisher` / `RedisEventSubscriber`
carry the same events across processes over Redis pub/sub (broadcast or precise mode).
"""
from .bus import InProcessBus
from .redis_bus import RedisEventPublisher, RedisEventSubscriber

__all__ = ["InProcessBus", "RedisEventPublisher", "RedisEventSubscriber"]
