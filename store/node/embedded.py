"""The store node inside `lmqtt serve`: `lmqtt serve` is a gateway over an in-process store node.

Why here and not in the gateway: the store node (`lmqtt store`, this package) is what composes the
engine (`MessageStore`, its tier), the light queues (`LightQueueStore`, RocksDB) and the notify bus;
the gateway's rooms, its composition root `lmqtt.gateway.app` included, never import them
(tests/architecture/test_layering.py). `lmqtt serve` runs the same gateway as `lmqtt gateway`, with
this node in its process instead of a socket away: `open_embedded(cfg, loop)` opens and starts it
and hands the gateway what it uses -

  storage         the storage facades (gateway/storage/facades.py) in-process (store/node/inprocess.py):
                  what the broker reads and writes, the only way the gateway reaches the data
  append_listener the notify bus, drained by the broker's publisher after each append
  attach()        the broker's hooks: flush the routed publishes before an SDK registration, and
                  where "queue has new data" events go
  stats(), tier_stats(), topic_ends(), session_page()  what the console and $SYS read of the store
  trace()         the console's tracer: a filter's history read from the ConsumeQueues, then followed
  sdk_server()    the embedded SDK port (`--store-port`): the node's StoreServer with the light
                  queues plugged in (store/node/sdk_service.py)
  close()         flush and close, the reverse of the open

Start order matters: the light-queue store registers its dispatcher before `store.start()`
(recovery re-dispatches) and the notify bus listens before the first publish; close is the reverse.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable

from lmqtt.gateway.storage.facades import Storage
from lmqtt.lightqueue import LightQueueStore, history
from lmqtt.lightqueue.replay import read_history
from lmqtt.lightqueue.topics import validate_filter
from lmqtt.notify import InProcessBus
from lmqtt.store import MessageStore, StoreConfig
from lmqtt.store.node.config import retention_ms
from lmqtt.store.node.inprocess import storage as in_process_storage
from lmqtt.store.node.sdk_service import install
from lmqtt.store.node.tier_parquet import attach_parquet
from lmqtt.store.server import StoreServer
from lmqtt.store.tier.config import TierConfig

log = logging.getLogger("lmqtt.gateway")


class HistoryTrace:
    """A filter's messages from `since_ms` on, read from the embedded store's ConsumeQueues (the
    same history read as `$replay/` and the SDK's `since`: lightqueue/history.py and
    replay.read_history) and then followed as they arrive. Nothing is registered in the store (no
    light queue is created for the filter): each poll reads the ConsumeQueues of the filter's
    first-level topics from where the last one stopped, so a first-level topic that appears after
    the start is read from `since_ms` too."""

    def __init__(self, store: Any, flt: str, since_ms: int) -> None:
        validate_filter(flt)            # InvalidTopicFilter (a ValueError) with the reason
        self.store, self.flt, self.since_ms = store, flt, int(since_ms)
        self.cursor: dict = {"filter": flt, "seam": 1 << 62, "end": 1 << 62, "sources": []}
        self._known: set[tuple[str, int]] = set()

    def _refresh_sources(self) -> None:
        for fl, qid in history.sources(self.store, self.flt):
            if (fl, qid) not in self._known:
                self._known.add((fl, qid))
                self.cursor["sources"].append([fl, qid, history.cq_offset_for_time(self.store, fl, qid, self.since_ms)])

    def poll(self, max_count: int = 200) -> list:
        """The next messages (StoredMessage: topic, props, body, store_ts), at most `max_count`."""
        self._refresh_sources()
        if not self.cursor["sources"]:
            return []
        msgs, self.cursor, _done = read_history(self.store, self.cursor, max_count=max_count)
        return msgs


class EmbeddedStore:
    """The opened and started store node of `lmqtt serve` (see the module docstring)."""

    def __init__(self, store: Any, lq: Any, bus: Any) -> None:
        self.store = store          # MessageStore: the node's own (and in-process tests')
        self.lq = lq                # LightQueueStore
        self.bus = bus              # notify.InProcessBus
        self.storage: Storage = in_process_storage(store, lq)
        self.append_listener = bus           # drain() after each append, drain_follows
        from lmqtt.store.node.security_service import SecurityDocs  # live users and ACL rules: --live-security only
        self.security = SecurityDocs(lq.metadata)   # users and ACL rules managed live (--live-security)

    def attach(self, flush_before_register: Callable[[], Any], on_queues: Callable[[Iterable[str]], None]) -> None:
        """The broker's hooks: registrations by SDK consumers (the store port) append the routed
        publishes first; "queue has new data" events reach the delivery engine."""
        self.lq.before_register = flush_before_register
        self.bus.subscribe(on_queues)

    # ------------------------------------------------------------------ what the console reads
    def stats(self) -> dict:
        """The store's counters (log end, dispatch lag, segments, disk, recoveries ...)."""
        return dict(self.store.stats())

    def tier_stats(self) -> dict | None:
        """The tier's use, None without --tier."""
        return self.store.tier_stats()

    @property
    def open_files_share(self) -> int:
        """The descriptors the store may hold (store/file_budget.py): the gateway's sockets get
        what the process limit leaves."""
        return self.store.budget.total

    def topic_ends(self) -> dict[tuple[str, int], int]:
        """{(first-level topic, queue id): end} of every ConsumeQueue."""
        return self.store.consume_queues.max_offsets()

    def session_page(self, limit: int) -> list:
        """The first `limit` persistent session records (SessionRecord), in client id order."""
        return self.lq.metadata.list_sessions(None, limit)

    def trace(self, flt: str, since_ms: int) -> HistoryTrace:
        return HistoryTrace(self.store, flt, since_ms)

    # ------------------------------------------------------------------ the SDK port
    def sdk_server(self, data_dir: str, host: str, port: int, token: str | None) -> Any:
        """The embedded SDK port: a StoreServer over this node's store, with the light queues'
        CALLs and routing (store/node/sdk_service.py); not listening yet (`await .start()`).
        ValueError for a non-loopback host without a token; OSError for its metadata file."""
        srv = StoreServer(self.store, os.path.join(data_dir, "sdk-meta"), host=host, port=port, token=token)
        try:
            install(srv, self.lq)
            from lmqtt.store.node import security_service  # live users and ACL rules: --live-security only
            security_service.install(srv, self.security)
        except BaseException:
            srv.meta.close()
            raise
        return srv

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Flush and close: the bus, the store (its last flush), the light queues. A failure is
        logged and the rest still closes."""
        self.bus.close()
        try:
            self.store.shutdown()
        except Exception as e:  # noqa: BLE001 - the light queues still close
            log.error("event=store_shutdown_failed error=%r", e)
        try:
            self.lq.close()
        except Exception as e:  # noqa: BLE001
            log.error("event=lightqueue_close_failed error=%r", e)


def open_embedded(cfg: Any, loop: Any) -> EmbeddedStore:
    """Open and start the store node of `lmqtt serve` in `cfg.data_dir` (a GatewayConfig's store
    settings: flush_mode, segment_mb, dispatch_inline, tier*, metadata_sync, lq_cache_mb,
    notify_window_ms), its notify bus on `loop`. What it opened is closed again if a later step fails."""
    data = Path(cfg.data_dir)
    data.mkdir(parents=True, exist_ok=True)
    scfg = StoreConfig(data_dir=str(data / "store"), flush_mode=cfg.flush_mode, segment_size=int(cfg.segment_mb) << 20,
                       retention_ms=retention_ms(cfg.retention), max_open_files=int(cfg.max_open_files))
    if cfg.dispatch_inline:
        scfg.dispatch_inline = True
    store = MessageStore(scfg)
    lq = bus = None
    try:
        if cfg.tier:       # tiered storage (store/tier; checked by GatewayConfig.validate)
            store.enable_tier(TierConfig.from_flags(cfg.tier, cfg.tier_endpoint, cfg.local_retention,
                                                    cfg.tier_retention, cfg.tier_cache_mb,
                                                    cfg.tier_parquet_file_mb, cfg.tier_parquet_merge_after_s))
            attach_parquet(store, cfg.tier_parquet)
        lq = LightQueueStore(store, str(data / "lightqueue"), metadata_sync=cfg.metadata_sync,
                             cache_bytes=int(cfg.lq_cache_mb) << 20)
        bus = InProcessBus(loop, cfg.notify_window_ms / 1000.0)
        lq.add_listener(bus.publish)
        store.start()
    except BaseException:
        if bus is not None:
            bus.close()
        for close in (store.shutdown, lq.close if lq is not None else None):
            if close is not None:
                try:
                    close()
                except Exception as e:  # noqa: BLE001 - the first failure is the one raised
                    log.debug("event=embedded_open_cleanup_failed error=%r", e)
        raise
    return EmbeddedStore(store, lq, bus)


__all__ = ["EmbeddedStore", "HistoryTrace", "open_embedded"]
