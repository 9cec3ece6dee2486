"""kill -9 of `lmqtt store` (flush mode sync) under SDK produce load: every acknowledged message is
stored byte-exact after the restarts, and a batch retried with the same producer id + sequence is
stored once."""
from __future__ import annotations

import hashlib
import os
import queue
import random
import subprocess
import sys
import threading
import time

import pytest

from lmqtt.store.client import connect
from tests.support import ROOT, LmqttStore

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
def test_kill9_store_under_sdk_produce_sync(tmp_path):
    seed = random.randrange(1 << 20)
    rnd = random.Random(seed)
    st = LmqttStore(str(tmp_path / "data"), extra_args=("--flush-mode", "sync"),
                    log_path=str(tmp_path / "store.log")).start()
    prod = subprocess.Popen([sys.executable, os.path.join(HERE, "store_kill_sdk_producer.py"), st.address,
                             "kill-sdk-producer", str(seed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=open(tmp_path / "producer.err", "wb"), cwd=ROOT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in prod.stdout], daemon=True).start()
    acks: dict[str, tuple] = {}
    done = []

    def read_until(n_acks: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(acks) < n_acks and not done and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                continue
            parts = line.split()
            if parts[0] == "ack":
                tag, msg_id, off, qoff, sha = parts[1:]
                assert tag not in acks, f"tag {tag} acknowledged twice"
                acks[tag] = (msg_id, int(off), int(qoff), sha)
            elif parts[0] == "done":
                done.append(line)

    try:
        read_until(1, 30)
        assert acks, f"producer acknowledged nothing: {(tmp_path / 'producer.err').read_text()}"
        kills = 3
        for k in range(kills):
            read_until(len(acks) + rnd.randint(50, 400), 30)
            time.sleep(rnd.random() * 0.2)
            st.kill9()
            time.sleep(rnd.random() * 0.5)
            st.start()
            before = len(acks)
            read_until(before + 1, 60)      # the producer got through the restart
            assert len(acks) > before, f"no ack after restart {k + 1}: {(tmp_path / 'producer.err').read_text()}"
        read_until(len(acks) + 100, 30)
        prod.stdin.write("stop\n")
        prod.stdin.flush()
        deadline = time.monotonic() + 60
        while not done and time.monotonic() < deadline:
            read_until(10 ** 9, 0.5)
        assert prod.wait(30) == 0, (tmp_path / "producer.err").read_text()
        assert done, "producer did not finish"
    finally:
        if prod.poll() is None:
            prod.kill()
            prod.wait()
    _d, _n, _r, retries, _dd, dups = done[0].split()
    retries, dups = int(retries), int(dups)
    # the kills hit batches in flight: the producer re-sent at least one with the same sequence
    assert retries >= 1, done[0]
    try:
        with connect(st.address) as c:
            stored: dict[str, list] = {}
            lo, hi = c.admin().offsets("ks")
            off = lo
            for _ in range(100_000):
                if off >= hi:
                    break
                r = c.pull("ks", 0, off, 2048)
                for rec in r.records:
                    stored.setdefault(rec.keys[0], []).append(rec)
                assert r.next_offset > off, f"pull stuck at {off} < {hi}"
                off = r.next_offset
            twice = {t: [x.queue_offset for x in v] for t, v in stored.items() if len(v) > 1}
            assert not twice, (f"seed {seed}: {len(twice)} messages stored more than once (retried batches not "
                              f"deduplicated), e.g. {list(twice.items())[:3]}")
            missing = [t for t in acks if t not in stored]
            assert not missing, f"seed {seed}: {len(missing)} acknowledged messages lost, e.g. {missing[:5]}"
            for tag, (msg_id, off, qoff, sha) in acks.items():
                (rec,) = stored[tag]
                assert hashlib.sha1(rec.body).hexdigest() == sha and rec.body.startswith(tag.encode() + b"|"), tag
                assert (rec.offset, rec.queue_offset, rec.msg_id) == (off, qoff, msg_id), (tag, rec, off, qoff)
            # nothing stored that was never acknowledged: the producer finished every batch it began
            extra = [t for t in stored if t not in acks]
            assert not extra, f"seed {seed}: stored but never acknowledged: {extra[:5]}"
            assert len(stored) == len(acks) > 0
    finally:
        st.stop()
    print(f"seed {seed}: {len(acks)} acknowledged messages, {kills} kills, {retries} re-sent batches, "
          f"{dups} answered as duplicates")
