"""Gateway building blocks on their own: record props encoding, the notify bus, configuration."""
from __future__ import annotations

import asyncio
import threading

import pytest
from hypothesis import given, settings, strategies as st

from lmqtt.gateway.storage import record_props
from lmqtt.gateway.app.config import ConfigError, build_config, load_toml
from lmqtt.gateway.mqtt import packets as P
from lmqtt.notify import InProcessBus

text = st.text(max_size=40)


@settings(max_examples=300, deadline=None)
@given(qos=st.integers(0, 2), retain=st.booleans(), cid=text,
       pfi=st.none() | st.integers(0, 1), mei=st.none() | st.integers(0, 2**32 - 1),
       ct=st.none() | text, rt=st.none() | text, cd=st.none() | st.binary(max_size=50),
       ups=st.lists(st.tuples(text, text), max_size=4))
def test_record_props_round_trip(qos, retain, cid, pfi, mei, ct, rt, cd, ups):
    props = P.Properties(payload_format_indicator=pfi, message_expiry_interval=mei, content_type=ct,
                         response_topic=rt, correlation_data=cd, user_property=ups)
    m = record_props.decode(record_props.encode(qos, retain, cid, props))
    assert (m.qos, m.retain, m.client_id) == (qos, retain, cid)
    back = m.to_properties()
    assert (back.payload_format_indicator, back.message_expiry_interval, back.content_type,
            back.response_topic, back.correlation_data, back.user_property) == (pfi, mei, ct, rt, cd, ups)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_foreign_props_never_break_delivery(raw):
    m = record_props.safe_decode(raw)
    assert m.qos in (0, 1, 2)


def test_sdk_written_record_without_props_is_qos0():
    m = record_props.decode(b"")
    assert (m.qos, m.retain, m.client_id, m.has_app_properties()) == (0, False, "", False)


def test_notify_bus_merges_events_from_threads_within_window():
    async def run():
        loop = asyncio.get_running_loop()
        bus = InProcessBus(loop, window_s=0.05)
        got: list[set[str]] = []
        bus.subscribe(got.append)
        ths = [threading.Thread(target=lambda k=k: [bus.publish({f"q{k}", "hot"}) for _ in range(100)])
               for k in range(4)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        await asyncio.sleep(0.2)
        bus.publish({"later"})
        await asyncio.sleep(0.2)
        bus.close()
        return got, bus

    got, bus = asyncio.run(run())
    assert got[0] == {"q0", "q1", "q2", "q3", "hot"}     # 400 events, one delivery
    assert got[1] == {"later"}
    assert len(got) == 2
    assert bus.events_in == 401


def test_notify_bus_subscriber_error_does_not_stop_others():
    async def run():
        bus = InProcessBus(asyncio.get_running_loop(), window_s=0)
        got = []

        def bad(names):
            raise RuntimeError("boom")
        bus.subscribe(bad)
        bus.subscribe(got.append)
        bus.publish({"a"})
        await asyncio.sleep(0.05)
        return got

    assert asyncio.run(run()) == [{"a"}]


def test_config_precedence_and_validation(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('port = 2000\n[serve]\nflush-mode = "sync"\nmax_inflight = 10\n')
    cfg = build_config(load_toml(f), {"port": 3000})
    assert (cfg.port, cfg.flush_mode, cfg.max_inflight, cfg.host) == (3000, "sync", 10, "127.0.0.1")
    with pytest.raises(ConfigError, match="max_inflight"):
        build_config({"max_inflight": 0})
    with pytest.raises(ConfigError, match="port must be an integer"):
        build_config({"port": "eighty"})
