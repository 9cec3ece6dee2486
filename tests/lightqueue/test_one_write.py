"""One metadata write for a SUBSCRIBE's writes (a reconnect storm): `MetadataStore.one_write` groups the
filter references, session records and offsets written inside it in one RocksDB write at its end;
on `lmqtt serve` a new persistent session's SUBSCRIBE (filter reference + epoch, record, offsets:
three writes before) is one write, made before its SUBACK leaves; a failure of that write drops the
connection before its SUBACK."""
from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from lmqtt.gateway.app.config import build_config
from lmqtt.gateway.app.gateway import Gateway
from lmqtt.gateway.mqtt import encode, packets as P
from lmqtt.gateway.net.connection import MQTTConnection
from lmqtt.lightqueue import MetadataStore, SessionRecord, Subscription
from lmqtt.lightqueue.errors import MetadataError
from tests.fakes import FakeTransport
from tests.lightqueue.test_filter_register_write import _Counting


def test_the_writes_inside_one_write_are_one_and_all_land(tmp_path):
    md = MetadataStore(str(tmp_path / "md"))
    real, md._db = md._db, _Counting(md._db)
    rec = SessionRecord("c1", 4, 0xFFFFFFFF, None, [Subscription("a/+", 1)])
    with md.one_write():
        md.put_filter_ref("a/+", 1, (5, 7))
        md.put_session("c1", rec)
        md.set_offsets("c1", {"a/+": 3})
        with md.one_write():                       # nested: the outer one writes
            md.set_offsets("c2", {"x": 1, "y": 2})
        assert md._db.writes == 0
        assert md.get_session("c1") is None        # not written yet: nothing inside reads them back
        md.set_recovery_checked(9)                 # any other write goes at once
        assert md._db.writes == 1
    assert md._db.writes == 2
    assert md.get_session("c1") == rec
    assert md.get_offsets("c1") == {"a/+": 3} and md.get_offsets("c2") == {"x": 1, "y": 2}
    assert md.filters()["a/+"] == 1 and md.get_filter_epoch("a/+") == (5, 7)
    md._db = real
    md.close()


def test_another_threads_writes_go_at_once_and_an_exception_still_writes(tmp_path):
    md = MetadataStore(str(tmp_path / "md"))
    real, md._db = md._db, _Counting(md._db)
    with pytest.raises(RuntimeError):
        with md.one_write():
            md.set_offsets("c1", {"a": 1})
            t = threading.Thread(target=md.set_offsets, args=("c2", {"b": 2}))
            t.start()
            t.join()
            assert md._db.writes == 1 and md.get_offsets("c2") == {"b": 2}
            raise RuntimeError("a packet refused half way")
    assert md._db.writes == 2 and md.get_offsets("c1") == {"a": 1}
    with pytest.raises(MetadataError):
        with md.one_write():
            md.set_offsets("c3", {"a": 1})
            md._closed = True                     # the write at its end fails: said there
    md._closed = False
    assert md._group_tid is None and md.get_offsets("c3") == {}
    md._db = real
    md.close()


class _Client:
    def __init__(self, gw: Gateway) -> None:
        self.conn = MQTTConnection(gw.broker)
        self.tr = FakeTransport(self.conn)
        self.conn.connection_made(self.tr)


async def _gateway(tmp_path) -> Gateway:
    cfg = build_config({}, {"host": "127.0.0.1", "port": 0, "metrics_port": 0, "data_dir": str(tmp_path / "data")})
    gw = Gateway(cfg)
    await gw.start()
    return gw


def test_a_new_sessions_subscribe_is_one_metadata_write_before_its_suback(tmp_path):
    async def main() -> None:
        gw = await _gateway(tmp_path)
        md = gw.lq.metadata
        real, md._db = md._db, _Counting(md._db)
        try:
            c = _Client(gw)
            c.conn.data_received(encode(P.Connect(client_id="one-w", protocol_level=4, clean_start=False), 4))
            await asyncio.sleep(0)
            assert c.tr.take()[:1] == b"\x20"
            before = md._db.writes
            c.conn.data_received(encode(P.Subscribe(1, [P.SubscriptionRequest("ow/1/+", qos=1)]), 4))
            assert md._db.writes - before == 1          # filter reference + epoch, record, offsets
            await asyncio.sleep(0)
            assert c.tr.take()[:1] == b"\x90"            # the SUBACK, after it
            rec = md.get_session("one-w")
            assert [s.filter for s in rec.subscriptions] == ["ow/1/+"]
            assert md.get_offsets("one-w") == {"ow/1/+": 0} and md.filters()["ow/1/+"] == 1
        finally:
            md._db = real
            await gw.stop()
    asyncio.run(main())


def test_a_failed_subscribe_write_drops_the_connection_before_its_suback(tmp_path, caplog):
    class _Failing(_Counting):
        def write(self, *a, **kw):
            raise OSError("No space left on device")

    async def main() -> None:
        gw = await _gateway(tmp_path)
        md = gw.lq.metadata
        real = md._db
        try:
            c = _Client(gw)
            c.conn.data_received(encode(P.Connect(client_id="one-f", protocol_level=4, clean_start=False), 4))
            await asyncio.sleep(0)
            assert c.tr.take()[:1] == b"\x20"
            md._db = _Failing(real)
            with caplog.at_level(logging.ERROR, logger="lmqtt.gateway"):
                c.conn.data_received(encode(P.Subscribe(1, [P.SubscriptionRequest("of/1/+", qos=1)]), 4))
                await asyncio.sleep(0)
            assert c.tr.aborted and c.tr.take() == b""   # no SUBACK
            assert any("event=subscribe_write_failed client_id=one-f" in r.getMessage()
                       and "No space left on device" in r.getMessage() for r in caplog.records), caplog.text
        finally:
            md._db = real
            await gw.stop()
    asyncio.run(main())


def test_a_release_inside_the_group_follows_its_register(tmp_path):
    """A SUBSCRIBE refused after its filter was registered in the group (ACL, quota) lets go of the
    reference: the release is written after the register, never overwritten by it."""
    from lmqtt.lightqueue.registry import FilterRegistry
    md = MetadataStore(str(tmp_path / "md"))
    reg = FilterRegistry(md)
    with md.one_write():
        assert reg.register("r/+", lambda: (1, 2)) == 1
        assert reg.unregister("r/+") == 0
        md.delete_filter_epoch("r/+")
    assert "r/+" not in md.filters() and md.get_filter_epoch("r/+") is None
    md.close()
    md = MetadataStore(str(tmp_path / "md"))
    assert "r/+" not in md.filters()
    md.close()
