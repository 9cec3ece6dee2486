"""What a running `lmqtt gateway` has loaded, not only what its source names: the layering test
(test_layering.py) reads imports, but a package's `__init__` can pull the engine in behind a
vocabulary import (`from lmqtt.lightqueue import topics` used to run lightqueue/__init__.py, which
imported the index and RocksDB). A fleet gateway keeps no store state: it must not
load RocksDB, the light queues' index or the CommitLog. Checked on a real gateway process over a
real `lmqtt store`, through /proc/PID/maps (the compiled libraries it mapped) and through the
modules a probe imports the way the gateway does.
"""
from __future__ import annotations

import json
import subprocess
import sys

import paho.mqtt.client as mqtt

from tests.support import fleet_of

ENGINE = ("lmqtt.lightqueue.index", "lmqtt.lightqueue.light_queue_store", "lmqtt.lightqueue.metadata",
          "lmqtt.store.commitlog", "lmqtt.store.message_store", "lmqtt.store.consume_queue",
          "lmqtt.store.mapped_file", "rocksdict")


def _mapped(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_a_running_fleet_gateway_maps_no_rocksdb(tmp_path):
    with fleet_of(tmp_path, n=1) as (store, gw):
        # traffic through the gateway: a subscribe and a publish (the delivery path's imports too)
        got = []
        sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="rt-sub", protocol=mqtt.MQTTv5)
        sub.on_message = lambda c, u, m: got.append(m.payload)
        sub.connect(gw.host, gw.port)
        sub.loop_start()
        sub.subscribe("rt/#", qos=1)
        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="rt-pub", protocol=mqtt.MQTTv5)
        pub.connect(gw.host, gw.port)
        pub.loop_start()
        import time
        deadline = time.time() + 15
        while not got and time.time() < deadline:
            pub.publish("rt/a", b"x", qos=1).wait_for_publish(5)
            time.sleep(0.2)
        for c in (pub, sub):
            c.loop_stop()
            c.disconnect()
        assert got, "no message through the gateway"
        assert "rocksdict" not in _mapped(gw.proc.pid), "the gateway process mapped RocksDB"
        assert "rocksdict" in _mapped(store.proc.pid), "the check sees RocksDB where it is loaded"


def test_the_gateways_rooms_import_no_engine_module():
    """Every room below gateway/app and the fleet gateway's composition, imported in a fresh
    interpreter: none of the engine's modules is loaded (the import-time view of the same rule)."""
    probe = ("import sys, json\n"
             "import lmqtt.gateway.broker.broker, lmqtt.gateway.storage.remote_store, lmqtt.gateway.fleet.sessions\n"
             "import lmqtt.gateway.fleet.group_leases, lmqtt.gateway.delivery.engine, lmqtt.gateway.net.connection\n"
             "import lmqtt.gateway.app.gateway, lmqtt.gateway.app.gateway_command\n"
             f"print(json.dumps(sorted(m for m in {ENGINE!r} if m in sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
    # and the probe sees them where they are loaded
    seen = subprocess.run([sys.executable, "-c", "import sys, json; import lmqtt.lightqueue.light_queue_store; "
                           f"print(json.dumps(sorted(m for m in {ENGINE!r} if m in sys.modules)))"],
                          capture_output=True, text=True, timeout=60)
    assert "rocksdict" in json.loads(seen.stdout)
