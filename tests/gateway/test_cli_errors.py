"""What a new user meets at the command line, run as the real `lmqtt` subprocess: errors are one
line naming the real cause (no traceback), refused starts create nothing, two processes never share
a data dir, `--version`, `lmqtt bench` usage, defaults in --help, and process names that make
`pidof lmqtt` / `kill -HUP` reach the process that reloads its files."""
from __future__ import annotations

import ctypes
import importlib.metadata
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from lmqtt.gateway.cli import BENCH
from tests.gateway.test_config_strict import run_refused
from tests.support import ROOT, LmqttServer, LmqttStore, Paho, free_port, lmqtt_cli

pytestmark = pytest.mark.timeout(180)


cli = lmqtt_cli


def wait_for(cond, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.05)


# --------------------------------------------------------------------------- the command itself
@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag):
    r = cli(flag)
    assert r.returncode == 0 and r.stdout == f"lmqtt {importlib.metadata.version('lmqtt')}\n", r
    assert r.stdout == "lmqtt 0.1.0\n"


def test_bench_help_lists_the_benchmarks():
    r = cli("bench", "--help")
    assert r.returncode == 0, r.stderr
    assert "usage: lmqtt bench BENCHMARK" in r.stdout and "commands:" not in r.stdout, r.stdout
    for name in BENCH:
        assert f"\n  {name} " in r.stdout, name


def test_bench_without_or_with_an_unknown_benchmark():
    r = cli("bench")
    assert r.returncode == 2 and "lmqtt bench: name a benchmark" in r.stderr, r.stderr
    assert "usage: lmqtt bench BENCHMARK" in r.stderr
    r = cli("bench", "nosuch")
    assert r.returncode == 2 and "unknown benchmark 'nosuch'" in r.stderr, r.stderr
    assert all(f"\n  {name} " in r.stderr for name in BENCH)
    r = cli("bench", "lightqueu")
    assert r.returncode == 2 and "did you mean 'lightqueue'?" in r.stderr, r.stderr


@pytest.mark.parametrize("cmd,shown", [
    ("simulate", ["MQTT broker port (default: 1883)", "(default: 20)", "(default: 0.01)", "(default: 1)"]),
    ("spark-iot", ["(default: 127.0.0.1:10911)", "(default: telemetry/+)", "(default: 1 minute)",
                   "(default: local[2])", "(default: 4.0)"]),
])
def test_help_shows_the_defaults(cmd, shown):
    r = cli(cmd, "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())          # argparse wraps lines
    for s in shown:
        assert s in text, (s, r.stdout)


# --------------------------------------------------------------------------- lmqtt passwd
def test_passwd_in_a_missing_folder_names_the_folder(tmp_path):
    target = tmp_path / "etc" / "lmqtt" / "passwd"
    r = cli("passwd", "-b", "-c", str(target), "alice", "pw")
    assert r.returncode == 1, r.stderr
    assert f"the folder {target.parent} does not exist" in r.stderr and "mkdir -p" in r.stderr, r.stderr
    assert not target.parent.exists()
    (tmp_path / "etc" / "lmqtt").mkdir(parents=True)
    assert cli("passwd", "-b", "-c", str(target), "alice", "pw").returncode == 0
    assert os.listdir(target.parent) == ["passwd"]           # no temporary file left


def test_passwd_without_a_password_at_the_prompt_says_so(tmp_path):
    """Input ended at the prompt (Ctrl-D, or no terminal): one line, nothing written; and a missing
    folder is named before any password is asked for."""
    f = tmp_path / "passwd"
    r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "passwd", "-c", str(f), "alice"],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no password given; nothing changed" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not f.exists()
    missing = tmp_path / "nodir" / "passwd"
    r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "passwd", "-c", str(missing), "alice"],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "does not exist (create it first" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "Password" not in r.stderr


def test_passwd_on_a_binary_file(tmp_path):
    f = tmp_path / "passwd"
    f.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    r = cli("passwd", "-b", str(f), "alice", "pw")
    assert r.returncode == 1 and "is not a password file" in r.stderr, r.stderr


