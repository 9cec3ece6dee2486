"""A fleet on a network bed for the partition tests: a store group of 3, two gateways, Redis and
the chaos clients, each on its own namespace host, under QoS 1 MQTT, SDK and POP load
(loadtest/chaos/partitions.py, partition_round.py). Skipped, with the reason, where namespaces
cannot be made (not root, no iptables) or redis-server is missing."""
from __future__ import annotations

import os
import shutil

import pytest

from lmqtt.loadtest.chaos import netbed

WHY = netbed.available() or (None if shutil.which("redis-server") else "redis-server is not installed")
needs_bed = pytest.mark.skipif(WHY is not None, reason=f"no partition bed here: {WHY}")
# the long round (every fault kind not in the CI round, several of each): minutes, not run by CI
LONG = os.environ.get("LMQTT_PARTITIONS_LONG", "") not in ("", "0")
long_round = pytest.mark.skipif(not LONG, reason="the long partition round: set LMQTT_PARTITIONS_LONG=1 "
                                                 "(about 2.5 minutes)")


def fleet_round(tmp_path_factory, name: str):
    """(bed, fleet, round) with the load running; everything stopped and removed after."""
    from lmqtt.loadtest.chaos.partition_round import PartitionRound, RoundOptions
    from lmqtt.loadtest.chaos.partitions import PartitionedFleet
    work = tmp_path_factory.mktemp(name)
    lines: list[str] = []
    with netbed.NetBed(workdir=work, log=lines.append) as bed:
        fleet = PartitionedFleet(bed, work, log=lines.append)
        rnd = None
        try:
            fleet.start()
            rnd = PartitionRound(fleet, RoundOptions(interval=0.5, drain=60), log=lines.append)
            rnd.start_load()
            yield bed, fleet, rnd
        finally:
            if rnd is not None:
                rnd.stop()
            fleet.stop()
