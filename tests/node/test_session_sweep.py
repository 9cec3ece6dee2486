"""The store node's session sweep (store/node/session_sweep.py) over a real MetadataStore on a
real event loop: it ends the expired sessions of gateways gone for good, gives a session that was
connected when its gateway went away that moment as its disconnect time, and leaves alone the
sessions of connected gateways, of gateways away for less than the grace period and of no gateway."""
from __future__ import annotations

import asyncio
import time

from lmqtt.lightqueue import MetadataStore, SessionRecord, Subscription
from lmqtt.lightqueue.records import HOST, NEVER_EXPIRES
from lmqtt.store.node.session_sweep import SessionSweep


def _rec(cid: str, host: str | None, expiry: int, last_ms: int | None) -> SessionRecord:
    return SessionRecord(cid, 5, expiry, last_ms, [Subscription(f"t/{cid}", qos=1)], {HOST: host} if host else {})


def test_the_sweep_ends_only_expired_sessions_of_gateways_gone_longer_than_the_grace(tmp_path):
    md = MetadataStore(str(tmp_path / "meta"))
    now = int(time.time() * 1000)
    hour_ago = now - 3_600_000
    recs = [
        _rec("a-expired", "gw-gone", 60, hour_ago),            # ended
        _rec("a-fresh", "gw-gone", 60, now - 1000),             # expires later: kept
        _rec("a-never", "gw-gone", NEVER_EXPIRES, hour_ago),    # kept
        _rec("a-online", "gw-gone", 3600, None),                # connected at the loss: marked
        _rec("b-expired", "gw-live", 60, hour_ago),             # its gateway expires it: kept
        _rec("c-expired", "gw-new-away", 60, hour_ago),         # away for less than the grace: kept
        _rec("d-expired", None, 60, hour_ago),                  # no gateway: the gateways' own
    ]
    for r in recs:
        md.put_session(r.client_id, r)
        md.set_offsets(r.client_id, {f"t/{r.client_id}": 7})
    gone_at = now - 600_000

    async def go() -> SessionSweep:
        sweep = SessionSweep(md, asyncio.get_running_loop(), lambda gid: gid == "gw-live",
                             grace_s=30, interval_s=0.05)
        sweep.PAGE = 2                      # several pages, continued on the loop
        sweep.away_since["gw-gone"] = gone_at
        sweep.gone("gw-new-away")           # just now
        sweep.start()
        deadline = time.monotonic() + 10
        while sweep.ended < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)            # a few more sweeps: nothing else changes
        sweep.close()
        return sweep

    sweep = asyncio.run(go())
    left = {r.client_id: r for r in md.list_sessions()}
    assert sorted(left) == ["a-fresh", "a-never", "a-online", "b-expired", "c-expired", "d-expired"]
    assert sweep.ended == 1 and sweep.marked_offline == 1
    assert md.get_offsets("a-expired") == {}                      # its offsets went with it
    assert md.get_offsets("a-fresh") == {"t/a-fresh": 7}
    assert left["a-online"].last_disconnect_ms == gone_at        # its expiry counts from the loss
    assert left["a-online"].subscriptions == recs[3].subscriptions and left["a-online"].host == "gw-gone"
    assert left["b-expired"] == recs[4] and left["d-expired"] == recs[6]
    # what gw-gone is told if it was only cut off (its gw_hello answer), once
    assert sweep.take_swept("gw-gone") == ["a-expired", "a-online"]
    assert sweep.take_swept("gw-gone") == [] and sweep.take_swept("gw-live") == []
    md.close()


