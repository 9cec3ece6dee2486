"""HDR-style latency histogram: log-linear buckets, bounded relative error, mergeable.

Why not keep every sample: a fan-out run delivers millions of messages per second spread over
several worker processes; the parent needs exact counts and percentiles with a known error, and
each worker must ship its histogram through a pipe. A log-linear histogram (as in HdrHistogram)
keeps ``2**(precision_bits-1)`` linear sub-buckets per power of two, so memory is O(log(max))
and every recorded value is known to within a relative error of ``2**-(precision_bits-1)``
(bucket width / bucket lower bound). Reported values are bucket midpoints, which halves that:
``relative_error == 2**-precision_bits`` (1/256 ≈ 0.4 % with the default 8 bits).

Layout, with ``S = 2**precision_bits``:

* values ``0 .. S-1`` have one bucket each (exact);
* a value ``v >= S`` has ``shift = v.bit_length() - precision_bits`` and
  ``mantissa = v >> shift`` in ``[S/2, S)``; its bucket index is
  ``S + (shift - 1) * S/2 + (mantissa - S/2)`` and covers ``[mantissa << shift, (mantissa+1) << shift)``.

Values are plain non-negative integers (the load generator records nanoseconds).
"""
from __future__ import annotations

from typing import Iterable

PERCENTILES = (50.0, 90.0, 99.0, 99.9)


