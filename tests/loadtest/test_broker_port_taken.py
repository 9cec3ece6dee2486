"""A compared Mosquitto must be the process listening on its port. Between the harness choosing a
free port and Mosquitto's bind, a parallel test's broker can take it: Mosquitto exits, the port
still accepts, and the run measured the other process (`sent 0` against "mosquitto"). Now `start`
refuses a port that is not Mosquitto's own (`PortTaken`, naming it) and, when it chose the port
itself, tries another."""
from __future__ import annotations

import shutil
import socket

import pytest

from lmqtt.loadtest import brokers

pytestmark = pytest.mark.skipif(shutil.which("mosquitto") is None, reason="needs mosquitto")


def test_mosquitto_on_a_port_another_process_holds_is_refused_and_named(tmp_path):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(brokers.PortTaken, match=f"port {port} is another process's"):
            brokers.start("mosquitto", tmp_path / "m", port=port, ready_timeout=10)


def test_a_started_mosquitto_holds_its_own_port(tmp_path):
    rb = brokers.start("mosquitto", tmp_path / "m")
    try:
        assert brokers.listens_on(rb.pid, rb.port) is True
    finally:
        rb.stop()