# --------------------------------------------------------------------------- data dirs
def test_a_second_process_on_a_data_dir_in_use_is_refused_by_name(tmp_path):
    srv = LmqttServer(str(tmp_path / "d"), log_path=str(tmp_path / "serve.log")).start()
    try:
        want = f"data dir {tmp_path / 'd'} is in use by another lmqtt (pid {srv.proc.pid}, lmqtt serve)"
        for args in (["serve", "--port", "0", "--store-port", "0", "--metrics-port", "0"],
                     ["store", "--port", "0"],
                     ["serve", "--workers", "2", "--port", "0", "--store-port", "0", "--metrics-port", "0"]):
            r = run_refused([*args, "--data-dir", str(tmp_path / "d")])
            assert r.returncode == 1 and want in r.stderr, (args, r.stderr)
        # the first one was not disturbed
        sub, pub = Paho(srv, "in-use-sub"), Paho(srv, "in-use-pub")
        sub.subscribe("in-use/t", 1)
        pub.publish("in-use/t", b"still here", 1)
        assert sub.get(10).payload == b"still here"
        sub.disconnect()
        pub.disconnect()
    finally:
        assert srv.stop() == 0, srv.log_tail()
    # the lock ends with its process: the data dir is free again
    srv.start()
    srv.stop()


@pytest.mark.parametrize("cmd", ["serve", "store"])
def test_data_dir_that_is_a_file(tmp_path, cmd):
    f = tmp_path / "afile"
    f.write_text("x")
    r = run_refused([cmd, "--data-dir", str(f), "--port", "0", "--metrics-port", "0"])
    assert r.returncode == 1, r.stderr
    assert f"cannot use data dir {f}: not a directory" in r.stderr and "File exists" not in r.stderr, r.stderr


