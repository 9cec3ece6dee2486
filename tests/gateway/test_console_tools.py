"""`lmqtt produce / consume / admin` as real subprocesses against a real `lmqtt store` / `lmqtt serve`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from lmqtt.store.client import connect
from tests.support import ROOT, Paho, free_port


def lmqtt(*args, stdin: bytes = b"", timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", *args], input=stdin, capture_output=True,
                          cwd=ROOT, timeout=timeout)


def produce(addr, topic, lines, *extra):
    r = lmqtt("produce", "--store", addr, "--topic", topic, *extra, stdin=b"".join(line + b"\n" for line in lines))
    assert r.returncode == 0, r.stderr.decode()
    assert f"{len(lines)} messages".encode() in r.stderr, r.stderr
    return r


def consume(addr, flt, *extra):
    r = lmqtt("consume", "--store", addr, "--filter", flt, *extra)
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout.decode().splitlines()


def test_produce_then_consume_text_and_json(lmqtt_store):
    addr = lmqtt_store.address
    lines = [b"line %d" % i for i in range(20)] + ["h\u00e9llo".encode()]
    produce(addr, "sensors/a/temp", lines, "--qos", "0", "--key", "dev-a", "--property", "unit=C",
            "--property", "src=console")
    produce(addr, "sensors/b/temp", [b"batched %d" % i for i in range(500)], "--batch")
    text = consume(addr, "sensors", "--from", "earliest", "--count", "521")
    assert text == [line.decode() for line in lines] + ["batched %d" % i for i in range(500)]
    js = [json.loads(x) for x in consume(addr, "sensors", "--from", "earliest", "--count", "3", "--format", "json")]
    assert [j["payload"] for j in js] == ["line 0", "line 1", "line 2"]
    j = js[1]
    assert j["topic"] == "sensors/a/temp" and j["offset"] == 1 and j["qos"] == 0 and j["retain"] is False
    assert j["properties"]["user_properties"] == [["unit", "C"], ["src", "console"]] and j["keys"] == ["dev-a"]
    assert j["msg_id"] and j["store_ts"] >= j["born_ts"] > 0
    # the same messages by msg id through the SDK: what json printed is what was stored
    with connect(addr) as c:
        assert c.admin().get_by_msg_id(j["msg_id"]).body == b"line 1"
    # --timeout ends a consume that has nothing more to read; --count 0 prints nothing
    assert consume(addr, "sensors", "--from", "latest", "--timeout", "0.5") == []
    assert consume(addr, "sensors", "--from", "earliest", "--count", "0") == []


def test_wildcard_filter_consume_sees_messages_after_registration(lmqtt_store):
    addr = lmqtt_store.address
    produce(addr, "plant/1/temp", [b"before"])
    # registering the filter (first consume) makes later messages visible in its light queue
    assert consume(addr, "plant/+/temp", "--group", "w", "--timeout", "0.3") == []
    produce(addr, "plant/1/temp", [b"t1", b"t2"])
    produce(addr, "plant/2/hum", [b"h1"])
    produce(addr, "plant/3/temp", [b"t3"])
    assert consume(addr, "plant/+/temp", "--group", "w", "--timeout", "1") == ["t1", "t2", "t3"]
    # --from earliest: the filter's whole history, from before its registration too
    js = [json.loads(x) for x in consume(addr, "plant/+/temp", "--from", "earliest", "--count", "4",
                                         "--format", "json")]
    assert [(j["topic"], j["payload"]) for j in js] == [("plant/1/temp", "before"), ("plant/1/temp", "t1"),
                                                        ("plant/1/temp", "t2"), ("plant/3/temp", "t3")]


def test_group_resumes_where_it_stopped(lmqtt_store):
    addr = lmqtt_store.address
    produce(addr, "jobs/x", [b"%d" % i for i in range(10)])
    assert consume(addr, "jobs", "--group", "g", "--from", "earliest", "--count", "4") == ["0", "1", "2", "3"]
    # no --from: the group's committed offset
    assert consume(addr, "jobs", "--group", "g", "--count", "3") == ["4", "5", "6"]
    assert consume(addr, "jobs", "--group", "g", "--timeout", "0.5") == ["7", "8", "9"]
    assert consume(addr, "jobs", "--group", "g", "--timeout", "0.3") == []
    # the group's position survives a store restart
    produce(addr, "jobs/x", [b"10"])
    lmqtt_store.restart()
    assert consume(addr, "jobs", "--group", "g", "--timeout", "0.5") == ["10"]


def test_from_time_epoch_ms_and_iso(lmqtt_store):
    addr = lmqtt_store.address
    produce(addr, "t/x", [b"old1", b"old2"])
    time.sleep(0.05)
    cut = int(time.time() * 1000)
    time.sleep(0.05)
    produce(addr, "t/x", [b"new1", b"new2"])
    assert consume(addr, "t", "--from", str(cut), "--timeout", "0.5") == ["new1", "new2"]
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(cut / 1000)) + ".%03dZ" % (cut % 1000)
    assert consume(addr, "t", "--from", iso, "--timeout", "0.5") == ["new1", "new2"]
    # a time before everything reads from the start; a bad time is a usage error
    assert consume(addr, "t", "--from", "2001-01-01T00:00:00", "--timeout", "0.5") == ["old1", "old2", "new1", "new2"]
    r = lmqtt("consume", "--store", addr, "--filter", "t", "--from", "yesterday")
    assert r.returncode == 2 and b"ISO 8601" in r.stderr


def test_admin_shows_queues_and_group_lag(lmqtt_store):
    addr = lmqtt_store.address
    produce(addr, "orders/eu", [b"%d" % i for i in range(7)])
    assert len(consume(addr, "orders", "--group", "billing", "--from", "earliest", "--count", "2")) == 2
    r = lmqtt("admin", "--store", addr, "--format", "json")
    assert r.returncode == 0, r.stderr.decode()
    doc = json.loads(r.stdout)
    assert {"topic": "orders", "queue_id": 0, "min_offset": 0, "max_offset": 7} in doc["queues"]
    (lag,) = doc["groups"]["billing"]
    assert (lag["topic"], lag["committed"], lag["max_offset"], lag["lag"]) == ("orders", 2, 7, 5)
    assert doc["stats"]["max_offset"] > 0
    r = lmqtt("admin", "--store", addr)
    assert r.returncode == 0
    out = r.stdout.decode()
    row = [line.split() for line in out.splitlines() if line.startswith("billing")]
    assert row == [["billing", "topic", "orders[0]", "2", "7", "5"]], out


def test_admin_lists_gateway_holds_and_releases_a_gone_gateways(lmqtt_store):
    """`lmqtt admin --gateways` / `--release-gateway ID`: a gateway id gone for good loses its
    filter holds, except a filter only it holds that a persistent session's record uses; a
    connected gateway's holds are refused."""
    from lmqtt.lightqueue.records import SessionRecord, Subscription
    addr = lmqtt_store.address
    with connect(addr) as gone, connect(addr) as live:
        gone.cmd("gw_register", gateway="pod-old", filters=["ended/+", "shared/+", "needed/+"])
        live.cmd("gw_hello", gateway="pod-new")
        live.cmd("gw_register", gateway="pod-new", filter="shared/+")
        rec = SessionRecord("dev-1", 4, 3600, 1, [Subscription("needed/+", 1)])
        live.cmd("gw_put_session", client_id="dev-1", rec=rec.to_bytes().decode())
        r = lmqtt("admin", "--store", addr, "--gateways", "--format", "json")
        assert r.returncode == 0, r.stderr.decode()
        assert json.loads(r.stdout)["gateways"] == {"pod-new": {"filters": 1, "connected": True},
                                                    "pod-old": {"filters": 3, "connected": False}}
        r = lmqtt("admin", "--store", addr, "--release-gateway", "pod-new")
        assert r.returncode != 0 and b"gateway 'pod-new' is connected: its holds are in use" in r.stderr, r.stderr
        assert b"ValueError" not in r.stderr and b"bad request" not in r.stderr, r.stderr     # a refusal, not a bug
        r = lmqtt("admin", "--store", addr, "--release-gateway", "pod-old", "--format", "json")
        assert r.returncode == 0, r.stderr.decode()
        assert json.loads(r.stdout) == {"released": ["ended/+", "shared/+"], "kept": ["needed/+"]}
        assert live.cmd("gw_filters", gateway="pod-old")["filters"] == {"needed/+": 1}
        assert live.cmd("gw_filters", gateway="pod-new")["filters"] == {"shared/+": 1}


