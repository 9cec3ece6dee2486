"""`lmqtt bench compare`'s embedded `lmqtt` broker takes a free store port, not the default 10911.

README's walk runs `lmqtt serve` (store port 10911), then `lmqtt bench compare --brokers lmqtt,...`:
the compared `lmqtt serve` used to ask for 10911 too, so it could not start beside the user's
server (or beside another comparison), and an SDK client of the user's 10911 reached the
benchmark's store instead. Two harness brokers at once must both run and carry messages."""
from __future__ import annotations

import psutil

from lmqtt.loadtest import brokers
from tests.support import Paho


def _store_ports(rb: brokers.RunningBroker) -> set[int]:
    proc = psutil.Process(rb.pid)
    return {c.laddr.port for c in proc.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN} - {rb.port}


def test_two_compared_lmqtt_brokers_run_side_by_side_on_their_own_store_ports(tmp_path):
    first = brokers.start("lmqtt", tmp_path / "a")
    try:
        second = brokers.start("lmqtt", tmp_path / "b")
        try:
            assert "--store-port" in first.argv and "--store-port" in second.argv
            assert 10911 not in _store_ports(first) | _store_ports(second)
            for i, rb in enumerate((first, second)):
                sub = Paho(rb, f"side-sub-{i}")
                sub.subscribe("side/#", 1)
                pub = Paho(rb, f"side-pub-{i}")
                pub.publish("side/x", b"%d" % i, qos=1)
                assert [m.payload for m in sub.get_n(1)] == [b"%d" % i]
                pub.disconnect()
                sub.disconnect()
        finally:
            second.stop()
    finally:
        first.stop()
