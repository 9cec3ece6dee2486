"""Delayed messages after a recovery that cut the CommitLog, end to end: three `$delayed/8/dl/...` publishes were acknowledged,
the server stopped, the newest CommitLog segment was cut inside the first one's parked record, the
server restarted. New messages then took the CommitLog offsets of the lost parked records: a new
delayed message due in 60 s (its parked record the same size as the first lost one, at its very
offset) and ordinary messages. When the lost timers come due, nothing may be released in their
place. Before the fix the first lost timer released the new delayed message 50 s early, and the
next ones met an ordinary record, failed, and stuck the wheel retrying (silently): a delayed
message due after them never arrived. Now the loss is named in a WARNING at start, the ordinary
messages arrive once each, the later delayed message arrives, the 60 s one does not.

Real parts: `lmqtt serve` subprocesses on one data dir, paho-mqtt, the segment file cut between
the two runs. Timing: the wait for the due time is generous (shared machine); nothing asserts a
tight bound."""
from __future__ import annotations

import glob
import os
import time

import pytest

from tests.support import LmqttServer, Paho, record_position

pytestmark = pytest.mark.timeout(120)

DELAY_S = 8              # long enough for the stop, the cut, the restart and the new publishes
MARGIN_S = 4.0           # precision (1 s) + scheduling on a shared machine


def _collect(sub: Paho, until: float) -> list:
    out = []
    while time.monotonic() < until:
        try:
            out.append(sub.msgs.get(timeout=0.05))
        except Exception:  # noqa: BLE001 - queue.Empty
            pass
    return out


def test_delayed_messages_lost_in_a_cut_release_nothing_in_their_place(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    srv = LmqttServer(str(data)).start()
    try:
        pub = Paho(srv, "pub")
        for i in range(1, 6):
            pub.publish("t/a", f"m-{i}".encode(), qos=1)
        t_pub = time.monotonic()
        for i in range(1, 4):
            pub.publish(f"$delayed/{DELAY_S}/dl/lost-{i}", f"lost-{i}".encode(), qos=1)    # acknowledged
        pub.disconnect()
        assert srv.stop() == 0

        segment = sorted(glob.glob(str(data / "store" / "commitlog" / "0*")))[-1]
        at = record_position(segment, "$timer", b"lost-1")
        os.truncate(segment, at + 9)

        srv.start()
        log = srv.log_tail(100_000)
        assert "store recovery: the checkpoints recorded" in log and "acknowledged are lost" in log, log
        assert "store recovery: 3 delayed messages lost in the cut, due at " in log, log
        assert "they will not be delivered" in log

        sub = Paho(srv, "sub")
        sub.subscribe("dl/#", qos=1)
        sub.subscribe("t/#", qos=1)
        pub = Paho(srv, "pub")
        pub.publish("$delayed/60/dl/newx-1", b"newx-1", qos=1)    # the size of lost-1's, at its offset
        new = [(f"new-{i}-".encode() + b"x" * 100) for i in range(1, 11)]     # over the other lost offsets
        for body in new:
            pub.publish("t/b", body, qos=1)
        # due after the lost timers (a whole number of seconds from now)
        after_s = int(t_pub + DELAY_S + 2 - time.monotonic()) + 1
        pub.publish(f"$delayed/{after_s}/dl/after", b"after", qos=1)
        assert time.monotonic() < t_pub + DELAY_S, "too slow to publish before the lost timers came due"
        assert record_position(segment, "$timer", b"newx-1") == at
        got = _collect(sub, time.monotonic() + after_s + MARGIN_S)
        assert sorted((m.topic, m.payload) for m in got) == sorted(
            [("t/b", b) for b in new] + [("dl/after", b"after")]), [(m.topic, m.payload[:20]) for m in got]
        log = srv.log_tail(100_000)
        assert "Traceback" not in log, log
        pub.disconnect()
        sub.disconnect()
    finally:
        srv.stop()
