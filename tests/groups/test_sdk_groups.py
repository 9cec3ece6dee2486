"""The SDK over several store groups (store/client/groups.py, docs/groups.md): two real `lmqtt
store` processes, produce routed by first-level topic, the owner recorded once in the first
group, a `#` filter read from both and merged, the console tools over `;`."""
from __future__ import annotations

import json

import pytest

from lmqtt.store.client import GroupedConnection, StoreClientError, connect, split_groups
from lmqtt.store.client.groups import rendezvous
from tests.support import LmqttStore, lmqtt_cli, running


def _topics_for_each(names: list[str], prefix: str) -> list[str]:
    """One first-level topic that rendezvous hashing gives to each group, in group order."""
    out = []
    for i in range(len(names)):
        out.append(next(f"{prefix}{k}" for k in range(10_000) if rendezvous(f"{prefix}{k}", names) == i))
    return out


def test_one_group_is_the_plain_connection(two):
    a, _b = two
    c = connect(a.address)
    try:
        assert not isinstance(c, GroupedConnection)
    finally:
        c.close()


def test_group_list_parsing_names_the_mistake():
    assert split_groups("a:1,b:2;c:3") == ["a:1,b:2", "c:3"]
    with pytest.raises(ValueError, match="empty group"):
        split_groups("a:1;;c:3")
    with pytest.raises(ValueError, match="not a port number"):
        split_groups("a:1;c:x")


def test_produce_goes_to_the_owning_group_and_a_wildcard_reads_all(two):
    a, b = two
    c = connect(f"{a.address};{b.address}")
    try:
        assert isinstance(c, GroupedConnection)
        ta, tb = _topics_for_each(c.names, "route")
        p = c.producer()
        sent = []
        for i in range(20):
            for t in (ta, tb):
                p.send(f"{t}/dev/{i % 3}", b"%s-%d" % (t.encode(), i))
                sent.append((f"{t}/dev/{i % 3}", b"%s-%d" % (t.encode(), i)))
        # each first-level topic is in exactly one group, which holds all of it
        only_a = connect(a.address)
        only_b = connect(b.address)
        try:
            assert len(only_a.pull(ta, 0, 0, 100).records) == 20 and not only_a.pull(tb, 0, 0, 100).records
            assert len(only_b.pull(tb, 0, 0, 100).records) == 20 and not only_b.pull(ta, 0, 0, 100).records
        finally:
            only_a.close()
            only_b.close()
        # a filter of one first-level topic reads its group; '#' reads both, each topic in order
        one = c.filter_consumer(f"{tb}/#", start="earliest")
        assert [r.body for r in one.poll()] == [b for t, b in sent if t.startswith(tb + "/")]
        merged = c.filter_consumer("#", start="earliest")
        got = []
        for _ in range(10):
            got += merged.poll()
        mine = [(r.topic, r.body) for r in got if r.topic.split("/")[0] in (ta, tb)]
        assert sorted(mine) == sorted(sent)
        for t in (ta, tb):
            assert [x for x in mine if x[0].startswith(t + "/")] == [x for x in sent if x[0].startswith(t + "/")]
    finally:
        c.close()


def test_the_owner_is_recorded_once_and_kept_when_the_list_changes(two):
    a, b = two
    c = connect(f"{a.address};{b.address}")
    try:
        ta, tb = _topics_for_each(c.names, "kept")
        c.producer().send(f"{tb}/x", b"1")
        table = c.admin().owners()
        assert table[tb] == c.names[1]
        # a group list naming only the first group (the directory) cannot put tb's messages there
        # silently: the recorded owner is not in its list
        d = GroupedConnection(f"{a.address};{a.address}")
        with pytest.raises(StoreClientError, match="twice"):
            d.open()
        d.close()
    finally:
        c.close()
    # another client, groups named in the same order, finds the recorded owner, whatever its hash
    c2 = connect(f"{a.address};{b.address}")
    try:
        assert c2.owner(f"{tb}/y") == 1
        assert c2.owner(f"{ta}/y") == 0
        r = c2.producer().send_batch([(f"{ta}/1", b"a"), (f"{tb}/1", b"b"), (f"{ta}/2", b"c")])
        assert [x.msg_id[:16] for x in r] == [c2.groups[0].ident[:16], c2.groups[1].ident[:16],
                                               c2.groups[0].ident[:16]]
        assert c2.admin().get_by_msg_id(r[1].msg_id).body == b"b"
    finally:
        c2.close()


