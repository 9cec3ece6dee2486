"""Memory of idle MQTT connections on a real `lmqtt serve`.

The figure is what tracemalloc sees the broker keep per connection after CONNECT + SUBSCRIBE to a
topic of its own (loadtest/conn_profile.py: the same profile the bench section of BENCHMARKS.md
shows): Python objects and uvloop's transport, not the kernel's socket buffers."""
from __future__ import annotations

from lmqtt.gateway.storage.record_props import RecordMeta
from lmqtt.gateway.session import NO_ALIASES, MqttSession, OutboundMessage
from lmqtt.gateway.session.inbound import NO_TOPIC_ALIASES
from lmqtt.loadtest.conn_profile import profile

# Parked (the profile waits until they are): 1,032 bytes at 2,000 connections, with a parked
# client's session folded (its subscription and offset, not three dicts and a cursor;
# gateway/session/parked.py `fold`), a plain subscription 56 bytes, the rare fields of sessions and
# connections out of line, a queue's one reader the session itself. The margin covers the dict and set tables' growth steps, which land differently with
# the number of connections.
TRACED_BUDGET = 1_200


def test_idle_subscribed_connection_stays_within_its_memory_budget():
    r = profile(connections=2_000, warmup=200, subscribe=True, frames=1, top=10, extra_args=[])
    assert r["still_open"] == 2_000
    assert r["traced_bytes_per_conn"] <= TRACED_BUDGET, r["lines"]


def test_a_session_creates_its_inbound_id_sets_and_alias_map_only_when_used():
    s = MqttSession("c")
    assert s._in2 is None and s._in_wait is None and s._aliases is NO_ALIASES
    assert s._aliases_in is NO_TOPIC_ALIASES and s._rare is None
    assert s.publish_received(2, 7, 100) == 0       # waits for the store
    s.publish_stored(2, 7)                          # stored, PUBREL awaited
    assert s.publish_received(1, 8, 100) == 0
    assert s.inbound_ids() == ({8}, {7})
    s.connect(5, None, None, 10, 10, 100)
    it = OutboundMessage("t", b"x", RecordMeta(qos=1))
    s.publish_bytes(it, 1, False, 1)                # a client taking aliases gets a map of its own
    assert s._aliases == {"t": 1} and NO_ALIASES == {}
    assert s.resolve_alias("in/t", 3, 10) == "in/t" and s._aliases_in == {3: "in/t"}
    s.connect(5, None, None, 0, 10, 100)            # a new connection: aliases start empty both ways
    assert s._aliases is NO_ALIASES and s._aliases_in is NO_TOPIC_ALIASES
    assert NO_TOPIC_ALIASES == {}
