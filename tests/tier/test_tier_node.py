"""`lmqtt store --tier` as a real process: segments move to the tier (moto's S3 server over HTTP,
and `file://`), an SDK pull and a persistent MQTT session's backlog (through `lmqtt gateway`) read
byte-identical messages from there, and a `kill -9` in the middle of an upload loses nothing,
leaves no half-visible or duplicate object, and the upload resumes at the restart."""
from __future__ import annotations

import json
import os
import time

import pytest

from lmqtt.store.client import connect
from tests.support import LmqttGateway, LmqttStore, Paho

SEG_MB = 5
BODY = 8 << 10


def _wait(cond, timeout: float = 60.0, what: str = "condition"):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        v = cond()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _tier(store) -> dict:
    c = connect(store.address)
    try:
        return c.cmd("tier")["tier"]
    finally:
        c.close()


def _produce(store, n: int, topic_fmt: str = "dev/{}/t") -> list[tuple[str, bytes]]:
    c = connect(store.address)
    try:
        p = c.producer()
        sent = [(topic_fmt.format(i % 5), f"{i:06d}".encode() + os.urandom(BODY - 6)) for i in range(n)]
        for i in range(0, n, 100):
            p.send_batch(sent[i:i + 100])
        return sent
    finally:
        c.close()


def _pull_all(store, topic: str, n: int) -> list:
    c = connect(store.address)
    try:
        out, off = [], 0
        while len(out) < n:
            r = c.pull(topic, 0, off, 256)
            if not r.records:
                break
            out += r.records
            off = r.next_offset
        return out
    finally:
        c.close()


def _offloaded(store, sealed_at_least: int) -> dict:
    def done():
        s = _tier(store)
        return s if (s["tier_segments"] >= sealed_at_least and s["uploading_segments"] == 0
                     and s["local_segments"] == 1) else None
    return _wait(done, 90, "the sealed segments in the tier and gone from the disk")


def test_lmqtt_store_offloads_to_s3_and_sdk_pull_and_a_session_backlog_read_it_back(moto_s3, tmp_path):
    bucket = moto_s3.new_bucket()
    (tmp_path / "data").mkdir()
    store = LmqttStore(str(tmp_path / "data"), ("--segment-mb", str(SEG_MB), "--tier", f"s3://{bucket}/n1",
                                                "--tier-endpoint", moto_s3.endpoint, "--local-retention", "0"))
    store.start()
    gw = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    try:
        sub = Paho(gw, client_id="tier-session", clean=False)
        assert sub.subscribe("dev/+/t", qos=1) == [1]
        sub.disconnect()
        gw.stop()
        since = int(time.time() * 1000) - 1000
        sent = _produce(store, 2000)                       # ~16 MB: 3 sealed 5 MiB segments
        s = _offloaded(store, 3)
        # the stats drop a segment before its file is unlinked (a reader may still map it): wait
        # for the disk to show it, then the assertion
        local = tmp_path / "data" / "store" / "commitlog"
        want = [f"{s['local_min_offset']:020d}"]
        _wait(lambda: sorted(os.listdir(local)) == want, 30, "the uploaded segments' local files removed")
        assert sorted(os.listdir(local)) == want
        # lmqtt admin --tier: local / uploading / in the tier / the oldest readable time
        import subprocess
        import sys
        r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "admin", "--store", store.address, "--tier"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        import re
        out = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in r.stdout.splitlines())
        assert f"s3://{bucket}/n1 (reachable" in out["tier"] and out["local"].startswith("1 segment(s)")
        assert out["in tier"].startswith(f"{s['tier_segments']} segment(s)")
        assert out["uploading"].startswith("0 sealed") and "UTC" in out["oldest readable"]
        man = json.loads(moto_s3.client().get_object(Bucket=bucket, Key="n1/manifest.json")["Body"].read())
        assert moto_s3.keys(bucket, "n1/") == sorted(["n1/manifest.json"] + [f"n1/{e['key']}" for e in man["segments"]]
                                                     + [f"n1/{k}" for e in man["segments"] for k in e["parquet"]])
        # the SDK's pull (the store node's raw fast path cannot map these: the tier serves them)
        got = _pull_all(store, "dev", len(sent))
        assert [(r.topic, bytes(r.body)) for r in got] == sent
        assert got[0].offset < s["local_min_offset"]
        # POP and a filter's history read (FilterConsumer from earliest) come from the tier too
        c = connect(store.address)
        try:
            pc, popped = c.pop_consumer("dev", "poppers"), []
            for _ in range(200):
                recs = pc.pop(64)
                if not recs:
                    break
                pc.ack(recs)
                popped += recs
            assert [(r.topic, bytes(r.body)) for r in popped] == sent
            fc, hist = c.filter_consumer("dev/+/t", start="earliest"), []
            for _ in range(400):
                recs = fc.poll()
                hist += recs
                if len(hist) >= len(sent):
                    break
            assert [(r.topic, bytes(r.body)) for r in hist] == sent
        finally:
            c.close()
        # the persistent session's backlog, through a fresh gateway (nothing of it cached there)
        gw = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
        sub = Paho(gw, client_id="tier-session", clean=False)
        assert sub.session_present
        msgs = sub.get_n(len(sent), timeout=60)
        assert [(m.topic, bytes(m.payload)) for m in msgs] == sent
        sub.disconnect()
        # subscribing from the past ($replay/{since}/{filter}) reads the same history from the tier
        rp = Paho(gw, client_id="replayer")
        assert rp.subscribe(f"$replay/{since}/dev/+/t", qos=1) == [1]
        msgs = rp.get_n(len(sent), timeout=60)
        assert [(m.topic, bytes(m.payload)) for m in msgs] == sent
        rp.disconnect()
        assert _tier(store)["cache_misses"] >= 3
    finally:
        gw.stop()
        store.stop()


