"""Sessions of a gateway gone for good end in every store group (docs/groups.md "The gateway",
gateway/storage/session_stubs.py): a session's record lives in its home group and its offsets in
its queues' groups; each group that holds offsets but not the record has a stub of the session,
which that group's own sweep ends - with the offsets - once the session has expired since its
gateway went away. A session taken over by another gateway has its stubs moved with it, so no
group ends the offsets of a session that lives on. Two real `lmqtt store` processes (two groups
of one), two real gateways, paho clients, a kill -9."""
from __future__ import annotations

import signal
import time

from lmqtt.gateway.storage.grouped_metadata import home_group
from lmqtt.loadtest.brokers import free_port
from lmqtt.store.client import connect
from lmqtt.store.client.groups import rendezvous
from tests.support import LmqttGateway, LmqttStore, Paho, metric, stop_all, until, wait_metric


def _offsets(store, cid: str) -> dict:
    with connect(store.address) as c:
        return c.cmd("gw_get_offsets", consumer=cid)["offsets"]


def _sessions(store) -> set[str]:
    with connect(store.address) as c:
        return {r["client_id"] for r in c.cmd("sessions", limit=10_000)["sessions"]}


def test_a_gone_gateways_sessions_end_with_their_offsets_in_every_group_and_a_moved_one_lives_on(tmp_path):
    """Gateway 1 holds two sessions with a 2 s expiry (one whose record is in each group), each
    subscribed to a topic of each group and with offsets in both, and is then killed for good;
    a third session (2 s too) was taken over by gateway 2 before. Each store's sweep ends one
    record and one stub - the two short sessions, their offsets in both groups gone, listed by
    neither store. The moved session keeps its record and its offsets in both groups after its
    expiry has passed since gateway 1's loss, and goes on receiving from both groups."""
    ports = [free_port(), free_port()]
    sweep = ("--will-grace-s", "0.5", "--session-sweep-s", "0.2")
    a = LmqttStore(str(tmp_path / "a"), (*sweep, "--metrics-port", str(ports[0])),
                   log_path=str(tmp_path / "a.log")).start()
    b = LmqttStore(str(tmp_path / "b"), (*sweep, "--metrics-port", str(ports[1])),
                   log_path=str(tmp_path / "b.log")).start()
    stores = (a, b)
    urls = [f"http://127.0.0.1:{p}/metrics" for p in ports]
    names = [a.address, b.address]
    ta, tb = (next(f"sw{k}" for k in range(10_000) if rendezvous(f"sw{k}", names) == i) for i in (0, 1))
    short = [next(f"short-{k}" for k in range(1000) if home_group(f"short-{k}", 2) == i) for i in (0, 1)]
    moved = next(f"moved-{k}" for k in range(1000) if home_group(f"moved-{k}", 2) == 0)
    g1 = LmqttGateway(f"{a.address};{b.address}", log_path=str(tmp_path / "g1.log")).start()
    g2 = LmqttGateway(f"{a.address};{b.address}", log_path=str(tmp_path / "g2.log")).start()
    clients: list[Paho] = []
    try:
        pub = Paho(g2, "sw-pub")
        clients.append(pub)
        for cid in (*short, moved):
            c = Paho(g1, cid, version=5, clean=False, expiry=2)
            clients.append(c)
            assert c.subscribe(f"{ta}/x", 1) == [1] and c.subscribe(f"{tb}/x", 1) == [1]
        for topic in (f"{ta}/x", f"{tb}/x"):
            pub.publish(topic, b"first", qos=1)
        for c in clients[1:]:
            assert sorted(m.payload for m in c.get_n(2)) == [b"first", b"first"]
        for cid in (*short, moved):                 # each session's offsets are in both groups
            assert until(lambda: all(_offsets(s, cid) for s in stores)), (cid, [_offsets(s, cid) for s in stores])
        for i, cid in enumerate(short):             # its record in its home only: the stub is not listed
            assert cid in _sessions(stores[i]) and cid not in _sessions(stores[1 - i])

        on_g2 = Paho(g2, moved, version=5, clean=False, expiry=2)   # taken over: g1 closes its connection
        clients.append(on_g2)
        assert on_g2.session_present
        rc = clients[3].disconnects.get(timeout=10)
        assert int(getattr(rc, "value", rc)) == 0x8E
        g1.stop(signal.SIGKILL)
        for c in clients[1:4]:
            c.c.loop_stop()                         # no reconnects: their gateway is gone for good
        gone_at = time.monotonic()

        for url in urls:                            # one record and one stub ended in each group
            assert wait_metric(url, "lmqtt_store_gateway_sessions_ended_total", 2, timeout=20) == 2
        for cid in short:
            assert (_offsets(a, cid), _offsets(b, cid)) == ({}, {})
            assert cid not in _sessions(a) | _sessions(b)
        # twice the expiry since g1's loss, sweeps every 0.2 s: a stub still naming g1 would be gone
        time.sleep(max(0.0, gone_at + 4.0 - time.monotonic()))
        assert [metric(url, "lmqtt_store_gateway_sessions_ended_total") for url in urls] == [2, 2]
        assert all(_offsets(s, moved) for s in stores), [_offsets(s, moved) for s in stores]
        assert moved in _sessions(a)
        assert set(m.payload for m in on_g2.drain(0.5)) <= {b"first"}   # resent if g1 had not committed yet
        for topic in (f"{ta}/x", f"{tb}/x"):
            pub.publish(topic, b"after", qos=1)
        assert [m.payload for m in on_g2.get_n(2)] == [b"after", b"after"]
    finally:
        for c in clients:
            try:
                c.disconnect()
            except Exception:  # noqa: BLE001 - their gateway may be gone
                pass
        g1.stop(signal.SIGKILL)
        stop_all([g2], b)
        a.stop()
