"""`lmqtt serve --tier` (the embedded store, and `--workers 2`: the store child gets the flags):
MQTT publishes fill segments, they move to the tier with their Parquet files (--tier-parquet, as
`lmqtt store` writes them), and a persistent session's backlog and an SDK pull read them back
byte-identical; `--tier-parquet on` without pyarrow is refused when the flags are checked."""
from __future__ import annotations

import os

import pytest

from tests.support import LmqttServer, Paho
from tests.tier.test_tier_node import BODY, SEG_MB, _offloaded, _pull_all, _wait


@pytest.mark.parametrize("workers", [1, 2])
def test_lmqtt_serve_tier_offloads_and_a_session_backlog_reads_it_back(workers, tmp_path):
    (tmp_path / "data").mkdir()
    extra = ("--segment-mb", str(SEG_MB), "--tier", f"file://{tmp_path / 'tier'}", "--local-retention", "0")
    if workers > 1:
        extra += ("--workers", str(workers))
    srv = LmqttServer(str(tmp_path / "data"), extra).start(timeout=60)
    srv.store = srv.store_address
    try:
        sub = Paho(srv, client_id="serve-tier", clean=False)
        assert sub.subscribe("dev/+/t", qos=1) == [1]
        sub.disconnect()
        pub = Paho(srv, client_id="serve-tier-pub")
        sent = [(f"dev/{i % 5}/t", f"{i:06d}".encode() + os.urandom(BODY - 6)) for i in range(2000)]
        for t, b in sent:
            pub.c.publish(t, b, qos=1)
        pub.publish("dev/0/t", b"last", qos=1)          # waits for its PUBACK: the others are in
        pub.disconnect()
        sent.append(("dev/0/t", b"last"))

        class _Addr:
            address = srv.store_address
        s = _offloaded(_Addr, 3)
        assert s["tier_min_offset"] == 0
        # the stats drop a segment before its file is unlinked (a reader may still map it): wait
        # for the disk to show it, then the assertion
        local = tmp_path / "data" / "store" / "commitlog"
        want = [f"{s['local_min_offset']:020d}"]
        _wait(lambda: sorted(os.listdir(local)) == want, 30, "the uploaded segments' local files removed")
        assert sorted(os.listdir(local)) == want
        # serve writes the Parquet copy for Spark as `lmqtt store` does (--tier-parquet auto, pyarrow
        # importable here): every offloaded message once, in order, in the manifest's files
        import json

        import pyarrow.parquet as pq
        assert s["parquet_segments"] == s["tier_segments"] and s["parquet_error"] is None, s
        man = json.loads((tmp_path / "tier" / "manifest.json").read_bytes())
        keys = list(dict.fromkeys(k for e in man["segments"] for k in e["parquet"]))
        assert keys and all(k.startswith("parquet/first_level=dev/date=") for k in keys), keys
        rows = []
        for k in keys:
            t = pq.read_table(tmp_path / "tier" / k, columns=["topic", "payload", "offset"]).to_pydict()
            rows += zip(t["offset"], t["topic"], t["payload"])
        assert [(tp, bytes(b)) for _o, tp, b in sorted(rows)] == sent[:len(rows)] and len(rows) > 1000
        got = _pull_all(_Addr, "dev", len(sent))
        assert [(r.topic, bytes(r.body)) for r in got] == sent
        sub = Paho(srv, client_id="serve-tier", clean=False)
        assert sub.session_present
        msgs = sub.get_n(len(sent), timeout=60)
        assert [(m.topic, bytes(m.payload)) for m in msgs] == sent
        sub.disconnect()
    finally:
        srv.stop()


def test_lmqtt_serve_refuses_bad_tier_flags_in_one_line(tmp_path):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "serve", "--port", "0", "--data-dir",
                        str(tmp_path / "d"), "--tier", "file:///x", "--tier-retention", "long"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--tier-retention: 'long'" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "d").exists()


def _without_pyarrow(tmp_path) -> dict:
    """The environment of a machine without pyarrow: a `pyarrow` package first on the path whose
    import fails as a missing one does."""
    shadow = tmp_path / "no-pyarrow" / "pyarrow"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'pyarrow'\")\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize("command", ["serve", "store"])
def test_tier_parquet_on_without_pyarrow_is_a_config_error_naming_pyarrow(command, tmp_path):
    import subprocess
    import sys
    env = _without_pyarrow(tmp_path)
    base = [sys.executable, "-m", "lmqtt.gateway.cli", command, "--port", "0", "--data-dir", str(tmp_path / "d"),
            "--tier", f"file://{tmp_path / 'tier'}"]
    r = subprocess.run(base + ["--tier-parquet", "on"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2, r.stderr
    assert "--tier-parquet on needs pyarrow" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "d").exists() and not (tmp_path / "tier").exists()
    # without --tier, `on` is named as a tier setting given alone
    r = subprocess.run(base[:-2] + ["--tier-parquet", "on"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "tier_parquet" in r.stderr and "tier is not" in r.stderr, r.stderr
