"""A first-level topic per device (`{device}/sensor`) on `lmqtt serve` with its defaults: the broker
holds 100,000 such topics within a bounded number of open files and a data dir proportional to
its data, restarts after a SIGTERM and after a kill -9 with every message readable over MQTT and
the SDK; and under an open-files limit of 1,024 it still starts, serves and refuses the client
connections past its share cleanly (CONNACK 0x97), never starving its store.

Once, each topic cost two descriptors, a memory map and a preallocated 1.25 MB file: 20,000
topics exhausted the limit and the broker could not restart. The broker runs as its own process,
sampled from /proc by lmqtt.loadtest.proc_stats; the load and the read-backs are those of
`lmqtt bench topics`."""
from __future__ import annotations

import random
import signal
import socket
import time

import pytest

from lmqtt.gateway.mqtt import Decoder, encode
from lmqtt.gateway.mqtt import packets as P
from lmqtt.loadtest import proc_stats
from lmqtt.loadtest.topics_bench import Broker, publish_topics, read_back_mqtt, read_back_sdk, topic_of

pytestmark = pytest.mark.slow

MAX_OPEN_FILES = 4096
MAX_DISK = 1100 * 10**6


def _check_sample(b: Broker, sample: list[str]) -> None:
    via_mqtt = read_back_mqtt("127.0.0.1", b.port, sample)
    assert {t: v for t, v in via_mqtt.items() if v != [b"1"]} == {}, "read back over MQTT ($replay/)"
    via_sdk = read_back_sdk(b.store, sample)
    assert {t: v for t, v in via_sdk.items() if v != [b"1"]} == {}, "read back over the SDK"


def test_100000_topics_restart_after_sigterm_and_kill9_within_the_file_budget(tmp_path):
    n = 100_000
    data = str(tmp_path / "data")
    b = Broker(data, str(tmp_path / "serve.log"))
    rng = random.Random(1)
    sample = sorted({topic_of(rng.randrange(n)) for _ in range(150)} | {topic_of(0), topic_of(n - 1)})
    b.start()
    try:
        with proc_stats.PeakSampler(b.proc.pid, interval=0.1) as peaks:
            assert publish_topics("127.0.0.1", b.port, n, conns=8) == n
            _check_sample(b, sample)
            for sig in (signal.SIGTERM, signal.SIGKILL):
                b.stop(sig)
                b.start()
                peaks.switch(b.proc.pid)
                _check_sample(b, sample)
            # new topics after the restarts continue as before
            assert publish_topics("127.0.0.1", b.port, 100, prefix="late") == 100
        assert peaks.samples > 10
        assert peaks.peak["open_files"] <= MAX_OPEN_FILES, peaks.peak
        assert b.error_lines() == []
        assert proc_stats.disk_bytes(data) <= MAX_DISK
    finally:
        b.stop(signal.SIGKILL)


def _connect(port: int, client_id: str, version: int) -> tuple[socket.socket, object]:
    """A raw MQTT connection: (socket, its CONNACK) - the socket left open when admitted."""
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    s.sendall(encode(P.Connect(client_id=client_id, protocol_level=version, clean_start=True), version))
    dec = Decoder(version=version, server_side=False)
    while True:
        data = s.recv(4096)
        assert data, f"{client_id}: closed without a CONNACK"
        for pkt in dec.feed(data):
            if isinstance(pkt, P.ConnAck):
                return s, pkt


def test_under_ulimit_1024_the_broker_serves_and_refuses_connections_past_its_share(tmp_path):
    """`ulimit -n 1024`: the store keeps its share (a quarter: 256), the clients get the rest but a
    reserve; the next client is told why (CONNACK 0x97 with a reason, 3.1.1: return code 3), the
    clients already in are served, and the store still writes, restarts and reads back."""
    n = 10_000
    b = Broker(str(tmp_path / "data"), str(tmp_path / "serve.log"), ulimit=1024)
    b.start()
    held: list[socket.socket] = []
    try:
        with proc_stats.PeakSampler(b.proc.pid, interval=0.1) as peaks:
            assert publish_topics("127.0.0.1", b.port, n, conns=4) == n
            refused = None
            for i in range(1000):
                s, ack = _connect(b.port, f"hold-{i}", 5)
                if ack.reason_code:
                    refused = (i, ack)
                    s.close()
                    break
                held.append(s)
            assert refused is not None, "1,000 connections admitted under a limit of 1,024 open files"
            i, ack = refused
            assert ack.reason_code == 0x97
            assert "open-files" in (ack.properties.reason_string or "")
            assert 500 <= i < 1000, f"refused after {i} connections"
            s, ack311 = _connect(b.port, "late-311", 4)
            assert ack311.reason_code == 3          # 3.1.1: server unavailable
            s.close()
            # the store is not starved: the clients in still publish new topics, stored and acknowledged
            for k, s in enumerate(held[:5]):
                s.sendall(encode(P.Publish(topic=f"busy{k}/t", payload=b"x", qos=1, packet_id=1), 5))
            for s in held[:5]:
                dec = Decoder(version=5, server_side=False)
                got = []
                deadline = time.monotonic() + 20
                while not got and time.monotonic() < deadline:
                    got = [p for p in dec.feed(s.recv(4096)) if isinstance(p, P.PubAck)]
                assert got and not got[0].reason_code
        for s in held:
            s.close()
        held.clear()
        b.stop(signal.SIGTERM)
        b.start()
        rng = random.Random(2)
        _check_sample(b, sorted({topic_of(rng.randrange(n)) for _ in range(50)}))
        assert peaks.peak["open_files"] <= 1024
        assert b.error_lines() == []
        with open(b.log_path) as f:
            assert "cause=open_files" in f.read()
    finally:
        for s in held:
            s.close()
        b.stop(signal.SIGKILL)