def test_admin_gateways_of_an_embedded_serve_says_it_needs_lmqtt_store(lmqtt_server):
    """`lmqtt serve` keeps no gateways: --gateways there said "unknown command 'gw_holders'"."""
    for flags in (("--gateways",), ("--release-gateway", "pod-x")):
        r = lmqtt("admin", "--store", lmqtt_server.store_address, *flags)
        err = r.stderr.decode()
        assert r.returncode != 0 and "embedded `lmqtt serve`" in err and "`lmqtt store`" in err, err
        assert "gw_holders" not in err and "Traceback" not in err, err


def test_admin_shows_sessions_and_one_sessions_lag(lmqtt_server):
    """`lmqtt admin --sessions` / `--session ID` against `lmqtt serve --store-port`: every persistent
    session with its state and expiry; one session's subscriptions with committed offset, queue
    end and lag (an offline subscriber falls behind by what was published meanwhile); an unknown
    client id is a clear error."""
    addr = lmqtt_server.store_address
    away = Paho(lmqtt_server, "adm-away", version=5, clean=False, expiry=600)
    away.subscribe("adm/+/t", 1)
    away.disconnect()
    here = Paho(lmqtt_server, "adm-here", clean=False)
    here.subscribe("adm/x", 1)
    here.subscribe("$share/grp/adm/s", 1)
    pub = Paho(lmqtt_server, "adm-pub")
    for i in range(3):
        pub.publish("adm/1/t", b"%d" % i, qos=1)
    pub.publish("adm/x", b"x", qos=1)
    assert [m.payload for m in here.get_n(1)] == [b"x"]
    pub.disconnect()
    r = lmqtt("admin", "--store", addr, "--sessions", "--format", "json")
    assert r.returncode == 0, r.stderr.decode()
    rows = {x["client_id"]: x for x in json.loads(r.stdout)["sessions"]}
    assert {k: rows["adm-away"][k] for k in ("connected", "expiry_interval", "subscriptions", "gateway")} == \
        {"connected": False, "expiry_interval": 600, "subscriptions": 1, "gateway": None}
    assert (rows["adm-here"]["connected"], rows["adm-here"]["subscriptions"]) == (True, 2)
    r = lmqtt("admin", "--store", addr, "--session", "adm-away", "--format", "json")
    assert r.returncode == 0, r.stderr.decode()
    (sub,) = json.loads(r.stdout)["session"]["subscriptions"]
    assert (sub["filter"], sub["qos"], sub["committed_offset"], sub["max_offset"], sub["lag"]) == ("adm/+/t", 1, 0, 3, 3)
    out = lmqtt("admin", "--store", addr, "--session", "adm-away").stdout.decode()
    assert out.startswith("session adm-away: MQTT 5.0, gateway -, offline ") and "expires in 9m" in out, out
    assert [line.split() for line in out.splitlines() if line.startswith("adm/")] == [["adm/+/t", "1", "-", "0", "3", "3"]]
    out = lmqtt("admin", "--store", addr, "--sessions").stdout.decode()
    assert [line.split()[:4] for line in out.splitlines() if line.startswith("adm-here")] == \
        [["adm-here", "-", "connected", "never"]], out
    out = lmqtt("admin", "--store", addr, "--sessions", "--limit", "1").stdout.decode()
    assert len([line for line in out.splitlines() if line.startswith("adm-")]) <= 1 and "--limit N for more" in out, out
    r = lmqtt("admin", "--store", addr, "--session", "adm-never")
    assert r.returncode == 1 and b"no persistent session 'adm-never'" in r.stderr
    here.disconnect()



