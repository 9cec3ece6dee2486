"""The fuzz input read front to back as the harnesses' choices (tests/fuzz/fuzz_fastpath.py,
fuzz_records.py, fuzz_columns.py): bytes, and ints in a range, mostly small or near an end (where
the edge cases are), else from 8 raw bytes. Past the input's end every read is zeros, so any
input is a valid one and the fuzzer's mutations keep the earlier choices in place."""
from __future__ import annotations


class Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.i = 0

    def byte(self) -> int:
        b = self.data[self.i] if self.i < len(self.data) else 0
        self.i += 1
        return b

    def take(self, n: int) -> bytes:
        out = self.data[self.i:self.i + n]
        self.i += n
        return out

    def rest(self) -> bytes:
        out = self.data[self.i:]
        self.i = len(self.data)
        return out

    def num(self, lo: int, hi: int) -> int:
        """An int in [lo, hi]: small from lo, small below hi, a multiple of 97 from lo, or 8 raw bytes."""
        t = self.byte()
        kind, v = t & 3, t >> 2
        if kind == 0:
            return min(lo + v, hi)
        if kind == 1:
            return max(hi - v, lo)
        if kind == 2:
            return min(lo + v * 97, hi)
        raw = int.from_bytes(self.take(8).ljust(8, b"\0"), "little")
        return lo + raw % (hi - lo + 1)
