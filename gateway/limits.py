"""Limits that protect the broker from its clients: rates per client and per source address, caps
on counts. Pure bookkeeping with an injectable clock (no I/O), so the connection code asks one
question per event and tests need no sleeping.

Why token buckets: a device may burst (reconnect storms, a backlog flush) but not sustain more than
its rate; `burst` sizes the allowance. Per-address state is kept for at most `max_tracked`
addresses (least recently seen evicted), so a flood of spoofed or rotating addresses cannot grow
memory.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable


class TokenBucket:
    """`rate` tokens per second up to `burst`; `take()` is True when a token was available."""

    __slots__ = ("rate", "burst", "tokens", "stamp", "_clock")

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"a token bucket needs rate > 0 and burst >= 1, got {rate}, {burst}")
        self.rate, self.burst = float(rate), float(burst)
        self._clock = clock
        self.tokens = float(burst)
        self.stamp = clock()

    def take(self, n: float = 1.0) -> bool:
        now = self._clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False

    def wait_time(self, n: float = 1.0) -> float:
        """Seconds until `n` tokens are available (0 when they are now)."""
        now = self._clock()
        tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        return max(0.0, (n - tokens) / self.rate)


class KeyedRateLimiter:
    """One token bucket per key (a source address, a client id), bounded in the number of keys."""

    def __init__(self, rate: float, burst: float, max_tracked: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        TokenBucket(rate, burst, clock)               # validate once
        self.rate, self.burst, self.max_tracked = rate, burst, max_tracked
        self._clock = clock
        self._buckets: OrderedDict[Hashable, TokenBucket] = OrderedDict()
        self.refused = 0

    def allow(self, key: Hashable) -> bool:
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = TokenBucket(self.rate, self.burst, self._clock)
            if len(self._buckets) > self.max_tracked:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        ok = b.take()
        if not ok:
            self.refused += 1
        return ok

    def __len__(self) -> int:
        return len(self._buckets)


@dataclass
class Limits:
    """What a listener enforces; 0 means unlimited. Names are the config keys (`--max-connections`,
    ...); the reason codes are what a refused client sees (MQTT 5)."""
    max_connections: int = 0                  # CONNACK 0x97 (quota exceeded) beyond it
    connect_rate_per_address: float = 0.0     # connects/s per source IP; CONNACK 0x9F (rate exceeded)
    connect_burst_per_address: int = 20
    publish_rate_per_client: float = 0.0      # PUBLISH/s per client; DISCONNECT 0x96 (rate too high)
    publish_burst_per_client: int = 1000
    max_subscriptions_per_client: int = 0     # SUBACK 0x97 for the ones beyond it
    max_topic_length: int = 65_535            # bytes; PUBLISH 0x90 / SUBACK 0x8F beyond it
    max_topic_levels: int = 128
    max_queued_per_session: int = 0           # an offline session's backlog; older QoS 0/1 dropped, counted

    def check_topic(self, topic: str) -> str | None:
        """None when the topic (or filter) is within limits, else the reason."""
        n = len(topic.encode())
        if n > self.max_topic_length:
            return f"topic of {n} bytes exceeds the limit of {self.max_topic_length}"
        levels = topic.count("/") + 1
        if levels > self.max_topic_levels:
            return f"topic of {levels} levels exceeds the limit of {self.max_topic_levels}"
        return None


class ConnectionGate:
    """The accept-time questions: may one more connection from `address` be admitted now?"""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.current = 0
        self._rate = (KeyedRateLimiter(limits.connect_rate_per_address, limits.connect_burst_per_address,
                                       clock=clock) if limits.connect_rate_per_address else None)
        self.refused_full = 0

    def admit(self, address: str) -> int:
        """0 to admit (and count it), else the MQTT 5 CONNACK reason code to refuse with."""
        if self.limits.max_connections and self.current >= self.limits.max_connections:
            self.refused_full += 1
            return 0x97
        if self._rate is not None and not self._rate.allow(address):
            return 0x9F
        self.current += 1
        return 0

    def release(self) -> None:
        self.current = max(0, self.current - 1)

    def publish_limiter(self, clock: Callable[[], float] = time.monotonic) -> TokenBucket | None:
        """A fresh per-client publish bucket, or None when publishing is not rate limited."""
        lim = self.limits
        if not lim.publish_rate_per_client:
            return None
        return TokenBucket(lim.publish_rate_per_client, lim.publish_burst_per_client, clock)
