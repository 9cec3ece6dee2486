"""The load generator's latency histogram: percentiles within the stated error, exact merge."""
from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest

from lmqtt.loadtest.histogram import Histogram


def exact_percentile(sorted_vals: list[int], pct: float) -> int:
    rank = max(1, math.ceil(Fraction(str(pct)) / 100 * len(sorted_vals)))  # exact, no float
    return sorted_vals[rank - 1]


def latency_like(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    # ns latencies from ~10 µs to seconds, heavy tail, plus exact small values
    vals = [int(rnd.lognormvariate(math.log(300_000), 1.5)) for _ in range(n)]
    vals += [rnd.randrange(0, 300) for _ in range(n // 10)]
    return vals


@pytest.mark.parametrize("bits", [5, 8, 11])
def test_percentiles_are_within_stated_relative_error(bits):
    vals = latency_like(20_000, seed=bits)
    h = Histogram(bits)
    for v in vals:
        h.record(v)
    s = sorted(vals)
    for pct in (0, 1, 10, 50, 90, 99, 99.9, 99.99, 100):
        want = exact_percentile(s, pct)
        got = h.percentile(pct)
        assert abs(got - want) <= want * h.relative_error, (pct, got, want)
    assert h.percentile(100) == max(vals) and h.percentile(0) == min(vals)
    assert h.total == len(vals) and h.sum == sum(vals)


def test_record_many_equals_record():
    vals = latency_like(5_000, seed=3)
    a, b = Histogram(), Histogram()
    for v in vals:
        a.record(v)
    b.record_many(vals)
    assert a.to_dict() == b.to_dict()


def test_small_values_are_exact():
    h = Histogram(8)
    for v in [0, 1, 2, 200, 255]:
        h.record(v)
    assert [h.percentile(p) for p in (20, 40, 60, 80, 100)] == [0, 1, 2, 200, 255]


def test_buckets_tile_the_number_line():
    h = Histogram(6)
    prev_high = 0
    for i in range(2000):
        low, high = h.bucket_bounds(i)
        assert low == prev_high and high > low
        assert h.index_of(low) == i and h.index_of(high - 1) == i
        assert (high - low) / max(low, 1) <= 2 * h.relative_error or high - low == 1
        prev_high = high


def test_merge_is_the_same_as_recording_everything_in_one():
    vals = latency_like(12_000, seed=7)
    parts = [Histogram() for _ in range(3)]
    for i, v in enumerate(vals):
        parts[i % 3].record(v)
    whole = Histogram()
    whole.record_many(vals)
    merged = Histogram()
    for p in parts:  # through the wire format, as worker processes ship them
        merged.merge(Histogram.from_dict(p.to_dict()))
    assert merged.to_dict() == whole.to_dict()
    assert merged.summary(1e3) == whole.summary(1e3)


def test_merge_rejects_different_precision_and_negative_values():
    with pytest.raises(ValueError):
        Histogram(8).merge(Histogram(9))
    with pytest.raises(ValueError):
        Histogram().record(-1)


def test_empty_histogram_reports_none():
    s = Histogram().summary()
    assert s["count"] == 0 and s["p99"] is None and s["max"] is None
