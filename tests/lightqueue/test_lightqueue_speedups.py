"""The C dispatch loop of the light-queue index (lightqueue/_take.c) against the Python reference
(`lightqueue.take.take_requests`): fed the same dispatch batches, both indexes hold the same
entries in every queue, report the same touched queues per batch, and survive the same writes
(a small `max_queues_per_write` forces RocksDB writes in the middle of batches)."""
from __future__ import annotations

import os
import random

import pytest

from lmqtt.lightqueue import take as lqtake
from lmqtt.lightqueue.index import LightQueueIndex
from lmqtt.store import DispatchRequest

pytestmark = pytest.mark.skipif(os.environ.get("LMQTT_PURE_PYTHON", "") not in ("", "0"),
                                reason="LMQTT_PURE_PYTHON is set: the C loop is off on purpose")


def test_the_c_dispatch_loop_is_built_and_used():
    assert lqtake._ctake is not None, ("lmqtt.lightqueue._take was not built: `pip install -e .` needs a C "
                                        "compiler (the index falls back to its Python loop)")


def batches(rng, n=30):
    topics = [f"site/{i % 4}/dev{i}/temp" for i in range(40)]
    filter_sets = [(), ("#",), ("#", "site/#"), ("site/+/+/temp", "#", "+/#"), ("x/#",)]
    qs_of = {}
    phys = 0
    out = []
    for _ in range(n):
        b = []
        for _ in range(rng.randint(1, 120)):
            t = rng.choice(topics)
            if t not in qs_of or rng.random() < 0.05:
                fs = rng.choice(filter_sets)
                if rng.random() < 0.1:
                    fs = fs + (t,)          # a name twice in one tuple
                qs_of[t] = (t,) + fs if rng.random() > 0.05 else ()
            size = rng.randint(80, 400)
            b.append(DispatchRequest(phys, size, t, 0, 0, 0, 0, 1_700_000_000_000 + phys, 0, (), qs_of[t]))
            phys += size
        out.append((b, phys))
    return out


def run(tmp_path, name, bs, ckpt_replay, monkeypatch, use_c):
    monkeypatch.setattr(lqtake, "_ctake", lqtake._ctake if use_c else None)
    idx = LightQueueIndex(str(tmp_path / name))
    idx.max_queues_per_write = 16       # writes (and _resolved resets) in the middle of batches
    idx.write_records = 200
    touched = []
    names = set()
    for b, end in bs:
        idx.dispatch(b, end)
        if ckpt_replay:
            idx.dispatch(b[: len(b) // 2], end)   # a replay of indexed records adds nothing
        touched.append(sorted(idx.take_touched()))
        for r in b:
            names.update(r.dispatch_queues)
    state = {n: (idx.min_offset(n), idx.max_offset(n), idx.read(n, 0, 1 << 20)) for n in sorted(names)}
    idx.close()
    return touched, state


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("replay", [False, True])
def test_c_and_python_dispatch_loops_build_the_same_index(tmp_path, monkeypatch, seed, replay):
    if lqtake._ctake is None:
        pytest.skip("C loop not built (see test_the_c_dispatch_loop_is_built_and_used)")
    bs = batches(random.Random(seed))
    c = run(tmp_path, "c", bs, replay, monkeypatch, True)
    py = run(tmp_path, "py", bs, replay, monkeypatch, False)
    assert c == py
    touched, state = c
    total = sum(len(r.dispatch_queues and set(r.dispatch_queues)) for b, _ in bs for r in b)
    assert sum(v[1] for v in state.values()) == total     # one entry per distinct queue per record
    assert all(v[2] and [e.queue_offset for e in v[2]] == list(range(len(v[2]))) for v in state.values())
