"""Shared pytest fixtures. Each helper section is marked; keep fixtures generic and real."""
from __future__ import annotations

import socket

import pytest


def free_port() -> int:
    """A free TCP port on loopback (bind to 0, read it back, release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def port() -> int:
    return free_port()