def test_a_gateway_back_before_the_grace_keeps_its_sessions(tmp_path):
    """A gateway that reconnects (a restart) is not gone: its connected-at-loss sessions keep no
    disconnect time, its own restore and expiry decide."""
    md = MetadataStore(str(tmp_path / "meta"))
    md.put_session("s", _rec("s", "gw", 1, None))
    connected = {"gw": False}

    async def go() -> None:
        sweep = SessionSweep(md, asyncio.get_running_loop(), lambda gid: connected[gid],
                             grace_s=0.3, interval_s=0.05)
        sweep.gone("gw")
        sweep.start()
        await asyncio.sleep(0.1)
        connected["gw"] = True
        sweep.back("gw")
        await asyncio.sleep(0.6)
        sweep.close()

    asyncio.run(go())
    assert md.get_session("s").last_disconnect_ms is None
    md.close()


def test_lmqtt_store_checks_the_sweep_interval(tmp_path, capsys):
    """`lmqtt store --session-sweep-s` / TOML `session_sweep_s`: out of range or not a number is
    refused before anything starts, naming the setting."""
    from lmqtt.store.node import command as store_serve
    assert store_serve.main(["--data-dir", str(tmp_path / "d"), "--session-sweep-s", "0"]) == 2
    assert "session_sweep_s must be 0.1..86400 seconds, got 0" in capsys.readouterr().err
    cfg = tmp_path / "store.toml"
    cfg.write_text('[store]\nsession_sweep_s = "often"\n')
    assert store_serve.main(["--data-dir", str(tmp_path / "d"), "--config", str(cfg)]) == 2
    assert "session_sweep_s must be a number of seconds, got 'often'" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_records_of_some_gateways_are_found_a_page_at_a_time_without_decoding_the_others(tmp_path):
    """`sessions_of_gateways`: the records naming one of the gateways, over pages that count the
    records looked at (a page may hold none), in client id order; ids that need JSON escaping too."""
    md = MetadataStore(str(tmp_path / "meta"))
    hosts = ["gw-a", None, 'gw "b"', "gw-a", "gw-c", 'gw "b"', None, "gw-a"]
    for i, h in enumerate(hosts):
        md.put_session(f"c{i}", _rec(f"c{i}", h, 60, 1))
    md.put_session("d-filter", SessionRecord("d-filter", 5, 60, 1, [Subscription('x/"gateway":"gw-a"')]))

    def walk(gateways, page, unhosted=False):
        got, after = [], None
        while True:
            recs, after = md.sessions_of_gateways(gateways, after, page, unhosted)
            got += [r.client_id for r in recs]
            if after is None:
                return got
    # no host, but in-flight state naming a queue `gateway`: still a record of no gateway
    md.put_session("e-inflight", SessionRecord("e-inflight", 5, 60, 1, [Subscription("gateway")],
                                               {"inflight": {"out": [], "next": {"gateway": 3}, "in2": [], "pid": 1}}))
    for page in (1, 3, 100):
        assert walk({"gw-a", 'gw "b"'}, page) == ["c0", "c2", "c3", "c5", "c7"]
        assert walk(None, page) == ["c0", "c2", "c3", "c4", "c5", "c7"]
        assert walk(set(), page) == []
        # a restarting gateway's restore: its own and those of no gateway
        assert walk(["gw-a"], page, unhosted=True) == ["c0", "c1", "c3", "c6", "c7", "d-filter", "e-inflight"]
    md.close()


def test_the_hosts_of_records_are_read_from_their_bytes(tmp_path):
    """`session_hosts`: each record's host without decoding it, also when its in-flight state
    names a queue `gateway` and when the host needs JSON escaping; pages of any size."""
    md = MetadataStore(str(tmp_path / "meta"))
    inflight = {"inflight": {"out": [[1, "gateway", 0, 1, False, 0, None]], "next": {"gateway": 1},
                             "in2": [], "pid": 2}}
    recs = [SessionRecord("h0", 5, 60, 1, [Subscription("gateway")], dict(inflight)),            # none
            SessionRecord("h1", 5, 60, 1, [Subscription("gateway")], {**inflight, HOST: "gw-1"}),
            SessionRecord("h2", 5, 60, None, [], {HOST: 'gw "2" \\ é'}),
            _rec("h3", "gw-3", 60, 1)]
    for r in recs:
        md.put_session(r.client_id, r)
    want = [(r.client_id, r.host) for r in recs]
    assert want == [("h0", None), ("h1", "gw-1"), ("h2", 'gw "2" \\ é'), ("h3", "gw-3")]
    for page in (1, 2, 10):
        got, after = [], None
        while True:
            part, after = md.session_hosts(after, page)
            got += part
            if after is None:
                break
        assert got == want
    md.close()


