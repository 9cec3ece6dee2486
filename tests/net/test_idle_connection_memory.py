"""Memory of idle MQTT connections on a real `lmqtt serve`.

The figure is what tracemalloc sees the broker keep per connection after CONNECT + SUBSCRIBE to a
topic of its own (loadtest/conn_profile.py: the same profile the bench section of BENCHMARKS.md
shows): Python objects and uvloop's transport, not the kernel's socket buffers."""
from __future__ import annotations

from lmqtt.gateway.model.session import NO_ALIASES, Session
from lmqtt.gateway.net.connection import NO_ALIASES as NO_TOPIC_ALIASES
from lmqtt.loadtest.conn_profile import profile

# Parked (the profile waits until they are): 1,032 bytes at 2,000 connections, with a parked
# client's session folded (its subscription and offset, not three dicts and a cursor;
# gateway/model/session.py `fold`), a plain subscription 56 bytes, the rare fields of sessions and
# connections out of line, a queue's one reader the session itself. The margin covers the dict and set tables' growth steps, which land differently with
# the number of connections.
TRACED_BUDGET = 1_200


def test_idle_subscribed_connection_stays_within_its_memory_budget():
    r = profile(connections=2_000, warmup=200, subscribe=True, frames=1, top=10, extra_args=[])
    assert r["still_open"] == 2_000
    assert r["traced_bytes_per_conn"] <= TRACED_BUDGET, r["lines"]


def test_a_session_creates_its_inbound_id_sets_and_alias_map_only_when_used():
    s = Session("c")
    assert s._inbound_qos2 is None and s._inbound_pending is None and s.aliases is NO_ALIASES
    s.inbound_qos2.add(7)
    s.inbound_pending.add(8)
    assert 7 in s.inbound_qos2 and 8 in s.inbound_pending
    s.version = 5
    s.set_client_limits(None, 10, 10)
    s.aliases["t"] = 1                    # a client taking aliases gets a map of its own
    assert s.aliases == {"t": 1} and NO_ALIASES == {}
    s.set_client_limits(None, 0, 10)
    assert s.aliases is NO_ALIASES
    assert NO_TOPIC_ALIASES == {}
