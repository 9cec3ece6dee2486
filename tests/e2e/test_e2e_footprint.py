"""A fresh data dir of `lmqtt serve` and of `lmqtt store` with their default sizes, holding a
handful of messages, takes tens of MB on disk, not hundreds (docs/store.md "Data dir footprint"):
a new user's laptop pays one 32 MiB CommitLog segment and small ConsumeQueue files, and an idle
broker's `$SYS` updates do not add a ConsumeQueue of their own."""
from __future__ import annotations

import time

from lmqtt.store.client import connect
from tests.support import LmqttServer, LmqttStore, Paho, disk_usage

BOUND = 48 << 20


def test_fresh_lmqtt_serve_data_dir_after_ten_messages_is_tens_of_mb(tmp_path):
    srv = LmqttServer(str(tmp_path / "data"), log_path=str(tmp_path / "serve.log"))
    # spawn, not start(): start() pins a small segment size, this keeps the command's default
    srv.spawn(["serve", "--host", srv.host, "--port", str(srv.port), "--data-dir", srv.data_dir,
               "--metrics-port", "0", "--store-port", str(srv.store_port), "--sys-interval", "0.2"],
              (srv.port, srv.store_port))
    try:
        pub = Paho(srv, client_id="pub", version=5)
        for i in range(10):
            pub.publish(f"home/room{i % 3}/temp", b"21.5" * 25, qos=1)
        pub.disconnect()
        time.sleep(1.0)              # a few $SYS ticks
        used = disk_usage(srv.data_dir)
        assert used < BOUND, f"fresh `lmqtt serve` data dir: {used / 2**20:.1f} MiB"
    finally:
        assert srv.stop() == 0, srv.log_tail()


def test_fresh_lmqtt_store_data_dir_after_ten_messages_is_tens_of_mb(tmp_path):
    srv = LmqttStore(str(tmp_path / "data"), log_path=str(tmp_path / "store.log"))
    srv.spawn(["store", "--host", srv.host, "--port", str(srv.port), "--data-dir", srv.data_dir], (srv.port,))
    c = connect(srv.address)
    try:
        producer = c.producer()
        for i in range(10):
            producer.send(f"orders/{i % 3}", b"x" * 100, keys=[f"order-{i}"])      # keys: a key index file
        used = disk_usage(srv.data_dir)
        assert used < BOUND, f"fresh `lmqtt store` data dir: {used / 2**20:.1f} MiB"
    finally:
        c.close()
        assert srv.stop() == 0, srv.log_tail()
