"""Prometheus metrics of one gateway process.

Why a private registry: tests and `lmqtt serve` may build several gateways in one interpreter;
a registry per gateway keeps their counters apart and makes `/metrics` show only this process'
gateway.

Why plain ints for the per-message counters: profiling the 1 -> 100 fan-out (cProfile) showed prometheus_client's
`Counter.inc` (a lock + a float add, ~13 us) at ~12% of server CPU when called per delivered
message. Messages/bytes/pulls/notify counters are therefore plain Python ints bumped on the
event-loop thread (`m.msg_out[qos] += 1`) and turned into Prometheus counters only when /metrics
is scraped (`_HotCounters.collect`).
"""
from __future__ import annotations

import threading
import time
from bisect import bisect_left, bisect_right
from http.server import ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import MetricsHandler

from lmqtt.gateway.session.messages import EXPIRED

_LAT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class FastHistogram:
    """A Prometheus histogram for per-message observations, as plain ints on the event loop.

    `prometheus_client.Histogram.observe` takes a lock and updates two float values (~25 us under
    cProfile per delivered message in `lmqtt bench compare`); this one is a bisect and two adds, exported as a normal histogram (`_bucket`,
    `_sum`, `_count`) when /metrics is scraped. Only the event-loop thread may call `observe`.
    """

    def __init__(self, name: str, doc: str, buckets) -> None:
        self.name = name
        self.doc = doc
        self.bounds = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)   # last slot: above the highest bound (+Inf)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1
        self.sum += v

    def observe_many(self, values) -> None:
        counts, bounds = self.counts, self.bounds
        s = 0.0
        for v in values:
            counts[bisect_left(bounds, v)] += 1
            s += v
        self.sum += s

    def metric(self) -> HistogramMetricFamily:
        acc = 0
        buckets = []
        counts = list(self.counts)
        for b, c in zip(self.bounds, counts):
            acc += c
            buckets.append((_fmt(b), acc))
        acc += counts[-1]
        buckets.append(("+Inf", acc))
        return HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=self.sum)


_FEW = 4      # LagHistogram.observe_store_times: batches up to this size are observed one by one


class LagHistogram(FastHistogram):
    """Dispatch lag: a message's store time to its first send, for messages stored while this
    gateway runs. A message stored before its start (a persistent session's messages kept over a
    restart or a kill -9, the records replayed after a recovery) waited for the gateway, not in the
    dispatch: its age would be the outage (minutes on the console's chart), so it is not observed.
    A lag longer than the gateway's uptime is exactly such a message."""

    def __init__(self, name: str, doc: str, buckets) -> None:
        super().__init__(name, doc, buckets)
        self.started = time.time()

    def observe(self, v: float) -> None:
        if v <= time.time() - self.started:
            super().observe(v)

    def observe_many(self, values) -> None:
        up = time.time() - self.started
        super().observe_many([v for v in values if v <= up])

    def observe_store_times(self, store_ts: list, now_ms: float) -> None:
        """`observe_many` of each message's lag, `now_ms` less its store time in ms (a lag below 0,
        a clock step, counts as 0), without a value per message: the store times sorted (one C
        pass: a queue's are in order already), each bucket is a bisect of its bound's store time,
        the sum one subtraction. Why: a subscriber taking 100,000 messages a second paid a float,
        a division and a bisect for each, ~3 % of a loaded broker's loop. A batch of a few messages
        (one per loop turn at a few thousand a second) is cheaper observed one by one: the walk over
        the ~17 bounds cost it a bisect per bound."""
        if len(store_ts) <= _FEW:
            self.observe_many([max(0.0, (now_ms - t) / 1000.0) for t in store_ts])
            return
        ts = sorted(store_ts)
        n = len(ts)
        lo = bisect_left(ts, now_ms - (time.time() - self.started) * 1000.0)   # older than the start: not lag
        if lo >= n:
            return
        counts = self.counts
        prev = n
        for i, b in enumerate(self.bounds):
            # lag <= b  <=>  store time >= now - b: the messages from `at` on are in this bucket or a lower one
            at = bisect_left(ts, now_ms - b * 1000.0, lo)
            counts[i] += prev - at
            prev = at
        counts[-1] += prev - lo
        past = bisect_right(ts, now_ms, lo)        # stored "after" now: lag 0, nothing to the sum
        if past > lo:
            base = ts[lo]       # sums taken from the oldest: no cancellation between epoch-sized values
            k = past - lo
            self.sum += (k * (now_ms - base) - (sum(ts[lo:past]) - k * base)) / 1000.0


def _fmt(b: float) -> str:
    return repr(b) if b != int(b) else f"{b:.1f}"


