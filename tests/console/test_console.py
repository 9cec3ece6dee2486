"""The web console (docs/console.md) in a real browser: headless Chromium from Debian's packages
driven by Selenium, against real `lmqtt serve` subprocesses with paho clients. The numbers on the
pages are checked against what the clients did (connections, a client's subscriptions, a
session's lag as `lmqtt admin --session` computes it); a client is disconnected from the page and
the paho client sees it; off loopback the console asks for a login (the MQTT password file) and
refuses an action to the read-only role. Every page is saved as a screenshot in the test's
tmp_path (the overview also as docs/console.png, the README's picture, with
LMQTT_CONSOLE_SCREENSHOT=1 or when it is missing).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.support import ROOT, LmqttServer, Paho, listening

selenium = pytest.importorskip("selenium")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
    pytest.skip("needs Debian's chromium and chromium-driver (.ci/run installs them)", allow_module_level=True)

WAIT = 20


@pytest.fixture(scope="module")
def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1400,900", "--disable-extensions", "--no-first-run",
              "--ignore-certificate-errors"):          # the TLS test's certificate is made by trustme
        opts.add_argument(a)
    d = webdriver.Chrome(service=Service(DRIVER), options=opts)
    try:
        yield d
    finally:
        d.quit()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("console")
    srv = LmqttServer(str(d / "data"), extra_args=("--sys-interval", "0"), log_path=str(d / "serve.log")).start()
    _wait_port(srv.host, srv.metrics_port)
    try:
        yield srv
    finally:
        assert srv.stop() == 0, srv.log_tail()


def console_url(srv, host: str | None = None) -> str:
    return f"http://{host or srv.host}:{srv.metrics_port}/console/"


def wait_text(browser, css: str, want: str, timeout: float = WAIT) -> None:
    """Until the element's text is `want` (the page updates itself: no reload)."""
    def ok(d):
        try:
            return d.find_element(By.CSS_SELECTOR, css).text == want
        except Exception:  # noqa: BLE001 - not rendered yet
            return False
    try:
        WebDriverWait(browser, timeout).until(ok)
    except Exception:
        els = browser.find_elements(By.CSS_SELECTOR, css)
        raise AssertionError(f"{css}: want {want!r}, page shows {[e.text for e in els]!r}") from None


def fresh(fn, tries: int = 10):
    """`fn()` again while the page re-renders under it: the clients table is rebuilt at every
    refresh, and an element found just before is then stale (StaleElementReferenceException)."""
    from selenium.common.exceptions import StaleElementReferenceException
    for i in range(tries):
        try:
            return fn()
        except StaleElementReferenceException:
            if i == tries - 1:
                raise
            time.sleep(0.05)


def open_page(browser, url: str, page: str) -> None:
    browser.get("about:blank")        # a fresh load (the same URL with another #page would not reload)
    browser.get(url + "#" + page)
    WebDriverWait(browser, WAIT).until(lambda d: d.execute_script("return document.body.dataset.ready") == page)


def shot(browser, tmp_path, name: str) -> str:
    path = str(tmp_path / f"console-{name}.png")
    browser.save_screenshot(path)
    assert os.path.getsize(path) > 1000
    return path


def test_overview_shows_the_connections_and_traffic(server, browser, tmp_path):
    clients = [Paho(server, client_id=f"ov-{i}") for i in range(3)]
    try:
        sub = clients[0]
        sub.subscribe("ov/t", 1)
        for i in range(20):
            clients[1].publish("ov/t", f"m{i}", qos=1)
        assert len(sub.get_n(20)) == 20
        open_page(browser, console_url(server), "overview")
        wait_text(browser, "#ov-connections", "3")
        wait_text(browser, "#ov-subscriptions", "1")
        # the chart drew the ring's samples (inline SVG polylines)
        WebDriverWait(browser, WAIT).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, "#chart-connections polyline"))
        p = shot(browser, tmp_path, "overview")
        readme_png = os.path.join(ROOT, "docs", "console.png")
        # the README's picture: refreshed on request only, so a test run leaves the tree clean
        if os.environ.get("LMQTT_CONSOLE_SCREENSHOT") == "1" or not os.path.exists(readme_png):
            shutil.copy(p, readme_png)
        clients.pop().disconnect()
        wait_text(browser, "#ov-connections", "2")      # live: the same page, no reload
    finally:
        for c in clients:
            c.disconnect()
    wait_text(browser, "#ov-connections", "0")


def test_clients_page_shows_a_client_and_disconnects_it(server, browser, tmp_path):
    a = Paho(server, client_id="dev-alpha", version=5, keepalive=45)
    b = Paho(server, client_id="dev-beta", version=4)
    try:
        a.subscribe("plant/+/temp", 1)
        a.subscribe("alerts/#", 0)
        b.subscribe("other", 0)
        open_page(browser, console_url(server), "clients")
        wait_text(browser, "#cl-count", "2 shown of 2 connected")
        search = browser.find_element(By.ID, "cl-search")
        search.send_keys("alpha")
        wait_text(browser, "#cl-count", "1 shown of 2 connected")
        alpha = 'tr[data-client="dev-alpha"]'

        def read_row():
            row = browser.find_element(By.CSS_SELECTOR, alpha)
            return ([td.text for td in row.find_elements(By.TAG_NAME, "td")],
                    sorted(t.text for t in row.find_elements(By.CSS_SELECTOR, ".subs .tag")))
        cells, tags = fresh(read_row)
        assert cells[0] == "dev-alpha" and cells[3] == "5.0" and cells[4] == "45s", cells
        assert tags == ["alerts/# q0", "plant/+/temp q1"]
        shot(browser, tmp_path, "clients")
        fresh(lambda: browser.find_element(By.CSS_SELECTOR, alpha + " button.disconnect").click())
        rc = a.disconnects.get(timeout=WAIT)          # the paho client sees the server close it
        assert getattr(rc, "value", rc) == 0x98, rc   # MQTT 5: Administrative action
        wait_text(browser, "#cl-count", "0 shown of 1 connected")
        assert b.c.is_connected()
        log = open(server.log_path, encoding="utf-8", errors="replace").read()
        assert "event=console_action action=disconnect user=local client_id=dev-alpha" in log
    finally:
        a.c.loop_stop()
        b.disconnect()


