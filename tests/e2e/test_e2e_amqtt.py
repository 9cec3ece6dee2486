"""End-to-end with amqtt 0.12's client (MQTT 3.1.1), the second independent client library:
persistent sessions across kill -9 of the server, retained with wildcards, will on a killed
client process, `$` topics, takeover."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.support import LmqttServer, Paho, per_test, running

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    """One `lmqtt serve` for the module's tests (each uses its own client ids and topics)."""
    d = tmp_path_factory.mktemp("amqtt")
    yield from running(LmqttServer(str(d / "data"), log_path=str(d / "lmqtt-serve.log")))


@pytest.fixture
def lmqtt_server(shared_server):
    """The module's server, up when the test starts; the test's paho clients closed at its end."""
    yield from per_test(shared_server)


@pytest.fixture
def fresh_server(tmp_path):
    """A server of its own, for the test that subscribes to `#` (the shared one holds other tests'
    retained messages)."""
    yield from running(LmqttServer(str(tmp_path / "data"), log_path=str(tmp_path / "lmqtt-serve.log")))


def _url(srv) -> str:
    return f"mqtt://{srv.host}:{srv.port}/"


async def _drain(c, timeout=0.7) -> list[tuple[str, bytes, int, bool]]:
    out = []
    while True:
        try:
            m = await c.deliver_message(timeout_duration=timeout)
        except asyncio.TimeoutError:
            return out
        out.append((m.topic, bytes(m.data), m.qos, bool(m.publish_packet.retain_flag)))


def _client(cid, **cfg):
    from amqtt.client import MQTTClient
    base = {"auto_reconnect": False, "keep_alive": 30}
    base.update(cfg)
    return MQTTClient(client_id=cid, config=base)


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "kill9"])
def test_amqtt_persistent_session_survives_server_restart(lmqtt_server, kill):
    async def subscribe_and_leave():
        c = _client("am-persist")
        await c.connect(_url(lmqtt_server), cleansession=False)
        await c.subscribe([("amp/#", 1)])
        await c.disconnect()

    async def come_back():
        c = _client("am-persist")
        await c.connect(_url(lmqtt_server), cleansession=False)
        got = []
        while True:                 # up to the sentinel queued behind them (was: a 2 s drain)
            m = await c.deliver_message(timeout_duration=10)
            if bytes(m.data) == b"sentinel":
                break
            got.append((m.topic, bytes(m.data), m.qos, bool(m.publish_packet.retain_flag)))
        got += await _drain(c, 0.2)     # and nothing after it either
        await c.disconnect()
        return got

    asyncio.run(subscribe_and_leave())
    pub = Paho(lmqtt_server, "amp-pub")
    for i in range(25):
        pub.publish(f"amp/{i % 3}", f"{i}".encode(), qos=1)
    pub.disconnect()
    lmqtt_server.restart(kill=kill)
    Paho(lmqtt_server, "amp-sentinel").publish("amp/sentinel", b"sentinel", qos=1)   # queued after the 25
    got = asyncio.run(come_back())
    assert [p for _, p, _, _ in got] == [f"{i}".encode() for i in range(25)]


def test_amqtt_retained_wildcards_and_clear(lmqtt_server):
    async def run():
        p = _client("am-ret-pub")
        await p.connect(_url(lmqtt_server))
        await p.publish("amr/x/state", b"on", qos=1, retain=True)
        await p.publish("amr/y/state", b"off", qos=1, retain=True)
        await p.publish("amr/z/state", b"gone", qos=1, retain=True)
        await p.publish("amr/z/state", b"", qos=1, retain=True)      # clear
        s = _client("am-ret-sub")
        await s.connect(_url(lmqtt_server))
        await s.subscribe([("amr/+/state", 1)])
        got = await _drain(s)
        await s.disconnect()
        await p.disconnect()
        return sorted(got)

    assert asyncio.run(run()) == [("amr/x/state", b"on", 1, True), ("amr/y/state", b"off", 1, True)]


def test_amqtt_will_when_client_process_is_killed(lmqtt_server, tmp_path):
    watcher = Paho(lmqtt_server, "am-will-watch")
    watcher.subscribe("amw/#", 1)
    script = tmp_path / "victim.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, sys
        from amqtt.client import MQTTClient
        async def main():
            c = MQTTClient(client_id="am-victim", config={{"auto_reconnect": False, "keep_alive": 30,
                "will": {{"topic": "amw/victim", "message": "victim died", "qos": 1, "retain": False}}}})
            await c.connect("{_url(lmqtt_server)}")
            print("connected", flush=True)
            await asyncio.sleep(60)
        asyncio.run(main())
    """))
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "connected"
        os.kill(p.pid, signal.SIGKILL)                    # no DISCONNECT: the OS closes the socket
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
    m = watcher.get(timeout=10)
    assert (m.topic, m.payload) == ("amw/victim", b"victim died")


def test_amqtt_clean_disconnect_sends_no_will(lmqtt_server):
    watcher = Paho(lmqtt_server, "am-nowill-watch")
    watcher.subscribe("amw2/#", 1)

    async def run():
        c = _client("am-polite", will={"topic": "amw2/polite", "message": "never", "qos": 1, "retain": False})
        await c.connect(_url(lmqtt_server))
        await c.disconnect()

    asyncio.run(run())
    assert watcher.drain(0.7) == []


def test_amqtt_dollar_topics_and_takeover(fresh_server):
    lmqtt_server = fresh_server

    async def run():
        a = _client("am-dollar")
        await a.connect(_url(lmqtt_server))
        await a.subscribe([("#", 0)])
        p = _client("am-dollar-pub")
        await p.connect(_url(lmqtt_server))
        await p.publish("$SYS/amqtt", b"hidden", qos=1)
        await p.publish("amd/visible", b"shown", qos=1)
        got = await _drain(a)
        # takeover: a second amqtt client with the same id replaces the first
        b = _client("am-dollar")
        await b.connect(_url(lmqtt_server))
        await b.subscribe([("amd/#", 1)])
        await p.publish("amd/after", b"to-b", qos=1)
        got_b = await _drain(b)
        await b.disconnect()
        await p.disconnect()
        return got, got_b

    got, got_b = asyncio.run(run())
    assert [(t, d) for t, d, _, _ in got] == [("amd/visible", b"shown")]
    assert [(t, d) for t, d, _, _ in got_b] == [("amd/after", b"to-b")]