def _drop_dac_override():
    """preexec_fn: as root, give up CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (bounding set, so the
    exec'd lmqtt has neither): file modes apply to it as to any user."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:           # PR_CAPBSET_DROP
            os._exit(97)


@pytest.mark.parametrize("cmd", ["serve", "store"])
def test_data_dir_not_writable_says_permission_denied(tmp_path, cmd):
    """A data dir made by another user (an earlier run as root): the part that cannot be written is
    named, where RocksDB failed with `MetadataError … Permission denied` and a traceback."""
    data = tmp_path / "d"
    meta = data / "lightqueue" / "meta"
    meta.mkdir(parents=True)
    meta.chmod(0o500)
    args = [sys.executable, "-m", "lmqtt.gateway.cli", cmd, "--data-dir", str(data), "--port", "0",
            "--metrics-port", "0"] + (["--store-port", "0"] if cmd == "serve" else [])
    try:
        p = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=_drop_dac_override if os.geteuid() == 0 else None)
        try:
            _, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            pytest.fail(f"started on a data dir it cannot write: {err}")
        if p.returncode == 97:
            pytest.skip("cannot drop CAP_DAC_OVERRIDE here (no CAP_SETPCAP)")
    finally:
        meta.chmod(0o700)
    assert p.returncode == 1, err
    assert "Traceback" not in err, err
    assert f"cannot use data dir {data}: permission denied: {meta} is not writable" in err, err


def test_refused_flags_create_no_data_dir(tmp_path):
    cases = [(["--host", "0.0.0.0"], "without authentication"),
             (["--store-host", "0.0.0.0", "--store-port", str(free_port())], "without an auth token"),
             (["--workers", "0"], "workers must be at least 1"),
             (["--workers", "-2"], "workers must be at least 1"),
             (["--workers", "2", "--host", "0.0.0.0"], "without authentication")]
    for i, (flags, want) in enumerate(cases):
        data = tmp_path / f"d{i}"
        r = run_refused(["serve", "--data-dir", str(data), "--port", "0", "--metrics-port", "0", *flags])
        assert r.returncode == 2 and want in r.stderr, (flags, r.stderr)
        assert not data.exists(), f"{flags}: the data dir was created before the start was refused"


@pytest.mark.parametrize("cmd", ["serve", "store"])
def test_a_segment_too_small_for_the_largest_message_is_refused_before_the_data_dir(tmp_path, cmd):
    """--segment-mb 2 cannot hold a 4 MiB message: it was a traceback from StoreConfig after the
    data dir was made; now one line naming the smallest size, and no data dir."""
    data = tmp_path / "d"
    r = run_refused([cmd, "--data-dir", str(data), "--port", "0", "--segment-mb", "2"])
    assert r.returncode == 2, r.stderr
    assert "segment_mb must be at least 5" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not data.exists()


def test_metrics_port_in_use_is_named_with_the_flag(tmp_path):
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    taken = blocker.getsockname()[1]
    try:
        srv = LmqttServer(str(tmp_path / "d"), log_path=str(tmp_path / "serve.log"))
        srv.metrics_port = taken
        srv.start()
        store = LmqttStore(str(tmp_path / "s"), ("--metrics-port", str(taken)), str(tmp_path / "store.log")).start()
        try:
            for proc in (srv, store):
                wait_for(lambda: "metrics:" in proc.log_tail(), lambda: proc.log_tail())
                assert (f"metrics:    unavailable: cannot listen on 127.0.0.1:{taken}: Address already in use "
                        f"(choose another port with --metrics-port N, or 0 = off)") in proc.log_tail(), proc.log_tail()
            Paho(srv, "metrics-taken").disconnect()           # MQTT serves anyway
        finally:
            store.stop()
            srv.stop()
    finally:
        blocker.close()


# --------------------------------------------------------------------------- process names
def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def _pidof(name: str) -> set[int]:
    out = subprocess.run(["pidof", name], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


needs_pidof = pytest.mark.skipif(not shutil.which("pidof") or not sys.platform.startswith("linux"),
                                 reason="pidof / procfs")


@needs_pidof
def test_pidof_finds_lmqtt_serve_and_sighup_reloads(tmp_path):
    """docs/gateway.md's `kill -HUP $(pidof -s lmqtt)`: the process was `python3`, pidof found
    nothing. Other lmqtt processes may run on this machine, so the test looks for its own pid in
    `pidof lmqtt` and signals that pid only."""
    acl = tmp_path / "acl"
    acl.write_text("allow all publish #\nallow all subscribe #\n")
    srv = LmqttServer(str(tmp_path / "d"), ("--acl-file", str(acl)), str(tmp_path / "serve.log")).start()
    try:
        pid = srv.proc.pid
        assert _comm(pid) == "lmqtt"
        assert pid in _pidof("lmqtt")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0].startswith(b"lmqtt serve --host 127.0.0.1")
        subprocess.run(["kill", "-HUP", str(pid)], check=True)
        wait_for(lambda: "event=reloaded what=acl" in srv.log_tail(), lambda: srv.log_tail())
        assert srv.proc.poll() is None
        Paho(srv, "after-hup").disconnect()
    finally:
        assert srv.stop() == 0, srv.log_tail()


@needs_pidof
def test_workers_have_names_of_their_own_and_hup_reaches_them_through_the_supervisor(tmp_path):
    acl = tmp_path / "acl"
    acl.write_text("allow all publish #\nallow all subscribe #\n")
    srv = LmqttServer(str(tmp_path / "d"), ("--workers", "2", "--acl-file", str(acl), "--metrics-port", "0"),
                      str(tmp_path / "serve.log"))
    srv.start(timeout=60)
    try:
        sup = srv.proc.pid

        def kids():
            out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(sup)], capture_output=True, text=True).stdout
            return {int(p): _comm(int(p)) for p in out.split()}
        wait_for(lambda: sorted(kids().values()) == ["lmqtt-store", "lmqtt-w0", "lmqtt-w1"], lambda: str(kids()))
        assert _comm(sup) == "lmqtt"
        found = _pidof("lmqtt")
        assert sup in found and not (set(kids()) & found), (found, kids())   # pidof -s lmqtt: the supervisor
        wait_for(lambda: srv.log_tail(100000).count("event=broker_started") >= 2, lambda: srv.log_tail())
        os.kill(sup, signal.SIGHUP)
        wait_for(lambda: srv.log_tail(100000).count("event=reloaded what=acl") >= 2, lambda: srv.log_tail())
    finally:
        assert srv.stop() == 0, srv.log_tail()


def test_store_ignores_sighup(tmp_path):
    """SIGHUP is the gateways' reload signal; sent to the store (by a `kill -HUP` meant for a
    gateway) it ended the store, Python's default."""
    from lmqtt.store.client import connect
    store = LmqttStore(str(tmp_path / "s"), log_path=str(tmp_path / "store.log")).start()
    try:
        os.kill(store.proc.pid, signal.SIGHUP)
        wait_for(lambda: "event=sighup_ignored" in store.log_tail() or store.proc.poll() is not None,
                 lambda: store.log_tail())
        assert store.proc.poll() is None, f"SIGHUP ended the store: {store.log_tail()}"
        with connect(store.address) as c:
            assert c.producer().send("hup/a", b"x").queue_offset == 0
        assert _comm(store.proc.pid) == "lmqtt-store"      # not `lmqtt`: pidof lmqtt does not pick it
    finally:
        assert store.stop() == 0, store.log_tail()