def test_clients_page_shows_in_flight_and_queued_of_a_client_that_does_not_ack(server, browser):
    """A raw MQTT 5 client with Receive Maximum 2 that never acknowledges: 2 in flight, the rest
    of what was published queued in its queue."""
    from lmqtt.gateway.mqtt import packets as P
    from tests.support import RawMQTT
    raw = RawMQTT(server, version=5)
    pub = Paho(server, client_id="slow-pub")
    try:
        props = P.Properties()
        props.receive_maximum = 2
        assert raw.connect("slow-dev", props=props) is not None
        raw.send(P.Subscribe(1, [P.SubscriptionRequest("slow/t", 1)]))
        assert isinstance(raw.recv(), P.SubAck)
        for i in range(5):
            pub.publish("slow/t", f"m{i}", qos=1)
        open_page(browser, console_url(server), "clients")
        row = 'tr[data-client="slow-dev"]'
        wait_text(browser, row + " .inflight", "2")
        wait_text(browser, row + " .queued", "3")
    finally:
        pub.disconnect()
        raw.close()


def test_sessions_page_shows_the_lag_of_an_offline_session(server, browser, tmp_path):
    dev = Paho(server, client_id="sess-dev", version=4, clean=False)
    dev.subscribe("fleet/lag", 1)
    dev.disconnect()
    pub = Paho(server, client_id="sess-pub")
    try:
        for i in range(7):
            pub.publish("fleet/lag", f"m{i}", qos=1)
    finally:
        pub.disconnect()
    admin = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "admin", "--store", server.store_address,
                            "--session", "sess-dev", "--format", "json"], capture_output=True, text=True, timeout=30,
                           cwd=ROOT)
    assert admin.returncode == 0, admin.stderr
    sub = json.loads(admin.stdout)["session"]["subscriptions"][0]
    assert sub["lag"] == 7, sub
    open_page(browser, console_url(server), "sessions")
    row = 'tr[data-client="sess-dev"][data-filter="fleet/lag"]'
    wait_text(browser, row + " .lag", "7")
    wait_text(browser, row + " .committed", f"{sub['committed_offset']:,}")
    wait_text(browser, row + " .end", f"{sub['max_offset']:,}")
    shot(browser, tmp_path, "sessions")
    dev.connect()                      # back online: it gets the 7 and the lag goes to 0 on the page
    try:
        assert len(dev.get_n(7)) == 7
        wait_text(browser, row + " .lag", "0")
    finally:
        dev.disconnect()


def _trace(browser, flt: str, since: str) -> None:
    browser.find_element(By.ID, "tr-filter").clear()
    browser.find_element(By.ID, "tr-filter").send_keys(flt)
    browser.find_element(By.CSS_SELECTOR, f'#tr-since option[value="{since}"]').click()
    browser.find_element(By.ID, "tr-start").click()


def _traced(browser) -> list[tuple[str, str, str]]:
    return [(r.find_element(By.CSS_SELECTOR, ".topic").text, r.find_element(By.CSS_SELECTOR, ".payload").text,
             r.find_element(By.CSS_SELECTOR, ".props").text)
            for r in browser.find_elements(By.CSS_SELECTOR, "#tr-table tbody tr")]


def test_tracer_shows_history_since_then_live_messages(server, browser, tmp_path):
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
    pub = Paho(server, client_id="tracer-pub", version=5)
    try:
        props = Properties(PacketTypes.PUBLISH)
        props.UserProperty = ("line", "3")
        props.ContentType = "text/plain"
        pub.publish("trace/room1/temp", "21.5", qos=1, properties=props)
        pub.publish("trace/room2/temp", "19.0", qos=1)
        pub.publish("other/x", "not traced", qos=1)
        open_page(browser, console_url(server), "tracer")
        _trace(browser, "trace/+/temp", "3600000")               # since an hour ago: the history
        wait_text(browser, "#tr-count", "2 messages")
        got = sorted(_traced(browser))
        assert got == [("trace/room1/temp", "21.5", "content-type=text/plain line=3"),
                       ("trace/room2/temp", "19.0", "")], got
        pub.publish("trace/room3/temp", "18.25", qos=1)         # live, on the same page
        wait_text(browser, "#tr-count", "3 messages")
        assert _traced(browser)[0][:2] == ("trace/room3/temp", "18.25")
        shot(browser, tmp_path, "tracer")
        browser.find_element(By.ID, "tr-stop").click()
    finally:
        pub.disconnect()


