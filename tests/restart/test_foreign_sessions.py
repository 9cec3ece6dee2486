"""Sessions by ownership: a fleet gateway restarted with 10,000 foreign sessions in the store
(records naming another gateway) restores only its own; a foreign client still resumes its session
when it connects to it. Real processes (a store, two gateways), kill -9 of the restarted gateway;
the start's duration is printed for the report, never asserted."""
from __future__ import annotations

import re
import time

from lmqtt.lightqueue.records import HOST, SessionRecord, Subscription
from lmqtt.store.client import connect
from tests.support import LmqttGateway, LmqttStore, Paho, listening, metric, stop_all

FOREIGN = 10_000


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_a_gateway_restarted_with_10000_foreign_sessions_restores_only_its_own(tmp_path):
    store = LmqttStore(str(tmp_path / "store"), log_path=str(tmp_path / "store.log")).start()
    a = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    b = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    try:
        for i in range(5):
            c = Paho(a, f"own-{i}", version=5, clean=False, expiry=3600)
            c.subscribe(f"own/{i}/#", 1)
            c.disconnect()
        real = Paho(b, "fx-real", version=5, clean=False, expiry=3600)
        real.subscribe("fx/real/+", 1)
        real.disconnect()
        b_id = f"test-{b.port}"
        b.stop()                                     # B is gone: its sessions stay in the store
        # 10,000 more records naming B, written through the store's metadata commands (as B would
        # have written them for clients that connected, subscribed and left)
        t0 = time.monotonic()
        with connect(store.address) as c:
            for i in range(FOREIGN - 1):
                flt = f"fx/{i}/+"
                rec = SessionRecord(f"fx-{i:05d}", 5, 3600, int(time.time() * 1000), [Subscription(flt, 1)],
                                    {"inflight": {"out": [], "next": {flt: 0}, "in2": [], "pid": 1}, HOST: b_id})
                c.cmd("gw_put_session", client_id=rec.client_id, rec=rec.to_bytes().decode())
        print(f"\n{FOREIGN - 1} foreign records written in {time.monotonic() - t0:.1f} s")

        rss_before = _rss_kib(a.proc.pid)
        a.stop(__import__("signal").SIGKILL)
        t0 = time.monotonic()
        a.start(timeout=60)
        up_s = time.monotonic() - t0
        listening(a.host, a.metrics_port, 30)
        print(f"gateway A back with {FOREIGN} foreign sessions in the store: MQTT port in {up_s:.2f} s "
              f"(loaded VM), RSS {_rss_kib(a.proc.pid)} KiB (before the restart {rss_before} KiB)")
        # only its own: the count, the dormant ones, and what its restore read
        assert metric(a.metrics_url, "lmqtt_sessions") == 5, a.log_tail()
        assert metric(a.metrics_url, "lmqtt_sessions_dormant") == 5
        started = re.findall(r"event=broker_started restored_sessions=(\d+)", a.log_tail(200000))
        assert started[-1] == "5", a.log_tail()

        pub = Paho(a, "fx-pub", version=5)
        pub.publish("fx/real/1", b"while-b-was-gone", qos=1)
        pub.publish("own/3/x", b"for-own-3", qos=1)
        moved = Paho(a, "fx-real", version=5, clean=False, expiry=3600)     # a foreign client, on A now
        assert moved.session_present
        assert [m.payload for m in moved.get_n(1)] == [b"while-b-was-gone"]
        own = Paho(a, "own-3", version=5, clean=False, expiry=3600)
        assert own.session_present
        assert [m.payload for m in own.get_n(1)] == [b"for-own-3"]
        synthetic = Paho(a, "fx-04242", version=5, clean=False, expiry=3600)
        assert synthetic.session_present
        assert metric(a.metrics_url, "lmqtt_sessions") == 8      # 4 dormant + 3 connected (+ fx-pub's)
        assert metric(a.metrics_url, "lmqtt_sessions_dormant") == 4
        for c in (pub, moved, own, synthetic):
            c.disconnect()
    finally:
        stop_all([a, b], store)