def test_a_clean_connect_ends_a_forgotten_session_and_its_filter_stops_being_indexed(lmqtt_server):
    """How docs/gateway.md says to end a persistent session of a device gone for good (a 3.1.1 one
    never expires by default): connect once with its client id and a clean session. Then `lmqtt
    admin --session` knows it no more, and its wildcard filter, which no one else holds, is no
    longer indexed: what is published after does not reach the filter's light queue."""
    addr = lmqtt_server.store_address
    dev = Paho(lmqtt_server, "dev-gone", clean=False)
    dev.subscribe("gone/+/t", 1)
    dev.disconnect()
    pub = Paho(lmqtt_server, "gone-pub")
    pub.publish("gone/1/t", b"a", qos=1)
    with connect(addr) as c:
        assert c.cmd("filter_offsets", filter="gone/+/t")["max_offset"] == 1
    assert lmqtt("admin", "--store", addr, "--session", "dev-gone").returncode == 0
    Paho(lmqtt_server, "dev-gone", clean=True).disconnect()
    r = lmqtt("admin", "--store", addr, "--session", "dev-gone")
    assert r.returncode == 1 and b"no persistent session 'dev-gone'" in r.stderr
    pub.publish("gone/2/t", b"b", qos=1)
    pub.publish("gone/3/t", b"c", qos=1)
    with connect(addr) as c:
        assert c.cmd("filter_offsets", filter="gone/+/t")["max_offset"] <= 1
    pub.disconnect()

