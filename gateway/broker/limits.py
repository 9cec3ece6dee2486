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

    def would_allow(self, key: Hashable) -> bool:
        """Whether `allow(key)` would say yes now, without taking a token."""
        b = self._buckets.get(key)
        return b is None or b.wait_time() == 0.0

    def __len__(self) -> int:
        return len(self._buckets)


@dataclass
class Limits:
    """What a gateway process enforces; 0 means unlimited. Names are the config keys
    (gateway/app/config.py, `--max-connections`, ...); the reason codes are what a refused client sees
    (MQTT 5; a 3.1.1 client gets CONNACK return code 3, server unavailable)."""
    max_connections: int = 0                  # sockets at once; CONNACK 0x97 (quota exceeded) beyond it
    max_connections_per_address: int = 0      # sockets at once from one source IP; CONNACK 0x97
    connect_rate_per_address: float = 0.0     # connects/s per source IP; CONNACK 0x9F (rate exceeded)
    connect_burst_per_address: int = 20
    publish_rate_per_client: float = 0.0      # PUBLISH/s per connection; over it we stop reading it
    publish_burst_per_client: int = 1000
    max_subscriptions_per_client: int = 0     # SUBACK 0x97 / 0x80 for the ones beyond it
    max_topic_length: int = 65_535            # bytes; PUBLISH: DISCONNECT 0x90, SUBSCRIBE: SUBACK 0x8F / 0x80
    max_topic_levels: int = 0                 # '/'-separated levels; the same codes

    @classmethod
    def from_config(cls, cfg) -> "Limits":
        return cls(max_connections=int(cfg.max_connections),
                   max_connections_per_address=int(cfg.max_connections_per_address),
                   connect_rate_per_address=float(cfg.connect_rate_per_address),
                   connect_burst_per_address=int(cfg.connect_burst_per_address),
                   publish_rate_per_client=float(cfg.publish_rate_per_client),
                   publish_burst_per_client=int(cfg.publish_burst_per_client),
                   max_subscriptions_per_client=int(cfg.max_subscriptions),
                   max_topic_length=int(cfg.max_topic_length), max_topic_levels=int(cfg.max_topic_levels))

    @property
    def topic_limited(self) -> bool:
        return self.max_topic_length < 65_535 or self.max_topic_levels > 0

    def topic_violation(self, topic: str) -> tuple[str, str] | None:
        """None when the topic (or filter) is within limits, else (limit name, reason)."""
        n = len(topic.encode())
        if n > self.max_topic_length:
            return "max_topic_length", f"topic of {n} bytes exceeds the limit of {self.max_topic_length}"
        if self.max_topic_levels:
            levels = topic.count("/") + 1
            if levels > self.max_topic_levels:
                return "max_topic_levels", f"topic of {levels} levels exceeds the limit of {self.max_topic_levels}"
        return None

    def check_topic(self, topic: str) -> str | None:
        """None when the topic (or filter) is within limits, else the reason."""
        v = self.topic_violation(topic)
        return None if v is None else v[1]


# the names of the limits as counted in `ConnectionGate.hits` and exported as
# lmqtt_limit_hits_total{limit=...}
LIMIT_NAMES = ("max_connections", "open_files", "max_connections_per_address", "connect_rate_per_address",
               "publish_rate_per_client", "max_subscriptions", "max_topic_length", "max_topic_levels")


