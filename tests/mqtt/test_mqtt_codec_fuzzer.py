"""The live fuzzer tool (`lmqtt bench fuzz`) against a real Mosquitto, and its building blocks."""
from __future__ import annotations

import json
import random
import shutil
import subprocess

import pytest

from tests.support import free_port, listening
from lmqtt.gateway.mqtt import Decoder, ProtocolError, encode
from lmqtt.gateway.mqtt import packets as P
from lmqtt.loadtest import mqtt_fuzz


def test_factory_packets_are_valid_for_our_decoder():
    rng = random.Random(3)
    fac = mqtt_fuzz.PacketFactory(rng)
    for version in (3, 4, 5):
        for _ in range(200):
            c = fac.connect(version)
            pkts = [fac.packet(version) for _ in range(10)]
            got = Decoder().feed(b"".join(encode(p, version) for p in [c] + pkts))
            assert got == [c] + pkts


def test_mutations_only_produce_protocol_errors():
    rng = random.Random(4)
    fac = mqtt_fuzz.PacketFactory(rng)
    refused = 0
    for _ in range(2000):
        version = rng.choice([4, 5])
        d = Decoder()
        d.feed(encode(P.Connect("x", version), version))
        try:
            d.feed(mqtt_fuzz.mutate(rng, encode(fac.packet(version), version)))
        except ProtocolError as e:
            assert "decoder failed" not in str(e)
            refused += 1
    assert refused > 500  # the mutations really do break packets


@pytest.fixture
def mosquitto(tmp_path):
    if shutil.which("mosquitto") is None:
        pytest.skip("mosquitto binary not installed")
    port = free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    log = open(tmp_path / "mosquitto.log", "wb")
    proc = subprocess.Popen(["mosquitto", "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    if not listening("127.0.0.1", port, 10, proc):
        proc.kill()
        pytest.fail("mosquitto did not start: " + (tmp_path / "mosquitto.log").read_text())
    yield port
    proc.terminate()
    proc.wait(10)
    log.close()


def test_fuzz_run_against_mosquitto_keeps_it_serving(mosquitto, capsys):
    rc = mqtt_fuzz.main(["--port", str(mosquitto), "--packets", "3000", "--seconds", "60",
                         "--connections", "4", "--seed", "11", "--check-interval", "0.5"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0, summary
    assert summary["packets_sent"] == 3000  # bounded exactly by the packet budget
    assert summary["mutated_packets"] > 0 and summary["connections"] > 10
    assert summary["healthy_before"] and summary["healthy_after"]
    assert summary["health_checks_failed"] == 0
    assert summary["broker_responses_malformed"] == 0


def test_fuzz_reports_a_dead_broker():
    port = free_port()  # nothing listens here
    rc = mqtt_fuzz.main(["--port", str(port), "--packets", "100", "--seconds", "1", "--connections", "2"])
    assert rc == 1


def test_fuzz_refuses_non_loopback_targets(capsys):
    assert mqtt_fuzz.main(["--host", "192.0.2.1", "--port", "1883"]) == 2
    assert "non-loopback" in capsys.readouterr().err


def test_health_check_against_mosquitto_both_versions(mosquitto):
    for version in (4, 5):
        ok, msg, _ = mqtt_fuzz.health_check("127.0.0.1", mosquitto, version)
        assert ok, msg