def test_mqtt_subscriber_sees_produced_lines(lmqtt_server):
    sub = Paho(lmqtt_server, client_id="console-sub", version=5)
    try:
        sub.subscribe("dev/+/cmd", qos=1)
        produce(lmqtt_server.store_address, "dev/7/cmd", [b"on", b"off"], "--property", "by=ops", "--qos", "1")
        got = sub.get_n(2, timeout=10)
        assert [(m.topic, m.payload, m.qos) for m in got] == [("dev/7/cmd", b"on", 1), ("dev/7/cmd", b"off", 1)]
        assert got[0].properties.UserProperty == [("by", "ops")]
    finally:
        sub.disconnect()


def test_unreachable_store_is_a_clear_error():
    addr = f"127.0.0.1:{free_port()}"
    for args in (("produce", "--topic", "a/b"), ("consume", "--filter", "a"), ("admin",)):
        r = lmqtt(args[0], "--store", addr, *args[1:], stdin=b"x\n")
        assert r.returncode == 3, (args, r.returncode, r.stderr)
        err = r.stderr.decode()
        assert f"cannot reach the store at {addr}" in err and "refused" in err.lower(), err
        assert err.count(addr) == 1, err      # named once, not "cannot reach store X: cannot reach the store at X"
        assert "Traceback" not in err and r.stdout == b""


