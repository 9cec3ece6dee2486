"""`--tier-parquet auto|on|off`: the tier service's columnar hook, shared by `lmqtt store`
(store/node/command.py) and `lmqtt serve`'s embedded store (gateway/app/gateway.py).

The hook is the tier's Parquet writer (lmqtt.store.tier.parquet, docs/spark.md),
imported only here: it needs pyarrow, which the store itself does not. `auto`: on when pyarrow is
importable; `on` without pyarrow is refused when the configuration is checked
(lmqtt.store.tier.config.parquet_problem), before the data dir is touched.
"""
from __future__ import annotations

import logging

from lmqtt.store.tier.parquet import ColumnarWriter, available

log = logging.getLogger("lmqtt.store")


def attach_parquet(store, mode: str | None) -> bool:
    """Give `store.tier` (enabled) the Parquet writer unless `mode` is off; True when it has one."""
    if mode == "off" or getattr(store, "tier", None) is None:
        return False
    why = available()
    if why is not None:
        if mode == "on":            # the config check said yes a moment ago: pyarrow broke since
            raise RuntimeError(f"--tier-parquet on: {why}")
        log.info("tier: no Parquet copy for Spark (--tier-parquet auto): %s", why)
        return False
    store.tier.columnar = ColumnarWriter(store)
    return True