def test_a_sweep_reads_nothing_while_every_gateway_with_sessions_is_connected(tmp_path):
    """After the first sweep has seen which gateways have sessions, later sweeps while they are all
    connected read no record; an away gateway whose sessions all ended is forgotten, so sweeps
    stop reading again."""
    md = MetadataStore(str(tmp_path / "meta"))
    now = int(time.time() * 1000)
    md.put_session("live", _rec("live", "gw-live", 60, now - 3_600_000))
    md.put_session("gone", _rec("gone", "gw-gone", 1, now - 3_600_000))

    async def go() -> SessionSweep:
        sweep = SessionSweep(md, asyncio.get_running_loop(), lambda gid: gid == "gw-live",
                             grace_s=0, interval_s=0.05)
        sweep.start()
        await asyncio.sleep(0.6)            # ~10 intervals
        sweep.close()
        return sweep

    sweep = asyncio.run(go())
    assert sweep.ended == 1 and [r.client_id for r in md.list_sessions()] == ["live"]
    assert sweep.sweeps == 2                # the first (every host), the one that found none left of gw-gone
    assert sweep.away_since == {}
    md.close()


def test_a_stub_is_never_listed_never_replaces_a_record_and_is_swept_with_its_offsets(tmp_path):
    """A session's stub (a group holding its offsets, not its record: lightqueue/records.py `STUB`)
    is hidden from every reader of sessions, is not written over a record the group holds, is
    replaced by a record, and is ended by the sweep with the offsets beside it once its session
    has expired since its gateway went away - that moment counting as its disconnect."""
    md = MetadataStore(str(tmp_path / "meta"))
    md.put_session("only-stub", SessionRecord.stub("only-stub", 5, 60, "gw-gone"))
    md.set_offsets("only-stub", {"t/x": 3})
    md.put_session("real", _rec("real", "gw-gone", NEVER_EXPIRES, None))
    assert md.put_session("real", SessionRecord.stub("real", 5, 60, "gw-other")) is False
    md.put_sessions([("real", SessionRecord.stub("real", 5, 60, "gw-other"))])
    md.put_session("replaced", SessionRecord.stub("replaced", 5, 60, "gw-gone"))
    md.put_session("replaced", _rec("replaced", "gw-gone", NEVER_EXPIRES, None))
    assert md.get_session("real").subscriptions and md.get_session("real").host == "gw-gone"
    assert md.get_session("only-stub") is None and md.get_session("only-stub", stubs=True).is_stub
    assert [r.client_id for r in md.list_sessions()] == ["real", "replaced"]
    assert [r.client_id for r, _o in md.sessions_with_offsets("gw-gone")] == ["real", "replaced"]
    assert [r.client_id for r in md.sessions_of_gateways(["gw-gone"], stubs=True)[0]] == ["only-stub", "real", "replaced"]
    gone_at = int(time.time() * 1000) - 120_000          # two minutes ago: past the stub's 60 s

    async def go() -> SessionSweep:
        sweep = SessionSweep(md, asyncio.get_running_loop(), lambda gid: False, grace_s=30, interval_s=0.05)
        sweep.away_since["gw-gone"] = gone_at
        sweep.start()
        deadline = time.monotonic() + 10
        while sweep.ended < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        sweep.close()
        return sweep

    sweep = asyncio.run(go())
    assert sweep.ended == 1 and md.get_session("only-stub", stubs=True) is None
    assert md.get_offsets("only-stub") == {}
    assert sorted(r.client_id for r in md.list_sessions()) == ["real", "replaced"]
    md.close()
