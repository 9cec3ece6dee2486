"""Session 7's new-user walkthrough (README, docs/sdk.md, docs/ha.md as a newcomer runs them): the
mistakes and confusions it met, each against a real `lmqtt serve` subprocess and the real `lmqtt`
command. Errors are one line naming the real cause, never a traceback."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from tests.support import ROOT, LmqttServer

pytestmark = pytest.mark.timeout(120)


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout)
    assert "Traceback" not in r.stderr, r.stderr
    return r


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("newcomer") / "data"
    d.mkdir()
    srv = LmqttServer(str(d)).start()
    yield srv
    srv.stop()


# ----------------------------------------------------------- the store address is another port
def test_tools_pointed_at_the_console_port_say_it_is_not_a_store(server):
    """`--store 127.0.0.1:9883` (the metrics/console port beside the store's 10911) printed a
    traceback ending in `ProtocolError: frame of 1213486160 bytes exceeds the limit` ("HTTP" read
    as a frame length)."""
    for tool in (("admin",), ("consume", "--filter", "a", "--timeout", "1")):
        r = cli(*tool, "--store", f"127.0.0.1:{server.metrics_port}")
        assert r.returncode == 3, r
        line = r.stderr.strip()
        assert "\n" not in line, line
        assert f"127.0.0.1:{server.metrics_port} is not an lmqtt store" in line and "HTTP" in line, line
        assert "--store-port" in line, line


def test_sdk_pointed_at_the_console_port_says_it_is_not_a_store(server):
    from lmqtt.store.client import StoreClientError, connect, connect_async
    addr = f"127.0.0.1:{server.metrics_port}"
    with pytest.raises(StoreClientError, match="is not an lmqtt store: an HTTP server"):
        connect(addr)

    async def aio():
        with pytest.raises(StoreClientError, match="is not an lmqtt store: an HTTP server"):
            await connect_async(addr)
    asyncio.run(aio())


def test_tools_pointed_at_the_mqtt_port_name_the_store_port(server):
    """An MQTT port closes the connection on the store's HELLO: the message says where the store is."""
    r = cli("admin", "--store", f"127.0.0.1:{server.port}")
    assert r.returncode == 3, r
    assert "closed the connection during the handshake" in r.stderr and "--store-port" in r.stderr, r.stderr
