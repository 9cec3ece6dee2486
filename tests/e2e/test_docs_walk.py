"""What a newcomer meets walking README.md and docs/spark.md: the example commands
`lmqtt simulate` and `lmqtt spark-iot`, run as real processes against a real `lmqtt serve`, end
with one line naming the cause (no broker, no store, broker lost) and stop cleanly on Ctrl-C,
never with a traceback."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import paho.mqtt.client as mqtt
import pytest

from tests.support import ROOT, free_port

LMQTT = [sys.executable, "-m", "lmqtt.gateway.cli"]
# Spark's driver and UI on loopback only
ENV = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYTHONUNBUFFERED="1")


@contextlib.contextmanager
def _sigint_at_default_in_children():
    """Processes started in it get SIGINT at its default, as a shell at a terminal starts a command.
    A shell without job control (a script, `bash .ci/run &`) starts a background command with SIGINT
    ignored (POSIX), every process under it inherits that, and a Python started with SIGINT ignored
    never raises KeyboardInterrupt: the Ctrl-C tests then failed for how pytest was started (an
    empty stderr, the command running on), not for what the command does. exec resets a handled
    signal to its default and keeps an ignored one ignored, so SIGINT is handled here meanwhile."""
    if (signal.getsignal(signal.SIGINT) != signal.SIG_IGN
            or threading.current_thread() is not threading.main_thread()):
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


class _Run:
    """An `lmqtt ...` process; its output goes to files (Spark writes more than a pipe holds)."""

    _n = 0

    def __init__(self, args, log_dir) -> None:
        _Run._n += 1
        self.out_path = os.path.join(str(log_dir), f"run{_Run._n}.out")
        self.err_path = os.path.join(str(log_dir), f"run{_Run._n}.err")
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err, _sigint_at_default_in_children():
            self.p = subprocess.Popen(LMQTT + list(args), stdout=out, stderr=err, cwd=ROOT, env=ENV)

    def err(self) -> str:
        with open(self.err_path, errors="replace") as f:
            return f.read()

    def finish(self, timeout: float) -> tuple[int, str]:
        try:
            self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            pytest.fail(f"{self.p.args} did not end within {timeout}s; stderr:\n{self.err()[-3000:]}")
        return self.p.returncode, self.err()


def _no_traceback(err: str) -> None:
    assert "Traceback" not in err, err[-4000:]


def test_simulate_without_a_broker_says_so_in_one_line(tmp_path):
    port = free_port()                                   # nothing listens there
    rc, err = _Run(["simulate", "--port", str(port), "--seconds", "2"], tmp_path).finish(30)
    _no_traceback(err)
    assert rc == 3
    assert err.strip() == (f"lmqtt simulate: cannot reach the MQTT broker at 127.0.0.1:{port}: "
                           "Connection refused (is `lmqtt serve` running?)")


def _watch_readings(port: int):
    """A subscriber to the simulator's topics: its event is set at the first reading."""
    got = threading.Event()
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="walk-watcher")
    c.on_message = lambda *_: got.set()
    c.connect("127.0.0.1", port)
    c.subscribe("telemetry/#", qos=0)
    c.loop_start()
    return c, got


