"""The console's own styles hold under its Content-Security-Policy (`style-src 'self'`, no inline
styles): a session's lag bar is as wide as its lag says, the largest the whole bar, and the
retained-messages heading keeps its spacing. Real `lmqtt serve`, real Chromium (the fixtures of
tests/console/test_console.py), paho clients; every wait bounded."""
from __future__ import annotations

from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.console.test_console import WAIT, browser, console_url, open_page, server, wait_text  # noqa: F401
from tests.support import Paho

assert browser and server          # module-scoped fixtures, used by name below


def _bar_width(browser, client: str) -> float:
    row = f'tr[data-client="{client}"]'
    return browser.execute_script(
        "const r = document.querySelector(arguments[0]); if (!r) return -1;"
        "const b = r.querySelector('.bar'), f = b && b.firstElementChild;"
        "return f ? f.getBoundingClientRect().width / b.getBoundingClientRect().width : -1;", row)


def test_lag_bars_are_as_wide_as_the_lag_under_the_pages_own_policy(server, browser):
    for cid in ("style-a", "style-b"):
        dev = Paho(server, client_id=cid, version=4, clean=False)
        dev.subscribe(f"style/{cid}", 1)
        dev.disconnect()
    pub = Paho(server, client_id="style-pub")
    try:
        for i in range(8):
            pub.publish("style/style-a", f"a{i}", qos=1)
        for i in range(2):
            pub.publish("style/style-b", f"b{i}", qos=1)
    finally:
        pub.disconnect()
    open_page(browser, console_url(server), "sessions")
    wait_text(browser, 'tr[data-client="style-a"] .lag', "8")
    wait_text(browser, 'tr[data-client="style-b"] .lag', "2")
    WebDriverWait(browser, WAIT).until(lambda d: _bar_width(d, "style-b") > 0)
    a, b = _bar_width(browser, "style-a"), _bar_width(browser, "style-b")
    lags = [int(e.text.replace(",", "")) for e in browser.find_elements(By.CSS_SELECTOR, "#se-table .lag") if e.text]
    # the widest bar belongs to the largest lag; the others in proportion (at least 2 %)
    assert abs(a - min(1.0, 8 / max(lags))) < 0.02 and abs(b - max(0.02, 2 / max(lags))) < 0.02, (a, b, lags)


def test_the_retained_heading_keeps_its_style(server, browser):
    open_page(browser, console_url(server), "topics")
    h = browser.execute_script("const h = document.getElementById('rt-count').parentElement;"
                               "return getComputedStyle(h).marginTop;")
    assert h == "22px", h


def test_a_fleet_gateways_footer_names_its_store_and_the_stores_disk(browser, tmp_path):
    """A fleet gateway has no data dir: its overview names the store it uses, and the data and
    disk card shows the store's CommitLog size and free disk (it showed a data dir of the
    gateway's working directory, and '-')."""
    from tests.console.test_console import _wait_ready
    from tests.support import LmqttGateway, LmqttStore
    store = LmqttStore(str(tmp_path / "store"), log_path=str(tmp_path / "store.log")).start()
    gw = None
    try:
        gw = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
        url = f"http://127.0.0.1:{gw.metrics_port}"
        _wait_ready(url, "gateway", gw.log_tail)
        open_page(browser, url + "/console/", "overview")
        WebDriverWait(browser, WAIT).until(lambda d: "store" in d.find_element(By.ID, "ov-gateway").text)
        footer = browser.find_element(By.ID, "ov-gateway").text
        assert footer.endswith(f"store {store.address}") and "lmqtt-data" not in footer, footer
        WebDriverWait(browser, WAIT).until(lambda d: not d.find_element(By.ID, "ov-disk").text.startswith("-"))
        disk = browser.find_element(By.ID, "ov-disk").text
        assert disk.endswith(" MB") and "-" not in disk, disk
    finally:
        if gw is not None:
            gw.stop()
        assert store.stop() == 0, store.log_tail()