def test_topics_page_counts_stored_messages_and_browses_retained(server, browser, tmp_path):
    pub = Paho(server, client_id="topics-pub")
    try:
        for i in range(5):
            pub.publish(f"tp/dev{i}/temp", f"{20 + i}", qos=1)
        pub.publish("tp/status", "online", qos=1, retain=True)
        pub.publish("tpx/state", bytes([0, 1, 2, 255]), qos=0, retain=True)
        open_page(browser, console_url(server), "topics")
        wait_text(browser, 'tr[data-topic="tp"] .stored', "6")           # 5 + the retained publish
        rows = browser.find_elements(By.CSS_SELECTOR, "#rt-table tbody tr")
        got = {r.get_attribute("data-topic"): r.find_element(By.CSS_SELECTOR, ".payload").text for r in rows}
        assert got.get("tp/status") == "online" and got.get("tpx/state") == "[hex] 00 01 02 ff", got
        f = browser.find_element(By.ID, "rt-filter")
        f.clear()
        f.send_keys("tp/#")
        browser.find_element(By.ID, "rt-show").click()
        wait_text(browser, "#rt-count", "1")
        f.clear()
        f.send_keys("tp/#/x")                                              # an invalid filter: its reason
        browser.find_element(By.ID, "rt-show").click()
        WebDriverWait(browser, WAIT).until(lambda d: "invalid filter 'tp/#/x'" in d.find_element(By.ID, "rt-error").text)
        shot(browser, tmp_path, "topics")
    finally:
        pub.disconnect()


def test_groups_page_shows_a_groups_committed_offset_lag_and_pop_state(server, browser, tmp_path):
    from lmqtt.store.client import connect
    pub = Paho(server, client_id="groups-pub")
    try:
        for i in range(9):
            pub.publish(f"grp/dev{i}", f"{i}", qos=1)
    finally:
        pub.disconnect()
    conn = connect(server.store_address)
    try:
        conn.cmd("commit", group="billing", topic="grp", queue_id=0, offset=4)
        lag = conn.admin().lag("billing")
        pop = conn.admin().pop_info("billing", "grp", 0)
        popped = conn.cmd("pop", group="grp-popper", topic="grp", queue_id=0, max_count=2, invisible_ms=60000)
        only = conn.admin().pop_info("grp-popper", "grp", 0)      # a group that only POPs
    finally:
        conn.close()
    assert (only["next"], only["inflight"], only["backlog"]) == (2, 2, 7), (only, popped)
    assert [(q["committed"], q["max_offset"], q["lag"]) for q in lag] == [(4, 9, 5)], lag
    open_page(browser, console_url(server), "groups")
    row = 'tr[data-group="billing"][data-queue="grp:0"]'
    wait_text(browser, row + " .committed", "4")
    wait_text(browser, row + " .end", "9")
    wait_text(browser, row + " .lag", "5")
    wait_text(browser, row + " .pop", f"{pop['next']:,} / {pop['inflight']:,} / {pop['backlog']:,}")
    wait_text(browser, row + " .dead", "0")
    row = 'tr[data-group="grp-popper"][data-queue="grp:0"]'
    wait_text(browser, row + " .pop", "2 / 2 / 7")
    wait_text(browser, row + " .committed", "-")
    wait_text(browser, row + " .lag", "7")
    shot(browser, tmp_path, "groups")


