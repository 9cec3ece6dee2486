"""The store side of the remote gateway seam (lightqueue/gateway_service.py) on a real `lmqtt
store`, through the sync SDK connection: wildcard filters held per gateway id (indexed while any
gateway holds them, holds surviving a store restart), and gw_pull's dispatch queues."""
from __future__ import annotations

import time

from lmqtt.store.client import connect


def _max(c, q: str) -> int:
    return c.cmd("gw_max_offsets", queues=[q])["max_offsets"][q]


def _until_max(c, q: str, want: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while (got := _max(c, q)) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


def test_filter_holds_per_gateway_survive_a_restart_and_release_last(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        p = c.producer()
        assert c.cmd("gw_register", gateway="gw1", filter="h/+")["count"] == 1
        assert c.cmd("gw_register", gateway="gw1", filter="h/+")["count"] == 2
        assert c.cmd("gw_register", gateway="gw2", filter="h/+")["count"] == 1
        p.send("h/x", b"1")
        assert _until_max(c, "h/+", 1) == 1
        assert c.cmd("gw_unregister", gateway="gw1", filter="h/+")["count"] == 1
        assert c.cmd("gw_unregister", gateway="gw1", filter="h/+")["count"] == 0
        p.send("h/x", b"2")                                  # gw2 still holds it: still indexed
        assert _until_max(c, "h/+", 2) == 2
        header, recs = c.cmd("gw_pull", queue="h/+", offset=0, max_count=10)
        assert [r[8] for r in recs] == [b"1", b"2"]
        assert all(set(dq) == {"h/x", "h/+"} for dq in header["dq"])
    lmqtt_store.restart()
    with connect(lmqtt_store.address) as c:
        assert c.cmd("gw_filters", gateway="gw2")["filters"] == {"h/+": 1}
        assert c.cmd("gw_filters", gateway="gw1")["filters"] == {}
        c.producer().send("h/y", b"3")
        assert _until_max(c, "h/+", 3) == 3                   # the hold came back with the store
        assert c.cmd("gw_unregister", gateway="gw2", filter="h/+")["count"] == 0
        assert c.cmd("gw_filters", gateway="gw2")["filters"] == {}


def test_metadata_commands_round_trip(lmqtt_store):
    import base64

    from lmqtt.lightqueue.records import SessionRecord, Subscription, WillRecord
    with connect(lmqtt_store.address) as c:
        rec = SessionRecord("cid", 5, 60, None, [Subscription("a/#", 1)])
        c.cmd("gw_put_session", client_id="cid", rec=rec.to_bytes().decode())
        assert SessionRecord.from_bytes(c.cmd("gw_get_session", client_id="cid")["rec"].encode()) == rec
        c.cmd("gw_set_offsets", consumer="cid", offsets={"a/#": 7})
        assert c.cmd("gw_get_offsets", consumer="cid")["offsets"] == {"a/#": 7}
        c.cmd("gw_set_retained", topic="r/1", payload=base64.b64encode(b"\x00\xff").decode(), props="")
        assert c.cmd("gw_retained_matching", filter="r/#")["retained"] == [["r/1", "AP8=", ""]]
        w = WillRecord("w/t", b"bye", 1, False, b"", 0, 1)
        c.cmd("gw_put_will", client_id="cid", will=base64.b64encode(w.to_bytes()).decode())
        [[cid, raw]] = c.cmd("gw_list_wills")["wills"]
        assert cid == "cid" and WillRecord.from_bytes(base64.b64decode(raw)) == w
        assert c.cmd("gw_pop_will", client_id="cid")["will"] is not None
        assert c.cmd("gw_list_wills")["wills"] == []
        assert c.cmd("gw_delete_session", client_id="cid")["deleted"] is True
        assert c.cmd("gw_get_session", client_id="cid")["rec"] is None