@pytest.mark.parametrize("kind,point", [("file", "tmp"), ("file", "manifest"), ("s3", "manifest")])
def test_kill9_in_the_middle_of_an_upload_loses_nothing_and_the_upload_resumes(kind, point, tmp_path, monkeypatch,
                                                                              request):
    """`tmp` (a filesystem tier): killed after an object's bytes were written but before they were
    renamed into place; `manifest`: killed after the objects were in place but before the manifest
    naming them (a filesystem, and moto's S3 server)."""
    tier_dir = tmp_path / "tier"
    if kind == "file":
        args = ("--tier", f"file://{tier_dir}")

        def listing():
            return sorted(str(p.relative_to(tier_dir)) for p in tier_dir.rglob("*") if p.is_file())

        def manifest():
            return json.loads((tier_dir / "manifest.json").read_bytes())
    else:
        moto_s3 = request.getfixturevalue("moto_s3")
        bucket = moto_s3.new_bucket()
        args = ("--tier", f"s3://{bucket}/k", "--tier-endpoint", moto_s3.endpoint)

        def listing():
            return [k[len("k/"):] for k in moto_s3.keys(bucket, "k/")]

        def manifest():
            return json.loads(moto_s3.client().get_object(Bucket=bucket, Key="k/manifest.json")["Body"].read())
    marker = tmp_path / "paused"
    monkeypatch.setenv("LMQTT_TIER_PAUSE", point)
    monkeypatch.setenv("LMQTT_TIER_PAUSE_FILE", str(marker))
    (tmp_path / "data").mkdir()
    store = LmqttStore(str(tmp_path / "data"), ("--segment-mb", str(SEG_MB), *args, "--local-retention", "0"))
    store.start()
    try:
        sent = _produce(store, 2000)
        _wait(marker.exists, 60, "the uploader to reach the pause point")
        store.kill9()
        left = listing()
        if point == "tmp":
            assert any(".tmp-" in k for k in left) and not any(k.endswith(".zst") for k in left), left
        else:
            assert any(k.endswith(".zst") for k in left) and "manifest.json" not in left, left
        local = sorted(os.listdir(tmp_path / "data" / "store" / "commitlog"))
        assert len(local) >= 4                                   # nothing was deleted locally
        monkeypatch.delenv("LMQTT_TIER_PAUSE")
        store.start()
        s = _offloaded(store, 3)
        man = manifest()
        assert listing() == sorted(["manifest.json"] + [e["key"] for e in man["segments"]]     # no tmp, no duplicate
                                   + [k for e in man["segments"] for k in e.get("parquet", ())])  # (Parquet: --tier-parquet auto)
        assert [e["start"] for e in man["segments"]] == [i * (SEG_MB << 20) for i in range(s["tier_segments"])]
        got = _pull_all(store, "dev", len(sent))
        assert [(r.topic, bytes(r.body)) for r in got] == sent
    finally:
        store.stop()


