"""Payload stamps and the subscriber-side loss / duplicate / order accounting.

Every published payload starts with a 16-byte stamp ``!IIQ``: publisher id, sequence number
(0, 1, 2, ... per publisher) and the send time in ``time.monotonic_ns()``. CLOCK_MONOTONIC is one
clock for the whole host on Linux, so a subscriber in another worker process can subtract it
from its own receive time. The rest of the payload is padding up to the requested size; it is
written once into the pre-encoded packet and never touched again (only the stamp is patched).

Accounting is per (subscriber, publisher) stream. For each stream we keep the highest sequence
seen and the sequence numbers skipped below it (as sorted ``[start, end)`` intervals, so a QoS 0
run that drops a million messages costs one interval, not a million set entries):

* ``seq == hi + 1``   → in order;
* ``seq >  hi + 1``   → the numbers in between are *missing* (possibly late);
* ``seq <  hi`` and in *missing* → arrived late: counted *out of order*, no longer missing;
* ``seq <= hi`` otherwise → a *duplicate*.

At the end ``lost = sent - unique`` for each stream the subscriber was meant to receive, where
``sent`` comes from the publisher (messages it wrote, or had acknowledged at QoS 1/2). Streams
that never delivered a single message are still counted as lost because the subscriber declares
which publishers it expects. Memory is bounded by the number of gaps, not by the message count.
"""
from __future__ import annotations

import struct
from bisect import bisect_right
from dataclasses import dataclass, field

STAMP = struct.Struct("!IIQ")
STAMP_SIZE = STAMP.size  # 16
_PAD = b"x"


def make_payload(size: int) -> bytearray:
    """A payload of ``size`` bytes (at least the stamp) with a zeroed stamp to patch later."""
    if size < STAMP_SIZE:
        raise ValueError(f"payload size must be >= {STAMP_SIZE} bytes (the stamp), got {size}")
    return bytearray(bytes(STAMP_SIZE) + _PAD * (size - STAMP_SIZE))


def stamp_into(buf: bytearray, offset: int, publisher: int, seq: int, now_ns: int) -> None:
    """Write the stamp at ``offset`` of an encoded packet (no copy of the payload)."""
    STAMP.pack_into(buf, offset, publisher, seq & 0xFFFFFFFF, now_ns)


def read_stamp(buf: bytes | bytearray | memoryview, offset: int = 0) -> tuple[int, int, int]:
    return STAMP.unpack_from(buf, offset)


@dataclass(slots=True)
class Stream:
    """What one subscriber saw of one publisher."""

    hi: int = -1
    unique: int = 0
    duplicates: int = 0
    out_of_order: int = 0
    gaps: list[list[int]] = field(default_factory=list)  # sorted, disjoint [start, end)

    def see(self, seq: int) -> None:
        hi = self.hi
        if seq == hi + 1:
            self.hi = seq
            self.unique += 1
        elif seq > hi:
            self.gaps.append([hi + 1, seq])
            self.hi = seq
            self.unique += 1
        elif self._fill(seq):
            self.out_of_order += 1
            self.unique += 1
        else:
            self.duplicates += 1

    def _fill(self, seq: int) -> bool:
        """Remove ``seq`` from the gaps; False if it was not missing (a duplicate)."""
        gaps = self.gaps
        i = bisect_right(gaps, [seq, float("inf")]) - 1
        if i < 0:
            return False
        start, end = gaps[i]
        if not start <= seq < end:
            return False
        if end - start == 1:
            del gaps[i]
        elif seq == start:
            gaps[i][0] = seq + 1
        elif seq == end - 1:
            gaps[i][1] = seq
        else:
            gaps[i][1] = seq
            gaps.insert(i + 1, [seq + 1, end])
        return True

    @property
    def missing(self) -> int:
        return sum(e - s for s, e in self.gaps)


class Tracker:
    """All streams of one subscriber (or of many: keys are (subscriber, publisher) ids)."""

    __slots__ = ("streams",)

    def __init__(self) -> None:
        self.streams: dict[tuple[int, int], Stream] = {}

    def expect(self, subscriber: int, publisher: int) -> None:
        """Declare a stream so a publisher that delivers nothing still counts as lost."""
        self.streams.setdefault((subscriber, publisher), Stream())

    def see(self, subscriber: int, publisher: int, seq: int) -> None:
        key = (subscriber, publisher)
        st = self.streams.get(key)
        if st is None:
            st = self.streams[key] = Stream()
        st.see(seq)

    def to_dict(self) -> dict:
        """Compact per-publisher totals for shipping to the parent process."""
        per_pub: dict[int, dict[str, int]] = {}
        for (_sub, pub), st in self.streams.items():
            agg = per_pub.setdefault(pub, {"streams": 0, "unique": 0, "duplicates": 0,
                                           "out_of_order": 0})
            agg["streams"] += 1
            agg["unique"] += st.unique
            agg["duplicates"] += st.duplicates
            agg["out_of_order"] += st.out_of_order
        return {str(k): v for k, v in per_pub.items()}


def merge_per_publisher(parts: list[dict]) -> dict[int, dict[str, int]]:
    out: dict[int, dict[str, int]] = {}
    for part in parts:
        for k, v in part.items():
            agg = out.setdefault(int(k), {"streams": 0, "unique": 0, "duplicates": 0,
                                          "out_of_order": 0})
            for f in agg:
                agg[f] += v[f]
    return out


def account(per_pub: dict[int, dict[str, int]], sent: dict[int, int]) -> dict[str, int]:
    """Totals over all streams: expected, received (unique), lost, duplicated, out of order.

    ``sent[p]`` is how many messages publisher p published; every stream of p expects all of them.
    A publisher that appears in ``sent`` but in no stream has no subscriber (nothing expected).
    Messages from an unknown publisher (``p`` not in ``sent``) count as unexpected.
    """
    expected = received = lost = dups = ooo = unexpected = 0
    for pub, agg in per_pub.items():
        n = sent.get(pub)
        if n is None:
            unexpected += agg["unique"] + agg["duplicates"]
            continue
        exp = n * agg["streams"]
        expected += exp
        received += agg["unique"]
        lost += max(0, exp - agg["unique"])
        dups += agg["duplicates"]
        ooo += agg["out_of_order"]
    return {"expected": expected, "received": received, "lost": lost, "duplicated": dups,
            "out_of_order": ooo, "unexpected": unexpected}
