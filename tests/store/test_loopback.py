"""One loopback test for every process (`lmqtt serve`, `lmqtt store`, `lmqtt gateway`): a listen
address is loopback only when it is `localhost` or an IP address in 127.0.0.0/8 or ::1."""
import pytest

from lmqtt.store.loopback import is_loopback
from lmqtt.store.server import StoreServer


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "127.1.2.3", "::1"])
def test_loopback_addresses(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["127.example.com", "0.0.0.0", "::", "10.0.0.1", "example.com", "", "127.0.0.1.nip.io"])
def test_a_name_starting_with_127_is_not_loopback(host):
    assert not is_loopback(host)


def test_the_store_server_refuses_a_127_named_host_without_a_token(tmp_path):
    with pytest.raises(ValueError, match="non-loopback address '127.example.com' without an auth token"):
        StoreServer(None, str(tmp_path / "meta"), host="127.example.com")
