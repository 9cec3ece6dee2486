"""The judges of the partition round on hand-made data (no bed needed): an acknowledgement whose
offset holds another message, or nothing, is counted as given by a losing primary; members'
CommitLogs that differ are found, at the first differing byte."""
from __future__ import annotations

from pathlib import Path

from lmqtt.loadtest.chaos.partition_round import misplaced_acks
from lmqtt.loadtest.chaos.partitions import Group, LogCompare, Member


def test_an_ack_is_judged_against_what_the_log_holds_at_its_offset():
    acks = {("p", 1): (1.0, 1, 1, 100), ("p", 2): (1.1, 1, 1, 200), ("p", 3): (5.0, 1, 1, 300),
            ("p", 4): (6.0, 2, 2, 300), ("p", 5): (7.0, 2, 2, 900)}
    # the log: 100 and 200 as acknowledged; 300 holds message 4 (node 2's): node 1 acknowledged
    # message 3 at 300 in epoch 1 while node 2 wrote there in epoch 2
    stored = {100: ("p", 1), 200: ("p", 2), 300: ("p", 4)}
    checked: set = set()
    bad = misplaced_acks(acks, stored, checked, reached=400, final=False)
    assert [(b["seq"], b["by_node"], b["log_has"]) for b in bad] == [(3, 1, ["p", 4])]
    assert ("p", 5) not in checked                     # beyond what was read: judged later
    assert misplaced_acks(acks, stored, checked, reached=400, final=False) == []     # each once
    bad = misplaced_acks(acks, stored, checked, reached=400, final=True)
    assert [(b["seq"], b["log_has"]) for b in bad] == [(5, None)]


def _member(root: Path, node: int, data: bytes, seg: int = 64) -> Member:
    m = Member("g1", node, f"g1m{node}", "10.77.0.1", root / f"m{node}", root / f"m{node}.log")
    d = m.data_dir / "store" / "commitlog"
    d.mkdir(parents=True)
    for start in range(0, max(len(data), 1), seg):
        (d / f"{start:020d}").write_bytes(data[start:start + seg].ljust(seg, b"\0"))
    return m


def test_logs_compare_equal_then_a_difference_is_found_at_its_offset(tmp_path):
    data = bytes(range(256)) * 2
    g = Group("g1", [_member(tmp_path, 1, data), _member(tmp_path, 2, data), _member(tmp_path, 3, data)])
    lc = LogCompare(g)
    lc.MARGIN, lc.CHUNK = 16, 50                      # small numbers: several chunks, two segments each
    ok, why = lc.compare({1: 512, 2: 512, 3: 500})
    assert ok, why
    assert lc.upto == 500 and lc.verified <= 500 - 16
    other = bytearray(data)
    other[450] ^= 0xFF
    g2 = Group("g1", [_member(tmp_path / "b", 1, data), _member(tmp_path / "b", 2, bytes(other)),
                      _member(tmp_path / "b", 3, data)])
    ok, why = LogCompare(g2).compare({1: 512, 2: 512, 3: 512})
    assert not ok and "offset 450" in why
