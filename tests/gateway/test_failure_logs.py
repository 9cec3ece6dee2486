"""The ERROR lines of writes nobody waits for (gateway/storage/facades.py `log_failure`): a full
disk fails the session writes of every client at once, and the log must still say what happened,
once, with how many more - not thousands of lines a second."""
from __future__ import annotations

import logging

from lmqtt.gateway.storage import facades
from lmqtt.gateway.storage.facades import Answer, Repeats, WrittenAgain, log_failure
from lmqtt.store import protocol as W
from lmqtt.store.client.errors import ConnectionLost, DiskFull

log = logging.getLogger("lmqtt.test.failure_logs")


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == log.name]


def test_repeated_failures_of_one_kind_are_logged_once_a_period_with_their_count(caplog, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(facades, "REPEATS", Repeats(every_s=10.0, clock=lambda: now[0]))
    caplog.set_level(logging.INFO, logger=log.name)
    full = DiskFull(W.E_DISK_FULL, "disk full: cannot write the SDK metadata")
    for i in range(1000):
        log_failure(Answer.failed(full), log, "save_session_failed", client_id=f"c{i}")
    log_failure(Answer.failed(ConnectionLost("store away")), log, "save_session_failed", client_id="x")
    log_failure(Answer.failed(full), log, "save_offsets_failed", client_id="y")
    log_failure(Answer.failed(WrittenAgain("failover")), log, "save_session_failed", client_id="z")
    log_failure(Answer.of(None), log, "save_session_failed", client_id="ok")
    assert _lines(caplog) == [
        f"event=save_session_failed client_id=c0 error={full!r}",
        "event=save_session_failed client_id=x error=ConnectionLost('store away')",   # another kind
        f"event=save_offsets_failed client_id=y error={full!r}",                       # another event
        "event=save_session_deferred client_id=z reason='failover'",                   # not an error
    ]
    caplog.clear()
    now[0] += 10.0
    log_failure(Answer.failed(full), log, "save_session_failed", client_id="c1000")
    log_failure(Answer.failed(full), log, "save_session_failed", client_id="c1001")
    assert _lines(caplog) == [f"event=save_session_failed client_id=c1000 error={full!r} "
                              "(999 more like it since the last such line, not logged)"]
    caplog.clear()
    now[0] += 60.0                        # quiet since: the next one is logged, with the one left out
    log_failure(Answer.failed(full), log, "save_session_failed", client_id="later")
    assert _lines(caplog) == [f"event=save_session_failed client_id=later error={full!r} "
                              "(1 more like it since the last such line, not logged)"]
