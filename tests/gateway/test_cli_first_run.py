"""A new user's first runs, as real `lmqtt` subprocesses: an address that is not HOST:PORT, an empty
topic, a start refused by a port in use, and the tier in `lmqtt serve`'s
banner. Each is one line naming the real cause, and a refused start leaves no data dir behind."""
from __future__ import annotations

import socket
import time

import pytest

from tests.gateway.test_config_strict import run_refused
from tests.support import LmqttServer, free_port, lmqtt_cli

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("cmd", [["gateway", "--port", "0", "--metrics-port", "0"], ["admin"], ["produce", "--topic", "t"]])
def test_a_store_address_whose_port_is_not_a_number_is_one_line(cmd):
    r = run_refused([*cmd, "--store", "127.0.0.1:notaport"])
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "127.0.0.1:notaport" in lines[0] and "'notaport' is not a port number" in lines[0], lines
    assert "invalid literal" not in r.stderr


def test_produce_to_an_empty_topic_says_it_is_empty(tmp_path):
    r = lmqtt_cli("produce", "--store", f"127.0.0.1:{free_port()}", "--topic", "", input="x\n")
    assert r.returncode == 2, r.stderr
    assert "--topic must not be empty" in r.stderr and "wildcards" not in r.stderr, r.stderr


@pytest.mark.parametrize("which", ["--port", "--store-port"])
def test_a_start_refused_for_a_port_in_use_leaves_no_new_data_dir(tmp_path, which):
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    taken = str(blocker.getsockname()[1])
    data = tmp_path / "d"
    try:
        args = ["serve", "--data-dir", str(data), "--metrics-port", "0", "--port", "0", which, taken]
        r = run_refused(args)
    finally:
        blocker.close()
    assert r.returncode == 1 and f"127.0.0.1:{taken}" in r.stderr, r.stderr
    assert not data.exists(), "a refused start left the data dir it created"


def test_a_refused_start_keeps_a_data_dir_that_was_there(tmp_path):
    data = tmp_path / "d"
    data.mkdir()
    (data / "mine.txt").write_text("kept")
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    try:
        r = run_refused(["serve", "--data-dir", str(data), "--metrics-port", "0",
                         "--port", str(blocker.getsockname()[1])])
    finally:
        blocker.close()
    assert r.returncode == 1, r.stderr
    assert (data / "mine.txt").read_text() == "kept"


def test_serve_with_a_tier_shows_it_in_the_banner(tmp_path):
    tier = tmp_path / "cold"
    srv = LmqttServer(str(tmp_path / "d"), extra_args=("--tier", f"file://{tier}"),
                      log_path=str(tmp_path / "serve.log")).start()
    try:
        deadline = time.monotonic() + 20
        while "  tier:" not in srv.log_tail() and time.monotonic() < deadline:
            time.sleep(0.05)
        log = srv.log_tail()
        assert f"  tier:       file://{tier}" in log, log
    finally:
        assert srv.stop() == 0, srv.log_tail()