def test_without_a_login_the_console_answers_only_to_a_loopback_host(server):
    """DNS rebinding: a page of evil.example resolved to 127.0.0.1 must not read or act."""
    base = f"http://{server.host}:{server.metrics_port}"
    for path in ("/console/", "/console/api/me", "/console/api/clients"):
        req = urllib.request.Request(base + path, headers={"Host": f"evil.example:{server.metrics_port}"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 403 and b"DNS rebinding" in e.value.read()
    for host in (f"127.0.0.1:{server.metrics_port}", f"localhost:{server.metrics_port}"):
        req = urllib.request.Request(base + "/console/api/me", headers={"Host": host})
        assert json.loads(urllib.request.urlopen(req, timeout=10).read())["role"] == "admin"
    # Prometheus scrapes by any name
    req = urllib.request.Request(base + "/metrics", headers={"Host": "prometheus-target.internal"})
    assert b"lmqtt_connections" in urllib.request.urlopen(req, timeout=10).read()


# ---- off loopback: a login -------------------------------------------------------------------

def _local_address() -> str | None:
    """A non-loopback address of this machine the browser can reach (192.0.2.2 here), or None."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout.split()
    except OSError:
        return None
    for a in out:
        if ":" in a or a.startswith("127."):
            continue
        try:
            with socket.socket() as s:
                s.bind((a, 0))
            return a
        except OSError:
            continue
    return None


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """`lmqtt serve` whose console listens on a non-loopback address (login required) or, when the
    machine has none, on loopback with console_login = true."""
    from lmqtt.gateway.security.auth import hash_password, write_password_file
    d = tmp_path_factory.mktemp("console-login")
    pw = d / "passwd"
    write_password_file(str(pw), {"ops": hash_password("ops-secret"), "watcher": hash_password("watch-secret"),
                                  "device": hash_password("dev-secret")})
    addr = _local_address()
    cfg = d / "lmqtt.toml"
    acl = d / "acl"
    acl.write_text("user ops\ntopic readwrite #\nuser device\ntopic readwrite #\n"
                   "user watcher\ntopic read #\ntopic deny secret/#\n")
    lines = [f'password_file = "{pw}"', f'acl_file = "{acl}"', 'console_admins = "ops"',
             'console_viewers = "watcher"']
    lines.append(f'metrics_host = "{addr}"' if addr else "console_login = true")
    cfg.write_text("\n".join(lines) + "\n")
    srv = LmqttServer(str(d / "data"), extra_args=("--config", str(cfg), "--sys-interval", "0"),
                      log_path=str(d / "serve.log")).start()
    srv.console_host = addr or srv.host
    _wait_port(srv.console_host, srv.metrics_port)
    try:
        yield srv
    finally:
        assert srv.stop() == 0, srv.log_tail()


def _wait_port(host: str, port: int, timeout: float = 20.0) -> None:
    """The console's port opens a moment after the MQTT port (LmqttServer.start waits for that)."""
    assert listening(host, port, timeout), f"nothing listens on {host}:{port}"


def _mqtt(srv, client_id: str, user: str, password: str) -> Paho:
    p = Paho(srv, client_id=client_id, connect=False)
    p.c.username_pw_set(user, password)
    p.connect()
    return p


def _login(browser, url: str, user: str, password: str) -> None:
    browser.delete_all_cookies()
    browser.get(url)
    WebDriverWait(browser, WAIT).until(lambda d: d.find_element(By.ID, "login").is_displayed())
    browser.find_element(By.ID, "login-user").send_keys(user)
    browser.find_element(By.ID, "login-password").send_keys(password)
    browser.find_element(By.ID, "login-submit").click()


def test_off_loopback_the_console_needs_a_login(guarded, browser, tmp_path):
    url = console_url(guarded, guarded.console_host)
    # the API answers nothing without a login; /metrics and the probes stay open for Prometheus/k8s
    for path in ("api/clients", "api/sessions", "api/overview"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + path, timeout=10)
        assert e.value.code == 401
    base = url.rsplit("/console/", 1)[0]
    assert urllib.request.urlopen(base + "/metrics", timeout=10).status == 200
    assert urllib.request.urlopen(base + "/healthz", timeout=10).read() == b"ok\n"
    _login(browser, url, "ops", "wrong")
    wait_text(browser, "#login-error", "wrong user name or password")
    shot(browser, tmp_path, "login")
    _login(browser, url, "device", "dev-secret")           # in the password file, no console role
    wait_text(browser, "#login-error", "user 'device' has no console role (console_admins / console_viewers)")
    dev = _mqtt(guarded, "guarded-dev", "device", "dev-secret")
    try:
        _login(browser, url, "ops", "ops-secret")
        wait_text(browser, "#who-user", "ops (admin)")
        open_page(browser, url, "clients")
        wait_text(browser, 'tr[data-client="guarded-dev"] td:nth-child(2)', "device")
        shot(browser, tmp_path, "clients-logged-in")
        browser.find_element(By.CSS_SELECTOR, 'tr[data-client="guarded-dev"] button.disconnect').click()
        dev.disconnects.get(timeout=WAIT)
        wait_text(browser, "#cl-count", "0 shown of 0 connected")
    finally:
        dev.c.loop_stop()
    log = open(guarded.log_path, encoding="utf-8", errors="replace").read()
    assert "event=console_login user=ops role=admin" in log
    assert "event=console_login_refused user=ops" in log
    assert "event=console_action action=disconnect user=ops client_id=guarded-dev" in log


def test_the_read_only_role_cannot_disconnect(guarded, browser, tmp_path):
    url = console_url(guarded, guarded.console_host)
    dev = _mqtt(guarded, "guarded-dev2", "device", "dev-secret")
    try:
        _login(browser, url, "watcher", "watch-secret")
        wait_text(browser, "#who-user", "watcher (viewer)")
        open_page(browser, url, "clients")
        btn = 'tr[data-client="guarded-dev2"] button.disconnect'
        WebDriverWait(browser, WAIT).until(lambda d: d.find_elements(By.CSS_SELECTOR, btn))
        assert not browser.find_element(By.CSS_SELECTOR, btn).is_enabled()
        shot(browser, tmp_path, "clients-read-only")
        # the server refuses it too (not only the greyed button): the viewer's own session and CSRF token
        status, body = browser.execute_async_script("""
            const done = arguments[arguments.length - 1];
            const me = await (await fetch('/console/api/me')).json();
            const r = await fetch('/console/api/clients/disconnect', {method: 'POST',
                headers: {'Content-Type': 'application/json', 'X-CSRF-Token': me.csrf},
                body: JSON.stringify({client_id: 'guarded-dev2'})});
            done([r.status, await r.text()]);""")
        assert status == 403 and "read-only role" in body, (status, body)
        # an admin's action without the CSRF token is refused as well
        _login(browser, url, "ops", "ops-secret")
        wait_text(browser, "#who-user", "ops (admin)")
        status, body = browser.execute_async_script("""
            const done = arguments[arguments.length - 1];
            const r = await fetch('/console/api/clients/disconnect', {method: 'POST',
                headers: {'Content-Type': 'application/json'}, body: JSON.stringify({client_id: 'guarded-dev2'})});
            done([r.status, await r.text()]);""")
        assert status == 403 and "CSRF" in body, (status, body)
        assert dev.c.is_connected()
        assert dev.disconnects.empty()
    finally:
        dev.disconnect()
    log = open(guarded.log_path, encoding="utf-8", errors="replace").read()
    assert "event=console_action_refused action=disconnect user=watcher reason=role" in log


def test_the_tracer_shows_only_what_the_users_acl_lets_them_read(guarded, browser, tmp_path):
    url = console_url(guarded, guarded.console_host)
    dev = _mqtt(guarded, "guarded-pub", "device", "dev-secret")
    try:
        dev.publish("secret/vault", "the combination", qos=1)
        dev.publish("public/news", "hello", qos=1)
        _login(browser, url, "watcher", "watch-secret")
        wait_text(browser, "#who-user", "watcher (viewer)")
        open_page(browser, url, "tracer")
        _trace(browser, "secret/#", "3600000")
        wait_text(browser, "#tr-error", "the ACL does not let user 'watcher' subscribe to 'secret/#'")
        _trace(browser, "#", "3600000")                 # allowed, overlaps the denied secret/#
        wait_text(browser, "#tr-count", "1 message")
        dev.publish("secret/vault", "changed", qos=1)
        dev.publish("public/news", "more", qos=1)
        wait_text(browser, "#tr-count", "2 messages")
        got = _traced(browser)
        assert [t for t, _p, _x in got] == ["public/news", "public/news"], got
        assert "combination" not in browser.page_source and "changed" not in browser.page_source
        shot(browser, tmp_path, "tracer-acl")
        # the retained browser too: the denied subtree refused, its messages hidden from '#'
        dev.publish("secret/door", "code 1234", qos=1, retain=True)
        dev.publish("public/motd", "welcome", qos=1, retain=True)
        open_page(browser, url, "topics")
        wait_text(browser, "#rt-count", "1")
        assert [r.get_attribute("data-topic") for r in browser.find_elements(By.CSS_SELECTOR, "#rt-table tbody tr")] \
            == ["public/motd"]
        f = browser.find_element(By.ID, "rt-filter")
        f.clear()
        f.send_keys("secret/#")
        browser.find_element(By.ID, "rt-show").click()
        wait_text(browser, "#rt-error", "the ACL does not let user 'watcher' subscribe to 'secret/#'")
        assert "1234" not in browser.page_source
        # the admin's ACL (readwrite #) lets them see both
        _login(browser, url, "ops", "ops-secret")
        wait_text(browser, "#who-user", "ops (admin)")
        open_page(browser, url, "tracer")
        _trace(browser, "secret/#", "3600000")
        wait_text(browser, "#tr-count", "3 messages")       # secret/vault twice, secret/door
    finally:
        dev.disconnect()


def test_console_tls_serves_https_with_the_listeners_certificate_and_a_secure_cookie(browser, tmp_path):
    import ssl

    import trustme
    from lmqtt.gateway.security.auth import hash_password, write_password_file
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_pem, ca_pem = tmp_path / "server.pem", tmp_path / "ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(cert_pem))
    ca.cert_pem.write_to_path(str(ca_pem))
    pw = tmp_path / "passwd"
    write_password_file(str(pw), {"ops": hash_password("ops-secret")})
    srv = LmqttServer(str(tmp_path / "data"), log_path=str(tmp_path / "serve.log"), extra_args=(
        "--sys-interval", "0", "--cert", str(cert_pem), "--console-tls", "--console-login",
        "--password-file", str(pw), "--console-admins", "ops")).start()
    try:
        _wait_port(srv.host, srv.metrics_port)
        base = f"https://{srv.host}:{srv.metrics_port}"
        ctx = ssl.create_default_context(cafile=str(ca_pem))
        assert b"lmqtt_connections" in urllib.request.urlopen(base + "/metrics", context=ctx, timeout=10).read()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + "/console/api/me", context=ctx, timeout=10)
        assert e.value.code == 401
        req = urllib.request.Request(base + "/console/api/login", method="POST",
                                     data=json.dumps({"user": "ops", "password": "ops-secret"}).encode(),
                                     headers={"Content-Type": "application/json"})
        r = urllib.request.urlopen(req, context=ctx, timeout=10)
        cookie = r.headers["Set-Cookie"].lower()
        assert "secure" in cookie and "httponly" in cookie and "samesite=strict" in cookie, cookie
        with pytest.raises((urllib.error.URLError, ConnectionError)):   # no plain HTTP on that port any more
            urllib.request.urlopen(f"http://{srv.host}:{srv.metrics_port}/metrics", timeout=10).read()
        _login(browser, base + "/console/", "ops", "ops-secret")
        wait_text(browser, "#who-user", "ops (admin)")     # the Secure cookie comes back over HTTPS
        assert f"console:    https://{srv.host}:{srv.metrics_port}/console/" in srv.log_tail(20000)
        shot(browser, tmp_path, "tls")
    finally:
        assert srv.stop() == 0, srv.log_tail()


def _wait_ready(url: str, what: str, log_tail, timeout: float = 30) -> None:
    import time
    deadline = time.monotonic() + timeout
    while True:
        try:
            if urllib.request.urlopen(url + "/readyz", timeout=2).read() == b"ready\n":
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{what} not ready: {log_tail()}"
        time.sleep(0.1)


def _connections(metrics_url: str) -> int:
    """A gateway's own count of its MQTT connections (its /metrics gauge)."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return int(float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith("lmqtt_connections "))))


def test_serve_workers_console_shows_every_workers_clients_and_disconnects_on_the_right_one(browser, tmp_path):
    """`serve --workers 2`: each worker's console shows the clients of both (each row names the
    worker it is on, the counts equal each worker's own gauge); a Disconnect pressed on worker 0's
    page ends a client that is on worker 1 (paho sees 0x98); the overview lists both workers as
    ready with the fleet's total; sessions and POP groups are read from the store."""
    from lmqtt.loadtest.brokers import free_port_pair
    from lmqtt.store.client import connect
    srv = LmqttServer(str(tmp_path / "data"), extra_args=("--workers", "2"),
                      log_path=str(tmp_path / "serve.log"))
    srv.metrics_port = free_port_pair()
    srv.start()
    urls = [f"http://127.0.0.1:{srv.metrics_port + i}" for i in (0, 1)]
    clients = []
    try:
        for i, u in enumerate(urls):
            _wait_ready(u, f"worker {i}", srv.log_tail)
        # the kernel spreads connections over the workers (SO_REUSEPORT): connect until both have some
        while len(clients) < 24:
            clients.append(Paho(srv, client_id=f"w-{len(clients)}", version=5))
            if len(clients) >= 6 and all(_connections(u + "/metrics") for u in urls):
                break
        per = [_connections(u + "/metrics") for u in urls]
        assert all(per) and sum(per) == len(clients), per
        n = len(clients)
        open_page(browser, urls[0] + "/console/", "clients")
        wait_text(browser, "#cl-count", f"{n} shown of {n} connected on 2 gateways")
        rows = browser.find_elements(By.CSS_SELECTOR, "#cl-table tbody tr")
        on = {r.get_attribute("data-client"): r.get_attribute("data-gateway") for r in rows}
        assert set(on) == {f"w-{i}" for i in range(n)}, on
        gateways = sorted(set(on.values()))
        assert len(gateways) == 2 and all(g.endswith((":w0", ":w1")) for g in gateways), gateways
        for i, g in enumerate(sorted(gateways)):       # each worker's rows: as many as its own gauge says
            assert sum(1 for v in on.values() if v == g) == per[int(g[-1])], (on, per)
        shot(browser, tmp_path, "clients-workers")
        # disconnect, from worker 0's page, a client that is on worker 1
        victim = next(c for c in sorted(on) if on[c].endswith(":w1"))
        browser.find_element(By.CSS_SELECTOR, f'tr[data-client="{victim}"] button.disconnect').click()
        paho = clients[int(victim.split("-")[1])]
        rc = paho.disconnects.get(timeout=WAIT)
        paho.c.loop_stop()                                    # paho would reconnect a second later
        clients.remove(paho)
        assert getattr(rc, "value", rc) == 0x98, rc           # MQTT 5: Administrative action
        wait_text(browser, "#cl-count", f"{n - 1} shown of {n - 1} connected on 2 gateways")
        assert not browser.find_elements(By.CSS_SELECTOR, f'tr[data-client="{victim}"]')
        assert _connections(urls[1] + "/metrics") == per[1] - 1 and _connections(urls[0] + "/metrics") == per[0]
        log = open(srv.log_path, encoding="utf-8", errors="replace").read()
        assert f"client_id={victim} gateway={on[victim]} via={gateways[0]} " in log, log[-3000:]
        # the overview of worker 1: both workers, ready, and the fleet's total on the card
        open_page(browser, urls[1] + "/console/", "overview")
        wait_text(browser, "#ov-connections", str(n - 1))
        wait_text(browser, "#fl-count", "2 gateways · the cards above add them up; the charts are this gateway's")
        for g in gateways:
            wait_text(browser, f'tr[data-gateway="{g}"] .health', "ready")
        wait_text(browser, f'tr[data-gateway="{gateways[0]}"] .connections', str(per[0]))
        assert browser.find_element(By.ID, "st-where").text == f"lmqtt://{srv.store_address}"
        shot(browser, tmp_path, "overview-workers")
        # sessions and POP groups: the store's, read by the worker's console too
        keep = Paho(srv, client_id="w-keep", version=4, clean=False)
        keep.subscribe("wk/lag", 1)
        keep.disconnect()
        for i in range(4):
            clients[0].publish("wk/lag", f"m{i}", qos=1)
        conn = connect(srv.store_address)
        try:
            popped = conn.cmd("pop", group="w-popper", topic="wk", queue_id=0, max_count=3, invisible_ms=60000)
            pop = conn.admin().pop_info("w-popper", "wk", 0)
            sess = conn.cmd("session", client_id="w-keep")["session"]["subscriptions"][0]
        finally:
            conn.close()
        assert sess["lag"] == 4 and pop["inflight"] == 3, (sess, pop, popped)
        open_page(browser, urls[1] + "/console/", "sessions")
        row = 'tr[data-client="w-keep"][data-filter="wk/lag"]'
        wait_text(browser, row + " .lag", "4")
        wait_text(browser, row + " .committed", f"{sess['committed_offset']:,}")
        open_page(browser, urls[0] + "/console/", "groups")
        row = 'tr[data-group="w-popper"][data-queue="wk:0"]'
        wait_text(browser, row + " .pop", f"{pop['next']:,} / 3 / {pop['backlog']:,}")
        wait_text(browser, row + " .dead", "0")
        shot(browser, tmp_path, "groups-workers")
    finally:
        for c in clients:
            c.disconnect()
        assert srv.stop() == 0, srv.log_tail()


def test_fleet_console_shows_both_gateways_traces_the_store_and_finds_a_peer_again_after_a_store_restart(
        browser, tmp_path):
    """A fleet (`lmqtt store` + 2 `lmqtt gateway`): gateway A's page lists B's client with B's id;
    B's tracer shows what was published on A (history, then live) and B's topics and retained
    browser read the store; after the store is killed (-9) and restarted, each gateway announces
    its console again (the store keeps none across a restart) and A's overview lists B as ready."""
    from tests.support import LmqttGateway, LmqttStore
    store = LmqttStore(str(tmp_path / "store"), log_path=str(tmp_path / "store.log")).start()
    gws = []
    clients = []
    try:
        gws = [LmqttGateway(store.address, log_dir=str(tmp_path)).start() for _ in range(2)]
        urls = [f"http://127.0.0.1:{g.metrics_port}" for g in gws]
        ids = [f"test-{g.port}" for g in gws]
        for i, u in enumerate(urls):
            _wait_ready(u, f"gateway {i}", gws[i].log_tail)
        a, b = Paho(gws[0], client_id="on-a"), Paho(gws[1], client_id="on-b", version=5)
        clients = [a, b]
        b.subscribe("fl/cmd/#", 1)
        for i in range(3):
            a.publish(f"fl/hist/{i}", f"h{i}", qos=1)
        a.publish("fl/state", "up", qos=1, retain=True)
        open_page(browser, urls[0] + "/console/", "clients")
        wait_text(browser, "#cl-count", "2 shown of 2 connected on 2 gateways")
        assert browser.find_element(By.CSS_SELECTOR, 'tr[data-client="on-b"]').get_attribute("data-gateway") == ids[1]
        wait_text(browser, 'tr[data-client="on-b"] .subs .tag', "fl/cmd/# q1")
        # a client of B that never acknowledges (Receive Maximum 2): 2 in flight, 3 queued, on A's page
        from lmqtt.gateway.mqtt import packets as P
        from tests.support import RawMQTT
        slow = RawMQTT(gws[1], version=5)
        try:
            props = P.Properties()
            props.receive_maximum = 2
            assert slow.connect("slow-on-b", props=props) is not None
            slow.send(P.Subscribe(1, [P.SubscriptionRequest("slow/t", 1)]))
            assert isinstance(slow.recv(), P.SubAck)
            for i in range(5):
                a.publish("slow/t", f"m{i}", qos=1)
            wait_text(browser, 'tr[data-client="slow-on-b"] .inflight', "2")
            wait_text(browser, 'tr[data-client="slow-on-b"] .queued', "3")
            assert browser.find_element(By.CSS_SELECTOR, 'tr[data-client="slow-on-b"]').get_attribute(
                "data-gateway") == ids[1]
        finally:
            slow.close()
        open_page(browser, urls[1] + "/console/", "tracer")
        _trace(browser, "fl/#", "3600000")
        WebDriverWait(browser, WAIT).until(lambda d: len(_traced(d)) == 4)
        a.publish("fl/cmd/go", "live", qos=1)
        WebDriverWait(browser, WAIT).until(lambda d: len(_traced(d)) == 5)
        assert sorted(t[:2] for t in _traced(browser)) == sorted(
            [(f"fl/hist/{i}", f"h{i}") for i in range(3)] + [("fl/state", "up"), ("fl/cmd/go", "live")]), _traced(browser)
        froms = [r.find_elements(By.TAG_NAME, "td")[4].text for r in browser.find_elements(By.CSS_SELECTOR, "#tr-table tbody tr")]
        assert froms == ["on-a"] * 5, froms
        shot(browser, tmp_path, "tracer-fleet")
        open_page(browser, urls[1] + "/console/", "topics")
        wait_text(browser, 'tr[data-topic="fl"] .stored', "5")
        wait_text(browser, 'tr[data-topic="fl/state"] .payload', "up")
        # the store restarts: it forgets the consoles; the gateways reconnect and announce again
        store.restart(kill=True)
        for i, u in enumerate(urls):
            _wait_ready(u, f"gateway {i} after the store's restart", gws[i].log_tail, timeout=60)
        open_page(browser, urls[0] + "/console/", "overview")
        wait_text(browser, f'tr[data-gateway="{ids[1]}"] .health', "ready", timeout=40)
        wait_text(browser, f'tr[data-gateway="{ids[0]}"] .health', "ready")
        wait_text(browser, "#st-where", f"lmqtt://{store.address}")
        shot(browser, tmp_path, "overview-fleet")
    finally:
        for c in clients:
            c.disconnect()
        for g in gws:
            g.stop()
        assert store.stop() == 0, store.log_tail()


def test_a_peer_request_without_the_gateways_token_is_refused(server):
    """/console/peer/* (what a peer console asks) answers only with this gateway's token, on
    loopback without a login too."""
    base = f"http://{server.host}:{server.metrics_port}"
    for path, hdr in (("/console/peer/clients", {}), ("/console/peer/overview", {"X-Lmqtt-Peer": "x" * 32})):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(base + path, headers=hdr), timeout=10)
        assert e.value.code == 403 and b"token" in e.value.read()
    req = urllib.request.Request(base + "/console/peer/disconnect", method="POST", data=b'{"client_id": "x"}',
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 403


def test_fleet_overview_shows_the_store_groups_roles_and_follows_a_failover(browser, tmp_path):
    """Gateways over a store group of 3 (docs/ha.md): the overview names the primary and the two
    replicas in sync, as the members' own `ha_status` says; after a kill -9 of the primary the same
    page (no reload) shows the new primary, and both gateways ready again (announced to it)."""
    from tests.ha.group import StoreGroup
    from tests.support import LmqttGateway
    group = StoreGroup(str(tmp_path), 3).start()
    gws = []
    try:
        first = group.wait_primary(in_sync=3)
        gws = [LmqttGateway(group.peers, log_dir=str(tmp_path)).start() for _ in range(2)]
        ids = [f"test-{g.port}" for g in gws]
        url = f"http://127.0.0.1:{gws[0].metrics_port}"
        _wait_ready(url, "gateway 0", gws[0].log_tail)
        open_page(browser, url + "/console/", "overview")
        for m in group.members:
            row = f'#st-members tr[data-node="{m.node}"]'
            wait_text(browser, row + " .role", "primary" if m is first else "replica")
            wait_text(browser, row + " .insync", "yes")
        for g in ids:
            wait_text(browser, f'tr[data-gateway="{g}"] .health', "ready")
        shot(browser, tmp_path, "overview-store-group")
        first.kill9()
        second = group.wait_primary(exclude=(first.node,), timeout=40)
        wait_text(browser, f'#st-members tr[data-node="{second.node}"] .role', "primary", timeout=40)
        assert not browser.find_elements(By.CSS_SELECTOR, f'#st-members tr[data-node="{first.node}"]')
        for g in ids:
            wait_text(browser, f'tr[data-gateway="{g}"] .health', "ready", timeout=40)
        assert browser.find_element(By.ID, "st-where").text == f"lmqtt://{second.address}"
    finally:
        for g in gws:
            g.stop()
        group.stop()


def _fmt1(x: float) -> str:
    """As the page's fmt(x, 1): thousands separators, at most one decimal."""
    return f"{x:,.1f}".rstrip("0").rstrip(".")


def test_overview_shows_the_tiers_use(browser, tmp_path):
    """`lmqtt serve --tier file://...`: the overview's store section says where the tier is and what
    it holds, as `lmqtt admin --tier` (the store's `tier` CALL) says."""
    from lmqtt.store.client import connect
    tier = tmp_path / "cold"
    tier.mkdir()
    srv = LmqttServer(str(tmp_path / "data"), log_path=str(tmp_path / "serve.log"),
                      extra_args=("--sys-interval", "0", "--tier", f"file://{tier}")).start()
    try:
        _wait_port(srv.host, srv.metrics_port)
        conn = connect(srv.store_address)
        try:
            t = conn.cmd("tier")["tier"]
        finally:
            conn.close()
        open_page(browser, console_url(srv), "overview")
        want = (f"tier file://{tier}: reachable · local {t['local_segments']:,} segments "
                f"({_fmt1(t['local_bytes'] / 1048576)} MB) · uploading {t['uploading_segments']:,} · in the tier "
                f"{t['tier_segments']:,} segments")
        WebDriverWait(browser, WAIT).until(lambda d: d.find_element(By.ID, "st-tier").text.startswith(want))
        assert browser.find_element(By.ID, "st-where").text == "embedded (lmqtt serve)"
        assert "disk free" in browser.find_element(By.ID, "st-summary").text
    finally:
        assert srv.stop() == 0, srv.log_tail()


def test_fleet_consoles_over_https_check_the_peers_announced_certificate(browser, tmp_path):
    """`--console-tls` in a fleet with a certificate no system CA signed (trustme): gateway A's
    console asks B's over HTTPS and lists B's client, because B's certificate is the one B announced
    to the store (its SHA-256); a console presenting another certificate is refused by name."""
    import trustme

    from lmqtt.gateway.app.console_web.fleet import Fleet, cert_fingerprint
    from tests.support import LmqttGateway, LmqttStore
    ca = trustme.CA()
    pem = tmp_path / "server.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))
    store = LmqttStore(str(tmp_path / "store"), log_path=str(tmp_path / "store.log")).start()
    gws, clients = [], []
    try:
        gws = [LmqttGateway(store.address, log_dir=str(tmp_path),
                            extra_args=("--cert", str(pem), "--console-tls")).start() for _ in range(2)]
        ids = [f"test-{g.port}" for g in gws]
        clients = [Paho(gws[1], client_id="tls-on-b")]
        url = f"https://127.0.0.1:{gws[0].metrics_port}/console/"
        open_page(browser, url, "clients")
        wait_text(browser, "#cl-count", "1 shown of 1 connected on 2 gateways")
        assert browser.find_element(By.CSS_SELECTOR, 'tr[data-client="tls-on-b"]').get_attribute("data-gateway") \
            == ids[1]
        assert browser.find_element(By.ID, "cl-note").text == ""
        shot(browser, tmp_path, "clients-fleet-tls")
        # the same peer with another certificate announced: refused, the reason named
        peer = {"gateway": ids[1], "url": f"https://127.0.0.1:{gws[1].metrics_port}", "token": "t" * 32,
                "cert_sha256": "0" * 64}
        ans = Fleet.__new__(Fleet)._http(peer, "/console/peer/clients", None)
        assert ans["status"] == 0 and "is not the one its gateway announced" in ans["error"], ans
        assert cert_fingerprint(str(pem)) != "0" * 64
    finally:
        for c in clients:
            c.disconnect()
        for g in gws:
            g.stop()
        assert store.stop() == 0, store.log_tail()
