"""How much one connection's socket may queue before delivery stops writing to it.

Every connection starts with the transport's marks at `write_high_water` / `write_low_water`
(1 MiB / 256 KiB): above the high mark the connection is `write_blocked`, delivery stops reading
the store for it, and its messages wait there (docs/gateway.md "Back-pressure"). That bound is
right for a client that reads slowly: the gateway holds little of its data. It is wrong for a
client that reads fast but is handed more than the mark in one burst. A loop turn that reads 100
publishers' sockets (up to 256 KiB each) and appends what they sent writes the one wildcard
subscriber megabytes at once; its socket fills, delivery stops for it until the socket drains
below the low mark (0.2-0.8 s), and meanwhile the publishers' messages keep coming, so a QoS 0
subscriber falls more than `max_qos0_backlog` behind and skips messages it could have taken.
Measured (`lmqtt bench external`, 100 `mosquitto_pub` x 20,000 into one `mosquitto_sub`):
74-86 % delivered with every connection at 1 MiB, 95-100 % with this growth, at a lower cost per
message (the broker's time went to deliveries instead of to publishes it would skip).

So a connection's marks grow while its client drains them fast: each time the transport resumes
writing after a pause, if the client took what the pause held at `GROW_MIN_RATE` or more, its high
mark becomes `write_high_water_max` (16 MiB; the low mark keeps its ratio to the high one); a client
that drained slower goes back to the base marks. Straight to the ceiling, not step by step: each
pause at the base marks is a burst the subscriber may skip, and doubling (four pauses to 16 MiB)
delivered 89.9 %. The growth of all connections together stays within `write_buffers_max`
(64 MiB): a fan-out burst to thousands of fast readers cannot turn into gigabytes of socket
buffers. A client that never reads never resumes: it never grows.
"""
from __future__ import annotations

from typing import Any

# bytes per second a client drained its socket at, over a pause, for its buffer to grow
GROW_MIN_RATE = 512 << 10


class WriteBuffers:
    """The write-buffer marks of a gateway's connections: `paused` / `resumed` from the
    connection's `pause_writing` / `resume_writing`, `release` when it closes or parks. A
    connection keeps its grown high mark in `conn.write_high` (0: the base) and the time it was
    paused in `conn.write_paused_at` (None when it is not)."""

    def __init__(self, base_high: int, base_low: int, ceiling: int, budget: int) -> None:
        self.base_high = base_high
        self.base_low = base_low
        self.ceiling = ceiling
        self.budget = budget
        self.grown = 0            # bytes above base_high, all connections' marks together
        self.grows = 0            # times a connection's mark grew (/metrics)

    def paused(self, conn: Any, now: float) -> None:
        conn.write_paused_at = now

    def resumed(self, conn: Any, now: float) -> None:
        """The transport drained below the low mark: grow the marks of a client that drained fast,
        back to the base for one that did not."""
        high = conn.write_high or self.base_high
        at = conn.write_paused_at
        secs = now - at if at is not None else 0.0
        conn.write_paused_at = None        # the default again: an idle connection keeps no rare fields
        drained = high - high * self.base_low // self.base_high
        if secs <= 0 or drained >= GROW_MIN_RATE * secs:
            want = min(self.ceiling, high + self.budget - self.grown)
        else:
            want = self.base_high
        if want > high:
            self.grows += 1
        if want != high and want >= self.base_high:
            self._set(conn, high, want)

    def release(self, conn: Any) -> None:
        """The connection closes or leaves the loop (parked): its growth goes back to the budget."""
        high = conn.write_high
        if high:
            self.grown -= high - self.base_high
            conn.write_high = 0

    def _set(self, conn: Any, old: int, new: int) -> None:
        t = conn.transport
        if t is None:
            return
        self.grown += new - old
        conn.write_high = 0 if new == self.base_high else new
        t.set_write_buffer_limits(high=new, low=new * self.base_low // self.base_high)


class WriteBufferMetrics:
    """/metrics: lmqtt_write_buffer_growth_bytes (what the connections' grown marks hold above the
    base, together) and lmqtt_write_buffer_grows_total (times a connection's mark grew)."""

    def __init__(self, buffers: WriteBuffers) -> None:
        self.buffers = buffers

    def describe(self):
        return []

    def collect(self):
        # only with the metrics port open (a scrape calls this)
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        yield GaugeMetricFamily("lmqtt_write_buffer_growth_bytes",
                                "Bytes the connections' grown write-buffer marks allow above write_high_water, together",
                                value=self.buffers.grown)
        yield CounterMetricFamily("lmqtt_write_buffer_grows",
                                  "Times a connection's write-buffer mark grew (its client drained it fast)",
                                  value=self.buffers.grows)