class Histogram:
    """Counts of non-negative integer values in log-linear buckets.

    ``record`` is the hot path (one call per delivered message) so it avoids attribute look-ups
    beyond what is needed and grows the count list only when a larger value arrives.
    """

    __slots__ = ("bits", "_s", "_half", "counts", "total", "min", "max", "sum")

    def __init__(self, precision_bits: int = 8) -> None:
        if not 2 <= precision_bits <= 16:
            raise ValueError(f"precision_bits must be in 2..16, got {precision_bits}")
        self.bits = precision_bits
        self._s = 1 << precision_bits
        self._half = self._s >> 1
        self.counts: list[int] = [0] * self._s
        self.total = 0
        self.min: int | None = None
        self.max: int | None = None
        self.sum = 0

    @property
    def relative_error(self) -> float:
        """Upper bound of |reported - true| / true for any percentile value."""
        return 2.0 ** -self.bits

    # -- index maths -----------------------------------------------------------------------
    def index_of(self, value: int) -> int:
        if value < self._s:
            return value
        shift = value.bit_length() - self.bits
        return self._s + (shift - 1) * self._half + ((value >> shift) - self._half)

    def bucket_bounds(self, index: int) -> tuple[int, int]:
        """[low, high) of the values that fall into bucket ``index``."""
        if index < self._s:
            return index, index + 1
        shift = (index - self._s) // self._half + 1
        mantissa = (index - self._s) % self._half + self._half
        return mantissa << shift, (mantissa + 1) << shift

    def bucket_value(self, index: int) -> int:
        """The value reported for a bucket: its midpoint (exact for the linear range)."""
        low, high = self.bucket_bounds(index)
        return low if high - low == 1 else (low + high - 1) // 2

    # -- recording -------------------------------------------------------------------------
    def record(self, value: int, count: int = 1) -> None:
        if value < 0:
            raise ValueError(f"histogram values must be >= 0, got {value}")
        if value < self._s:
            idx = value
        else:
            shift = value.bit_length() - self.bits
            idx = self._s + (shift - 1) * self._half + ((value >> shift) - self._half)
        counts = self.counts
        if idx >= len(counts):
            counts.extend([0] * (idx + 1 - len(counts)))
        counts[idx] += count
        self.total += count
        self.sum += value * count
        if self.min is None or value < self.min:
            self.min = value
        if self.max is None or value > self.max:
            self.max = value

    def record_many(self, values: Iterable[int]) -> None:
        """Record a batch (the receive loop collects one batch per socket read)."""
        s, bits, half = self._s, self.bits, self._half
        counts = self.counts
        n = 0
        total = 0
        lo = self.min
        hi = self.max
        for v in values:
            if v < 0:
                v = 0  # clock skew cannot happen on one host with CLOCK_MONOTONIC; be safe
            if v < s:
                idx = v
            else:
                shift = v.bit_length() - bits
                idx = s + (shift - 1) * half + ((v >> shift) - half)
            if idx >= len(counts):
                counts.extend([0] * (idx + 1 - len(counts)))
            counts[idx] += 1
            n += 1
            total += v
            if lo is None or v < lo:
                lo = v
            if hi is None or v > hi:
                hi = v
        self.total += n
        self.sum += total
        self.min, self.max = lo, hi

    def merge(self, other: "Histogram") -> "Histogram":
        if other.bits != self.bits:
            raise ValueError(f"cannot merge histograms of {other.bits} and {self.bits} bits")
        if len(other.counts) > len(self.counts):
            self.counts.extend([0] * (len(other.counts) - len(self.counts)))
        for i, c in enumerate(other.counts):
            if c:
                self.counts[i] += c
        self.total += other.total
        self.sum += other.sum
        if other.min is not None and (self.min is None or other.min < self.min):
            self.min = other.min
        if other.max is not None and (self.max is None or other.max > self.max):
            self.max = other.max
        return self

    # -- queries ---------------------------------------------------------------------------
    def percentile(self, pct: float) -> int | None:
        """Smallest recorded bucket value v such that at least pct% of values are <= v.

        The first and last ranks return the exact min / max; others are clamped into [min, max].
        """
        if not self.total:
            return None
        if not 0.0 <= pct <= 100.0:
            raise ValueError(f"percentile must be in [0, 100], got {pct}")
        # rank of the wanted value (1-based); ceil without float surprises at 100 %
        rank = max(1, -(-int(round(pct * self.total * 1000)) // 100000))
        if rank >= self.total:
            return self.max
        if rank == 1:
            return self.min
        seen = 0
        for i, c in enumerate(self.counts):
            if c:
                seen += c
                if seen >= rank:
                    v = self.bucket_value(i)
                    return min(max(v, self.min), self.max)  # type: ignore[type-var]
        return self.max

    def mean(self) -> float | None:
        return self.sum / self.total if self.total else None

    def summary(self, scale: float = 1.0) -> dict[str, float | int | None]:
        """p50/p90/p99/p99.9/max/min/mean divided by ``scale`` (1e3 turns ns into µs)."""
        out: dict[str, float | int | None] = {"count": self.total}

        def sc(v: float | int | None) -> float | None:
            return None if v is None else round(v / scale, 3)

        for p in PERCENTILES:
            out[f"p{p:g}"] = sc(self.percentile(p))
        out["max"] = sc(self.max)
        out["min"] = sc(self.min)
        out["mean"] = sc(self.mean())
        return out

    # -- transport between processes -------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "bits": self.bits,
            "counts": {str(i): c for i, c in enumerate(self.counts) if c},
            "total": self.total, "sum": self.sum, "min": self.min, "max": self.max,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Histogram":
        h = cls(int(d["bits"]))
        idx = {int(k): int(v) for k, v in d["counts"].items()}
        if idx:
            top = max(idx)
            if top >= len(h.counts):
                h.counts.extend([0] * (top + 1 - len(h.counts)))
            for i, c in idx.items():
                h.counts[i] = c
        h.total, h.sum, h.min, h.max = int(d["total"]), int(d["sum"]), d["min"], d["max"]
        return h

    def cdf_points(self) -> list[tuple[int, float]]:
        """(value, cumulative fraction) per non-empty bucket, for plots."""
        pts: list[tuple[int, float]] = []
        seen = 0
        for i, c in enumerate(self.counts):
            if c:
                seen += c
                pts.append((self.bucket_value(i), seen / self.total))
        return pts
