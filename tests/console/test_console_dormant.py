"""After a restart the persistent sessions wait dormant (docs/fleet.md
"dormant") until their clients come back; the console's overview and sessions page and the `$SYS`
counts show them (before: the Sessions card said 0 and the subscriptions went uncounted while the
sessions existed). A real `lmqtt serve` killed with kill -9 and started again, real Chromium
(tests/console/test_console.py's fixtures), a paho client reading `$SYS`; every wait bounded."""
from __future__ import annotations

import time

from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.console.test_console import WAIT, _wait_port, browser, console_url, open_page, shot, wait_text  # noqa: F401
from tests.support import LmqttServer, Paho, wait_metric

assert browser          # the module-scoped Chromium fixture, used by name below


def _sys_values(srv, want: dict[str, str], timeout: float = 20.0) -> dict[str, str]:
    """The latest `$SYS` payloads of `want`'s topics, once they equal `want` (or at the timeout)."""
    sub = Paho(srv, "dormant-sys")
    seen: dict[str, str] = {}
    try:
        for t in want:
            sub.subscribe(t, 0)
        deadline = time.monotonic() + timeout
        while seen != want and time.monotonic() < deadline:
            for m in sub.get_n(1, timeout=max(0.1, deadline - time.monotonic())):
                seen[m.topic] = m.payload.decode()
    finally:
        sub.disconnect()
    return seen


def test_restarted_serve_counts_and_lists_its_dormant_sessions(browser, tmp_path):  # noqa: F811
    """Three persistent sessions with four subscriptions, one of them still connected at a kill -9;
    after the restart all three are dormant: the overview's Sessions card says 3 (3 dormant), the
    Subscriptions card 4, the sessions page marks each "dormant, offline" with its lag, and `$SYS`
    counts them (clients/total 3 + the reader, subscriptions/count 4 + the reader's 2)."""
    srv = LmqttServer(str(tmp_path / "data"), extra_args=("--sys-interval", "1"),
                      log_path=str(tmp_path / "serve.log")).start()
    try:
        a = Paho(srv, "dd-a", version=4, clean=False)
        a.subscribe("dd/a/+", 1)
        a.subscribe("dd/a2", 1)
        a.disconnect()
        b = Paho(srv, "dd-b", version=5, clean=False, expiry=3600)
        b.subscribe("dd/b", 1)
        b.disconnect()
        on = Paho(srv, "dd-on", version=5, clean=False, expiry=3600)
        on.subscribe("dd/on/#", 1)
        on.c.loop_stop()            # still connected at the kill, no reconnect after it
        srv.restart(kill=True)
        _wait_port(srv.host, srv.metrics_port)
        assert wait_metric(srv.metrics_url, "lmqtt_sessions_dormant", 3, WAIT) == 3, srv.log_tail()
        pub = Paho(srv, "dd-pub")
        for i in range(5):
            pub.publish("dd/b", f"m{i}".encode(), qos=1)
        pub.disconnect()

        url = console_url(srv)
        open_page(browser, url, "overview")
        wait_text(browser, "#ov-sessions", "3")
        wait_text(browser, "#ov-sessions-dormant", "3 dormant")
        wait_text(browser, "#ov-subscriptions", "4")
        shot(browser, tmp_path, "overview-dormant")

        open_page(browser, url, "sessions")
        wait_text(browser, "#se-count", "3")
        wait_text(browser, 'tr[data-client="dd-b"][data-filter="dd/b"] .lag', "5")
        for cid, flt in (("dd-a", "dd/a/+"), ("dd-b", "dd/b"), ("dd-on", "dd/on/#")):
            cell = f'tr[data-client="{cid}"][data-filter="{flt}"] td:nth-child(2)'
            try:
                WebDriverWait(browser, WAIT).until(
                    lambda d: d.find_element(By.CSS_SELECTOR, cell).text.startswith("dormant, offline"))
            except Exception:
                raise AssertionError(f"{cid}: {[e.text for e in browser.find_elements(By.CSS_SELECTOR, cell)]}") \
                    from None
        shot(browser, tmp_path, "sessions-dormant")

        want = {"$SYS/broker/clients/total": "4", "$SYS/broker/subscriptions/count": "6"}
        assert _sys_values(srv, want) == want, srv.log_tail()

        a = Paho(srv, "dd-a", version=4, clean=False)      # back: no longer dormant, still counted
        assert a.session_present
        try:
            wait_text(browser, 'tr[data-client="dd-a"][data-filter="dd/a/+"] td:nth-child(2)', "connected")
            open_page(browser, url, "overview")
            wait_text(browser, "#ov-sessions", "3")
            wait_text(browser, "#ov-sessions-dormant", "2 dormant")
        finally:
            a.disconnect()
    finally:
        assert srv.stop() == 0, srv.log_tail()
