"""MQTT.js (npm `mqtt`, the client of most JavaScript and Node-RED deployments) against a real
`lmqtt serve`, over TCP and over WebSocket, talking to paho on the other side: a second client
implementation, written by other people, agreeing with the broker on every QoS, retained
messages, wildcards and MQTT 5 properties. Needs node and `npm ci --prefix tests/js` (.ci/run
does it); skipped when node or the package is absent."""
import json
import os
import shutil
import subprocess

import pytest

from tests.support import ROOT, LmqttServer, Paho, free_port

JS = os.path.join(ROOT, "tests", "js")
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(
    NODE is None or not os.path.isdir(os.path.join(JS, "node_modules", "mqtt")),
    reason="MQTT.js not installed (node + `npm ci --prefix tests/js`)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("mqttjs")
    ws = free_port()
    srv = LmqttServer(str(d / "data"), extra_args=("--ws-port", str(ws)), log_path=str(d / "serve.log")).start()
    srv.ws_port = ws
    yield srv
    srv.stop()


def _urls(server):
    return {"tcp": f"mqtt://127.0.0.1:{server.port}", "ws": f"ws://127.0.0.1:{server.ws_port}/mqtt"}


class JsSubscriber:
    """`node mqttjs_client.mjs sub ...` in the background; lines are JSON events."""

    def __init__(self, url, flt, qos, count, timeout_ms=15000, version=5):
        self.p = subprocess.Popen([NODE, os.path.join(JS, "mqttjs_client.mjs"), "sub", url, flt, str(qos),
                                   str(count), str(timeout_ms), str(version)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=JS)
        self.early = []              # a retained message may arrive before the SUBACK resolves
        while True:
            ev = json.loads(self.p.stdout.readline() or '{"event": "eof"}')
            if ev["event"] == "message":
                self.early.append(ev)
                continue
            assert ev["event"] == "subscribed", (ev, self.p.stderr.read() if ev["event"] == "eof" else "")
            self.granted = ev["granted"]
            break

    def messages(self, timeout=30):
        out, _err = self.p.communicate(timeout=timeout)
        events = [json.loads(line) for line in out.splitlines() if line.strip()]
        return self.early + [e for e in events if e["event"] == "message"]


def js_publish(url, messages, version=5):
    r = subprocess.run([NODE, os.path.join(JS, "mqttjs_client.mjs"), "pub", url, json.dumps(messages), str(version)],
                       capture_output=True, text=True, timeout=30, cwd=JS)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == {"event": "published", "count": len(messages)}


@pytest.mark.parametrize("transport", ["tcp", "ws"])
def test_paho_publishes_mqttjs_receives_every_qos_with_properties(server, transport):
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
    root = f"js2/{transport}"
    sub = JsSubscriber(_urls(server)[transport], f"{root}/+/temp", 2, 3)
    assert sub.granted == [2]
    pub = Paho(server, client_id=f"paho-pub-{transport}", version=5)
    for q in (0, 1, 2):
        props = Properties(PacketTypes.PUBLISH)
        props.UserProperty = [("unit", "C"), ("q", str(q))]
        props.ContentType = "text/plain"
        pub.publish(f"{root}/room{q}/temp", f"21.{q}", qos=q, properties=props)
    pub.publish(f"{root}/room9/humidity", "50", qos=1)            # not matching the filter
    got = sorted(sub.messages(), key=lambda m: m["topic"])
    pub.disconnect()
    assert [m["topic"] for m in got] == [f"{root}/room{q}/temp" for q in (0, 1, 2)]
    assert [m["payload"] for m in got] == ["21.0", "21.1", "21.2"]
    assert [m["qos"] for m in got] == [0, 1, 2]                   # min(publish QoS, granted 2)
    assert all(m["contentType"] == "text/plain" for m in got)
    assert [m["userProperties"] for m in got] == [{"unit": "C", "q": str(q)} for q in (0, 1, 2)]


@pytest.mark.parametrize("transport", ["tcp", "ws"])
def test_mqttjs_publishes_paho_receives_and_retained_reaches_a_late_subscriber(server, transport):
    root = f"js1/{transport}"
    sub = Paho(server, client_id=f"paho-sub-{transport}", version=5)
    sub.subscribe(f"{root}/#", qos=2)
    msgs = [{"topic": f"{root}/cmd/{q}", "payload": f"go {q}", "qos": q,
             "userProperties": {"from": "js"}, "contentType": "text/plain"} for q in (0, 1, 2)]
    msgs.append({"topic": f"{root}/state", "payload": "on", "qos": 1, "retain": True})
    js_publish(_urls(server)[transport], msgs)
    got = sorted(sub.get_n(4), key=lambda m: m.topic)
    sub.disconnect()
    assert [(m.topic, m.payload, m.qos) for m in got] == sorted(
        [(f"{root}/cmd/{q}", f"go {q}".encode(), q) for q in (0, 1, 2)] + [(f"{root}/state", b"on", 1)])
    cmd = [m for m in got if "/cmd/" in m.topic]
    assert all(dict(m.properties.UserProperty) == {"from": "js"} and m.properties.ContentType == "text/plain"
               for m in cmd)
    # a late MQTT.js subscriber gets the retained state at once, flagged retained
    late = JsSubscriber(_urls(server)[transport], f"{root}/state", 1, 1, timeout_ms=10000)
    (m,) = late.messages()
    assert (m["topic"], m["payload"], m["retain"]) == (f"{root}/state", "on", True)


def test_mqttjs_over_mqtt_3_1_1(server):
    sub = JsSubscriber(_urls(server)["tcp"], "js311/#", 1, 2, version=4)
    js_publish(_urls(server)["tcp"], [{"topic": "js311/a", "payload": "x", "qos": 1},
                                      {"topic": "js311/b", "payload": "y", "qos": 0}], version=4)
    got = sorted((m["topic"], m["payload"], m["qos"]) for m in sub.messages())
    assert got == [("js311/a", "x", 1), ("js311/b", "y", 0)]