def test_tier_flags_are_checked_before_the_store_starts(tmp_path):
    import subprocess
    import sys
    for args, want in [(("--tier", "foo://x"), "unknown protocol 'foo'"),
                       (("--tier", f"file://{tmp_path}/t", "--local-retention", "soon"), "--local-retention: 'soon'"),
                       (("--local-retention", "1h"), "local_retention is set but tier is not")]:
        r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "store", "--port", "0", "--data-dir",
                            str(tmp_path / "d"), *args], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and want in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_tier_away_the_node_serves_keeps_its_files_and_readers_skip_nothing(moto_s3, s3_proxy, tmp_path):
    """The tier unreachable for a while: appends and local reads go on, sealed segments stay on the
    disk, a read of the offloaded range fails (SDK pull, a filter's history) instead of skipping
    those messages; when the tier is back the uploads catch up and every reader gets everything."""
    from lmqtt.store.client import StoreClientError
    bucket = moto_s3.new_bucket()
    (tmp_path / "data").mkdir()
    store = LmqttStore(str(tmp_path / "data"), ("--segment-mb", str(SEG_MB), "--tier", f"s3://{bucket}/n",
                                                "--tier-endpoint", s3_proxy.endpoint, "--local-retention", "0"))
    store.start()
    gw = None
    try:
        gw = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
        sub = Paho(gw, client_id="tier-away-session", clean=False)
        assert sub.subscribe("dev/+/t", qos=1) == [1]
        sub.disconnect()
        sent = _produce(store, 2000)
        _offloaded(store, 3)
        s3_proxy.down()
        more = _produce(store, 2000, "dev/{}/t")                 # the node keeps taking messages
        _wait(lambda: _tier(store)["error"], 60, "the uploader to notice")
        t = _tier(store)
        assert t["uploading_segments"] >= 3 and t["local_segments"] == t["uploading_segments"] + 1
        assert not t["reachable"] and "failed" in t["error"]
        c = connect(store.address)
        try:
            with pytest.raises(StoreClientError, match="tier"):
                c.pull("dev", 0, 0, 256)
            fc = c.filter_consumer("dev/+/t", start="earliest")
            with pytest.raises(StoreClientError, match="tier"):
                fc.poll()
            # local data is served meanwhile
            r = c.pull("dev", 0, len(sent), 256)
            assert [(x.topic, bytes(x.body)) for x in r.records] == more[:len(r.records)] and r.records
        finally:
            c.close()
        # a persistent session's backlog starts in the offloaded range: the gateway waits (one
        # line naming the tier, no traceback) and delivers nothing out of order meanwhile
        sub = Paho(gw, client_id="tier-away-session", clean=False)
        assert sub.session_present
        _wait(lambda: "event=store_read_failed" in open(gw.log_path).read(), 30, "the gateway to report the tier")
        assert sub.get_n(1, timeout=1) == []
        s3_proxy.up()
        _offloaded(store, 6)
        _wait(lambda: (lambda t: t if t["reachable"] and t["error"] is None else None)(_tier(store)), 30,
                  "the tier reachable again")
        got = _pull_all(store, "dev", len(sent) + len(more))
        assert [(x.topic, bytes(x.body)) for x in got] == sent + more
        c = connect(store.address)
        try:
            fc, hist = c.filter_consumer("dev/+/t", start="earliest"), []
            for _ in range(400):
                hist += fc.poll()
                if len(hist) >= len(sent) + len(more):
                    break
            assert [(x.topic, bytes(x.body)) for x in hist] == sent + more
        finally:
            c.close()
        # ... and once the tier is back, the session gets its whole backlog, in order, by itself
        msgs = sub.get_n(len(sent) + len(more), timeout=60)
        assert [(m.topic, bytes(m.payload)) for m in msgs] == sent + more
        sub.disconnect()
        log_text = open(gw.log_path).read()
        assert "Traceback" not in log_text and "delivery_failed" not in log_text, log_text[-3000:]
    finally:
        if s3_proxy._srv is None:
            s3_proxy.up()
        if gw is not None:
            gw.stop()
        store.stop()


def test_after_a_restart_offloaded_history_is_still_every_reader_s(tmp_path):
    """A store restarted with its history in the tier: the light queues, the session backlog, an
    SDK pull and a filter's history still reach the offloaded range (the tier's range is known
    before the queues check themselves against the log start)."""
    (tmp_path / "data").mkdir()
    store = LmqttStore(str(tmp_path / "data"), ("--segment-mb", str(SEG_MB), "--tier", f"file://{tmp_path / 'tier'}",
                                                "--local-retention", "0"))
    store.start()
    gw = None
    try:
        gw = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
        sub = Paho(gw, client_id="tier-restart", clean=False)
        assert sub.subscribe("dev/+/t", qos=1) == [1]
        sub.disconnect()
        gw.stop()
        sent = _produce(store, 2000)
        _offloaded(store, 3)
        store.stop()
        store.start()
        got = _pull_all(store, "dev", len(sent))
        assert [(r.topic, bytes(r.body)) for r in got] == sent
        gw = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
        sub = Paho(gw, client_id="tier-restart", clean=False)
        assert sub.session_present
        msgs = sub.get_n(len(sent), timeout=60)
        assert [(m.topic, bytes(m.payload)) for m in msgs] == sent
        sub.disconnect()
    finally:
        if gw is not None:
            gw.stop()
        store.stop()
