"""Broker-protecting limits (gateway/broker/limits.py) with a controllable clock."""
from __future__ import annotations

import pytest

from lmqtt.gateway.broker.limits import ConnectionGate, KeyedRateLimiter, Limits, TokenBucket


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_token_bucket_allows_a_burst_then_the_rate():
    c = Clock()
    b = TokenBucket(rate=10, burst=5, clock=c)
    assert [b.take() for _ in range(6)] == [True] * 5 + [False]
    assert b.wait_time() == pytest.approx(0.1)
    c.t += 0.25                                   # 2.5 tokens back
    assert [b.take() for _ in range(3)] == [True, True, False]
    c.t += 100                                    # never more than the burst
    assert sum(b.take() for _ in range(10)) == 5
    with pytest.raises(ValueError):
        TokenBucket(0, 1)


def test_keyed_limiter_is_per_key_and_bounded_in_memory():
    c = Clock()
    k = KeyedRateLimiter(rate=1, burst=2, max_tracked=1000, clock=c)
    assert [k.allow("10.0.0.1") for _ in range(3)] == [True, True, False]
    assert k.allow("10.0.0.2")                    # another address has its own bucket
    for i in range(5000):
        k.allow(f"spoofed-{i}")
    assert len(k) == 1000 and k.refused == 1


def test_connection_gate_reason_codes():
    c = Clock()
    g = ConnectionGate(Limits(max_connections=3, connect_rate_per_address=1, connect_burst_per_address=2), c)
    assert [g.admit("a"), g.admit("a"), g.admit("a")] == [(0, None), (0, None), (0x9F, "connect_rate_per_address")]
    assert g.admit("b") == (0, None)
    assert g.admit("c") == (0x97, "max_connections")                      # full
    g.release("a")
    assert g.admit("c") == (0, None)
    assert g.hits["max_connections"] == 1 and g.hits["connect_rate_per_address"] == 1
    assert ConnectionGate(Limits()).publish_limiter() is None
    assert ConnectionGate(Limits(publish_rate_per_client=5)).publish_limiter().burst == 1000


def test_connections_per_address_are_counted_and_released():
    g = ConnectionGate(Limits(max_connections_per_address=2))
    assert [g.admit("10.0.0.1")[0] for _ in range(3)] == [0, 0, 0x97]
    assert g.admit("10.0.0.1") == (0x97, "max_connections_per_address")
    assert g.admit("10.0.0.2") == (0, None)                       # another address is not affected
    assert g.connections_from("10.0.0.1") == 2 and g.current == 3
    g.release("10.0.0.1")
    assert g.admit("10.0.0.1") == (0, None)
    for _ in range(5):                                             # released down to nothing: no entry kept
        g.release("10.0.0.2")
    assert g.connections_from("10.0.0.2") == 0 and "10.0.0.2" not in g._per_address
    assert g.hits["max_connections_per_address"] == 2


def test_unlimited_gate_admits_everything_and_counts_nothing():
    g = ConnectionGate(Limits())
    assert all(g.admit(f"10.0.{i % 3}.1") == (0, None) for i in range(10_000))
    assert g.current == 10_000 and not any(g.hits.values()) and g._per_address is None


def test_refusal_log_lines_are_rate_limited_and_say_how_many_were_left_out():
    c = Clock()
    g = ConnectionGate(Limits(), clock=c, log_rate=1, log_burst=3)
    assert [g.log_allowed() for _ in range(5)] == [0, 0, 0, None, None]
    c.t += 1.0
    assert g.log_allowed() == 2                                   # the next line carries suppressed=2
    assert g.log_allowed() is None


def test_topic_limits_name_the_reason():
    lim = Limits(max_topic_length=10, max_topic_levels=3)
    assert lim.check_topic("a/b/c") is None
    assert "exceeds the limit of 10" in lim.check_topic("a" * 11)
    assert "4 levels exceeds the limit of 3" in lim.check_topic("a/b/c/d")


def test_topic_violation_names_the_limit_and_zero_levels_is_unlimited():
    lim = Limits()
    assert not lim.topic_limited and lim.topic_violation("a/" * 500 + "b") is None
    lim = Limits(max_topic_length=10, max_topic_levels=3)
    assert lim.topic_limited
    assert lim.topic_violation("a/b/c") is None
    assert lim.topic_violation("a/b/c/d") == ("max_topic_levels", "topic of 4 levels exceeds the limit of 3")
    assert lim.topic_violation("é" * 6)[0] == "max_topic_length"          # bytes, not characters


def test_over_connect_rate_peeks_without_taking_a_token():
    c = Clock()
    g = ConnectionGate(Limits(connect_rate_per_address=1, connect_burst_per_address=2), c)
    assert not g.over_connect_rate("a")                           # never seen: fine
    assert g.admit("a") == (0, None) and not g.over_connect_rate("a")
    assert g.admit("a") == (0, None)                              # the peek took nothing: 2 admitted
    assert g.over_connect_rate("a") and g.hits["connect_rate_per_address"] == 1
    c.t += 1.0
    assert not g.over_connect_rate("a") and g.admit("a") == (0, None)
    assert not ConnectionGate(Limits()).over_connect_rate("a")   # no rate limit: never
