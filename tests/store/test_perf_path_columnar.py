"""The store's columnar append path (docs/store.md "Append path"): append_batch results built on
demand, the live hand-off to dispatch as runs of records, the built-in dispatchers' column
readers, and the page prefaulter. Each must give exactly what the plain path gives."""
from __future__ import annotations

import os

from lmqtt.store import AppendResult, Message, MessageStore, StoreConfig, commitlog
from lmqtt.store.consume_queue import ENTRY


def cfg(path, **kw):
    base = dict(data_dir=str(path), segment_size=64 * 1024, max_message_size=16 * 1024,
                flush_mode="async", index_slots=128, index_entries=4096, cq_block_entries=100)
    base.update(kw)
    return StoreConfig(**base)


def batches():
    """Batches shaped like real traffic: long runs of one topic (equal and unequal body sizes),
    topics sharing a first-level queue, several queue ids, keys on some records, enough bytes to
    roll the 64 KiB segments many times (runs cut by blank fillers)."""
    same = "dev/1/temp"   # one string object: a run per batch
    out = []
    for i in range(60):
        if i % 4 == 0:
            out.append([Message(topic=same, body=b"%03d" % i * 30) for _ in range(50)])
        elif i % 4 == 1:
            out.append([Message(topic=same, body=os.urandom(1 + (i * 7 + j * 13) % 300), born_ts=5)
                        for j in range(40)])
        elif i % 4 == 2:
            out.append([Message(topic=f"dev/{j % 3}/x", body=b"v" * 40, queue_id=j % 2,
                                keys=("k",) if j % 5 == 0 else ()) for j in range(30)])
        else:
            out.append([Message(topic="other", body=b"o" * 90, props=b"pp", flags=7) for _ in range(20)])
    return out


def test_append_results_behave_like_a_list(tmp_path):
    with MessageStore(cfg(tmp_path / "s")) as st:
        msgs = [Message(topic="t/a", body=b"x" * (i % 7 + 1)) for i in range(12)]
        rs = st.append_batch(msgs)
        last, first = rs[-1], rs[0]            # answered from the columns
        plain = list(rs)                       # built once
        assert len(rs) == 12 and all(type(r) is AppendResult for r in plain)
        assert last == plain[-1] and first == plain[0]
        assert rs[3] == plain[3] and rs[2:5] == plain[2:5] and rs[-3:] == plain[-3:]
        assert rs == plain and [r.queue_offset for r in rs] == list(range(12))
        assert [r.phys_offset for r in rs] == [plain[0].phys_offset + sum(r.size for r in plain[:i])
                                              for i in range(12)]
        assert (rs + [None])[-1] is None and ([None] + rs)[0] is None
        acc = []
        acc += rs
        assert acc == plain and list(reversed(rs)) == plain[::-1] and plain[4] in rs
        assert rs[-1].durable.result() == last.phys_offset + last.size


def _store_state(st):
    """Every ConsumeQueue's raw entries and the records they point to."""
    out = {}
    for key in sorted(st.consume_queues.max_offsets()):
        cq = st.consume_queues.get(*key)
        raw = b"".join(piece for _, piece in cq.pieces(0, cq.max_offset))
        entries = [e for e in ENTRY.iter_unpack(raw)]
        msgs = [(m.queue_offset, m.phys_offset, m.body, m.props, m.flags, m.born_ts)
                for m in st.read_consume_queue(key[0], key[1], 0, 10_000)]
        out[key] = (cq.max_offset, entries, msgs)
    return out


def test_live_columnar_dispatch_builds_the_same_indexes_as_parsing_the_log(tmp_path, monkeypatch):
    """Live hand-off with the C encoder (ConsumeQueue blocks packed while encoding), live with the
    Python encoder (blocks packed from the runs), and parsing the log: the same indexes."""
    states = []
    bs = batches()
    encoders = [("c", commitlog._fast), ("python", None)] if commitlog._fast is not None else [("python", None)]
    for live, (name, fast) in [(True, e) for e in encoders] + [(False, encoders[0])]:
        monkeypatch.setattr(commitlog, "_fast", fast)
        with MessageStore(cfg(tmp_path / f"s{live}{name}", dispatch_from_memory=live)) as st:
            rs = []
            for b in bs:
                rs = st.append_batch(b)
            assert st.wait_dispatched(rs[-1].phys_offset + rs[-1].size, 10)
            keyed = st.query_by_key("dev/0/x", "k", 0, 1 << 62, 1000)
            states.append((_store_state(st), sorted(m.phys_offset for m in keyed)))
    assert len(states) == len(encoders) + 1
    assert all(s == states[0] for s in states[1:])
    cqs = states[0][0]
    assert cqs[("dev", 0)][0] == 15 * 50 + 15 * 40 + 15 * 15 and cqs[("other", 0)][0] == 15 * 20
    assert len(states[0][1]) == 15 * 2   # j = 0 and 15 of each keyed batch are on dev/0/x


def test_prefault_keeps_pages_ahead_without_changing_data(tmp_path):
    c = cfg(tmp_path / "p", segment_size=8 << 20, max_message_size=1 << 20, prefault_bytes=1 << 20)
    with MessageStore(c) as st:
        bodies = [os.urandom(200) for _ in range(20_000)]
        rs = []
        for i in range(0, len(bodies), 100):
            rs += st.append_batch([Message(topic="p/q", body=b) for b in bodies[i:i + 100]])
            if st.prefault.enabled:
                st.prefault.step()
        assert st.wait_dispatched(rs[-1].phys_offset + rs[-1].size, 10)
        assert [st.read(r.phys_offset).body for r in rs] == bodies
        if st.prefault.enabled:
            assert st.prefault.populated > 0
    with MessageStore(c) as st:   # recovery sees exactly the records (prefaulted pages are zeros)
        assert st.max_offset == rs[-1].phys_offset + rs[-1].size
        assert st.read(rs[-1].phys_offset).body == bodies[-1]