@pytest.fixture(params=["pytest-at-a-terminal", "pytest-in-the-background"])
def pytest_sigint(request):
    """The SIGINT disposition pytest was started with: handled (a terminal) or ignored (started
    with `&` by a shell without job control, as a CI script may be); the commands it starts are
    interrupted as from a terminal either way."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal dispositions are set from the main thread only")
    want = signal.SIG_IGN if request.param == "pytest-in-the-background" else signal.default_int_handler
    old = signal.signal(signal.SIGINT, want)
    yield request.param
    signal.signal(signal.SIGINT, old)


def test_simulate_stops_on_ctrl_c(lmqtt_server, tmp_path, pytest_sigint):
    watcher, publishing = _watch_readings(lmqtt_server.port)
    try:
        run = _Run(["simulate", "--port", str(lmqtt_server.port), "--devices", "3", "--seconds", "60"], tmp_path)
        # Ctrl-C while it publishes, as a user presses it (a fixed sleep could land in its start-up
        # on a loaded machine)
        assert publishing.wait(30), f"no reading within 30 s; stderr:\n{run.err()[-3000:]}"
    finally:
        watcher.loop_stop()
        watcher.disconnect()
    run.p.send_signal(signal.SIGINT)
    rc, err = run.finish(30)
    _no_traceback(err)
    assert rc == 0
    assert "lmqtt simulate: interrupted after" in err


def test_simulate_names_the_lost_broker(lmqtt_server, tmp_path):
    run = _Run(["simulate", "--port", str(lmqtt_server.port), "--devices", "3", "--seconds", "120",
                "--interval", "0.2"], tmp_path)
    time.sleep(2)
    lmqtt_server.kill9()
    rc, err = run.finish(60)
    _no_traceback(err)
    assert rc == 3
    assert f"lmqtt simulate: lost the MQTT broker at 127.0.0.1:{lmqtt_server.port} after" in err


def test_spark_iot_without_a_store_says_so_before_starting_spark(tmp_path):
    pytest.importorskip("pyspark")
    port = free_port()
    rc, err = _Run(["spark-iot", "--store", f"127.0.0.1:{port}", "--out", str(tmp_path / "iot")], tmp_path).finish(180)
    _no_traceback(err)
    assert rc == 3
    assert err.startswith(f"lmqtt spark-iot: cannot reach the store at 127.0.0.1:{port}"), err[-3000:]
    assert "is `lmqtt serve` or `lmqtt store` running?" in err
    assert not (tmp_path / "iot").exists()               # Spark never started


def test_spark_iot_runs_over_checkpoints_a_stop_left_before_their_first_batch(lmqtt_server, tmp_path):
    """A stop while a query writes its first batch's offsets leaves the offset log with the write's
    temporary files and no batch; Spark 4 refuses such a checkpoint (STATE_STORE_CHECKPOINT_
    LOCATION_NOT_EMPTY) and the job ended with that at every re-run. The job starts such a
    checkpoint anew, says so, and runs."""
    pytest.importorskip("pyspark")
    out_dir = tmp_path / "iot"
    for q in ("stats", "alerts"):
        chk = out_dir / "_checkpoints" / q
        (chk / "offsets").mkdir(parents=True)
        (chk / "offsets" / ".0.3f1c2a.tmp").write_text("v1\n")       # what the interrupted write left
        (chk / "offsets" / "..0.3f1c2a.tmp.crc").write_bytes(b"crc")
        (chk / "state" / "0" / "0").mkdir(parents=True)
        (chk / "metadata").write_text('{"id":"4c0d2b1e-0000-4000-8000-000000000000"}')
    args = ["spark-iot", "--store", lmqtt_server.store_address, "--out", str(out_dir), "--master", "local[1]",
            "--seconds", "3"]
    rc, err = _Run(args, tmp_path).finish(240)
    _no_traceback(err)
    assert rc == 0, err[-3000:]
    for q in ("stats", "alerts"):
        assert f"{out_dir / '_checkpoints' / q} recorded no batch (a stop came during its first): " \
               "starting it anew" in err, err[-3000:]
    assert "STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY" not in err
    assert err.rstrip().endswith("lmqtt spark-iot: stopped (run the same command again to continue from "
                                 "the checkpoints)"), err[-3000:]
    assert not (out_dir / "_checkpoints" / "stats" / "offsets" / ".0.3f1c2a.tmp").exists()


def test_spark_iot_stops_cleanly_on_ctrl_c_and_at_its_seconds_over_one_checkpoint(lmqtt_server, tmp_path):
    """docs/spark.md: the job runs until Ctrl-C, 'stop and re-run any time', or for `--seconds`.
    Ctrl-C used to print PySpark's reentrant py4j tracebacks (its SIGINT handler calls into the JVM
    while the main thread waits in awaitAnyTermination); a run with `--seconds` ended silently after
    Spark's warnings (the last line on the screen was `WARN DAGScheduler: Failed to cancel job
    group ...`). The second run continues from the first run's checkpoints, and stops at its
    seconds with the same closing line as the last thing it prints (one JVM per run: the two
    behaviours share them); so does a third stopped before its queries have started."""
    pytest.importorskip("pyspark")
    out_dir = tmp_path / "iot"
    args = ["spark-iot", "--store", lmqtt_server.store_address, "--out", str(out_dir), "--master", "local[1]"]
    started = out_dir / "_checkpoints" / "alerts" / "metadata"     # written when the 2nd query starts
    running = "lmqtt spark-iot: running over 'telemetry/+'"
    closing = "lmqtt spark-iot: stopped (run the same command again to continue from the checkpoints)"
    run = _Run(args, tmp_path)
    deadline = time.monotonic() + 180
    while not started.exists():
        if run.p.poll() is not None:
            pytest.fail(f"spark-iot exited with {run.p.returncode}: {run.err()[-3000:]}")
        if time.monotonic() > deadline:
            run.finish(0.1)
        time.sleep(0.2)
    time.sleep(2)                                        # the driver is waiting on its queries by now
    run.p.send_signal(signal.SIGINT)
    rc, err = run.finish(120)
    _no_traceback(err)
    assert rc == 0, err[-3000:]
    assert running in err and closing in err
    # over the checkpoints: for 3 s, then stopped while its queries still start (Spark printed the
    # tracebacks of the source's Python worker it cancelled as it connected back)
    for seconds in ("3", "0.1"):
        rc, err = _Run(args + ["--seconds", seconds], tmp_path).finish(240)
        _no_traceback(err)
        assert rc == 0, err[-3000:]
        assert running in err, err[-3000:]
        assert err.rstrip().endswith(closing), err[-3000:]
