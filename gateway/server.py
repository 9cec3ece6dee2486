"""The embedded gateway: store + light queues + notify bus + MQTT listener in one process.

`Gateway(cfg)` is what `lmqtt serve` runs and what tests may build in-process. Start order matters:
the light-queue store registers its dispatcher before `store.start()` (recovery re-dispatches), the
notify bus is attached before the first publish, and the listener opens last; stop is the reverse,
with the broker persisting sessions/offsets before the store flushes and closes.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from lmqtt.gateway.broker import Broker
from lmqtt.gateway.config import GatewayConfig
from lmqtt.gateway.connection import MQTTConnection
from lmqtt.gateway.metrics import GatewayMetrics
from lmqtt.notify import InProcessBus

log = logging.getLogger("lmqtt.gateway")


class Gateway:
    def __init__(self, cfg: GatewayConfig, metrics: GatewayMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or GatewayMetrics()
        self.store = None
        self.lq = None
        self.bus: InProcessBus | None = None
        self.broker: Broker | None = None
        self.server: asyncio.base_events.Server | None = None
        self.address: tuple[str, int] | None = None

    async def start(self) -> None:
        from lmqtt.lightqueue import LightQueueStore
        from lmqtt.store import MessageStore, StoreConfig

        cfg = self.cfg
        loop = asyncio.get_running_loop()
        data = Path(cfg.data_dir)
        data.mkdir(parents=True, exist_ok=True)
        scfg = StoreConfig(data_dir=str(data / "store"), flush_mode=cfg.flush_mode,
                           segment_size=int(cfg.segment_mb) << 20)
        if cfg.dispatch_inline:
            scfg.dispatch_inline = True
        self.store = MessageStore(scfg)
        self.lq = LightQueueStore(self.store, str(data / "lightqueue"), metadata_sync=cfg.metadata_sync,
                                  cache_bytes=int(cfg.lq_cache_mb) << 20,
                                  # the store's just-appended records: the same budget as the
                                  # delivery ring (a quarter of lq_cache_mb), so one knob sizes
                                  # every message cache
                                  recent_bytes=(int(cfg.lq_cache_mb) << 20) // 4)
        self.bus = InProcessBus(loop, cfg.notify_window_ms / 1000.0)
        self.lq.add_listener(self.bus.publish)
        self.store.start()
        try:
            self.broker = Broker(cfg, self.store, self.lq, loop, self.metrics)
            self.bus.subscribe(self.broker.delivery.on_queues)
            self.broker.publisher.after_append = self.bus.drain
            self.broker.start()
            self.server = await loop.create_server(lambda: MQTTConnection(self.broker), cfg.host, cfg.port,
                                                   reuse_address=True, backlog=1024)
        except BaseException:
            self._close_storage()
            raise
        sock = self.server.sockets[0]
        self.address = sock.getsockname()[:2]

    async def stop(self) -> None:
        """Stop accepting, close sessions (persisting offsets), flush and close the store."""
        if self.server is not None:
            self.server.close()
        if self.broker is not None:
            await self.broker.shutdown()
        if self.server is not None:
            try:
                await asyncio.wait_for(self.server.wait_closed(), 2.0)
            except (asyncio.TimeoutError, Exception):
                pass
        self._close_storage()

    def _close_storage(self) -> None:
        if self.bus is not None:
            self.bus.close()
        if self.store is not None:
            try:
                self.store.shutdown()
            except Exception as e:
                log.error("event=store_shutdown_failed error=%r", e)
        if self.lq is not None:
            try:
                self.lq.close()
            except Exception as e:
                log.error("event=lightqueue_close_failed error=%r", e)
        self.store = self.lq = None
