"""TLS listeners (gateway/net/tls.py) with certificates from trustme: paho over TLS and mutual TLS
through a real in-process gateway, the client certificate's CN as the identity, and clear errors."""
from __future__ import annotations

import ssl
import threading
import time

import pytest

from lmqtt.gateway.security.auth import certificate_subject
from lmqtt.gateway.net.tls import TlsConfigError, server_context
from tests.gateway.test_websocket import LoopThread

trustme = pytest.importorskip("trustme")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("localhost", "127.0.0.1")
    client = ca.issue_cert("device-17@example", common_name="device-17")
    paths = {"ca": d / "ca.pem", "cert": d / "server.pem", "key": d / "server.key",
             "ccert": d / "client.pem", "ckey": d / "client.key"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    server.private_key_pem.write_to_path(str(paths["key"]))
    with open(paths["cert"], "wb") as f:
        for blob in server.cert_chain_pems:
            f.write(blob.bytes())
    client.private_key_pem.write_to_path(str(paths["ckey"]))
    with open(paths["ccert"], "wb") as f:
        for blob in client.cert_chain_pems:
            f.write(blob.bytes())
    other = trustme.CA().issue_cert("intruder", common_name="intruder")
    paths["bad_cert"], paths["bad_key"] = d / "bad.pem", d / "bad.key"
    other.private_key_pem.write_to_path(str(paths["bad_key"]))
    with open(paths["bad_cert"], "wb") as f:
        for blob in other.cert_chain_pems:
            f.write(blob.bytes())
    return {k: str(v) for k, v in paths.items()}


@pytest.fixture
def tls_gateway(tmp_path, pki):
    from lmqtt.gateway.app.config import build_config
    from lmqtt.gateway.net.connection import MQTTConnection
    from lmqtt.gateway.app.gateway import Gateway
    lt = LoopThread()
    cfg = build_config({}, {"host": "127.0.0.1", "port": 0, "data_dir": str(tmp_path / "data"),
                            "metrics_port": 0, "segment_mb": 16})
    gw = Gateway(cfg)
    ctx = server_context(pki["cert"], pki["key"], pki["ca"], require_certificate=True)
    peers = []

    class Recording(MQTTConnection):
        def connection_made(self, transport):
            peers.append(certificate_subject(transport.get_extra_info("peercert")))
            super().connection_made(transport)

    async def start():
        await gw.start()
        return await lt.loop.create_server(lambda: Recording(gw.broker), "127.0.0.1", 0, ssl=ctx)
    srv = lt.run(start())
    yield srv.sockets[0].getsockname()[1], peers
    async def stop():
        srv.close()
        await gw.stop()
    lt.run(stop())
    lt.stop()


def _paho(pki, port, cert, key):
    import paho.mqtt.client as mqtt
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"tls-{time.monotonic_ns()}")
    c.tls_set(ca_certs=pki["ca"], certfile=cert, keyfile=key)
    got, ev = [], threading.Event()
    c.on_connect = lambda cl, u, fl, rc, pr: (got.append(rc), ev.set())
    c.on_message = lambda cl, u, m: got.append(m)
    return c, got, ev


def test_mutual_tls_with_paho_and_the_certificate_names_the_client(pki, tls_gateway):
    port, peers = tls_gateway
    c, got, ev = _paho(pki, port, pki["ccert"], pki["ckey"])
    c.connect("127.0.0.1", port)
    c.loop_start()
    assert ev.wait(5) and not got[0].is_failure
    c.subscribe("t/#", qos=1)
    time.sleep(0.2)
    c.publish("t/1", b"over tls", qos=1).wait_for_publish(5)
    deadline = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert got[1].payload == b"over tls"
    assert peers[-1] == "device-17"
    c.loop_stop()
    c.disconnect()


def test_a_client_without_an_accepted_certificate_fails_the_handshake(pki, tls_gateway):
    port, _ = tls_gateway
    import socket
    for cert, key in ((None, None), (pki["bad_cert"], pki["bad_key"])):
        ctx = ssl.create_default_context(cafile=pki["ca"])
        if cert:
            ctx.load_cert_chain(cert, key)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
                with ctx.wrap_socket(raw, server_hostname="localhost") as s:
                    s.sendall(b"\x10\x0c\x00\x04MQTT\x04\x02\x00<\x00\x00")   # TLS 1.3: refusal shows on use
                    if not s.recv(4):
                        raise ConnectionResetError("closed")


def test_tls_settings_errors_name_the_file_and_the_cause(pki, tmp_path):
    with pytest.raises(TlsConfigError, match="TLS certificate /nope.pem: no such file"):
        server_context("/nope.pem", pki["key"])
    with pytest.raises(TlsConfigError, match="needs --cafile"):
        server_context(pki["cert"], pki["key"], require_certificate=True)
    with pytest.raises(TlsConfigError, match="do the certificate and key belong together"):
        server_context(pki["cert"], pki["bad_key"])