def test_a_merged_group_commits_in_every_group(two):
    a, b = two
    c = connect(f"{a.address};{b.address}")
    try:
        ta, tb = _topics_for_each(c.names, "commit")
        p = c.producer()
        for i in range(5):
            p.send(f"{ta}/v", b"a%d" % i)
            p.send(f"{tb}/v", b"b%d" % i)
        f = c.filter_consumer("+/v", group="merged-g", start="earliest")
        recs = []
        for _ in range(10):
            recs += [r for r in f.poll() if r.topic in (f"{ta}/v", f"{tb}/v")]
        assert len(recs) == 10
        f.commit()
        p.send(f"{ta}/v", b"a-new")
        p.send(f"{tb}/v", b"b-new")
        again = c.filter_consumer("+/v", group="merged-g")
        later = []
        for _ in range(10):
            later += [r.body for r in again.poll() if r.topic in (f"{ta}/v", f"{tb}/v")]
        assert sorted(later) == [b"a-new", b"b-new"]
    finally:
        c.close()


def test_console_tools_take_groups(two):
    a, b = two
    store = f"{a.address};{b.address}"
    c = connect(store)
    try:
        ta, tb = _topics_for_each(c.names, "tool")
    finally:
        c.close()
    for t in (ta, tb):
        r = lmqtt_cli("produce", "--store", store, "--topic", f"{t}/x", input="1\n2\n3\n")
        assert r.returncode == 0, r.stderr
    r = lmqtt_cli("consume", "--store", store, "--filter", "#", "--from", "earliest", "--timeout", "1",
                  "--format", "json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    for t in (ta, tb):
        assert [x["payload"] for x in rows if x["topic"] == f"{t}/x"] == ["1", "2", "3"]
    r = lmqtt_cli("consume", "--store", store, "--filter", tb, "--from", "earliest", "--timeout", "1")
    assert r.returncode == 0 and r.stdout.split() == ["1", "2", "3"], r.stderr
    r = lmqtt_cli("admin", "--store", store, "--format", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [g["store"] for g in doc["store_groups"]] == [a.address, b.address]
    assert doc["topic_groups"][tb] == doc["store_groups"][1]["name"]
    assert any(q["topic"] == tb for q in doc["store_groups"][1]["queues"])
    r = lmqtt_cli("admin", "--store", store)
    assert r.returncode == 0 and "STORE GROUP" in r.stdout and tb in r.stdout, r.stderr


def test_the_gateway_over_several_groups_refuses_redis_notify_naming_why():
    r = lmqtt_cli("gateway", "--store", "127.0.0.1:1;127.0.0.1:2", "--redis", "redis://127.0.0.1:1", timeout=30)
    assert r.returncode == 2
    assert "several store groups" in r.stderr and "--redis" in r.stderr, r.stderr


def test_admin_sessions_over_groups_lists_every_groups_records_naming_the_group(two):
    """Gateways spread the session records over the groups by client id: `lmqtt admin --sessions`
    lists those of every group (each row naming its group), `--session ID` finds one wherever it is."""
    a, b = two
    for store, cid in ((a, "adm-in-a"), (b, "adm-in-b")):
        c = connect(store.address)
        try:
            rec = {"client_id": cid, "protocol_version": 4, "expiry_interval": 600, "last_disconnect_ms": 1,
                   "subscriptions": [{"filter": "adm/x", "qos": 1}], "extra": {}, "v": 1}
            c.cmd("gw_put_session", client_id=cid, rec=json.dumps(rec))
        finally:
            c.close()
    both = f"{a.address};{b.address}"
    r = lmqtt_cli("admin", "--store", both, "--sessions", "--format", "json")
    assert r.returncode == 0, r.stderr
    rows = {x["client_id"]: x["store_group"] for x in json.loads(r.stdout)["sessions"]}
    assert rows["adm-in-a"] == a.address and rows["adm-in-b"] == b.address
    r = lmqtt_cli("admin", "--store", both, "--sessions")
    assert r.returncode == 0 and "store group" in r.stdout and "adm-in-b" in r.stdout, r.stdout + r.stderr
    r = lmqtt_cli("admin", "--store", both, "--session", "adm-in-b")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"session adm-in-b (store group {b.address}): MQTT 3.1.1"), r.stdout
    r = lmqtt_cli("admin", "--store", both, "--session", "adm-nowhere")
    assert r.returncode == 1 and "no persistent session 'adm-nowhere'" in r.stderr


def test_adding_a_group_keeps_every_topic_where_its_history_is(two, tmp_path):
    """A third group appended to the list: every recorded topic stays in its group (its history
    readable there, new messages following it), and new first-level topics reach the new group."""
    a, b = two
    c = connect(f"{a.address};{b.address}")
    try:
        old = [f"grow{k}" for k in range(40)]     # (2/3)^40: some would move by hash alone
        p = c.producer()
        for t in old:
            p.send(f"{t}/x", b"before")
        before = {t: c.names[c.owner(t)] for t in old}
    finally:
        c.close()
    third = LmqttStore(str(tmp_path / "c"), log_path=str(tmp_path / "c.log"))
    gen = running(third)
    next(gen)
    try:
        c3 = connect(f"{a.address};{b.address};{third.address}")
        try:
            # rendezvous over three names would move some of the old topics; their records keep them
            assert any(rendezvous(t, c3.names) == 2 for t in old)
            p = c3.producer()
            for t in old:
                p.send(f"{t}/x", b"after")
                assert c3.names[c3.owner(t)] == before[t]
            for t in old:
                assert [r.body for r in c3.pull(t, 0, 0, 10).records] == [b"before", b"after"]
            new = next(t for t in (f"fresh{k}" for k in range(10_000)) if rendezvous(t, c3.names) == 2)
            p.send(f"{new}/x", b"new")
            assert c3.owner(new) == 2
            only = connect(third.address)
            try:
                assert [r.body for r in only.pull(new, 0, 0, 10).records] == [b"new"]
                assert all(not only.pull(t, 0, 0, 10).records for t in old)
            finally:
                only.close()
            f = c3.filter_consumer("+/x", start="earliest")
            got = []
            for _ in range(10):
                got += [(r.topic.split("/")[0], r.body) for r in f.poll()]
            assert sorted(x for x in got if x[0] in old) == sorted([(t, b"before") for t in old] +
                                                                   [(t, b"after") for t in old])
        finally:
            c3.close()
    finally:
        next(gen, None)


def test_asyncio_routes_and_merges_as_the_sync_sdk(two):
    import asyncio

    from lmqtt.store.client import AsyncGroupedConnection, connect_async

    a, b = two

    async def run():
        one = await connect_async(a.address)
        assert not isinstance(one, AsyncGroupedConnection)
        await one.close()
        c = await connect_async(f"{a.address};{b.address}")
        try:
            assert isinstance(c, AsyncGroupedConnection)
            ta, tb = _topics_for_each(c.names, "aio")
            p = c.producer()
            await p.send(f"{ta}/1", b"a1")
            r = await p.send_batch([(f"{tb}/1", b"b1"), (f"{ta}/2", b"a2")])
            assert [x.msg_id[:16] for x in r] == [c.groups[1].ident[:16], c.groups[0].ident[:16]]
            async with c.auto_batch_producer(linger_ms=1) as ab:
                for i in range(10):
                    await ab.send(f"{(ta, tb)[i % 2]}/ab", b"%d" % i)
            assert ab.acknowledged == 10
            assert [x.body for x in (await c.pull(tb, 0, 0, 100)).records] == [b"b1", b"1", b"3", b"5", b"7", b"9"]
            f = await c.filter_consumer("#", group="aio-g", start="earliest")
            got = []
            for _ in range(10):
                got += [x for x in await f.poll() if x.topic.split("/")[0] in (ta, tb)]
            assert len(got) == 13
            await f.commit()
            again = await c.filter_consumer("#", group="aio-g")
            assert [x for x in await again.poll() if x.topic.split("/")[0] in (ta, tb)] == []
            assert (await c.admin().owners())[tb] == c.names[1]
        finally:
            await c.close()
    asyncio.run(run())


def test_a_claim_keeps_the_first_owner_and_refuses_what_is_not_a_first_level_topic(two):
    a, _b = two
    c = connect(a.address)
    try:
        assert c.cmd("topic_group_claim", topic="race", group="g-one") == {"group": "g-one", "claimed": True}
        assert c.cmd("topic_group_claim", topic="race", group="g-two") == {"group": "g-one", "claimed": False}
        assert c.cmd("topic_groups")["topics"]["race"] == "g-one"
        for bad in ("race/x", "+", "#", ""):
            with pytest.raises(StoreClientError, match="first-level topic"):
                c.cmd("topic_group_claim", topic=bad, group="g-one")
        with pytest.raises(StoreClientError, match="group's name"):
            c.cmd("topic_group_claim", topic="race2", group="")
    finally:
        c.close()
