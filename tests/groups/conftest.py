"""Two real `lmqtt store` processes, each a group of one (docs/groups.md), per test module."""
from __future__ import annotations

import pytest

from tests.support import LmqttStore, running


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """(a, b): the first is the directory (the first group of every list these tests give)."""
    d = tmp_path_factory.mktemp("two-groups")
    a = LmqttStore(str(d / "a"), log_path=str(d / "a.log"))
    b = LmqttStore(str(d / "b"), log_path=str(d / "b.log"))
    gen_a, gen_b = running(a), running(b)
    next(gen_a)
    next(gen_b)
    try:
        yield a, b
    finally:
        for g in (gen_b, gen_a):
            next(g, None)
