"""Mistakes a new user makes following README, docs/sdk.md and docs/ha.md (a tool pointed at the
wrong port, a misspelt name, a missing service, a half-given TLS pair), each against a real `lmqtt
serve` subprocess and the real `lmqtt` command. Errors are one line naming the real cause, never a traceback."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from tests.support import ROOT, LmqttServer, listening, lmqtt_cli

pytestmark = pytest.mark.timeout(120)


cli = lmqtt_cli


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("newcomer") / "data"
    d.mkdir()
    srv = LmqttServer(str(d)).start()
    # the console/metrics port opens after the MQTT and store ports start() waits for; the first
    # test points tools at it
    assert listening(srv.host, srv.metrics_port, 30, srv.proc), srv.log_tail()
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


# ------------------------------------------------------------------------------- lmqtt admin
def test_admin_table_of_a_store_group_keeps_its_width(tmp_path):
    """`lmqtt admin --store a:p,b:p,c:p` (docs/ha.md "Seeing it"): the STATS table printed the
    group's `ha` as one JSON value, and right-aligned every other value to its width (lines of
    ~230 characters, mostly blanks). Now each field of `ha` is a row of its own."""
    from tests.ha.group import StoreGroup
    g = StoreGroup(tmp_path, 3, election_timeout=2.0).start()
    try:
        g.wait_primary(in_sync=3)
        r = cli("admin", "--store", g.peers)
        assert r.returncode == 0, r.stderr
        stats = r.stdout.split("\nSTATS\n", 1)[1].splitlines()
        rows = dict(line.split(None, 1) for line in stats[2:])
        assert rows["ha.role"] == "primary" and rows["ha.group"] == g.name, r.stdout
        assert rows["ha.in_sync"] == "[1, 2, 3]", r.stdout
        assert "ha" not in rows and rows["max_offset"].isdigit(), r.stdout
        assert max(len(line) for line in stats) < 100, r.stdout
    finally:
        g.stop()


def test_admin_names_an_unknown_group_instead_of_none(server):
    r = cli("admin", "--store", server.store_address, "--group", "nosuch")
    assert r.returncode == 0, r.stderr
    groups = r.stdout.split("GROUPS\n", 1)[1].split("\n\n", 1)[0]
    assert groups.strip() == "nosuch: no committed offset (no such group, or one that only POPs)", r.stdout


# ------------------------------------------------------------------------ serve --workers ports
def test_workers_metrics_ports_that_hit_the_store_port_are_refused_by_name(tmp_path):
    """`serve --workers 2 --metrics-port P --store-port P+1`: worker 1 took P+1 for its metrics and
    console, found it in use by the store and ran without them, said only in its log line. Now the
    command refuses before anything starts, naming both ports."""
    from tests.ha.group import group_ports
    (base,) = group_ports(1)                      # base, base+1, base+2 free
    from tests.support import free_port
    data = tmp_path / "d"
    r = cli("serve", "--workers", "2", "--port", str(free_port()), "--metrics-port", str(base),
            "--store-port", str(base + 1), "--data-dir", str(data))
    assert r.returncode == 2, r
    line = r.stderr.strip()
    assert "\n" not in line and f"{base + 1} is the --store-port" in line, line
    assert f"({base}..{base + 1})" in line, line
    assert not data.exists()


# --------------------------------------------------------------------------------- lmqtt simulate
@pytest.fixture(scope="module")
def passworded(tmp_path_factory):
    d = tmp_path_factory.mktemp("newcomer-pw")
    assert cli("passwd", "-b", "-c", str(d / "passwd"), "alice", "s3cret").returncode == 0
    (d / "data").mkdir()
    srv = LmqttServer(str(d / "data"), ("--password-file", str(d / "passwd"))).start()
    yield srv
    srv.stop()


def test_simulate_against_a_passworded_broker(passworded):
    """docs/spark.md's simulator had no credentials and did not wait for the CONNACK: against a
    server with --password-file it said "lost the MQTT broker after 0 readings: The client is not
    currently connected". Now the refusal is named, and --username/--password log in."""
    port = str(passworded.port)
    r = cli("simulate", "--port", port, "--devices", "2", "--seconds", "1")
    assert r.returncode == 3, r
    assert r.stderr.strip() == (f"lmqtt simulate: the MQTT broker at 127.0.0.1:{port} refused the connection: "
                                "Not authorized (give --username and --password)"), r.stderr
    r = cli("simulate", "--port", port, "--devices", "2", "--seconds", "1", "--interval", "0.2",
            "--username", "alice", "--password", "s3cret")
    assert r.returncode == 0, r.stderr
    r = cli("consume", "--store", passworded.store_address, "--filter", "telemetry", "--from", "earliest",
            "--timeout", "1", "--format", "json")
    assert r.returncode == 0 and len(r.stdout.splitlines()) >= 2, r