def test_store_dying_mid_produce_reports_what_was_acknowledged(tmp_path):
    from tests.support import LmqttStore
    st = LmqttStore(str(tmp_path / "d"), log_path=str(tmp_path / "store.log")).start()
    proc = subprocess.Popen([sys.executable, "-m", "lmqtt.gateway.cli", "produce", "--store", st.address,
                             "--topic", "k/x"], stdin=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        proc.stdin.write(b"first\n")
        proc.stdin.flush()
        with connect(st.address) as c:
            deadline = time.monotonic() + 10
            while not c.pull("k", 0, 0).records and time.monotonic() < deadline:
                time.sleep(0.05)
        st.kill9()
        proc.stdin.write(b"second\n")
        proc.stdin.close()
        rc = proc.wait(60)
        err = proc.stderr.read().decode()
        assert rc == 3, err
        assert "lost the store" in err and "after 1 acknowledged" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        st.stop()


def test_usage_errors():
    r = lmqtt("produce", "--store", "127.0.0.1:1", "--topic", "a/+")
    assert r.returncode == 2 and b"wildcards" in r.stderr
    r = lmqtt("produce", "--store", "127.0.0.1:1", "--topic", "a", "--property", "novalue")
    assert r.returncode == 2 and b"k=v" in r.stderr
    r = lmqtt("--help")
    out = r.stdout.decode()
    for name in ("produce", "consume", "admin", "passwd", "bench timer", "bench sdk", "bench fuzz-store"):
        assert name in out


def test_wrong_token_is_refused_not_unreachable(tmp_path):
    from tests.support import LmqttStore
    st = LmqttStore(str(tmp_path / "d"), extra_args=("--token", "s3cret"),
                    log_path=str(tmp_path / "store.log")).start()
    try:
        r = lmqtt("produce", "--store", st.address, "--topic", "a/b", stdin=b"x\n")
        assert r.returncode == 4 and b"refused the connection" in r.stderr and b"auth" in r.stderr, r.stderr
        r = lmqtt("produce", "--store", st.address, "--token", "s3cret", "--topic", "a/b", stdin=b"x\r\ny")
        assert r.returncode == 0, r.stderr
        r = lmqtt("consume", "--store", st.address, "--token", "s3cret", "--filter", "a", "--from", "earliest",
                  "--count", "2")
        assert r.stdout.decode().splitlines() == ["x", "y"]
    finally:
        st.stop()


def test_the_token_comes_from_LMQTT_STORE_TOKEN_as_for_the_store_and_the_gateway(tmp_path):
    """`lmqtt store` and `lmqtt gateway` take their token from $LMQTT_STORE_TOKEN; so do the tools
    that talk to them, and `--token` wins over it. A refusal says where the token comes from."""
    from tests.support import LmqttStore
    st = LmqttStore(str(tmp_path / "d"), extra_args=("--token", "s3cret"),
                    log_path=str(tmp_path / "store.log")).start()
    env = dict(os.environ, LMQTT_STORE_TOKEN="s3cret")

    def run(*args, stdin=b"", env=env):
        return subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", *args], input=stdin,
                              capture_output=True, cwd=ROOT, timeout=60, env=env)
    try:
        r = run("produce", "--store", st.address, "--topic", "a/b", stdin=b"x\n")
        assert r.returncode == 0, r.stderr
        r = run("consume", "--store", st.address, "--filter", "a", "--from", "earliest", "--count", "1")
        assert r.returncode == 0 and r.stdout.decode().splitlines() == ["x"], r.stderr
        r = run("admin", "--store", st.address, "--format", "json")
        assert r.returncode == 0 and "queues" in json.loads(r.stdout), r.stderr
        wrong = dict(env, LMQTT_STORE_TOKEN="nope")
        r = run("admin", "--store", st.address, "--token", "s3cret", env=wrong)
        assert r.returncode == 0, r.stderr
        r = run("admin", "--store", st.address, env=wrong)
        err = r.stderr.decode()
        assert r.returncode == 4 and "--token" in err and "LMQTT_STORE_TOKEN" in err, err
        assert "Traceback" not in err
    finally:
        st.stop()


def test_consume_refuses_a_queue_id_with_a_filter():
    """`--queue-id` names one ConsumeQueue of a first-level topic; a filter reads every queue of its
    topics, so the flag would be silently ignored: refused, before the store is even dialled."""
    addr = f"127.0.0.1:{free_port()}"          # nothing listens: the refusal comes first
    r = lmqtt("consume", "--store", addr, "--filter", "sensors/#", "--queue-id", "1", "--count", "1")
    err = r.stderr.decode()
    assert r.returncode == 2, (r.returncode, err)
    assert "--queue-id applies to a first-level topic" in err and "'sensors/#' is a filter" in err, err
    assert "Traceback" not in err
