"""Fixtures shared by every test folder; the helpers behind them live in tests/support.py."""
from __future__ import annotations

import pytest

from tests.support import LmqttServer, LmqttStore, free_port, running


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`.ci/run` runs `-n 4 --dist loadgroup`): every test module is one
    group, so a module's shared servers start once, on one worker; the Spark tests are one group
    together, so the run starts one SparkSession. Without xdist the marks do nothing."""
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        group = "spark" if path.startswith("tests/spark/") or path.endswith("_spark.py") else path
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def lmqtt_server(tmp_path):
    """A running `lmqtt serve` (tmp data dir, free loopback port); SIGTERM at teardown."""
    yield from running(LmqttServer(str(tmp_path / "data"), log_path=str(tmp_path / "lmqtt-serve.log")))


@pytest.fixture
def lmqtt_store(tmp_path):
    """A running `lmqtt store` (tmp data dir, free loopback port); SIGTERM at teardown."""
    yield from running(LmqttStore(str(tmp_path / "store-data"), log_path=str(tmp_path / "lmqtt-store.log")))
