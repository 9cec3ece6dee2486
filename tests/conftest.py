"""Fixtures shared by every test folder; the helpers behind them live in tests/support.py."""
from __future__ import annotations

import pytest

from tests.support import LmqttServer, LmqttStore, free_port, running


# The groups that run longest (seconds of one worker, CI on 2 cores; `PYTEST_ADDOPTS=--durations=0`
# prints them), handed out first: xdist gives each worker the next group when it is nearly done,
# so a long group handed out last keeps one worker busy while the others have nothing left. Its
# own order (by number of tests) put the long modules of few tests at the end.
LONGEST_FIRST = (
    "spark",                                            # ~410 s
    "tests/ha/test_failover.py",
    "tests/e2e/test_e2e_sessions.py",
    "tests/console/test_console.py",
    "tests/gateway/test_usage_errors_name_the_cause.py",
    "tests/loadtest/test_chaos.py",
    "tests/ha/test_group_members.py",
    "tests/e2e/test_docs_walk.py",
    "tests/fleet/test_shared_groups.py",
    "tests/ha/test_replicated_metadata.py",
    "tests/e2e/test_e2e_limits.py",
    "tests/tier/test_tier_node.py",
    "tests/mqtt/test_mqtt_codec_hypothesis.py",
    "tests/e2e/test_e2e_fleet_faults.py",
    "tests/partitions/test_partition_round.py",
    "tests/gateway/test_console_tools.py",
    "tests/fuzz/test_fuzz_harnesses.py",
    "tests/e2e/test_e2e_delayed.py",
    "tests/store/test_store_kill.py",                   # ~40 s
)


def pytest_configure(config):
    if getattr(config.option, "loadscopereorder", None) is not None:
        config.option.loadscopereorder = False          # the order below, not by number of tests


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`.ci/run` runs `-n 3 --dist loadgroup`): every test module is one
    group, so a module's shared servers start once, on one worker; the Spark tests are one group
    together, so the run starts one SparkSession. The longest groups come first
    (`LONGEST_FIRST`), the others in collection order. Without xdist the marks do nothing."""
    rank = {g: i for i, g in enumerate(LONGEST_FIRST)}
    keys = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        group = "spark" if path.startswith("tests/spark/") or path.endswith("_spark.py") else path
        item.add_marker(pytest.mark.xdist_group(group))
        keys[item.nodeid] = rank.get(group, len(rank))
    items.sort(key=lambda it: keys[it.nodeid])      # stable: each group's tests keep their order


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
