"""A full disk under `lmqtt serve`, end to end: the data dir on a small tmpfs the test
mounts (loadtest/chaos/disk.py SmallDisk), filled by a filler file while MQTT 5 and 3.1.1
publishers (paho-mqtt, QoS 1 and 2) and an SDK producer publish.

What a full disk must do: refuse cleanly (MQTT 5: PUBACK/PUBREC 0x97 with a reason string naming
the full disk; 3.1.1, which has no negative ack: the connection is closed and the message is not
acknowledged, so paho re-sends it when it reconnects; SDK: DiskFull), log one line, keep serving
subscribers; after free(): accept again without a restart, every acknowledged message readable,
and restarts (SIGTERM, kill -9) recover without a CRC error."""
from __future__ import annotations

import queue
import re
import signal
import threading
import time
import urllib.request

import pytest

from lmqtt.gateway.mqtt import packets as P
from lmqtt.loadtest.chaos.disk import SmallDisk, can_mount_tmpfs
from tests.support import LmqttServer, Paho, RawMQTT

pytestmark = pytest.mark.skipif(not can_mount_tmpfs(), reason="needs root to mount a tmpfs (mount -t tmpfs)")

QUOTA_EXCEEDED = 0x97
BODY = 4000          # bytes of padding per message


class Pub:
    """A paho publisher that records, per message id, the broker's answer (reason code, reason
    string) and the disconnects."""

    def __init__(self, srv, client_id: str, version: int) -> None:
        import paho.mqtt.client as mqtt
        self.version = version
        kw = {} if version == 5 else {"clean_session": False}
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                             protocol=mqtt.MQTTv5 if version == 5 else mqtt.MQTTv311, **kw)
        self.c.reconnect_delay_set(1, 2)
        self.answers: dict[int, tuple[int, str | None]] = {}
        self.cond = threading.Condition()
        self.disconnects: queue.Queue = queue.Queue()
        self.connected = threading.Event()

        def on_publish(c, u, mid, rc, props):
            with self.cond:
                self.answers[mid] = (rc.value if hasattr(rc, "value") else int(rc),
                                     getattr(props, "ReasonString", None) if props is not None else None)
                self.cond.notify_all()

        def on_connect(c, u, flags, rc, props):
            if not rc.is_failure:
                self.connected.set()

        def on_disconnect(c, u, flags, rc, props):
            self.connected.clear()
            self.disconnects.put(rc)
        self.c.on_publish = on_publish
        self.c.on_connect = on_connect
        self.c.on_disconnect = on_disconnect
        self.c.connect(srv.host, srv.port, 30)
        self.c.loop_start()
        assert self.connected.wait(5), f"{client_id} did not connect"

    def publish(self, topic: str, payload: bytes, qos: int) -> int:
        return self.c.publish(topic, payload, qos=qos).mid

    def answer(self, mid: int, timeout: float = 10.0):
        """(reason code, reason string) the broker answered for `mid`, or None."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while mid not in self.answers:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)
            return self.answers[mid]

    def close(self) -> None:
        try:
            self.c.disconnect()
        finally:
            self.c.loop_stop()


def payload(tag: str, i: int) -> bytes:
    return f"{tag}-{i:05d}-".encode() + b"p" * BODY


def sdk_read_all(address: str, first_level: str = "df") -> list:
    """Every record of the ConsumeQueue `first_level`/0, from the earliest offset."""
    from lmqtt.store.client import connect
    c = connect(address)
    try:
        out, off = [], 0
        for _ in range(1000):          # bounded: 256 per pull
            r = c.pull(first_level, 0, off, max_count=256)
            if not r.records:
                return out
            out += r.records
            off = r.next_offset
        raise AssertionError("pull never reached the end")
    finally:
        c.close()


def metric(srv, name: str) -> float | None:
    text = urllib.request.urlopen(srv.metrics_url, timeout=5).read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def log_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read().splitlines()


def disk_full_errors(lines: list[str]) -> list[str]:
    return [ln for ln in lines if "level=error" in ln and "logger=lmqtt.store " in ln and "disk full" in ln]


def wait(pred, timeout: float, what: str, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(step)


@pytest.fixture
def full_disk_server(tmp_path):
    """`lmqtt serve` with its data dir on a 128 MiB tmpfs (8 MiB CommitLog segments). Not smaller:
    RocksDB leaves its out-of-space error state by itself only once the free space is at least
    its write buffer (64 MiB for the light-queue index)."""
    disk = SmallDisk(str(tmp_path / "disk"), 128).mount()
    srv = LmqttServer(str(tmp_path / "disk" / "data"), extra_args=("--segment-mb", "8"),
                      log_path=str(tmp_path / "serve.log"))
    try:
        srv.start()
        yield disk, srv
    finally:
        try:
            srv.stop(signal.SIGKILL)
        finally:
            disk.umount()


def publish_until_refused(pub: Pub, topic: str, tag: str, qos: int, acked: list, limit: int = 5000):
    """Publish (one at a time) until the broker refuses; the acknowledged payloads go to `acked`.
    -> (reason code, reason string) of the refusal."""
    for i in range(limit):         # bounded: an 8 MiB segment holds ~2,000 of these
        p = payload(tag, i)
        a = pub.answer(pub.publish(topic, p, qos))
        assert a is not None, f"no answer for {tag} {i}"
        if a[0] >= 0x80:
            return a
        acked.append(p)
    pytest.fail(f"{tag}: never refused after {limit} publishes")


def test_full_disk_refuses_each_publisher_cleanly_serves_subscribers_and_accepts_again_after_free(full_disk_server):
    from lmqtt.store.client import DiskFull, connect
    disk, srv = full_disk_server
    sub = Paho(srv, "df-sub", version=5)
    sub.subscribe("df/#", qos=1)
    v5 = Pub(srv, "df-v5", 5)
    v3a = Pub(srv, "df-v3-q1", 4)
    v3b = Pub(srv, "df-v3-q2", 4)
    sdk = connect(srv.store_address)
    producer = sdk.producer()
    acked: list[bytes] = []
    try:
        for i in range(3):     # everybody gets through while there is space
            for pub, topic, tag, qos in ((v5, "df/v5q1", "v5q1", 1), (v5, "df/v5q2", "v5q2", 2),
                                         (v3a, "df/v3q1", "v3q1", 1), (v3b, "df/v3q2", "v3q2", 2)):
                p = payload(tag + "-pre", i)
                assert pub.answer(pub.publish(topic, p, qos)) == (0, None)
                acked.append(p)
            p = payload("sdk-pre", i)
            producer.send("df/sdk", p)
            acked.append(p)

        disk.fill(0)
        # MQTT 5, QoS 1: accepted into the preallocated segment until the store notices, then 0x97
        rc, why = publish_until_refused(v5, "df/v5q1", "v5q1", 1, acked)
        assert rc == QUOTA_EXCEEDED, (rc, why)
        assert why and "disk full" in why and "free" in why, why
        # MQTT 5, QoS 2: PUBREC 0x97 with the reason string (seen on the wire: paho ignores a
        # PUBREC's reason code and sends PUBREL anyway, answered PUBCOMP 0x92 Packet Identifier
        # not found - the message was never stored - which is what paho reports)
        raw = RawMQTT(srv, version=5)
        assert raw.connect("df-raw-v5").reason_code == 0
        raw.send(P.Publish("df/v5q2", payload("raw", 0), 2, False, False, 7, P.Properties()))
        rec = raw.recv()
        assert isinstance(rec, P.PubRec) and rec.packet_id == 7, rec
        assert rec.reason_code == QUOTA_EXCEEDED and "disk full" in rec.properties.reason_string, rec
        raw.close()
        rc, why = publish_until_refused(v5, "df/v5q2", "v5q2", 2, acked)
        assert rc == 0x92, (rc, why)
        # the SDK producer: DiskFull, a StoreClientError naming the full disk
        with pytest.raises(DiskFull, match="disk full"):
            for i in range(5000):
                p = payload("sdk", i)
                producer.send("df/sdk", p)
                acked.append(p)
        # MQTT 3.1.1 (no reason codes): no PUBACK/PUBREC for the message, the connection is closed
        refused_v3 = []
        for pub, topic, tag, qos in ((v3a, "df/v3q1", "v3q1", 1), (v3b, "df/v3q2", "v3q2", 2)):
            p = payload(tag, 0)
            mid = pub.publish(topic, p, qos)
            pub.disconnects.get(timeout=10)                 # closed by the server
            assert mid not in pub.answers, f"{tag}: acknowledged on a full disk"
            refused_v3.append((pub, mid, p))

        # the disk stays full for a while: the 3.1.1 clients reconnect and re-send (refused and
        # closed again), the light-queue index's and the SDK metadata's RocksDB flushes fail
        time.sleep(3)
        assert srv.proc.poll() is None, "the server died on a full disk"
        errors = disk_full_errors(log_lines(srv.log_path))
        assert len(errors) == 1, errors                     # one line, not one per refusal
        assert srv.data_dir in errors[0] and "free" in errors[0], errors[0]
        assert metric(srv, "lmqtt_publish_refused_disk_full_total") >= 3
        assert metric(srv, "lmqtt_store_disk_full") == 1
        assert metric(srv, "lmqtt_store_disk_full_refused_total") >= 4
        # subscribers are still served: everything acknowledged so far arrives
        got = {m.payload for m in sub.get_n(len(acked), timeout=30)}
        assert set(acked) <= got, f"{len(set(acked) - got)} acknowledged messages not delivered"

        disk.free()
        # no restart: MQTT 5 publishes are accepted again (the store re-checks space every second)
        for qos, topic, tag in ((1, "df/v5q1", "v5q1-after"), (2, "df/v5q2", "v5q2-after")):
            def accepted(qos=qos, topic=topic, tag=tag):
                p = payload(tag, 0)
                if v5.answer(v5.publish(topic, p, qos))[0] == 0:
                    acked.append(p)
                    return True
                time.sleep(0.2)
                return False
            wait(accepted, 15, f"{tag} accepted after free()")
        # 3.1.1: paho reconnects and re-sends the refused message, now acknowledged
        for pub, mid, p in refused_v3:
            assert pub.answer(mid, timeout=30) == (0, None), "3.1.1 re-send not acknowledged after free()"
            acked.append(p)

        # the SDK: accepted again (its metadata's RocksDB resumes by itself once space is back)
        def sdk_ok():
            p = payload("sdk-after", 0)
            try:
                producer.send("df/sdk", p)
            except DiskFull:
                time.sleep(0.5)
                return False
            acked.append(p)
            return True
        wait(sdk_ok, 30, "SDK send accepted after free()")
        assert metric(srv, "lmqtt_store_disk_full") == 0
        # the episode ends with one line once everything writes again (RocksDB's own recovery
        # from running out of space takes a few seconds)
        wait(lambda: any("disk space is back" in ln for ln in log_lines(srv.log_path)), 30,
             "the log line saying the disk-full episode ended", step=0.2)

        # every acknowledged message: delivered live, and readable from the earliest offset
        got |= {m.payload for m in sub.get_n(len(acked) - len(got), timeout=30)}
        assert set(acked) <= got, f"{len(set(acked) - got)} acknowledged messages not delivered"
        stored = [r.body for r in sdk_read_all(srv.store_address)]
        assert set(acked) <= set(stored), f"{len(set(acked) - set(stored))} acknowledged messages not stored"
        assert len(stored) == len(set(stored)), "a message stored twice"
    finally:
        for p in (v5, v3a, v3b):
            p.close()
        sub.disconnect()
        sdk.close()


def test_acknowledged_messages_survive_sigterm_and_kill9_after_a_full_disk(full_disk_server):
    """Full twice: stopped with SIGTERM while full, then killed with kill -9 while full. The server
    does not start on a full disk (it says so); after free() it starts, recovers without a CRC
    error, and every acknowledged message is there."""
    from lmqtt.store.client import DiskFull, connect
    disk, srv = full_disk_server
    acked: list[bytes] = []
    for round_, sig in enumerate((signal.SIGTERM, signal.SIGKILL)):
        v5 = Pub(srv, f"df-v5-{round_}", 5)
        sdk = connect(srv.store_address)
        try:
            for i in range(30):     # while there is space (the first round: creates the segment)
                p = payload(f"r{round_}-pre", i)
                assert v5.answer(v5.publish("df/v5q1", p, 1)) == (0, None)
                acked.append(p)
                if i % 10 == 0:
                    p = payload(f"r{round_}-sdk-pre", i)
                    sdk.producer().send("df/sdk", p)
                    acked.append(p)
            disk.fill(7 << 20)      # under the 95% high-water mark: the next segment does not fit,
                                    # what is left of the current one is taken first
            n = len(acked)
            rc, why = publish_until_refused(v5, "df/v5q1", f"r{round_}-v5q1", 1, acked)
            assert rc == QUOTA_EXCEEDED and "disk full" in why, (rc, why)
            assert len(acked) > n, "nothing accepted between fill() and the refusal"
            with pytest.raises(DiskFull, match="disk full"):
                for i in range(5000):
                    p = payload(f"r{round_}-sdk", i)
                    sdk.producer().send("df/sdk", p)
                    acked.append(p)
            disk.fill(0)            # and now nothing at all
        finally:
            v5.close()
            sdk.close()
        rc = srv.stop(sig)
        if sig == signal.SIGTERM:
            assert rc == 0, f"SIGTERM on a full disk: exit code {rc}: {srv.log_tail()}"
        with pytest.raises(RuntimeError, match="No space left on device"):
            srv.start()             # refuses to start on a full disk, naming the cause
        disk.free()
        srv.start()
        stored = [r.body for r in sdk_read_all(srv.store_address)]
        assert set(acked) <= set(stored), f"{len(set(acked) - set(stored))} acknowledged messages lost"
        assert len(stored) == len(set(stored)), "a message stored twice"
    lines = log_lines(srv.log_path)
    bad = [ln for ln in lines if re.search(r"CRC|corrupt data|[1-9][0-9]* corrupt range|torn", ln)]
    assert not bad, f"recovery found corrupt data: {bad}"
    assert sum(" 0 corrupt range(s)" in ln for ln in lines) == 3     # the first start and two recoveries
    assert not [ln for ln in lines if "Traceback" in ln], "a traceback in the server log"
