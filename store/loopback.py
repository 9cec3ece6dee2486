"""Is a listen address loopback? The one test of every lmqtt process (`lmqtt serve`, `lmqtt store`,
`lmqtt gateway`, the web console's login rule), in a module that imports nothing of ours: the
store's server, the store node and the gateway's rooms all name it without importing the engine
(tests/architecture/test_layering.py: a vocabulary unit of `lmqtt.store`)."""
from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Is `host` (a listen address as given on the command line) a loopback address? `localhost`,
    or an IP address in 127.0.0.0/8 or ::1 - never a name that merely starts with "127."
    (`127.example.com` is a host on the network)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


__all__ = ["is_loopback"]
