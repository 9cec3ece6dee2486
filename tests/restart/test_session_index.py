"""The store's session records indexed by the gateway they name
(lightqueue/metadata.py `h` keys), so a fleet gateway's restore reads its own records, not the
whole fleet's. Real RocksDB; the last test real processes (a store and a gateway) on a data dir
written before the index existed (its `h` keys and marker taken out)."""
from __future__ import annotations

import logging
import re
import time

from rocksdict import Options, Rdict

from lmqtt.lightqueue.metadata import K_SESSION_INDEX, P_SESSION_BY_HOST, MetadataStore
from lmqtt.lightqueue.records import HOST, NEVER_EXPIRES, SessionRecord, Subscription
from tests.support import LmqttGateway, LmqttStore, Paho, listening, metric, stop_all


def _rec(cid: str, host: str | None) -> SessionRecord:
    flt = f"ix/{cid}/+"
    extra = {"inflight": {"out": [], "next": {flt: 0}, "in2": [], "pid": 1}}
    if host is not None:
        extra[HOST] = host
    return SessionRecord(cid, 5, NEVER_EXPIRES, int(time.time() * 1000), [Subscription(flt, 1)], extra)


def _strip_index(path: str) -> int:
    """Make `path` a metadata dir of a version before the index: its `h` keys and marker deleted."""
    db = Rdict(path, Options(raw_mode=True))
    try:
        keys = [k for k in db.keys() if k[:1] == P_SESSION_BY_HOST or k == K_SESSION_INDEX]
        for k in keys:
            del db[k]
        return len(keys)
    finally:
        db.close()


def _all_of(md: MetadataStore, gateways, limit: int) -> tuple[list[str], int]:
    """Every client id `sessions_of_gateways` pages through (own + unhosted), and the pages taken."""
    got, after, pages = [], None, 0
    while True:
        recs, after = md.sessions_of_gateways(gateways, after, limit, unhosted=True)
        got += [r.client_id for r in recs]
        pages += 1
        if after is None:
            return got, pages


def test_a_page_of_a_gateways_sessions_holds_only_its_own_whatever_the_others(tmp_path):
    """1,000 records of gateway B sort before A's 3 and an unhosted one: a page of 10 for A holds
    A's and the unhosted one at once (before the index a page was the next 10 records of any
    gateway: 101 pages of reading B's records to find A's). A record moved from B to A without
    saying so leaves B's entry, which B's listing drops; a deleted record leaves nothing."""
    md = MetadataStore(str(tmp_path / "meta"))
    try:
        for i in range(1000):
            md.put_session(f"a-{i:04d}", _rec(f"a-{i:04d}", "gw-b"))
        for cid in ("z-1", "z-2", "z-3"):
            md.put_session(cid, _rec(cid, "gw-a"))
        md.put_session("y-none", _rec("y-none", None))
        recs, after = md.sessions_of_gateways(["gw-a"], None, 10, unhosted=True)
        assert ([r.client_id for r in recs], after) == (["y-none", "z-1", "z-2", "z-3"], None)
        assert _all_of(md, ["gw-a"], 2) == (["y-none", "z-1", "z-2", "z-3"], 2)
        assert [r.client_id for r in md.sessions_of_gateways(["gw-a"], "z-1", 10)[0]] == ["z-2", "z-3"]

        md.put_session("a-0007", _rec("a-0007", "gw-a"))         # moved, the old host not said
        assert "a-0007" not in _all_of(md, ["gw-b"], 400)[0]
        assert "a-0007" in _all_of(md, ["gw-a"], 400)[0]
        assert md._db.get(P_SESSION_BY_HOST + b"gw-b\x00a-0007") is None      # the stale entry dropped
        md.put_session("a-0008", _rec("a-0008", "gw-a"), before="gw-b")     # moved, said: dropped at once
        assert md._db.get(P_SESSION_BY_HOST + b"gw-b\x00a-0008") is None
        assert md.delete_session("z-2")
        assert md._db.get(P_SESSION_BY_HOST + b"gw-a\x00z-2") is None
        assert [r.client_id for r, _ in md.sessions_with_offsets("gw-a")] == ["a-0007", "a-0008", "y-none",
                                                                               "z-1", "z-3"]
        assert len(md.sessions_of_gateways(None, None, 2000)[0]) == 1002      # any gateway: not y-none
    finally:
        md.close()


def test_a_metadata_dir_written_before_the_index_gets_it_on_open(tmp_path, caplog):
    path = str(tmp_path / "meta")
    md = MetadataStore(path)
    for i in range(50):
        md.put_session(f"b-{i:02d}", _rec(f"b-{i:02d}", "gw-b"))
    md.put_session("own", _rec("own", "gw-a"))
    md.close()
    assert _strip_index(path) == 52
    with caplog.at_level(logging.INFO, logger="lmqtt.lightqueue.metadata"):
        md = MetadataStore(path)
    try:
        assert [r for r in caplog.messages if "event=session_index_built records=51" in r], caplog.messages
        assert _all_of(md, ["gw-a"], 10) == (["own"], 1)
        assert len(_all_of(md, ["gw-b"], 10)[0]) == 50
    finally:
        md.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lmqtt.lightqueue.metadata"):
        MetadataStore(path).close()                                 # built once: not again
    assert not [r for r in caplog.messages if "session_index_built" in r]


def test_a_store_on_a_data_dir_from_before_the_index_restores_each_gateway_its_own(tmp_path):
    """A store and gateway A (real processes); A's 3 sessions over MQTT; both stopped; 300
    records of a gone gateway and one of no gateway written into the store's metadata, and the
    index taken out (a data dir of the version before). The store started again builds the
    index (says so once); A restarted restores its 3 and the unhosted one, nothing else; a client
    of the gone gateway still resumes its session on A."""
    store = LmqttStore(str(tmp_path / "store"), log_path=str(tmp_path / "store.log")).start()
    a = LmqttGateway(store.address, log_dir=str(tmp_path)).start()
    try:
        for i in range(3):
            c = Paho(a, f"own-{i}", version=5, clean=False, expiry=3600)
            c.subscribe(f"own/{i}/#", 1)
            c.disconnect()
        a.stop()
        store.stop()
        meta = str(tmp_path / "store" / "lightqueue" / "meta")
        md = MetadataStore(meta)
        try:
            for i in range(300):
                md.put_session(f"fx-{i:03d}", _rec(f"fx-{i:03d}", "gone-gw"))
            md.put_session("nobody", _rec("nobody", None))
        finally:
            md.close()
        assert _strip_index(meta) >= 305
        store.start()
        a.start(timeout=60)
        listening(a.host, a.metrics_port, 30)
        assert re.search(r"event=session_index_built records=304 ", store.log_tail(200000)), store.log_tail()
        assert metric(a.metrics_url, "lmqtt_sessions") == 4, a.log_tail()
        started = re.findall(r"event=broker_started restored_sessions=(\d+)", a.log_tail(200000))
        assert started[-1] == "4", a.log_tail()
        moved = Paho(a, "fx-123", version=5, clean=False, expiry=3600)
        assert moved.session_present
        own = Paho(a, "own-1", version=5, clean=False, expiry=3600)
        assert own.session_present
        for c in (moved, own):
            c.disconnect()
    finally:
        stop_all([a], store)
