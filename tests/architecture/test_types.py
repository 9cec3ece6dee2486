"""A static type check (mypy) of the seam between gateway and store: the typed gateway <-> node
protocol and the code on both sides of it. `TYPED` is the list; CI runs it through this test and
fails on any error, printed with file and line.

Why a shadow tree: the repository keeps the design's folders (store/, gateway/, ...) and
pyproject.toml maps them to `lmqtt.store`, `lmqtt.gateway`, ...; an editable install resolves that
mapping with an import hook mypy does not run. A folder `lmqtt/` of symbolic links gives mypy the
same module names from the same files."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FOLDERS = ("store", "lightqueue", "notify", "gateway", "loadtest", "examples")

# the modules checked; every one must pass (add to it, never take away)
TYPED = [
    "lmqtt.store.node.protocol",
    "lmqtt.store.node.wire",                # the typed messages' codec (Wire, BadRequest), split from protocol
    "lmqtt.gateway.storage.node_client",    # the gateway's client of the node (NodeClient), split from protocol
    "lmqtt.gateway.storage.facades",        # the storage facades and both implementations
    "lmqtt.store.node.inprocess",
    "lmqtt.store.node.embedded",            # lmqtt serve's in-process store node: what the gateway gets of it
    "lmqtt.gateway.storage.remote_metadata",
    "lmqtt.gateway.storage.remote_store",   # the remote QueueStore: mirrors, and answers asked together
    "lmqtt.gateway.storage.remote_mirrors",  # the remote QueueStore's mirrors kept fresh (pushes, events, poll)
    "lmqtt.gateway.storage.remote_reads",
    "lmqtt.gateway.subscriptions.subscription_registry",  # the facades' main caller: prepare / deciding
    "lmqtt.store.node.config",              # NodeConfig: every lmqtt store setting, typed
    "lmqtt.store.client.commands",          # the SDK's command layer: every request typed
    "lmqtt.store.client.failover",          # the one connection policy (Members, Retry)
    "lmqtt.loadtest.chaos.netbed",          # the network-partition bed and the fleet, faults and round on it
    "lmqtt.loadtest.chaos.nfdelay",
    "lmqtt.loadtest.chaos.partitions",
    "lmqtt.loadtest.chaos.partition_round",
    "lmqtt.loadtest.chaos.remote",
    "lmqtt.store.heap",                     # what the store gives back to the kernel
    "lmqtt.store.rocksdb_options",          # the options every RocksDB database opens with
    "lmqtt.store.node.stop_signals",        # SIGTERM/SIGINT of lmqtt store, kept across a restart in place
    "lmqtt.store.unique_keys",              # one record per (topic, key): PRODUCE F_UNIQUE_KEYS
    "lmqtt.gateway.storage.topic_owners",   # a gateway over several store groups: who owns a first level
    "lmqtt.gateway.storage.grouped_metadata",  # ... its metadata facades
    "lmqtt.gateway.storage.grouped_queues",    # ... its light queues
    "lmqtt.gateway.storage.session_stubs",     # ... and its sessions' stubs in the groups holding their offsets
]

pytest.importorskip("mypy", reason="mypy is in the test extras (pip install -e '.[test]')")


def _shadow(tmp: pathlib.Path) -> pathlib.Path:
    pkg = tmp / "lmqtt"
    pkg.mkdir()
    for f in FOLDERS:
        os.symlink(ROOT / f, pkg / f)
    return tmp


def _mypy(cwd: pathlib.Path, *targets: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports",
            "--no-error-summary", "--hide-error-context", "--cache-dir", str(cwd / ".mypy_cache"),
            "--check-untyped-defs"]
    for t in targets:
        args += ["-m", t] if not t.endswith(".py") else [t]
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600)


def test_the_seam_type_checks(tmp_path):
    r = _mypy(_shadow(tmp_path), *TYPED)
    assert r.returncode == 0, f"mypy found errors in {TYPED}:\n{r.stdout}{r.stderr}"


def test_the_type_check_sees_a_wrong_type(tmp_path):
    """The check would pass on anything if mypy saw nothing: a call with a wrong type fails it."""
    tree = _shadow(tmp_path)
    probe = tree / "probe_wrong_type.py"
    probe.write_text("from lmqtt.store.node import protocol as NP\n"
                     "def f() -> None:\n    NP.Pull(queue=7, offset='0')\n")
    r = _mypy(tree, str(probe))
    assert r.returncode != 0, r.stdout + r.stderr
    assert 'probe_wrong_type.py:3: error: Argument "queue" to "Pull" has incompatible type "int"' in r.stdout, r.stdout