def test_simulate_pointed_at_the_store_port_says_it_is_not_mqtt(server):
    r = cli("simulate", "--port", str(server.store_port), "--devices", "1", "--seconds", "1")
    assert r.returncode == 3, r
    assert "did not answer the MQTT CONNECT (is it an MQTT port?" in r.stderr, r.stderr


# ------------------------------------------------------------------------------- asyncio SDK
def test_asyncio_connection_has_the_admin_queries(server):
    """docs/sdk.md: connect_async gives "the same command API as the sync connection"; `c.admin()`
    was missing (AttributeError), so an asyncio service had no topics/lag/lookups."""
    from lmqtt.store.client import connect, connect_async

    async def run():
        c = await connect_async(server.store_address)
        try:
            r = await c.producer().send("nc-aio/a/temp", b"21.5", keys=("dev-a",))
            a = c.admin()
            assert (await a.get_by_msg_id(r.msg_id)).body == b"21.5"
            (hit,) = await a.query_by_key("nc-aio/a/temp", "dev-a")
            assert hit.msg_id == r.msg_id
            assert {"topic": "nc-aio", "queue_id": 0} .items() <= next(
                q for q in await a.topics() if q["topic"] == "nc-aio").items()
            assert await a.offsets("nc-aio") == (0, 1)
            assert await a.offset_for_time("nc-aio", 0) == 0
            assert (await a.stats())["max_offset"] > 0
            g = await c.consumer("nc-aio", "nc-billing")
            await g.poll()
            await g.commit()
            assert await a.committed("nc-billing", "nc-aio") == 1
            assert [(q["committed"], q["lag"]) for q in await a.lag("nc-billing")] == [(1, 0)]
            return r.msg_id, await a.pop_info("nc-workers", "nc-aio")
        finally:
            await c.close()
    msg_id, pop = asyncio.run(run())
    sync = connect(server.store_address)
    try:
        assert sync.admin().get_by_msg_id(msg_id).body == b"21.5"
        assert pop == sync.admin().pop_info("nc-workers", "nc-aio")
    finally:
        sync.close()


# ------------------------------------------------------------------------------------ --help
@pytest.mark.parametrize("cmd", ["produce", "consume", "admin", "serve", "gateway", "store"])
def test_help_says_every_default(cmd):
    """Every option that takes a value says its default (consume's --count, --timeout and --format,
    admin's --format, every tool's --token, serve's --config, --cert, --password-file, --tier ...,
    store's --group, --peers ... did not)."""
    import re
    r = cli(cmd, "--help")
    assert r.returncode == 0, r.stderr
    opts = re.split(r"\n  (?=-)", r.stdout.split("options:", 1)[1])
    missing = []
    for raw in opts:
        o = " ".join(raw.split())
        head = o.split("  ")[0] if "  " in o else o
        # a metavar follows its option after one space; a flag's help after two or a new line
        takes_value = re.match(r"(-\w, )?--[\w-]+ (?! )\S", raw)
        actions = ("--filter", "--topic", "--release-gateway", "--session",     # required, or what to do
                   "--store",                                                # (gateway: required)
                   "--user-add", "--user-passwd", "--user-remove", "--acl-add", "--acl-remove",
                   "--add-member", "--remove-member")
        if takes_value and "default" not in o and head.split()[0] not in actions:
            missing.append(o)
    assert not missing, missing


