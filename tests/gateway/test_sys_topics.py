"""`$SYS/broker/...` values (gateway/broker/sys_topics.py): Mosquitto's names, only changes published,
Mosquitto's damped per-minute load averages."""
import math

from lmqtt.gateway.broker.sys_topics import PREFIX, SysTopics


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _make(raw):
    clock, sent = Clock(), []
    sys_ = SysTopics(lambda: dict(raw), lambda t, p: sent.append((t, p.decode())), version="1.2.3",
                     clock=clock)
    return sys_, clock, sent


def test_first_tick_publishes_every_value_under_mosquitto_names():
    raw = {"connected": 3, "disconnected": 2, "messages_received": 10, "messages_sent": 7,
           "publish_received": 10, "publish_sent": 7, "publish_dropped": 1, "bytes_received": 500,
           "bytes_sent": 300, "subscriptions": 4, "retained": 5, "connects": 6}
    s, clock, sent = _make(raw)
    clock.t += 12
    s.tick()
    got = dict(sent)
    assert got[PREFIX + "version"] == "lmqtt version 1.2.3"
    assert got[PREFIX + "uptime"] == "12 seconds"
    assert got[PREFIX + "clients/connected"] == "3"
    assert got[PREFIX + "clients/disconnected"] == "2"
    assert got[PREFIX + "clients/total"] == "5"
    assert got[PREFIX + "clients/maximum"] == "3"
    assert got[PREFIX + "messages/received"] == "10" and got[PREFIX + "publish/messages/sent"] == "7"
    assert got[PREFIX + "bytes/received"] == "500" and got[PREFIX + "publish/messages/dropped"] == "1"
    assert got[PREFIX + "subscriptions/count"] == "4"
    assert got[PREFIX + "retained messages/count"] == "5"
    assert all(t.startswith("$SYS/broker/") for t in got)


def test_only_changed_values_are_published_and_maximum_is_kept():
    raw = {"connected": 3, "messages_received": 10}
    s, clock, sent = _make(raw)
    s.tick()
    sent.clear()
    clock.t += 10
    s.tick()                                 # nothing moved but the uptime (and the first loads)
    assert PREFIX + "uptime" in dict(sent) and PREFIX + "clients/connected" not in dict(sent)
    sent.clear()
    raw["connected"] = 1
    clock.t += 10
    s.tick()
    got = dict(sent)
    assert got[PREFIX + "clients/connected"] == "1"
    assert PREFIX + "clients/maximum" not in got            # still 3: unchanged, not re-sent
    assert s.values()[PREFIX + "clients/maximum"] == "3"


def test_load_averages_are_damped_per_minute_rates():
    raw = {"messages_received": 0}
    s, clock, sent = _make(raw)
    s.tick()
    raw["messages_received"] = 600                           # 600 in one minute
    clock.t += 60
    s.tick()
    got = dict(sent)
    assert got[PREFIX + "load/messages/received/1min"] == "600.00"
    sent.clear()
    clock.t += 60                                            # a quiet minute
    s.tick()
    got = dict(sent)
    assert float(got[PREFIX + "load/messages/received/1min"]) == round(600 * math.exp(-1), 2)
    assert float(got[PREFIX + "load/messages/received/15min"]) == round(600 * math.exp(-60 / 900), 2)


def test_sys_filters_are_those_whose_first_level_is_sys():
    """The retained lookup answers these from the gateway's memory (SysRetained), the others from
    the store: a filter that can match a topic anyone else may publish must not be one."""
    from lmqtt.gateway.delivery.retained import is_sys_filter
    assert all(is_sys_filter(f) for f in ("$SYS", "$SYS/#", "$SYS/broker/+", "$SYS/broker/uptime"))
    assert not any(is_sys_filter(f) for f in ("#", "+/broker/uptime", "$SYSX/#", "$SYSTEM",
                                              "a/$SYS", "$sys/#"))


def test_the_delivery_engine_knows_its_sys_queues_as_readers_and_groups_come_and_go():
    """A `$SYS` value goes to the queues of `$SYS` filters only (SysRetained.publish), which the
    engine keeps as readers and shared groups are added and removed: a tick does not walk every
    device's filter, and nothing stays behind once the last reader of a queue is gone."""
    from types import SimpleNamespace

    from lmqtt.gateway.app.config import GatewayConfig
    from lmqtt.gateway.delivery.engine import DeliveryEngine

    d = DeliveryEngine(None, None, None, GatewayConfig(), session_offsets_moved=lambda s: None,
                       group_offsets_moved=lambda g: None, flush_writes=lambda: None)
    a, b = object(), object()
    for q in ("$SYS/#", "$SYS", "dev/1/cmd", "$SYSTEM/x", "+/broker/uptime"):
        d.add_reader(a, q)
    d.add_reader(b, "$SYS/#")
    g = SimpleNamespace(name="g", queue="$SYS/broker/uptime")
    d.add_group(g)
    assert d.sys_queues == {"$SYS/#", "$SYS", "$SYS/broker/uptime"}
    d.remove_reader(a, "$SYS/#")
    assert "$SYS/#" in d.sys_queues                  # b still reads it
    d.remove_reader(b, "$SYS/#")
    d.remove_reader(a, "$SYS")
    assert d.sys_queues == {"$SYS/broker/uptime"}
    d.add_reader(a, "$SYS/broker/uptime")            # a direct reader beside the group
    d.remove_group(g)
    assert d.sys_queues == {"$SYS/broker/uptime"}
    d.remove_reader(a, "$SYS/broker/uptime")
    assert d.sys_queues == set()