class ConnectionGate:
    """The accept-time questions (may one more connection from `address` be admitted now?) and the
    counters of every limit hit, exported on /metrics. One per gateway process."""

    # refused sockets waiting for their CONNECT (to be told why in CONNACK); beyond this many they
    # are closed at once without an answer, so a flood of refused sockets costs no memory (and, by
    # the open-files limit, fewer: see `open_files`)
    MAX_REFUSED_PENDING = 256
    # descriptors the process keeps for itself beyond the store's share: listening sockets, the
    # metrics and console server and its clients, the store link, logs (store/file_budget.py RESERVE)
    RESERVE = 64

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic,
                 log_rate: float = 20.0, log_burst: int = 100,
                 open_files: tuple[int, int] | None = None) -> None:
        """`open_files`: (the process's open-files limit, the store's share of it in this process)
        - the client sockets admitted at once are bounded by what is left (`socket_cap`), so a
        broker at its limit refuses the next client cleanly instead of failing its store's next
        open, or its accept(), with EMFILE."""
        self.limits = limits
        self.socket_cap = 0
        self.open_files = open_files
        if open_files is not None:
            limit, share = open_files
            self.MAX_REFUSED_PENDING = min(self.MAX_REFUSED_PENDING, max(8, limit // 16))
            self.socket_cap = max(1, limit - share - self.RESERVE - self.MAX_REFUSED_PENDING)
        self.current = 0
        self._clock = clock
        self._rate = (KeyedRateLimiter(limits.connect_rate_per_address, limits.connect_burst_per_address,
                                       clock=clock) if limits.connect_rate_per_address else None)
        self._per_address: dict[str, int] | None = {} if limits.max_connections_per_address else None
        self.hits: dict[str, int] = dict.fromkeys(LIMIT_NAMES, 0)
        self.refused_pending = 0
        # refusal log lines: at most `log_rate`/s (burst `log_burst`); the next line says how many
        # were left out, so a flood of refused connects cannot flood the log
        self._log_bucket = TokenBucket(log_rate, log_burst, clock)
        self._log_suppressed = 0

    @property
    def counts_addresses(self) -> bool:
        """Whether `release` needs the address `admit` was given (max_connections_per_address set)."""
        return self._per_address is not None

    @property
    def refused_full(self) -> int:
        return self.hits["max_connections"]

    def admit(self, address: str) -> tuple[int, str | None]:
        """(0, None) to admit (and count it: call `release(address)` when it closes), else the
        MQTT 5 CONNACK reason code to refuse with and the name of the limit."""
        lim = self.limits
        if self._rate is not None and not self._rate.allow(address):
            self.hits["connect_rate_per_address"] += 1
            return 0x9F, "connect_rate_per_address"
        if lim.max_connections and self.current >= lim.max_connections:
            self.hits["max_connections"] += 1
            return 0x97, "max_connections"
        if self.socket_cap and self.current >= self.socket_cap:
            self.hits["open_files"] += 1
            return 0x97, "open_files"
        per = self._per_address
        if per is not None:
            n = per.get(address, 0)
            if n >= lim.max_connections_per_address:
                self.hits["max_connections_per_address"] += 1
                return 0x97, "max_connections_per_address"
            per[address] = n + 1
        self.current += 1
        return 0, None

    def over_connect_rate(self, address: str) -> bool:
        """True when a connection from `address` now would be refused for its connect rate: a TLS
        listener then closes it before the handshake (the CPU a rate limit is there to save),
        counted as a connect-rate refusal. No token is taken: `admit` takes it."""
        if self._rate is None or self._rate.would_allow(address):
            return False
        self.hits["connect_rate_per_address"] += 1
        return True

    def release(self, address: str | None = None) -> None:
        self.current = max(0, self.current - 1)
        per = self._per_address
        if per is not None and address is not None:
            n = per.get(address, 0) - 1
            if n > 0:
                per[address] = n
            else:
                per.pop(address, None)

    def connections_from(self, address: str) -> int:
        return self._per_address.get(address, 0) if self._per_address is not None else 0

    def log_allowed(self) -> int | None:
        """None when this refusal's log line is to be left out (over the log rate), else how many
        were left out before it (0 normally)."""
        if not self._log_bucket.take():
            self._log_suppressed += 1
            return None
        n, self._log_suppressed = self._log_suppressed, 0
        return n

    def publish_limiter(self, clock: Callable[[], float] | None = None) -> TokenBucket | None:
        """A fresh per-client publish bucket, or None when publishing is not rate limited."""
        lim = self.limits
        if not lim.publish_rate_per_client:
            return None
        return TokenBucket(lim.publish_rate_per_client, lim.publish_burst_per_client, clock or self._clock)
