"""More mistakes a new user makes (tests/gateway/test_usage_errors_name_the_cause.py has the tools'
ones): the SDK, `lmqtt store`, `lmqtt serve --workers`, `read_history`, `lmqtt passwd`, each against real `lmqtt serve` / `lmqtt store` subprocesses, real sockets and the real `lmqtt`
command. Errors are one line naming the real cause, never a traceback."""
from __future__ import annotations

import json

import pytest

from tests.support import LmqttServer, lmqtt_cli

pytestmark = pytest.mark.timeout(120)


cli = lmqtt_cli


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("leftovers") / "data"
    d.mkdir()
    srv = LmqttServer(str(d)).start()
    yield srv
    srv.stop()


# ----------------------------------------------------------- 1. the SDK may not produce to '$' topics
def test_sdk_send_to_a_dollar_topic_is_refused_by_the_store(server):
    """`connect(A).producer().send("$SYS/x", b"y")` was stored and reached MQTT subscribers of
    `$SYS/#` as the broker's own statistics; `$timer` wrote into the store's parked delayed messages."""
    from lmqtt.store.client import StoreClientError, connect
    with connect(server.store_address) as conn:
        p = conn.producer()
        for topic in ("$SYS/broker/clients/connected", "$timer", "$anything/else"):
            with pytest.raises(StoreClientError, match=r"topics starting with '\$' belong to the broker and the store"):
                p.send(topic, b"y")
        # a batch with one '$' topic writes nothing of the batch
        with pytest.raises(StoreClientError, match=r"starting with '\$'"):
            p.send_batch([("leftovers/ok", b"a"), ("$SYS/x", b"b")])
        assert p.send("leftovers/ok", b"c").queue_offset == 0      # ordinary topics still go in
    r = cli("admin", "--store", server.store_address, "--format", "json")
    topics = {q["topic"] for q in json.loads(r.stdout)["queues"]}
    assert "$SYS" not in topics and "$anything" not in topics, topics
    assert not any(t.startswith("$timer") for t in topics), topics


# ----------------------------------------------------------- 2. lmqtt store --redis with no Redis
def test_store_says_when_its_redis_is_not_there(tmp_path):
    """`lmqtt store --redis redis://127.0.0.1:26379/0` with no Redis: the banner said "Redis broadcast
    at ..." and nothing else; the first trace was `notify_redis_unavailable` at the first publish.
    Now the banner and a warning at start name the unreachable Redis, as `lmqtt gateway --redis` does."""
    import time

    from tests.support import LmqttStore, free_port
    (tmp_path / "s").mkdir()
    url = f"redis://127.0.0.1:{free_port()}/0"          # nobody listens there
    store = LmqttStore(str(tmp_path / "s"), ("--redis", url)).start()
    try:
        deadline = time.monotonic() + 20
        while "metrics:" not in store.log_tail() and time.monotonic() < deadline:
            time.sleep(0.1)
        log = store.log_tail()
        assert f"(Redis NOT REACHABLE at {url}: retrying;" in log, log
        assert f"event=notify_redis_unreachable url={url}" in log, log
        assert "Traceback" not in log, log
    finally:
        store.stop()


# ----------------------------------------------------------- 3. serve --workers N --host ::1
def test_workers_banner_brackets_an_ipv6_host(tmp_path):
    """`lmqtt serve --workers 2 --host ::1` printed `mqtt://::1:1883` (serve itself brackets since
    3c22ac7); now `mqtt://[::1]:PORT`, through the same helper (gateway/app/config.py hostport)."""
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
    srv.spawn(["serve", "--workers", "2", "--host", "::1", "--port", str(srv.port), "--data-dir", srv.data_dir,
               "--metrics-port", str(srv.metrics_port), "--store-port", str(srv.store_port)], (srv.port,), 60)
    try:
        deadline = time.monotonic() + 60
        while "2 workers on" not in srv.log_tail() and time.monotonic() < deadline:
            time.sleep(0.1)
        log = srv.log_tail()
        assert f"2 workers on mqtt://[::1]:{srv.port} " in log, log
        assert "mqtt://::1:" not in log, log
    finally:
        srv.stop()


# ----------------------------------------------------------- 4. read_history with a wrong tier URL
def test_read_history_with_no_manifest_at_the_tier_url_names_it(tmp_path):
    """`read_history(tier="file:///wrong")` with no manifest there read everything through the store,
    slowly and silently; now FileNotFoundError naming the URL, as spark.read.parquet does for a missing
    path (raised on the driver before Spark is used: no session is needed to see it)."""
    pytest.importorskip("pyspark")
    from lmqtt.store.spark import read_history
    for url in (f"file://{tmp_path}/wrong", f"file://{tmp_path}"):      # missing, and a directory without one
        with pytest.raises(FileNotFoundError, match=f"no tier manifest at {url} "):
            read_history(None, store="127.0.0.1:1", tier=url, topic="plant7")


# ----------------------------------------------------------- 5. lmqtt passwd from a pipe
def test_passwd_reads_a_piped_password_without_a_warning(tmp_path):
    """`echo PASS | lmqtt passwd -c FILE USER` (no terminal) printed Python's GetPassWarning ("Can not
    control echo on the terminal") and its prompts; now stdin's first line is the password, silently,
    and the file holds a hash that password checks against."""
    from lmqtt.gateway.security.auth import read_password_file, split_entry, verify_password
    f = tmp_path / "passwd"
    r = cli("passwd", "-c", str(f), "alice", input="s3cret-pipe\n")
    assert r.returncode == 0, r
    assert "Warning" not in r.stderr and "Password:" not in r.stderr and "Password:" not in r.stdout, r
    entry = read_password_file(str(f))["alice"]
    assert verify_password(split_entry(entry)[0], b"s3cret-pipe"), entry
    assert not verify_password(split_entry(entry)[0], b"s3cret-pipe\n")
    # two lines that differ are a mismatch (as the terminal's two prompts), and nothing changes
    r = cli("passwd", str(f), "alice", input="one\ntwo\n")
    assert r.returncode == 1 and "passwords do not match" in r.stderr and "Warning" not in r.stderr, r
    assert read_password_file(str(f))["alice"] == entry
    r = cli("passwd", str(f), "bob", input="")        # nothing piped
    assert r.returncode == 1 and "no password given" in r.stderr, r


# ----------------------------------------------------------- 6. a member list with another server's port
def test_member_list_with_a_non_store_port_tries_the_next_member(server):
    """`connect("127.0.0.1:<console port>,127.0.0.1:<store port>")` failed at once on the HTTP port
    ("is not an lmqtt store") instead of trying the next member; now it connects to the store, and a
    list with no store at all names every member that refused, in one error."""
    import asyncio

    from lmqtt.store.client import StoreClientError, connect, connect_async
    http = f"127.0.0.1:{server.metrics_port}"
    good = f"{http},{server.store_address}"
    with connect(good, failover_timeout=20) as c:
        assert c.producer().send("leftovers/members", b"x").offset >= 0
    bad = f"{http},127.0.0.1:{server.metrics_port}"        # the same HTTP port twice: no store
    with pytest.raises(StoreClientError, match=f"no member of {bad} is an lmqtt store: {http} is not an lmqtt store"):
        connect(bad, failover_timeout=20)

    async def aio():
        c = await connect_async(good, failover_timeout=20)
        try:
            assert (await c.producer().send("leftovers/members", b"y")).offset >= 0
        finally:
            await c.close()
        with pytest.raises(StoreClientError, match=f"no member of {bad} is an lmqtt store"):
            await connect_async(bad, failover_timeout=20)
    asyncio.run(aio())
