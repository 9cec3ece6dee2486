"""The console's login rule uses the one loopback test of every lmqtt process
(store/loopback.py): on a loopback address nobody logs in, anywhere else everybody does - and a
name that merely starts with "127." is not loopback."""
import pytest

from lmqtt.gateway.app.config import GatewayConfig
from lmqtt.gateway.app.console_web.auth import ConsoleAuth


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "127.1.2.3", "::1"])
def test_on_a_loopback_address_the_console_needs_no_login(host):
    assert ConsoleAuth(GatewayConfig(), host).login_required is False


@pytest.mark.parametrize("host", ["127.example.com", "127.0.0.1.nip.io", "0.0.0.0", "::", "10.0.0.1", "example.com"])
def test_anywhere_else_the_console_needs_a_login(host):
    assert ConsoleAuth(GatewayConfig(), host).login_required is True


def test_console_login_on_loopback_still_asks_for_one():
    assert ConsoleAuth(GatewayConfig(console_login=True), "127.0.0.1").login_required is True
