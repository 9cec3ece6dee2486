"""The epoch file: where each primary's term began in the CommitLog (RocketMQ's EpochFile).

`<data_dir>/ha/epochs` holds JSON `[[epoch, start_offset], ...]`, ascending. A primary appends
its entry when it takes over (start = its CommitLog end then); a replica takes the primary's list
in the handshake. Two members' logs agree up to the end of the last epoch both hold
(`divergence`): a rejoining old primary truncates what it appended after that point.
"""
from __future__ import annotations

import json
import os

from ..checkpoint import write_atomic


class EpochFile:
    def __init__(self, path: str) -> None:
        self.path = path
        self.entries: list[tuple[int, int]] = []
        try:
            with open(path, encoding="utf-8") as f:
                self.entries = [(int(e), int(s)) for e, s in json.load(f)]
        except FileNotFoundError:
            pass

    @property
    def last_epoch(self) -> int:
        return self.entries[-1][0] if self.entries else 0

    def save(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        write_atomic(self.path, json.dumps([list(x) for x in self.entries]).encode())

    def begin(self, epoch: int, start: int) -> None:
        """This member becomes primary of `epoch` with its log ending at `start`."""
        self.entries = [x for x in self.entries if x[0] < epoch] + [(epoch, start)]
        self.save()

    def replace(self, entries, end: int) -> None:
        """Take the primary's list (a replica after the handshake); entries beyond `end` included:
        the data of those epochs is on its way."""
        self.entries = [(int(e), int(s)) for e, s in entries]
        self.save()


def divergence(primary: list, primary_end: int, replica: list, replica_end: int) -> int:
    """The offset up to which the replica's log is the primary's: the end of the last epoch both
    lists hold (the smaller of its two ends), or 0 when they share none."""
    pset = {(int(e), int(s)) for e, s in primary}
    rlist = [(int(e), int(s)) for e, s in replica if int(s) <= replica_end]
    for i in range(len(rlist) - 1, -1, -1):
        e, s = rlist[i]
        if (e, s) not in pset:
            continue
        r_end = rlist[i + 1][1] if i + 1 < len(rlist) else replica_end
        plist = sorted(pset)
        j = plist.index((e, s))
        p_end = plist[j + 1][1] if j + 1 < len(plist) else primary_end
        return min(r_end, p_end, replica_end)
    return 0
