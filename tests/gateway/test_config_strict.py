"""Config files are read strictly by every command that takes `--config` (`lmqtt serve`, `lmqtt
gateway`, `lmqtt store`): a value of the wrong TOML type and an unknown key or table are refused by
name (exit 2, one line, no traceback, nothing created on disk), an unreadable file is named with
the line. Each case runs the real command as a subprocess."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import ROOT, LmqttServer, LmqttStore, Paho, free_port

pytestmark = pytest.mark.timeout(120)


def lmqtt(cmd: str, tmp_path, conf_text: str | bytes, *extra: str):
    """Run `lmqtt CMD --config FILE` with a data dir that must not appear; the CompletedProcess."""
    conf = tmp_path / "lmqtt.toml"
    if isinstance(conf_text, bytes):
        conf.write_bytes(conf_text)
    else:
        conf.write_text(conf_text)
    args = {"serve": ["--data-dir", str(tmp_path / "data"), "--port", "0", "--metrics-port", "0",
                      "--store-port", "0"],
            "store": ["--data-dir", str(tmp_path / "data"), "--port", "0"],
            "gateway": ["--store", f"127.0.0.1:{free_port()}", "--port", "0", "--metrics-port", "0"]}[cmd]
    r = run_refused([cmd, "--config", str(conf), *args, *extra])
    assert not (tmp_path / "data").exists(), f"a refused start created the data dir: {r.stderr}"
    return r


def run_refused(args: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
    """`lmqtt ARGS` expected to stop at once: a process still running after `timeout` started
    although it should not have (killed, and the test fails with its output)."""
    p = subprocess.Popen([sys.executable, "-m", "lmqtt.gateway.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"lmqtt {' '.join(args[:1])} started instead of refusing: {err[-2000:]}")
    assert "Traceback" not in err, err
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


# a boolean given as a string: it was bool("false") == True, anonymous access ON
@pytest.mark.parametrize("cmd,key", [("serve", "allow_anonymous"), ("gateway", "allow_anonymous"),
                                     ("store", "dispatch_inline")])
def test_quoted_boolean_is_refused_naming_key_and_type(tmp_path, cmd, key):
    r = lmqtt(cmd, tmp_path, f'{key} = "false"\n')
    assert r.returncode == 2, r.stderr
    assert f"{key} must be true or false" in r.stderr, r.stderr
    assert "got 'false' (a string)" in r.stderr and "line 1" in r.stderr, r.stderr


def test_quoted_false_no_longer_turns_anonymous_access_on(tmp_path):
    """The user's case: a server on 0.0.0.0 with a password file and `allow_anonymous = "false"`
    started with `auth: password; anonymous allowed`. Now it does not start at all."""
    pw = tmp_path / "passwd"
    subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "passwd", "-b", "-c", str(pw), "alice", "pw"],
                   cwd=ROOT, check=True, timeout=60)
    r = lmqtt("serve", tmp_path, f'allow_anonymous = "false"\npassword_file = "{pw}"\n', "--host", "0.0.0.0")
    assert r.returncode == 2 and "anonymous allowed" not in r.stderr, r.stderr


@pytest.mark.parametrize("cmd,text,want", [
    ("serve", 'port = "1883"\n', "port must be an integer, got '1883' (a string)"),
    ("serve", "[serve]\nmax_inflight = 1.5\n", "max_inflight must be an integer, got 1.5 (a float)"),
    ("serve", 'sys_interval = "10"\n', "sys_interval must be a number, got '10' (a string)"),
    ("serve", "password_file = 7\n", "password_file must be a string"),
    ("gateway", 'safety_poll_ms = "250"\n', "safety_poll_ms must be a number"),
    ("store", '[store]\nport = "10911"\n', "port must be an integer, got '10911' (a string)"),
    ("store", "will_grace_s = true\n", "will_grace_s must be a number of seconds, got true (a boolean)"),
])
def test_wrong_types_are_refused(tmp_path, cmd, text, want):
    r = lmqtt(cmd, tmp_path, text)
    assert r.returncode == 2 and want in r.stderr, r.stderr


@pytest.mark.parametrize("cmd", ["serve", "gateway", "store"])
def test_unknown_key_is_refused_with_the_closest_known_one(tmp_path, cmd):
    # the user's case: `tls_prot = 8883` started lmqtt serve without TLS and without a word
    r = lmqtt(cmd, tmp_path, "# listeners\ntls_prot = 8883\n")
    assert r.returncode == 2, r.stderr
    assert "unknown key 'tls_prot'" in r.stderr and "line 2" in r.stderr, r.stderr
    assert "did you mean 'tls_port'?" in r.stderr, r.stderr


@pytest.mark.parametrize("cmd,text,want", [
    ("serve", "[serve]\nflush_mdoe = 'sync'\n", "unknown key 'flush_mdoe'"),
    ("gateway", "[gateway]\nsafety_pol_ms = 5\n", "did you mean 'safety_poll_ms'?"),
    ("serve", "[sevre]\nport = 1\n", "unknown table [sevre]"),
    ("store", "[stor]\nport = 1\n", "did you mean [store]?"),
    ("serve", "completely_unrelated = 1\n", "unknown key 'completely_unrelated'"),
])
def test_unknown_keys_and_tables(tmp_path, cmd, text, want):
    r = lmqtt(cmd, tmp_path, text)
    assert r.returncode == 2 and want in r.stderr, r.stderr


@pytest.mark.parametrize("cmd", ["serve", "gateway", "store"])
def test_binary_file_is_named_with_its_line(tmp_path, cmd):
    r = lmqtt(cmd, tmp_path, b"port = 1\n\x89PNG\r\n\x1a\n\x00\x8f\xff")
    assert r.returncode == 2, r.stderr
    assert "lmqtt.toml is not a TOML text file: line 2" in r.stderr and "UTF-8" in r.stderr, r.stderr


@pytest.mark.parametrize("cmd", ["serve", "gateway", "store"])
def test_malformed_toml_is_named_with_its_line(tmp_path, cmd):
    r = lmqtt(cmd, tmp_path, "port = 1\nhost = \n")
    assert r.returncode == 2, r.stderr
    assert "lmqtt.toml is not valid TOML" in r.stderr and "line 2" in r.stderr, r.stderr


def test_config_file_that_is_a_directory(tmp_path):
    r = run_refused(["serve", "--config", str(tmp_path), "--data-dir", str(tmp_path / "data")])
    assert r.returncode == 2 and "is a directory" in r.stderr, r.stderr


def test_one_file_for_the_fleet_still_starts_each_command(tmp_path):
    """What stays accepted: the Helm chart's shared lmqtt.toml, with the store's keys at the top
    level and a [store] table (skipped by lmqtt serve), gateway keys (skipped by lmqtt store), an
    integer where a number is asked (`sys_interval = 5`), dashes in keys."""
    conf = tmp_path / "fleet.toml"
    conf.write_text('max_inflight = 10\nsys-interval = 5\nwill_grace_s = 3\nallow_anonymous = false\n'
                    '[serve]\nmax_subscriptions = 7\n[store]\nflush_mode = "sync"\nmax_frame_mb = 8\n')
    srv = LmqttServer(str(tmp_path / "serve"), ("--config", str(conf)), str(tmp_path / "serve.log")).start()
    try:
        Paho(srv, "fleet-conf").disconnect()
    finally:
        assert srv.stop() == 0, srv.log_tail()
    store = LmqttStore(str(tmp_path / "store"), ("--config", str(conf)), str(tmp_path / "store.log")).start()
    try:
        pass
    finally:
        assert store.stop() == 0, store.log_tail()
    assert "flush mode: sync" in store.log_tail()