class _HotCounters:
    """Exports GatewayMetrics' plain-int counters as Prometheus counters."""

    def __init__(self, metrics: "GatewayMetrics") -> None:
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        m = self.metrics
        yield GaugeMetricFamily("lmqtt_connections", "Open MQTT connections (after CONNECT)", value=m.connections)
        for name, doc, vals in (("lmqtt_messages_in", "PUBLISH packets received from clients", m.msg_in),
                                ("lmqtt_messages_out", "PUBLISH packets sent to clients", m.msg_out)):
            c = CounterMetricFamily(name, doc, labels=["qos"])
            for q in range(3):
                c.add_metric([str(q)], vals[q])
            yield c
        for name, doc, v in (
                ("lmqtt_connects", "CONNECT packets accepted", m.connects),
                ("lmqtt_bytes_in", "Bytes read from client sockets", m.bytes_in),
                ("lmqtt_bytes_out", "Bytes written to client sockets", m.bytes_out),
                ("lmqtt_lightqueue_pulls", "Light-queue pull calls (shared by sessions at one offset)", m.pulls),
                ("lmqtt_notify_events", "Merged queue-event sets received from notify", m.notify_events),
                ("lmqtt_notify_queue_names", "Queue names received from notify (after merging)", m.notify_queues),
                ("lmqtt_session_record_writes", "Persistent session records written to the store (CONNECT of a "
                 "present session, a SUBSCRIBE that changes one, disconnect, QoS 2 exchanges)",
                 m.session_record_writes),
                ("lmqtt_session_offset_writes", "Persistent sessions' committed offsets written to the store "
                 "(a new subscription's start, moved offsets at the flush timer or at disconnect)",
                 m.session_offset_writes)):
            yield CounterMetricFamily(name, doc, value=v)
        for h in m.fast_histograms:
            yield h.metric()


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        # open connections (after CONNECT) and CONNECTs accepted: plain ints (a reconnect storm's every
        # CONNECT and close changed them through prometheus_client's lock: ~2 % of its CPU),
        # exported by _HotCounters as the gauge lmqtt_connections and the counter lmqtt_connects
        self.connections = 0
        self.connects = 0
        self.sessions = Gauge("lmqtt_sessions", "Sessions known to this gateway (online + offline persistent)", registry=r)
        self.sessions_dormant = Gauge("lmqtt_sessions_dormant", "Persistent sessions restored at start whose client "
                                      "has not come back yet (their filters held; built when it connects)", registry=r)
        self.connect_refused = Counter("lmqtt_connect_refused", "CONNECT refused", ["reason"], registry=r)
        # hot counters: plain ints, exported by _HotCounters at scrape time
        self.msg_in = [0, 0, 0]
        self.msg_out = [0, 0, 0]
        self.bytes_in = 0
        self.bytes_out = 0
        self.pulls = 0
        self.notify_events = 0
        self.notify_queues = 0
        self.session_record_writes = 0     # persistent session records written (SessionPersistence)
        self.session_offset_writes = 0     # and their committed offsets
        r.register(_HotCounters(self))
        d = Counter("lmqtt_dropped_messages", "Messages not delivered", ["reason"], registry=r)
        self.dropped_qos0_backpressure = d.labels(reason="qos0_backpressure")
        self.dropped_store_error = d.labels(reason="store_error")
        # MQTT 5: message expiry passed before delivery / over the client's Maximum Packet Size
        self.dropped_expired = d.labels(reason="expired")
        self.dropped_too_large = d.labels(reason="packet_too_large")
        # a session back from offline further behind than max_offline_backlog: the older ones skipped
        self.dropped_offline_backlog = d.labels(reason="offline_backlog")
        self.protocol_errors = Counter("lmqtt_protocol_errors", "Connections closed for a protocol error", registry=r)
        # per-message / per-batch histograms: FastHistogram (plain ints), exported by _HotCounters
        self.append_latency = FastHistogram("lmqtt_store_append_seconds", "Time of one store append_batch call",
                                            _LAT_BUCKETS)
        self.append_batch_size = FastHistogram("lmqtt_store_append_batch_messages", "Messages per append_batch",
                                               (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
        self.flush_latency = FastHistogram("lmqtt_store_durable_seconds",
                                           "Append to durable (flush-mode ack) for QoS 1/2 publishes",
                                           _LAT_BUCKETS)
        self.dispatch_lag = LagHistogram("lmqtt_dispatch_lag_seconds",
                                         "Store timestamp of a message to its first send by this gateway "
                                         "(messages stored since the gateway started)", _LAT_BUCKETS)
        self.fast_histograms = [self.append_latency, self.append_batch_size, self.flush_latency,
                                self.dispatch_lag]
        self.inflight = Gauge("lmqtt_inflight_messages", "Outbound QoS 1/2 messages awaiting the client's ack", registry=r)
        self.paused_sessions = Gauge("lmqtt_backpressured_connections", "Connections above the write high-water mark", registry=r)
        # idle connections whose socket is parked off the event loop (gateway/net/parking.py); counted in lmqtt_connections too
        self.connections_parked = Gauge("lmqtt_connections_parked", "Connected clients parked while idle", registry=r)
        self._http: ThreadingHTTPServer | None = None

    # the session machine's `Tally` (gateway/session/outbound.py): what it sent and dropped
    def dropped(self, why: int) -> None:
        """A message not sent to a client: EXPIRED (1) or TOO_LARGE (2, its Maximum Packet Size)."""
        (self.dropped_expired if why == EXPIRED else self.dropped_too_large).inc()

    def first_sent(self, store_ts: list[int]) -> None:
        """Messages sent for the first time by this gateway, by store time: the dispatch lag."""
        self.dispatch_lag.observe_store_times(store_ts, time.time() * 1000.0)

    def start_http(self, host: str, port: int) -> tuple[str, int]:
        """Serve /metrics (Prometheus text) on a daemon thread; returns the bound address."""
        registry = self.registry
        handler = MetricsHandler.factory(registry)
        srv = ThreadingHTTPServer((host, port), handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, name="lmqtt-metrics", daemon=True).start()
        self._http = srv
        return srv.server_address[0], srv.server_address[1]

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