# ------------------------------------------------------------------------------------------ TLS
def test_tls_cert_without_key_or_a_key_as_cert_is_named(tmp_path):
    """docs/gateway.md's `--tls-port 8883 --cert server.pem` with the key in another file and no
    --key, or the key given as --cert: OpenSSL's "[SSL] PEM lib (_ssl.c:3926) (do the certificate
    and key belong together?)". Now the message says which file lacks what."""
    pytest.importorskip("trustme")
    from tests.support import free_port, pki_files
    pki = pki_files(tmp_path)
    base = ("serve", "--port", "0", "--metrics-port", "0", "--store-port", "0", "--tls-port", str(free_port()),
            "--data-dir", str(tmp_path / "d"))
    r = cli(*base, "--cert", pki["cert"])
    assert r.returncode == 2, r
    assert r.stderr.strip() == (f"lmqtt serve: TLS certificate {pki['cert']} has no private key in it: "
                                "give the key file with --key FILE"), r.stderr
    r = cli(*base, "--cert", pki["key"], "--key", pki["key"])
    assert r.returncode == 2, r
    assert "no PEM certificate in it" in r.stderr and "is it the key?" in r.stderr, r.stderr
    assert not (tmp_path / "d").exists()


# ----------------------------------------------------------------------------- fleet with Redis
def test_gateway_says_when_its_redis_is_not_there(tmp_path):
    """docs/fleet.md's `lmqtt gateway --redis redis://...` with Redis not running (not started
    yet, a wrong port): the banner said "notify: broadcast via redis://..." and nothing else; the
    only trace was a later "session_claim_failed ... network:ConnectionError". Now the banner and
    a warning name the unreachable Redis (the gateway still runs, on the safety poll)."""
    import time

    from tests.support import LmqttGateway, LmqttStore, free_port
    (tmp_path / "s").mkdir()
    store = LmqttStore(str(tmp_path / "s")).start()
    url = f"redis://127.0.0.1:{free_port()}/0"          # nobody listens there
    gw = LmqttGateway(store.address, ("--redis", url), log_dir=str(tmp_path))
    try:
        gw.start()
        deadline = time.monotonic() + 20
        while "auth:" not in gw.log_tail() and time.monotonic() < deadline:
            time.sleep(0.1)
        log = gw.log_tail()
        assert f"(Redis NOT REACHABLE at {url}: retrying;" in log, log
        assert f"event=notify_redis_unreachable url={url}" in log, log
    finally:
        gw.stop()
        store.stop()


def test_consume_with_an_empty_filter_is_a_usage_error(server):
    """`--filter ''` (an unset shell variable) printed "0 messages" and exit 0."""
    r = cli("consume", "--store", server.store_address, "--filter", "", "--timeout", "1")
    assert r.returncode == 2 and "--filter is empty" in r.stderr, r


# ---------------------------------------------------------------------------------- banner
def test_banner_urls_of_an_ipv6_host_are_bracketed(tmp_path):
    """`lmqtt serve --host ::1` printed `mqtt://::1:1883` and `http://::1:9883/console/`, which no
    browser or client takes; now `[::1]:PORT`."""
    import socket
    import time
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    (tmp_path / "d").mkdir()
    srv = LmqttServer(str(tmp_path / "d"))
    srv.host = "::1"
    srv.spawn(["serve", "--host", "::1", "--port", str(srv.port), "--data-dir", srv.data_dir, "--metrics-port",
               str(srv.metrics_port), "--store-port", str(srv.store_port)], (srv.port,))
    try:
        deadline = time.monotonic() + 20
        while "auth:" not in srv.log_tail() and time.monotonic() < deadline:
            time.sleep(0.1)
        log = srv.log_tail()
        assert f"listening on mqtt://[::1]:{srv.port} " in log, log
        assert f"http://[::1]:{srv.metrics_port}/console/" in log, log
        assert f"lmqtt://127.0.0.1:{srv.store_port}" in log, log         # the store stays on --store-host
        assert "://::1:" not in log, log
    finally:
        srv.stop()


def test_produce_refuses_dollar_topics(server):
    """`lmqtt produce --topic '$SYS/x'` was stored and reached MQTT subscribers of `$SYS/#` as if the
    broker had said it (an MQTT client's publish there gets PUBACK 0x87), and `--topic '$timer'` wrote
    into the store's queue of parked delayed messages."""
    for topic in ("$SYS/broker/clients/connected", "$timer"):
        r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "produce", "--store", server.store_address,
                            "--topic", topic], input="x\n", cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r
        assert "topics starting with '$' belong to the broker" in r.stderr and "Traceback" not in r.stderr, r
    r = cli("admin", "--store", server.store_address, "--format", "json")
    import json
    assert not [q for q in json.loads(r.stdout)["queues"] if q["topic"] == "$SYS"], r.stdout
