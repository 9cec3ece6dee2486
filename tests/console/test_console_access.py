"""The console's Access page (admin role): users and ACL rules kept in the store, added and removed
from the page of a real `lmqtt serve --live-security` in real Chromium, and obeyed at once by a
client that stays connected (raw MQTT 5)."""
from __future__ import annotations

from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.console.test_console import WAIT, _wait_port, browser, console_url, open_page, wait_text  # noqa: F401
from tests.integrations.test_http_auth import _connect, _publish
from tests.support import LmqttServer, lmqtt_cli

assert browser


def test_users_and_rules_added_and_removed_from_the_console_apply_at_once(browser, tmp_path):
    srv = LmqttServer(str(tmp_path / "data"), extra_args=("--live-security", "--sys-interval", "0"),
                      log_path=str(tmp_path / "serve.log")).start()
    _wait_port(srv.host, srv.metrics_port)
    try:
        url = console_url(srv)
        open_page(browser, url, "access")
        browser.find_element(By.ID, "ac-user").send_keys("carol")
        browser.find_element(By.ID, "ac-password").send_keys("carol-pw")
        browser.find_element(By.ID, "ac-user-add").click()
        wait_text(browser, 'tr[data-user="carol"] .user', "carol")
        carol, ack = _connect(srv, "carol-1", "carol", "carol-pw")
        assert ack.reason_code == 0, ack
        assert _publish(carol, "lab/1", 1).reason_code == 0
        browser.find_element(By.ID, "ac-rule").send_keys("deny user:carol publish lab/#")
        browser.find_element(By.ID, "ac-rule-add").click()
        wait_text(browser, "#ac-rules tbody tr .rule", "deny user:carol publish lab/#")
        assert _publish(carol, "lab/1", 2).reason_code == 0x87           # the same connection
        # a rule the parser refuses is named on the page, nothing added
        browser.find_element(By.ID, "ac-rule").clear()
        browser.find_element(By.ID, "ac-rule").send_keys("deny carol publish lab/#")
        browser.find_element(By.ID, "ac-rule-add").click()
        wait_text(browser, "#ac-error", "rule 'deny carol publish lab/#': bad WHO 'carol' (user:NAME, client:ID, "
                                         "cert:CN, all, anonymous)")
        assert len(browser.find_elements(By.CSS_SELECTOR, "#ac-rules tbody tr")) == 1
        browser.find_element(By.CSS_SELECTOR, "#ac-rules tbody tr button.remove").click()
        WebDriverWait(browser, WAIT).until(lambda d: not d.find_elements(By.CSS_SELECTOR, "#ac-rules tbody tr"))
        assert _publish(carol, "lab/1", 3).reason_code == 0
        browser.find_element(By.CSS_SELECTOR, 'tr[data-user="carol"] button.remove').click()
        WebDriverWait(browser, WAIT).until(lambda d: not d.find_elements(By.CSS_SELECTOR, 'tr[data-user="carol"]'))
        c, ack = _connect(srv, "carol-2", "carol", "carol-pw")
        assert ack.reason_code == 0x86, ack
        c.close()
        carol.close()
        # what the page did is what `lmqtt admin` reads from the store
        r = lmqtt_cli("admin", "--store", srv.store_address, "--users")
        assert r.returncode == 0 and r.stdout.strip() == "(no users)", r
        assert "event=console_action action=security op=user_set user=local target='carol'" in srv.log_tail(50000)
    finally:
        assert srv.stop() == 0, srv.log_tail()
